/*
 * The driver's checkpoint API (CUDA 12.8, driver 570+), as the double models it; #included by
 * cuda_double.c. Signatures and states are cuda.h's:
 *
 *   cuCheckpointProcessGetState(pid, *state)       RUNNING / LOCKED / CHECKPOINTED / FAILED
 *   cuCheckpointProcessLock(pid, *args)             RUNNING -> LOCKED: the process's CUDA calls block
 *   cuCheckpointProcessCheckpoint(pid, *args)       LOCKED -> CHECKPOINTED: its submitted work
 *                                                   completes, its device memory moves to host
 *                                                   memory, the GPU is released (NVML no longer
 *                                                   lists it, the device's used memory drops)
 *   cuCheckpointProcessRestore(pid, *args)          CHECKPOINTED -> LOCKED: memory back on the GPU,
 *                                                   or on others (args->gpuPairs: old uuid -> new
 *                                                   uuid, every checkpointed GPU named, enough free
 *                                                   memory there, each new GPU of the old one's chip
 *                                                   type: else CUDA_ERROR_INVALID_DEVICE, the
 *                                                   double's choice of code); the caller must have
 *                                                   called cuInit
 *   cuCheckpointProcessUnlock(pid, *args)           LOCKED -> RUNNING: its blocked calls go on
 *
 * They are called by another process with the target's pid (as `cuda-checkpoint --toggle
 * --pid` does). A call in the wrong state answers CUDA_ERROR_ILLEGAL_STATE and changes nothing;
 * a pid that is not a CUDA process (no context, no memory) CUDA_ERROR_INVALID_VALUE; a target
 * of another user, unless the caller is root, CUDA_ERROR_NOT_PERMITTED; reserved fields that
 * are not zero CUDA_ERROR_INVALID_VALUE. Built with DBL_NO_CHECKPOINT (a driver before 570)
 * none of this exists: no symbols, cuGetProcAddress answers CUDA_ERROR_NOT_FOUND.
 * CUDA_DOUBLE_CHECKPOINT=unsupported: every call answers CUDA_ERROR_NOT_SUPPORTED.
 * A process that exported memory through CUDA IPC (cuIpcGetMemHandle) cannot be checkpointed, as
 * before driver 610: its checkpoint answers CUDA_ERROR_NOT_SUPPORTED and leaves it LOCKED.
 * CUDA_DOUBLE_CHECKPOINT_FAIL=checkpoint: the checkpoint fails (the host copy cannot be made:
 * CUDA_ERROR_OUT_OF_MEMORY) and leaves the process LOCKED with its memory on the GPU;
 * =restore: the restore fails (CUDA_ERROR_UNKNOWN) and leaves the process FAILED.
 */
#define CUDA_ERROR_ILLEGAL_STATE 401
#define CUDA_ERROR_NOT_PERMITTED 800
#define CUDA_ERROR_UNKNOWN 999

typedef enum CUprocessState_enum {
    CU_PROCESS_STATE_RUNNING = 0,
    CU_PROCESS_STATE_LOCKED = 1,
    CU_PROCESS_STATE_CHECKPOINTED = 2,
    CU_PROCESS_STATE_FAILED = 3,
} CUprocessState;

typedef struct CUcheckpointLockArgs_st {
    unsigned int timeoutMs;
    unsigned int reserved0;
    cuuint64_t reserved1[7];
} CUcheckpointLockArgs;
typedef struct CUcheckpointCheckpointArgs_st {
    cuuint64_t reserved[8];
} CUcheckpointCheckpointArgs;
typedef struct CUcheckpointGpuPair_st {
    CUuuid oldUuid;
    CUuuid newUuid;
} CUcheckpointGpuPair;
typedef struct CUcheckpointRestoreArgs_st {
    CUcheckpointGpuPair *gpuPairs;
    unsigned int gpuPairsCount;
    char reserved[52 - sizeof(CUcheckpointGpuPair *)];
    cuuint64_t reserved1;
} CUcheckpointRestoreArgs;
typedef struct CUcheckpointUnlockArgs_st {
    cuuint64_t reserved[8];
} CUcheckpointUnlockArgs;

/* ---- the target's side: its calls wait while it is not RUNNING ---------------------------- */

static void cp_wait(void) {
    struct timespec ts = {0, 1000000};
    nanosleep(&ts, NULL);
}

/* This process's record with the lock held, once it may make CUDA calls. */
static struct dbl_pid *cp_running_self_locked(void) {
    for (;;) {
        dbl_lock();
        struct dbl_pid *p = dbl_pid_locked(dbl_self());
        if (!p || p->cp_state == CU_PROCESS_STATE_RUNNING) return p;
        dbl_unlock();
        cp_wait();
    }
}

static void cp_gate(void) {
    if (!__atomic_load_n(&dbl->cp_busy, __ATOMIC_ACQUIRE)) return; /* the usual case: one load */
    cp_running_self_locked();
    dbl_unlock();
}

#ifndef DBL_NO_CHECKPOINT

/* ---- the controller's side ---------------------------------------------------------------- */

static int cp_zero(const void *p, size_t n) {
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++)
        if (b[i]) return 0;
    return 1;
}

static int cp_permitted(int pid) {
    if (geteuid() == 0) return 1;
    char path[300];
    snprintf(path, sizeof(path), "%s/%d", dbl_env.host_proc[0] ? dbl_env.host_proc : "/proc", pid);
    struct stat st;
    return stat(path, &st) != 0 || st.st_uid == geteuid();
}

/* The target's record (lock held), or an error: not a CUDA process, not permitted. */
static CUresult cp_target_locked(int pid, struct dbl_pid **out) {
    *out = NULL;
    if (pid <= 0 || !dbl_alive(pid)) return CUDA_ERROR_INVALID_VALUE;
    for (int i = 0; i < DBL_PIDS; i++) {
        struct dbl_pid *r = &dbl->pids[i];
        if (r->pid != pid) continue;
        int cuda = r->cp_state != CU_PROCESS_STATE_RUNNING;
        for (int d = 0; d < DBL_MAX_DEV; d++) cuda |= r->used[d] || r->contexts[d];
        if (!cuda) break;
        if (!cp_permitted(pid)) return CUDA_ERROR_NOT_PERMITTED;
        *out = r;
        return CUDA_SUCCESS;
    }
    return CUDA_ERROR_INVALID_VALUE;
}

static void cp_copy_time(uint64_t bytes) {
    if (dbl_env.cp_bytes_per_s)
        dbl_sleep_until(dbl_now() + bytes * 1000000000ull / dbl_env.cp_bytes_per_s);
}

static int cp_dev_of(const CUuuid *u) {
    for (int d = 0; d < dbl_env.ndev; d++) {
        CUuuid mine;
        dbl_uuid(d, &mine);
        if (memcmp(mine.bytes, u->bytes, sizeof(mine.bytes)) == 0) return d;
    }
    return -1;
}

/* Whether the target process can reach physical device d: its /dev (seen from the host's
 * /proc, as the driver restoring in its context would) has d's device node, where it sees its
 * devices through device nodes at all. */
static int cp_reachable(const struct dbl_pid *p, int d) {
    if (!p->nodes) return 1;
    char root[300];
    snprintf(root, sizeof(root), "%s/%d/root", dbl_env.host_proc[0] ? dbl_env.host_proc : "/proc", p->pid);
    return dbl_has_node(root, d);
}

/* A restore goes onto another GPU only of the same chip type (the double: the same name). */
static int cp_same_chip(int a, int b) {
    char x[96], y[96];
    dbl_device_name(a, x, sizeof(x));
    dbl_device_name(b, y, sizeof(y));
    return strcmp(x, y) == 0;
}

EXPORT CUresult cuCheckpointProcessGetState(int pid, CUprocessState *state) {
    dbl_ready();
    if (dbl_env.cp_unsupported) return CUDA_ERROR_NOT_SUPPORTED;
    if (!state) return CUDA_ERROR_INVALID_VALUE;
    dbl_lock();
    struct dbl_pid *p;
    CUresult rc = cp_target_locked(pid, &p);
    if (!rc) *state = (CUprocessState)p->cp_state;
    dbl_unlock();
    return rc;
}

EXPORT CUresult cuCheckpointProcessGetRestoreThreadId(int pid, int *tid) {
    CUprocessState st;
    if (!tid) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = cuCheckpointProcessGetState(pid, &st);
    if (!rc) *tid = pid; /* the double restores from its main thread */
    return rc;
}

/* One transition from `from` to `to` (lock held by the caller of the step). */
static CUresult cp_step(int pid, CUprocessState from, struct dbl_pid **out) {
    CUresult rc = cp_target_locked(pid, out);
    if (rc) return rc;
    if ((*out)->cp_state != (uint32_t)from) return CUDA_ERROR_ILLEGAL_STATE;
    return CUDA_SUCCESS;
}

/* Lock (RUNNING -> LOCKED: its calls block) or unlock (LOCKED -> RUNNING) ``pid``. */
static CUresult cp_toggle_lock(int pid, int lock) {
    dbl_lock();
    struct dbl_pid *p;
    CUresult rc = cp_step(pid, lock ? CU_PROCESS_STATE_RUNNING : CU_PROCESS_STATE_LOCKED, &p);
    if (!rc) {
        p->cp_state = lock ? CU_PROCESS_STATE_LOCKED : CU_PROCESS_STATE_RUNNING;
        if (lock)
            __atomic_add_fetch(&dbl->cp_busy, 1, __ATOMIC_RELEASE);
        else
            __atomic_sub_fetch(&dbl->cp_busy, 1, __ATOMIC_RELEASE);
    }
    dbl_unlock();
    return rc;
}

EXPORT CUresult cuCheckpointProcessLock(int pid, CUcheckpointLockArgs *args) {
    dbl_ready();
    if (dbl_env.cp_unsupported) return CUDA_ERROR_NOT_SUPPORTED;
    if (args && (args->reserved0 || !cp_zero(args->reserved1, sizeof(args->reserved1))))
        return CUDA_ERROR_INVALID_VALUE;
    return cp_toggle_lock(pid, 1);
}

EXPORT CUresult cuCheckpointProcessCheckpoint(int pid, CUcheckpointCheckpointArgs *args) {
    dbl_ready();
    if (dbl_env.cp_unsupported) return CUDA_ERROR_NOT_SUPPORTED;
    if (args && !cp_zero(args, sizeof(*args))) return CUDA_ERROR_INVALID_VALUE;
    dbl_lock();
    struct dbl_pid *p;
    CUresult rc = cp_step(pid, CU_PROCESS_STATE_LOCKED, &p);
    uint64_t last = 0, bytes = 0;
    for (int d = 0; !rc && d < dbl_env.ndev; d++) { /* its submitted work completes first */
        struct dbl_dev *dev = &dbl->dev[d];
        uint64_t n = dev->head < DBL_RING ? dev->head : DBL_RING;
        for (uint64_t k = 0; k < n; k++) {
            const struct dbl_kernel *r = &dev->ring[(dev->head - 1 - k) % DBL_RING];
            if (r->pid == pid && r->end > last) last = r->end;
        }
        bytes += p->used[d];
    }
    int ipc = p && p->used_ipc;
    dbl_unlock();
    if (rc) return rc;
    if (ipc) return CUDA_ERROR_NOT_SUPPORTED;
    dbl_sleep_until(last);
    if (dbl_env.cp_fail == 1) return CUDA_ERROR_OUT_OF_MEMORY; /* no host memory for the copy */
    cp_copy_time(bytes);
    dbl_lock();
    if (!(rc = cp_step(pid, CU_PROCESS_STATE_LOCKED, &p))) {
        for (int d = 0; d < DBL_MAX_DEV; d++) {
            struct dbl_dev *dev = &dbl->dev[d];
            dev->used -= p->used[d] < dev->used ? p->used[d] : dev->used;
            p->host[d] = p->used[d];
            p->host_contexts[d] = p->contexts[d];
            p->used[d] = 0;
            p->contexts[d] = 0;
        }
        p->cp_state = CU_PROCESS_STATE_CHECKPOINTED;
    }
    dbl_unlock();
    return rc;
}

EXPORT CUresult cuCheckpointProcessRestore(int pid, CUcheckpointRestoreArgs *args) {
    dbl_ready();
    if (dbl_env.cp_unsupported) return CUDA_ERROR_NOT_SUPPORTED;
    if (!initialised) return CUDA_ERROR_NOT_INITIALIZED; /* the caller must have called cuInit */
    if (args && (!cp_zero(args->reserved, sizeof(args->reserved)) || args->reserved1 ||
                 (args->gpuPairsCount && !args->gpuPairs)))
        return CUDA_ERROR_INVALID_VALUE;
    if (args && args->gpuPairsCount && dbl_env.driver_version < 13000)
        return CUDA_ERROR_INVALID_VALUE; /* before 580 these fields were reserved */
    int to[DBL_MAX_DEV];
    for (int d = 0; d < DBL_MAX_DEV; d++) to[d] = d;
    dbl_lock();
    struct dbl_pid *p;
    CUresult rc = cp_step(pid, CU_PROCESS_STATE_CHECKPOINTED, &p);
    unsigned n = args ? args->gpuPairsCount : 0;
    int named[DBL_MAX_DEV] = {0};
    for (unsigned i = 0; !rc && i < n; i++) {
        int from = cp_dev_of(&args->gpuPairs[i].oldUuid), dest = cp_dev_of(&args->gpuPairs[i].newUuid);
        if (from < 0 || dest < 0 || !cp_same_chip(from, dest) || !cp_reachable(p, dest))
            rc = CUDA_ERROR_INVALID_DEVICE;
        else if (named[from]++) rc = CUDA_ERROR_INVALID_VALUE;
        else to[from] = dest;
    }
    uint64_t need[DBL_MAX_DEV] = {0}, bytes = 0;
    for (int d = 0; !rc && d < DBL_MAX_DEV; d++) {
        int held = p->host[d] || p->host_contexts[d];
        if (held && n && !named[d]) rc = CUDA_ERROR_INVALID_VALUE; /* pairs name every checkpointed GPU */
        need[to[d]] += p->host[d];
        bytes += p->host[d];
    }
    if (!rc) dbl_reap_all_locked(); /* the dead's memory is free, as on a real driver */
    for (int d = 0; !rc && d < DBL_MAX_DEV; d++)
        if (need[d] > dbl->dev[d].total - dbl->dev[d].used) rc = CUDA_ERROR_OUT_OF_MEMORY;
    if (!rc && dbl_env.cp_fail == 2) {
        p->cp_state = CU_PROCESS_STATE_FAILED; /* an uncorrectable error: its calls stay blocked */
        rc = CUDA_ERROR_UNKNOWN;
    }
    if (!rc) {
        for (int l = 0; l < DBL_MAX_DEV; l++) { /* its devices that lived on d live on to[d] now */
            int t = to[dbl_phys(p, l)];
            p->cp_map[l] = t == l ? 0 : (uint32_t)t + 1;
            if (p->cp_map[l]) dbl->remapped = 1;
        }
        uint64_t host[DBL_MAX_DEV];
        uint32_t ctx[DBL_MAX_DEV];
        memcpy(host, p->host, sizeof(host));
        memcpy(ctx, p->host_contexts, sizeof(ctx));
        for (int d = 0; d < DBL_MAX_DEV; d++) {
            dbl->dev[to[d]].used += host[d];
            p->used[to[d]] += host[d];
            p->contexts[to[d]] += ctx[d];
            p->host[d] = 0;
            p->host_contexts[d] = 0;
        }
        p->cp_state = CU_PROCESS_STATE_LOCKED;
    }
    dbl_unlock();
    if (!rc) cp_copy_time(bytes);
    return rc;
}

EXPORT CUresult cuCheckpointProcessUnlock(int pid, CUcheckpointUnlockArgs *args) {
    dbl_ready();
    if (dbl_env.cp_unsupported) return CUDA_ERROR_NOT_SUPPORTED;
    if (args && !cp_zero(args, sizeof(*args))) return CUDA_ERROR_INVALID_VALUE;
    return cp_toggle_lock(pid, 0);
}

typedef struct CUipcMemHandle_st {
    char reserved[64];
} CUipcMemHandle;

EXPORT CUresult cuIpcGetMemHandle(CUipcMemHandle *handle, CUdeviceptr ptr) {
    CUresult rc = need_ctx();
    if (rc) return rc;
    if (!handle || !ptr) return CUDA_ERROR_INVALID_VALUE;
    memset(handle, 0, sizeof(*handle));
    memcpy(handle->reserved, &ptr, sizeof(ptr));
    dbl_lock();
    struct dbl_pid *p = dbl_pid_locked(dbl_self());
    if (p) p->used_ipc = 1;
    dbl_unlock();
    return CUDA_SUCCESS;
}

/* Host memory a process's checkpoint holds (test helper, not CUDA). */
EXPORT unsigned long long cuDoubleCheckpointHostBytes(int pid) {
    dbl_ready();
    unsigned long long n = 0;
    dbl_lock();
    for (int i = 0; i < DBL_PIDS; i++)
        if (dbl->pids[i].pid == pid)
            for (int d = 0; d < DBL_MAX_DEV; d++) n += dbl->pids[i].host[d];
    dbl_unlock();
    return n;
}

#endif
