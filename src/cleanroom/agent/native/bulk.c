/* The bulk disk: see bulk.h. */
#define _GNU_SOURCE
#include "bulk.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

enum {
    PIECE = 1024 * 1024, /* bytes per disk read or write (the buffer's size) */
    BLOCK = 4096,        /* O_DIRECT's alignment of offsets, lengths and the buffer */
};

static int disk = -1;
static int64_t disk_size;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER; /* the one buffer */
static unsigned char *buffer;                              /* PIECE bytes, BLOCK-aligned */

/* the first line of a small sysfs file into `out` (0), or -1 */
static int read_line(const char *path, char *out, size_t cap) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    ssize_t n = fd >= 0 ? read(fd, out, cap - 1) : -1;
    if (fd >= 0)
        close(fd);
    if (n <= 0)
        return -1;
    out[n] = 0;
    out[strcspn(out, "\n")] = 0;
    return 0;
}

int bulk_open(void) {
    DIR *dir = opendir("/sys/block");
    struct dirent *e;
    while (disk < 0 && dir && (e = readdir(dir))) {
        char path[300], line[64];
        if (strncmp(e->d_name, "vd", 2))
            continue;
        snprintf(path, sizeof path, "/sys/block/%.64s/serial", e->d_name);
        if (read_line(path, line, sizeof line) || strcmp(line, BULK_SERIAL))
            continue;
        snprintf(path, sizeof path, "/sys/block/%.64s/size", e->d_name);
        long long sectors = read_line(path, line, sizeof line) ? 0 : atoll(line);
        snprintf(path, sizeof path, "/dev/%.64s", e->d_name);
        void *p = NULL;
        if (sectors <= 0 || posix_memalign(&p, BLOCK, PIECE))
            continue;
        int fd = open(path, O_RDWR | O_DIRECT | O_CLOEXEC);
        if (fd < 0) {
            free(p);
            continue;
        }
        disk = fd;
        disk_size = (int64_t)sectors * 512 / BLOCK * BLOCK;
        buffer = p;
    }
    if (dir)
        closedir(dir);
    return disk >= 0 ? 0 : -1;
}

int64_t bulk_size(void) { return disk >= 0 ? disk_size : 0; }

static size_t rounded(size_t n) { return (n + BLOCK - 1) / BLOCK * BLOCK; }

/* pread/pwrite all of `n` bytes (0), or an errno (EIO for a short transfer) */
static int whole(int write, int fd, unsigned char *p, size_t n, int64_t at) {
    while (n) {
        ssize_t done = write ? pwrite(fd, p, n, at) : pread(fd, p, n, at);
        if (done < 0 && errno == EINTR)
            continue;
        if (done <= 0)
            return done < 0 ? errno : EIO;
        p += done;
        n -= (size_t)done;
        at += done;
    }
    return 0;
}

int bulk_to_file(int fd, int64_t at, int64_t n) {
    if (disk < 0)
        return ENODEV;
    if (n < 0 || n > disk_size || at < 0)
        return EINVAL;
    int err = 0;
    pthread_mutex_lock(&lock);
    for (int64_t off = 0; off < n && !err; off += PIECE) {
        size_t len = n - off < PIECE ? (size_t)(n - off) : PIECE;
        err = whole(0, disk, buffer, rounded(len), off);
        if (!err)
            err = whole(1, fd, buffer, len, at + off);
    }
    pthread_mutex_unlock(&lock);
    return err;
}

int bulk_from_file(int fd, int64_t at, int64_t max, int64_t *got) {
    *got = 0;
    if (disk < 0)
        return ENODEV;
    if (max < 0 || max > disk_size || at < 0)
        return EINVAL;
    int err = 0, end = 0;
    pthread_mutex_lock(&lock);
    for (int64_t off = 0; off < max && !err && !end; off += PIECE) {
        size_t want = max - off < PIECE ? (size_t)(max - off) : PIECE, len = 0;
        while (len < want) { /* the file's bytes; fewer only at its end */
            ssize_t r = pread(fd, buffer + len, want - len, at + off + (int64_t)len);
            if (r < 0 && errno == EINTR)
                continue;
            if (r < 0)
                err = errno;
            if (r <= 0)
                break;
            len += (size_t)r;
        }
        end = len < want;
        if (!err && len) {
            memset(buffer + len, 0, rounded(len) - len); /* the block's tail: no stale bytes */
            err = whole(1, disk, buffer, rounded(len), off);
        }
        if (!err)
            *got += (int64_t)len;
    }
    pthread_mutex_unlock(&lock);
    return err;
}
