/*
 * elastic.c: elastic slices. A slice has a request (memory_mib, cores_percent: guaranteed) and
 * a limit (memory_limit_mib, cores_limit_percent) it may burst to while the card allows:
 *
 * - memory: past its request, a container may hold what the card has that no other
 *   container's request needs (card total minus, for every other live container of the card,
 *   the larger of its request and its use), up to its limit, and nothing more while another
 *   container waits for memory within its request (a reclaim is pending). Two containers
 *   bursting at once may both read the same room: so a burst, once counted, publishes its use
 *   and reads the others' need again (vgpu_mem_burst_holds; seq-cst on both sides, so at least
 *   one sees the other) and is undone and refused if the card cannot hold it all. Where the
 *   node agent relays the entries (read-only node regions) the others' use is a relay period
 *   old: two bursts within that lag can both succeed (the driver, then a reclaim, sorts it out).
 * - reclaim: an allocation within the request that the driver refuses for lack of memory,
 *   while other containers of the card use more than their requests, is not failed at once:
 *   the container records the reclaim in its node entry (MiB wanted, since when; read by
 *   libvgpu/elastic.py for the hub, which takes the burst back from the burster) and retries
 *   the driver until the memory is there or reclaim_wait_ms has passed (then
 *   CUDA_ERROR_OUT_OF_MEMORY). Where the node agent relays the entries (read-only node regions)
 *   a burst shows up to a relay period late: an out-of-memory with no burst in sight is retried
 *   for RELAY_LAG_NS before it fails.
 * - compute: the rate limiter runs at the container's share of the card now: its request,
 *   plus the part of the card no busy container's request claims (split in proportion to the
 *   busy containers' requests), up to its limit. A container is busy while it launched within
 *   BUSY_WINDOW_NS (a container sleeping off its limiter's debt stamps the time it will launch,
 *   so long kernels keep it busy); one held for a higher priority is not. The GPU time it
 *   runs above its request is counted in its activity file (compute_burst_ns), for metering.
 *
 * All of it reads the card's node region (node_region_dir): without one a slice does not burst.
 */
#define _GNU_SOURCE
#include "memory.h"

#define BUSY_WINDOW_NS (200ull * 1000000ull)
#define SHARE_RECHECK_NS (2ull * 1000000ull)
#define RECLAIM_STEP_NS (10ull * 1000000ull)
#define RELAY_LAG_NS (150ull * 1000000ull) /* three periods of the node agent's relay (50 ms) */

static _Atomic uint64_t card_total[VGPU_MAX_DEV];

static uint64_t total_of(int dev) {
    uint64_t t = atomic_load_explicit(&card_total[dev], memory_order_relaxed);
    if (t) return t;
    size_t b = 0;
    cuDeviceTotalMem_v2_fn real = REAL(cuDeviceTotalMem_v2);
    if (real && real(&b, dev) == CUDA_SUCCESS) atomic_store(&card_total[dev], (uint64_t)b);
    return (uint64_t)b;
}

static inline int memory_elastic(int dev) {
    return vgpu.cfg.memory_bytes[dev] != VGPU_UNLIMITED &&
           vgpu.cfg.memory_limit_bytes[dev] > vgpu.cfg.memory_bytes[dev];
}

/* What the other live containers of the card need (each the larger of its request and its
 * use); *pending: whether one of them waits for a reclaim. */
static uint64_t others_need(struct vgpu_node_attach *na, uint64_t total, int *pending) {
    struct vgpu_node_region *n = na->region;
    uint64_t need = 0, now = vgpu_coarse_real_ns();
    *pending = 0;
    for (int i = 0; i < VGPU_NODE_ENTRIES; i++) {
        struct vgpu_node_entry *e = &n->entries[i];
        uint64_t id = atomic_load_explicit(&e->container_id, memory_order_relaxed);
        if (!id || vgpu_node_own(na, i, id)) continue;
        if (!vgpu_entry_alive(na, i, now)) continue;
        uint64_t req = e->memory_limit, used = atomic_load(&e->memory_used);
        if (req == VGPU_UNLIMITED) req = total; /* no memory limit: it may take the card */
        need += req > used ? req : used;
        if (atomic_load_explicit(&e->reclaim, memory_order_relaxed)) *pending = 1;
    }
    return need;
}

uint64_t vgpu_mem_allowed(int dev) {
    uint64_t req = vgpu.cfg.memory_bytes[dev], lim = vgpu.cfg.memory_limit_bytes[dev];
    if (dev < 0 || dev >= VGPU_MAX_DEV || !memory_elastic(dev)) return lim;
    struct vgpu_node_attach *na = vgpu_node_get(dev);
    uint64_t total = total_of(dev);
    if (!na || !total) return req;
    int pending;
    uint64_t need = others_need(na, total, &pending);
    if (pending) return req;
    uint64_t room = total > need ? total - need : 0;
    if (room > lim) room = lim;
    return room > req ? room : req;
}

/* Called after an elastic slice's allocation is counted. Past its request, where the node
 * region is attached directly: publishes its use at once and reads the others' need again
 * (seq-cst on both sides: of two containers bursting into the same room at once, at least one
 * sees the other); 0 when the card cannot hold it all (the caller undoes the count). */
int vgpu_mem_burst_holds(int dev) {
    uint64_t used = atomic_load(&vgpu.reg->used[dev]);
    if (used <= vgpu.cfg.memory_bytes[dev]) return 1; /* within the request: guaranteed */
    struct vgpu_node_attach *na = vgpu_node_get(dev);
    uint64_t total = total_of(dev);
    if (!na || na->relay || !total) return 1; /* relayed: a period late, see the header */
    atomic_store(&na->region->entries[na->entry].memory_used, used);
    int pending;
    uint64_t need = others_need(na, total, &pending);
    return !pending && need <= total && used <= total - need;
}

/* ---- reclaim ------------------------------------------------------------------------------ */

/* Whether another live container of the card uses more than its request. */
static int someone_bursts(struct vgpu_node_attach *na) {
    struct vgpu_node_region *n = na->region;
    uint64_t now = vgpu_coarse_real_ns();
    for (int i = 0; i < VGPU_NODE_ENTRIES; i++) {
        struct vgpu_node_entry *e = &n->entries[i];
        uint64_t id = atomic_load_explicit(&e->container_id, memory_order_relaxed);
        if (!id || vgpu_node_own(na, i, id)) continue;
        if (e->memory_limit != VGPU_UNLIMITED && atomic_load(&e->memory_used) > e->memory_limit &&
            vgpu_entry_alive(na, i, now))
            return 1;
    }
    return 0;
}

int vgpu_reclaim_retry(struct vgpu_reclaim *w, int dev, uint64_t bytes, CUresult rc) {
    struct vgpu_node_attach *na = dev >= 0 && dev < VGPU_MAX_DEV && vgpu.reg ? vgpu_node_get(dev)
                                                                             : NULL;
    int again = 0;
    if (rc == CUDA_ERROR_OUT_OF_MEMORY && na && vgpu.cfg.reclaim_wait_ms &&
        vgpu.cfg.memory_bytes[dev] != VGPU_UNLIMITED &&
        vgpu_container_used(dev) <= vgpu.cfg.memory_bytes[dev]) { /* within the request */
        uint64_t now = vgpu_mono_ns();
        if (!w->since_ns) {
            if (someone_bursts(na)) {
                w->since_ns = now;
                uint64_t mib = (bytes + (1ull << 20) - 1) >> 20;
                if (mib > 0xffffffffull) mib = 0xffffffffull;
                if (!mib) mib = 1;
                uint64_t word = (vgpu_real_ns() / 1000000000ull) << 32 | mib;
                atomic_store(na->reclaim, word);
                vgpu_log("GPU %d: %llu MiB within this slice's request are held by other slices' "
                         "bursts; waiting up to %u ms for them to be given back", dev,
                         (unsigned long long)mib, vgpu.cfg.reclaim_wait_ms);
            } else if (na->relay) { /* the others' entries are relayed: a burst shows a period late */
                if (!w->looked_ns) w->looked_ns = now;
                if (now - w->looked_ns < RELAY_LAG_NS) {
                    vgpu_sleep_ns(RECLAIM_STEP_NS);
                    again = 1;
                }
            }
        }
        if (w->since_ns && now - w->since_ns < (uint64_t)vgpu.cfg.reclaim_wait_ms * 1000000ull) {
            vgpu_sleep_ns(RECLAIM_STEP_NS);
            again = 1;
        }
    }
    if (!again && w->since_ns && na) {
        atomic_store(na->reclaim, 0);
        if (rc == CUDA_ERROR_OUT_OF_MEMORY)
            vgpu_log("GPU %d: the bursts were not given back within %u ms; the allocation fails",
                     dev, vgpu.cfg.reclaim_wait_ms);
        w->since_ns = 0;
    }
    return again;
}

/* ---- compute: the share now --------------------------------------------------------------- */

static _Atomic uint64_t share_at[VGPU_MAX_DEV];
static _Atomic uint32_t share_now[VGPU_MAX_DEV];

uint32_t vgpu_compute_share(int dev) {
    uint32_t req = vgpu.cfg.cores_percent[dev], lim = vgpu.cfg.cores_limit_percent[dev];
    if (lim <= req) return req;
    uint64_t now = vgpu_real_ns(), at = atomic_load_explicit(&share_at[dev], memory_order_relaxed);
    if (at && now - at < SHARE_RECHECK_NS) return atomic_load(&share_now[dev]);
    atomic_store_explicit(&share_at[dev], now, memory_order_relaxed);
    struct vgpu_node_attach *na = vgpu_node_get(dev);
    uint32_t share = req;
    if (na) {
        struct vgpu_node_region *n = na->region;
        uint64_t busy_req = req; /* the busy containers' requests, this one's included */
        for (int i = 0; i < VGPU_NODE_ENTRIES; i++) {
            struct vgpu_node_entry *e = &n->entries[i];
            uint64_t id = atomic_load_explicit(&e->container_id, memory_order_relaxed);
            if (!id || vgpu_node_own(na, i, id)) continue;
            uint64_t t = atomic_load_explicit(&e->last_launch_ns, memory_order_relaxed);
            if (!t || t + BUSY_WINDOW_NS <= now || atomic_load(&e->held_since_ns)) continue;
            if (!vgpu_entry_alive(na, i, now)) continue;
            busy_req += e->cores_percent ? e->cores_percent : 100;
        }
        uint64_t left = busy_req < 100 ? 100 - busy_req : 0;
        uint64_t s = req + left * req / busy_req;
        share = (uint32_t)(s > lim ? lim : s);
    }
    if (share != atomic_exchange(&share_now[dev], share))
        vgpu_debug("gpu %d: compute share %u%% (request %u%%, limit %u%%)", dev, share, req, lim);
    return share;
}

/* A container sleeping off its limiter's debt will launch at wake: it stays busy meanwhile. */
void vgpu_compute_will_launch(int dev, uint64_t wait_ns) {
    if (!(vgpu.features & VGPU_F_PRIORITY)) return;
    struct vgpu_node_attach *na = vgpu_node_get(dev);
    if (!na) return;
    if (wait_ns > 900000000ull) wait_ns = 900000000ull; /* within the priority's clock slack */
    atomic_store_explicit(na->last_launch, vgpu_coarse_real_ns() + wait_ns, memory_order_relaxed);
}

/* The limiter's sampler read that the container ran busy_ns of GPU time in a window of
 * window_ns (each window is read by one process of the container): what is above the request
 * is burst, added up in the activity file for metering (the hub's usage records). */
void vgpu_compute_ran(int dev, uint64_t busy_ns, uint64_t window_ns) {
    struct vgpu_activity *a = vgpu.act;
    uint32_t req = vgpu.cfg.cores_percent[dev];
    if (!a || vgpu.cfg.cores_limit_percent[dev] <= req) return;
    uint64_t guaranteed = window_ns / 100 * req;
    if (busy_ns > guaranteed)
        atomic_fetch_add_explicit(&a->compute_burst_ns[dev], busy_ns - guaranteed,
                                  memory_order_relaxed);
}
