/*
 * region.c: the shared-memory regions.
 *
 *  - container region (one per container, cfg.container_region): per-process slots with
 *    memory in use per GPU and the last launch time, the container's totals, the compute
 *    limiter's shared state;
 *  - node region (one per GPU, <node_region_dir>/<GPU uuid>.region): one entry per container
 *    on that GPU with its priority, last launch and memory in use; where the container may only
 *    read it (Kubernetes), the node agent writes the entry from the container region's card[];
 *  - activity file (optional, cfg.activity_file): a container-wide summary for the culler.
 *
 * Files are fixed-size and versioned. A new file is initialised under a temporary name and
 * linked into place, so nobody ever maps a half-initialised region, and nobody waits on a
 * node-wide lock to start. Structural changes happen under a PTHREAD_MUTEX_ROBUST mutex in the
 * region; a process that dies holding it hands the next locker EOWNERDEAD, which marks it
 * consistent and repairs the totals from the slots.
 *
 * Liveness does not depend on pids (which are per namespace and get reused): each process
 * holds an OFD lock on one byte per slot/entry (past EOF) for as long as it lives; the kernel
 * drops it when the process dies, SIGKILL included. Anyone with the file open can test it.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "vgpu.h"

/* getrandom (glibc 2.25) and renameat2 (glibc 2.28) are called through syscall(2): the shim is
 * built against glibc 2.17 (manylinux2014) so that it loads in old CUDA images too. The numbers
 * are the kernel's, for headers older than the calls (the kernel answers ENOSYS if it lacks them,
 * and each caller has a fallback). */
#ifndef SYS_getrandom
#if defined(__x86_64__)
#define SYS_getrandom 318
#elif defined(__aarch64__)
#define SYS_getrandom 278
#endif
#endif
#ifndef SYS_renameat2
#if defined(__x86_64__)
#define SYS_renameat2 316
#elif defined(__aarch64__)
#define SYS_renameat2 276
#endif
#endif
#define VGPU_GRND_NONBLOCK 0x0001
#define VGPU_RENAME_NOREPLACE (1 << 0)

_Static_assert(sizeof(struct vgpu_slot) == 320, "slot layout");
_Static_assert(sizeof(struct vgpu_compute) == 128, "compute layout");
_Static_assert(__builtin_offsetof(struct vgpu_container_region, lock) == 128, "layout");
_Static_assert(__builtin_offsetof(struct vgpu_container_region, used) == 192, "layout");
_Static_assert(__builtin_offsetof(struct vgpu_container_region, compute) == 512, "layout");
_Static_assert(__builtin_offsetof(struct vgpu_container_region, slots) == 4096, "layout");
_Static_assert(sizeof(struct vgpu_node_entry) == 128, "node entry layout");
_Static_assert(__builtin_offsetof(struct vgpu_node_region, entries) == 256, "layout");
_Static_assert(sizeof(struct vgpu_activity) == 4096, "activity layout");
_Static_assert(sizeof(pthread_mutex_t) <= 64, "mutex fits its pad");

struct head {
    char magic[8];
    uint32_t version;
    uint32_t kind;
    uint64_t size;
    uint64_t created_ns;
};

static char region_path[PATH_MAX];
static char node_path[VGPU_MAX_DEV][PATH_MAX];

/* ---- locks --------------------------------------------------------------------------------- */

static void init_robust_mutex(pthread_mutex_t *m) {
    pthread_mutexattr_t a;
    pthread_mutexattr_init(&a);
    pthread_mutexattr_setpshared(&a, PTHREAD_PROCESS_SHARED);
    pthread_mutexattr_setrobust(&a, PTHREAD_MUTEX_ROBUST);
    pthread_mutex_init(m, &a);
    pthread_mutexattr_destroy(&a);
}

/* A lock holder that keeps the lock this long is treated as dead: stopped (SIGSTOP), hung, or
 * hostile, it must not hang every other process of the container or node. We go on without
 * the lock (every counter is atomic; only check-and-reserve loses its exactness) and, while
 * that same holder keeps it, do not wait for it again. */
#define LOCK_STALL_NS (1000ull * 1000000ull)
#define FUTEX_TID_BITS 0x3fffffff
static struct {
    _Atomic(pthread_mutex_t *) mutex;
    _Atomic int owner;
} stalled[1 + VGPU_MAX_DEV];

static int lock_owner(pthread_mutex_t *m) { /* glibc: the lock word holds the owner's tid */
    return atomic_load((_Atomic int *)&m->__data.__lock) & FUTEX_TID_BITS;
}

static int stalled_index(pthread_mutex_t *m, int claim) {
    for (int i = 0; i < 1 + VGPU_MAX_DEV; i++) {
        pthread_mutex_t *have = atomic_load(&stalled[i].mutex);
        if (have == m) return i;
        if (!have && claim) {
            pthread_mutex_t *none = NULL;
            if (atomic_compare_exchange_strong(&stalled[i].mutex, &none, m) || none == m) return i;
        }
    }
    return -1;
}

/* 0 locked; 1 locked after the previous owner died (now consistent); -1 not locked. */
static int robust_lock(pthread_mutex_t *m) {
    int rc = pthread_mutex_trylock(m);
    if (rc == EBUSY) {
        int owner = lock_owner(m), i = stalled_index(m, 0);
        if (owner && i >= 0 && atomic_load(&stalled[i].owner) == owner) return -1;
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        uint64_t t = (uint64_t)ts.tv_nsec + LOCK_STALL_NS;
        ts.tv_sec += (time_t)(t / 1000000000ull);
        ts.tv_nsec = (long)(t % 1000000000ull);
        rc = pthread_mutex_timedlock(m, &ts);
        if (rc == ETIMEDOUT) {
            owner = lock_owner(m);
            i = stalled_index(m, 1);
            if (i >= 0) atomic_store(&stalled[i].owner, owner);
            vgpu_log("a process (tid %d in its namespace) has held a region lock for over %llu ms: "
                     "stalled, treated as dead; going on without the lock", owner,
                     (unsigned long long)(LOCK_STALL_NS / 1000000ull));
            return -1;
        }
    }
    if (rc == 0) return 0;
    if (rc == EOWNERDEAD) {
        pthread_mutex_consistent(m);
        return 1;
    }
    static _Atomic int warned;
    if (!atomic_exchange(&warned, 1))
        vgpu_log("region lock unusable (%s); continuing without it", strerror(rc));
    return -1;
}

/* OFD lock probe: 1 if another open file description holds a conflicting lock on the byte,
 * 0 if none, -1 if the kernel cannot tell. */
static int ofd_probe(int fd, off_t byte, short type) {
    struct flock fl = {.l_type = type, .l_whence = SEEK_SET, .l_start = byte, .l_len = 1};
    if (fd < 0 || fcntl(fd, F_OFD_GETLK, &fl) != 0) return -1;
    return fl.l_type != F_UNLCK;
}

static int ofd_lock(int fd, off_t byte, short type) {
    struct flock fl = {.l_type = type, .l_whence = SEEK_SET, .l_start = byte, .l_len = 1};
    if (fd < 0) return 0;
    return fcntl(fd, F_OFD_SETLK, &fl);
}

/* ---- mapping files ------------------------------------------------------------------------- */

static void make_parent_dir(const char *path) {
    char dir[PATH_MAX];
    snprintf(dir, sizeof(dir), "%s", path);
    char *slash = strrchr(dir, '/');
    if (!slash || slash == dir) return;
    *slash = 0;
    if (mkdir(dir, 0777) == 0) chmod(dir, 0777 | S_ISVTX);
}

static uint64_t random_u64(void) {
    uint64_t v = 0;
    if (syscall(SYS_getrandom, &v, sizeof(v), VGPU_GRND_NONBLOCK) != (long)sizeof(v))
        v = vgpu_mono_ns() ^ ((uint64_t)getpid() << 32);
    return v ? v : 1;
}

typedef void (*init_fn)(void *mem, void *arg);

static int valid_head(const struct head *h, size_t size, uint32_t kind) {
    return memcmp(h->magic, VGPU_MAGIC, 8) == 0 && h->version == VGPU_REGION_VERSION &&
           h->kind == kind && h->size == size;
}

static void write_head(void *mem, size_t size, uint32_t kind) {
    struct head *h = mem;
    h->version = VGPU_REGION_VERSION;
    h->kind = kind;
    h->size = size;
    h->created_ns = vgpu_real_ns();
    atomic_thread_fence(memory_order_release);
    memcpy(h->magic, VGPU_MAGIC, 8); /* last: a reader that sees the magic sees the rest */
}

/* Maps path (creating and initialising it if missing). 0 ok; -1 with errno; -2 not a
 * region of ours (wrong layout, version, size or file type: *why says which).
 * An existing file is opened without following symlinks and without blocking (a FIFO must
 * not hang us), and must be a regular file of exactly the region's size with a valid head:
 * new files are initialised before they are linked into place, so a visible file is always
 * complete, and anything else was planted or damaged. */
static int map_region(const char *path, size_t size, uint32_t kind, init_fn init, void *arg,
                      void **out, int *out_fd, const char **why) {
    make_parent_dir(path);
    *why = NULL;
    for (int attempt = 0; attempt < 200; attempt++) {
        int fd = open(path, O_RDWR | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
        if (fd < 0 && errno == ELOOP) {
            *why = "a symbolic link, not a region file";
            return -2;
        }
        if (fd >= 0) {
            struct stat st;
            if (fstat(fd, &st) != 0) {
                close(fd);
                return -1;
            }
            if (!S_ISREG(st.st_mode) || (size_t)st.st_size != size) {
                close(fd);
                *why = !S_ISREG(st.st_mode) ? "not a regular file" : "not of a region's size";
                return -2;
            }
            void *m = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
            if (m == MAP_FAILED) {
                close(fd);
                return -1;
            }
            if (!valid_head(m, size, kind)) {
                munmap(m, size);
                close(fd);
                *why = "not a region of this libvgpu version (damaged, or written by another)";
                return -2;
            }
            *out = m;
            *out_fd = fd;
            return 0;
        }
        if (errno != ENOENT) return -1;
        /* create under a temporary name, then link into place */
        char tmp[PATH_MAX + 64];
        snprintf(tmp, sizeof(tmp), "%s.tmp.%d.%llx", path, (int)getpid(),
                 (unsigned long long)random_u64());
        int tfd = open(tmp, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
        if (tfd < 0) return -1;
        fchmod(tfd, 0666);
        if (ftruncate(tfd, (off_t)size) != 0) {
            int e = errno;
            close(tfd);
            unlink(tmp);
            errno = e;
            return -1;
        }
        void *m = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, tfd, 0);
        if (m == MAP_FAILED) {
            int e = errno;
            close(tfd);
            unlink(tmp);
            errno = e;
            return -1;
        }
        init(m, arg);
        write_head(m, size, kind);
        int linked = link(tmp, path);
        int e = errno;
        if (linked != 0 && e != EEXIST) { /* no hard links here: an atomic no-clobber rename */
            linked = (int)syscall(SYS_renameat2, AT_FDCWD, tmp, AT_FDCWD, path, VGPU_RENAME_NOREPLACE);
            e = errno;
        }
        unlink(tmp); /* (gone already after a rename) */
        if (linked == 0) {
            *out = m;
            *out_fd = tfd;
            return 0;
        }
        munmap(m, size);
        close(tfd);
        if (e != EEXIST) {
            errno = e;
            return -1;
        }
        /* someone else created it first: map theirs */
    }
    errno = ETIMEDOUT;
    return -1;
}

/* ---- container region ---------------------------------------------------------------------- */

static void init_container(void *mem, void *arg) {
    (void)arg;
    struct vgpu_container_region *r = mem;
    r->container_id = random_u64();
    r->max_devices = VGPU_MAX_DEV;
    r->max_procs = VGPU_MAX_PROCS;
    r->slot_size = sizeof(struct vgpu_slot);
    r->slots_offset = (uint32_t)__builtin_offsetof(struct vgpu_container_region, slots);
    for (int i = 0; i < VGPU_MAX_DEV; i++) r->limit[i] = VGPU_UNLIMITED;
    init_robust_mutex(&r->lock.m);
}

static void init_activity(void *mem, void *arg) {
    struct vgpu_activity *a = mem;
    a->container_id = *(uint64_t *)arg;
}

static void write_config_copy(struct vgpu_container_region *r) {
    for (int i = 0; i < VGPU_MAX_DEV; i++) {
        r->limit[i] = vgpu.cfg.memory_bytes[i];
        r->cores_percent[i] = vgpu.cfg.cores_percent[i];
    }
    r->priority = vgpu.cfg.priority;
}

/* For the hub or the node agent, not the shim's own use: creates (or checks) a container region
 * and its activity file at these paths exactly as the shim would on its first CUDA call, so
 * that they can live in a directory the container cannot write, where it cannot unlink,
 * rename or replace them (a region of its own would be a fresh limit). 0 ok; -1 with one line
 * in why. */
VGPU_EXPORT int libvgpu_prepare_region(const char *container_region, const char *activity_file,
                                       char *why, size_t whylen) {
    void *m;
    int fd;
    const char *bad;
    int rc = map_region(container_region, sizeof(struct vgpu_container_region),
                        VGPU_KIND_CONTAINER, init_container, NULL, &m, &fd, &bad);
    if (rc != 0) {
        snprintf(why, whylen, "%s: %s", container_region, rc == -2 ? bad : strerror(errno));
        return -1;
    }
    uint64_t cid = ((struct vgpu_container_region *)m)->container_id;
    munmap(m, sizeof(struct vgpu_container_region));
    close(fd);
    if (!activity_file || !*activity_file) return 0;
    rc = map_region(activity_file, sizeof(struct vgpu_activity), VGPU_KIND_ACTIVITY, init_activity,
                    &cid, &m, &fd, &bad);
    if (rc != 0) {
        snprintf(why, whylen, "%s: %s", activity_file, rc == -2 ? bad : strerror(errno));
        return -1;
    }
    munmap(m, sizeof(struct vgpu_activity));
    close(fd);
    return 0;
}

static void init_node(void *mem, void *arg);

/* For the node agent: creates (or checks) the node region of card uuid in dir exactly as the
 * shim would on its first use of the card (mode 0666), so that the directory can stay the
 * agent's: containers map the card's region but can neither unlink, rename nor replace it.
 * 0 ok; -1 with one line in why. */
VGPU_EXPORT int libvgpu_prepare_node_region(const char *dir, const char *uuid, char *why, size_t whylen) {
    char path[PATH_MAX];
    void *m;
    int fd;
    const char *bad;
    if (!uuid || !*uuid || strchr(uuid, '/') ||
        snprintf(path, sizeof(path), "%s/%s.region", dir, uuid) >= (int)sizeof(path)) {
        snprintf(why, whylen, "%s/%s.region: not a node region's path", dir, uuid ? uuid : "");
        return -1;
    }
    int rc = map_region(path, sizeof(struct vgpu_node_region), VGPU_KIND_NODE, init_node, (void *)uuid, &m,
                        &fd, &bad);
    if (rc != 0) {
        snprintf(why, whylen, "%s: %s", path, rc == -2 ? bad : strerror(errno));
        return -1;
    }
    munmap(m, sizeof(struct vgpu_node_region));
    close(fd);
    return 0;
}

int vgpu_region_open(void) {
    struct vgpu_config *c = &vgpu.cfg;
    if (!c->container_region[0])
        snprintf(c->container_region, sizeof(c->container_region), "/tmp/libvgpu-%d.region",
                 (int)getuid());
    snprintf(region_path, sizeof(region_path), "%s", c->container_region);
    void *m;
    int fd;
    const char *why;
    int rc = map_region(region_path, sizeof(struct vgpu_container_region), VGPU_KIND_CONTAINER,
                        init_container, NULL, &m, &fd, &why);
    if (rc != 0) { /* never a region of one's own: N processes would get N limits */
        vgpu_log("cannot use the accounting region %s (%s); CUDA is disabled. Remove the file "
                 "while no CUDA program of this container runs, or fix its permissions",
                 region_path, rc == -2 ? why : strerror(errno));
        return -1;
    }
    vgpu.reg = m;
    vgpu.reg_fd = fd;
    write_config_copy(vgpu.reg);
    if (c->activity_file[0]) {
        uint64_t cid = vgpu.reg->container_id;
        rc = map_region(c->activity_file, sizeof(struct vgpu_activity), VGPU_KIND_ACTIVITY,
                        init_activity, &cid, &m, &fd, &why);
        if (rc == 0) {
            vgpu.act = m;
            close(fd); /* no locks live in it; the mapping is enough */
            if (vgpu.act->container_id != cid) vgpu.act->container_id = cid;
        } else {
            vgpu_log("cannot use the activity file %s (%s)", c->activity_file,
                     rc == -2 ? why : strerror(errno));
        }
    }
    return 0;
}

static int slot_alive(struct vgpu_container_region *r, int i) {
    if (vgpu.reg_private) return 1;
    int p = ofd_probe(vgpu.reg_fd, VGPU_LOCK_BASE + i, F_WRLCK);
    if (p >= 0) return p;
    int pid = atomic_load(&r->slots[i].pid);
    return !(kill(pid, 0) != 0 && errno == ESRCH);
}

/* Allocations and frees update the counters without the lock (memory.c: a compare-and-swap on
 * the total, then the slot, with the slot's busy count raised around both). A holder of the lock
 * reaps: it raises quiesce, after which new updates take the lock instead, and waits for the
 * busy counts of the live slots to drop; then nothing is half-done and the total is recounted
 * exactly from the live slots (which also undoes what a process killed mid-update left in it).
 * A live slot that stays busy (a stopped process, or a hostile one raising its count) is not
 * waited for past QUIESCE_NS: then only the dead slots' bytes are taken off the total. */
#define QUIESCE_NS (2ull * 1000000ull)

static int quiesced(struct vgpu_container_region *r, uint32_t hwm, int mine) {
    uint64_t deadline = 0;
    for (unsigned spins = 0;; spins++) {
        int busy = 0;
        for (uint32_t i = 0; i < hwm && !busy; i++) {
            struct vgpu_slot *s = &r->slots[i];
            if (!atomic_load(&s->busy) || !atomic_load(&s->pid)) continue;
            busy = (int)i == mine || slot_alive(r, (int)i);
        }
        if (!busy) return 1;
        if (spins < 64) continue;
        uint64_t now = vgpu_mono_ns();
        if (!deadline) deadline = now + QUIESCE_NS;
        if (now >= deadline) return 0;
        sched_yield();
    }
}

/* own: this process's private counts (memory.c), or NULL. Its slot is raised back to them
 * where someone lowered it, and only here, once every update of this process is finished: an
 * update changes the slot and the private count one after the other, so in between they differ
 * legitimately, and a slot "restored" then keeps a free forever (CI, four processes hammering
 * one limit under load: 40 MiB left in a slot in 5 of 30 runs). Returns 1 if it restored. */
int vgpu_region_reap_own_locked(struct vgpu_container_region *r, _Atomic uint64_t *own) {
    uint64_t total[VGPU_MAX_DEV] = {0}, dead[VGPU_MAX_DEV] = {0};
    int mine = atomic_load(&vgpu.slot), restored = 0;
    uint32_t hwm = atomic_load(&r->hwm);
    if (hwm > VGPU_MAX_PROCS) hwm = VGPU_MAX_PROCS;
    atomic_store(&r->quiesce, 1);
    int exact = quiesced(r, hwm, mine);
    if (own && exact && mine >= 0 && (uint32_t)mine < hwm) {
        struct vgpu_slot *s = &r->slots[mine];
        for (int d = 0; d < VGPU_MAX_DEV; d++) {
            uint64_t o = atomic_load(&own[d]);
            if (atomic_load(&s->used[d]) >= o) continue;
            atomic_store(&s->used[d], o);
            restored = 1;
        }
    }
    for (uint32_t i = 0; i < hwm; i++) {
        struct vgpu_slot *s = &r->slots[i];
        if (!atomic_load(&s->pid)) continue;
        if ((int)i != mine && !slot_alive(r, (int)i)) {
            for (int d = 0; d < VGPU_MAX_DEV; d++) {
                dead[d] += atomic_exchange(&s->used[d], 0);
                atomic_store(&s->overhead[d], 0);
            }
            atomic_store(&s->busy, 0);
            atomic_store(&s->pid, 0);
            continue;
        }
        for (int d = 0; d < VGPU_MAX_DEV; d++) total[d] += atomic_load(&s->used[d]);
    }
    for (int d = 0; d < VGPU_MAX_DEV; d++) {
        if (exact) {
            atomic_store(&r->used[d], total[d]);
            continue;
        }
        uint64_t old = atomic_load(&r->used[d]);
        while (dead[d] && !atomic_compare_exchange_weak(&r->used[d], &old,
                                                        old > dead[d] ? old - dead[d] : 0)) {
        }
    }
    atomic_store(&r->quiesce, 0);
    return restored;
}

void vgpu_region_reap_locked(struct vgpu_container_region *r) {
    vgpu_region_reap_own_locked(r, NULL);
}

int vgpu_region_lock(struct vgpu_container_region *r) {
    int rc = robust_lock(&r->lock.m);
    if (rc == 1) {
        vgpu_log("a process died holding the accounting lock; usage repaired from live processes");
        vgpu_region_reap_locked(r);
        rc = 0;
    }
    return rc;
}

void vgpu_region_unlock(struct vgpu_container_region *r) { pthread_mutex_unlock(&r->lock.m); }

int vgpu_region_claim_slot(void) {
    if (atomic_load(&vgpu.slot) >= 0) return 0;
    if (!vgpu.reg) return -1;
    pthread_mutex_lock(&vgpu.slow_lock);
    if (atomic_load(&vgpu.slot) >= 0) {
        pthread_mutex_unlock(&vgpu.slow_lock);
        return 0;
    }
    struct vgpu_container_region *r = vgpu.reg;
    int locked = vgpu_region_lock(r) == 0;
    int found = -1;
    for (int pass = 0; pass < 2 && found < 0; pass++) {
        if (pass) vgpu_region_reap_locked(r);
        for (int i = 0; i < VGPU_MAX_PROCS && found < 0; i++) {
            if (atomic_load(&r->slots[i].pid)) continue;
            if (ofd_lock(vgpu.reg_fd, VGPU_LOCK_BASE + i, F_WRLCK) != 0) continue;
            found = i;
        }
    }
    if (found >= 0) {
        struct vgpu_slot *s = &r->slots[found];
        for (int d = 0; d < VGPU_MAX_DEV; d++) {
            atomic_store(&s->used[d], 0);
            atomic_store(&s->overhead[d], 0);
        }
        atomic_store(&s->host_pid, atomic_load(&vgpu.host_pid));
        s->flags = 0;
        s->attached_ns = vgpu_real_ns();
        atomic_store(&s->last_launch_ns, 0);
        atomic_store(&s->launches, 0);
        atomic_store(&vgpu.launches, 0);
        memset(s->comm, 0, sizeof(s->comm));
        snprintf(s->comm, sizeof(s->comm), "%s", program_invocation_short_name);
        atomic_store(&s->pid, (int32_t)getpid());
        if (atomic_load(&r->hwm) < (uint32_t)found + 1) atomic_store(&r->hwm, (uint32_t)found + 1);
        vgpu.me = s;
        atomic_store(&vgpu.slot, found);
    }
    if (locked) vgpu_region_unlock(r);
    pthread_mutex_unlock(&vgpu.slow_lock);
    if (found < 0) {
        vgpu_log("all %d process slots of %s are taken; this process is not accounted",
                 VGPU_MAX_PROCS, region_path);
        return -1;
    }
    return 0;
}

/* A process that exits normally gives its slot back (SIGKILLed ones are reaped by the others).
 * Never blocks: if the lock is busy the slot is cleared and the totals are recomputed by the
 * next reap (every query and every allocation near the limit reaps). */
__attribute__((destructor)) static void release_slot_at_exit(void) {
    struct vgpu_container_region *r = vgpu.reg;
    int i = atomic_load(&vgpu.slot);
    if (!r || i < 0 || vgpu.reg_private) return;
    struct vgpu_slot *s = &r->slots[i];
    int locked = pthread_mutex_trylock(&r->lock.m);
    if (locked == EOWNERDEAD) {
        pthread_mutex_consistent(&r->lock.m);
        locked = 0;
    }
    for (int d = 0; d < VGPU_MAX_DEV; d++) {
        uint64_t used = atomic_exchange(&s->used[d], 0);
        atomic_store(&s->overhead[d], 0);
        uint64_t total = atomic_load(&r->used[d]);
        while (locked == 0 && used &&
               !atomic_compare_exchange_weak(&r->used[d], &total, total > used ? total - used : 0)) {
        }
    }
    atomic_store(&s->pid, 0);
    if (locked == 0) pthread_mutex_unlock(&r->lock.m);
    atomic_store(&vgpu.slot, -1);
    vgpu.me = NULL;
}

/* ---- host pids the container's processes hold -------------------------------------------
 * Each process that knows its host pid holds an OFD read lock on byte HOST_PID_BASE + host pid
 * of the container region for as long as it lives. Unlike the slots, nobody else can take
 * that away: a lock belongs to its holder's open file description, so a process that zeroes
 * another's slot (pid, host pid, counters) cannot make that process's memory vanish. Readers
 * ask about each pid NVML lists (F_OFD_GETLK on its byte): a lock planted over many bytes only
 * makes its own container pay for more. */
#define HOST_PID_BASE (VGPU_LOCK_BASE + (1LL << 24))
#define HOST_PID_MAX (1LL << 22) /* the kernel's pid_max limit */

void vgpu_region_hold_host_pid(unsigned int pid) {
    if (!vgpu.reg || vgpu.reg_private || vgpu.reg_fd < 0 || !pid || pid >= HOST_PID_MAX) return;
    if (ofd_lock(vgpu.reg_fd, HOST_PID_BASE + pid, F_RDLCK) != 0)
        vgpu_log("cannot register host pid %u in %s (%s)", pid, region_path, strerror(errno));
}

int vgpu_region_host_pid_held(unsigned int pid) {
    if (!vgpu.reg || vgpu.reg_private || vgpu.reg_fd < 0 || !pid || pid >= HOST_PID_MAX) return 0;
    return ofd_probe(vgpu.reg_fd, HOST_PID_BASE + pid, F_WRLCK) == 1;
}

/* ---- node regions ----------------------------------------------------------------------- */

static void init_node(void *mem, void *arg) {
    struct vgpu_node_region *n = mem;
    snprintf(n->uuid, sizeof(n->uuid), "%s", (const char *)arg);
    n->max_entries = VGPU_NODE_ENTRIES;
    n->entry_size = sizeof(struct vgpu_node_entry);
    n->entries_offset = (uint32_t)__builtin_offsetof(struct vgpu_node_region, entries);
    init_robust_mutex(&n->lock.m);
}

static int claim_entry(struct vgpu_node_region *n, int fd, int dev) {
    uint64_t cid = vgpu.reg->container_id;
    int found = -1, spare = -1;
    for (int i = 0; i < VGPU_NODE_ENTRIES; i++) {
        uint64_t id = atomic_load(&n->entries[i].container_id);
        if (id == cid) {
            found = i;
            break;
        }
        if (spare < 0 && (id == 0 || ofd_probe(fd, VGPU_LOCK_BASE + i, F_WRLCK) == 0)) spare = i;
    }
    if (found < 0 && spare >= 0) {
        struct vgpu_node_entry *e = &n->entries[spare];
        atomic_store(&e->container_id, 0);
        e->priority = vgpu.cfg.priority;
        e->cores_percent = vgpu.cfg.cores_percent[dev];
        e->memory_limit = vgpu.cfg.memory_bytes[dev];
        atomic_store(&e->memory_used, atomic_load(&vgpu.reg->used[dev]));
        atomic_store(&e->last_launch_ns, 0);
        atomic_store(&e->held_since_ns, 0);
        atomic_store(&e->reclaim, 0);
        e->attached_ns = vgpu_real_ns();
        memset(e->name, 0, sizeof(e->name));
        snprintf(e->name, sizeof(e->name), "%s", vgpu.cfg.name);
        atomic_store(&e->container_id, cid);
        found = spare;
    }
    if (found >= 0 && ofd_lock(fd, VGPU_LOCK_BASE + found, F_RDLCK) != 0) found = -1;
    return found;
}

/* A card's node region the container may only read (Kubernetes: a read-only mount; the node
 * agent writes the entries from each container region's card[]). 0 ok, -1 errno, -2 why. */
static int map_node_readonly(const char *path, void **out, int *out_fd, const char **why) {
    size_t size = sizeof(struct vgpu_node_region);
    struct stat st;
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    if (fd < 0) return errno == ELOOP ? (*why = "a symbolic link, not a region file", -2) : -1;
    void *m = MAP_FAILED;
    if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && (size_t)st.st_size == size)
        m = mmap(NULL, size, PROT_READ, MAP_SHARED, fd, 0);
    if (m != MAP_FAILED && valid_head(m, size, VGPU_KIND_NODE)) {
        *out = m;
        *out_fd = fd;
        return 0;
    }
    if (m != MAP_FAILED) munmap(m, size);
    close(fd);
    *why = "not a node region of this libvgpu version";
    return -2;
}

/* Where the entry fields this container updates go: its own node entry, or (relay) its
 * container region's card record, which the node agent copies into the node region. */
static void node_fields(struct vgpu_node_attach *na, int dev) {
    struct vgpu_card *c = &vgpu.reg->card[dev];
    struct vgpu_node_entry *e = na->relay ? NULL : &na->region->entries[na->entry];
    na->last_launch = e ? &e->last_launch_ns : &c->last_launch_ns;
    na->held_since = e ? &e->held_since_ns : &c->held_since_ns;
    na->reclaim = e ? &e->reclaim : &c->reclaim;
}

struct vgpu_node_attach *vgpu_node_get(int dev) {
    if (dev < 0 || dev >= VGPU_MAX_DEV || !vgpu.reg) return NULL;
    struct vgpu_node_attach *na = &vgpu.node[dev];
    int s = atomic_load_explicit(&na->state, memory_order_acquire);
    if (VGPU_LIKELY(s == 1)) return na;
    if (s < 0 || !vgpu.cfg.node_region_dir[0]) return NULL;
    pthread_mutex_lock(&vgpu.slow_lock);
    s = atomic_load(&na->state);
    if (s != 0) {
        pthread_mutex_unlock(&vgpu.slow_lock);
        return s == 1 ? na : NULL;
    }
    char uuid[80];
    int rc = -1;
    if (vgpu_device_uuid(dev, uuid, sizeof(uuid)) == 0 &&
        snprintf(node_path[dev], sizeof(node_path[dev]), "%s/%s.region",
                 vgpu.cfg.node_region_dir, uuid) < (int)sizeof(node_path[dev])) {
        void *m;
        int fd;
        const char *why;
        rc = map_region(node_path[dev], sizeof(struct vgpu_node_region), VGPU_KIND_NODE,
                        init_node, uuid, &m, &fd, &why);
        if (rc == -1 && (errno == EROFS || errno == EACCES)) {
            rc = map_node_readonly(node_path[dev], &m, &fd, &why);
            if (rc == 0) {
                na->region = m;
                na->fd = fd;
                na->entry = -1;
                na->relay = 1;
                node_fields(na, dev);
                memcpy(vgpu.reg->name, vgpu.cfg.name, sizeof(vgpu.reg->name));
                snprintf(vgpu.reg->card[dev].uuid, sizeof(vgpu.reg->card[dev].uuid), "%.47s", uuid);
            }
        } else if (rc == 0) {
            struct vgpu_node_region *n = m;
            int locked = robust_lock(&n->lock.m) >= 0;
            int entry = claim_entry(n, fd, dev);
            if (locked) pthread_mutex_unlock(&n->lock.m);
            if (entry >= 0) {
                na->region = n;
                na->fd = fd;
                na->entry = entry;
                node_fields(na, dev);
            } else {
                vgpu_log("node region %s has no free entry; priority is not applied on GPU %d",
                         node_path[dev], dev);
                munmap(m, sizeof(struct vgpu_node_region));
                close(fd);
                rc = -3;
            }
        }
        if (rc != 0 && rc != -3)
            vgpu_log("cannot use the node region %s (%s); priority is not applied on GPU %d",
                     node_path[dev], rc == -2 ? why : strerror(errno), dev);
    }
    atomic_store_explicit(&na->state, rc == 0 ? 1 : -1, memory_order_release);
    pthread_mutex_unlock(&vgpu.slow_lock);
    return rc == 0 ? na : NULL;
}

int vgpu_node_entry_alive(struct vgpu_node_attach *na, int entry) {
    return ofd_probe(na->fd, VGPU_LOCK_BASE + entry, F_WRLCK) != 0; /* unknown counts as alive */
}

VGPU_HOT void vgpu_publish_usage(int dev, uint64_t now) {
    uint64_t used = atomic_load_explicit(&vgpu.reg->used[dev], memory_order_relaxed);
    if (vgpu.act) {
        atomic_store_explicit(&vgpu.act->used[dev], used, memory_order_relaxed);
        atomic_store_explicit(&vgpu.act->updated_ns, now, memory_order_relaxed);
    }
    if (vgpu.features & VGPU_F_PRIORITY) {
        struct vgpu_node_attach *na = vgpu_node_get(dev);
        if (na && !na->relay) /* relay: the agent reads used[] itself */
            atomic_store_explicit(&na->region->entries[na->entry].memory_used, used,
                                  memory_order_relaxed);
    }
}

/* ---- fork ------------------------------------------------------------------------------- */

static int reopen(const char *path, int oldfd, int mode) {
    int fd = open(path, mode | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    close(oldfd); /* drops our reference only; the parent's locks stay with the parent */
    return fd;
}

void vgpu_region_after_fork_child(void) {
    atomic_store(&vgpu.host_pid, 0); /* a new process: found again at its first context */
    atomic_store(&vgpu.slot, -1);
    vgpu.me = NULL;
    if (!vgpu.reg) return;
    if (vgpu.reg_private) {
        struct vgpu_container_region *r = vgpu.reg;
        for (int i = 0; i < VGPU_MAX_PROCS; i++) memset(&r->slots[i], 0, sizeof(r->slots[i]));
        for (int d = 0; d < VGPU_MAX_DEV; d++) atomic_store(&r->used[d], 0);
        atomic_store(&r->hwm, 0);
    } else if (vgpu.reg_fd >= 0) {
        vgpu.reg_fd = reopen(region_path, vgpu.reg_fd, O_RDWR);
    }
    for (int d = 0; d < VGPU_MAX_DEV; d++) {
        struct vgpu_node_attach *na = &vgpu.node[d];
        if (atomic_load(&na->state) != 1) continue;
        na->fd = reopen(node_path[d], na->fd, na->relay ? O_RDONLY : O_RDWR);
        if (na->fd < 0 || (!na->relay && ofd_lock(na->fd, VGPU_LOCK_BASE + na->entry, F_RDLCK) != 0))
            atomic_store(&na->state, -1);
        na->next_check_ns = 0;
        na->stamped_ns = 0;
    }
}
