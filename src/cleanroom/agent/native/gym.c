/* The gym process, from the native agent: see gym.h (and agent/gym_worker.py, its twin). */
#define _GNU_SOURCE
#include "gym.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "json.h"
#include "warm.h"

enum { MAX_CONFIG = 256 * 1024 };      /* gym.json */
static const double READY_S = 60.0;    /* gym_worker.READY_S */
static const char CONFIG[] = "/etc/cleanroom/gym.json"; /* gym_worker.CONFIG_FILE */

enum { MAX_ENV = 64 };

static struct {
    pid_t pid;
    int sock;
    int ready;
    char error[512];
    struct reader rd;
    char dir[4096];          /* the agent's folder: gym_worker.py is there */
    char *envp[MAX_ENV + 1]; /* the base environment, kept for a start at the first request */
} g = {.pid = 0, .sock = -1};

static ssize_t sock_read(void *ctx, void *buf, size_t n) {
    (void)ctx;
    ssize_t got;
    do
        got = read(g.sock, buf, n);
    while (got < 0 && errno == EINTR);
    return got;
}

static void stop(const char *why) {
    python_stop(&g.pid, &g.sock);
    g.ready = 0;
    snprintf(g.error, sizeof g.error, "%s", why);
}

static char *read_config(size_t *n) {
    int fd = open(CONFIG, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return NULL;
    char *buf = malloc(MAX_CONFIG + 1);
    size_t have = 0;
    ssize_t got = 1;
    while (buf && have < MAX_CONFIG && got > 0) {
        got = read(fd, buf + have, MAX_CONFIG - have);
        if (got > 0)
            have += (size_t)got;
    }
    close(fd);
    if (!buf || got < 0 || have == MAX_CONFIG) {
        free(buf);
        return NULL;
    }
    buf[have] = 0;
    *n = have;
    return buf;
}

/* The gym process's first frame: OK {"ready": true, ...} once its envs are made. */
static void wait_ready(void) {
    struct pollfd p = {g.sock, POLLIN, 0};
    if (poll(&p, 1, (int)(READY_S * 1000)) != 1) {
        stop("the gym process was not ready in time");
        return;
    }
    struct frame f;
    const char *why = "closed";
    int st = frame_read(&g.rd, &f, &why);
    if (st != FRAME_OK) {
        stop(st == FRAME_BAD ? why : "the gym process closed its channel");
        return;
    }
    jspan v;
    if (f.kind == K_OK && !json_get(frame_header(&f), "ready", &v) && json_true(v)) {
        g.ready = 1;
    } else {
        char *message = json_get(frame_header(&f), "message", &v) ? NULL : json_strdup(v);
        stop(message ? message : "not ready");
        free(message);
    }
    frame_free(&f);
}

/* The image's python3; outside a VM (on a socket: the fake driver) CLEANROOM_PYTHON may name
 * the host's, the one with gymnasium */
static const char *python3(void) {
    const char *own = getenv("CLEANROOM_AGENT_SOCKET") ? getenv("CLEANROOM_PYTHON") : NULL;
    return own && *own == '/' && access(own, X_OK) == 0 ? own : python_path();
}

/* Start the gym process with `config` (a JSON object) and wait until it is ready. */
static void start(const char *config) {
    const char *python = python3(), *why = "no python3 in the image";
    pid_t pid = python ? python_start(python, g.dir, "gym_worker", config, g.envp, &g.sock, &why)
                       : -1;
    if (pid < 0) {
        stop(why);
        return;
    }
    g.pid = pid, g.error[0] = 0;
    g.rd.read = sock_read;
    g.rd.ctx = NULL;
    g.rd.start = g.rd.end = 0;
    wait_ready();
}

/* Start it with the baseline's config, or none (its envs are then made at GYM_MAKE). */
static void start_configured(void) {
    size_t n = 0;
    char *config = read_config(&n);
    start(config ? config : "{}");
    free(config);
}

void gym_boot(const char *agent_dir, char *const envp[]) {
    snprintf(g.dir, sizeof g.dir, "%s", agent_dir);
    for (size_t i = 0; envp && envp[i] && i < MAX_ENV; i++)
        g.envp[i] = strdup(envp[i]); /* NULL-terminated: the rest of the array stays NULL */
    if (access(CONFIG, R_OK) == 0)
        start_configured(); /* before HELLO: a snapshot template holds its envs made */
}

int gym_available(void) {
    char path[4200];
    snprintf(path, sizeof path, "%s/gym_worker.py", g.dir);
    return g.ready || (python3() && access(path, R_OK) == 0);
}


int gym_request(int kind) { return kind >= K_GYM_MAKE && kind <= K_GYM_CLOSE; }

static void fatal(send_fn send, const char *why) {
    jbuf h = {0};
    jb_lit(&h, "{\"message\":");
    jb_str(&h, why, strlen(why));
    jb_lit(&h, ",\"fatal\":true}");
    send(K_GYM_ERROR, h.failed ? "{\"fatal\":true}" : h.p, NULL, 0);
    jb_free(&h);
}

static int write_all(const unsigned char *p, size_t n) {
    while (n) {
        ssize_t put = write(g.sock, p, n);
        if (put < 0 && errno == EINTR)
            continue;
        if (put <= 0)
            return -1;
        p += put, n -= (size_t)put;
    }
    return 0;
}

void gym_handle(send_fn send, const struct frame *f) {
    if (!g.ready) /* none yet, or it died: a new one (as gym_worker.handle starts a Proxy) */
        start_configured();
    if (!g.ready) {
        char why[600];
        snprintf(why, sizeof why, "gym process: %s", g.error[0] ? g.error : "did not start");
        fatal(send, why);
        return;
    }
    size_t total = 0;
    unsigned char *out = frame_encode(f->kind, f->header, f->hlen, f->body, f->blen, &total);
    if (!out) {
        fatal(send, "out of memory");
        return;
    }
    int failed = write_all(out, total);
    free(out);
    if (failed) {
        stop("the gym process died (its channel broke)");
        fatal(send, g.error);
        return;
    }
    struct frame a;
    const char *why = "closed";
    int st = frame_read(&g.rd, &a, &why);
    if (st != FRAME_OK) {
        stop(st == FRAME_BAD ? "the gym process sent a bad frame" : "the gym process died");
        fatal(send, g.error);
        return;
    }
    if (a.kind != K_GYM_SPACES && a.kind != K_GYM_OBS && a.kind != K_GYM_ERROR) {
        frame_free(&a);
        stop("the gym process answered with a frame of another kind");
        fatal(send, g.error);
        return;
    }
    send(a.kind, a.header, a.body, a.blen);
    frame_free(&a);
}
