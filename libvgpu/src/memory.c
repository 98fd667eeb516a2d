/*
 * memory.c: the container's memory counters and this process's allocation table.
 *
 * Every allocation hook (alloc.c, pools.c, context.c) reserves its bytes here first
 * (check-and-reserve under the region lock; over the limit -> CUDA_ERROR_OUT_OF_MEMORY and
 * the driver is not called), calls the driver, rolls the reservation back if the driver
 * failed, and remembers handle -> (size, GPU, context) in a process-local open-addressing
 * table so the free releases exactly what was counted. Sizes the driver decides (pitch,
 * arrays, contexts, modules) are reserved as an estimate first and corrected afterwards; a
 * correction over the limit undoes the call. The table is a static array, grown with mmap
 * when it fills up: no malloc on these paths.
 */
#define _GNU_SOURCE
#include <sched.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "memory.h"

/* The table starts small (16 slots, 512 bytes) and doubles as it fills (at 70 %): an
 * allocation's slot is a hash of its address, so a table much larger than what it holds puts
 * each new allocation in a cache line (and page) that no recent one touched, a cache miss on
 * every allocation once the driver's own work has evicted the table (with 4096 slots, 128 KiB,
 * perf put 40 % of the shim's own time on an alloc+free pair on that one load). */
#define TABLE0 16
static struct entry table0[TABLE0];
static struct entry *table = table0;
static size_t table_cap = TABLE0, table_count;
/* The table's lock: held briefly (a lookup and an insert or delete; a scan of the whole table
 * only on cuMemUnmap, cuMemRelease and a context's destruction), so a spin lock: on the
 * alloc+free path a pthread mutex's lock and unlock cost more than the work they guard (A/B
 * against the modelled driver: the shim's share of a pair about 630 -> 220 ns). A waiter yields
 * after a short spin, so a holder that lost its CPU gets it back. */
static _Atomic int table_lock;

static inline void table_acquire(void) {
    for (unsigned spins = 0;
         atomic_exchange_explicit(&table_lock, 1, memory_order_acquire);) {
        while (atomic_load_explicit(&table_lock, memory_order_relaxed))
            if (++spins > 64) sched_yield();
    }
}

static inline void table_release(void) {
    atomic_store_explicit(&table_lock, 0, memory_order_release);
}

/* What this process counts on each GPU (private, beside its slot's copy): everything, and the
 * driver's own part of it (contexts, modules, true-ups). Its allocations are the difference, so
 * an allocation or a free updates one private counter, not two. */
static _Atomic uint64_t own_bytes[VGPU_MAX_DEV];
static _Atomic uint64_t own_overhead[VGPU_MAX_DEV];

/* A key's first slot. Keys near each other get slots near each other: the driver hands out
 * device pointers in 512-byte steps, so an allocation lands next to the one before it, in a
 * cache line and page the last one touched, not in a random one of the table's 128 KiB (a cache
 * and TLB miss on every allocation after the driver's own work: about a third of what the
 * shim added to an alloc+free pair). The higher bits are folded in so that 2 MiB-aligned
 * blocks (caching allocators) spread as well; the low 9 bits spread host-pointer handles
 * (arrays: 16-byte aligned). */
static inline size_t home(uint64_t key, uint8_t kind, size_t mask) {
    uint64_t h = (key >> 9) ^ (key >> 21) ^ (key >> 33) ^ (key & 0x1ff) ^ ((uint64_t)kind << 5);
    return (size_t)h & mask;
}

static int grow_locked(void) {
    size_t cap = table_cap * 2;
    struct entry *t = mmap(NULL, cap * sizeof(*t), PROT_READ | PROT_WRITE,
                           MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (t == MAP_FAILED) return -1;
    for (size_t i = 0; i < table_cap; i++) {
        if (!table[i].key) continue;
        size_t j = home(table[i].key, table[i].kind, cap - 1);
        while (t[j].key) j = (j + 1) & (cap - 1);
        t[j] = table[i];
    }
    if (table != table0) munmap(table, table_cap * sizeof(*table));
    table = t;
    table_cap = cap;
    return 0;
}

/* Removes the entry at i (backward-shift deletion: no tombstones). */
static VGPU_HOT void delete_at_locked(size_t i) {
    size_t mask = table_cap - 1, j = i;
    for (;;) {
        j = (j + 1) & mask;
        if (!table[j].key) break;
        size_t k = home(table[j].key, table[j].kind, mask);
        int stays = i <= j ? (i < k && k <= j) : (i < k || k <= j);
        if (stays) continue;
        table[i] = table[j];
        i = j;
    }
    memset(&table[i], 0, sizeof(table[i]));
    table_count--;
}

static VGPU_HOT int find_locked(uint64_t key, uint8_t kind, size_t *at) {
    size_t mask = table_cap - 1;
    for (size_t i = home(key, kind, mask);; i = (i + 1) & mask) {
        if (!table[i].key) return 0;
        if (table[i].key == key && table[i].kind == kind) {
            *at = i;
            return 1;
        }
    }
}

VGPU_HOT int vgpu_mem_take(uint64_t key, uint8_t kind, struct entry *out) {
    table_acquire();
    size_t i;
    int found = find_locked(key, kind, &i);
    if (found) {
        *out = table[i];
        delete_at_locked(i);
    }
    table_release();
    return found;
}

/* Remembers key -> size. Returns the size of a stale entry it replaced (the driver reused the
 * handle without us seeing the free), which the caller releases. */
VGPU_HOT uint64_t vgpu_mem_track(uint64_t key, uint8_t kind, uint64_t size, int dev,
                                CUcontext ctx) {
    uint64_t stale = 0;
    int stale_dev = 0;
    table_acquire();
    size_t i;
    if (find_locked(key, kind, &i)) {
        stale = table[i].size;
        stale_dev = table[i].dev;
        delete_at_locked(i);
    }
    if ((table_count + 1) * 10 > table_cap * 7 && grow_locked() != 0 &&
        table_count + 1 >= table_cap) {
        table_release();
        static _Atomic int warned;
        if (!atomic_exchange(&warned, 1))
            vgpu_log("allocation table full; some allocations stay counted until exit");
        return 0;
    }
    size_t mask = table_cap - 1;
    for (i = home(key, kind, mask); table[i].key; i = (i + 1) & mask) {
    }
    table[i] = (struct entry){key, size, ctx, kind, (uint8_t)dev};
    table_count++;
    table_release();
    if (kind == K_MAP) stale = 0; /* a mapping's size field is its handle, not bytes */
    if (stale) vgpu_mem_release(stale_dev, stale, 0);
    return stale;
}

void vgpu_mem_put_back(const struct entry *e) {
    vgpu_mem_track(e->key, e->kind, e->size, e->dev, e->ctx);
}

int vgpu_mem_is_mapped(CUmemGenericAllocationHandle handle) {
    int n = 0;
    table_acquire();
    for (size_t i = 0; i < table_cap && !n; i++)
        n = table[i].key && table[i].kind == K_MAP && table[i].size == handle;
    table_release();
    return n;
}

int vgpu_mem_take_mappings(CUdeviceptr va, size_t size, CUmemGenericAllocationHandle *gone,
                           int cap) {
    int n = 0;
    table_acquire();
    for (size_t i = 0; i < table_cap && n < cap;) {
        if (table[i].key && table[i].kind == K_MAP && table[i].key >= va &&
            table[i].key - va < size) {
            gone[n++] = table[i].size;
            delete_at_locked(i); /* something may have shifted into i: look again */
            continue;
        }
        i++;
    }
    table_release();
    return n;
}

/* Releases every allocation made in ctx (the driver freed them with the context). */
void vgpu_mem_forget_context(CUcontext ctx) {
    uint64_t freed[VGPU_MAX_DEV] = {0};
    table_acquire();
    for (size_t i = 0; i < table_cap;) {
        if (table[i].key && table[i].ctx == ctx && ctx) {
            freed[table[i].dev] += table[i].size;
            delete_at_locked(i); /* something may have shifted into i: look again */
            continue;
        }
        i++;
    }
    table_release();
    for (int d = 0; d < VGPU_MAX_DEV; d++)
        if (freed[d]) vgpu_mem_release(d, freed[d], 0);
}

/* ---- the container's counters -------------------------------------------------------- */

/* The most the container may hold on dev: its burst limit (its request when not elastic). */
uint64_t vgpu_limit(int dev) {
    return dev >= 0 && dev < VGPU_MAX_DEV ? vgpu.cfg.memory_limit_bytes[dev] : VGPU_UNLIMITED;
}

/* ---- what other processes of the container use, checked against NVML ---------------------
 * The region is writable by every process of the container, so a hostile one can zero the
 * counters. What this process itself holds is known privately (own_bytes); what the others
 * hold is taken as the larger of their slot's count and NVML's usage of their host pid (the
 * driver's word, which no container can write). That floor is refreshed at most every
 * FLOOR_NS, on the first allocation of a process, and before an allocation is refused on its
 * account (so a stale floor never refuses what fits). A process also restores its own slot
 * when it finds it lowered. */
#define FLOOR_NS (100ull * 1000000ull)
static const char *region_name(void) { return vgpu.cfg.container_region; }
static _Atomic uint64_t floor_others[VGPU_MAX_DEV], floor_at[VGPU_MAX_DEV];

/* The region this process mapped must still be the file at its path: unlinked, renamed or
 * replaced, the container's next process would start a region of its own, a fresh limit. So
 * from then on this process refuses to allocate (fail closed) and says so once. Checked with
 * the floor (at most every FLOOR_NS, and before a refusal). A directory moved as a whole (the
 * hub carries a swapped-out kernel's files over to the allocation it resumes in) leaves the
 * file linked and its old directory gone: that is no loss (its parent is the hub's to move). */
static _Atomic int region_lost;

static int region_gone(void) {
    if (atomic_load_explicit(&region_lost, memory_order_relaxed)) return 1;
    struct stat mapped, named;
    if (vgpu.reg_private || vgpu.reg_fd < 0 || fstat(vgpu.reg_fd, &mapped) != 0) return 0;
    if (stat(region_name(), &named) == 0 && named.st_ino == mapped.st_ino &&
        named.st_dev == mapped.st_dev)
        return 0;
    char dir[PATH_MAX];
    snprintf(dir, sizeof(dir), "%s", region_name());
    char *slash = strrchr(dir, '/');
    if (slash) *slash = 0;
    if (mapped.st_nlink > 0 && slash && slash != dir && stat(dir, &named) != 0) return 0;
    if (!atomic_exchange(&region_lost, 1))
        vgpu_log("the accounting region %s was removed or replaced while this process used it; "
                 "its allocations are refused from now on (restart the container's CUDA programs)",
                 region_name());
    return 1;
}

static void refresh_floor(int dev) {
    struct vgpu_container_region *r = vgpu.reg;
    nvmlProcessInfo_v2_t p[VGPU_SNAP_PIDS];
    int n = vgpu_nvml_processes(dev, p, VGPU_SNAP_PIDS); /* before the lock: NVML is slow */
    int locked = vgpu_region_lock(r) == 0;
    struct vgpu_slot *me = vgpu.me;
    if (me && atomic_load(&me->pid) != (int32_t)getpid()) { /* its slot was wiped: take it back */
        atomic_store(&me->host_pid, atomic_load(&vgpu.host_pid));
        atomic_store(&me->pid, (int32_t)getpid());
    }
    if (vgpu_region_reap_own_locked(r, own_bytes)) { /* its slot's count restored */
        static _Atomic int warned;
        if (!atomic_exchange(&warned, 1))
            vgpu_log("this process's memory count in %s was lowered by someone; restored",
                     region_name());
    }
    int mine = atomic_load(&vgpu.slot);
    uint32_t hwm = atomic_load(&r->hwm);
    uint64_t sum = 0;
    unsigned char counted[VGPU_SNAP_PIDS] = {0};
    for (uint32_t i = 0; i < hwm && i < VGPU_MAX_PROCS; i++) {
        struct vgpu_slot *s = &r->slots[i];
        if ((int)i == mine || !atomic_load(&s->pid)) continue;
        uint64_t u = atomic_load(&s->used[dev]);
        unsigned int hp = (unsigned int)atomic_load(&s->host_pid);
        for (int k = 0; hp && k < n; k++)
            if (p[k].pid == hp && !counted[k]) {
                counted[k] = 1;
                if (p[k].usedGpuMemory != ~0ull && p[k].usedGpuMemory > u) u = p[k].usedGpuMemory;
            }
        sum += u;
    }
    if (locked) vgpu_region_unlock(r);
    /* processes of the container whose slot someone wiped: their host pid is still held */
    unsigned int self = vgpu_self_nvml_pid();
    for (int k = 0; k < n; k++)
        if (!counted[k] && p[k].pid != self && p[k].usedGpuMemory != ~0ull &&
            vgpu_region_host_pid_held(p[k].pid))
            sum += p[k].usedGpuMemory;
    atomic_store(&floor_others[dev], sum);
    atomic_store(&floor_at[dev], vgpu_coarse_real_ns() | 1);
}

/* floor_at is the refresh's time | 1 (0: never); the bit is masked off again here: an even
 * time stored as one more than the clock made the difference wrap, and every allocation until
 * the coarse clock's next tick (4 to 24 ms) listed NVML's processes again. */
static inline int floor_stale(int dev, uint64_t now) {
    uint64_t at = atomic_load_explicit(&floor_at[dev], memory_order_relaxed);
    return !at || now - (at & ~1ull) >= FLOOR_NS;
}

/* The container's usage on dev: the shared total, or more if the floor says so. */
static inline uint64_t effective(uint64_t shared, int dev) {
    uint64_t f = atomic_load(&floor_others[dev]) + atomic_load(&own_bytes[dev]);
    return f > shared ? f : shared;
}

uint64_t vgpu_container_used(int dev) {
    struct vgpu_container_region *r = vgpu.reg;
    if (!r || dev < 0 || dev >= VGPU_MAX_DEV) return 0;
    if (vgpu.cfg.memory_bytes[dev] != VGPU_UNLIMITED && floor_stale(dev, vgpu_coarse_real_ns()))
        refresh_floor(dev);
    if (vgpu_region_lock(r) == 0) {
        vgpu_region_reap_locked(r);
        vgpu_region_unlock(r);
    }
    uint64_t used = atomic_load(&r->used[dev]);
    return vgpu.cfg.memory_bytes[dev] != VGPU_UNLIMITED ? effective(used, dev) : used;
}

/* ---- updates without the lock ---------------------------------------------------------
 * An allocation or a free changes the container's total with one compare-and-swap (the check
 * against the limit and the reservation are that one step, so concurrent processes never take
 * more than the limit together), then its own slot; the slot's busy count is raised around
 * both so that a holder of the lock that recounts the total (vgpu_region_reap_locked) waits
 * until nothing is half-done. While a recount is under way (quiesce), or without a slot, the
 * update takes the lock instead. The robust mutex's lock and unlock cost more than the update
 * they guard: this is most of what the shim adds to an alloc+free pair. */
static inline int unlocked_begin(struct vgpu_container_region *r, struct vgpu_slot *me) {
    if (!me) return 0;
    atomic_fetch_add(&me->busy, 1);
    if (VGPU_LIKELY(!atomic_load(&r->quiesce))) return 1;
    atomic_fetch_sub(&me->busy, 1);
    return 0;
}

static inline void unlocked_end(struct vgpu_slot *me) {
    atomic_fetch_sub_explicit(&me->busy, 1, memory_order_release);
}

static inline int over(uint64_t used, int dev, uint64_t bytes, uint64_t limit) {
    return limit != VGPU_UNLIMITED && (bytes > limit || effective(used, dev) > limit - bytes);
}

/* Adds bytes to the total unless that takes it over limit; *used: the total it last saw. */
static inline int add_within(struct vgpu_container_region *r, int dev, uint64_t bytes,
                             uint64_t limit, uint64_t *used) {
    *used = atomic_load(&r->used[dev]);
    do {
        if (over(*used, dev, bytes, limit)) return 0;
    } while (!atomic_compare_exchange_weak(&r->used[dev], used, *used + bytes));
    return 1;
}

static inline void count_own(struct vgpu_slot *me, int dev, uint64_t bytes, int overhead) {
    if (me) {
        atomic_fetch_add(&me->used[dev], bytes);
        if (overhead) atomic_fetch_add(&me->overhead[dev], bytes);
    }
    atomic_fetch_add(&own_bytes[dev], bytes);
    if (overhead) atomic_fetch_add(&own_overhead[dev], bytes);
}

#ifdef VGPU_TEST_HOOKS
static void test_pause(const char *where) { /* test hook: die here, mid-update */
    if (VGPU_LIKELY(!vgpu.test_sleep_in_lock_ms)) return;
    vgpu_log("test: %s for %u ms", where, vgpu.test_sleep_in_lock_ms);
    vgpu_sleep_ns((uint64_t)vgpu.test_sleep_in_lock_ms * 1000000ull);
}
static void test_hold_burst(int dev, uint64_t bytes) { /* test hook: a burst waits for the file */
    if (VGPU_LIKELY(!vgpu.test_hold_burst)) return;
    if (vgpu_container_used(dev) + bytes <= vgpu.cfg.memory_bytes[dev]) return; /* no burst */
    vgpu_log("test: holding a burst between what the card allows and the count");
    while (access(vgpu.test_hold_burst, F_OK) != 0) vgpu_sleep_ns(1000000ull);
}
#define TEST_PAUSE(where) test_pause(where)
#define TEST_HOLD_BURST(dev, bytes) test_hold_burst(dev, bytes)
#define TEST_LOCKED_PATH() (vgpu.test_locked_path)
#else
#define TEST_PAUSE(where) ((void)0)
#define TEST_HOLD_BURST(dev, bytes) ((void)0)
#define TEST_LOCKED_PATH() 0
#endif

/* force: memory the driver already holds (a true-up): counted even past the limit. now: the
 * coarse clock, read once per allocation. */
static VGPU_HOT CUresult reserve(int dev, uint64_t bytes, int overhead, int force, uint64_t now) {
    struct vgpu_container_region *r = vgpu.reg;
    if (!r || dev < 0 || dev >= VGPU_MAX_DEV || !bytes) return CUDA_SUCCESS;
    if (!vgpu.me) vgpu_region_claim_slot();
    struct vgpu_slot *me = vgpu.me;
    uint64_t limit = force ? VGPU_UNLIMITED : vgpu.cfg.memory_limit_bytes[dev];
    if (limit != VGPU_UNLIMITED && floor_stale(dev, now)) {
        if (region_gone()) return CUDA_ERROR_OUT_OF_MEMORY;
        refresh_floor(dev);
    }
    if (limit != VGPU_UNLIMITED && atomic_load_explicit(&region_lost, memory_order_relaxed))
        return CUDA_ERROR_OUT_OF_MEMORY;
    /* an elastic slice past its request: only what the card has that no other slice needs
     * (vgpu_mem_allowed attaches the node region: before the region lock, as slow_lock is
     * taken before it) */
    int elastic = limit != VGPU_UNLIMITED && limit > vgpu.cfg.memory_bytes[dev];
    if (elastic) {
        limit = vgpu_mem_allowed(dev);
        TEST_HOLD_BURST(dev, bytes);
    }
    uint64_t used;
    if (!TEST_LOCKED_PATH() && unlocked_begin(r, me)) {
        int added = add_within(r, dev, bytes, limit, &used);
        if (added) {
            TEST_PAUSE("between the total and the slot");
            count_own(me, dev, bytes, overhead);
        }
        unlocked_end(me);
        if (added) goto counted;
    }
    /* over the limit, or a recount under way: under the lock */
    int locked = vgpu_region_lock(r) == 0;
    if (!add_within(r, dev, bytes, limit, &used)) {
        vgpu_region_reap_locked(r); /* the dead hold nothing */
        used = atomic_load(&r->used[dev]);
        if (bytes <= limit && used <= limit - bytes) { /* only the floor says no: recheck */
            if (locked) vgpu_region_unlock(r);
            refresh_floor(dev);
            locked = vgpu_region_lock(r) == 0;
        }
        if (!add_within(r, dev, bytes, limit, &used)) {
            if (locked) vgpu_region_unlock(r);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
    }
    TEST_PAUSE("holding the accounting lock");
    count_own(me, dev, bytes, overhead);
    if (locked) vgpu_region_unlock(r);
counted:
    vgpu_publish_usage(dev, now);
    if (VGPU_UNLIKELY(elastic) && used + bytes > vgpu.cfg.memory_bytes[dev] && /* a burst */
        !vgpu_mem_burst_holds(dev)) { /* another burst took the room meanwhile */
        vgpu_mem_release(dev, bytes, overhead);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    return CUDA_SUCCESS;
}
CUresult vgpu_mem_reserve(int dev, uint64_t bytes, int overhead) {
    return reserve(dev, bytes, overhead, 0, vgpu_coarse_real_ns());
}
CUresult vgpu_mem_reserve_held(int dev, uint64_t bytes, int overhead) {
    return reserve(dev, bytes, overhead, 1, vgpu_coarse_real_ns());
}
uint64_t vgpu_mem_local_alloc(int dev) {
    uint64_t all = atomic_load(&own_bytes[dev]), overhead = atomic_load(&own_overhead[dev]);
    return all > overhead ? all - overhead : 0;
}

/* Memory true-up: what NVML says this process holds beyond its counted allocations is the
 * driver's own (context, lazily loaded modules, cuCtxSetLimit, local memory growth, graph
 * exec memory); when it grew past the overhead counted so far, the growth is counted too.
 * At most every TRUE_UP_NS per process (an NVML call), on allocations and memory queries.
 * A configured context_mib means "charge this, do not measure": no true-up then. */
#define TRUE_UP_NS (100ull * 1000000ull)
static _Atomic uint64_t true_up_at[VGPU_MAX_DEV];
static _Atomic uint64_t trued[VGPU_MAX_DEV]; /* the part of the overhead added by true-ups */

static void true_up_from_nvml(int dev) {
    struct vgpu_slot *me = vgpu.me;
    uint64_t nvml_used;
    if (!me || vgpu_nvml_process_used(dev, &nvml_used) != 0) return;
    uint64_t local = vgpu_mem_local_alloc(dev);
    uint64_t driver = nvml_used > local ? nvml_used - local : 0;
    uint64_t counted = atomic_load(&me->overhead[dev]);
    if (driver > counted) {
        vgpu_debug("gpu %d: driver holds %llu MiB of its own, %llu MiB counted: trued up", dev,
                   (unsigned long long)(driver >> 20), (unsigned long long)(counted >> 20));
        vgpu_mem_reserve_held(dev, driver - counted, 1);
        atomic_fetch_add(&trued[dev], driver - counted);
    } else if (driver < counted && atomic_load(&trued[dev])) { /* what was trued up shrank */
        uint64_t t = atomic_load(&trued[dev]), back = counted - driver < t ? counted - driver : t;
        atomic_fetch_sub(&trued[dev], back);
        vgpu_mem_release(dev, back, 1);
    }
}

/* now: the coarse clock (an allocation reads it once for everything it checks). */
static inline void true_up(int dev, int now_please, uint64_t now) {
    if (now_please && dev >= 0 && dev < VGPU_MAX_DEV) vgpu_pools_reconcile(dev);
    if (dev < 0 || dev >= VGPU_MAX_DEV || !vgpu.reg || !vgpu_self_nvml_pid() ||
        vgpu.cfg.context_bytes >= 0)
        return;
    uint64_t last = atomic_load_explicit(&true_up_at[dev], memory_order_relaxed);
    if (!now_please && now - last < TRUE_UP_NS) return;
    if (atomic_compare_exchange_strong(&true_up_at[dev], &last, now)) true_up_from_nvml(dev);
}

void vgpu_mem_true_up(int dev, int now_please) { true_up(dev, now_please, vgpu_coarse_real_ns()); }

static uint64_t sub_clamped(_Atomic uint64_t *v, uint64_t n) {
    uint64_t old = atomic_load(v), nv;
    do {
        nv = old > n ? old - n : 0;
    } while (!atomic_compare_exchange_weak(v, &old, nv));
    return nv;
}

VGPU_HOT void vgpu_mem_release(int dev, uint64_t bytes, int overhead) {
    struct vgpu_container_region *r = vgpu.reg;
    if (!r || dev < 0 || dev >= VGPU_MAX_DEV || !bytes) return;
    struct vgpu_slot *me = vgpu.me;
    int unlocked = unlocked_begin(r, me), locked = !unlocked && vgpu_region_lock(r) == 0;
    if (me) { /* the slot first: a process killed in between leaves the total high, not low */
        sub_clamped(&me->used[dev], bytes);
        if (overhead) sub_clamped(&me->overhead[dev], bytes);
    }
    sub_clamped(&r->used[dev], bytes);
    sub_clamped(&own_bytes[dev], bytes); /* inside the update: a recount sees both or neither */
    if (overhead) sub_clamped(&own_overhead[dev], bytes);
    if (unlocked) unlocked_end(me);
    if (locked) vgpu_region_unlock(r);
    vgpu_publish_usage(dev, vgpu_coarse_real_ns());
}

/* Corrects a reservation of est to actual; CUDA_ERROR_OUT_OF_MEMORY if actual does not fit
 * (the caller then undoes the driver call; est stays reserved for it to release). */
CUresult vgpu_mem_settle(int dev, uint64_t est, uint64_t actual, int overhead) {
    if (actual > est) return vgpu_mem_reserve(dev, actual - est, overhead);
    if (actual < est) vgpu_mem_release(dev, est - actual, overhead);
    return CUDA_SUCCESS;
}

void vgpu_mem_after_fork_child(void) {
    atomic_store(&table_lock, 0);
    if (table != table0) munmap(table, table_cap * sizeof(*table));
    table = table0;
    table_cap = TABLE0;
    table_count = 0;
    memset(table0, 0, sizeof(table0));
    for (int d = 0; d < VGPU_MAX_DEV; d++) {
        atomic_store(&own_bytes[d], 0);
        atomic_store(&own_overhead[d], 0);
        atomic_store(&floor_at[d], 0);
        atomic_store(&trued[d], 0);
        atomic_store(&true_up_at[d], 0);
    }
    vgpu_pools_after_fork_child();
    vgpu_ctx_after_fork_child();
}

/* ---- before and after an allocation --------------------------------------------------- */

static CUcontext current_ctx(void) {
    CUcontext c = NULL;
    cuCtxGetCurrent_fn get = REAL(cuCtxGetCurrent);
    if (get) get(&c);
    return c;
}

/* Before and after an allocation (memory.h). */
VGPU_HOT CUresult vgpu_mem_begin(int id, uint64_t bytes, int *dev, CUcontext *ctx) {
    CUresult rc = ready();
    if (rc != CUDA_SUCCESS) return rc;
    if (!atomic_load_explicit(&vgpu_hooks[id].real, memory_order_acquire))
        return CUDA_ERROR_NOT_FOUND;
    *dev = -1;
    *ctx = NULL;
    if (!accounting()) return CUDA_SUCCESS;
    CUdevice d;
    vgpu_current_device(&d);
    if (d >= VGPU_MAX_DEV) return CUDA_SUCCESS;
    *dev = d;
    *ctx = current_ctx();
    uint64_t now = vgpu_coarse_real_ns();
    true_up(d, 0, now);
    rc = reserve(d, bytes, 0, 0, now);
    if (rc == CUDA_ERROR_OUT_OF_MEMORY) { /* pools, graphs, the driver may have given back */
        vgpu_mem_true_up(d, 1);
        rc = vgpu_mem_reserve(d, bytes, 0);
    }
    return rc;
}

VGPU_HOT CUresult vgpu_mem_end(CUresult rc, uint64_t key, int kind, int dev, CUcontext ctx,
                               uint64_t bytes) {
    if (dev < 0) return rc;
    if (rc != CUDA_SUCCESS) {
        vgpu_mem_release(dev, bytes, 0);
        return rc;
    }
    vgpu_mem_track(key, (uint8_t)kind, bytes, dev, ctx);
    return rc;
}
