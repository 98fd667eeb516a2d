/*
 * config.c: the limits, from a read-only key=value file, with env vars as a fallback.
 *
 * Which file: the default path (VGPU_DEFAULT_CONFIG, /etc/libvgpu/limits.conf) when it
 * exists — then LIBVGPU_CONFIG cannot point elsewhere; otherwise LIBVGPU_CONFIG if set (a
 * missing file is an error: limits were meant to apply); otherwise no file (env mode, the
 * single-machine fallback).
 *
 * With a file, env can only lower memory_mib/cores_percent/priority (min of both) and may
 * supply region paths the file leaves out; it is ignored for everything else. An unknown key,
 * a duplicate, or a bad value is an error: the shim then refuses CUDA instead of running
 * unlimited.
 */
#define _GNU_SOURCE
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "vgpu.h"

#define MAX_CONFIG_BYTES 65536

enum key_id { K_MEMORY, K_CORES, K_MEMORY_LIMIT, K_CORES_LIMIT, K_PRIORITY, K_CONTAINER_REGION, K_NODE_REGION_DIR,
              K_ACTIVITY_FILE, K_PRIORITY_WINDOW, K_CONTEXT_MIB, K_NAME, K_RECLAIM_WAIT, K_COUNT };

static const struct {
    const char *key;
    const char *env;
    int indexed;
} keys[K_COUNT] = {
    [K_MEMORY] = {"memory_mib", "LIBVGPU_MEMORY_MIB", 1},
    [K_CORES] = {"cores_percent", "LIBVGPU_CORES_PERCENT", 1},
    [K_MEMORY_LIMIT] = {"memory_limit_mib", "LIBVGPU_MEMORY_LIMIT_MIB", 1},
    [K_CORES_LIMIT] = {"cores_limit_percent", "LIBVGPU_CORES_LIMIT_PERCENT", 1},
    [K_PRIORITY] = {"priority", "LIBVGPU_PRIORITY", 0},
    [K_CONTAINER_REGION] = {"container_region", "LIBVGPU_CONTAINER_REGION", 0},
    [K_NODE_REGION_DIR] = {"node_region_dir", "LIBVGPU_NODE_REGION_DIR", 0},
    [K_ACTIVITY_FILE] = {"activity_file", "LIBVGPU_ACTIVITY_FILE", 0},
    [K_PRIORITY_WINDOW] = {"priority_window_ms", "LIBVGPU_PRIORITY_WINDOW_MS", 0},
    [K_CONTEXT_MIB] = {"context_mib", "LIBVGPU_CONTEXT_MIB", 0},
    [K_NAME] = {"name", "LIBVGPU_NAME", 0},
    [K_RECLAIM_WAIT] = {"reclaim_wait_ms", "LIBVGPU_RECLAIM_WAIT_MS", 0},
};

static const char ALLOWED[] =
    "memory_mib[.N], cores_percent[.N], memory_limit_mib[.N], cores_limit_percent[.N], priority, "
    "container_region, node_region_dir, activity_file, priority_window_ms, context_mib, name, "
    "reclaim_wait_ms";

/* What one source (file or env) said; -1/empty = not given. */
struct raw {
    int64_t memory_all, memory[VGPU_MAX_DEV];
    int64_t cores_all, cores[VGPU_MAX_DEV];
    int64_t memory_limit_all, memory_limit[VGPU_MAX_DEV]; /* elastic: the burst limits */
    int64_t cores_limit_all, cores_limit[VGPU_MAX_DEV];
    int64_t priority, window_ms, context_mib, reclaim_wait_ms;
    char container_region[PATH_MAX], node_region_dir[PATH_MAX], activity_file[PATH_MAX];
    char name[64];
    unsigned char seen[K_COUNT][VGPU_MAX_DEV + 1];
};

static void raw_init(struct raw *r) {
    memset(r, 0, sizeof(*r));
    r->memory_all = r->cores_all = r->priority = r->window_ms = r->context_mib = -1;
    r->memory_limit_all = r->cores_limit_all = r->reclaim_wait_ms = -1;
    r->priority = INT64_MIN;
    for (int i = 0; i < VGPU_MAX_DEV; i++)
        r->memory[i] = r->cores[i] = r->memory_limit[i] = r->cores_limit[i] = -1;
}

static int parse_int(const char *s, int64_t lo, int64_t hi, int64_t *out) {
    if (!*s) return -1;
    errno = 0;
    char *end;
    long long v = strtoll(s, &end, 10);
    if (errno || *end || v < lo || v > hi) return -1;
    *out = v;
    return 0;
}

/* Applies key[.index]=value to r. origin names the source for messages ("file:3", "env X"). */
static int apply(struct raw *r, const char *key, const char *value, const char *origin,
                 char *err, size_t errlen) {
    const char *dot = strchr(key, '.');
    size_t klen = dot ? (size_t)(dot - key) : strlen(key);
    int id = -1;
    for (int k = 0; k < K_COUNT; k++)
        if (strlen(keys[k].key) == klen && strncmp(keys[k].key, key, klen) == 0) id = k;
    if (id < 0) {
        snprintf(err, errlen, "%s: unknown key '%s' (allowed: %s)", origin, key, ALLOWED);
        return -1;
    }
    int index = -1; /* -1: all GPUs */
    if (dot) {
        int64_t idx;
        if (!keys[id].indexed) {
            snprintf(err, errlen, "%s: key '%.*s' takes no GPU index (allowed: %s)", origin,
                     (int)klen, key, ALLOWED);
            return -1;
        }
        if (parse_int(dot + 1, 0, VGPU_MAX_DEV - 1, &idx)) {
            snprintf(err, errlen, "%s: GPU index in '%s' must be an integer 0..%d", origin, key,
                     VGPU_MAX_DEV - 1);
            return -1;
        }
        index = (int)idx;
    }
    unsigned char *seen = &r->seen[id][index + 1];
    if (*seen) {
        snprintf(err, errlen, "%s: key '%s' is given twice", origin, key);
        return -1;
    }
    *seen = 1;
    int64_t v;
    switch (id) {
    case K_MEMORY:
    case K_MEMORY_LIMIT: {
        if (parse_int(value, 0, INT64_MAX / (1 << 20), &v)) goto bad_int;
        int64_t *all = id == K_MEMORY ? &r->memory_all : &r->memory_limit_all;
        int64_t *one = id == K_MEMORY ? r->memory : r->memory_limit;
        if (index < 0) *all = v; else one[index] = v;
        return 0;
    }
    case K_CORES:
    case K_CORES_LIMIT: {
        if (parse_int(value, 1, 100, &v)) {
            snprintf(err, errlen, "%s: %s must be an integer 1..100, got '%s'", origin, key, value);
            return -1;
        }
        int64_t *all = id == K_CORES ? &r->cores_all : &r->cores_limit_all;
        int64_t *one = id == K_CORES ? r->cores : r->cores_limit;
        if (index < 0) *all = v; else one[index] = v;
        return 0;
    }
    case K_PRIORITY:
        if (parse_int(value, -1000000000, 1000000000, &v)) {
            snprintf(err, errlen, "%s: priority must be an integer -1000000000..1000000000, "
                     "got '%s'", origin, value);
            return -1;
        }
        r->priority = v;
        return 0;
    case K_PRIORITY_WINDOW:
        if (parse_int(value, 1, 3600000, &v)) {
            snprintf(err, errlen, "%s: priority_window_ms must be an integer 1..3600000, got '%s'",
                     origin, value);
            return -1;
        }
        r->window_ms = v;
        return 0;
    case K_RECLAIM_WAIT:
        if (parse_int(value, 0, 600000, &v)) {
            snprintf(err, errlen, "%s: reclaim_wait_ms must be an integer 0..600000, got '%s'",
                     origin, value);
            return -1;
        }
        r->reclaim_wait_ms = v;
        return 0;
    case K_CONTEXT_MIB:
        if (parse_int(value, 0, 1 << 20, &v)) goto bad_int;
        r->context_mib = v;
        return 0;
    case K_NAME:
        if (strlen(value) >= sizeof(r->name)) {
            snprintf(err, errlen, "%s: name must be shorter than %zu characters", origin,
                     sizeof(r->name));
            return -1;
        }
        strcpy(r->name, value);
        return 0;
    default: {
        char *dst = id == K_CONTAINER_REGION ? r->container_region
                    : id == K_NODE_REGION_DIR ? r->node_region_dir
                                              : r->activity_file;
        if (value[0] != '/' || strlen(value) >= PATH_MAX - 64) {
            snprintf(err, errlen, "%s: %s must be an absolute path, got '%s'", origin, key, value);
            return -1;
        }
        strcpy(dst, value);
        return 0;
    }
    }
bad_int:
    snprintf(err, errlen, "%s: %s must be a whole number of MiB (0 or more), got '%s'", origin,
             key, value);
    return -1;
}

static char *trim(char *s) {
    while (isspace((unsigned char)*s)) s++;
    char *e = s + strlen(s);
    while (e > s && isspace((unsigned char)e[-1])) *--e = 0;
    return s;
}

static int parse_text(struct raw *r, char *text, const char *path, char *err, size_t errlen) {
    int lineno = 0;
    for (char *line = text; line; ) {
        char *nl = strchr(line, '\n');
        if (nl) *nl = 0;
        lineno++;
        char origin[PATH_MAX + 32];
        snprintf(origin, sizeof(origin), "%s line %d", path, lineno);
        char *s = trim(line);
        line = nl ? nl + 1 : NULL;
        if (!*s || *s == '#') continue;
        char *eq = strchr(s, '=');
        if (!eq) {
            snprintf(err, errlen, "%s: expected key=value, got '%.80s'", origin, s);
            return -1;
        }
        *eq = 0;
        char *key = trim(s), *value = trim(eq + 1);
        if (apply(r, key, value, origin, err, errlen)) return -1;
    }
    return 0;
}

static int parse_env(struct raw *r, char *err, size_t errlen) {
    char name[64], key[64], origin[96];
    for (int k = 0; k < K_COUNT; k++) {
        for (int i = -1; i < (keys[k].indexed ? VGPU_MAX_DEV : 0); i++) {
            if (i < 0) {
                snprintf(name, sizeof(name), "%s", keys[k].env);
                snprintf(key, sizeof(key), "%s", keys[k].key);
            } else {
                snprintf(name, sizeof(name), "%s_%d", keys[k].env, i);
                snprintf(key, sizeof(key), "%s.%d", keys[k].key, i);
            }
            const char *v = getenv(name);
            if (!v) continue;
            char value[PATH_MAX];
            snprintf(value, sizeof(value), "%s", v);
            snprintf(origin, sizeof(origin), "environment variable %s", name);
            if (apply(r, key, trim(value), origin, err, errlen)) return -1;
        }
    }
    return 0;
}

static uint64_t min_u64(uint64_t a, uint64_t b) { return a < b ? a : b; }

/* Effective limits of one source: per-GPU value, else the all-GPUs value, else unlimited
 * (memory, cores: 0) or, for the burst limits, absent (-1). */
static void resolve(const struct raw *r, uint64_t mem[VGPU_MAX_DEV], uint32_t cores[VGPU_MAX_DEV],
                    int64_t mem_limit[VGPU_MAX_DEV], int64_t cores_limit[VGPU_MAX_DEV]) {
    for (int i = 0; i < VGPU_MAX_DEV; i++) {
        int64_t m = r->memory[i] >= 0 ? r->memory[i] : r->memory_all;
        mem[i] = m >= 0 ? (uint64_t)m << 20 : VGPU_UNLIMITED;
        int64_t c = r->cores[i] >= 0 ? r->cores[i] : r->cores_all;
        cores[i] = c > 0 && c < 100 ? (uint32_t)c : 0;
        mem_limit[i] = r->memory_limit[i] >= 0 ? r->memory_limit[i] : r->memory_limit_all;
        cores_limit[i] = r->cores_limit[i] >= 0 ? r->cores_limit[i] : r->cores_limit_all;
    }
}

/* A burst limit must not be below its request, and needs one (the limits file's own values:
 * the environment can only lower, see finish()). */
static int check_limits(const struct raw *r, const char *origin, char *err, size_t errlen) {
    uint64_t mem[VGPU_MAX_DEV];
    uint32_t cores[VGPU_MAX_DEV];
    int64_t mem_limit[VGPU_MAX_DEV], cores_limit[VGPU_MAX_DEV];
    resolve(r, mem, cores, mem_limit, cores_limit);
    for (int i = 0; i < VGPU_MAX_DEV; i++) {
        if (mem_limit[i] >= 0 && mem[i] == VGPU_UNLIMITED) {
            snprintf(err, errlen, "%s for GPU %d: memory_limit_mib needs a memory_mib (the "
                     "guaranteed request it bursts from)", origin, i);
            return -1;
        }
        if (mem_limit[i] >= 0 && (uint64_t)mem_limit[i] < mem[i] >> 20) {
            snprintf(err, errlen, "%s for GPU %d: memory_limit_mib (%lld) is below memory_mib "
                     "(%llu): the limit is what the slice may burst to, at least its request",
                     origin, i, (long long)mem_limit[i], (unsigned long long)(mem[i] >> 20));
            return -1;
        }
        int64_t c = r->cores[i] >= 0 ? r->cores[i] : r->cores_all;
        if (cores_limit[i] >= 0 && c < 0) {
            snprintf(err, errlen, "%s for GPU %d: cores_limit_percent needs a cores_percent (the "
                     "guaranteed request it bursts from)", origin, i);
            return -1;
        }
        if (cores_limit[i] >= 0 && cores_limit[i] < c) {
            snprintf(err, errlen, "%s for GPU %d: cores_limit_percent (%lld) is below "
                     "cores_percent (%lld): the limit is what the slice may burst to, at least its "
                     "request", origin, i, (long long)cores_limit[i], (long long)c);
            return -1;
        }
    }
    return 0;
}

static void finish(struct vgpu_config *cfg, const struct raw *file, const struct raw *env,
                   int have_file) {
    const struct raw *main = have_file ? file : env;
    int64_t mem_limit[VGPU_MAX_DEV], cores_limit[VGPU_MAX_DEV];
    resolve(main, cfg->memory_bytes, cfg->cores_percent, mem_limit, cores_limit);
    for (int i = 0; i < VGPU_MAX_DEV; i++) {
        /* the burst limits: absent, the request; cores 100 = the whole card */
        cfg->memory_limit_bytes[i] = mem_limit[i] >= 0 && cfg->memory_bytes[i] != VGPU_UNLIMITED
                                         ? (uint64_t)mem_limit[i] << 20 : cfg->memory_bytes[i];
        cfg->cores_limit_percent[i] = cores_limit[i] > 0 && cfg->cores_percent[i]
                                          ? (uint32_t)cores_limit[i] : cfg->cores_percent[i];
    }
    if (have_file) { /* env may only lower */
        uint64_t mem[VGPU_MAX_DEV];
        uint32_t cores[VGPU_MAX_DEV];
        int64_t env_mem_limit[VGPU_MAX_DEV], env_cores_limit[VGPU_MAX_DEV];
        resolve(env, mem, cores, env_mem_limit, env_cores_limit);
        for (int i = 0; i < VGPU_MAX_DEV; i++) {
            /* memory_mib in env caps what the process may use at all: request and limit */
            cfg->memory_bytes[i] = min_u64(cfg->memory_bytes[i], mem[i]);
            cfg->memory_limit_bytes[i] = min_u64(cfg->memory_limit_bytes[i], mem[i]);
            if (env_mem_limit[i] >= 0)
                cfg->memory_limit_bytes[i] = min_u64(cfg->memory_limit_bytes[i],
                                                     (uint64_t)env_mem_limit[i] << 20);
            cfg->memory_bytes[i] = min_u64(cfg->memory_bytes[i], cfg->memory_limit_bytes[i]);
            if (cores[i] && (!cfg->cores_percent[i] || cores[i] < cfg->cores_percent[i]))
                cfg->cores_percent[i] = cores[i];
            if (cores[i] && (!cfg->cores_limit_percent[i] || cores[i] < cfg->cores_limit_percent[i]))
                cfg->cores_limit_percent[i] = cores[i];
            if (env_cores_limit[i] > 0 && cfg->cores_limit_percent[i] &&
                env_cores_limit[i] < cfg->cores_limit_percent[i])
                cfg->cores_limit_percent[i] = (uint32_t)env_cores_limit[i];
            if (cfg->cores_limit_percent[i] && cfg->cores_limit_percent[i] < cfg->cores_percent[i])
                cfg->cores_percent[i] = cfg->cores_limit_percent[i];
        }
    }
    for (int i = 0; i < VGPU_MAX_DEV; i++) /* 100 % as a request is no limit: nothing to burst */
        if (!cfg->cores_percent[i]) cfg->cores_limit_percent[i] = 0;
    cfg->priority = main->priority != INT64_MIN ? (int32_t)main->priority : 0;
    if (have_file && env->priority != INT64_MIN && env->priority < cfg->priority)
        cfg->priority = (int32_t)env->priority;
    cfg->priority_window_ms = main->window_ms > 0 ? (uint32_t)main->window_ms : 500;
    cfg->context_bytes = main->context_mib >= 0 ? main->context_mib << 20 : -1;
    cfg->reclaim_wait_ms = main->reclaim_wait_ms >= 0 ? (uint32_t)main->reclaim_wait_ms : 30000;
    snprintf(cfg->name, sizeof(cfg->name), "%s", main->name[0] ? main->name : env->name);
#define PATHKEY(f)                                                                     \
    snprintf(cfg->f, sizeof(cfg->f), "%s", main->f[0] ? main->f : (have_file ? env->f : ""))
    PATHKEY(container_region);
    PATHKEY(node_region_dir);
    PATHKEY(activity_file);
#undef PATHKEY
}

int vgpu_config_parse_text(struct vgpu_config *cfg, const char *text, const char *origin,
                           char *err, size_t errlen) {
    static struct raw file, env; /* large; callers are serialised by pthread_once */
    raw_init(&file);
    raw_init(&env);
    memset(cfg, 0, sizeof(*cfg));
    char *copy = strdup(text);
    if (!copy) {
        snprintf(err, errlen, "%s: out of memory", origin);
        return -1;
    }
    int rc = parse_text(&file, copy, origin, err, errlen);
    free(copy);
    if (rc || check_limits(&file, origin, err, errlen) || parse_env(&env, err, errlen)) return -1;
    finish(cfg, &file, &env, 1);
    snprintf(cfg->source, sizeof(cfg->source), "%s", origin);
    return 0;
}

int vgpu_config_load(struct vgpu_config *cfg, char *err, size_t errlen) {
    const char *path = NULL;
    struct stat st;
    if (stat(VGPU_DEFAULT_CONFIG, &st) == 0) {
        path = VGPU_DEFAULT_CONFIG;
    } else {
        const char *p = getenv("LIBVGPU_CONFIG");
        if (p && *p && stat(p, &st) != 0) { /* limits were meant to be there: fail safe */
            snprintf(err, errlen, "%s (named by LIBVGPU_CONFIG) cannot be read (%s)", p,
                     strerror(errno));
            return -1;
        }
        if (p && *p) path = p;
    }
    if (!path) {
        static struct raw file, env;
        raw_init(&file);
        raw_init(&env);
        memset(cfg, 0, sizeof(*cfg));
        if (parse_env(&env, err, errlen) || check_limits(&env, "environment", err, errlen))
            return -1;
        finish(cfg, &file, &env, 0);
        snprintf(cfg->source, sizeof(cfg->source), "environment (no limits file)");
        return 0;
    }
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        snprintf(err, errlen, "%s: cannot be read (%s)", path, strerror(errno));
        return -1;
    }
    char *buf = malloc(MAX_CONFIG_BYTES + 1);
    if (!buf) {
        close(fd);
        snprintf(err, errlen, "%s: out of memory", path);
        return -1;
    }
    size_t n = 0;
    for (;;) {
        ssize_t got = read(fd, buf + n, MAX_CONFIG_BYTES + 1 - n);
        if (got < 0 && errno == EINTR) continue;
        if (got < 0) {
            snprintf(err, errlen, "%s: cannot be read (%s)", path, strerror(errno));
            close(fd);
            free(buf);
            return -1;
        }
        if (got == 0) break;
        n += (size_t)got;
        if (n > MAX_CONFIG_BYTES) {
            snprintf(err, errlen, "%s: larger than %d bytes", path, MAX_CONFIG_BYTES);
            close(fd);
            free(buf);
            return -1;
        }
    }
    close(fd);
    buf[n] = 0;
    if (memchr(buf, 0, n)) {
        snprintf(err, errlen, "%s: contains a NUL byte; expected key=value text lines", path);
        free(buf);
        return -1;
    }
    int rc = vgpu_config_parse_text(cfg, buf, path, err, errlen);
    free(buf);
    return rc;
}
