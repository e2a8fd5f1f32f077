/*
 * cleanroom-runas: run a command as the image config's User, whatever the image's libc.
 *
 *   runas UID GID GROUPS GUEST_ROOT -- COMMAND [ARG...]
 *
 * GROUPS: the supplementary gids, comma-separated ("-" for none). GUEST_ROOT: the episode's
 * /run/cleanroom ("-" to leave it alone). The builder resolved the user from the image's
 * /etc/passwd and /etc/group; this helper only applies numbers. Started by the guest agent (as
 * root), it hands GUEST_ROOT, its out/ and its secrets (never through a symlink) to UID:GID, so
 * the command can write result.json and artifacts and read its secrets as that user, then drops
 * the supplementary groups, gid and uid (checked: a uid that stays 0 is an error) and execs
 * COMMAND (searched on PATH). Exit 126: the drop failed; 127: the command was not found.
 * Static, so it runs in a busybox, musl or distroless image.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

enum { MAX_GROUPS = 64 };

static int number(const char *text, unsigned long *out) {
    char *end;
    errno = 0;
    unsigned long value = strtoul(text, &end, 10);
    if (errno || end == text || *end || value > 0xfffffffeUL || text[0] == '-')
        return -1;
    *out = value;
    return 0;
}

static void hand_over(const char *path, uid_t uid, gid_t gid) {
    int fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_DIRECTORY);
    if (fd < 0)
        return; /* not there (a session before any RUN): nothing to hand over */
    if (fchown(fd, uid, gid) != 0)
        fprintf(stderr, "runas: chown %s: %s\n", path, strerror(errno));
    close(fd);
}

static void hand_over_secrets(const char *root, uid_t uid, gid_t gid) {
    char path[PATH_MAX];
    snprintf(path, sizeof path, "%s/secrets", root);
    hand_over(path, uid, gid);
    int dir = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_DIRECTORY);
    if (dir < 0)
        return;
    DIR *d = fdopendir(dir);
    if (!d) {
        close(dir);
        return;
    }
    struct dirent *e;
    while ((e = readdir(d)))
        if (e->d_name[0] != '.')
            fchownat(dir, e->d_name, uid, gid, AT_SYMLINK_NOFOLLOW);
    closedir(d);
}

int main(int argc, char **argv) {
    if (argc < 7 || strcmp(argv[5], "--") != 0) {
        fprintf(stderr, "usage: runas UID GID GROUPS GUEST_ROOT -- COMMAND [ARG...]\n");
        return 126;
    }
    unsigned long uid, gid, g;
    gid_t groups[MAX_GROUPS];
    size_t ngroups = 0;
    if (number(argv[1], &uid) || number(argv[2], &gid)) {
        fprintf(stderr, "runas: bad uid/gid %s:%s\n", argv[1], argv[2]);
        return 126;
    }
    if (strcmp(argv[3], "-") != 0) {
        char *list = strdup(argv[3]), *save = NULL;
        for (char *item = strtok_r(list, ",", &save); item; item = strtok_r(NULL, ",", &save)) {
            if (ngroups == MAX_GROUPS || number(item, &g)) {
                fprintf(stderr, "runas: bad group list %s\n", argv[3]);
                return 126;
            }
            groups[ngroups++] = (gid_t)g;
        }
        free(list);
    }
    if (strcmp(argv[4], "-") != 0) {
        char out[PATH_MAX];
        hand_over(argv[4], (uid_t)uid, (gid_t)gid);
        snprintf(out, sizeof out, "%s/out", argv[4]);
        hand_over(out, (uid_t)uid, (gid_t)gid);
        hand_over_secrets(argv[4], (uid_t)uid, (gid_t)gid);
    }
    if (setgroups(ngroups, groups) != 0 || setgid((gid_t)gid) != 0 || setuid((uid_t)uid) != 0) {
        fprintf(stderr, "runas: cannot become %lu:%lu: %s\n", uid, gid, strerror(errno));
        return 126;
    }
    if (getuid() != (uid_t)uid || geteuid() != (uid_t)uid || getegid() != (gid_t)gid ||
        (uid != 0 && setuid(0) == 0)) {
        fprintf(stderr, "runas: the drop to %lu:%lu did not hold\n", uid, gid);
        return 126;
    }
    execvp(argv[6], argv + 6);
    fprintf(stderr, "runas: %s: %s\n", argv[6], strerror(errno));
    return errno == ENOENT ? 127 : 126;
}
