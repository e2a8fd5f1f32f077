/* Running one process: see proc.h. */
#define _GNU_SOURCE
#include "proc.h"

#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "frame.h"
#include "json.h"

enum { RELAY_CHUNK = 64 * 1024 };
static const double DRAIN_S = 2.0;     /* relay.DRAIN_S: a grandchild holding a pipe open */
static const double EXIT_POLL_S = 0.1; /* without a pidfd: how often to look for the exit */
static const double MAX_WAIT_S = 3600.0;

double monotonic_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

int env_set(struct env *e, const char *key, const char *value) {
    size_t klen = strlen(key), vlen = strlen(value);
    char *item = malloc(klen + vlen + 2);
    if (!item)
        return -1;
    memcpy(item, key, klen);
    item[klen] = '=';
    memcpy(item + klen + 1, value, vlen + 1);
    for (size_t i = 0; i < e->n; i++) {
        if (strncmp(e->items[i], key, klen) == 0 && e->items[i][klen] == '=') {
            free(e->items[i]);
            e->items[i] = item;
            return 0;
        }
    }
    if (e->n + 2 > e->cap) {
        size_t cap = e->cap ? e->cap * 2 : 16;
        char **items = realloc(e->items, cap * sizeof *items);
        if (!items) {
            free(item);
            return -1;
        }
        e->items = items;
        e->cap = cap;
    }
    e->items[e->n++] = item;
    e->items[e->n] = NULL;
    return 0;
}

void env_free(struct env *e) {
    for (size_t i = 0; i < e->n; i++)
        free(e->items[i]);
    free(e->items);
    memset(e, 0, sizeof *e);
}

static const char *env_get(char *const envp[], const char *key) {
    size_t klen = strlen(key);
    for (size_t i = 0; envp[i]; i++)
        if (strncmp(envp[i], key, klen) == 0 && envp[i][klen] == '=')
            return envp[i] + klen + 1;
    return NULL;
}

/* In the child: only async-signal-safe calls. execve each PATH entry, as execvpe does
 * but with the new environment's PATH. */
static void child_exec(char *const argv[], char *const envp[], const char *path_env) {
    const char *name = argv[0];
    if (strchr(name, '/')) {
        execve(name, argv, envp);
        return;
    }
    size_t nlen = strlen(name);
    int saw_eacces = 0;
    const char *p = path_env ? path_env : "/usr/bin:/bin";
    char buf[4096];
    for (;;) {
        const char *colon = strchr(p, ':');
        size_t dlen = colon ? (size_t)(colon - p) : strlen(p);
        if (dlen + nlen + 2 <= sizeof buf) {
            size_t k = 0;
            if (dlen) {
                memcpy(buf, p, dlen);
                k = dlen;
            } else {
                buf[k++] = '.';
            }
            buf[k++] = '/';
            memcpy(buf + k, name, nlen + 1);
            execve(buf, argv, envp);
            if (errno == EACCES)
                saw_eacces = 1;
        }
        if (!colon)
            break;
        p = colon + 1;
    }
    errno = saw_eacces ? EACCES : ENOENT;
}

void child_signals(void) {
    struct sigaction dfl;
    memset(&dfl, 0, sizeof dfl);
    dfl.sa_handler = SIG_DFL;
    int ignored_here[] = {SIGPIPE, SIGHUP, SIGINT, SIGQUIT, SIGTSTP, SIGTTIN, SIGTTOU};
    for (size_t i = 0; i < sizeof ignored_here / sizeof *ignored_here; i++)
        sigaction(ignored_here[i], &dfl, NULL); /* the agent ignores them; not the process */
}

void send_exit(send_fn send, int code, int sig, double duration, int timed_out, const char *extra) {
    jbuf h = {0};
    jb_lit(&h, "{\"code\":");
    if (code >= 0)
        jb_int(&h, code);
    else
        jb_lit(&h, "null");
    jb_lit(&h, ",\"signal\":");
    if (sig > 0)
        jb_int(&h, sig);
    else
        jb_lit(&h, "null");
    jb_lit(&h, ",\"duration_s\":");
    jb_fixed(&h, (uint64_t)(duration * 1e6));
    jb_lit(&h, timed_out ? ",\"timed_out\":true" : ",\"timed_out\":false");
    if (extra)
        jb_lit(&h, extra);
    jb_lit(&h, "}");
    send(K_EXIT, h.failed ? NULL : h.p, NULL, 0);
    jb_free(&h);
}

static void cannot_start(send_fn send, const char *name, int err) {
    char msg[512];
    int n = snprintf(msg, sizeof msg, "cannot start %s: [Errno %d] %s\n", name, err, strerror(err));
    send(K_STDERR, NULL, msg, n < 0 ? 0 : (size_t)n >= sizeof msg ? sizeof msg - 1 : (size_t)n);
    send_exit(send, 127, 0, 0.0, 0, NULL);
}

void timed_expire(struct timed_file *timed, size_t ntimed, double now, double *next) {
    for (size_t i = 0; i < ntimed; i++) {
        if (timed[i].at < 0)
            continue;
        if (timed[i].at <= now) {
            unlink(timed[i].path);
            timed[i].at = -1;
        } else if (*next < 0 || timed[i].at < *next) {
            *next = timed[i].at;
        }
    }
}

int relay_step(send_fn send, int fds[2], int watch, double timeout_s) {
    char buf[RELAY_CHUNK]; /* on the stack: several requests relay at once (mux.c) */
    struct pollfd p[3];
    int kinds[3], n = 0;
    for (int i = 0; i < 2; i++) {
        if (fds[i] >= 0) {
            p[n].fd = fds[i];
            p[n].events = POLLIN;
            kinds[n++] = i;
        }
    }
    if (watch >= 0) {
        p[n].fd = watch;
        p[n].events = POLLIN;
        kinds[n++] = -1;
    }
    if (timeout_s > MAX_WAIT_S) /* a far deadline: wake now and then, never overflow int */
        timeout_s = MAX_WAIT_S;
    int ms = timeout_s < 0 ? -1 : (int)(timeout_s * 1000) + 1;
    int watched = 0;
    if (poll(p, (nfds_t)n, ms) <= 0)
        return 0;
    for (int i = 0; i < n; i++) {
        if (!(p[i].revents & (POLLIN | POLLHUP | POLLERR)))
            continue;
        if (kinds[i] < 0) {
            watched = 1;
            continue;
        }
        ssize_t k = read(p[i].fd, buf, sizeof buf);
        if (k > 0) {
            send(kinds[i] == 0 ? K_STDOUT : K_STDERR, NULL, buf, (size_t)k);
        } else if (k == 0 || (errno != EINTR && errno != EAGAIN)) { /* a PTY's end: EIO */
            close(fds[kinds[i]]);
            fds[kinds[i]] = -1;
        }
    }
    return watched;
}

void relay_drain(send_fn send, int fds[2]) {
    double drain_until = monotonic_s() + DRAIN_S;
    while (fds[0] >= 0 || fds[1] >= 0) {
        double left = drain_until - monotonic_s();
        if (left <= 0)
            break;
        relay_step(send, fds, -1, left);
    }
    for (int i = 0; i < 2; i++)
        if (fds[i] >= 0)
            close(fds[i]);
}

/* the process could not start: STARTED {pid: null} first for a multiplexed request */
static void fail_start(send_fn send, const struct proc_opts *o, const char *name, int err) {
    if (o && o->started)
        o->started(o->ctx, -1);
    cannot_start(send, name, err);
}

/* In the child: the request's user (its groups, then gid, then uid); 0 or -1. Raw system
 * calls: glibc's setuid() in a threaded process signals every thread to change too, and this
 * child shares the agent's memory (spawn_child) */
static int child_ids(const struct proc_opts *o) {
    if (!o || !o->has_ids)
        return 0;
    if (syscall(SYS_setgroups, o->ngroups, o->groups) || syscall(SYS_setgid, o->gid) ||
        syscall(SYS_setuid, o->uid))
        return -1;
    return 0;
}

/* What the child of spawn() needs, and what it says back if it could not exec */
struct spawn {
    char *const *argv, *const *envp;
    const char *cwd, *path_env;
    int in, out, err, tty;
    const struct proc_opts *opts;
    int failed, err_no;
};

/* The child: it shares the agent's memory until its execve (CLONE_VM | CLONE_VFORK), so only
 * system calls here, no allocation, no lock; its errno goes back through `s`. */
static int spawn_child(void *arg) {
    struct spawn *s = arg;
    child_signals();
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    setsid();
    int null = s->tty >= 0 ? s->tty : s->in >= 0 ? s->in : open("/dev/null", O_RDONLY);
    if (null >= 0)
        dup2(null, 0);
    dup2(s->tty >= 0 ? s->tty : s->out, 1);
    dup2(s->tty >= 0 ? s->tty : s->err, 2);
    if (s->tty >= 0)
        ioctl(0, TIOCSCTTY, 0); /* its terminal: ^C and window changes reach its group */
    if (child_ids(s->opts) == 0 && chdir(s->cwd ? s->cwd : "/") == 0)
        child_exec((char *const *)s->argv, (char *const *)s->envp, s->path_env);
    s->err_no = errno ? errno : ENOENT;
    s->failed = 1;
    _exit(127);
}

/* Start the child as vfork does (no copy of the agent's page tables, no copy-on-write faults
 * after it: under TCG a fork of the agent cost more than the exec of /bin/true), on a stack of
 * its own, every signal blocked meanwhile; its pid once it exec'd, or -1 with errno (clone's
 * own, or the child's from its execve, the child then reaped). */
static pid_t spawn(struct spawn *s) {
    static const size_t stack_size = 32 * 1024; /* child_exec's 4 KiB path and the calls */
    char stack[32 * 1024] __attribute__((aligned(16)));
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    s->failed = 0;
    pid_t pid = clone(spawn_child, stack + stack_size, CLONE_VM | CLONE_VFORK | SIGCHLD, s);
    int err = errno;
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (pid > 0 && s->failed) {
        waitpid(pid, NULL, 0);
        err = s->err_no;
        pid = -1;
    }
    errno = err;
    return pid;
}

void run_process(send_fn send, char *const argv[], char *const envp[], const char *cwd,
                 double timeout_s, struct timed_file *timed, size_t ntimed) {
    run_process_with(send, argv, envp, cwd, timeout_s, timed, ntimed, NULL);
}

void run_process_with(send_fn send, char *const argv[], char *const envp[], const char *cwd,
                      double timeout_s, struct timed_file *timed, size_t ntimed,
                      const struct proc_opts *opts) {
    double started = monotonic_s();
    int out[2], err[2];
    int stdin_fd = opts ? opts->stdin_fd : -1;
    int tty = opts && opts->tty_fd > 0 ? opts->tty_fd : -1;
    if (!argv[0]) {
        if (tty >= 0)
            close(tty);
        if (stdin_fd >= 0)
            close(stdin_fd);
        fail_start(send, opts, "[]", ENOENT);
        return;
    }
    if (pipe2(out, O_CLOEXEC) || pipe2(err, O_CLOEXEC)) {
        if (tty >= 0)
            close(tty);
        if (stdin_fd >= 0)
            close(stdin_fd);
        fail_start(send, opts, argv[0], errno);
        return;
    }
    struct spawn s = {argv, envp, cwd, env_get(envp, "PATH"), stdin_fd, out[1], err[1], tty, opts,
                      0, 0};
    pid_t pid = spawn(&s);
    int spawn_errno = errno;
    close(out[1]);
    close(err[1]);
    if (stdin_fd >= 0)
        close(stdin_fd); /* the child's end: a writer to an exited process gets EPIPE */
    if (tty >= 0) { /* one terminal for all three: its master is read as stdout */
        close(tty);
        close(out[0]);
        close(err[0]);
        out[0] = fcntl(opts->tty_master, F_DUPFD_CLOEXEC, 0);
        err[0] = -1;
    }
    if (pid < 0) { /* no child, or one whose exec failed: nothing ran */
        if (out[0] >= 0)
            close(out[0]);
        if (err[0] >= 0)
            close(err[0]);
        fail_start(send, opts, argv[0], spawn_errno);
        return;
    }
    if (opts && opts->started)
        opts->started(opts->ctx, pid);
    int fds[2] = {out[0], err[0]};
    int pidfd = (int)syscall(SYS_pidfd_open, pid, 0);
    double deadline = timeout_s < 0 ? -1 : started + timeout_s;
    int status = 0, timed_out = 0;
    for (;;) {
        pid_t w = waitpid(pid, &status, WNOHANG);
        if (w == pid)
            break;
        double now = monotonic_s(), next = -1;
        timed_expire(timed, ntimed, now, &next);
        if (deadline >= 0 && now >= deadline) {
            timed_out = 1;
            kill(-pid, SIGKILL);
            kill(pid, SIGKILL);
            waitpid(pid, &status, 0);
            break;
        }
        double wait = deadline < 0 ? -1 : deadline - now;
        if (next >= 0 && (wait < 0 || next - now < wait))
            wait = next - now;
        if (pidfd < 0 && (wait < 0 || wait > EXIT_POLL_S))
            wait = EXIT_POLL_S;
        relay_step(send, fds, pidfd, wait);
    }
    if (pidfd >= 0)
        close(pidfd);
    relay_drain(send, fds);
    int code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    int sig = WIFSIGNALED(status) ? WTERMSIG(status) : 0;
    send_exit(send, code, sig, monotonic_s() - started, timed_out, NULL);
}

/* argv from a JSON list of strings (NULL if it is not one) */
char **argv_of(jspan list) {
    if (!json_is(list, '['))
        return NULL;
    size_t pos = 0, n = 0;
    jspan item;
    while (json_next(list, &pos, NULL, &item))
        n++;
    char **argv = calloc(n + 1, sizeof *argv);
    if (!argv)
        return NULL;
    pos = 0;
    for (size_t i = 0; json_next(list, &pos, NULL, &item); i++) {
        if (!(argv[i] = json_strdup(item))) {
            for (size_t k = 0; k < i; k++)
                free(argv[k]);
            free(argv);
            return NULL;
        }
    }
    return argv;
}

void free_argv(char **argv) {
    for (size_t i = 0; argv && argv[i]; i++)
        free(argv[i]);
    free(argv);
}

int make_parents(const char *path) {
    char buf[4096];
    size_t n = strlen(path);
    if (n >= sizeof buf)
        return -1;
    memcpy(buf, path, n + 1);
    for (size_t i = 1; i < n; i++) {
        if (buf[i] != '/')
            continue;
        buf[i] = 0;
        if (mkdir(buf, 0755) && errno != EEXIST)
            return -1;
        buf[i] = '/';
    }
    return 0;
}

double timeout_of(jspan v) {
    double t;
    return json_number(v, &t) ? -1 : t < 0 ? 0 : t;
}

