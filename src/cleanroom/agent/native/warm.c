/* The warm Python worker, from the native agent: see warm.h. */
#define _GNU_SOURCE
#include "warm.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "frame.h"

enum {
    MAX_MESSAGE = 8 * 1024 * 1024, /* worker.MAX_MESSAGE */
    MAX_CONFIG = 256 * 1024,       /* entry.json */
};
static const double READY_S = 60.0;    /* warm.READY_S: the worker's imports must be done */
static const double KILL_WAIT_S = 5.0; /* warm.KILL_WAIT_S */
static const char *const PYTHONS[] = {"/usr/local/bin/python3", "/usr/bin/python3", "/bin/python3"};

enum { STARTING, READY, FAILED };

static struct {
    int started; /* a worker was ever started (HELLO says how it went) */
    int state;
    int sock; /* the agent's end of the socket pair */
    pid_t pid;
    int ahead; /* a child is forked and waits for its job */
    pid_t ready_pid;
    char *function;    /* "module:function" it serves */
    char import_s[32]; /* its ready message's import_s (a JSON number) */
    char error[512];
    char dir[4096]; /* the agent's folder: worker.py is there */
} w = {.sock = -1};

int warm_message_ok(const char *p, size_t n) {
    return n <= MAX_MESSAGE && json_check_object(p, n) == 0 ? 0 : -1;
}

/* -- messages ----------------------------------------------------------------------------- */

static int send_msg(const char *json, size_t n, const int *fds, int nfds) {
    unsigned char *payload = malloc(n + 4);
    if (!payload)
        return -1;
    payload[0] = (unsigned char)(n >> 24), payload[1] = (unsigned char)(n >> 16);
    payload[2] = (unsigned char)(n >> 8), payload[3] = (unsigned char)n;
    memcpy(payload + 4, json, n);
    size_t off = 0, total = n + 4;
    if (nfds) { /* the descriptors ride on the first bytes */
        union {
            char buf[CMSG_SPACE(2 * sizeof(int))];
            struct cmsghdr align;
        } control;
        memset(&control, 0, sizeof control);
        struct iovec iov = {payload, total};
        struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1};
        msg.msg_control = control.buf;
        msg.msg_controllen = CMSG_SPACE((size_t)nfds * sizeof(int));
        struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN((size_t)nfds * sizeof(int));
        memcpy(CMSG_DATA(c), fds, (size_t)nfds * sizeof(int));
        ssize_t s;
        do
            s = sendmsg(w.sock, &msg, MSG_NOSIGNAL);
        while (s < 0 && errno == EINTR);
        if (s <= 0) {
            free(payload);
            return -1;
        }
        off = (size_t)s;
    }
    while (off < total) {
        ssize_t s = send(w.sock, payload + off, total - off, MSG_NOSIGNAL);
        if (s < 0 && errno == EINTR)
            continue;
        if (s <= 0)
            break;
        off += (size_t)s;
    }
    free(payload);
    return off == total ? 0 : -1;
}

/* n bytes by `deadline` (monotonic): 0, -1 closed or failed, -2 too late */
static int read_exact(int fd, unsigned char *buf, size_t n, double deadline) {
    for (size_t got = 0; got < n;) {
        double left = deadline - monotonic_s();
        if (left <= 0)
            return -2;
        struct pollfd p = {fd, POLLIN, 0};
        int r = poll(&p, 1, (int)(left * 1000) + 1);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            continue; /* the deadline check above decides */
        ssize_t k = read(fd, buf + got, n - got);
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0)
            return -1;
        got += (size_t)k;
    }
    return 0;
}

/* The worker's next message (malloc'd, NUL-terminated, a valid object), or NULL: *late is 1
 * if it did not come within timeout_s, else the worker closed the channel or broke it. */
static char *recv_msg(double timeout_s, size_t *len, int *late) {
    unsigned char head[4];
    double deadline = monotonic_s() + timeout_s;
    *late = 0;
    int st = read_exact(w.sock, head, 4, deadline);
    if (st) {
        *late = st == -2;
        return NULL;
    }
    size_t n = (size_t)head[0] << 24 | (size_t)head[1] << 16 | (size_t)head[2] << 8 | head[3];
    char *msg = n <= MAX_MESSAGE ? malloc(n + 1) : NULL;
    if (!msg || read_exact(w.sock, (unsigned char *)msg, n, deadline + KILL_WAIT_S) ||
        warm_message_ok(msg, n)) {
        free(msg);
        return NULL;
    }
    msg[n] = 0;
    *len = n;
    return msg;
}

/* -- the worker process ------------------------------------------------------------------- */

const char *python_path(void) {
    for (size_t i = 0; i < sizeof PYTHONS / sizeof *PYTHONS; i++)
        if (access(PYTHONS[i], X_OK) == 0)
            return PYTHONS[i];
    return NULL;
}

pid_t python_start(const char *python, const char *dir, const char *module, const char *config,
                   char *const envp[], int *sock, const char **why) {
    jbuf launcher = {0};
    jb_lit(&launcher, "import sys; sys.path.insert(0, ");
    jb_str(&launcher, dir, strlen(dir)); /* a JSON string is a Python literal too */
    jb_lit(&launcher, "); import ");
    jb_lit(&launcher, module);
    jb_lit(&launcher, "; sys.exit(");
    jb_lit(&launcher, module);
    jb_lit(&launcher, ".main())");
    int sv[2];
    if (launcher.failed || socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv)) {
        jb_free(&launcher);
        *why = "cannot make its channel";
        return -1;
    }
    char fd[16];
    snprintf(fd, sizeof fd, "%d", sv[1]);
    char *argv[] = {(char *)python, "-I", "-c", launcher.p, fd, (char *)config, NULL};
    pid_t pid = fork();
    if (pid == 0) {
        child_signals();
        sigset_t none;
        sigemptyset(&none);
        sigprocmask(SIG_SETMASK, &none, NULL);
        setsid();
        int null = open("/dev/null", O_RDONLY);
        if (null >= 0)
            dup2(null, 0);
        fcntl(sv[1], F_SETFD, 0); /* its end stays open across exec */
        if (chdir("/") == 0)
            execve(python, argv, envp);
        _exit(127);
    }
    close(sv[1]);
    jb_free(&launcher);
    if (pid < 0) {
        close(sv[0]);
        *why = "cannot fork";
        return -1;
    }
    *sock = sv[0];
    return pid;
}

void python_stop(pid_t *pid, int *sock) {
    if (*pid > 0) {
        kill(*pid, SIGKILL);
        waitpid(*pid, NULL, 0);
        *pid = 0;
    }
    if (*sock >= 0)
        close(*sock);
    *sock = -1;
}

static void stop(void) {
    python_stop(&w.pid, &w.sock);
    w.state = FAILED;
}

static void fail(const char *why) {
    size_t n = strlen(why); /* a traceback's last lines say what went wrong */
    snprintf(w.error, sizeof w.error, "%s", n < sizeof w.error ? why : why + n - (sizeof w.error - 1));
    stop();
}

static void start(const char *config, size_t n, char *const envp[]) {
    const char *python = python_path();
    stop();
    free(w.function);
    w.function = NULL;
    w.started = 1, w.ahead = 0, w.ready_pid = 0, w.import_s[0] = 0, w.error[0] = 0;
    jspan cfg = {config, n}, fn;
    if (!json_get(cfg, "function", &fn))
        w.function = json_strdup(fn);
    if (!python || !w.function || !*w.function) {
        fail(python ? "its config names no function" : "no python3 in the image");
        return;
    }
    char *conf = malloc(n + 1);
    if (!conf) {
        fail("cannot make its channel");
        return;
    }
    memcpy(conf, config, n);
    conf[n] = 0;
    const char *why = NULL;
    pid_t pid = python_start(python, w.dir, "worker", conf, envp, &w.sock, &why);
    free(conf);
    if (pid < 0) {
        fail(why);
        return;
    }
    w.pid = pid, w.state = STARTING;
}

/* Wait for the worker's imports; 0 once ready, -1 (worker stopped, w.error set) if not. */
static int wait_ready(double timeout_s) {
    if (w.state == STARTING) {
        size_t n = 0;
        int late;
        char *msg = recv_msg(timeout_s > 0.001 ? timeout_s : 0.001, &n, &late);
        jspan m = {msg, n}, v;
        if (msg && !json_get(m, "ready", &v) && json_true(v)) {
            int64_t pid = 0;
            w.state = READY, w.ahead = 1;
            if (!json_get(m, "pid", &v) && !json_int(v, &pid))
                w.ready_pid = (pid_t)pid;
            double seconds;
            if (!json_get(m, "import_s", &v) && v.n < sizeof w.import_s &&
                !json_number(v, &seconds)) {
                memcpy(w.import_s, v.p, v.n);
                w.import_s[v.n] = 0;
            }
        } else {
            char *why = NULL;
            if (msg && !json_get(m, "error", &v))
                why = json_strdup(v);
            char text[64];
            snprintf(text, sizeof text, "its imports took over %.1fs", timeout_s);
            fail(why && *why ? why : late ? text : "it exited");
            free(why);
        }
        free(msg);
    }
    return w.state == READY ? 0 : -1;
}

static int serves(const char *function) {
    return w.state != FAILED && w.sock >= 0 && w.function && !strcmp(w.function, function) &&
           waitpid(w.pid, NULL, WNOHANG) == 0;
}

void warm_boot(const char *agent_dir, char *const envp[]) {
    snprintf(w.dir, sizeof w.dir, "%s", agent_dir);
    char path[4200];
    snprintf(path, sizeof path, "%s/../entry.json", agent_dir);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return; /* a command baseline */
    char *config = malloc(MAX_CONFIG);
    ssize_t n = config ? read(fd, config, MAX_CONFIG) : -1;
    close(fd);
    jspan cfg = {config, n > 0 ? (size_t)n : 0}, fn;
    if (n > 0 && n < MAX_CONFIG && !json_check_object(config, (size_t)n) &&
        !json_get(cfg, "function", &fn) && json_is(fn, '"')) {
        start(config, (size_t)n, envp);
        wait_ready(READY_S);
    }
    free(config);
}

void warm_hello(jbuf *h) {
    if (!w.started)
        return;
    jb_key(h, "warm");
    if (w.state == READY) {
        jb_lit(h, "{\"ready\":true,\"warm_up\":true,\"pid\":");
        jb_int(h, w.ready_pid);
        jb_lit(h, ",\"import_s\":");
        jb_lit(h, w.import_s[0] ? w.import_s : "null");
        jb_lit(h, "}");
    } else {
        size_t n = strlen(w.error);
        const char *tail = n > 400 ? w.error + n - 400 : w.error;
        jb_lit(h, "{\"ready\":false,\"error\":");
        jb_str(h, tail, strlen(tail));
        jb_lit(h, "}");
    }
}

int warm_up(double timeout_s) {
    if (w.state != READY || !w.ahead || w.sock < 0 || w.pid <= 0)
        return 0;
    if (kill(w.pid, SIGUSR1)) {
        fail("it cannot be signalled");
        return -1;
    }
    size_t n = 0;
    int late;
    char *msg = recv_msg(timeout_s, &n, &late);
    jspan m = {msg, n}, v;
    int ok = msg && !json_get(m, "warmed", &v) && json_true(v);
    free(msg);
    if (!ok)
        fail(late ? "its warm-up took too long" : "it broke its warm-up");
    return ok ? 1 : -1;
}

/* -- one episode -------------------------------------------------------------------------- */

static void job_json(jbuf *j, const char *function, const char *root, jspan cwd,
                     char *const envp[], const unsigned char *seed, size_t seedlen) {
    static const char hex[] = "0123456789abcdef";
    jb_lit(j, "{\"function\":");
    jb_str(j, function, strlen(function));
    jb_key(j, "root");
    jb_str(j, root, strlen(root));
    jb_key(j, "cwd");
    jb_raw(j, json_is(cwd, '"') ? cwd.p : "null", json_is(cwd, '"') ? cwd.n : 4);
    jb_lit(j, ",\"env\":{");
    for (size_t i = 0; envp[i]; i++) {
        const char *eq = strchr(envp[i], '=');
        if (!eq)
            continue;
        if (i)
            jb_lit(j, ",");
        jb_str(j, envp[i], (size_t)(eq - envp[i]));
        jb_lit(j, ":");
        jb_str(j, eq + 1, strlen(eq + 1));
    }
    jb_lit(j, "},\"seed\":\"");
    for (size_t i = 0; i < seedlen; i++) {
        char b[2] = {hex[seed[i] >> 4], hex[seed[i] & 15]};
        jb_raw(j, b, 2);
    }
    jb_lit(j, "\"}");
}

static void exit_with(send_fn send, int code, double started, int timed_out, const char *how) {
    char extra[64];
    snprintf(extra, sizeof extra, ",\"entry\":\"function\",\"worker\":\"%s\"", how);
    send_exit(send, code >= 0 ? code : -1, code < 0 ? -code : 0, monotonic_s() - started,
              timed_out, extra);
}

void warm_run(send_fn send, jspan config, const char *root, jspan cwd, char *const envp[],
              char *const base_envp[], const unsigned char *seed, size_t seedlen,
              double timeout_s, struct timed_file *timed, size_t ntimed) {
    double started = monotonic_s();
    const char *how = "warm";
    jspan fn;
    char *function = json_is(config, '{') && !json_get(config, "function", &fn) ? json_strdup(fn)
                                                                                 : NULL;
    if (!function || !*function) {
        static const char why[] = "cleanroom-agent: RUN's function names no module:function\n";
        send(K_STDERR, NULL, why, sizeof why - 1);
        exit_with(send, 1, started, 0, how);
        free(function);
        return;
    }
    if (!serves(function)) {
        start(config.p, config.n, base_envp);
        how = "started";
    }
    double ready_s = timeout_s < 0 ? READY_S : timeout_s - (monotonic_s() - started);
    if (wait_ready(ready_s < READY_S ? ready_s : READY_S)) {
        char why[700];
        int n = snprintf(why, sizeof why,
                         "cleanroom-agent: the warm Python worker did not start: %s\n", w.error);
        send(K_STDERR, NULL, why, n < 0 ? 0 : (size_t)n >= sizeof why ? sizeof why - 1 : (size_t)n);
        int late = timeout_s >= 0 && monotonic_s() - started >= timeout_s;
        exit_with(send, 1, started, late, how);
        free(function);
        return;
    }
    int out[2] = {-1, -1}, err[2] = {-1, -1};
    unsigned char mixed[1024 + 16];
    size_t nseed = seedlen < 1024 ? seedlen : 1024;
    memcpy(mixed, seed, nseed); /* the host's bytes, and this guest's own */
    if (getrandom(mixed + nseed, 16, 0) == 16)
        nseed += 16;
    jbuf job = {0};
    job_json(&job, function, root, cwd, envp, mixed, nseed);
    free(function);
    int died = job.failed || pipe2(out, O_CLOEXEC) || pipe2(err, O_CLOEXEC);
    if (!died && !w.ahead) /* its child ran an earlier episode: ask for the next one */
        died = send_msg("{\"next\":true}", 13, NULL, 0) != 0;
    if (!died) {
        int fds[2] = {out[1], err[1]};
        died = send_msg(job.p, job.n, fds, 2) != 0;
    }
    jb_free(&job);
    for (int i = 0; i < 2; i++) {
        if ((i ? err : out)[1] >= 0)
            close((i ? err : out)[1]);
    }
    w.ahead = 0;
    int pipes[2] = {out[0], err[0]}, timed_out = 0, code = -1, have_code = 0;
    int64_t child = 0;
    double deadline = timeout_s < 0 ? -1 : started + timeout_s;
    while (!died) {
        double now = monotonic_s(), next = -1;
        timed_expire(timed, ntimed, now, &next);
        if (deadline >= 0 && now >= deadline) {
            if (timed_out) { /* the worker never answered the kill */
                died = 1;
                break;
            }
            timed_out = 1;
            if (child > 0)
                kill(-(pid_t)child, SIGKILL);
            deadline = now + KILL_WAIT_S;
            continue;
        }
        double wait = deadline < 0 ? -1 : deadline - now;
        if (next >= 0 && (wait < 0 || next - now < wait))
            wait = next - now;
        if (!relay_step(send, pipes, w.sock, wait))
            continue;
        size_t n = 0;
        int late;
        char *msg = recv_msg(KILL_WAIT_S, &n, &late); /* readable: a whole message follows */
        jspan m = {msg, n}, v;
        int64_t value;
        if (!msg) {
            died = 1;
        } else if (!json_get(m, "code", &v) && !json_int(v, &value)) {
            code = (int)value, have_code = 1;
        } else if (!json_get(m, "pid", &v) && !json_int(v, &value) && value > 1) {
            child = value;
            if (timed_out) /* the child started after the deadline passed */
                kill(-(pid_t)child, SIGKILL);
        }
        free(msg);
        if (have_code)
            break;
    }
    if (died) {
        if (child > 0)
            kill(-(pid_t)child, SIGKILL);
        fail("the worker died");
    }
    relay_drain(send, pipes);
    if (!have_code) { /* EXIT with code and signal null */
        char extra[64];
        snprintf(extra, sizeof extra, ",\"entry\":\"function\",\"worker\":\"%s\"", how);
        send_exit(send, -1, 0, monotonic_s() - started, timed_out, extra);
        return;
    }
    exit_with(send, code, started, timed_out, how);
}
