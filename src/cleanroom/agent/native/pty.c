/* ^C on a terminal that signals nobody: see pty.h. */
#include "pty.h"

#include <termios.h>
#include <unistd.h>

int pty_unattached_intr(int master) {
    struct termios t;
    if (tcgetattr(master, &t) != 0)
        return 0x03; /* a terminal it cannot read: ^C, as before it could */
    if (!(t.c_lflag & ISIG) || t.c_cc[VINTR] == _POSIX_VDISABLE)
        return -1; /* raw mode: the program reads ^C as a key */
    if (tcgetpgrp(master) > 0)
        return -1; /* the line discipline delivers it */
    return t.c_cc[VINTR];
}
