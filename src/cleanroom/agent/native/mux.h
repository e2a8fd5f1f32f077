/*
 * Multiplexed requests (protocol.py, "mux"): every frame whose header has an "id" is routed
 * here by the reading thread, which never blocks on one. EXEC (a process: STARTED, its
 * STDOUT/STDERR in bounded chunks, EXIT, DONE; stdin fed through a pipe and ACKed; a user;
 * KILL = SIGKILL to its process group; a PTY's ^C sent as SIGINT where the terminal signals
 * nobody: pty.c), UPLOAD and DOWNLOAD (a file in DATA chunks within protocol.WINDOW of the
 * receiver's ACK; with "tar", a folder unpacked or packed: tar.c) each run in a thread of
 * their own, so several run at once; their frames go out whole through the agent's one
 * sender, each tagged with its id. BULK_PUT and BULK_GET move a piece of a file through the
 * bulk disk (bulk.h) where the VM has one. CONNECT relays a TCP connection to a port of the
 * guest (127.0.0.1 only; port.h) both ways as DATA within the window.
 * Anything else with an id is FAILED {code: "unsupported"}; the agent itself goes on.
 */
#ifndef CLEANROOM_MUX_H
#define CLEANROOM_MUX_H

#include <stdint.h>

#include "frame.h"
#include "json.h"
#include "proc.h"

/* What the agent lends: its sender, the base environment of a request (env_of), and a count
 * of running requests (+1 / -1) for its heartbeat and its idle wait. */
struct mux_host {
    send_fn send;
    int (*env_of)(struct env *e, jspan extra);
    void (*activity)(int delta);
};

void mux_init(const struct mux_host *host);

/* What a frame is to mux.c: not its (no id), input for a running request (MUX_LATE: with an
 * id that is no integer, so for none), a new request, or one to refuse (FAILED). */
enum { MUX_NOT, MUX_INPUT, MUX_LATE, MUX_NEW, MUX_REFUSE };
int mux_classify(const struct frame *f, int64_t *id, jspan *idv);

/* 1 if `f` carries an id (it was handled here, and freed or kept), 0 if it is not mux's. */
int mux_route(struct frame *f);

/* The id of the request the calling thread serves (-1: none), for the sender to add. */
int64_t mux_current_id(void);

/* 1 if `pid` is a process of a running request (the orphan reaper leaves it alone). */
int mux_owns(int pid);

/* /etc/passwd and /etc/group in C: the account `name` (a user name or a uid in digits).
 * 0 and its fields (home into `home`, groups into `groups`), or -1 if there is none. Root
 * ("root" or "0") is uid 0, gid 0, home /root even where /etc/passwd lacks it or is absent. */
int mux_lookup_user(const char *name, unsigned *uid, unsigned *gid, char *home, size_t home_cap,
                    char *user, size_t user_cap, unsigned *groups, size_t *ngroups,
                    size_t max_groups);

#endif
