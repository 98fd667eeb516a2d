/*
 * memory.c: every allocation path counted per GPU against the container's limit.
 *
 * Each hook: reserve the bytes in the container region (check-and-reserve under the region
 * lock; over the limit -> CUDA_ERROR_OUT_OF_MEMORY and the driver is not called), call the
 * driver, roll the reservation back if the driver failed, and remember handle -> (size, GPU,
 * context) in a process-local open-addressing table so the free releases exactly what was
 * counted. Sizes the driver decides (pitch, arrays, contexts, modules) are reserved as an
 * estimate first and corrected afterwards; a correction over the limit undoes the call.
 * The table is a static array, grown with mmap when it fills up: no malloc on these paths.
 */
#define _GNU_SOURCE
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "vgpu.h"

#define DEFAULT_CONTEXT_BYTES (256ull << 20) /* when the driver's own usage cannot be measured */
#define PITCH_ALIGN 512ull

static void vgpu_ctx_after_fork_child(void);

/* K_MAP: a VMM mapping (key: its address, size: the handle); K_VMM_GONE: a handle released
 * while still mapped (its memory lives until the last mapping goes). */
enum { K_PTR = 1, K_VMM = 2, K_ARRAY = 3, K_MIPMAP = 4, K_ASYNC = 5, K_MAP = 6, K_VMM_GONE = 7 };

struct entry {
    uint64_t key;
    uint64_t size;
    CUcontext ctx;
    uint8_t kind;
    uint8_t dev;
};

#define TABLE0 4096
static struct entry table0[TABLE0];
static struct entry *table = table0;
static size_t table_cap = TABLE0, table_count;
static pthread_mutex_t table_lock = PTHREAD_MUTEX_INITIALIZER;
static _Atomic uint64_t local_alloc[VGPU_MAX_DEV]; /* this process's counted allocations */
static _Atomic uint64_t own_bytes[VGPU_MAX_DEV];   /* ... plus its counted overhead: private */
#define MAX_POOLS 64
static struct {
    CUmemoryPool pool;
    int dev;
    uint64_t counted;
} pools[MAX_POOLS];
static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;
static void reconcile_pools(int dev);
static uint64_t graph_counted[VGPU_MAX_DEV]; /* graph memory counted (pool lock) */
static _Atomic uint64_t graph_checked_at;

static inline size_t home(uint64_t key, uint8_t kind, size_t mask) {
    uint64_t h = (key ^ ((uint64_t)kind << 59)) * 0x9E3779B97F4A7C15ull;
    return (size_t)(h ^ (h >> 31)) & mask;
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
static void delete_at_locked(size_t i) {
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

static int find_locked(uint64_t key, uint8_t kind, size_t *at) {
    size_t mask = table_cap - 1;
    for (size_t i = home(key, kind, mask);; i = (i + 1) & mask) {
        if (!table[i].key) return 0;
        if (table[i].key == key && table[i].kind == kind) {
            *at = i;
            return 1;
        }
    }
}

static int take(uint64_t key, uint8_t kind, struct entry *out) {
    pthread_mutex_lock(&table_lock);
    size_t i;
    int found = find_locked(key, kind, &i);
    if (found) {
        *out = table[i];
        delete_at_locked(i);
    }
    pthread_mutex_unlock(&table_lock);
    return found;
}

/* Remembers key -> size. Returns the size of a stale entry it replaced (the driver reused the
 * handle without us seeing the free), which the caller releases. */
static uint64_t track(uint64_t key, uint8_t kind, uint64_t size, int dev, CUcontext ctx) {
    uint64_t stale = 0;
    int stale_dev = 0;
    pthread_mutex_lock(&table_lock);
    size_t i;
    if (find_locked(key, kind, &i)) {
        stale = table[i].size;
        stale_dev = table[i].dev;
        delete_at_locked(i);
    }
    if ((table_count + 1) * 10 > table_cap * 7 && grow_locked() != 0 &&
        table_count + 1 >= table_cap) {
        pthread_mutex_unlock(&table_lock);
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
    pthread_mutex_unlock(&table_lock);
    if (kind == K_MAP) stale = 0; /* a mapping's size field is its handle, not bytes */
    if (stale) vgpu_mem_release(stale_dev, stale, 0);
    return stale;
}

static void put_back(const struct entry *e) {
    track(e->key, e->kind, e->size, e->dev, e->ctx);
}

/* Releases every allocation made in ctx (the driver freed them with the context). */
void vgpu_mem_forget_context(CUcontext ctx) {
    uint64_t freed[VGPU_MAX_DEV] = {0};
    pthread_mutex_lock(&table_lock);
    for (size_t i = 0; i < table_cap;) {
        if (table[i].key && table[i].ctx == ctx && ctx) {
            freed[table[i].dev] += table[i].size;
            delete_at_locked(i); /* something may have shifted into i: look again */
            continue;
        }
        i++;
    }
    pthread_mutex_unlock(&table_lock);
    for (int d = 0; d < VGPU_MAX_DEV; d++)
        if (freed[d]) vgpu_mem_release(d, freed[d], 0);
}

/* ---- the container's counters -------------------------------------------------------- */

uint64_t vgpu_limit(int dev) {
    return dev >= 0 && dev < VGPU_MAX_DEV ? vgpu.cfg.memory_bytes[dev] : VGPU_UNLIMITED;
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

static void refresh_floor(int dev) {
    struct vgpu_container_region *r = vgpu.reg;
    nvmlProcessInfo_v2_t p[VGPU_SNAP_PIDS];
    int n = vgpu_nvml_processes(dev, p, VGPU_SNAP_PIDS); /* before the lock: NVML is slow */
    int locked = vgpu_region_lock(r) == 0;
    struct vgpu_slot *me = vgpu.me;
    uint64_t own = atomic_load(&own_bytes[dev]);
    if (me && atomic_load(&me->used[dev]) < own) {
        static _Atomic int warned;
        if (!atomic_exchange(&warned, 1))
            vgpu_log("this process's memory count in %s was lowered by someone; restored",
                     region_name());
        atomic_store(&me->used[dev], own);
    }
    if (me && atomic_load(&me->pid) != (int32_t)getpid()) { /* its slot was wiped: take it back */
        atomic_store(&me->host_pid, atomic_load(&vgpu.host_pid));
        atomic_store(&me->pid, (int32_t)getpid());
    }
    vgpu_region_reap_locked(r);
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

static inline int floor_stale(int dev) {
    uint64_t at = atomic_load_explicit(&floor_at[dev], memory_order_relaxed);
    return !at || vgpu_coarse_real_ns() - at >= FLOOR_NS;
}

/* The container's usage on dev: the shared total, or more if the floor says so. */
static inline uint64_t effective(uint64_t shared, int dev) {
    uint64_t f = atomic_load(&floor_others[dev]) + atomic_load(&own_bytes[dev]);
    return f > shared ? f : shared;
}

uint64_t vgpu_container_used(int dev) {
    struct vgpu_container_region *r = vgpu.reg;
    if (!r || dev < 0 || dev >= VGPU_MAX_DEV) return 0;
    if (vgpu.cfg.memory_bytes[dev] != VGPU_UNLIMITED && floor_stale(dev)) refresh_floor(dev);
    if (vgpu_region_lock(r) == 0) {
        vgpu_region_reap_locked(r);
        vgpu_region_unlock(r);
    }
    uint64_t used = atomic_load(&r->used[dev]);
    return vgpu.cfg.memory_bytes[dev] != VGPU_UNLIMITED ? effective(used, dev) : used;
}

/* force: memory the driver already holds (a true-up): counted even past the limit. */
static CUresult reserve(int dev, uint64_t bytes, int overhead, int force) {
    struct vgpu_container_region *r = vgpu.reg;
    if (!r || dev < 0 || dev >= VGPU_MAX_DEV || !bytes) return CUDA_SUCCESS;
    if (!vgpu.me) vgpu_region_claim_slot();
    struct vgpu_slot *me = vgpu.me;
    uint64_t limit = force ? VGPU_UNLIMITED : vgpu.cfg.memory_bytes[dev];
    if (limit != VGPU_UNLIMITED && floor_stale(dev)) refresh_floor(dev);
    int locked = vgpu_region_lock(r) == 0;
    uint64_t used = atomic_load(&r->used[dev]);
    if (limit != VGPU_UNLIMITED && (bytes > limit || effective(used, dev) > limit - bytes)) {
        vgpu_region_reap_locked(r); /* the dead hold nothing */
        used = atomic_load(&r->used[dev]);
        if (bytes <= limit && used <= limit - bytes) { /* only the floor says no: recheck */
            if (locked) vgpu_region_unlock(r);
            refresh_floor(dev);
            locked = vgpu_region_lock(r) == 0;
            used = atomic_load(&r->used[dev]);
        }
        if (bytes > limit || effective(used, dev) > limit - bytes) {
            if (locked) vgpu_region_unlock(r);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
    }
    if (me) {
        atomic_fetch_add(&me->used[dev], bytes);
        if (overhead) atomic_fetch_add(&me->overhead[dev], bytes);
    }
#ifdef VGPU_TEST_HOOKS
    if (VGPU_UNLIKELY(vgpu.test_sleep_in_lock_ms)) { /* test hook: die here, mid-update */
        vgpu_log("test: holding the accounting lock for %u ms", vgpu.test_sleep_in_lock_ms);
        vgpu_sleep_ns((uint64_t)vgpu.test_sleep_in_lock_ms * 1000000ull);
    }
#endif
    atomic_store(&r->used[dev], used + bytes);
    atomic_fetch_add(&own_bytes[dev], bytes);
    if (locked) vgpu_region_unlock(r);
    if (!overhead) atomic_fetch_add(&local_alloc[dev], bytes);
    vgpu_publish_usage(dev);
    return CUDA_SUCCESS;
}
CUresult vgpu_mem_reserve(int dev, uint64_t bytes, int overhead) {
    return reserve(dev, bytes, overhead, 0);
}

/* Memory true-up: what NVML says this process holds beyond its counted allocations is the
 * driver's own (context, lazily loaded modules, cuCtxSetLimit, local memory growth, graph
 * exec memory); when it grew past the overhead counted so far, the growth is counted too.
 * At most every TRUE_UP_NS per process (an NVML call), on allocations and memory queries.
 * A configured context_mib means "charge this, do not measure": no true-up then. */
#define TRUE_UP_NS (100ull * 1000000ull)
static _Atomic uint64_t true_up_at[VGPU_MAX_DEV];
static _Atomic uint64_t trued[VGPU_MAX_DEV]; /* the part of the overhead added by true-ups */

void vgpu_mem_true_up(int dev, int now_please) {
    if (now_please && dev >= 0 && dev < VGPU_MAX_DEV) reconcile_pools(dev);
    if (dev < 0 || dev >= VGPU_MAX_DEV || !vgpu.reg || !vgpu_self_nvml_pid() ||
        vgpu.cfg.context_bytes >= 0)
        return;
    uint64_t now = vgpu_coarse_real_ns(), last = atomic_load_explicit(&true_up_at[dev],
                                                                     memory_order_relaxed);
    if (!now_please && now - last < TRUE_UP_NS) return;
    if (!atomic_compare_exchange_strong(&true_up_at[dev], &last, now)) return;
    struct vgpu_slot *me = vgpu.me;
    uint64_t nvml_used;
    if (!me || vgpu_nvml_process_used(dev, &nvml_used) != 0) return;
    uint64_t local = atomic_load(&local_alloc[dev]);
    uint64_t driver = nvml_used > local ? nvml_used - local : 0;
    uint64_t counted = atomic_load(&me->overhead[dev]);
    if (driver > counted) {
        vgpu_debug("gpu %d: driver holds %llu MiB of its own, %llu MiB counted: trued up", dev,
                   (unsigned long long)(driver >> 20), (unsigned long long)(counted >> 20));
        reserve(dev, driver - counted, 1, 1);
        atomic_fetch_add(&trued[dev], driver - counted);
    } else if (driver < counted && atomic_load(&trued[dev])) { /* what was trued up shrank */
        uint64_t t = atomic_load(&trued[dev]), back = counted - driver < t ? counted - driver : t;
        atomic_fetch_sub(&trued[dev], back);
        vgpu_mem_release(dev, back, 1);
    }
}

static uint64_t sub_clamped(_Atomic uint64_t *v, uint64_t n) {
    uint64_t old = atomic_load(v), nv;
    do {
        nv = old > n ? old - n : 0;
    } while (!atomic_compare_exchange_weak(v, &old, nv));
    return nv;
}

void vgpu_mem_release(int dev, uint64_t bytes, int overhead) {
    struct vgpu_container_region *r = vgpu.reg;
    if (!r || dev < 0 || dev >= VGPU_MAX_DEV || !bytes) return;
    struct vgpu_slot *me = vgpu.me;
    int locked = vgpu_region_lock(r) == 0;
    if (me) {
        sub_clamped(&me->used[dev], bytes);
        if (overhead) sub_clamped(&me->overhead[dev], bytes);
    }
    sub_clamped(&r->used[dev], bytes);
    sub_clamped(&own_bytes[dev], bytes);
    if (locked) vgpu_region_unlock(r);
    if (!overhead) sub_clamped(&local_alloc[dev], bytes);
    vgpu_publish_usage(dev);
}

/* Corrects a reservation of est to actual; CUDA_ERROR_OUT_OF_MEMORY if actual does not fit
 * (the caller then undoes the driver call; est stays reserved for it to release). */
static CUresult settle(int dev, uint64_t est, uint64_t actual, int overhead) {
    if (actual > est) return vgpu_mem_reserve(dev, actual - est, overhead);
    if (actual < est) vgpu_mem_release(dev, est - actual, overhead);
    return CUDA_SUCCESS;
}

void vgpu_mem_after_fork_child(void) {
    pthread_mutex_init(&table_lock, NULL);
    pthread_mutex_init(&pool_lock, NULL);
    memset(pools, 0, sizeof(pools)); /* a child has no pools of its own yet */
    memset(graph_counted, 0, sizeof(graph_counted));
    if (table != table0) munmap(table, table_cap * sizeof(*table));
    table = table0;
    table_cap = TABLE0;
    table_count = 0;
    memset(table0, 0, sizeof(table0));
    for (int d = 0; d < VGPU_MAX_DEV; d++) {
        atomic_store(&local_alloc[d], 0);
        atomic_store(&own_bytes[d], 0);
        atomic_store(&floor_at[d], 0);
        atomic_store(&trued[d], 0);
        atomic_store(&true_up_at[d], 0);
    }
    vgpu_ctx_after_fork_child();
}

/* ---- allocation hooks ------------------------------------------------------------------- */

static inline CUresult ready(void) {
    if (VGPU_LIKELY(atomic_load_explicit(&vgpu_cuda_go, memory_order_acquire))) return CUDA_SUCCESS;
    return vgpu_not_ready();
}

static inline int accounting(void) { return (vgpu.features & VGPU_F_REGION) != 0; }

static CUcontext current_ctx(void) {
    CUcontext c = NULL;
    cuCtxGetCurrent_fn get = REAL(cuCtxGetCurrent);
    if (get) get(&c);
    return c;
}

/* Before an allocation of bytes with hook id: ready, real present, reserved. dev < 0: not
 * accounted (no region). */
static CUresult begin(int id, uint64_t bytes, int *dev, CUcontext *ctx) {
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
    vgpu_mem_true_up(d, 0);
    rc = vgpu_mem_reserve(d, bytes, 0);
    if (rc == CUDA_ERROR_OUT_OF_MEMORY) { /* pools, graphs, the driver may have given back */
        vgpu_mem_true_up(d, 1);
        rc = vgpu_mem_reserve(d, bytes, 0);
    }
    return rc;
}

static CUresult end(CUresult rc, uint64_t key, int kind, int dev, CUcontext ctx, uint64_t bytes) {
    if (dev < 0) return rc;
    if (rc != CUDA_SUCCESS) {
        vgpu_mem_release(dev, bytes, 0);
        return rc;
    }
    track(key, (uint8_t)kind, bytes, dev, ctx);
    return rc;
}

VGPU_EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytes) {
    int dev;
    CUcontext ctx;
    CUresult rc = begin(H_cuMemAlloc_v2, bytes, &dev, &ctx);
    if (rc != CUDA_SUCCESS) return rc;
    rc = REAL(cuMemAlloc_v2)(dptr, bytes);
    return end(rc, rc == CUDA_SUCCESS ? *dptr : 0, K_PTR, dev, ctx, bytes);
}

VGPU_EXPORT CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytes, unsigned int flags) {
    int dev;
    CUcontext ctx;
    CUresult rc = begin(H_cuMemAllocManaged, bytes, &dev, &ctx);
    if (rc != CUDA_SUCCESS) return rc;
    rc = REAL(cuMemAllocManaged)(dptr, bytes, flags);
    return end(rc, rc == CUDA_SUCCESS ? *dptr : 0, K_PTR, dev, ctx, bytes);
}

/* ---- stream-ordered pools ------------------------------------------------------------------
 * What counts is what a pool has reserved on the device, not its live blocks: freed blocks
 * stay reserved for reuse (PyTorch sets the release threshold to UINT64_MAX, so nothing is
 * ever given back unless trimmed), and a pool gives memory back at synchronisations or a
 * trim. Each pool's reserved size (the driver's own CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT) is
 * reconciled with what was counted for it after every stream-ordered allocation and free,
 * on a trim, on memory queries and before an allocation is refused. */

static int pool_reserved(CUmemoryPool pool, uint64_t *bytes) {
    cuMemPoolGetAttribute_fn get = REAL(cuMemPoolGetAttribute);
    cuuint64_t v = 0;
    if (!get || !pool || get(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, &v) != CUDA_SUCCESS)
        return -1;
    *bytes = v;
    return 0;
}

/* Brings the count of pool i to its reserved size; `reserved` bytes were counted already for
 * the allocation being made (0 otherwise). Pool lock held. */
static void reconcile_locked(int i, uint64_t reserved) {
    uint64_t now;
    if (pool_reserved(pools[i].pool, &now) != 0) return;
    uint64_t had = pools[i].counted + reserved;
    if (now > had) reserve(pools[i].dev, now - had, 0, 1); /* the driver holds it already */
    else if (now < had) vgpu_mem_release(pools[i].dev, had - now, 0);
    pools[i].counted = now;
}

static int pool_slot_locked(CUmemoryPool pool, int dev) {
    int spare = -1;
    for (int i = 0; i < MAX_POOLS; i++) {
        if (pools[i].pool == pool) return i;
        if (spare < 0 && !pools[i].pool) spare = i;
    }
    if (spare >= 0) pools[spare].pool = pool, pools[spare].dev = dev, pools[spare].counted = 0;
    return spare;
}

/* ---- graph memory ------------------------------------------------------------------------
 * Memory allocation nodes take memory from the device's graph pool when a graph runs; it
 * stays reserved for later launches until cuDeviceGraphMemTrim. The count follows the
 * driver's CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT after graph launches (at most every
 * GRAPH_CHECK_NS per process), trims, memory queries and before refusals. */
#define GRAPH_CHECK_NS (100ull * 1000000ull)

static void reconcile_graph_mem_locked(int dev) {
    cuDeviceGetGraphMemAttribute_fn get = REAL(cuDeviceGetGraphMemAttribute);
    cuuint64_t now = 0;
    if (!get || get(dev, CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT, &now) != CUDA_SUCCESS) return;
    if (now > graph_counted[dev]) reserve(dev, now - graph_counted[dev], 0, 1); /* held already */
    else if (now < graph_counted[dev]) vgpu_mem_release(dev, graph_counted[dev] - now, 0);
    graph_counted[dev] = now;
}

void vgpu_graph_launched(void) {
    if (!accounting()) return;
    uint64_t now = vgpu_coarse_real_ns(), last = atomic_load(&graph_checked_at);
    if (now - last < GRAPH_CHECK_NS || !atomic_compare_exchange_strong(&graph_checked_at, &last, now))
        return;
    CUdevice dev;
    vgpu_current_device(&dev);
    if (dev < 0 || dev >= VGPU_MAX_DEV) return;
    pthread_mutex_lock(&pool_lock);
    reconcile_graph_mem_locked(dev);
    pthread_mutex_unlock(&pool_lock);
}

VGPU_EXPORT CUresult cuDeviceGraphMemTrim(CUdevice dev) {
    CUresult rc = ready();
    if (rc != CUDA_SUCCESS) return rc;
    cuDeviceGraphMemTrim_fn real = REAL(cuDeviceGraphMemTrim);
    if (!real) return CUDA_ERROR_NOT_FOUND;
    rc = real(dev);
    if (rc == CUDA_SUCCESS && accounting() && dev >= 0 && dev < VGPU_MAX_DEV) {
        pthread_mutex_lock(&pool_lock);
        reconcile_graph_mem_locked(dev);
        pthread_mutex_unlock(&pool_lock);
    }
    return rc;
}

/* Every pool of dev, and its graph memory, reconciled (memory queries; before refusals). */
static void reconcile_pools(int dev) {
    pthread_mutex_lock(&pool_lock);
    for (int i = 0; i < MAX_POOLS; i++)
        if (pools[i].pool && pools[i].dev == dev) reconcile_locked(i, 0);
    reconcile_graph_mem_locked(dev);
    pthread_mutex_unlock(&pool_lock);
}

/* What a pool holds reserved but not in use: a new block up to this size needs nothing new. */
static uint64_t pool_idle(CUmemoryPool pool) {
    cuMemPoolGetAttribute_fn get = REAL(cuMemPoolGetAttribute);
    cuuint64_t reserved = 0, used = 0;
    if (!get || get(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, &reserved) != CUDA_SUCCESS ||
        get(pool, CU_MEMPOOL_ATTR_USED_MEM_CURRENT, &used) != CUDA_SUCCESS)
        return 0;
    return reserved > used ? reserved - used : 0;
}

static CUresult alloc_async(int id, CUdeviceptr *dptr, size_t bytes, CUmemoryPool pool,
                            CUstream s) {
    int dev;
    CUcontext ctx;
    CUresult rc = begin(id, 0, &dev, &ctx); /* ready, real present, which GPU */
    if (rc != CUDA_SUCCESS) return rc;
    void *real = atomic_load(&vgpu_hooks[id].real);
    int from_pool = !(id == H_cuMemAllocAsync || id == H_cuMemAllocAsync_ptsz);
    CUmemoryPool counted_pool = pool;
    cuDeviceGetMemPool_fn current = REAL(cuDeviceGetMemPool);
    if (dev >= 0 && !from_pool && (!current || current(&counted_pool, dev) != CUDA_SUCCESS))
        counted_pool = NULL;
    uint64_t reserved;
    int by_pool = dev >= 0 && counted_pool && pool_reserved(counted_pool, &reserved) == 0;
    uint64_t idle = by_pool ? pool_idle(counted_pool) : 0;
    uint64_t need = bytes > idle ? bytes - idle : 0; /* reuse needs nothing new */
    if (dev >= 0) {
        rc = vgpu_mem_reserve(dev, need, 0);
        if (rc == CUDA_ERROR_OUT_OF_MEMORY) {
            vgpu_mem_true_up(dev, 1);
            rc = vgpu_mem_reserve(dev, need, 0);
        }
        if (rc != CUDA_SUCCESS) return rc;
    }
    rc = from_pool ? ((cuMemAllocFromPoolAsync_fn)real)(dptr, bytes, pool, s)
                   : ((cuMemAllocAsync_fn)real)(dptr, bytes, s);
    if (dev < 0) return rc;
    if (!by_pool) return end(rc, rc == CUDA_SUCCESS ? *dptr : 0, K_PTR, dev, ctx, bytes);
    pthread_mutex_lock(&pool_lock);
    int i = pool_slot_locked(counted_pool, dev);
    if (i >= 0) reconcile_locked(i, need);
    pthread_mutex_unlock(&pool_lock);
    if (i < 0) { /* no room to follow it: per block */
        if (need < bytes && rc == CUDA_SUCCESS) reserve(dev, bytes - need, 0, 1);
        return end(rc, rc == CUDA_SUCCESS ? *dptr : 0, K_PTR, dev, ctx, bytes);
    }
    if (rc == CUDA_SUCCESS) track(*dptr, K_ASYNC, 0, dev, (CUcontext)counted_pool);
    return rc;
}

VGPU_EXPORT CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t keep) {
    CUresult rc = ready();
    if (rc != CUDA_SUCCESS) return rc;
    cuMemPoolTrimTo_fn real = REAL(cuMemPoolTrimTo);
    if (!real) return CUDA_ERROR_NOT_FOUND;
    rc = real(pool, keep);
    if (rc != CUDA_SUCCESS || !accounting()) return rc;
    pthread_mutex_lock(&pool_lock);
    for (int i = 0; i < MAX_POOLS; i++)
        if (pools[i].pool == pool) reconcile_locked(i, 0);
    pthread_mutex_unlock(&pool_lock);
    return rc;
}

VGPU_EXPORT CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytes, CUstream s) {
    return alloc_async(H_cuMemAllocAsync, dptr, bytes, NULL, s);
}
VGPU_EXPORT CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytes, CUstream s) {
    return alloc_async(H_cuMemAllocAsync_ptsz, dptr, bytes, NULL, s);
}
VGPU_EXPORT CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytes, CUmemoryPool pool,
                                             CUstream s) {
    return alloc_async(H_cuMemAllocFromPoolAsync, dptr, bytes, pool, s);
}
VGPU_EXPORT CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytes,
                                                  CUmemoryPool pool, CUstream s) {
    return alloc_async(H_cuMemAllocFromPoolAsync_ptsz, dptr, bytes, pool, s);
}

VGPU_EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pitch, size_t width,
                                        size_t height, unsigned int elem) {
    uint64_t est = ((width + PITCH_ALIGN - 1) / PITCH_ALIGN) * PITCH_ALIGN * height;
    int dev;
    CUcontext ctx;
    CUresult rc = begin(H_cuMemAllocPitch_v2, est, &dev, &ctx);
    if (rc != CUDA_SUCCESS) return rc;
    rc = REAL(cuMemAllocPitch_v2)(dptr, pitch, width, height, elem);
    if (dev < 0 || rc != CUDA_SUCCESS) return end(rc, 0, K_PTR, dev, ctx, est);
    uint64_t actual = (uint64_t)*pitch * height;
    if (settle(dev, est, actual, 0) != CUDA_SUCCESS) {
        REAL(cuMemFree_v2)(*dptr);
        vgpu_mem_release(dev, est, 0);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    return end(rc, *dptr, K_PTR, dev, ctx, actual);
}

static CUresult free_ptr(int id, CUdeviceptr p, CUstream s) {
    CUresult rc = ready();
    if (rc != CUDA_SUCCESS) return rc;
    void *real = atomic_load(&vgpu_hooks[id].real);
    if (!real) return CUDA_ERROR_NOT_FOUND;
    struct entry e;
    int had = p && accounting() && take(p, K_PTR, &e);
    int async = !had && p && accounting() && take(p, K_ASYNC, &e);
    rc = id == H_cuMemFree_v2 ? ((cuMemFree_v2_fn)real)(p) : ((cuMemFreeAsync_fn)real)(p, s);
    if (had) {
        if (rc == CUDA_SUCCESS) vgpu_mem_release(e.dev, e.size, 0);
        else put_back(&e);
    } else if (async) { /* back into its pool: counted while the pool keeps it */
        if (rc != CUDA_SUCCESS) put_back(&e);
        pthread_mutex_lock(&pool_lock);
        for (int i = 0; i < MAX_POOLS; i++)
            if (pools[i].pool == (CUmemoryPool)e.ctx) reconcile_locked(i, 0);
        pthread_mutex_unlock(&pool_lock);
    }
    return rc;
}

VGPU_EXPORT CUresult cuMemFree_v2(CUdeviceptr p) { return free_ptr(H_cuMemFree_v2, p, NULL); }
VGPU_EXPORT CUresult cuMemFreeAsync(CUdeviceptr p, CUstream s) {
    return free_ptr(H_cuMemFreeAsync, p, s);
}
VGPU_EXPORT CUresult cuMemFreeAsync_ptsz(CUdeviceptr p, CUstream s) {
    return free_ptr(H_cuMemFreeAsync_ptsz, p, s);
}

/* VMM: physical memory is created per device and lives until cuMemRelease (no context). */
VGPU_EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t bytes,
                                 const CUmemAllocationProp *prop, unsigned long long flags) {
    CUresult rc = ready();
    if (rc != CUDA_SUCCESS) return rc;
    cuMemCreate_fn real = REAL(cuMemCreate);
    if (!real) return CUDA_ERROR_NOT_FOUND;
    if (!accounting() || !prop || prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE ||
        prop->location.id < 0 || prop->location.id >= VGPU_MAX_DEV)
        return real(handle, bytes, prop, flags);
    int dev = prop->location.id;
    rc = vgpu_mem_reserve(dev, bytes, 0);
    if (rc != CUDA_SUCCESS) return rc;
    rc = real(handle, bytes, prop, flags);
    return end(rc, rc == CUDA_SUCCESS ? *handle : 0, K_VMM, dev, NULL, bytes);
}

static int is_mapped(CUmemGenericAllocationHandle handle) {
    int n = 0;
    pthread_mutex_lock(&table_lock);
    for (size_t i = 0; i < table_cap && !n; i++)
        n = table[i].key && table[i].kind == K_MAP && table[i].size == handle;
    pthread_mutex_unlock(&table_lock);
    return n;
}

/* A handle's memory lives until it is released and no mapping of it is left. */
VGPU_EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
    CUresult rc = ready();
    if (rc != CUDA_SUCCESS) return rc;
    cuMemRelease_fn real = REAL(cuMemRelease);
    if (!real) return CUDA_ERROR_NOT_FOUND;
    struct entry e;
    int had = handle && accounting() && take(handle, K_VMM, &e);
    rc = real(handle);
    if (had) {
        if (rc != CUDA_SUCCESS) put_back(&e);
        else if (is_mapped(handle)) track(handle, K_VMM_GONE, e.size, e.dev, NULL);
        else vgpu_mem_release(e.dev, e.size, 0);
    }
    return rc;
}

VGPU_EXPORT CUresult cuMemMap(CUdeviceptr va, size_t size, size_t offset,
                              CUmemGenericAllocationHandle handle, unsigned long long flags) {
    CUresult rc = ready();
    if (rc != CUDA_SUCCESS) return rc;
    cuMemMap_fn real = REAL(cuMemMap);
    if (!real) return CUDA_ERROR_NOT_FOUND;
    rc = real(va, size, offset, handle, flags);
    if (rc == CUDA_SUCCESS && accounting() && va) track(va, K_MAP, handle, 0, NULL);
    return rc;
}

VGPU_EXPORT CUresult cuMemUnmap(CUdeviceptr va, size_t size) {
    CUresult rc = ready();
    if (rc != CUDA_SUCCESS) return rc;
    cuMemUnmap_fn real = REAL(cuMemUnmap);
    if (!real) return CUDA_ERROR_NOT_FOUND;
    rc = real(va, size);
    if (rc != CUDA_SUCCESS || !accounting()) return rc;
    CUmemGenericAllocationHandle gone[64];
    int n = 0;
    pthread_mutex_lock(&table_lock); /* every mapping in [va, va + size) */
    for (size_t i = 0; i < table_cap && n < 64;) {
        if (table[i].key && table[i].kind == K_MAP && table[i].key >= va &&
            table[i].key - va < size) {
            gone[n++] = table[i].size;
            delete_at_locked(i); /* something may have shifted into i: look again */
            continue;
        }
        i++;
    }
    pthread_mutex_unlock(&table_lock);
    for (int k = 0; k < n; k++) {
        struct entry e;
        if (!is_mapped(gone[k]) && take(gone[k], K_VMM_GONE, &e))
            vgpu_mem_release(e.dev, e.size, 0);
    }
    return rc;
}

/* ---- arrays ---------------------------------------------------------------------------- */

static uint64_t element_bytes(CUarray_format f, unsigned channels) {
    uint64_t b;
    switch (f) {
    case CU_AD_FORMAT_UNSIGNED_INT8:
    case CU_AD_FORMAT_SIGNED_INT8: b = 1; break;
    case CU_AD_FORMAT_UNSIGNED_INT16:
    case CU_AD_FORMAT_SIGNED_INT16:
    case CU_AD_FORMAT_HALF: b = 2; break;
    default: b = 4; break; /* 32-bit formats; others are corrected by the driver's answer */
    }
    return b * (channels ? channels : 1);
}

static uint64_t dim(size_t v) { return v ? v : 1; }

static uint64_t array3d_bytes(const CUDA_ARRAY3D_DESCRIPTOR *d, unsigned levels) {
    uint64_t total = 0, e = element_bytes(d->Format, d->NumChannels);
    int layered = (d->Flags & (CUDA_ARRAY3D_LAYERED | CUDA_ARRAY3D_CUBEMAP)) != 0;
    for (unsigned l = 0; l < (levels ? levels : 1); l++) {
        uint64_t w = dim(d->Width >> l), h = d->Height ? dim(d->Height >> l) : 1;
        uint64_t z = layered ? dim(d->Depth) : (d->Depth ? dim(d->Depth >> l) : 1);
        total += w * h * z * e;
    }
    return total;
}

/* After an array was created with est reserved: correct to the driver's own size. */
static CUresult settle_array(int dev, uint64_t est, uint64_t actual, void *handle, int kind) {
    if (settle(dev, est, actual, 0) == CUDA_SUCCESS) return CUDA_SUCCESS;
    if (kind == K_ARRAY) REAL(cuArrayDestroy)((CUarray)handle);
    else REAL(cuMipmappedArrayDestroy)((CUmipmappedArray)handle);
    vgpu_mem_release(dev, est, 0);
    return CUDA_ERROR_OUT_OF_MEMORY;
}

static uint64_t array_actual(CUarray a, int dev, uint64_t est) {
    CUDA_ARRAY_MEMORY_REQUIREMENTS req;
    cuArrayGetMemoryRequirements_fn get = REAL(cuArrayGetMemoryRequirements);
    memset(&req, 0, sizeof(req));
    if (get && get(&req, a, dev) == CUDA_SUCCESS && req.size) return req.size;
    return est;
}

static CUresult array_create(int id, CUarray *arr, uint64_t est, const void *desc) {
    int dev;
    CUcontext ctx;
    CUresult rc = begin(id, est, &dev, &ctx);
    if (rc != CUDA_SUCCESS) return rc;
    if (id == H_cuArrayCreate_v2)
        rc = REAL(cuArrayCreate_v2)(arr, (const CUDA_ARRAY_DESCRIPTOR *)desc);
    else
        rc = REAL(cuArray3DCreate_v2)(arr, (const CUDA_ARRAY3D_DESCRIPTOR *)desc);
    if (dev < 0 || rc != CUDA_SUCCESS) return end(rc, 0, K_ARRAY, dev, ctx, est);
    uint64_t actual = array_actual(*arr, dev, est);
    rc = settle_array(dev, est, actual, *arr, K_ARRAY);
    if (rc != CUDA_SUCCESS) return rc;
    return end(CUDA_SUCCESS, (uint64_t)(uintptr_t)*arr, K_ARRAY, dev, ctx, actual);
}

VGPU_EXPORT CUresult cuArrayCreate_v2(CUarray *arr, const CUDA_ARRAY_DESCRIPTOR *d) {
    uint64_t est = d ? dim(d->Width) * dim(d->Height) * element_bytes(d->Format, d->NumChannels)
                     : 0;
    return array_create(H_cuArrayCreate_v2, arr, est, d);
}

VGPU_EXPORT CUresult cuArray3DCreate_v2(CUarray *arr, const CUDA_ARRAY3D_DESCRIPTOR *d) {
    return array_create(H_cuArray3DCreate_v2, arr, d ? array3d_bytes(d, 1) : 0, d);
}

VGPU_EXPORT CUresult cuMipmappedArrayCreate(CUmipmappedArray *arr,
                                            const CUDA_ARRAY3D_DESCRIPTOR *d, unsigned levels) {
    uint64_t est = d ? array3d_bytes(d, levels) : 0;
    int dev;
    CUcontext ctx;
    CUresult rc = begin(H_cuMipmappedArrayCreate, est, &dev, &ctx);
    if (rc != CUDA_SUCCESS) return rc;
    rc = REAL(cuMipmappedArrayCreate)(arr, d, levels);
    if (dev < 0 || rc != CUDA_SUCCESS) return end(rc, 0, K_MIPMAP, dev, ctx, est);
    uint64_t actual = est;
    CUDA_ARRAY_MEMORY_REQUIREMENTS req;
    memset(&req, 0, sizeof(req));
    cuMipmappedArrayGetMemoryRequirements_fn get = REAL(cuMipmappedArrayGetMemoryRequirements);
    if (get && get(&req, *arr, dev) == CUDA_SUCCESS && req.size) actual = req.size;
    rc = settle_array(dev, est, actual, *arr, K_MIPMAP);
    if (rc != CUDA_SUCCESS) return rc;
    return end(CUDA_SUCCESS, (uint64_t)(uintptr_t)*arr, K_MIPMAP, dev, ctx, actual);
}

static CUresult destroy_array(int id, void *handle, int kind) {
    CUresult rc = ready();
    if (rc != CUDA_SUCCESS) return rc;
    void *real = atomic_load(&vgpu_hooks[id].real);
    if (!real) return CUDA_ERROR_NOT_FOUND;
    struct entry e;
    int had = handle && accounting() && take((uint64_t)(uintptr_t)handle, (uint8_t)kind, &e);
    rc = kind == K_ARRAY ? ((cuArrayDestroy_fn)real)((CUarray)handle)
                         : ((cuMipmappedArrayDestroy_fn)real)((CUmipmappedArray)handle);
    if (had) {
        if (rc == CUDA_SUCCESS) vgpu_mem_release(e.dev, e.size, 0);
        else put_back(&e);
    }
    return rc;
}

VGPU_EXPORT CUresult cuArrayDestroy(CUarray a) { return destroy_array(H_cuArrayDestroy, a, K_ARRAY); }
VGPU_EXPORT CUresult cuMipmappedArrayDestroy(CUmipmappedArray a) {
    return destroy_array(H_cuMipmappedArrayDestroy, a, K_MIPMAP);
}

/* ---- queries report the slice ---------------------------------------------------------- */

VGPU_EXPORT CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total_bytes) {
    CUresult rc = ready();
    if (rc != CUDA_SUCCESS) return rc;
    cuMemGetInfo_v2_fn real = REAL(cuMemGetInfo_v2);
    if (!real) return CUDA_ERROR_NOT_FOUND;
    rc = real(free_bytes, total_bytes);
    if (rc != CUDA_SUCCESS || !accounting() || !free_bytes || !total_bytes) return rc;
    CUdevice dev;
    vgpu_current_device(&dev);
    uint64_t limit = vgpu_limit(dev);
    if (limit == VGPU_UNLIMITED) return rc;
    vgpu_mem_true_up(dev, 1);
    uint64_t used = vgpu_container_used(dev);
    uint64_t total = limit < *total_bytes ? limit : *total_bytes;
    uint64_t avail = used >= total ? 0 : total - used;
    *total_bytes = (size_t)total;
    if (avail < *free_bytes) *free_bytes = (size_t)avail;
    return rc;
}

VGPU_EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev) {
    CUresult rc = ready();
    if (rc != CUDA_SUCCESS) return rc;
    cuDeviceTotalMem_v2_fn real = REAL(cuDeviceTotalMem_v2);
    if (!real) return CUDA_ERROR_NOT_FOUND;
    rc = real(bytes, dev);
    if (rc != CUDA_SUCCESS || !bytes || !accounting()) return rc;
    uint64_t limit = vgpu_limit(dev);
    if (limit < *bytes) *bytes = (size_t)limit;
    return rc;
}

/* ---- contexts and modules: the driver's own memory counts ------------------------------- */

static pthread_mutex_t ctx_lock = PTHREAD_MUTEX_INITIALIZER;
#define MAX_TRACKED 1024
static struct owned {
    void *handle; /* a CUcontext, CUmodule or CUlibrary */
    int dev;
    uint64_t bytes;
} owned[MAX_TRACKED];
static int primary_refs[VGPU_MAX_DEV];
static CUcontext primary_ctx[VGPU_MAX_DEV];
static uint64_t primary_bytes[VGPU_MAX_DEV];

static void vgpu_ctx_after_fork_child(void) {
    pthread_mutex_init(&ctx_lock, NULL);
    memset(owned, 0, sizeof(owned));
    memset(primary_refs, 0, sizeof(primary_refs));
    memset(primary_ctx, 0, sizeof(primary_ctx));
    memset(primary_bytes, 0, sizeof(primary_bytes));
}

static void own(void *handle, int dev, uint64_t bytes) {
    for (int i = 0; i < MAX_TRACKED; i++)
        if (!owned[i].handle) {
            owned[i] = (struct owned){handle, dev, bytes};
            return;
        }
}

static int disown(void *handle, struct owned *out) {
    for (int i = 0; i < MAX_TRACKED; i++)
        if (owned[i].handle == handle) {
            *out = owned[i];
            memset(&owned[i], 0, sizeof(owned[i]));
            return 1;
        }
    return 0;
}

/* Measuring the driver's memory for this process around a call. */
struct measure {
    int ok;
    uint64_t before, local_before;
};

static void measure_begin(int dev, struct measure *m) {
    m->ok = vgpu_nvml_process_used(dev, &m->before) >= 0; /* not listed yet: 0 bytes */
    m->local_before = atomic_load(&local_alloc[dev]);
}

/* The driver's own growth during the call (allocations counted meanwhile excluded), or -1. */
static int64_t measure_end(int dev, const struct measure *m) {
    uint64_t after;
    if (!m->ok || vgpu_nvml_process_used(dev, &after) != 0) return -1;
    uint64_t local = atomic_load(&local_alloc[dev]);
    uint64_t counted = local > m->local_before ? local - m->local_before : 0;
    int64_t grew = (int64_t)after - (int64_t)m->before - (int64_t)counted;
    return grew > 0 ? grew : 0;
}

static uint64_t context_estimate(int measurable) {
    if (vgpu.cfg.context_bytes >= 0) return (uint64_t)vgpu.cfg.context_bytes;
    return measurable ? 0 : DEFAULT_CONTEXT_BYTES;
}

typedef CUresult (*ctx_call)(void *args);

/* Charges a context's own memory around call(): reserve the estimate, create, correct to the
 * measured size. On OOM after creation, undo() destroys it. Returns the bytes charged. */
static CUresult charged_create(int dev, ctx_call call, void *args, void (*undo)(void *),
                               uint64_t *charged, CUcontext *pctx) {
    struct vgpu_pidsnap snap;
    vgpu_host_pid_before(dev, &snap);
    struct measure m;
    measure_begin(dev, &m);
    uint64_t est = context_estimate(m.ok);
    CUresult rc = vgpu_mem_reserve(dev, est, 1);
    if (rc != CUDA_SUCCESS) return rc;
    rc = call(args);
    if (rc != CUDA_SUCCESS) {
        vgpu_mem_release(dev, est, 1);
        return rc;
    }
    vgpu_host_pid_after(dev, &snap, *pctx);
    uint64_t actual = est;
    if (vgpu.cfg.context_bytes < 0) {
        int64_t grew = measure_end(dev, &m);
        actual = grew >= 0 ? (uint64_t)grew : DEFAULT_CONTEXT_BYTES;
    }
    if (settle(dev, est, actual, 1) != CUDA_SUCCESS) {
        undo(args);
        vgpu_mem_release(dev, est, 1);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *charged = actual;
    return CUDA_SUCCESS;
}

struct ctx_args {
    int version;
    CUcontext *pctx;
    unsigned int flags;
    CUdevice dev;
    void *params;
    int nparams;
};

static CUresult do_ctx_create(void *p) {
    struct ctx_args *a = p;
    switch (a->version) {
    case 3: return REAL(cuCtxCreate_v3)(a->pctx, a->params, a->nparams, a->flags, a->dev);
    case 4: return REAL(cuCtxCreate_v4)(a->pctx, a->params, a->flags, a->dev);
    default: return REAL(cuCtxCreate_v2)(a->pctx, a->flags, a->dev);
    }
}

static void undo_ctx_create(void *p) { REAL(cuCtxDestroy_v2)(*((struct ctx_args *)p)->pctx); }

static CUresult ctx_create(int id, struct ctx_args *a) {
    CUresult rc = ready();
    if (rc != CUDA_SUCCESS) return rc;
    if (!atomic_load(&vgpu_hooks[id].real)) return CUDA_ERROR_NOT_FOUND;
    if (!accounting() || a->dev < 0 || a->dev >= VGPU_MAX_DEV || !a->pctx) return do_ctx_create(a);
    uint64_t charged = 0;
    pthread_mutex_lock(&ctx_lock);
    rc = charged_create(a->dev, do_ctx_create, a, undo_ctx_create, &charged, a->pctx);
    if (rc == CUDA_SUCCESS) own(*a->pctx, a->dev, charged);
    pthread_mutex_unlock(&ctx_lock);
    return rc;
}

VGPU_EXPORT CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev) {
    struct ctx_args a = {2, pctx, flags, dev, NULL, 0};
    return ctx_create(H_cuCtxCreate_v2, &a);
}
VGPU_EXPORT CUresult cuCtxCreate_v3(CUcontext *pctx, CUexecAffinityParam *params, int n,
                                    unsigned int flags, CUdevice dev) {
    struct ctx_args a = {3, pctx, flags, dev, params, n};
    return ctx_create(H_cuCtxCreate_v3, &a);
}
VGPU_EXPORT CUresult cuCtxCreate_v4(CUcontext *pctx, CUctxCreateParams *params, unsigned int flags,
                                    CUdevice dev) {
    struct ctx_args a = {4, pctx, flags, dev, params, 0};
    return ctx_create(H_cuCtxCreate_v4, &a);
}

VGPU_EXPORT CUresult cuCtxDestroy_v2(CUcontext ctx) {
    CUresult rc = ready();
    if (rc != CUDA_SUCCESS) return rc;
    cuCtxDestroy_v2_fn real = REAL(cuCtxDestroy_v2);
    if (!real) return CUDA_ERROR_NOT_FOUND;
    rc = real(ctx);
    if (rc != CUDA_SUCCESS || !accounting()) return rc;
    struct owned o;
    pthread_mutex_lock(&ctx_lock);
    int had = disown(ctx, &o);
    pthread_mutex_unlock(&ctx_lock);
    if (had) vgpu_mem_release(o.dev, o.bytes, 1);
    vgpu_mem_forget_context(ctx);
    return rc;
}

struct retain_args {
    CUcontext *pctx;
    CUdevice dev;
};
static CUresult do_retain(void *p) {
    struct retain_args *a = p;
    return REAL(cuDevicePrimaryCtxRetain)(a->pctx, a->dev);
}
static void undo_retain(void *p) { REAL(cuDevicePrimaryCtxRelease_v2)(((struct retain_args *)p)->dev); }

VGPU_EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) {
    CUresult rc = ready();
    if (rc != CUDA_SUCCESS) return rc;
    if (!REAL(cuDevicePrimaryCtxRetain)) return CUDA_ERROR_NOT_FOUND;
    struct retain_args a = {pctx, dev};
    if (!accounting() || dev < 0 || dev >= VGPU_MAX_DEV || !pctx) return do_retain(&a);
    pthread_mutex_lock(&ctx_lock);
    if (primary_refs[dev] > 0) {
        rc = do_retain(&a);
        if (rc == CUDA_SUCCESS) primary_refs[dev]++;
    } else {
        uint64_t charged = 0;
        rc = charged_create(dev, do_retain, &a, undo_retain, &charged, pctx);
        if (rc == CUDA_SUCCESS) {
            primary_refs[dev] = 1;
            primary_ctx[dev] = *pctx;
            primary_bytes[dev] = charged;
        }
    }
    pthread_mutex_unlock(&ctx_lock);
    return rc;
}

VGPU_EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
    CUresult rc = ready();
    if (rc != CUDA_SUCCESS) return rc;
    cuDevicePrimaryCtxRelease_v2_fn real = REAL(cuDevicePrimaryCtxRelease_v2);
    if (!real) return CUDA_ERROR_NOT_FOUND;
    rc = real(dev);
    if (rc != CUDA_SUCCESS || !accounting() || dev < 0 || dev >= VGPU_MAX_DEV) return rc;
    CUcontext gone = NULL;
    uint64_t bytes = 0;
    pthread_mutex_lock(&ctx_lock);
    if (primary_refs[dev] > 0 && --primary_refs[dev] == 0) {
        gone = primary_ctx[dev];
        bytes = primary_bytes[dev];
        primary_ctx[dev] = NULL;
        primary_bytes[dev] = 0;
    }
    pthread_mutex_unlock(&ctx_lock);
    if (gone) {
        vgpu_mem_release(dev, bytes, 1);
        vgpu_mem_forget_context(gone);
    }
    return rc;
}

VGPU_EXPORT CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev) {
    CUresult rc = ready();
    if (rc != CUDA_SUCCESS) return rc;
    cuDevicePrimaryCtxReset_v2_fn real = REAL(cuDevicePrimaryCtxReset_v2);
    if (!real) return CUDA_ERROR_NOT_FOUND;
    rc = real(dev);
    if (rc == CUDA_SUCCESS && accounting() && dev >= 0 && dev < VGPU_MAX_DEV) {
        pthread_mutex_lock(&ctx_lock);
        CUcontext c = primary_ctx[dev];
        pthread_mutex_unlock(&ctx_lock);
        if (c) vgpu_mem_forget_context(c); /* its allocations are gone; the context stays charged */
    }
    return rc;
}

/* Modules and libraries: whatever the driver's usage for this process grew by while loading
 * (measured through NVML when it can see this process) is charged until the unload. */
struct load_args {
    int id;
    void **out;
    const void *a;
    unsigned int n;
    int *opts;
    void **vals;
    int *lopts;
    void **lvals;
    unsigned int ln;
};

static CUresult do_load(void *p) {
    struct load_args *l = p;
    switch (l->id) {
    case H_cuModuleLoad: return REAL(cuModuleLoad)((CUmodule *)l->out, l->a);
    case H_cuModuleLoadData: return REAL(cuModuleLoadData)((CUmodule *)l->out, l->a);
    case H_cuModuleLoadDataEx:
        return REAL(cuModuleLoadDataEx)((CUmodule *)l->out, l->a, l->n, l->opts, l->vals);
    case H_cuModuleLoadFatBinary: return REAL(cuModuleLoadFatBinary)((CUmodule *)l->out, l->a);
    case H_cuLibraryLoadData:
        return REAL(cuLibraryLoadData)((CUlibrary *)l->out, l->a, l->opts, l->vals, l->n,
                                       l->lopts, l->lvals, l->ln);
    default:
        return REAL(cuLibraryLoadFromFile)((CUlibrary *)l->out, l->a, l->opts, l->vals, l->n,
                                           l->lopts, l->lvals, l->ln);
    }
}

static void undo_load(void *p) {
    struct load_args *l = p;
    if (l->id == H_cuLibraryLoadData || l->id == H_cuLibraryLoadFromFile)
        REAL(cuLibraryUnload)(*(CUlibrary *)l->out);
    else
        REAL(cuModuleUnload)(*(CUmodule *)l->out);
}

static CUresult load(struct load_args *l) {
    CUresult rc = ready();
    if (rc != CUDA_SUCCESS) return rc;
    if (!atomic_load(&vgpu_hooks[l->id].real)) return CUDA_ERROR_NOT_FOUND;
    if (!accounting() || !l->out) return do_load(l);
    CUdevice dev;
    vgpu_current_device(&dev);
    if (dev >= VGPU_MAX_DEV) return do_load(l);
    struct measure m;
    measure_begin(dev, &m);
    rc = do_load(l);
    if (rc != CUDA_SUCCESS) return rc;
    int64_t grew = measure_end(dev, &m);
    if (grew <= 0) return rc;
    if (vgpu_mem_reserve(dev, (uint64_t)grew, 1) != CUDA_SUCCESS) {
        undo_load(l);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    pthread_mutex_lock(&ctx_lock);
    own(*l->out, dev, (uint64_t)grew);
    pthread_mutex_unlock(&ctx_lock);
    return rc;
}

VGPU_EXPORT CUresult cuModuleLoad(CUmodule *m, const char *fname) {
    struct load_args l = {.id = H_cuModuleLoad, .out = (void **)m, .a = fname};
    return load(&l);
}
VGPU_EXPORT CUresult cuModuleLoadData(CUmodule *m, const void *image) {
    struct load_args l = {.id = H_cuModuleLoadData, .out = (void **)m, .a = image};
    return load(&l);
}
VGPU_EXPORT CUresult cuModuleLoadDataEx(CUmodule *m, const void *image, unsigned int n, int *opts,
                                        void **vals) {
    struct load_args l = {.id = H_cuModuleLoadDataEx, .out = (void **)m, .a = image, .n = n,
                          .opts = opts, .vals = vals};
    return load(&l);
}
VGPU_EXPORT CUresult cuModuleLoadFatBinary(CUmodule *m, const void *fatbin) {
    struct load_args l = {.id = H_cuModuleLoadFatBinary, .out = (void **)m, .a = fatbin};
    return load(&l);
}
VGPU_EXPORT CUresult cuLibraryLoadData(CUlibrary *lib, const void *code, int *opts, void **vals,
                                       unsigned int n, int *lopts, void **lvals, unsigned int ln) {
    struct load_args l = {H_cuLibraryLoadData, (void **)lib, code, n, opts, vals, lopts, lvals, ln};
    return load(&l);
}
VGPU_EXPORT CUresult cuLibraryLoadFromFile(CUlibrary *lib, const char *file, int *opts,
                                           void **vals, unsigned int n, int *lopts, void **lvals,
                                           unsigned int ln) {
    struct load_args l = {H_cuLibraryLoadFromFile, (void **)lib, file, n, opts, vals, lopts,
                          lvals, ln};
    return load(&l);
}

static CUresult unload(int id, void *handle) {
    CUresult rc = ready();
    if (rc != CUDA_SUCCESS) return rc;
    void *real = atomic_load(&vgpu_hooks[id].real);
    if (!real) return CUDA_ERROR_NOT_FOUND;
    rc = id == H_cuModuleUnload ? ((cuModuleUnload_fn)real)((CUmodule)handle)
                                : ((cuLibraryUnload_fn)real)((CUlibrary)handle);
    if (rc != CUDA_SUCCESS || !accounting() || !handle) return rc;
    struct owned o;
    pthread_mutex_lock(&ctx_lock);
    int had = disown(handle, &o);
    pthread_mutex_unlock(&ctx_lock);
    if (had) vgpu_mem_release(o.dev, o.bytes, 1);
    return rc;
}

VGPU_EXPORT CUresult cuModuleUnload(CUmodule m) { return unload(H_cuModuleUnload, m); }
VGPU_EXPORT CUresult cuLibraryUnload(CUlibrary l) { return unload(H_cuLibraryUnload, l); }
