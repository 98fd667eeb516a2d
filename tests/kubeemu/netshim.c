/* The emulator's pod network: each pod has its own loopback address (KUBEEMU_POD_IP), and
 * this preloaded library gives the pod's processes what a network namespace would give them:
 *
 *  - bind() to 0.0.0.0 or 127.0.0.1 (or :: on a dual-stack socket) binds the pod's address, so
 *    the same port in two pods never collides, and what a pod binds on "localhost" is
 *    reachable only through its own address;
 *  - connect() to 127.0.0.1:port goes to the pod's own address when something of the pod
 *    listens on that port there; otherwise it stays 127.0.0.1 (the node's own services, such
 *    as the hub and the API server in the tests: see README.md, "Not emulated").
 *
 * Programs that do not go through libc's bind/connect (static binaries, raw syscalls) are
 * not covered. Loaded through the container's /etc/ld.so.preload (or LD_PRELOAD where a
 * volume owns that file).
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

typedef int (*bind_fn)(int, const struct sockaddr *, socklen_t);
typedef int (*connect_fn)(int, const struct sockaddr *, socklen_t);

static bind_fn real_bind;
static connect_fn real_connect;
static struct in_addr pod_ip;
static int have_ip = -1;

static void init(void) {
    if (have_ip != -1) return;
    real_bind = (bind_fn)dlsym(RTLD_NEXT, "bind");
    real_connect = (connect_fn)dlsym(RTLD_NEXT, "connect");
    const char *ip = getenv("KUBEEMU_POD_IP");
    have_ip = ip && inet_pton(AF_INET, ip, &pod_ip) == 1;
}

static int is_v4(const struct sockaddr *a, socklen_t len) {
    return a && len >= (socklen_t)sizeof(struct sockaddr_in) && a->sa_family == AF_INET;
}

static int is_v6(const struct sockaddr *a, socklen_t len) {
    return a && len >= (socklen_t)sizeof(struct sockaddr_in6) && a->sa_family == AF_INET6;
}

static int stream_socket(int fd) {
    int type = 0;
    socklen_t len = sizeof(type);
    return getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &len) == 0 && type == SOCK_STREAM;
}

/* Does a socket of this pod listen on pod_ip:port? (A bind with SO_REUSEADDR fails only then.) */
static int pod_listens(in_port_t port) {
    int s = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (s < 0) return 0;
    int one = 1;
    setsockopt(s, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    struct sockaddr_in a;
    memset(&a, 0, sizeof(a));
    a.sin_family = AF_INET;
    a.sin_port = port;
    a.sin_addr = pod_ip;
    int saved = errno;
    int r = real_bind(s, (struct sockaddr *)&a, sizeof(a));
    int busy = r != 0 && errno == EADDRINUSE;
    close(s);
    errno = saved;
    return busy;
}

int bind(int fd, const struct sockaddr *addr, socklen_t len) {
    init();
    if (have_ip && is_v4(addr, len)) {
        struct sockaddr_in a;
        memcpy(&a, addr, sizeof(a));
        if (a.sin_addr.s_addr == htonl(INADDR_ANY) || a.sin_addr.s_addr == htonl(INADDR_LOOPBACK)) {
            a.sin_addr = pod_ip;
            return real_bind(fd, (struct sockaddr *)&a, sizeof(a));
        }
    } else if (have_ip && is_v6(addr, len)) {
        struct sockaddr_in6 a;
        memcpy(&a, addr, sizeof(a));
        int v6only = 0;
        socklen_t olen = sizeof(v6only);
        getsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &v6only, &olen);
        if (!v6only && IN6_IS_ADDR_UNSPECIFIED(&a.sin6_addr)) {
            memset(&a.sin6_addr, 0, sizeof(a.sin6_addr));
            a.sin6_addr.s6_addr[10] = 0xff;
            a.sin6_addr.s6_addr[11] = 0xff;
            memcpy(&a.sin6_addr.s6_addr[12], &pod_ip, 4);
            return real_bind(fd, (struct sockaddr *)&a, sizeof(a));
        }
    }
    return real_bind(fd, addr, len);
}

int connect(int fd, const struct sockaddr *addr, socklen_t len) {
    init();
    if (have_ip && is_v4(addr, len) && stream_socket(fd)) {
        struct sockaddr_in a;
        memcpy(&a, addr, sizeof(a));
        if (a.sin_addr.s_addr == htonl(INADDR_LOOPBACK) && pod_listens(a.sin_port)) {
            a.sin_addr = pod_ip;
            return real_connect(fd, (struct sockaddr *)&a, sizeof(a));
        }
    }
    return real_connect(fd, addr, len);
}
