/*
 * An NVML test double: built by the tests as libnvidia-ml.so.1. Reads the simulated devices
 * of double_state.h: memory as the device sees it, device-wide utilisation over the last
 * CUDA_DOUBLE_UTIL_WINDOW_MS, per-process SM utilisation as a driver samples it (one integer
 * percent per process per CUDA_DOUBLE_UTIL_SAMPLE_MS period, stamped with the period's end,
 * the samples newer than lastSeenTimeStamp returned, the last second's at most), and the
 * memory each process uses (contexts and modules included), all measured from the kernels
 * that really ran on the simulated timeline.
 *
 * For the node agent (additive; unset variables keep the behaviour above):
 *   CUDA_DOUBLE_NAME           device name(s) (double_state.h)
 *   CUDA_DOUBLE_TEMPERATURE_C  nvmlDeviceGetTemperature: this + index (default 40)
 *   CUDA_DOUBLE_SM_COUNT       nvmlDeviceGetAttributes_v2 on a full GPU (unset: NOT_SUPPORTED,
 *                              as real drivers answer for non-MIG handles)
 *   CUDA_DOUBLE_MIG            GPUs in MIG mode and their instances, e.g. "1:3g.40gb,3g.40gb"
 *                              (several GPUs separated by ';'); others report MIG disabled
 *   CUDA_DOUBLE_XID_FILE       a file of "<device index> <xid>" lines: every line appended
 *                              after nvmlEventSetCreate is delivered by nvmlEventSetWait_v2 as
 *                              an Xid critical error event of that device
 *   CUDA_DOUBLE_LOST_FILE      device indexes (whitespace-separated) that fell off the bus: as
 *                              a real driver, nvmlDeviceGetHandleByUUID and
 *                              nvmlDeviceGetMemoryInfo answer NVML_ERROR_GPU_IS_LOST for them
 *                              until a reset (the index taken out of the file)
 * nvmlDeviceGetComputeRunningProcesses_v3 answers like _v2 (same structure).
 * Test helper (not NVML): nvmlDoubleProcessQueries, how many process lists this process asked
 * for (each is a driver round trip on a real GPU).
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

/* ---- MIG instances (CUDA_DOUBLE_MIG) ------------------------------------------------------- */

#define DBL_MIG_MAX 7
struct nvml_mig {
    int parent, index;
    char profile[32];
};
static struct nvml_mig migs[DBL_MAX_DEV][DBL_MIG_MAX];
static int mig_count[DBL_MAX_DEV];
static int mig_enabled[DBL_MAX_DEV];
static pthread_once_t mig_once = PTHREAD_ONCE_INIT;

static void mig_parse(void) {
    const char *spec = getenv("CUDA_DOUBLE_MIG");
    if (!spec) return;
    char buf[512];
    snprintf(buf, sizeof(buf), "%s", spec);
    char *save_gpu = NULL;
    for (char *gpu = strtok_r(buf, ";", &save_gpu); gpu; gpu = strtok_r(NULL, ";", &save_gpu)) {
        char *colon = strchr(gpu, ':');
        int dev = atoi(gpu);
        if (dev < 0 || dev >= DBL_MAX_DEV) continue;
        mig_enabled[dev] = 1;
        if (!colon) continue;
        char *save_p = NULL;
        for (char *p = strtok_r(colon + 1, ",", &save_p); p && mig_count[dev] < DBL_MIG_MAX;
             p = strtok_r(NULL, ",", &save_p)) {
            struct nvml_mig *m = &migs[dev][mig_count[dev]];
            m->parent = dev;
            m->index = mig_count[dev]++;
            snprintf(m->profile, sizeof(m->profile), "%s", p);
        }
    }
}
static void mig_ready(void) { pthread_once(&mig_once, mig_parse); }

static struct nvml_mig *as_mig(nvmlDevice_t d) {
    struct nvml_mig *m = (struct nvml_mig *)d;
    if (m < &migs[0][0] || m >= &migs[0][0] + DBL_MAX_DEV * DBL_MIG_MAX) return NULL;
    return m->index < mig_count[m->parent] ? m : NULL;
}
/* "3g.40gb" -> 3 slices, 40 GiB */
static int mig_slices(const struct nvml_mig *m) { return atoi(m->profile); }
static uint64_t mig_memory(const struct nvml_mig *m) {
    const char *dot = strchr(m->profile, '.');
    return dot ? strtoull(dot + 1, NULL, 10) << 30 : 0;
}
static void device_name(int i, char *name, unsigned len) { dbl_device_name(i, name, len); }

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
static void uuid_of(int i, char *out, unsigned len) { dbl_uuid_text(i, out, len); }
EXPORT nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t d, char *out, unsigned int len) {
    struct nvml_mig *m = as_mig(d);
    if (m) {
        snprintf(out, len, "MIG-d00b1e00-7369-6d2d-6d69-6700000000%d%d", m->parent, m->index);
        return NVML_SUCCESS;
    }
    if (!valid(d)) return NVML_ERROR_INVALID_ARGUMENT;
    uuid_of(idx(d), out, len);
    return NVML_SUCCESS;
}
#define DBL_NVML_ERROR_GPU_IS_LOST 15
/* Whether device i is listed in CUDA_DOUBLE_LOST_FILE (read at each call: a test resets it). */
static int lost(int i) {
    const char *path = getenv("CUDA_DOUBLE_LOST_FILE");
    FILE *f = path ? fopen(path, "r") : NULL;
    int found = 0, n;
    while (f && !found && fscanf(f, "%d", &n) == 1) found = n == i;
    if (f) fclose(f);
    return found;
}
EXPORT nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *d) {
    dbl_ready();
    char buf[96];
    for (int i = 0; i < dbl_env.ndev; i++) {
        uuid_of(i, buf, sizeof(buf));
        if (strcmp(buf, uuid) == 0) {
            if (lost(i)) return DBL_NVML_ERROR_GPU_IS_LOST;
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
EXPORT nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t d, unsigned int *minor) {
    if (!valid(d) || as_mig(d) || !minor) return NVML_ERROR_INVALID_ARGUMENT;
    *minor = (unsigned)idx(d); /* /dev/nvidia<index> */
    return NVML_SUCCESS;
}
EXPORT nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t d, char *name, unsigned int len) {
    struct nvml_mig *m = as_mig(d);
    if (m) {
        char parent[96];
        device_name(m->parent, parent, sizeof(parent));
        snprintf(name, len, "%s MIG %s", parent, m->profile);
        return NVML_SUCCESS;
    }
    if (!valid(d)) return NVML_ERROR_INVALID_ARGUMENT;
    device_name(idx(d), name, len);
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t d, nvmlMemory_t *m) {
    struct nvml_mig *g = as_mig(d);
    if (g && m) {
        m->total = mig_memory(g);
        m->used = 0;
        m->free = m->total;
        return NVML_SUCCESS;
    }
    if (!valid(d) || !m) return NVML_ERROR_INVALID_ARGUMENT;
    if (lost(idx(d))) return DBL_NVML_ERROR_GPU_IS_LOST;
    dbl_lock();
    dbl_pid_locked(dbl_self());
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

/* Busy ns per pid of the kernels that ran within [t0, t1) on dev (lock held); n pids. */
static int busy_per_pid_locked(int dev, uint64_t t0, uint64_t t1, int *pids, uint64_t *busy) {
    struct dbl_dev *x = &dbl->dev[dev];
    uint64_t total = x->head < DBL_RING ? x->head : DBL_RING;
    int n = 0;
    for (uint64_t k = 0; k < total; k++) {
        const struct dbl_kernel *r = &x->ring[(x->head - 1 - k) % DBL_RING];
        if (r->end <= t0) break;
        uint64_t s = r->start > t0 ? r->start : t0, e = r->end < t1 ? r->end : t1;
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
    return n;
}

#define DBL_SAMPLES 512
static _Thread_local nvmlProcessUtilizationSample_t samples[DBL_SAMPLES];

/* The samples a driver would hold newer than t0: one per process busy in each sample period
 * (periods end at multiples of the sample period), integer percent. */
static unsigned sampled_locked(int dev, uint64_t t0, uint64_t now) {
    uint64_t period = dbl_env.util_sample_ns;
    int pids[DBL_PIDS];
    uint64_t busy[DBL_PIDS];
    unsigned n = 0;
    for (uint64_t end = (t0 / period + 1) * period; end <= now && n < DBL_SAMPLES; end += period) {
        int np = busy_per_pid_locked(dev, end - period, end, pids, busy);
        for (int j = 0; j < np && n < DBL_SAMPLES; j++) {
            memset(&samples[n], 0, sizeof(samples[n]));
            samples[n].pid = (unsigned)pids[j];
            samples[n].timeStamp = end / 1000;
            samples[n++].smUtil = (unsigned)((busy[j] * 100 + period / 2) / period);
        }
    }
    return n;
}

/* Exact utilisation over [t0, now) per process, one sample each (CUDA_DOUBLE_UTIL_SAMPLE_MS=0). */
static unsigned exact_locked(int dev, uint64_t t0, uint64_t now) {
    int pids[DBL_PIDS];
    uint64_t busy[DBL_PIDS];
    int np = busy_per_pid_locked(dev, t0, now, pids, busy);
    unsigned n = 0;
    for (int j = 0; j < np && n < DBL_SAMPLES; j++) {
        memset(&samples[n], 0, sizeof(samples[n]));
        samples[n].pid = (unsigned)pids[j];
        samples[n].timeStamp = now / 1000;
        samples[n++].smUtil = (unsigned)((busy[j] * 100 + (now - t0) / 2) / (now - t0));
    }
    return n;
}

EXPORT nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t d,
                                                    nvmlProcessUtilizationSample_t *out,
                                                    unsigned int *count,
                                                    unsigned long long last_seen_us) {
    if (!valid(d) || !count) return NVML_ERROR_INVALID_ARGUMENT;
    if (dbl_env.no_process_util) return NVML_ERROR_NOT_SUPPORTED;
    uint64_t now = dbl_now(), t0 = last_seen_us * 1000;
    if (t0 < now - 1000000000ull || t0 >= now) t0 = now - 1000000000ull; /* the last second's */
    dbl_lock();
    unsigned n = dbl_env.util_sample_ns ? sampled_locked(idx(d), t0, now) : exact_locked(idx(d), t0, now);
    dbl_unlock();
    if (!n) return NVML_ERROR_NOT_FOUND;
    if (!out) {
        *count = n;
        return NVML_SUCCESS;
    }
    if (*count < n) {
        *count = n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    memcpy(out, samples, n * sizeof(*out));
    *count = n;
    return NVML_SUCCESS;
}

static _Atomic unsigned long long process_queries; /* by this process */

EXPORT unsigned long long nvmlDoubleProcessQueries(void) { return process_queries; }

EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t d, unsigned int *count,
                                                            nvmlProcessInfo_v2_t *out) {
    process_queries++;
    if (!valid(d) || !count) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned n = 0, cap = *count;
    dbl_lock();
    dbl_pid_locked(dbl_self());
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

EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t d, unsigned int *count,
                                                            nvmlProcessInfo_v2_t *out) {
    return nvmlDeviceGetComputeRunningProcesses_v2(d, count, out);
}

/* ---- for the node agent: temperature, attributes, MIG, Xid events ------------------------ */

EXPORT nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t d, int sensor, unsigned int *temp) {
    if (!valid(d) || !temp || sensor != 0) return NVML_ERROR_INVALID_ARGUMENT;
    *temp = (unsigned)dbl_env_u64("CUDA_DOUBLE_TEMPERATURE_C", 40) + (unsigned)idx(d);
    return NVML_SUCCESS;
}

struct dbl_attributes { /* nvmlDeviceAttributes_t */
    unsigned int multiprocessorCount, sharedCopyEngineCount, sharedDecoderCount,
        sharedEncoderCount, sharedJpegCount, sharedOfaCount, gpuInstanceSliceCount,
        computeInstanceSliceCount;
    unsigned long long memorySizeMB;
};

EXPORT nvmlReturn_t nvmlDeviceGetAttributes_v2(nvmlDevice_t d, struct dbl_attributes *a) {
    if (!a) return NVML_ERROR_INVALID_ARGUMENT;
    mig_ready();
    struct nvml_mig *m = as_mig(d);
    memset(a, 0, sizeof(*a));
    if (m) {
        unsigned per_slice = (unsigned)dbl_env_u64("CUDA_DOUBLE_SM_COUNT", 98) / 7;
        a->multiprocessorCount = per_slice * (unsigned)mig_slices(m);
        a->gpuInstanceSliceCount = a->computeInstanceSliceCount = (unsigned)mig_slices(m);
        a->memorySizeMB = mig_memory(m) >> 20;
        return NVML_SUCCESS;
    }
    if (!valid(d)) return NVML_ERROR_INVALID_ARGUMENT;
    if (!getenv("CUDA_DOUBLE_SM_COUNT")) return NVML_ERROR_NOT_SUPPORTED;
    a->multiprocessorCount = (unsigned)dbl_env_u64("CUDA_DOUBLE_SM_COUNT", 0);
    a->memorySizeMB = dbl_env.memory >> 20;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t d, unsigned int *current,
                                         unsigned int *pending) {
    if (!valid(d) || !current || !pending) return NVML_ERROR_INVALID_ARGUMENT;
    mig_ready();
    *current = *pending = (unsigned)mig_enabled[idx(d)];
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t d, unsigned int *count) {
    if (!valid(d) || !count) return NVML_ERROR_INVALID_ARGUMENT;
    mig_ready();
    *count = mig_enabled[idx(d)] ? DBL_MIG_MAX : 0;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t d, unsigned int i,
                                                        nvmlDevice_t *out) {
    if (!valid(d) || !out) return NVML_ERROR_INVALID_ARGUMENT;
    mig_ready();
    if (!mig_enabled[idx(d)]) return NVML_ERROR_INVALID_ARGUMENT;
    if ((int)i >= mig_count[idx(d)]) return NVML_ERROR_NOT_FOUND;
    *out = (nvmlDevice_t)&migs[idx(d)][i];
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceIsMigDeviceHandle(nvmlDevice_t d, unsigned int *is_mig) {
    if (!is_mig) return NVML_ERROR_INVALID_ARGUMENT;
    mig_ready();
    *is_mig = as_mig(d) != NULL;
    return NVML_SUCCESS;
}

#define DBL_EVENT_XID 0x8ull /* nvmlEventTypeXidCriticalError */
#define DBL_ERROR_TIMEOUT 10 /* NVML_ERROR_TIMEOUT */

struct dbl_event_set {
    unsigned registered; /* bit per device */
    long offset;         /* bytes of CUDA_DOUBLE_XID_FILE already delivered */
};
struct dbl_event_data { /* nvmlEventData_t */
    nvmlDevice_t device;
    unsigned long long eventType, eventData;
    unsigned int gpuInstanceId, computeInstanceId;
};

static long xid_file_size(void) {
    const char *path = getenv("CUDA_DOUBLE_XID_FILE");
    struct stat st;
    return path && stat(path, &st) == 0 ? (long)st.st_size : 0;
}

EXPORT nvmlReturn_t nvmlEventSetCreate(struct dbl_event_set **set) {
    if (!set) return NVML_ERROR_INVALID_ARGUMENT;
    *set = calloc(1, sizeof(**set));
    if (!*set) return NVML_ERROR_UNKNOWN;
    (*set)->offset = xid_file_size(); /* like the driver: only events from now on */
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlEventSetFree(struct dbl_event_set *set) {
    free(set);
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t d, unsigned long long *types) {
    if (!valid(d) || !types) return NVML_ERROR_INVALID_ARGUMENT;
    *types = DBL_EVENT_XID;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t d, unsigned long long types,
                                             struct dbl_event_set *set) {
    if (!valid(d) || !set) return NVML_ERROR_INVALID_ARGUMENT;
    if (types & ~DBL_EVENT_XID) return NVML_ERROR_NOT_SUPPORTED;
    set->registered |= 1u << idx(d);
    return NVML_SUCCESS;
}

/* The next complete "<index> <xid>" line after set->offset for a registered device. */
static int xid_next(struct dbl_event_set *set, int *dev, unsigned long long *xid) {
    const char *path = getenv("CUDA_DOUBLE_XID_FILE");
    FILE *f = path ? fopen(path, "r") : NULL;
    if (!f) return 0;
    int found = 0;
    char line[128];
    if (fseek(f, set->offset, SEEK_SET) == 0) {
        while (!found && fgets(line, sizeof(line), f)) {
            size_t n = strlen(line);
            if (!n || line[n - 1] != '\n') break; /* partly written: next time */
            set->offset += (long)n;
            int d;
            unsigned long long x;
            if (sscanf(line, "%d %llu", &d, &x) == 2 && d >= 0 && d < dbl_env.ndev &&
                (set->registered & (1u << d))) {
                *dev = d;
                *xid = x;
                found = 1;
            }
        }
    }
    fclose(f);
    return found;
}

EXPORT nvmlReturn_t nvmlEventSetWait_v2(struct dbl_event_set *set, struct dbl_event_data *data,
                                        unsigned int timeout_ms) {
    if (!set || !data) return NVML_ERROR_INVALID_ARGUMENT;
    uint64_t deadline = dbl_now() + (uint64_t)timeout_ms * 1000000ull;
    for (;;) {
        int dev;
        unsigned long long xid;
        if (xid_next(set, &dev, &xid)) {
            memset(data, 0, sizeof(*data));
            data->device = (nvmlDevice_t)&devices[dev];
            data->eventType = DBL_EVENT_XID;
            data->eventData = xid;
            return NVML_SUCCESS;
        }
        uint64_t now = dbl_now();
        if (now >= deadline) return DBL_ERROR_TIMEOUT;
        uint64_t step = deadline - now < 10000000ull ? deadline - now : 10000000ull;
        dbl_sleep_until(now + step);
    }
}

__attribute__((constructor)) static void double_env(void) { dbl_ready(); }
