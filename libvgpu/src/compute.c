/*
 * compute.c: the launch gate (kernel launches, cooperative launches, graph launches).
 *
 * Every launch stamps the activity record (a clock read through the vDSO and a store to this
 * process's slot, at most once per clock tick). Without a cores limit or node regions that is
 * all: no locks, no syscalls. With them, the launch passes the priority gate (priority.c)
 * and the rate limiter below.
 *
 * The rate limiter is a token bucket in GPU time shared by the container's processes: it
 * refills at cores_percent of wall time, each launch takes the measured GPU time of one
 * launch, and a launch that finds the bucket in debt sleeps the debt off. The cost of a launch
 * is measured, not guessed: every SAMPLE_NS one process asks NVML for the container's SM
 * utilisation over the window and divides the GPU time it implies by the launches admitted
 * in that window. Kernels of any length and graphs of any size are limited the same way.
 *
 * While the cost is not known (a cold start, or after idle) launches are not let through at
 * a guessed rate: each one is measured on its stream with a pair of events and waited for
 * before the next, so no backlog can build up, and the first measurement sets the cost at
 * once (a 200 ms graph is held to the limit from its second launch). The measurement keeps to
 * the rules of stream capture (see relaxed() below).
 */
#define _GNU_SOURCE
#include "vgpu.h"

#define SAMPLE_NS (50ull * 1000000ull)
#define BURST_NS (50ull * 1000000ull)

static _Atomic uint64_t stamp_ns; /* last activity stamp written by this process */

static void stamp_slow(uint64_t now) {
    struct vgpu_container_region *r = vgpu.reg;
    if (vgpu.me) atomic_store_explicit(&vgpu.me->last_launch_ns, now, memory_order_relaxed);
    if (now - atomic_load_explicit(&r->last_launch_ns, memory_order_relaxed) >= 1000000ull)
        atomic_store_explicit(&r->last_launch_ns, now, memory_order_relaxed);
    struct vgpu_activity *a = vgpu.act;
    if (a) {
        if (now - atomic_load_explicit(&a->last_launch_ns, memory_order_relaxed) >= 1000000ull)
            atomic_store_explicit(&a->last_launch_ns, now, memory_order_relaxed);
    }
}

/* The counts are approximate (the region's contract): threads of a process, and processes of
 * a container for the activity record's, may race and lose one. So they are plain loads and
 * stores, not locked additions: a locked addition waits for every earlier store to reach the
 * cache, and on the launch path that includes the driver's. */
static inline void stamp_activity(void) {
    struct vgpu_slot *me = vgpu.me;
    if (VGPU_LIKELY(me != NULL)) { /* the slot's count is stored, not read (vgpu.launches) */
        uint64_t n = atomic_load_explicit(&vgpu.launches, memory_order_relaxed) + 1;
        atomic_store_explicit(&vgpu.launches, n, memory_order_relaxed);
        atomic_store_explicit(&me->launches, n, memory_order_relaxed);
    }
    struct vgpu_activity *a = vgpu.act;
    if (VGPU_LIKELY(a != NULL))
        atomic_store_explicit(&a->launches,
                              atomic_load_explicit(&a->launches, memory_order_relaxed) + 1,
                              memory_order_relaxed);
    uint64_t now = vgpu_coarse_real_ns(); /* vDSO, ~1-4 ms resolution */
    if (VGPU_LIKELY(now == atomic_load_explicit(&stamp_ns, memory_order_relaxed))) return;
    atomic_store_explicit(&stamp_ns, now, memory_order_relaxed);
    stamp_slow(now);
}

/* ---- the rate limiter -------------------------------------------------------------------- */

#define PROBE_LAUNCHES 16           /* launches per window while the cost is not known yet */
#define STALE_NS 3000000000ull      /* nobody launched for this long: measure afresh */
#define MAX_WINDOW_NS 2000000000ull /* give up waiting for NVML samples after this long */
#define MAX_SLEEP_NS 10000000000ull /* one launch never waits longer than this */
#define SATURATED_PERMILLE 970      /* a window this busy is "saturated" */
#define COST_WINDOW_NS 1000000000ull /* the longest window kept open for a cost estimate */
#define COST_LAUNCHES 8             /* launches' time a window needs to re-estimate the cost */

/* The container's launch count as this process saw it at recent times (NVML timestamps, us):
 * NVML's samples end in the past (a period of 1/6 s to 1 s, then the time to ask), so the
 * launches a window of samples holds are those let through by its end, not by now. */
#define HISTORY 64
#define HISTORY_STEP_NS 5000000ull
static struct {
    uint64_t us, total;
} history[VGPU_MAX_DEV][HISTORY];
static _Atomic unsigned history_next[VGPU_MAX_DEV];
static _Atomic uint64_t history_ns[VGPU_MAX_DEV];

static void remember(int dev, struct vgpu_compute *c, uint64_t now) {
    uint64_t last = atomic_load_explicit(&history_ns[dev], memory_order_relaxed);
    if (now - last < HISTORY_STEP_NS || !atomic_compare_exchange_strong(&history_ns[dev], &last, now))
        return;
    unsigned i = atomic_fetch_add(&history_next[dev], 1) % HISTORY;
    history[dev][i].total = atomic_load(&c->total);
    history[dev][i].us = vgpu_real_ns() / 1000;
}

/* The container's launch count at NVML time us: the last one remembered by then (the oldest
 * remembered if us is older; the current one if none is). */
static uint64_t total_at(int dev, struct vgpu_compute *c, uint64_t us) {
    uint64_t best_us = 0, best = atomic_load(&c->total), oldest_us = UINT64_MAX, oldest = best;
    for (unsigned i = 0; i < HISTORY; i++) {
        uint64_t t = history[dev][i].us;
        if (!t) continue;
        if (t <= us && t > best_us) best_us = t, best = history[dev][i].total;
        if (t < oldest_us) oldest_us = t, oldest = history[dev][i].total;
    }
    return best_us ? best : oldest_us != UINT64_MAX ? oldest : best;
}

/* The busy windows this process read in a row (process-local: another process of the
 * container that reads a window breaks the row): GPU time and launches, each window's weight
 * three quarters of the next one's. */
static struct {
    uint64_t end_us;
    double busy_ns, launches;
} busy_row[VGPU_MAX_DEV];

/* The GPU time per launch over the row, with this window [since, ts] (NVML us) added. */
static uint64_t busy_run(int dev, uint64_t since, uint64_t ts, uint64_t busy, uint64_t n) {
    if (busy_row[dev].end_us != since) busy_row[dev].busy_ns = busy_row[dev].launches = 0;
    busy_row[dev].busy_ns = busy_row[dev].busy_ns * 0.75 + (double)busy;
    busy_row[dev].launches = busy_row[dev].launches * 0.75 + (double)n;
    busy_row[dev].end_us = ts;
    return (uint64_t)(busy_row[dev].busy_ns / busy_row[dev].launches);
}

static void restart(struct vgpu_compute *c) {
    atomic_store(&c->aligned, 0);
    atomic_store(&c->launches, 0);
    atomic_store(&c->window_total, atomic_load(&c->total));
    atomic_store(&c->sample_us, vgpu_real_ns() / 1000);
}

static void sample(int dev, uint32_t pct, struct vgpu_compute *c, uint64_t last, uint64_t now,
                   uint64_t prev_gate) {
    if (!atomic_compare_exchange_strong(&c->sample_ns, &last, now)) return; /* someone else */
    uint64_t since = atomic_load(&c->sample_us);
    if (last == 0 || since == 0) {
        restart(c);
        return;
    }
    if (now - prev_gate > STALE_NS) { /* idle: measure the (maybe new) work afresh */
        atomic_store(&c->cost_ns, 0);
        atomic_store(&c->tokens_ns, 0);
        restart(c);
        return;
    }
    uint64_t ts = since;
    uint32_t permille, gpu_permille;
    int src = vgpu_nvml_container_util(dev, &ts, &permille, &gpu_permille);
    if (src < 0) {
        static _Atomic int warned;
        if (!atomic_exchange(&warned, 1))
            vgpu_log("NVML gives no utilisation for GPU %d: its cores limit cannot be enforced",
                     dev);
        return;
    }
    uint64_t window_ns = ts > since ? (ts - since) * 1000 : 0;
    if (src == 2 && window_ns < MAX_WINDOW_NS) return; /* no new samples: keep the window open */
    /* a launch timed with events while no one else used the card waited for nothing: its time
     * is the cost (the rules for one that waited, below, are for a card others keep busy) */
    if (src == 0 && gpu_permille < permille + 50 && atomic_load(&c->probed))
        atomic_store(&c->probed, 0);
    uint64_t old = atomic_load(&c->cost_ns), guard = old;
    if (old && atomic_load(&c->probed)) { /* old is a timed launch, its wait included: a launch
                                           * costs at most what NVML says this window's ran */
        uint64_t so_far = atomic_load(&c->total) - atomic_load(&c->window_total);
        uint64_t most = (uint64_t)((permille + 5) / 1000.0 * (double)window_ns);
        if (most / (so_far ? so_far : 1) < guard) guard = most / (so_far ? so_far : 1);
    }
    /* NVML samples whole periods (1/6 s to 1 s) and the launches counted here are not aligned
     * with them: a window must hold several launches to tell what one costs, so it stays open
     * up to COST_WINDOW_NS while it is shorter than COST_LAUNCHES launches */
    if (src == 0 && window_ns < COST_LAUNCHES * guard && window_ns < COST_WINDOW_NS) return;
    if (!window_ns) window_ns = now - last;
    if (src == 0 && (!atomic_exchange(&c->aligned, 1) || window_ns > COST_WINDOW_NS)) {
        /* the first samples (their period began before the window) or a window longer than
         * NVML is sure to keep samples for: the next window begins where these end */
        atomic_store(&c->launches, 0);
        atomic_store(&c->window_total, total_at(dev, c, ts - old / 2000));
        atomic_store(&c->sample_us, ts);
        return;
    }
    uint64_t n = atomic_exchange(&c->launches, 0);
    if (src == 0) { /* the launches let through within the sampled window (a launch counts
                     * where the middle of its run falls) */
        uint64_t end = total_at(dev, c, ts - old / 2000), begin = atomic_exchange(&c->window_total, end);
        if (begin && end >= begin) n = end - begin;
    } else {
        atomic_store(&c->window_total, atomic_load(&c->total));
    }
    atomic_store(&c->sample_us, ts > since ? ts : vgpu_real_ns() / 1000);
    atomic_store(&c->util_permille, permille);
    uint64_t busy = (uint64_t)((double)permille / 1000.0 * (double)window_ns);
    vgpu_compute_ran(dev, busy, window_ns);
    /* The GPU was busy all window (other containers' work, or ours): launches admitted in it
     * may still be queued behind that work, so a low use of ours says nothing about the cost
     * of a launch, and the time they have not run yet is no credit. */
    int gpu_busy = gpu_permille >= SATURATED_PERMILLE;
    /* the bucket was charged old per launch; charge what the GPU really ran instead, so work
     * queued earlier is paid for when it runs (the debt is bounded: stop feeding, no payback;
     * the credit too: one burst, and none while our launches may be waiting on the GPU) */
    if (old) {
        int64_t delta = (int64_t)(n * old) - (int64_t)busy;
        if (delta > 0 && gpu_busy) delta = 0;
        /* the correction is bounded to one burst either way, and the launches' own charges
         * are not forgiven: a debt that other processes of the container are sleeping off
         * stays (long launches counted in one window often run in the next: the credit of
         * one window is the debit of the next) */
        int64_t bound = (int64_t)(BURST_NS * pct / 100);
        if (delta > bound) delta = bound;
        if (delta < -bound) delta = -bound;
        int64_t t = atomic_fetch_add(&c->tokens_ns, delta) + delta;
        while (t > bound && !atomic_compare_exchange_weak(&c->tokens_ns, &t, bound)) {
        }
    }
    /* fewer than COST_LAUNCHES launches' time in the window (long launches): the part of a
     * launch that falls in it is too large a share of it, so it says too little of the cost;
     * the measured cost stands (the bucket was corrected above) */
    if (old && window_ns < COST_LAUNCHES * guard) return;
    /* (a window of a few launches is busy throughout whenever they fall in it together) */
    int saturated = permille >= SATURATED_PERMILLE && pct <= 90 && window_ns >= 16 * old;
    if (!n && !saturated) return;
    uint64_t cost;
    uint64_t bound = window_ns / (n ? n : 1);
    /* the first window after a launch timed with events: that launch waited behind the work
     * queued on the card (three bursting neighbours' kernels: 2 ms measured as 3.5-117 ms), so its
     * time is an upper bound, and what NVML says the launches ran replaces it at once, busy
     * card or not (halving per window, and never on a busy card, held a newcomer under its
     * floor for seconds). NVML rounds to 1 %: under 3 % the estimate is too coarse to be told
     * from its error, so the most the launches can have cost stands, still an upper bound,
     * until a window says more. Then the rules below.
     * The windows are read together until they hold COST_LAUNCHES launches: the launches are
     * counted when let through, and one let through late in a window may run in the next,
     * behind others' work, so a window of one to three launches is off by one (beside two CPU
     * hogs: 0 % busy with one launch, 2 % with three, 4 % with two, estimates of 0.4-1.7
     * times the cost); read together the launch that ran late is counted where it ran, only
     * the last one may not have run yet (at least all but half a launch are taken to have),
     * and while nothing of ours ran and at most two launches were counted there is no bound. */
    int fine = permille >= 30, probed = n && atomic_load(&c->probed);
    uint64_t first = 0;
    if (probed) {
        uint64_t all = atomic_fetch_add(&c->probe_n, n) + n;
        uint64_t ran = atomic_fetch_add(&c->probe_busy_ns, busy) + busy;
        uint64_t slack = fine ? 0 : window_ns / 200;
        slack += atomic_fetch_add(&c->probe_slack_ns, slack);
        if (!ran && all < 3) return;
        first = all > 1 ? 2 * (ran + slack) / (2 * all - 1) : ran + slack;
        /* more than the bound from fewer than COST_LAUNCHES launches: launches let through
         * before these windows ran in them (a process that could not launch for a while, its
         * earlier launches still queued behind others' work), so they say nothing more; the
         * bound stands and the windows go on being read together */
        if (first >= old && all < COST_LAUNCHES) first = old;
        else if (first >= old || (fine && all >= COST_LAUNCHES)) atomic_store(&c->probed, 0);
    }
    if (probed && first <= old) {
        cost = first;
    } else if (saturated) {
        /* busy all window although limited: queued work hides the real cost. The debt above
         * already stops the feeding; raise the estimate at most twofold per window. */
        cost = old ? (bound > 2 * old ? 2 * old : bound > old ? bound : old) : bound;
    } else if (gpu_busy) {
        /* others kept the GPU busy: our launches wait behind their work (80 ms behind a
         * neighbour without a cores limit that keeps its queue full), so a window holds
         * launches let through in the one before: after a change of rate it counts too many
         * (the rate rose: some have not run yet) or too few (it fell: the faster ones before
         * it run now). Every launch is counted once and runs once, so over several windows
         * the two agree: the estimate is the GPU time over the launches of the busy windows
         * read in a row, the older ones weighing less (a quarter less each window), at most
         * twofold up or down per window. (One window's rate, rising at once and never
         * falling on a busy card, kept a 25 % slice at 14 % for as long as such a neighbour
         * ran; two windows' agreement still swung it 10-35 % beside two CPU hogs.)
         * A slice bursting above its request keeps that older rule: its estimate may rise on
         * one window but not fall while the card is busy. Erring high costs it only part of
         * a burst, and its accurate estimates would fill the card to 99 % with queued work that
         * a newcomer's first launches wait behind (on the doubles, which run the processes'
         * kernels in one queue: 110-150 ms, and the newcomer's floor came back in 1.26 s at
         * p95 instead of 0.55, bench/elastic.py). */
        if (!old) cost = bound;
        else if (pct > vgpu.cfg.cores_percent[dev]) {
            uint64_t est = busy / n;
            cost = est > 2 * old ? 2 * old : est > old ? est : old;
        } else {
            cost = busy_run(dev, since, ts, busy, n);
            if (cost > 2 * old) cost = 2 * old;
            if (cost < old / 2) cost = old / 2;
        }
    } else {
        /* the GPU idled in this window: little was left queued. Below NVML's resolution
         * (1 %) the work is not known to be zero: count it as half a percent. */
        uint64_t est = (busy > window_ns / 200 ? busy : window_ns / 200) / n;
        if (!old) cost = est;
        else cost = est < old / 2 ? old / 2 : (old + est) / 2; /* down at most twofold */
    }
    atomic_store(&c->cost_ns, cost ? cost : 1);
    vgpu_debug("gpu %d: %.1f%% busy (GPU %.1f%%) over %.1f ms, %llu launches: %.1f us per launch",
               dev, permille / 10.0, gpu_permille / 10.0, window_ns / 1e6, (unsigned long long)n,
               (cost ? cost : 1) / 1e3);
}

/* ---- measuring a launch with events (cost unknown) ---------------------------------------- */

#define TLS __attribute__((tls_model("initial-exec"))) __thread
static TLS int probing_dev = -1;
static TLS CUevent probe_start, probe_end;
static TLS CUstream probe_stream;
static _Atomic int probes_active; /* any thread measuring a launch: the fast path's only check */

/* Stream capture: a launch into a capturing stream does not run now (it is gated when its
 * graph is launched), and waiting on an event recorded inside a capture is illegal (it fails
 * and invalidates the capture: PyTorch's graph capture would fail), so such a launch is
 * neither measured nor held. A thread in the default (global)
 * capture mode may not wait on any event while another thread captures in global mode, so the
 * measurement's calls run with this thread's mode relaxed, as PyTorch's allocator does around
 * cudaMalloc. relaxed(&m) switches (m keeps the old mode; 0 if the driver has no capture),
 * relaxed_end(m) switches back. */
static int relaxed(int *mode) {
    cuThreadExchangeStreamCaptureMode_fn xchg = REAL(cuThreadExchangeStreamCaptureMode);
    *mode = CU_STREAM_CAPTURE_MODE_RELAXED;
    return xchg && xchg(mode) == CUDA_SUCCESS;
}

static void relaxed_end(int had, int mode) {
    if (had) REAL(cuThreadExchangeStreamCaptureMode)(&mode);
}

static int capturing(CUstream s) {
    cuStreamIsCapturing_fn is = REAL(cuStreamIsCapturing);
    int status = CU_STREAM_CAPTURE_STATUS_NONE, mode, had = relaxed(&mode);
    int yes = is && (is(s, &status) != CUDA_SUCCESS || status != CU_STREAM_CAPTURE_STATUS_NONE);
    relaxed_end(had, mode);
    return yes;
}

/* Records a start event on s before the launch; 1 if this launch is to be measured. */
static int probe_begin(int dev, CUstream s) {
    cuEventCreate_fn create = REAL(cuEventCreate);
    cuEventRecord_fn record = REAL(cuEventRecord);
    if (!create || !record || !REAL(cuEventSynchronize) || !REAL(cuEventElapsedTime) ||
        !REAL(cuEventDestroy_v2))
        return 0;
    int mode, had = relaxed(&mode);
    int ok = create(&probe_start, 0) == CUDA_SUCCESS;
    if (ok && create(&probe_end, 0) != CUDA_SUCCESS) {
        REAL(cuEventDestroy_v2)(probe_start);
        ok = 0;
    }
    if (ok && record(probe_start, s) != CUDA_SUCCESS) {
        REAL(cuEventDestroy_v2)(probe_start);
        REAL(cuEventDestroy_v2)(probe_end);
        ok = 0;
    }
    relaxed_end(had, mode);
    if (!ok) return 0;
    probe_stream = s;
    probing_dev = dev;
    atomic_fetch_add(&probes_active, 1);
    return 1;
}

/* After the launch: waits for it, and charges what it took. */
static __attribute__((noinline)) void probe_finish(CUresult launched) {
    int dev = probing_dev;
    if (dev < 0) return; /* another thread's probe */
    probing_dev = -1;
    atomic_fetch_sub(&probes_active, 1);
    float ms = 0;
    int mode, had = relaxed(&mode);
    if (launched == CUDA_SUCCESS && REAL(cuEventRecord)(probe_end, probe_stream) == CUDA_SUCCESS &&
        REAL(cuEventSynchronize)(probe_end) == CUDA_SUCCESS &&
        REAL(cuEventElapsedTime)(&ms, probe_start, probe_end) == CUDA_SUCCESS && ms > 0) {
        struct vgpu_compute *c = &vgpu.reg->compute[dev];
        uint64_t ns = (uint64_t)((double)ms * 1e6), unknown = 0;
        if (atomic_compare_exchange_strong(&c->cost_ns, &unknown, ns ? ns : 1)) {
            atomic_store(&c->probe_n, 0);
            atomic_store(&c->probe_busy_ns, 0);
            atomic_store(&c->probe_slack_ns, 0);
            atomic_store(&c->probed, 1);
            vgpu_debug("gpu %d: a launch measured %.3f ms", dev, (double)ms);
        }
        /* not charged: a launch is paid for before it runs (the next one sleeps for its own
         * cost), and this one ran at once as the bucket's first burst */
        uint64_t never = 0;
        atomic_compare_exchange_strong(&c->refill_ns, &never, vgpu_mono_ns());
    }
    REAL(cuEventDestroy_v2)(probe_start);
    REAL(cuEventDestroy_v2)(probe_end);
    relaxed_end(had, mode);
}

static inline void probe_done(CUresult launched) {
    if (VGPU_UNLIKELY(atomic_load_explicit(&probes_active, memory_order_relaxed)))
        probe_finish(launched);
}

void vgpu_compute_gate(int dev, CUstream s) {
    uint32_t pct = vgpu_compute_share(dev); /* the request, or more while the card idles */
    struct vgpu_compute *c = &vgpu.reg->compute[dev];
    uint64_t now = vgpu_mono_ns();
    uint64_t prev_gate = atomic_load_explicit(&c->gate_ns, memory_order_relaxed);
    if (now - prev_gate >= 1000000ull) atomic_store_explicit(&c->gate_ns, now, memory_order_relaxed);
    uint64_t last = atomic_load_explicit(&c->sample_ns, memory_order_relaxed);
    if (now - last >= SAMPLE_NS) sample(dev, pct, c, last, now, prev_gate);

    uint64_t cost = atomic_load_explicit(&c->cost_ns, memory_order_relaxed);
    remember(dev, c, now);
    if (!cost) { /* not measured yet: measure this launch, or a few launches per window */
        if (capturing(s)) return;
        atomic_fetch_add_explicit(&c->total, 1, memory_order_relaxed);
        uint64_t in_window = atomic_fetch_add_explicit(&c->launches, 1, memory_order_relaxed) + 1;
        int64_t t = atomic_load(&c->tokens_ns);
        if (t < 0) { /* a measured launch left a debt: sleep it off first */
            uint64_t wait = (uint64_t)(-t) * 100 / pct;
            vgpu_compute_will_launch(dev, wait);
            vgpu_sleep_ns(wait < MAX_SLEEP_NS ? wait : MAX_SLEEP_NS);
        }
        if (probe_begin(dev, s)) return;
        if (in_window > PROBE_LAUNCHES) {
            last = atomic_load(&c->sample_ns);
            uint64_t t2 = vgpu_mono_ns();
            if (last + SAMPLE_NS > t2) vgpu_sleep_ns(last + SAMPLE_NS - t2);
        }
        return;
    }
    uint64_t refill = atomic_load_explicit(&c->refill_ns, memory_order_relaxed);
    if (now > refill && atomic_compare_exchange_strong(&c->refill_ns, &refill, now)) {
        uint64_t gap = now - refill;
        /* idle time earns one burst at most; time spent paying off a debt earns all of it
         * (a long debt sleep, of this process or another of the container, is its refill) */
        if (gap > BURST_NS && atomic_load(&c->tokens_ns) >= 0) gap = BURST_NS;
        int64_t add = (int64_t)(gap * pct / 100), cap = (int64_t)(BURST_NS * pct / 100);
        int64_t t = atomic_fetch_add(&c->tokens_ns, add) + add;
        while (t > cap && !atomic_compare_exchange_weak(&c->tokens_ns, &t, cap)) {
        }
    }
    int64_t t = atomic_fetch_sub(&c->tokens_ns, (int64_t)cost) - (int64_t)cost;
    if (t < 0) {
        uint64_t wait = (uint64_t)(-t) * 100 / pct;
        vgpu_compute_will_launch(dev, wait);
        vgpu_sleep_ns(wait < MAX_SLEEP_NS ? wait : MAX_SLEEP_NS);
    }
    /* counted when it is let through: it runs in the window open now, not in one closed while
     * it slept */
    atomic_fetch_add_explicit(&c->launches, 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&c->total, 1, memory_order_relaxed);
    atomic_store_explicit(&c->admit_ns, vgpu_mono_ns(), memory_order_relaxed);
}

/* ---- the launch hooks ------------------------------------------------------------------ */

static __attribute__((noinline)) void gate_slow(CUstream s) {
    CUdevice dev;
    vgpu_current_device(&dev);
    if (dev < 0 || dev >= VGPU_MAX_DEV) return;
    if (vgpu.features & VGPU_F_PRIORITY) vgpu_priority_gate(dev);
    if (vgpu.cfg.cores_percent[dev]) vgpu_compute_gate(dev, s);
}

static inline CUresult gate(int id, CUstream s) {
    if (VGPU_UNLIKELY(!atomic_load_explicit(&vgpu_cuda_go, memory_order_acquire))) {
        CUresult rc = vgpu_not_ready();
        if (rc != CUDA_SUCCESS) return rc;
    }
    if (VGPU_UNLIKELY(!atomic_load_explicit(&vgpu_hooks[id].real, memory_order_relaxed)))
        return CUDA_ERROR_NOT_FOUND;
    unsigned f = vgpu.features;
    if (f & VGPU_F_REGION) {
        stamp_activity();
        if (f & (VGPU_F_COMPUTE | VGPU_F_PRIORITY)) gate_slow(s);
    }
    return CUDA_SUCCESS;
}

VGPU_EXPORT CUresult cuLaunchKernel(CUfunction f, unsigned int gx, unsigned int gy,
                                    unsigned int gz, unsigned int bx, unsigned int by,
                                    unsigned int bz, unsigned int shmem, CUstream s, void **p,
                                    void **e) {
    CUresult rc = gate(H_cuLaunchKernel, s);
    if (VGPU_UNLIKELY(rc != CUDA_SUCCESS)) return rc;
    rc = REAL(cuLaunchKernel)(f, gx, gy, gz, bx, by, bz, shmem, s, p, e);
    probe_done(rc);
    return rc;
}

VGPU_EXPORT CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned int gx, unsigned int gy,
                                         unsigned int gz, unsigned int bx, unsigned int by,
                                         unsigned int bz, unsigned int shmem, CUstream s,
                                         void **p, void **e) {
    CUresult rc = gate(H_cuLaunchKernel_ptsz, s);
    if (VGPU_UNLIKELY(rc != CUDA_SUCCESS)) return rc;
    rc = REAL(cuLaunchKernel_ptsz)(f, gx, gy, gz, bx, by, bz, shmem, s, p, e);
    probe_done(rc);
    return rc;
}

VGPU_EXPORT CUresult cuLaunchKernelEx(const CUlaunchConfig *cfg, CUfunction f, void **p,
                                      void **e) {
    CUresult rc = gate(H_cuLaunchKernelEx, cfg ? cfg->hStream : NULL);
    if (VGPU_UNLIKELY(rc != CUDA_SUCCESS)) return rc;
    rc = REAL(cuLaunchKernelEx)(cfg, f, p, e);
    probe_done(rc);
    return rc;
}

VGPU_EXPORT CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *cfg, CUfunction f, void **p,
                                           void **e) {
    CUresult rc = gate(H_cuLaunchKernelEx_ptsz, cfg ? cfg->hStream : NULL);
    if (VGPU_UNLIKELY(rc != CUDA_SUCCESS)) return rc;
    rc = REAL(cuLaunchKernelEx_ptsz)(cfg, f, p, e);
    probe_done(rc);
    return rc;
}

VGPU_EXPORT CUresult cuLaunchCooperativeKernel(CUfunction f, unsigned int gx, unsigned int gy,
                                               unsigned int gz, unsigned int bx, unsigned int by,
                                               unsigned int bz, unsigned int shmem, CUstream s,
                                               void **p) {
    CUresult rc = gate(H_cuLaunchCooperativeKernel, s);
    if (VGPU_UNLIKELY(rc != CUDA_SUCCESS)) return rc;
    rc = REAL(cuLaunchCooperativeKernel)(f, gx, gy, gz, bx, by, bz, shmem, s, p);
    probe_done(rc);
    return rc;
}

VGPU_EXPORT CUresult cuLaunchCooperativeKernel_ptsz(CUfunction f, unsigned int gx,
                                                    unsigned int gy, unsigned int gz,
                                                    unsigned int bx, unsigned int by,
                                                    unsigned int bz, unsigned int shmem,
                                                    CUstream s, void **p) {
    CUresult rc = gate(H_cuLaunchCooperativeKernel_ptsz, s);
    if (VGPU_UNLIKELY(rc != CUDA_SUCCESS)) return rc;
    rc = REAL(cuLaunchCooperativeKernel_ptsz)(f, gx, gy, gz, bx, by, bz, shmem, s, p);
    probe_done(rc);
    return rc;
}

VGPU_EXPORT CUresult cuGraphLaunch(CUgraphExec g, CUstream s) {
    CUresult rc = gate(H_cuGraphLaunch, s);
    if (VGPU_UNLIKELY(rc != CUDA_SUCCESS)) return rc;
    rc = REAL(cuGraphLaunch)(g, s);
    probe_done(rc);
    vgpu_graph_launched(); /* its memory nodes may have taken memory */
    return rc;
}

VGPU_EXPORT CUresult cuGraphLaunch_ptsz(CUgraphExec g, CUstream s) {
    CUresult rc = gate(H_cuGraphLaunch_ptsz, s);
    if (VGPU_UNLIKELY(rc != CUDA_SUCCESS)) return rc;
    rc = REAL(cuGraphLaunch_ptsz)(g, s);
    probe_done(rc);
    vgpu_graph_launched();
    return rc;
}

/* The legacy launch API: work like any other launch. (Launches from device code, dynamic
 * parallelism, never pass through the host; their parent kernel's launch is gated.) */
VGPU_EXPORT CUresult cuLaunch(CUfunction f) {
    CUresult rc = gate(H_cuLaunch, NULL);
    if (VGPU_UNLIKELY(rc != CUDA_SUCCESS)) return rc;
    rc = REAL(cuLaunch)(f);
    probe_done(rc);
    return rc;
}

VGPU_EXPORT CUresult cuLaunchGrid(CUfunction f, int w, int h) {
    CUresult rc = gate(H_cuLaunchGrid, NULL);
    if (VGPU_UNLIKELY(rc != CUDA_SUCCESS)) return rc;
    rc = REAL(cuLaunchGrid)(f, w, h);
    probe_done(rc);
    return rc;
}

VGPU_EXPORT CUresult cuLaunchGridAsync(CUfunction f, int w, int h, CUstream s) {
    CUresult rc = gate(H_cuLaunchGridAsync, s);
    if (VGPU_UNLIKELY(rc != CUDA_SUCCESS)) return rc;
    rc = REAL(cuLaunchGridAsync)(f, w, h, s);
    probe_done(rc);
    return rc;
}
