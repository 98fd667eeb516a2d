/*
 * priority.c: on a shared GPU, a container holds its launches (kernels and graphs) while a
 * container of higher priority has launched within the window (priority_window_ms), and
 * resumes when that one goes quiet. Works with or without a cores limit.
 *
 * State lives in the node region of the GPU: each container's entry carries its priority and
 * the time of its last launch (stored at most once per millisecond). The scan of the entries
 * runs at most once per millisecond per process; a held process sleeps until the newest
 * higher-priority launch is a window old, in steps of at most HOLD_STEP_NS, and shows
 * held_since_ns != 0 in its entry meanwhile.
 */
#define _GNU_SOURCE
#include "vgpu.h"

#define CHECK_EVERY_NS 1000000ull
#define STAMP_EVERY_NS 1000000ull
#define HOLD_STEP_NS (20ull * 1000000ull)

#define ALIVE_RECHECK_NS (100ull * 1000000ull)
#define CLOCK_SLACK_NS 1000000000ull /* a launch stamped further ahead than this is forged */

/* Whether entry i has a live process attached (its liveness lock is held), cached briefly:
 * a forged entry written by a process that has exited holds nobody. */
static int entry_alive(struct vgpu_node_attach *na, int i, uint64_t now) {
    static _Atomic uint64_t checked[VGPU_MAX_DEV][VGPU_NODE_ENTRIES];
    static _Atomic int alive[VGPU_MAX_DEV][VGPU_NODE_ENTRIES];
    int dev = (int)(na - vgpu.node);
    uint64_t at = atomic_load_explicit(&checked[dev][i], memory_order_relaxed);
    if (at && now - at < ALIVE_RECHECK_NS) return atomic_load(&alive[dev][i]);
    int a = vgpu_node_entry_alive(na, i);
    atomic_store(&alive[dev][i], a);
    atomic_store(&checked[dev][i], now);
    return a;
}

/* The end of the latest window of a live higher-priority container, or 0. Entries of dead
 * processes and launches stamped in the future are ignored. */
static uint64_t busy_until(struct vgpu_node_attach *na, int32_t prio, uint64_t now,
                           uint64_t window) {
    struct vgpu_node_region *n = na->region;
    uint64_t until = 0;
    for (int i = 0; i < VGPU_NODE_ENTRIES; i++) {
        struct vgpu_node_entry *e = &n->entries[i];
        if (i == na->entry || !atomic_load_explicit(&e->container_id, memory_order_relaxed))
            continue;
        if (e->priority <= prio) continue;
        uint64_t t = atomic_load_explicit(&e->last_launch_ns, memory_order_relaxed);
        if (!t || t > now + CLOCK_SLACK_NS || t + window <= now || t + window <= until) continue;
        if (!entry_alive(na, i, now)) continue;
        until = t + window;
    }
    return until;
}

void vgpu_priority_gate(int dev) {
    struct vgpu_node_attach *na = vgpu_node_get(dev);
    if (!na) return;
    struct vgpu_node_region *n = na->region;
    struct vgpu_node_entry *me = &n->entries[na->entry];
    uint64_t now = vgpu_coarse_real_ns();
    if (now >= atomic_load_explicit(&na->next_check_ns, memory_order_relaxed)) {
        uint64_t window = (uint64_t)vgpu.cfg.priority_window_ms * 1000000ull;
        int held = 0;
        for (;;) {
            uint64_t t = vgpu_real_ns();
            uint64_t until = busy_until(na, vgpu.cfg.priority, t, window);
            if (!until) break;
            if (!held) {
                atomic_store(&me->held_since_ns, t);
                held = 1;
            }
            uint64_t wait = until - t;
            vgpu_sleep_ns(wait < HOLD_STEP_NS ? wait : HOLD_STEP_NS);
        }
        if (held) {
            atomic_store(&me->held_since_ns, 0);
            now = vgpu_coarse_real_ns();
        }
        atomic_store_explicit(&na->next_check_ns, now + CHECK_EVERY_NS, memory_order_relaxed);
    }
    if (now - atomic_load_explicit(&na->stamped_ns, memory_order_relaxed) >= STAMP_EVERY_NS) {
        atomic_store_explicit(&na->stamped_ns, now, memory_order_relaxed);
        atomic_store_explicit(&me->last_launch_ns, now, memory_order_relaxed);
    }
}
