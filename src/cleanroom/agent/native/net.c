/* The egress NIC: see net.h (and agent/guestnet.py, its twin, whose constants these are). */
#define _GNU_SOURCE
#include "net.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <net/if.h>
#include <net/route.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#define IFACE "eth0"
#define NETMASK "255.255.255.0"
#define GUEST_ADDR "10.0.2.15"
#define GATEWAY "10.0.2.2"
#define PROXY_URL "http://10.0.2.100:3128"
#define DNS_ADDR "10.0.2.101"
#define RESOLV_CONF "nameserver " DNS_ADDR "\noptions use-vc timeout:5 attempts:2\n"
#define NO_PROXY "localhost,127.0.0.1"

static const char *const PROXY_VARS[][2] = {
    {"HTTP_PROXY", PROXY_URL}, {"HTTPS_PROXY", PROXY_URL}, {"NO_PROXY", NO_PROXY},
    {"http_proxy", PROXY_URL}, {"https_proxy", PROXY_URL}, {"no_proxy", NO_PROXY},
};

static int configured;   /* eth0 is set up */
static char error[300];  /* why it is not (empty: there is no NIC) */

static void set_addr(struct sockaddr *sa, const char *ip) {
    struct sockaddr_in *in = (struct sockaddr_in *)sa;
    memset(in, 0, sizeof *in);
    in->sin_family = AF_INET;
    inet_pton(AF_INET, ip, &in->sin_addr);
}

static int up(int sock, const char *name) {
    struct ifreq r;
    memset(&r, 0, sizeof r);
    snprintf(r.ifr_name, sizeof r.ifr_name, "%s", name);
    if (ioctl(sock, SIOCGIFFLAGS, &r))
        return -1;
    r.ifr_flags |= IFF_UP;
    return ioctl(sock, SIOCSIFFLAGS, &r);
}

static int address(int sock, unsigned long request, const char *ip) {
    struct ifreq r;
    memset(&r, 0, sizeof r);
    snprintf(r.ifr_name, sizeof r.ifr_name, "%s", IFACE);
    set_addr(&r.ifr_addr, ip);
    return ioctl(sock, request, &r);
}

static int default_route(int sock) {
    struct rtentry rt;
    memset(&rt, 0, sizeof rt);
    set_addr(&rt.rt_dst, "0.0.0.0");
    set_addr(&rt.rt_gateway, GATEWAY);
    set_addr(&rt.rt_genmask, "0.0.0.0");
    rt.rt_flags = RTF_UP | RTF_GATEWAY;
    return ioctl(sock, SIOCADDRT, &rt);
}

static int write_resolv_conf(void) {
    static const char tmp[] = "/etc/resolv.conf.cleanroom";
    mkdir("/etc", 0755); /* an image may have no /etc at all (FROM scratch) */
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd < 0)
        return -1;
    ssize_t n = write(fd, RESOLV_CONF, sizeof RESOLV_CONF - 1);
    close(fd);
    /* rename replaces a symlink too (the root is a writable overlay) */
    return n == (ssize_t)(sizeof RESOLV_CONF - 1) ? rename(tmp, "/etc/resolv.conf") : -1;
}

void net_setup(void) {
    struct stat st;
    const char *sock_env = getenv("CLEANROOM_AGENT_SOCKET");
    if (sock_env && *sock_env)
        return; /* not a VM: the host's network is not ours to touch */
    int sock = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    const char *step = "socket";
    int ok = sock >= 0;
    if (ok && (step = "lo up", up(sock, "lo")))
        ok = 0;
    /* lo is up in every VM (a guest's own 127.0.0.1: its servers, CONNECT's port.c); the rest
     * only with a NIC */
    if (stat("/sys/class/net/" IFACE, &st)) {
        if (sock >= 0)
            close(sock);
        return;
    }
    if (ok && (step = "address", address(sock, SIOCSIFADDR, GUEST_ADDR)))
        ok = 0;
    if (ok && (step = "netmask", address(sock, SIOCSIFNETMASK, NETMASK)))
        ok = 0;
    if (ok && (step = IFACE " up", up(sock, IFACE)))
        ok = 0;
    if (ok && (step = "default route", default_route(sock)))
        ok = 0;
    if (ok && (step = "/etc/resolv.conf", write_resolv_conf()))
        ok = 0;
    int err = errno;
    if (sock >= 0)
        close(sock);
    if (ok)
        configured = 1;
    else
        snprintf(error, sizeof error, "OSError: %s: [Errno %d] %s", step, err, strerror(err));
}

void net_hello(jbuf *h) {
    if (!configured && !error[0])
        return;
    jb_key(h, "network");
    if (!configured) {
        jb_lit(h, "{\"error\":");
        jb_str(h, error, strlen(error));
        jb_lit(h, "}");
        return;
    }
    jb_lit(h, "{\"address\":\"" GUEST_ADDR "\",\"env\":{");
    for (size_t i = 0; i < sizeof PROXY_VARS / sizeof *PROXY_VARS; i++) {
        if (i)
            jb_lit(h, ",");
        jb_str(h, PROXY_VARS[i][0], strlen(PROXY_VARS[i][0]));
        jb_lit(h, ":");
        jb_str(h, PROXY_VARS[i][1], strlen(PROXY_VARS[i][1]));
    }
    jb_lit(h, "}}");
}

int net_env(struct env *e) {
    for (size_t i = 0; configured && i < sizeof PROXY_VARS / sizeof *PROXY_VARS; i++)
        if (env_set(e, PROXY_VARS[i][0], PROXY_VARS[i][1]))
            return -1;
    return 0;
}
