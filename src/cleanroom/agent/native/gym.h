/*
 * The gym process (agent/gym_worker.py) seen from the native agent, as gym_worker.Proxy sees
 * it from the Python one: started at boot when the baseline lists its Gymnasium envs in
 * /etc/cleanroom/gym.json and the image has python3, so a snapshot template holds it with
 * its envs made; each GYM_* request (kinds 40-45) is relayed to it over a socket pair as the
 * frame it came as, and its one answer (GYM_SPACES, GYM_OBS or GYM_ERROR: checked for kind
 * and size by frame_read, not decoded: the host decodes it) goes back as it came. A dead or
 * misbehaving gym process is a fatal GYM_ERROR; the agent lives on, and the next request
 * starts a new one.
 */
#ifndef CLEANROOM_GYM_H
#define CLEANROOM_GYM_H

#include "frame.h"
#include "proc.h"

/* At boot: start the gym process if the baseline has a gym config, with the base environment
 * `envp` (kept: a request with no gym process running starts one, as gym_worker.handle does),
 * and wait (READY_S at most) until its imports and premade envs are done. */
void gym_boot(const char *agent_dir, char *const envp[]);

/* Whether the gym process runs or can be started (gym_worker.py beside the agent, python3 in
 * the image): HELLO lists "gym" then. */
int gym_available(void);

/* Whether `kind` is a request the gym process answers (GYM_MAKE .. GYM_CLOSE). */
int gym_request(int kind);

/* Relay one request and send its answer (or a GYM_ERROR) with `send`. */
void gym_handle(send_fn send, const struct frame *f);

#endif
