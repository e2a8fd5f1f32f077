/*
 * What a PTY command needs beyond the terminal itself (mux.c opens that): ^C for a terminal
 * whose line discipline signals nobody. Under gVisor the command's TIOCSCTTY succeeds but a
 * ^C written to the master reaches no foreground process group (it is echoed and read back as
 * a plain byte), so a shell's trap never runs and the command waits forever; so the agent
 * signals the command's process group itself.
 */
#ifndef CLEANROOM_PTY_H
#define CLEANROOM_PTY_H

/* ^C was written to the PTY `master` of the process group `pgid`: SIGINT to that group as
 * ISIG would have sent it, unless the program reads ^C as a key (no ISIG) or the terminal has
 * a foreground process group (the kernel delivered it). */
void pty_interrupt_unattached(int master, int pgid);

#endif
