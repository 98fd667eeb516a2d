/*
 * State of the simulated GPU(s), shared by the CUDA driver double (libcuda.so.1) and the NVML
 * double (libnvidia-ml.so.1) of every process that maps the same file (CUDA_DOUBLE_STATE).
 *
 * A device has a fixed memory size; processes allocate from it, contexts and modules use some
 * of it too. Kernels run one after another on the device timeline (busy_until), each for its
 * simulated duration; a ring of recent kernels (pid, start, end) is what utilisation is
 * measured from, exactly like NVML samples real SM activity.
 *
 * Environment (read once per process):
 *   CUDA_DOUBLE_STATE          state file (default /tmp/cuda-double-<uid>.state)
 *   CUDA_VISIBLE_DEVICES       read by the CUDA double as the driver reads it (not by NVML)
 *   CUDA_DOUBLE_DEVICES        number of devices (1..4, default 1)
 *   CUDA_DOUBLE_MEMORY_MIB     memory per device (default 16384)
 *   CUDA_DOUBLE_NAME           device name, or one per device separated by ';' (default
 *                              "Simulated GPU <index>"): NVML's and cuDeviceGetName's, and the
 *                              chip type a restore onto another device must match
 *   CUDA_DOUBLE_CONTEXT_MIB    memory a context takes (default 300)
 *   CUDA_DOUBLE_MODULE_MIB     memory a loaded module takes (default 0)
 *   CUDA_DOUBLE_KERNEL_US      duration of a kernel whose name is not k<microseconds> (100)
 *   CUDA_DOUBLE_QUEUE          kernels a process may have queued before launches block (1024)
 *   CUDA_DOUBLE_LAUNCH_CPU_NS  CPU time a launch costs the caller (busy loop, default 0)
 *   CUDA_DOUBLE_ALLOC_CPU_NS   CPU time an allocation costs the caller (default 0)
 *   CUDA_DOUBLE_UTIL_WINDOW_MS window of nvmlDeviceGetUtilizationRates (default 100)
 *   CUDA_DOUBLE_UTIL_SAMPLE_MS nvmlDeviceGetProcessUtilization's sample period, as a real driver
 *                              samples (about 167 ms to 1 s by GPU; default 167): one integer
 *                              percent per process per period, stamped with the period's end;
 *                              0: exact utilisation since lastSeenTimeStamp (no sampling)
 *   CUDA_DOUBLE_NO_PROCESS_UTIL=1  nvmlDeviceGetProcessUtilization answers NOT_SUPPORTED
 *   CUDA_DOUBLE_PROC_ALIASES=1 cuGetProcAddress returns internal entry points, not the
 *                              exported symbols (as a real driver may)
 *   CUDA_DOUBLE_CONTEXT_CREATE_MS  how long creating a context takes after its memory is taken
 *                              (real drivers: 100+ ms; the process is listed by NVML meanwhile)
 *   CUDA_DOUBLE_LAZY_MODULE_MIB memory a module takes when its first function is fetched
 *                              (CUDA_MODULE_LOADING=LAZY: the driver loads code on first use)
 *   CUDA_DOUBLE_CHECKPOINT     'unsupported': the checkpoint API answers CUDA_ERROR_NOT_SUPPORTED
 *                              (a driver or GPU that has the symbols but cannot checkpoint);
 *                              the old driver without them is a separate build (DBL_NO_CHECKPOINT)
 *   CUDA_DOUBLE_CHECKPOINT_FAIL 'checkpoint' or 'restore': that step fails (the host copy could
 *                              not be made / the GPU could not be re-acquired), see checkpoint.c
 *   CUDA_DOUBLE_DRIVER_VERSION cuDriverGetVersion's answer (default 13000: driver 580, whose
 *                              restore takes a device map; below 13000 a restore given GPU pairs
 *                              answers CUDA_ERROR_INVALID_VALUE, as 570's reserved fields do)
 *   CUDA_DOUBLE_CHECKPOINT_GIB_S  copy bandwidth of checkpoint and restore (0: instantaneous)
 * Device nodes: where /dev/nvidiactl exists (a container of the emulator's GPU node:
 * tests/kubeemu/devices.py), a process sees only the devices whose /dev/nvidia<minor> is a
 * character device 195:<minor>, in minor order (CUDA ordinal k is the k-th of them), as a real
 * driver enumerates what the container runtime gave the container; a restore onto a device
 * whose node the target process lacks is refused. Without /dev/nvidiactl (a test on the host)
 * every device is seen. NVML still lists every device.
 *   CUDA_DOUBLE_HOST_PROC      a procfs of the host's pid namespace (the tests bind-mount the
 *                              host's /proc there before entering a new pid namespace): the
 *                              double then knows each process by its host pid, as the kernel
 *                              driver does, and NVML reports host pids. A process in a pid
 *                              namespace sees other pids from getpid(): exactly a pod's view.
 */
#ifndef DOUBLE_STATE_H
#define DOUBLE_STATE_H

#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <time.h>
#include <unistd.h>

#ifdef DBL_NO_CHECKPOINT /* a driver before 570 (CUDA 12.8): no checkpoint API at all */
#define DBL_DRIVER_VERSION 12040
#else /* driver 580 (CUDA 13.0): its restore takes a device map; CUDA_DOUBLE_DRIVER_VERSION=12080 is 570 */
#define DBL_DRIVER_VERSION 13000
#endif

#define DBL_MAX_DEV 4
#define DBL_RING 65536
#define DBL_PIDS 512
#define DBL_MAGIC 0x44424c31u

struct dbl_kernel {
    int32_t pid;
    uint32_t pad;
    uint64_t start, end; /* CLOCK_REALTIME ns */
};

struct dbl_dev {
    uint64_t total, used;
    uint64_t busy_until;
    uint64_t head; /* kernels ever queued; ring index = head % DBL_RING */
    struct dbl_kernel ring[DBL_RING];
};

struct dbl_pid {
    int32_t pid;
    uint32_t nodes; /* the process sees the devices through device nodes (its /dev) */
    uint64_t used[DBL_MAX_DEV];
    uint32_t contexts[DBL_MAX_DEV]; /* listed by NVML while it has a context or memory */
    /* the checkpoint API (checkpoint.c): the process's state, what it holds in host memory
     * while checkpointed, and where each of its devices lives since a remapping restore */
    uint32_t cp_state;
    uint32_t cp_map[DBL_MAX_DEV]; /* physical device + 1; 0: the device itself */
    uint64_t host[DBL_MAX_DEV];
    uint32_t host_contexts[DBL_MAX_DEV];
    uint32_t used_ipc; /* exported memory through CUDA IPC: not checkpointable before driver 610 */
};

struct dbl_state {
    uint32_t magic;
    uint32_t ndev;
    pthread_mutex_t lock;
    uint64_t next_addr;
    struct dbl_dev dev[DBL_MAX_DEV];
    struct dbl_pid pids[DBL_PIDS];
    uint32_t cp_busy;  /* processes not in CU_PROCESS_STATE_RUNNING (their calls block) */
    uint32_t remapped; /* a process was restored onto other devices: map devices from now on */
};

struct dbl_env {
    int ndev;
    uint64_t memory, context, context_create_ns, module, lazy_module, kernel_ns, launch_cpu_ns, alloc_cpu_ns,
        util_window_ns, util_sample_ns;
    char host_proc[256];
    int queue, no_process_util, proc_aliases;
    int cp_unsupported, cp_fail; /* cp_fail: 1 checkpoint, 2 restore */
    int driver_version;          /* cuDriverGetVersion: 1000 * major + 10 * minor */
    uint64_t cp_bytes_per_s;
    int nodes;               /* /dev/nvidiactl exists: devices are those with a device node */
    int nvis;                /* devices this process sees (CUDA ordinals) */
    int vis[DBL_MAX_DEV];    /* ordinal -> physical device */
};

static struct dbl_state *dbl;
static struct dbl_env dbl_env;
static pthread_once_t dbl_once = PTHREAD_ONCE_INIT;

static inline uint64_t dbl_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static inline void dbl_sleep_until(uint64_t t) {
    for (uint64_t now = dbl_now(); now < t; now = dbl_now()) {
        uint64_t ns = t - now;
        struct timespec ts = {(time_t)(ns / 1000000000ull), (long)(ns % 1000000000ull)};
        nanosleep(&ts, NULL);
    }
}

static inline void dbl_burn(uint64_t ns) { /* CPU time of this thread: as a driver call costs */
    if (!ns) return;
    struct timespec a, b;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &a);
    do {
        clock_gettime(CLOCK_THREAD_CPUTIME_ID, &b);
    } while ((uint64_t)(b.tv_sec - a.tv_sec) * 1000000000ull + (uint64_t)b.tv_nsec -
                 (uint64_t)a.tv_nsec < ns);
}

static inline uint64_t dbl_env_u64(const char *name, uint64_t dflt) {
    const char *v = getenv(name);
    return v && *v ? strtoull(v, NULL, 10) : dflt;
}

/* Device i's name (NVML's and cuDeviceGetName's; its chip type for a remapping restore):
 * CUDA_DOUBLE_NAME, one name for every device or one per device separated by ';' (the last
 * one for the devices after it); unset, "Simulated GPU <i>": every device a type of its own. */
static void dbl_device_name(int i, char *name, size_t len) {
    const char *n = getenv("CUDA_DOUBLE_NAME");
    if (!n || !*n) {
        snprintf(name, len, "Simulated GPU %d", i);
        return;
    }
    for (const char *semi; i > 0 && (semi = strchr(n, ';')) && semi[1]; i--) n = semi + 1;
    snprintf(name, len, "%.*s", (int)strcspn(n, ";"), n);
}

static void dbl_lock(void) {
    int rc = pthread_mutex_lock(&dbl->lock);
    if (rc == EOWNERDEAD) pthread_mutex_consistent(&dbl->lock);
}

static void dbl_unlock(void) { pthread_mutex_unlock(&dbl->lock); }

#define DBL_NVIDIA_MAJOR 195

/* Whether <root>/dev/nvidia<minor> is the card's device node (character device 195:minor). */
static int dbl_has_node(const char *root, int minor) {
    char path[320];
    struct stat st;
    snprintf(path, sizeof(path), "%s/dev/nvidia%d", root, minor);
    return stat(path, &st) == 0 && S_ISCHR(st.st_mode) && major(st.st_rdev) == DBL_NVIDIA_MAJOR &&
           (int)minor(st.st_rdev) == minor;
}

/* Physical device i's uuid as NVML prints it (cuDeviceGetUuid's 16 bytes in text). */
static inline void dbl_uuid_text(int i, char *out, size_t len) {
    snprintf(out, len, "GPU-d00b1e00-7369-6d2d-6770-7500000000%02x", i);
}

/* The physical device CUDA_VISIBLE_DEVICES's entry [s, s+n) names among the ``nbase`` devices
 * of ``base`` (an ordinal among them, or a prefix of a "GPU-" uuid naming one); -1: none. */
static int dbl_visible_entry(const char *s, size_t n, const int *base, int nbase) {
    while (n && *s == ' ') s++, n--;
    while (n && s[n - 1] == ' ') n--;
    if (!n) return -1;
    if (n > 4 && strncmp(s, "GPU-", 4) == 0) {
        int found = -1;
        for (int k = 0; k < nbase; k++) {
            char uuid[64];
            dbl_uuid_text(base[k], uuid, sizeof(uuid));
            if (n <= strlen(uuid) && strncmp(uuid, s, n) == 0) {
                if (found >= 0) return -1; /* an ambiguous prefix names no device */
                found = base[k];
            }
        }
        return found;
    }
    int ordinal = 0;
    for (size_t i = 0; i < n; i++) {
        if (s[i] < '0' || s[i] > '9' || ordinal > DBL_MAX_DEV) return -1;
        ordinal = ordinal * 10 + (s[i] - '0');
    }
    return ordinal < nbase ? base[ordinal] : -1;
}

/* The devices this process sees (see the header): by device node where /dev/nvidiactl exists,
 * then CUDA_VISIBLE_DEVICES as the CUDA driver reads it (ordinals or uuid prefixes, in the
 * order given, up to the first entry naming no device or one named already; empty: none).
 * Only the CUDA side: NVML ignores the variable. */
static void dbl_visible_devices(struct dbl_env *e) {
    e->nodes = access("/dev/nvidiactl", F_OK) == 0;
    int base[DBL_MAX_DEV], nbase = 0;
    for (int i = 0; i < e->ndev; i++)
        if (!e->nodes || dbl_has_node("", i)) base[nbase++] = i;
    const char *list = getenv("CUDA_VISIBLE_DEVICES");
    e->nvis = 0;
    if (!list) {
        for (int k = 0; k < nbase; k++) e->vis[e->nvis++] = base[k];
        return;
    }
    for (const char *s = list; *s && e->nvis < DBL_MAX_DEV;) {
        size_t n = strcspn(s, ",");
        int d = dbl_visible_entry(s, n, base, nbase);
        for (int k = 0; d >= 0 && k < e->nvis; k++)
            if (e->vis[k] == d) d = -1;
        if (d < 0) break;
        e->vis[e->nvis++] = d;
        s += n + (s[n] == ',');
    }
}

static void dbl_init(void) {
    struct dbl_env *e = &dbl_env;
    e->ndev = (int)dbl_env_u64("CUDA_DOUBLE_DEVICES", 1);
    if (e->ndev < 1) e->ndev = 1;
    if (e->ndev > DBL_MAX_DEV) e->ndev = DBL_MAX_DEV;
    e->memory = dbl_env_u64("CUDA_DOUBLE_MEMORY_MIB", 16384) << 20;
    e->context = dbl_env_u64("CUDA_DOUBLE_CONTEXT_MIB", 300) << 20;
    e->module = dbl_env_u64("CUDA_DOUBLE_MODULE_MIB", 0) << 20;
    e->lazy_module = dbl_env_u64("CUDA_DOUBLE_LAZY_MODULE_MIB", 0) << 20;
    e->context_create_ns = dbl_env_u64("CUDA_DOUBLE_CONTEXT_CREATE_MS", 0) * 1000000ull;
    const char *hp = getenv("CUDA_DOUBLE_HOST_PROC");
    snprintf(e->host_proc, sizeof(e->host_proc), "%s", hp ? hp : "");
    e->kernel_ns = dbl_env_u64("CUDA_DOUBLE_KERNEL_US", 100) * 1000;
    e->queue = (int)dbl_env_u64("CUDA_DOUBLE_QUEUE", 1024);
    if (e->queue < 1) e->queue = 1;
    if (e->queue > 4096) e->queue = 4096;
    e->launch_cpu_ns = dbl_env_u64("CUDA_DOUBLE_LAUNCH_CPU_NS", 0);
    e->alloc_cpu_ns = dbl_env_u64("CUDA_DOUBLE_ALLOC_CPU_NS", 0);
    e->util_window_ns = dbl_env_u64("CUDA_DOUBLE_UTIL_WINDOW_MS", 100) * 1000000ull;
    e->util_sample_ns = dbl_env_u64("CUDA_DOUBLE_UTIL_SAMPLE_MS", 167) * 1000000ull;
    e->no_process_util = dbl_env_u64("CUDA_DOUBLE_NO_PROCESS_UTIL", 0) != 0;
    e->proc_aliases = dbl_env_u64("CUDA_DOUBLE_PROC_ALIASES", 0) != 0;
    const char *cp = getenv("CUDA_DOUBLE_CHECKPOINT"), *fail = getenv("CUDA_DOUBLE_CHECKPOINT_FAIL");
    e->cp_unsupported = cp && strcmp(cp, "unsupported") == 0;
    e->cp_fail = !fail ? 0 : strcmp(fail, "checkpoint") == 0 ? 1 : strcmp(fail, "restore") == 0 ? 2 : 0;
    e->driver_version = (int)dbl_env_u64("CUDA_DOUBLE_DRIVER_VERSION", DBL_DRIVER_VERSION);
    const char *gib_s = getenv("CUDA_DOUBLE_CHECKPOINT_GIB_S");
    e->cp_bytes_per_s = gib_s ? (uint64_t)(strtod(gib_s, NULL) * 1073741824.0) : 0;

    dbl_visible_devices(e);
    char path[4096];
    const char *p = getenv("CUDA_DOUBLE_STATE");
    if (p && *p) snprintf(path, sizeof(path), "%s", p);
    else snprintf(path, sizeof(path), "/tmp/cuda-double-%d.state", (int)getuid());
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0666);
    if (fd < 0) {
        fprintf(stderr, "cuda double: cannot open %s: %s\n", path, strerror(errno));
        abort();
    }
    flock(fd, LOCK_EX);
    struct stat st;
    fstat(fd, &st);
    int fresh = st.st_size < (off_t)sizeof(struct dbl_state);
    if (fresh && ftruncate(fd, sizeof(struct dbl_state)) != 0) abort();
    dbl = mmap(NULL, sizeof(struct dbl_state), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (dbl == MAP_FAILED) abort();
    if (fresh || dbl->magic != DBL_MAGIC) {
        memset(dbl, 0, sizeof(*dbl));
        pthread_mutexattr_t a;
        pthread_mutexattr_init(&a);
        pthread_mutexattr_setpshared(&a, PTHREAD_PROCESS_SHARED);
        pthread_mutexattr_setrobust(&a, PTHREAD_MUTEX_ROBUST);
        pthread_mutex_init(&dbl->lock, &a);
        dbl->ndev = (uint32_t)e->ndev;
        dbl->next_addr = 0x700000000000ull;
        for (int i = 0; i < DBL_MAX_DEV; i++) dbl->dev[i].total = e->memory;
        dbl->magic = DBL_MAGIC;
    }
    flock(fd, LOCK_UN);
    close(fd);
}

static inline void dbl_ready(void) { pthread_once(&dbl_once, dbl_init); }

/* getpid() once per process, as a real driver keeps it: a launch or an allocation makes no
 * system call (so the GPU check can count the ones the shim adds); reset in a forked child. */
static _Atomic int dbl_getpid_cache;
static void dbl_forked(void) { __atomic_store_n(&dbl_getpid_cache, 0, __ATOMIC_RELEASE); }
__attribute__((constructor)) static void dbl_register_fork(void) { pthread_atfork(NULL, NULL, dbl_forked); }
static inline int dbl_getpid(void) {
    int p = __atomic_load_n(&dbl_getpid_cache, __ATOMIC_ACQUIRE);
    if (!p) {
        p = getpid();
        __atomic_store_n(&dbl_getpid_cache, p, __ATOMIC_RELEASE);
    }
    return p;
}

/* The calling process as the driver knows it: its pid in the host's pid namespace. */
static int dbl_self(void) {
    static _Atomic int cached_for, cached;
    int me = dbl_getpid();
    if (!dbl_env.host_proc[0]) return me;
    if (__atomic_load_n(&cached_for, __ATOMIC_ACQUIRE) == me) return cached;
    char path[300], link[32];
    snprintf(path, sizeof(path), "%s/self", dbl_env.host_proc);
    ssize_t n = readlink(path, link, sizeof(link) - 1);
    if (n <= 0) {
        fprintf(stderr, "cuda double: cannot read %s: %s\n", path, strerror(errno));
        abort();
    }
    link[n] = 0;
    cached = atoi(link);
    __atomic_store_n(&cached_for, me, __ATOMIC_RELEASE);
    return cached;
}

/* Whether a host pid lives (the driver frees what dead processes held). */
static int dbl_alive(int pid) {
    if (!dbl_env.host_proc[0]) return !(kill(pid, 0) != 0 && errno == ESRCH);
    char path[300];
    snprintf(path, sizeof(path), "%s/%d", dbl_env.host_proc, pid);
    return access(path, F_OK) == 0;
}

/* Frees what a dead process held (lock held): the driver does at its death. */
static inline void dbl_reap_locked(struct dbl_pid *r) {
    if (!r->pid || dbl_alive(r->pid)) return;
    for (int d = 0; d < DBL_MAX_DEV; d++) {
        dbl->dev[d].used -= r->used[d] < dbl->dev[d].used ? r->used[d] : dbl->dev[d].used;
        r->used[d] = 0;
        r->contexts[d] = 0;
    }
    if (r->cp_state && dbl->cp_busy) dbl->cp_busy--;
    r->pid = 0;
}

/* Frees what every dead process held (lock held), before a check of free memory that no new
 * process's registration came before (a restore). */
static inline void dbl_reap_all_locked(void) {
    for (int i = 0; i < DBL_PIDS; i++) dbl_reap_locked(&dbl->pids[i]);
}

/* This process's record (lock held); reaps records of dead processes on the way. */
static struct dbl_pid *dbl_pid_locked(int pid) {
    struct dbl_pid *free_slot = NULL;
    for (int i = 0; i < DBL_PIDS; i++) {
        struct dbl_pid *r = &dbl->pids[i];
        if (r->pid == pid) return r;
        if (r->pid != pid) dbl_reap_locked(r);
        if (!r->pid && !free_slot) free_slot = r;
    }
    if (!free_slot) return NULL;
    memset(free_slot, 0, sizeof(*free_slot));
    free_slot->pid = pid;
    if (pid == dbl_self()) { /* its devices, as its device nodes name them */
        free_slot->nodes = (uint32_t)dbl_env.nodes;
        for (int k = 0; k < dbl_env.nvis; k++)
            if (dbl_env.vis[k] != k) {
                free_slot->cp_map[k] = (uint32_t)dbl_env.vis[k] + 1;
                dbl->remapped = 1;
            }
    }
    return free_slot;
}

/* The physical device behind a process's device (lock held): itself unless restored elsewhere. */
static inline int dbl_phys(const struct dbl_pid *p, int dev) {
    return p && p->cp_map[dev] ? (int)p->cp_map[dev] - 1 : dev;
}

/* Busy ns of pid (0: anyone) on dev within [t0, t1] (lock held). */
static uint64_t dbl_busy_locked(int dev, int pid, uint64_t t0, uint64_t t1) {
    struct dbl_dev *d = &dbl->dev[dev];
    uint64_t busy = 0;
    uint64_t n = d->head < DBL_RING ? d->head : DBL_RING;
    for (uint64_t k = 0; k < n; k++) {
        const struct dbl_kernel *r = &d->ring[(d->head - 1 - k) % DBL_RING];
        if (r->end <= t0) break; /* the timeline is ordered: everything older ends earlier */
        if (pid && r->pid != pid) continue;
        uint64_t s = r->start > t0 ? r->start : t0, e = r->end < t1 ? r->end : t1;
        if (e > s) busy += e - s;
    }
    return busy;
}

#endif
