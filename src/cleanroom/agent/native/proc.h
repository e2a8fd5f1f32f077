/*
 * Running one process for the agent (EXEC, and RUN's command entrypoint): its own session and
 * process group, stdin /dev/null, stdout and stderr relayed to the host as STDOUT/STDERR frames
 * from the calling thread (one poll loop), a deadline after which the whole group is killed,
 * then EXIT {code, signal, duration_s, timed_out}.
 */
#ifndef CLEANROOM_PROC_H
#define CLEANROOM_PROC_H

#include <stddef.h>

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

/* Run argv with env in cwd (NULL: "/"), for at most timeout_s (< 0: no limit); send EXIT. */
void run_process(send_fn send, char *const argv[], char *const envp[], const char *cwd,
                 double timeout_s, struct timed_file *timed, size_t ntimed);

double monotonic_s(void);

#endif
