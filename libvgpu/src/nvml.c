/*
 * nvml.c: NVML memory queries report the slice (so nvidia-smi and pynvml inside the container
 * show it), and the shim's own NVML questions: the container's SM utilisation (the compute
 * limiter's feedback) and this process's memory as the driver sees it (context/module size).
 */
#define _GNU_SOURCE
#include <string.h>
#include <unistd.h>

#include "vgpu.h"

#define NVML_ERROR_FUNCTION_NOT_FOUND 13
#define NVML_VALUE_NOT_AVAILABLE_ULL (~0ull)

static nvmlDevice_t nvml_dev_cache[VGPU_MAX_DEV];
static _Atomic int nvml_dev_cached[VGPU_MAX_DEV];

int vgpu_nvml_device(int dev, nvmlDevice_t *out) {
    if (dev < 0 || dev >= VGPU_MAX_DEV) return -1;
    if (atomic_load_explicit(&nvml_dev_cached[dev], memory_order_acquire)) {
        *out = nvml_dev_cache[dev];
        return 0;
    }
    if (vgpu_ensure_nvml() != 0) return -1;
    char uuid[80];
    nvmlDevice_t h;
    nvmlDeviceGetHandleByUUID_fn by_uuid = REAL(nvmlDeviceGetHandleByUUID);
    if (vgpu_device_uuid(dev, uuid, sizeof(uuid)) != 0 || !by_uuid ||
        by_uuid(uuid, &h) != NVML_SUCCESS)
        return -1;
    nvml_dev_cache[dev] = h;
    atomic_store_explicit(&nvml_dev_cached[dev], 1, memory_order_release);
    *out = h;
    return 0;
}

static int container_has_pid(unsigned int pid) {
    struct vgpu_container_region *r = vgpu.reg;
    unsigned int self = vgpu_self_nvml_pid();
    if (self && pid == self) return 1;
    if (!r || vgpu.reg_private) return pid == (unsigned int)getpid();
    uint32_t hwm = atomic_load(&r->hwm);
    for (uint32_t i = 0; i < hwm && i < VGPU_MAX_PROCS; i++) {
        int32_t p = atomic_load(&r->slots[i].pid);
        if (!p) continue;
        if ((unsigned int)p == pid || (unsigned int)atomic_load(&r->slots[i].host_pid) == pid)
            return 1;
    }
    return vgpu_region_host_pid_held(pid); /* one whose slot was wiped */
}

/* The container's SM utilisation on dev since *since_us (NVML timestamps), in permille, and
 * the whole GPU's (every process's, this container's included) in *gpu_permille.
 * 0: from per-process samples; 1: device-wide fallback (both are the device's); 2: no samples
 * since (idle, or NVML has not sampled yet); -1: NVML cannot tell. */
static int util_of(nvmlDevice_t nd, uint64_t *since_us, uint32_t *permille,
                   uint32_t *gpu_permille);

int vgpu_nvml_container_util(int dev, uint64_t *since_us, uint32_t *permille,
                             uint32_t *gpu_permille) {
    nvmlDevice_t nd;
    if (vgpu_nvml_device(dev, &nd) != 0) return -1;
    return util_of(nd, since_us, permille, gpu_permille);
}

/* The driver's sample period (us), learnt from the timestamps of its samples: the shortest
 * gap seen between two of them. 0 until two distinct ones were seen. */
static _Atomic uint64_t sample_period_us;

static void learn_period(uint64_t gap_us) {
    if (gap_us < 1000) return; /* not a sample period (two samples of one sampling pass) */
    uint64_t p = atomic_load(&sample_period_us);
    while ((p == 0 || gap_us < p) && !atomic_compare_exchange_weak(&sample_period_us, &p, gap_us)) {
    }
}

/* A driver returns one sample per process per sample period in which the process used the
 * GPU (integer percent), and none for periods it idled: the busy time of a window is the sum
 * of its samples times the period, over the window, not their average. */
static int util_of(nvmlDevice_t nd, uint64_t *since_us, uint32_t *permille,
                   uint32_t *gpu_permille) {
    nvmlDeviceGetProcessUtilization_fn per_process = REAL(nvmlDeviceGetProcessUtilization);
    if (per_process) {
        nvmlProcessUtilizationSample_t s[128];
        unsigned int n = 128;
        nvmlReturn_t rc = per_process(nd, s, &n, *since_us);
        if (rc == NVML_ERROR_NOT_FOUND) {
            *permille = 0;
            *gpu_permille = 0;
            return 2;
        }
        if (rc == NVML_SUCCESS) {
            uint64_t total = 0, gpu = 0, newest = *since_us, stamps[128];
            unsigned int nstamps = 0;
            if (n > 128) n = 128;
            for (unsigned int i = 0; i < n; i++) {
                if (s[i].timeStamp > newest) newest = s[i].timeStamp;
                gpu += s[i].smUtil;
                if (container_has_pid(s[i].pid)) total += s[i].smUtil;
                unsigned int j = 0;
                while (j < nstamps && stamps[j] != s[i].timeStamp) j++;
                if (j == nstamps) stamps[nstamps++] = s[i].timeStamp;
            }
            for (unsigned int i = 0; i < nstamps; i++) /* gaps between the samples' periods */
                for (unsigned int j = 0; j < nstamps; j++)
                    if (stamps[j] > stamps[i]) learn_period(stamps[j] - stamps[i]);
            uint64_t window = newest > *since_us ? newest - *since_us : 0;
            uint64_t period = atomic_load(&sample_period_us);
            /* not learnt yet, or a window shorter than one: the samples cover the window */
            if (!period || !window || period * nstamps > window) period = window / (nstamps ? nstamps : 1);
            uint64_t scale = window ? period * 10 : 10, div = window ? window : 1;
            total = total * scale / div;
            gpu = gpu * scale / div;
            *permille = (uint32_t)(total > 1000 ? 1000 : total);
            *gpu_permille = (uint32_t)(gpu > 1000 ? 1000 : gpu);
            *since_us = newest;
            return 0;
        }
    }
    nvmlDeviceGetUtilizationRates_fn device_wide = REAL(nvmlDeviceGetUtilizationRates);
    nvmlUtilization_t u;
    if (!device_wide || device_wide(nd, &u) != NVML_SUCCESS) return -1;
    *permille = u.gpu > 100 ? 1000 : u.gpu * 10;
    *gpu_permille = *permille;
    *since_us = vgpu_real_ns() / 1000;
    return 1;
}

/* NVML's compute processes on dev (host pids); their count, or -1. */
int vgpu_nvml_processes(int dev, nvmlProcessInfo_v2_t *p, unsigned int cap) {
    nvmlDevice_t nd;
    if (vgpu_nvml_device(dev, &nd) != 0) return -1;
    nvmlDeviceGetComputeRunningProcesses_v2_fn list = REAL(nvmlDeviceGetComputeRunningProcesses_v2);
    if (!list) return -1;
    unsigned int n = cap;
    if (list(nd, &n, p) != NVML_SUCCESS) return -1;
    return (int)(n < cap ? n : cap);
}

/* This process's memory on dev as the driver reports it. 0: found; 1: not listed (no context
 * yet, or its host pid is not known yet; *bytes = 0); -1: NVML cannot tell. */
int vgpu_nvml_process_used(int dev, uint64_t *bytes) {
    nvmlProcessInfo_v2_t p[VGPU_SNAP_PIDS];
    int n = vgpu_nvml_processes(dev, p, VGPU_SNAP_PIDS);
    if (n < 0) return -1;
    unsigned int me = vgpu_self_nvml_pid();
    *bytes = 0;
    if (!me) return 1; /* getpid() is no NVML pid inside a pid namespace: never guess by it */
    for (int i = 0; i < n; i++) {
        if (p[i].pid != me) continue;
        if (p[i].usedGpuMemory == NVML_VALUE_NOT_AVAILABLE_ULL) return -1;
        *bytes = p[i].usedGpuMemory;
        return 0;
    }
    return 1;
}

/* ---- host-pid discovery ---------------------------------------------------------------------
 * NVML lists processes by their host pid. Before this process's first context exists it is
 * not listed; right after, it is. Whoever appeared in between, less the pids other processes
 * of this container already claimed, is this process: outside a pid namespace that is getpid()
 * itself. When several processes appeared at once (others started a context at the same
 * moment), a signature decides: this process allocates a random number of 2 MiB pages behind
 * the accounting's back for an instant, and the candidate whose usage grew by exactly that is
 * this process. Found once per process; written to its slot for the other processes and the
 * node agent. */

void vgpu_host_pid_before(int dev, struct vgpu_pidsnap *s) {
    s->ok = 0;
    s->n = 0;
    if (vgpu_self_nvml_pid()) return; /* known already */
    nvmlProcessInfo_v2_t p[VGPU_SNAP_PIDS];
    int n = vgpu_nvml_processes(dev, p, VGPU_SNAP_PIDS);
    if (n < 0) return;
    for (int i = 0; i < n; i++) s->pids[s->n++] = p[i].pid;
    s->ok = 1;
}

static int claimed_by_another_slot(unsigned int pid) {
    struct vgpu_container_region *r = vgpu.reg;
    if (!r || vgpu.reg_private) return 0;
    int mine = atomic_load(&vgpu.slot);
    uint32_t hwm = atomic_load(&r->hwm);
    for (uint32_t i = 0; i < hwm && i < VGPU_MAX_PROCS; i++) {
        if ((int)i == mine || !atomic_load(&r->slots[i].pid)) continue;
        if ((unsigned int)atomic_load(&r->slots[i].host_pid) == pid) return 1;
    }
    return vgpu_region_host_pid_held(pid);
}

static void set_host_pid(unsigned int pid) {
    atomic_store(&vgpu.host_pid, (int)pid);
    if (vgpu.me) atomic_store(&vgpu.me->host_pid, (int32_t)pid);
    vgpu_region_hold_host_pid(pid);
    vgpu_debug("host pid %u (pid %d here)", pid, (int)getpid());
}

/* Which of cand[] grew by a freshly made allocation of a random size; 0 if not exactly one. */
static unsigned int by_signature(int dev, const unsigned int *cand, int nc, CUcontext ctx) {
    cuMemAlloc_v2_fn alloc = REAL(cuMemAlloc_v2);
    cuMemFree_v2_fn release = REAL(cuMemFree_v2);
    cuCtxPushCurrent_v2_fn push = REAL(cuCtxPushCurrent_v2);
    cuCtxPopCurrent_v2_fn pop = REAL(cuCtxPopCurrent_v2);
    if (!alloc || !release || !push || !pop || !ctx || nc > 64) return 0;
    nvmlProcessInfo_v2_t a[VGPU_SNAP_PIDS], b[VGPU_SNAP_PIDS];
    uint64_t size = (uint64_t)(3 + (vgpu_mono_ns() / 1000) % 29) << 21;
    if (push(ctx) != CUDA_SUCCESS) return 0;
    unsigned int found = 0;
    int na = vgpu_nvml_processes(dev, a, VGPU_SNAP_PIDS);
    CUdeviceptr ptr = 0;
    if (na >= 0 && alloc(&ptr, size) == CUDA_SUCCESS) {
        int nb = vgpu_nvml_processes(dev, b, VGPU_SNAP_PIDS);
        int matches = 0;
        for (int c = 0; c < nc; c++) {
            uint64_t before = 0, after = 0;
            for (int i = 0; i < na; i++)
                if (a[i].pid == cand[c]) before = a[i].usedGpuMemory;
            for (int i = 0; i < nb; i++)
                if (b[i].pid == cand[c]) after = b[i].usedGpuMemory;
            if (after >= before + size && after <= before + size + (2ull << 20)) {
                found = cand[c];
                matches++;
            }
        }
        if (matches != 1) found = 0;
        release(ptr);
    }
    CUcontext popped;
    pop(&popped);
    return found;
}

void vgpu_host_pid_after(int dev, const struct vgpu_pidsnap *before, CUcontext ctx) {
    if (!before->ok || vgpu_self_nvml_pid()) return;
    nvmlProcessInfo_v2_t p[VGPU_SNAP_PIDS];
    int n = vgpu_nvml_processes(dev, p, VGPU_SNAP_PIDS);
    if (n < 0) return;
    unsigned int cand[VGPU_SNAP_PIDS], self = (unsigned int)getpid();
    int nc = 0;
    for (int i = 0; i < n; i++) {
        int old = 0;
        for (unsigned int j = 0; j < before->n && !old; j++) old = before->pids[j] == p[i].pid;
        if (old || claimed_by_another_slot(p[i].pid)) continue;
        if (p[i].pid == self) { /* not in a pid namespace of its own */
            set_host_pid(self);
            return;
        }
        cand[nc++] = p[i].pid;
    }
    unsigned int found = nc == 1 ? cand[0] : 0;
    /* another process's own signature or allocation may land between the two lists and match
     * too: try again with another size (CI, two pods at once beside two CPU hogs: 1 in ~1300) */
    for (int tries = 0; !found && nc > 1 && tries < 4; tries++)
        found = by_signature(dev, cand, nc, ctx);
    if (found) set_host_pid(found);
    else if (nc > 1)
        vgpu_log("could not tell this process's host pid from %d that appeared at once; "
                 "its utilisation and driver memory are not measured", nc);
}

/* CUDA index of an NVML device: by uuid when CUDA is up in this process, else NVML's index
 * (the container sees only its GPUs; set CUDA_DEVICE_ORDER=PCI_BUS_ID so both agree). */
static int cuda_index(nvmlDevice_t d) {
    int ndev = atomic_load(&vgpu.ndev);
    nvmlDeviceGetUUID_fn get_uuid = REAL(nvmlDeviceGetUUID);
    char want[NVML_DEVICE_UUID_V2_BUFFER_SIZE], have[80];
    if (ndev > 0 && get_uuid && get_uuid(d, want, sizeof(want)) == NVML_SUCCESS) {
        for (int i = 0; i < ndev && i < VGPU_MAX_DEV; i++)
            if (vgpu_device_uuid(i, have, sizeof(have)) == 0 && strcmp(have, want) == 0) return i;
    }
    unsigned int idx;
    nvmlDeviceGetIndex_fn get_index = REAL(nvmlDeviceGetIndex);
    if (get_index && get_index(d, &idx) == NVML_SUCCESS && idx < VGPU_MAX_DEV) return (int)idx;
    return -1;
}

/* Fills total/used/free for the slice; 0 if this GPU has no memory limit. */
static int slice(nvmlDevice_t d, unsigned long long real_total, unsigned long long *total,
                 unsigned long long *used, unsigned long long *free_bytes) {
    if (!(vgpu.features & VGPU_F_REGION)) return 0;
    int idx = cuda_index(d);
    uint64_t limit = vgpu_limit(idx);
    if (limit == VGPU_UNLIMITED) return 0;
    uint64_t t = limit < real_total ? limit : real_total;
    vgpu_mem_true_up(idx, 1);
    uint64_t u = vgpu_container_used(idx);
    if (u > t) u = t;
    uint64_t now = vgpu_mem_allowed(idx); /* an elastic slice: what it may hold now */
    if (now > t) now = t;
    *total = t;
    *used = u;
    *free_bytes = now > u ? now - u : 0;
    return 1;
}

VGPU_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t d, nvmlMemory_t *m) {
    if (vgpu_resolve_nvml() != 0) return NVML_ERROR_UNINITIALIZED;
    nvmlDeviceGetMemoryInfo_fn real = REAL(nvmlDeviceGetMemoryInfo);
    if (!real) return NVML_ERROR_FUNCTION_NOT_FOUND;
    if (vgpu_ensure_state() != VGPU_READY) return NVML_ERROR_UNKNOWN;
    nvmlReturn_t rc = real(d, m);
    if (rc == NVML_SUCCESS && m) slice(d, m->total, &m->total, &m->used, &m->free);
    return rc;
}

VGPU_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t d, nvmlMemory_v2_t *m) {
    if (vgpu_resolve_nvml() != 0) return NVML_ERROR_UNINITIALIZED;
    nvmlDeviceGetMemoryInfo_v2_fn real = REAL(nvmlDeviceGetMemoryInfo_v2);
    if (!real) return NVML_ERROR_FUNCTION_NOT_FOUND;
    if (vgpu_ensure_state() != VGPU_READY) return NVML_ERROR_UNKNOWN;
    nvmlReturn_t rc = real(d, m);
    if (rc == NVML_SUCCESS && m && slice(d, m->total, &m->total, &m->used, &m->free))
        m->reserved = 0;
    return rc;
}

/* ---- what a container sees of the card's processes and utilisation -----------------------
 * Inside a container (a region is configured) NVML's process lists name only the container's
 * own processes, and utilisation is the container's own (nvidia-smi in the container shows
 * its slice, not its neighbours). */

static int in_container(void) {
    return vgpu_ensure_state() == VGPU_READY && (vgpu.features & VGPU_F_REGION) != 0;
}

#define LIST_MAX 512
static nvmlReturn_t process_list(int id, nvmlDevice_t d, unsigned int *count, void *out,
                                 size_t elem) {
    if (vgpu_resolve_nvml() != 0) return NVML_ERROR_UNINITIALIZED;
    nvml_process_list_fn real = (nvml_process_list_fn)atomic_load(&vgpu_hooks[id].real);
    if (!real) return NVML_ERROR_FUNCTION_NOT_FOUND;
    if (!count || !in_container()) return real(d, count, out);
    static _Thread_local unsigned char buf[LIST_MAX * sizeof(nvmlProcessInfo_v2_t)];
    unsigned int n = LIST_MAX;
    nvmlReturn_t rc = real(d, &n, buf);
    if (rc != NVML_SUCCESS) return rc;
    unsigned int kept = 0;
    for (unsigned int i = 0; i < n && i < LIST_MAX; i++) {
        unsigned int pid;
        memcpy(&pid, buf + i * elem, sizeof(pid));
        if (!container_has_pid(pid)) continue;
        if (kept != i) memmove(buf + kept * elem, buf + i * elem, elem);
        kept++;
    }
    if (!out || *count < kept) {
        *count = kept;
        return kept ? NVML_ERROR_INSUFFICIENT_SIZE : NVML_SUCCESS;
    }
    memcpy(out, buf, kept * elem);
    *count = kept;
    return NVML_SUCCESS;
}

#define V1 (sizeof(unsigned int) * 2 + sizeof(unsigned long long)) /* pid, pad, usedGpuMemory */
VGPU_EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses(nvmlDevice_t d, unsigned int *n,
                                                              void *out) {
    return process_list(H_nvmlDeviceGetComputeRunningProcesses, d, n, out, V1);
}
VGPU_EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t d, unsigned int *n,
                                                                 nvmlProcessInfo_v2_t *out) {
    return process_list(H_nvmlDeviceGetComputeRunningProcesses_v2, d, n, out, sizeof(*out));
}
VGPU_EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t d, unsigned int *n,
                                                                 nvmlProcessInfo_v2_t *out) {
    return process_list(H_nvmlDeviceGetComputeRunningProcesses_v3, d, n, out, sizeof(*out));
}
VGPU_EXPORT nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v2(nvmlDevice_t d, unsigned int *n,
                                                                  nvmlProcessInfo_v2_t *out) {
    return process_list(H_nvmlDeviceGetGraphicsRunningProcesses_v2, d, n, out, sizeof(*out));
}
VGPU_EXPORT nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v3(nvmlDevice_t d, unsigned int *n,
                                                                  nvmlProcessInfo_v2_t *out) {
    return process_list(H_nvmlDeviceGetGraphicsRunningProcesses_v3, d, n, out, sizeof(*out));
}

VGPU_EXPORT nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t d,
                                                         nvmlProcessUtilizationSample_t *out,
                                                         unsigned int *count,
                                                         unsigned long long since) {
    if (vgpu_resolve_nvml() != 0) return NVML_ERROR_UNINITIALIZED;
    nvmlDeviceGetProcessUtilization_fn real = REAL(nvmlDeviceGetProcessUtilization);
    if (!real) return NVML_ERROR_FUNCTION_NOT_FOUND;
    if (!count || !in_container()) return real(d, out, count, since);
    static _Thread_local nvmlProcessUtilizationSample_t buf[LIST_MAX];
    unsigned int n = LIST_MAX;
    nvmlReturn_t rc = real(d, buf, &n, since);
    if (rc != NVML_SUCCESS) return rc;
    unsigned int kept = 0;
    for (unsigned int i = 0; i < n && i < LIST_MAX; i++)
        if (container_has_pid(buf[i].pid)) buf[kept++] = buf[i];
    if (!kept) return NVML_ERROR_NOT_FOUND; /* as NVML answers when no sample is left */
    if (!out || *count < kept) {
        *count = kept;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    memcpy(out, buf, kept * sizeof(*buf));
    *count = kept;
    return NVML_SUCCESS;
}

VGPU_EXPORT nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t d, nvmlUtilization_t *u) {
    if (vgpu_resolve_nvml() != 0) return NVML_ERROR_UNINITIALIZED;
    nvmlDeviceGetUtilizationRates_fn real = REAL(nvmlDeviceGetUtilizationRates);
    if (!real) return NVML_ERROR_FUNCTION_NOT_FOUND;
    nvmlReturn_t rc = real(d, u);
    if (rc != NVML_SUCCESS || !u || !in_container()) return rc;
    uint64_t since = vgpu_real_ns() / 1000 - 1000000ull; /* the last second, as NVML's own */
    uint32_t mine = 0, card = 0;
    int src = util_of(d, &since, &mine, &card);
    if (src == 0 || src == 2) u->gpu = (mine + 5) / 10; /* per-process samples: ours only */
    return rc;
}
