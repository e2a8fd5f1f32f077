/* ^C on a terminal that signals nobody: see pty.h. */
#include "pty.h"

#include <signal.h>
#include <termios.h>
#include <unistd.h>

void pty_interrupt_unattached(int master, int pgid) {
    struct termios t;
    if (tcgetattr(master, &t) == 0) {
        if (!(t.c_lflag & ISIG))
            return; /* raw mode: the program reads ^C as a key */
        if (tcgetpgrp(master) > 0)
            return; /* the line discipline delivered it */
    }
    if (pgid > 0)
        kill(-pgid, SIGINT);
}
