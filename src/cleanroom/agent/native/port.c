/* CONNECT's header and dial: see port.h. */
#define _GNU_SOURCE
#include "port.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

int port_of(jspan header, int *port) {
    jspan v;
    int64_t n;
    if (json_get(header, "port", &v) || json_int(v, &n) || n < 1 || n > 65535)
        return -1;
    *port = (int)n;
    return 0;
}

int port_dial(int port, int timeout_ms) {
    if (port < 1 || port > 65535) {
        errno = EINVAL;
        return -1;
    }
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0)
        return -1;
    struct sockaddr_in to = {.sin_family = AF_INET, .sin_port = htons((unsigned short)port)};
    to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    int err = 0;
    if (connect(fd, (struct sockaddr *)&to, sizeof to) < 0) {
        err = errno;
        if (err == EINPROGRESS) {
            struct pollfd pf = {fd, POLLOUT, 0};
            int ready;
            while ((ready = poll(&pf, 1, timeout_ms)) < 0 && errno == EINTR)
                ;
            socklen_t len = sizeof err;
            if (ready == 0)
                err = ETIMEDOUT;
            else if (ready < 0 || getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) < 0)
                err = errno;
        }
    }
    if (err) {
        close(fd);
        errno = err;
        return -1;
    }
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    return fd;
}

const char *port_error_code(int err) {
    return err == ECONNREFUSED ? "refused" : err == ETIMEDOUT ? "timeout" : "os_error";
}
