/*
 * What a PTY command needs beyond the terminal itself (mux.c opens that): ^C for a terminal
 * whose line discipline signals nobody. Under gVisor the command's TIOCSCTTY succeeds but a
 * ^C written to the master reaches no foreground process group (it is echoed and read back as
 * a plain byte), so a shell's trap never runs and the command waits forever; so the agent
 * signals the command's process group itself, and does not write the ^C at all: the line
 * discipline, reaching it later, would flush the output the command's handler had already
 * written ("GOT-INT" lost), the race a real terminal avoids by signalling and flushing at once.
 */
#ifndef CLEANROOM_PTY_H
#define CLEANROOM_PTY_H

/* The interrupt character (VINTR) the agent must turn into SIGINT itself for the PTY
 * `master`, or -1 where the kernel does: the program reads ^C as a key (no ISIG) or the
 * terminal has a foreground process group. */
int pty_unattached_intr(int master);

#endif
