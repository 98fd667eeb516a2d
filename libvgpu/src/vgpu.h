/*
 * libvgpu: shared types of the shim.
 *
 * Files: hooks.c (the hook table, driver resolution, cuGetProcAddress, the dlopen redirect),
 * dlsym.c (the dlsym redirect: driver entry points found through any library are the hooks),
 * config.c (limits file / env), region.c (shared-memory regions), memory accounting in
 * memory.c (the counters and the allocation table), alloc.c (allocation hooks and queries),
 * pools.c (stream-ordered pools, graph memory) and context.c (contexts, modules; the four
 * share memory.h), compute.c (launch gate, rate limiter), priority.c (node-wide priority),
 * elastic.c (elastic slices: memory burst and reclaim, the compute share now),
 * nvml.c (NVML hooks and the shim's own NVML queries).
 *
 * The region layouts below are a contract with libvgpu/regions.py (Python reader used by the
 * node agent and the culler): change them only together with VGPU_REGION_VERSION and the
 * offsets table there (tests/libvgpu/test_regions.py checks both agree).
 */
#ifndef VGPU_H
#define VGPU_H

#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>

#include "cuda_api.h"
#include "hooktable.h"

#define VGPU_EXPORT __attribute__((visibility("default")))
#define VGPU_LIKELY(x) __builtin_expect(!!(x), 1)
/* The allocation and launch paths: laid out together (.text.hot), so that a call after the
 * driver's own work, which evicts much of the caches, touches few code pages and lines. */
#define VGPU_HOT __attribute__((hot))
#define VGPU_UNLIKELY(x) __builtin_expect(!!(x), 0)

#define VGPU_MAX_DEV 16
#define VGPU_MAX_PROCS 1024
#define VGPU_NODE_ENTRIES 64
#define VGPU_REGION_VERSION 1
#define VGPU_MAGIC "LIBVGPU"
#define VGPU_KIND_CONTAINER 1
#define VGPU_KIND_NODE 2
#define VGPU_KIND_ACTIVITY 3
#define VGPU_UNLIMITED UINT64_MAX
/* Byte offset of the per-slot / per-entry liveness locks (F_OFD_SETLK; advisory, past EOF). */
#define VGPU_LOCK_BASE (1LL << 30)

#ifndef VGPU_DEFAULT_CONFIG
#define VGPU_DEFAULT_CONFIG "/etc/libvgpu/limits.conf"
#endif

/* ---- shared-memory layouts (all integers little-endian, naturally aligned) --------------- */

typedef union {
    pthread_mutex_t m; /* PTHREAD_PROCESS_SHARED + PTHREAD_MUTEX_ROBUST */
    char pad[64];
} vgpu_lock_t;

/* Compute limiter state of one GPU, shared by the container's processes (128 bytes). */
struct vgpu_compute {
    _Atomic int64_t tokens_ns;   /* GPU-time budget; negative = debt being slept off */
    _Atomic uint64_t refill_ns;  /* CLOCK_MONOTONIC of the last refill */
    _Atomic uint64_t cost_ns;    /* measured GPU time per launch (0 = not measured yet) */
    _Atomic uint64_t launches;   /* launches since the last sample */
    _Atomic uint64_t sample_ns;  /* CLOCK_MONOTONIC of the last utilisation sample */
    _Atomic uint64_t sample_us;  /* NVML timestamp of the last sample (lastSeenTimeStamp) */
    _Atomic uint32_t util_permille; /* the container's measured utilisation, last window */
    _Atomic uint32_t probed;     /* cost_ns is a launch timed with events (its wait included) */
    _Atomic uint64_t gate_ns;    /* CLOCK_MONOTONIC of a recent launch (1 ms resolution) */
    _Atomic uint64_t admit_ns;   /* CLOCK_MONOTONIC when the last launch was let through */
    _Atomic uint64_t total;      /* launches let through, ever */
    _Atomic uint64_t window_total; /* total when the sampled window began (0: unknown) */
    _Atomic uint64_t aligned;    /* the window begins where NVML's samples end */
    _Atomic uint64_t probe_busy_ns; /* while probed: GPU time the windows read so far held */
    _Atomic uint64_t probe_n;    /* while probed: launches those windows counted */
    _Atomic uint64_t probe_slack_ns; /* while probed: NVML's rounding in those under 3 % */
    uint64_t pad1[1];
};

/* One process of the container (320 bytes). pid == 0: free. Liveness: the owner holds an
 * OFD write lock on byte VGPU_LOCK_BASE + index of the region file while it lives. */
struct vgpu_slot {
    _Atomic int32_t pid;           /* pid in the container's pid namespace */
    _Atomic int32_t host_pid;      /* host pid if known (the node agent may fill it), else 0 */
    uint32_t flags;
    _Atomic uint32_t busy;         /* > 0 while its threads update the counters without the lock */
    uint64_t attached_ns;          /* CLOCK_REALTIME ns */
    _Atomic uint64_t last_launch_ns; /* CLOCK_REALTIME ns of the last kernel/graph launch, 0 never */
    _Atomic uint64_t launches;     /* launches so far (approximate under thread races) */
    char comm[16];                 /* process name */
    uint64_t pad;
    _Atomic uint64_t used[VGPU_MAX_DEV];     /* bytes in use per GPU: allocations + overhead */
    _Atomic uint64_t overhead[VGPU_MAX_DEV]; /* the part of used[] that is context/module memory */
};

/* What the container writes of its entry in one card's node region (80 bytes): the card's
 * uuid ("" while the container has not used it) and the entry's fields the shim updates. */
struct vgpu_card {
    char uuid[48];
    _Atomic uint64_t last_launch_ns;  /* as vgpu_node_entry's */
    _Atomic uint64_t held_since_ns;
    _Atomic uint64_t reclaim;
    uint64_t pad;
};

struct vgpu_container_region {
    char magic[8];            /* "LIBVGPU\0" */
    uint32_t version;
    uint32_t kind;            /* VGPU_KIND_CONTAINER */
    uint64_t size;
    uint64_t created_ns;
    uint64_t container_id;    /* random, chosen by the creator */
    uint32_t max_devices;
    uint32_t max_procs;
    uint32_t slot_size;
    uint32_t slots_offset;
    int32_t priority;         /* informational copy of the config */
    _Atomic uint32_t hwm;     /* slots [0, hwm) may be in use */
    _Atomic uint64_t last_launch_ns; /* container-wide, CLOCK_REALTIME ns (1 ms resolution) */
    _Atomic uint32_t quiesce; /* != 0: a holder of the lock recounts used[]: updates take the lock */
    uint32_t pad0a;
    uint64_t pad0[6];
    vgpu_lock_t lock;                        /* offset 128 */
    _Atomic uint64_t used[VGPU_MAX_DEV];     /* offset 192: sum over live slots */
    uint64_t limit[VGPU_MAX_DEV];            /* offset 320: informational, never read as a limit */
    uint32_t cores_percent[VGPU_MAX_DEV];    /* offset 448: informational, 0 = unlimited */
    struct vgpu_compute compute[VGPU_MAX_DEV]; /* offset 512 */
    /* Its node-region entries, for the node agent to relay where the node regions are read-only
     * to the container (Kubernetes): the agent copies them, with used[], limit[],
     * cores_percent[] and priority above, into each card's node region (region.c). */
    char name[64];                           /* offset 2560: the limits file's name= */
    struct vgpu_card card[VGPU_MAX_DEV];     /* offset 2624 */
    char reserved[4096 - 2624 - VGPU_MAX_DEV * 80];
    struct vgpu_slot slots[VGPU_MAX_PROCS];  /* offset 4096 */
};

/* One container on one GPU in the node region (128 bytes). container_id == 0: free.
 * priority, cores_percent and memory_limit are the container's requests (its guarantee).
 * Liveness: every attached process holds an OFD read lock on VGPU_LOCK_BASE + index. */
struct vgpu_node_entry {
    _Atomic uint64_t container_id;
    int32_t priority;
    uint32_t cores_percent;
    uint64_t memory_limit;             /* bytes, VGPU_UNLIMITED if none */
    _Atomic uint64_t memory_used;      /* the container's usage on this GPU */
    _Atomic uint64_t last_launch_ns;   /* CLOCK_REALTIME ns, 1 ms resolution */
    _Atomic uint64_t held_since_ns;    /* != 0 while it holds launches for a higher priority */
    uint64_t attached_ns;
    /* elastic slices: != 0 while the container waits for memory within its request that other
     * containers' bursts hold: MiB wanted (low 32 bits) | CLOCK_REALTIME seconds since (high 32);
     * read by libvgpu/elastic.py (pending_reclaims) */
    _Atomic uint64_t reclaim;
    char name[64];                     /* config 'name' (e.g. the allocation id) */
};

struct vgpu_node_region {
    char magic[8];
    uint32_t version;
    uint32_t kind;            /* VGPU_KIND_NODE */
    uint64_t size;
    uint64_t created_ns;
    char uuid[64];            /* offset 32: GPU uuid, "GPU-..." */
    uint32_t max_entries;     /* offset 96 */
    uint32_t entry_size;
    uint32_t entries_offset;
    uint32_t pad0;
    uint64_t pad1[2];
    vgpu_lock_t lock;         /* offset 128 */
    char reserved[64];
    struct vgpu_node_entry entries[VGPU_NODE_ENTRIES]; /* offset 256 */
};

/* The activity file: a container-wide summary for the culler (4096 bytes). */
struct vgpu_activity {
    char magic[8];
    uint32_t version;
    uint32_t kind;            /* VGPU_KIND_ACTIVITY */
    uint64_t size;
    uint64_t created_ns;
    uint64_t container_id;    /* offset 32 */
    _Atomic uint64_t last_launch_ns; /* offset 40 */
    _Atomic uint64_t launches;       /* offset 48, approximate (racing launches may lose one) */
    _Atomic uint64_t updated_ns;     /* offset 56 */
    _Atomic uint64_t used[VGPU_MAX_DEV]; /* offset 64: container usage per GPU */
    /* offset 192: elastic slices, for metering: GPU time (ns) the container ran above its
     * compute request per GPU, so far (from the NVML windows the rate limiter reads) */
    _Atomic uint64_t compute_burst_ns[VGPU_MAX_DEV];
    char reserved[4096 - 320];
};

/* ---- configuration ---------------------------------------------------------------------- */

struct vgpu_config {
    uint64_t memory_bytes[VGPU_MAX_DEV]; /* VGPU_UNLIMITED if none */
    uint32_t cores_percent[VGPU_MAX_DEV]; /* 0 = unlimited */
    /* elastic slices: what the slice may burst to while the card has room (memory) or idle
     * share (compute); equal to the request above when not elastic (cores: 0 with no limit) */
    uint64_t memory_limit_bytes[VGPU_MAX_DEV];
    uint32_t cores_limit_percent[VGPU_MAX_DEV];
    int32_t priority;
    int64_t context_bytes;      /* -1: measure, else charge this per context */
    uint32_t priority_window_ms;
    uint32_t reclaim_wait_ms;   /* the longest an allocation within the request waits for bursts */
    char container_region[PATH_MAX];
    char node_region_dir[PATH_MAX];
    char activity_file[PATH_MAX];
    char name[64];
    char source[PATH_MAX + 32]; /* where the limits came from, for messages */
};

/* Parses the limits file (or env fallback) into cfg. Returns 0, or -1 after writing one line
 * naming the problem to err. Pure: reads only the given file and the environment. */
int vgpu_config_load(struct vgpu_config *cfg, char *err, size_t errlen);
int vgpu_config_parse_text(struct vgpu_config *cfg, const char *text, const char *origin,
                           char *err, size_t errlen);

/* ---- the hook table --------------------------------------------------------------------- */

enum vgpu_lib { VGPU_LIB_CUDA = 0, VGPU_LIB_NVML = 1, VGPU_LIB_COUNT = 2 };

/* One row of hooktable.h: the real symbol name, its cuGetProcAddress base name and the CUDA
 * version that introduced this variant, which library holds it, whether it is a per-thread
 * default stream (_ptsz) variant, and our hook (NULL: resolved for the shim's own use only). */
struct vgpu_hook {
    const char *name;
    const char *base;
    int since;
    unsigned char lib;
    unsigned char ptsz;
    void *hook;
    void *_Atomic real;
};

#define VGPU_HOOK_ID(sym, base, since, lib, ptsz, hook) H_##sym,
enum vgpu_hook_id { VGPU_HOOK_TABLE(VGPU_HOOK_ID) H_COUNT };
#undef VGPU_HOOK_ID

extern struct vgpu_hook vgpu_hooks[H_COUNT];

/* The real function of a row, typed: REAL(cuMemAlloc_v2)(...). NULL if the driver lacks it. */
#define REAL(sym) ((sym##_fn)atomic_load_explicit(&vgpu_hooks[H_##sym].real, memory_order_acquire))

typedef nvmlReturn_t (*nvmlDeviceGetUUID_fn)(nvmlDevice_t, char *, unsigned int);

/* ---- process state ---------------------------------------------------------------------- */

enum vgpu_state { VGPU_UNINIT = 0, VGPU_READY = 1, VGPU_BROKEN = 2 };

#define VGPU_F_MEMORY 1u   /* a memory limit on some GPU */
#define VGPU_F_COMPUTE 2u  /* a cores limit on some GPU */
#define VGPU_F_PRIORITY 4u /* node regions configured */
#define VGPU_F_REGION 8u   /* a container region is mapped (activity is recorded) */

struct vgpu_node_attach {
    struct vgpu_node_region *region; /* NULL until attached */
    int fd;
    int entry;
    _Atomic int state;               /* 0 not tried, 1 attached, -1 failed */
    _Atomic uint64_t next_check_ns;  /* priority: next time the entries are scanned */
    _Atomic uint64_t stamped_ns;     /* last last_launch_ns written */
    /* relay: the node region is read-only to this container (the node agent writes its
     * entry from the container region's card[]; entry is -1); else the shim's own entry */
    int relay;
    _Atomic uint64_t *last_launch;   /* where this container's entry fields are written */
    _Atomic uint64_t *held_since;
    _Atomic uint64_t *reclaim;
};


struct vgpu_proc {
    _Atomic int state;               /* enum vgpu_state */
    unsigned features;
    struct vgpu_config cfg;
    struct vgpu_container_region *reg;
    int reg_fd;
    int reg_private;                 /* anonymous fallback: limits per process only */
    _Atomic int slot;                /* -1 until claimed */
    struct vgpu_slot *me;
    /* me->launches, kept here too: a launch stores its slot's count without loading the slot's
     * line, which the driver's own work between two launches evicts (0 when a slot is claimed) */
    _Atomic uint64_t launches;
    struct vgpu_activity *act;
    _Atomic int ndev;                /* CUDA devices, known after cuInit (0 = not yet) */
    _Atomic int single_dev;          /* 1 when exactly one device is visible */
    struct vgpu_node_attach node[VGPU_MAX_DEV];
    _Atomic int host_pid;            /* this process's pid as NVML reports it; 0 = not known */
#ifdef VGPU_TEST_HOOKS
    unsigned test_sleep_in_lock_ms;  /* LIBVGPU_TEST_SLEEP_{IN_LOCK,MID_UPDATE}_MS: test builds */
    int test_locked_path;            /* IN_LOCK: allocations take the locked path */
    const char *test_hold_burst;     /* LIBVGPU_TEST_HOLD_BURST_UNTIL: a burst waits for the file */
#endif
    pthread_mutex_t slow_lock;       /* process-local: slot claim, node attach */
};

extern struct vgpu_proc vgpu;

/* Whether entry i (container id id) of na's node region is this container's own. */
static inline int vgpu_node_own(const struct vgpu_node_attach *na, int i, uint64_t id) {
    return i == na->entry || (na->relay && id == vgpu.reg->container_id);
}

/* hooks.c */
int vgpu_ensure_state(void);        /* config + region map; returns enum vgpu_state */
int vgpu_ensure_cuda(void);         /* + real libcuda resolved; returns enum vgpu_state */
int vgpu_ensure_nvml(void);         /* real NVML resolved and initialised; 0 ok, -1 missing */
int vgpu_resolve_nvml(void);        /* real NVML symbols resolved (no nvmlInit); 0 ok */
void vgpu_log(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
extern int vgpu_debug_on; /* LIBVGPU_DEBUG=1: log limiter decisions */
#define vgpu_debug(...) do { if (VGPU_UNLIKELY(vgpu_debug_on)) vgpu_log(__VA_ARGS__); } while (0)
int vgpu_current_device(CUdevice *dev);
int vgpu_device_uuid(int dev, char *out, size_t outlen);

static inline uint64_t vgpu_mono_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static inline uint64_t vgpu_real_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static inline uint64_t vgpu_coarse_real_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME_COARSE, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

void vgpu_sleep_ns(uint64_t ns);

/* region.c */
int vgpu_region_open(void);              /* maps the container region (and activity file) */
VGPU_EXPORT int libvgpu_prepare_region(const char *container_region, const char *activity_file,
                                       char *why, size_t whylen); /* for the hub/agent */
int vgpu_region_claim_slot(void);        /* claims this process's slot; 0 ok */
int vgpu_region_lock(struct vgpu_container_region *r); /* 0: locked; -1: unusable, not locked */
void vgpu_region_unlock(struct vgpu_container_region *r);
void vgpu_region_reap_locked(struct vgpu_container_region *r);
int vgpu_region_reap_own_locked(struct vgpu_container_region *r, _Atomic uint64_t *own);
void vgpu_region_after_fork_child(void);
struct vgpu_node_attach *vgpu_node_get(int dev); /* attaches on first use; NULL if unavailable */
int vgpu_node_entry_alive(struct vgpu_node_attach *na, int entry); /* some process holds it */
void vgpu_publish_usage(int dev, uint64_t now); /* the container's usage to node/activity;
                                                 * now: the coarse clock */
void vgpu_region_hold_host_pid(unsigned int pid); /* registered while this process lives */
int vgpu_region_host_pid_held(unsigned int pid); /* 1: another process of it registered pid */

/* dlsym.c */
struct link_map;
void *vgpu_dlsym(void *handle, const char *name); /* glibc's dlsym: the shim's own lookups */
void *vgpu_object_symbol(const struct link_map *lm, const char *name); /* lm's own definition */
int vgpu_driver_object(const struct link_map *lm); /* VGPU_LIB_* it is, by identity, or -1 */

/* memory.c (alloc.c, pools.c, context.c: memory.h) */
CUresult vgpu_mem_reserve(int dev, uint64_t bytes, int overhead);
void vgpu_mem_release(int dev, uint64_t bytes, int overhead);
void vgpu_mem_true_up(int dev, int now_please);
void vgpu_graph_launched(void); /* graph memory nodes may have taken memory */ /* NVML's per-process usage: driver memory */
void vgpu_mem_forget_context(CUcontext ctx);
void vgpu_mem_after_fork_child(void);
uint64_t vgpu_limit(int dev);
uint64_t vgpu_container_used(int dev);

/* compute.c / priority.c */
void vgpu_compute_gate(int dev, CUstream s);
void vgpu_priority_gate(int dev);
void vgpu_priority_after_fork_child(void);
int vgpu_entry_alive(struct vgpu_node_attach *na, int i, uint64_t now); /* cached briefly */

/* elastic.c: elastic slices (request + burst limit) */
uint64_t vgpu_mem_allowed(int dev);   /* bytes the container may hold on dev now */
int vgpu_mem_burst_holds(int dev);     /* after a count: 0 = another burst took the room */
uint32_t vgpu_compute_share(int dev); /* the cores percent the limiter runs at now */
void vgpu_compute_will_launch(int dev, uint64_t wait_ns); /* busy while sleeping off a debt */
/* metering: the container ran busy_ns of GPU time in a window of window_ns (one sampler each) */
void vgpu_compute_ran(int dev, uint64_t busy_ns, uint64_t window_ns);
struct vgpu_reclaim {
    uint64_t since_ns;  /* 0: not waiting */
    uint64_t looked_ns; /* relay: since when no burst was seen (the entries may lag a period) */
};
/* After a driver allocation of bytes on dev returned rc: 1 when the caller should call the
 * driver again (it waited for other slices' bursts to be given back), else 0. */
int vgpu_reclaim_retry(struct vgpu_reclaim *w, int dev, uint64_t bytes, CUresult rc);
/* The same, without a call when there is nothing to do: no out-of-memory and no wait begun. */
static inline int vgpu_reclaim_again(struct vgpu_reclaim *w, int dev, uint64_t bytes,
                                     CUresult rc) {
    return (rc == CUDA_ERROR_OUT_OF_MEMORY || w->since_ns) && vgpu_reclaim_retry(w, dev, bytes, rc);
}

/* nvml.c */
int vgpu_nvml_device(int dev, nvmlDevice_t *out);
int vgpu_nvml_container_util(int dev, uint64_t *since_us, uint32_t *permille,
                             uint32_t *gpu_permille);
int vgpu_nvml_process_used(int dev, uint64_t *bytes);
int vgpu_nvml_processes(int dev, nvmlProcessInfo_v2_t *p, unsigned int cap); /* count or -1 */

/* Host-pid discovery: NVML reports host pids, getpid() inside a pid namespace (a pod) is not
 * one. Snapshot NVML's process list before this process's first context on dev, then look at
 * who appeared (nvml.c). */
#define VGPU_SNAP_PIDS 256
struct vgpu_pidsnap {
    int ok;
    unsigned int n;
    unsigned int pids[VGPU_SNAP_PIDS];
};
void vgpu_host_pid_before(int dev, struct vgpu_pidsnap *s);
void vgpu_host_pid_after(int dev, const struct vgpu_pidsnap *before, CUcontext ctx);
static inline unsigned int vgpu_self_nvml_pid(void) {
    int h = atomic_load_explicit(&vgpu.host_pid, memory_order_relaxed);
    return h > 0 ? (unsigned int)h : 0;
}

/* ---- the hooks (exported under the driver's own names; defined in alloc.c, pools.c,
 * context.c, compute.c, hooks.c, nvml.c) ------------------------------------------------- */
VGPU_EXPORT CUresult cuInit(unsigned int);
VGPU_EXPORT CUresult cuGetProcAddress(const char *, void **, int, cuuint64_t);
VGPU_EXPORT CUresult cuGetProcAddress_v2(const char *, void **, int, cuuint64_t,
                                         CUdriverProcAddressQueryResult *);
VGPU_EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
VGPU_EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr *, size_t *, size_t, size_t, unsigned int);
VGPU_EXPORT CUresult cuMemAllocManaged(CUdeviceptr *, size_t, unsigned int);
VGPU_EXPORT CUresult cuMemAllocAsync(CUdeviceptr *, size_t, CUstream);
VGPU_EXPORT CUresult cuMemAllocAsync_ptsz(CUdeviceptr *, size_t, CUstream);
VGPU_EXPORT CUresult cuMemAllocFromPoolAsync(CUdeviceptr *, size_t, CUmemoryPool, CUstream);
VGPU_EXPORT CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *, size_t, CUmemoryPool, CUstream);
VGPU_EXPORT CUresult cuMemFree_v2(CUdeviceptr);
VGPU_EXPORT CUresult cuMemPoolTrimTo(CUmemoryPool, size_t);
VGPU_EXPORT CUresult cuDeviceGraphMemTrim(CUdevice);
VGPU_EXPORT CUresult cuMemFreeAsync(CUdeviceptr, CUstream);
VGPU_EXPORT CUresult cuMemFreeAsync_ptsz(CUdeviceptr, CUstream);
VGPU_EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *, size_t,
                                 const CUmemAllocationProp *, unsigned long long);
VGPU_EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle);
VGPU_EXPORT CUresult cuMemMap(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle,
                              unsigned long long);
VGPU_EXPORT CUresult cuMemUnmap(CUdeviceptr, size_t);
VGPU_EXPORT CUresult cuArrayCreate_v2(CUarray *, const CUDA_ARRAY_DESCRIPTOR *);
VGPU_EXPORT CUresult cuArray3DCreate_v2(CUarray *, const CUDA_ARRAY3D_DESCRIPTOR *);
VGPU_EXPORT CUresult cuMipmappedArrayCreate(CUmipmappedArray *, const CUDA_ARRAY3D_DESCRIPTOR *,
                                            unsigned int);
VGPU_EXPORT CUresult cuArrayDestroy(CUarray);
VGPU_EXPORT CUresult cuMipmappedArrayDestroy(CUmipmappedArray);
VGPU_EXPORT CUresult cuMemGetInfo_v2(size_t *, size_t *);
/* the v1 ABI (before CUDA 3.2: 32-bit sizes and device pointers; alloc.c) */
VGPU_EXPORT CUresult cuMemAlloc(unsigned int *, unsigned int);
VGPU_EXPORT CUresult cuMemAllocPitch(unsigned int *, unsigned int *, unsigned int, unsigned int,
                                     unsigned int);
VGPU_EXPORT CUresult cuArrayCreate(CUarray *, const void *);
VGPU_EXPORT CUresult cuArray3DCreate(CUarray *, const void *);
VGPU_EXPORT CUresult cuCtxCreate(CUcontext *, unsigned int, CUdevice);
VGPU_EXPORT CUresult cuMemGetInfo(unsigned int *, unsigned int *);
VGPU_EXPORT CUresult cuDeviceTotalMem(unsigned int *, CUdevice);
VGPU_EXPORT CUresult cuDeviceTotalMem_v2(size_t *, CUdevice);
VGPU_EXPORT CUresult cuCtxCreate_v2(CUcontext *, unsigned int, CUdevice);
VGPU_EXPORT CUresult cuCtxCreate_v3(CUcontext *, CUexecAffinityParam *, int, unsigned int,
                                    CUdevice);
VGPU_EXPORT CUresult cuCtxCreate_v4(CUcontext *, CUctxCreateParams *, unsigned int, CUdevice);
VGPU_EXPORT CUresult cuCtxDestroy_v2(CUcontext);
VGPU_EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *, CUdevice);
VGPU_EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice);
VGPU_EXPORT CUresult cuDevicePrimaryCtxReset_v2(CUdevice);
VGPU_EXPORT CUresult cuModuleLoad(CUmodule *, const char *);
VGPU_EXPORT CUresult cuModuleLoadData(CUmodule *, const void *);
VGPU_EXPORT CUresult cuModuleLoadDataEx(CUmodule *, const void *, unsigned int, int *, void **);
VGPU_EXPORT CUresult cuModuleLoadFatBinary(CUmodule *, const void *);
VGPU_EXPORT CUresult cuModuleUnload(CUmodule);
VGPU_EXPORT CUresult cuLibraryLoadData(CUlibrary *, const void *, int *, void **, unsigned int,
                                       int *, void **, unsigned int);
VGPU_EXPORT CUresult cuLibraryLoadFromFile(CUlibrary *, const char *, int *, void **,
                                           unsigned int, int *, void **, unsigned int);
VGPU_EXPORT CUresult cuLibraryUnload(CUlibrary);
VGPU_EXPORT CUresult cuLaunchKernel(CUfunction, unsigned int, unsigned int, unsigned int,
                                    unsigned int, unsigned int, unsigned int, unsigned int,
                                    CUstream, void **, void **);
VGPU_EXPORT CUresult cuLaunchKernel_ptsz(CUfunction, unsigned int, unsigned int, unsigned int,
                                         unsigned int, unsigned int, unsigned int, unsigned int,
                                         CUstream, void **, void **);
VGPU_EXPORT CUresult cuLaunchKernelEx(const CUlaunchConfig *, CUfunction, void **, void **);
VGPU_EXPORT CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *, CUfunction, void **, void **);
VGPU_EXPORT CUresult cuLaunchCooperativeKernel(CUfunction, unsigned int, unsigned int,
                                               unsigned int, unsigned int, unsigned int,
                                               unsigned int, unsigned int, CUstream, void **);
VGPU_EXPORT CUresult cuLaunchCooperativeKernel_ptsz(CUfunction, unsigned int, unsigned int,
                                                    unsigned int, unsigned int, unsigned int,
                                                    unsigned int, unsigned int, CUstream,
                                                    void **);
VGPU_EXPORT CUresult cuGraphLaunch(CUgraphExec, CUstream);
VGPU_EXPORT CUresult cuGraphLaunch_ptsz(CUgraphExec, CUstream);
VGPU_EXPORT CUresult cuLaunch(CUfunction);
VGPU_EXPORT CUresult cuLaunchGrid(CUfunction, int, int);
VGPU_EXPORT CUresult cuLaunchGridAsync(CUfunction, int, int, CUstream);
VGPU_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t, nvmlMemory_t *);
VGPU_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t, nvmlMemory_v2_t *);
VGPU_EXPORT nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t, nvmlUtilization_t *);
VGPU_EXPORT nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t,
                                                         nvmlProcessUtilizationSample_t *,
                                                         unsigned int *, unsigned long long);
VGPU_EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses(nvmlDevice_t, unsigned int *, void *);
VGPU_EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t, unsigned int *,
                                                                 nvmlProcessInfo_v2_t *);
VGPU_EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t, unsigned int *,
                                                                 nvmlProcessInfo_v2_t *);
VGPU_EXPORT nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v2(nvmlDevice_t, unsigned int *,
                                                                  nvmlProcessInfo_v2_t *);
VGPU_EXPORT nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v3(nvmlDevice_t, unsigned int *,
                                                                  nvmlProcessInfo_v2_t *);

/* Hot-path readiness: set once config, region and the real libcuda are in place. */
extern _Atomic int vgpu_cuda_go;
CUresult vgpu_not_ready(void); /* slow path: initialises; CUDA_SUCCESS when now ready */

#endif /* VGPU_H */
