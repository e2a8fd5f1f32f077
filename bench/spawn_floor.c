/* The guest's floor for one command (bench/session.py): argv[1] times posix_spawn (glibc: a
 * clone with CLONE_VM | CLONE_VFORK, as the agent's own spawn) + waitpid of argv[2] from this
 * smallest static parent, then the mean in microseconds on stdout. No agent, no channel: what
 * the guest kernel and the program's own loader cost under the accelerator. */
#define _GNU_SOURCE
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

extern char **environ;

int main(int argc, char **argv) {
    if (argc < 3)
        return 2;
    int n = atoi(argv[1]);
    char *child[] = {argv[2], NULL};
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    for (int i = 0; i < n; i++) {
        pid_t pid;
        int status;
        if (posix_spawn(&pid, argv[2], NULL, NULL, child, environ) ||
            waitpid(pid, &status, 0) != pid || status != 0)
            return 1;
    }
    clock_gettime(CLOCK_MONOTONIC, &b);
    double us = ((double)(b.tv_sec - a.tv_sec) * 1e9 + (double)(b.tv_nsec - a.tv_nsec)) / 1e3;
    printf("%.1f\n", us / (n > 0 ? n : 1));
    return 0;
}
