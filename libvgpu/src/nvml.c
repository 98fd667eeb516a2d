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
    if (!r || vgpu.reg_private) return pid == (unsigned int)getpid();
    uint32_t hwm = atomic_load(&r->hwm);
    for (uint32_t i = 0; i < hwm && i < VGPU_MAX_PROCS; i++) {
        int32_t p = atomic_load(&r->slots[i].pid);
        if (!p) continue;
        if ((unsigned int)p == pid || (unsigned int)atomic_load(&r->slots[i].host_pid) == pid)
            return 1;
    }
    return 0;
}

/* The container's SM utilisation on dev since *since_us (NVML timestamps), in permille, and
 * the whole GPU's (every process's, this container's included) in *gpu_permille.
 * 0: from per-process samples; 1: device-wide fallback (both are the device's); 2: no samples
 * since (idle, or NVML has not sampled yet); -1: NVML cannot tell. */
int vgpu_nvml_container_util(int dev, uint64_t *since_us, uint32_t *permille,
                             uint32_t *gpu_permille) {
    nvmlDevice_t nd;
    if (vgpu_nvml_device(dev, &nd) != 0) return -1;
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
            uint64_t total = 0, gpu = 0, newest = *since_us;
            for (unsigned int i = 0; i < n && i < 128; i++) {
                if (s[i].timeStamp > newest) newest = s[i].timeStamp;
                int first = 1; /* average a pid's samples, then sum over pids */
                for (unsigned int j = 0; j < i; j++) first &= s[j].pid != s[i].pid;
                if (!first) continue;
                uint64_t sum = 0, cnt = 0;
                for (unsigned int j = i; j < n && j < 128; j++)
                    if (s[j].pid == s[i].pid) {
                        sum += s[j].smUtil;
                        cnt++;
                    }
                gpu += sum * 10 / cnt;
                if (container_has_pid(s[i].pid)) total += sum * 10 / cnt;
            }
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

/* This process's memory on dev as the driver reports it. 0: found; 1: not listed (no context
 * yet, or invisible from this pid namespace; *bytes = 0); -1: NVML cannot tell. */
int vgpu_nvml_process_used(int dev, uint64_t *bytes) {
    nvmlDevice_t nd;
    if (vgpu_nvml_device(dev, &nd) != 0) return -1;
    nvmlDeviceGetComputeRunningProcesses_v2_fn list = REAL(nvmlDeviceGetComputeRunningProcesses_v2);
    if (!list) return -1;
    nvmlProcessInfo_v2_t p[256];
    unsigned int n = 256;
    if (list(nd, &n, p) != NVML_SUCCESS) return -1;
    unsigned int me = (unsigned int)getpid();
    unsigned int host = vgpu.me ? (unsigned int)atomic_load(&vgpu.me->host_pid) : 0;
    *bytes = 0;
    for (unsigned int i = 0; i < n && i < 256; i++) {
        if (p[i].pid != me && (!host || p[i].pid != host)) continue;
        if (p[i].usedGpuMemory == NVML_VALUE_NOT_AVAILABLE_ULL) return -1;
        *bytes = p[i].usedGpuMemory;
        return 0;
    }
    return 1;
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
    uint64_t u = vgpu_container_used(idx);
    if (u > t) u = t;
    *total = t;
    *used = u;
    *free_bytes = t - u;
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
