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
 *
 * Each container states its own priority in its entry (written by itself, or relayed by the node
 * agent from its container region), so the priority an entry shows is only a claim: where the hub or the node agent wrote a priority table (<node_region_dir>/priorities,
 * "<name> <priority> [<GPU uuid>,...]" lines, owned by the directory's owner and writable by
 * nobody else), an entry holds others only if the table gives its name that same priority and,
 * where the line lists cards, the allocation holds this card. A table that is
 * there but not trustworthy (another owner, writable by others, not a regular file) makes no
 * entry hold anyone. Without a table (no hub or agent) the entries are believed.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "vgpu.h"

#define CHECK_EVERY_NS 1000000ull
#define STAMP_EVERY_NS 1000000ull
#define HOLD_STEP_NS (20ull * 1000000ull)

#define ALIVE_RECHECK_NS (100ull * 1000000ull)
#define CLOCK_SLACK_NS 1000000000ull /* a launch stamped further ahead than this is forged */

/* Whether entry i has a live process attached (its liveness lock is held), cached briefly:
 * a forged entry written by a process that has exited holds nobody. */
int vgpu_entry_alive(struct vgpu_node_attach *na, int i, uint64_t now) {
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

/* ---- the priority table ---------------------------------------------------------------- */

#define TABLE_NAME "priorities"
#define TABLE_MAX 256
#define TABLE_BYTES 65536
#define TABLE_RECHECK_NS (100ull * 1000000ull)
#define TABLE_GPUS 800 /* 16 uuids */

static struct {
    pthread_mutex_t lock;
    uint64_t checked_ns;
    int state;                 /* 0 no table: believe entries; 1 table; -1 untrusted: none holds */
    struct stat st;            /* of the file last read */
    int n;
    char names[TABLE_MAX][64];
    int32_t prio[TABLE_MAX];
    char gpus[TABLE_MAX][TABLE_GPUS]; /* "uuid,uuid" or "" (any card) */
} table = {.lock = PTHREAD_MUTEX_INITIALIZER};

static void table_load(void) {
    char path[PATH_MAX + 16];
    snprintf(path, sizeof(path), "%s/" TABLE_NAME, vgpu.cfg.node_region_dir);
    struct stat dir;
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    if (fd < 0) {
        table.state = errno == ENOENT ? 0 : -1;
        table.n = 0;
        return;
    }
    struct stat st;
    if (fstat(fd, &st) != 0 || stat(vgpu.cfg.node_region_dir, &dir) != 0 || !S_ISREG(st.st_mode) ||
        st.st_uid != dir.st_uid || (st.st_mode & 022) || st.st_size > TABLE_BYTES) {
        close(fd);
        if (table.state != -1)
            vgpu_log("the priority table %s is not the hub's or agent's (owner, mode or size): "
                     "no container's priority holds launches", path);
        table.state = -1;
        table.n = 0;
        return;
    }
    if (table.state == 1 && st.st_ino == table.st.st_ino && st.st_mtim.tv_sec == table.st.st_mtim.tv_sec &&
        st.st_mtim.tv_nsec == table.st.st_mtim.tv_nsec && st.st_size == table.st.st_size) {
        close(fd);
        return;
    }
    static char buf[TABLE_BYTES + 1];
    ssize_t got = 0, r;
    while (got < TABLE_BYTES && (r = read(fd, buf + got, (size_t)(TABLE_BYTES - got))) > 0) got += r;
    close(fd);
    buf[got] = 0;
    table.n = 0;
    for (char *line = buf, *next; line && *line && table.n < TABLE_MAX; line = next) {
        next = strchr(line, '\n');
        if (next) *next++ = 0;
        char name[64], gpus[TABLE_GPUS] = "";
        long long v;
        int got = sscanf(line, "%63s %lld %799s", name, &v, gpus);
        if (got >= 2 && v >= INT32_MIN && v <= INT32_MAX) {
            memcpy(table.names[table.n], name, sizeof(name));
            memcpy(table.gpus[table.n], gpus, sizeof(gpus));
            table.prio[table.n++] = (int32_t)v;
        }
    }
    table.st = st;
    table.state = 1;
}

void vgpu_priority_after_fork_child(void) { pthread_mutex_init(&table.lock, NULL); }

static int lists(const char *gpus, const char *uuid) {
    size_t n = strlen(uuid);
    if (!gpus[0]) return 1;
    for (const char *p = gpus; (p = strstr(p, uuid)); p += n)
        if ((p == gpus || p[-1] == ',') && (p[n] == 0 || p[n] == ',')) return 1;
    return 0;
}

/* Whether entry e of the node region of card uuid may hold others at its priority: the table
 * confirms its name's priority on this card. */
static int confirmed(const struct vgpu_node_entry *e, const char *uuid, uint64_t now) {
    pthread_mutex_lock(&table.lock);
    if (!table.checked_ns || now - table.checked_ns >= TABLE_RECHECK_NS) {
        table_load();
        table.checked_ns = now;
    }
    int ok = table.state == 0;
    if (table.state == 1) {
        char name[64];
        memcpy(name, e->name, sizeof(name));
        name[63] = 0;
        for (int i = 0; i < table.n && !ok; i++)
            ok = !strcmp(table.names[i], name) && table.prio[i] == e->priority &&
                 lists(table.gpus[i], uuid);
    }
    pthread_mutex_unlock(&table.lock);
    return ok;
}

/* The end of the latest window of a live higher-priority container, or 0. Entries of dead
 * processes and launches stamped in the future are ignored. */
static uint64_t busy_until(struct vgpu_node_attach *na, int32_t prio, uint64_t now,
                           uint64_t window) {
    struct vgpu_node_region *n = na->region;
    char uuid[sizeof(n->uuid)];
    memcpy(uuid, n->uuid, sizeof(uuid));
    uuid[sizeof(uuid) - 1] = 0;
    uint64_t until = 0;
    for (int i = 0; i < VGPU_NODE_ENTRIES; i++) {
        struct vgpu_node_entry *e = &n->entries[i];
        uint64_t id = atomic_load_explicit(&e->container_id, memory_order_relaxed);
        if (!id || vgpu_node_own(na, i, id)) continue;
        if (e->priority <= prio) continue;
        uint64_t t = atomic_load_explicit(&e->last_launch_ns, memory_order_relaxed);
        if (!t || t > now + CLOCK_SLACK_NS || t + window <= now || t + window <= until) continue;
        if (!vgpu_entry_alive(na, i, now) || !confirmed(e, uuid, now)) continue;
        until = t + window;
    }
    return until;
}

void vgpu_priority_gate(int dev) {
    struct vgpu_node_attach *na = vgpu_node_get(dev);
    if (!na) return;
    uint64_t now = vgpu_coarse_real_ns();
    if (now >= atomic_load_explicit(&na->next_check_ns, memory_order_relaxed)) {
        uint64_t window = (uint64_t)vgpu.cfg.priority_window_ms * 1000000ull;
        int held = 0;
        for (;;) {
            uint64_t t = vgpu_real_ns();
            uint64_t until = busy_until(na, vgpu.cfg.priority, t, window);
            if (!until) break;
            if (!held) {
                atomic_store(na->held_since, t);
                held = 1;
            }
            uint64_t wait = until - t;
            vgpu_sleep_ns(wait < HOLD_STEP_NS ? wait : HOLD_STEP_NS);
        }
        if (held) {
            atomic_store(na->held_since, 0);
            now = vgpu_coarse_real_ns();
        }
        atomic_store_explicit(&na->next_check_ns, now + CHECK_EVERY_NS, memory_order_relaxed);
    }
    if (now - atomic_load_explicit(&na->stamped_ns, memory_order_relaxed) >= STAMP_EVERY_NS) {
        atomic_store_explicit(&na->stamped_ns, now, memory_order_relaxed);
        atomic_store_explicit(na->last_launch, now, memory_order_relaxed);
    }
}
