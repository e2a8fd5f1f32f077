/*
 * Running one process for the agent (EXEC, and RUN's command entrypoint): its own session and
 * process group, stdin /dev/null, stdout and stderr relayed to the host as STDOUT/STDERR frames
 * from the calling thread (one poll loop), a deadline after which the whole group is killed,
 * then EXIT {code, signal, duration_s, timed_out}.
 */
#ifndef CLEANROOM_PROC_H
#define CLEANROOM_PROC_H

#include <stddef.h>

#include "json.h"

/* An environment being built: "KEY=VALUE" strings, later ones replace earlier keys. */
struct env {
    char **items; /* NULL-terminated */
    size_t n, cap;
};

int env_set(struct env *e, const char *key, const char *value);
void env_free(struct env *e);

/* A file removed at a wall-clock-free deadline while the process runs (a secret's lifetime). */
struct timed_file {
    char *path;
    double at; /* monotonic seconds; < 0: never */
};

/* The agent's sender: a frame with a JSON header (NULL: "{}") and a body. */
typedef void (*send_fn)(int kind, const char *header, const void *body, size_t blen);

/* What a multiplexed EXEC adds (mux.c): a stdin pipe, a user, and a call once it runs. */
struct proc_opts {
    int stdin_fd;    /* the child's end of its stdin pipe (closed here), -1: /dev/null */
    int tty_fd;      /* > 0: a PTY's terminal end for stdin, stdout, stderr (closed here) */
    int tty_master;  /* then its master, read (a dup of it) as stdout */
    int has_ids;     /* run as uid/gid with these supplementary groups */
    unsigned uid, gid;
    const unsigned *groups;
    size_t ngroups;
    void (*started)(void *ctx, int pid); /* after exec succeeded; pid -1: it did not start */
    void *ctx;
};

/* Run argv with env in cwd (NULL: "/"), for at most timeout_s (< 0: no limit); send EXIT. */
void run_process(send_fn send, char *const argv[], char *const envp[], const char *cwd,
                 double timeout_s, struct timed_file *timed, size_t ntimed);

void run_process_with(send_fn send, char *const argv[], char *const envp[], const char *cwd,
                      double timeout_s, struct timed_file *timed, size_t ntimed,
                      const struct proc_opts *opts);

/* EXIT {code (< 0: null), signal (0: null), duration_s, timed_out} plus `extra` (",key:value"
 * pairs of valid JSON, or NULL) */
void send_exit(send_fn send, int code, int sig, double duration, int timed_out, const char *extra);

/* Remove the files whose time has come; *next: the earliest deadline left (< 0: none). */
void timed_expire(struct timed_file *timed, size_t ntimed, double now, double *next);

/* Forward what the pipes fds[0] (STDOUT) and fds[1] (STDERR) have, waiting up to timeout_s
 * (< 0: forever); a pipe at end of file is closed and set to -1. Returns 1 if `watch`
 * (-1: none) is readable. */
int relay_step(send_fn send, int fds[2], int watch, double timeout_s);

/* After the process ended: what is left in the pipes (a grandchild holding one open loses it
 * after relay.DRAIN_S), then both closed. */
void relay_drain(send_fn send, int fds[2]);

double monotonic_s(void);

/* In a forked child: the signals the agent ignores (SIGPIPE, a terminal's) back to default. */
void child_signals(void);

/* argv from a JSON list of strings (NULL if it is not one), and its release */
char **argv_of(jspan list);
void free_argv(char **argv);
/* a request's "timeout_s": < 0 if it is not a number (no limit), 0 if negative */
double timeout_of(jspan v);
/* the folders above `path` (mode 0755); -1 with errno if one cannot be made */
int make_parents(const char *path);

#endif
