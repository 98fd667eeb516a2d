/*
 * An NVML test double: built by the tests as libnvidia-ml.so.1. Reads the simulated devices
 * of double_state.h: memory as the device sees it, device-wide utilisation over the last
 * CUDA_DOUBLE_UTIL_WINDOW_MS, per-process SM utilisation since lastSeenTimeStamp, and the
 * memory each process uses (contexts and modules included), all measured from the kernels
 * that really ran on the simulated timeline.
 */
#include "double_state.h"

#include "../../../libvgpu/src/cuda_api.h"

#define EXPORT __attribute__((visibility("default")))

struct nvml_device {
    int index;
};
static struct nvml_device devices[DBL_MAX_DEV] = {{0}, {1}, {2}, {3}};

static int valid(nvmlDevice_t d) {
    struct nvml_device *x = (struct nvml_device *)d;
    return x >= devices && x < devices + dbl_env.ndev;
}
static int idx(nvmlDevice_t d) { return ((struct nvml_device *)d)->index; }

EXPORT nvmlReturn_t nvmlInit_v2(void) {
    dbl_ready();
    return NVML_SUCCESS;
}
EXPORT nvmlReturn_t nvmlInit(void) { return nvmlInit_v2(); }
EXPORT nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    return nvmlInit_v2();
}
EXPORT nvmlReturn_t nvmlShutdown(void) { return NVML_SUCCESS; }
EXPORT nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *n) {
    dbl_ready();
    *n = (unsigned)dbl_env.ndev;
    return NVML_SUCCESS;
}
EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int i, nvmlDevice_t *d) {
    dbl_ready();
    if ((int)i >= dbl_env.ndev) return NVML_ERROR_INVALID_ARGUMENT;
    *d = (nvmlDevice_t)&devices[i];
    return NVML_SUCCESS;
}
static void uuid_of(int i, char *out, unsigned len) {
    snprintf(out, len, "GPU-d00b1e00-7369-6d2d-6770-7500000000%02x", i);
}
EXPORT nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t d, char *out, unsigned int len) {
    if (!valid(d)) return NVML_ERROR_INVALID_ARGUMENT;
    uuid_of(idx(d), out, len);
    return NVML_SUCCESS;
}
EXPORT nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *d) {
    dbl_ready();
    char buf[96];
    for (int i = 0; i < dbl_env.ndev; i++) {
        uuid_of(i, buf, sizeof(buf));
        if (strcmp(buf, uuid) == 0) {
            *d = (nvmlDevice_t)&devices[i];
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_NOT_FOUND;
}
EXPORT nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t d, unsigned int *i) {
    if (!valid(d)) return NVML_ERROR_INVALID_ARGUMENT;
    *i = (unsigned)idx(d);
    return NVML_SUCCESS;
}
EXPORT nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t d, char *name, unsigned int len) {
    if (!valid(d)) return NVML_ERROR_INVALID_ARGUMENT;
    snprintf(name, len, "Simulated GPU %d", idx(d));
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t d, nvmlMemory_t *m) {
    if (!valid(d) || !m) return NVML_ERROR_INVALID_ARGUMENT;
    dbl_lock();
    dbl_pid_locked(getpid());
    struct dbl_dev *x = &dbl->dev[idx(d)];
    m->total = x->total;
    m->used = x->used;
    m->free = x->total - x->used;
    dbl_unlock();
    return NVML_SUCCESS;
}
EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t d, nvmlMemory_v2_t *m) {
    nvmlMemory_t v1;
    if (!m || m->version != nvmlMemory_v2) return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t rc = nvmlDeviceGetMemoryInfo(d, &v1);
    if (rc) return rc;
    m->total = v1.total;
    m->reserved = 0;
    m->used = v1.used;
    m->free = v1.free;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t d, nvmlUtilization_t *u) {
    if (!valid(d) || !u) return NVML_ERROR_INVALID_ARGUMENT;
    uint64_t now = dbl_now(), w = dbl_env.util_window_ns;
    dbl_lock();
    uint64_t busy = dbl_busy_locked(idx(d), 0, now - w, now);
    dbl_unlock();
    u->gpu = (unsigned)((busy * 100 + w / 2) / w);
    u->memory = 0;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t d,
                                                    nvmlProcessUtilizationSample_t *out,
                                                    unsigned int *count,
                                                    unsigned long long last_seen_us) {
    if (!valid(d) || !count) return NVML_ERROR_INVALID_ARGUMENT;
    if (dbl_env.no_process_util) return NVML_ERROR_NOT_SUPPORTED;
    uint64_t now = dbl_now(), t0 = last_seen_us * 1000;
    if (t0 < now - 1000000000ull || t0 >= now) t0 = now - 1000000000ull;
    uint64_t window = now - t0;
    int pids[DBL_PIDS], n = 0;
    uint64_t busy[DBL_PIDS];
    dbl_lock();
    struct dbl_dev *x = &dbl->dev[idx(d)];
    uint64_t total = x->head < DBL_RING ? x->head : DBL_RING;
    for (uint64_t k = 0; k < total; k++) {
        const struct dbl_kernel *r = &x->ring[(x->head - 1 - k) % DBL_RING];
        if (r->end <= t0) break;
        uint64_t s = r->start > t0 ? r->start : t0, e = r->end < now ? r->end : now;
        if (e <= s) continue;
        int j = 0;
        while (j < n && pids[j] != r->pid) j++;
        if (j == n) {
            if (n == DBL_PIDS) continue;
            pids[n] = r->pid;
            busy[n++] = 0;
        }
        busy[j] += e - s;
    }
    dbl_unlock();
    if (!n) return NVML_ERROR_NOT_FOUND;
    if (!out) {
        *count = (unsigned)n;
        return NVML_SUCCESS;
    }
    if (*count < (unsigned)n) {
        *count = (unsigned)n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    for (int j = 0; j < n; j++) {
        memset(&out[j], 0, sizeof(out[j]));
        out[j].pid = (unsigned)pids[j];
        out[j].timeStamp = now / 1000;
        out[j].smUtil = (unsigned)((busy[j] * 100 + window / 2) / window);
    }
    *count = (unsigned)n;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t d, unsigned int *count,
                                                            nvmlProcessInfo_v2_t *out) {
    if (!valid(d) || !count) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned n = 0, cap = *count;
    dbl_lock();
    dbl_pid_locked(getpid());
    for (int i = 0; i < DBL_PIDS; i++) {
        struct dbl_pid *p = &dbl->pids[i];
        if (!p->pid || (!p->used[idx(d)] && !p->contexts[idx(d)])) continue;
        if (out && n < cap) {
            memset(&out[n], 0, sizeof(out[n]));
            out[n].pid = (unsigned)p->pid;
            out[n].usedGpuMemory = p->used[idx(d)];
        }
        n++;
    }
    dbl_unlock();
    *count = n;
    return n > cap ? NVML_ERROR_INSUFFICIENT_SIZE : NVML_SUCCESS;
}

__attribute__((constructor)) static void double_env(void) { dbl_ready(); }
