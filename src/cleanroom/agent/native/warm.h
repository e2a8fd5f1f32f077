/*
 * The warm Python worker (agent/worker.py) seen from the native agent: started at boot when the baseline has a function entrypoint
 * (<agent dir>/../entry.json) and the image has python3, so a snapshot template holds it
 * ready; a function RUN is relayed to it (a job with the episode's stdout/stderr pipes), its
 * output streamed, its child's process group killed at the deadline.
 *
 * Messages both ways: a 4-byte big-endian length, then a JSON object; a job's two
 * descriptors ride on its first bytes (SCM_RIGHTS).
 */
#ifndef CLEANROOM_WARM_H
#define CLEANROOM_WARM_H

#include <stddef.h>
#include <sys/types.h>

#include "json.h"
#include "proc.h"

/* At boot: if `agent_dir`/../entry.json names a function, start the worker with the base
 * environment `envp` and wait (READY_S at most) until its imports are done. */
void warm_boot(const char *agent_dir, char *const envp[]);

/* ,"warm":{...} for HELLO (nothing if no worker was ever started). */
void warm_hello(jbuf *h);

/* One function episode: `config` is RUN's "function" object; the job gets `root`, `cwd` (a
 * string span or empty), the episode's environment `envp` and `seed`. Sends EXIT (with
 * "entry":"function","worker":"warm"|"started"); `timed` files expire meanwhile. */
void warm_run(send_fn send, jspan config, const char *root, jspan cwd, char *const envp[],
              char *const base_envp[], const unsigned char *seed, size_t seedlen,
              double timeout_s, struct timed_file *timed, size_t ntimed);

/* A clone not yet taken (a spare): the worker runs the Python paths of an episode once in its
 * own process (worker.py: rehearse_job, on SIGUSR1), so the child that runs the episode finds
 * them translated. 1 once it said {"warmed":true} within `timeout_s`; 0 if it has no worker
 * ready; -1 if it did not answer in time or broke the message (the worker is then stopped:
 * the next RUN starts one). */
int warm_up(double timeout_s);

/* The image's python3 (NULL if none). */
const char *python_path(void);

/* A Python process of the agent's (the warm worker, gym.c's gym process): `python -I -c` a
 * launcher that puts `dir` first on sys.path and runs `module`.main() with argv [fd, config],
 * fd its end of a new socket pair; in its own session, stdin /dev/null, the base environment
 * `envp`. Its pid (our end in *sock), or -1 with the reason in *why. */
pid_t python_start(const char *python, const char *dir, const char *module, const char *config,
                   char *const envp[], int *sock, const char **why);

/* SIGKILL and reap *pid (when > 0), close *sock (when >= 0); both reset. */
void python_stop(pid_t *pid, int *sock);

/* 0 if [p, p+n) is one worker message body (a JSON object within the size limit). */
int warm_message_ok(const char *p, size_t n);

#endif
