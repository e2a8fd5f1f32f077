/* Packing a folder as a tar stream: see tar.h. As Python's tarfile writes
 * PAX_FORMAT: ustar headers ("ustar\0" "00"), a pax 'x' header before a member whose name or
 * link is longer than its field or not ASCII, or whose size, uid or gid does not fit; folders
 * named with a trailing "/"; two zero blocks, then zeros to a whole record (10240 bytes). The
 * order is os.walk's: in each folder its subfolders, then its files, each sorted by name,
 * then each subfolder in turn (links are stored, never followed). */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "tar.h"

enum {
    BLOCK = 512,
    RECORD = 20 * BLOCK,
    OUT = 256 * 1024, /* protocol.CHUNK: one DATA frame */
    COPY = 64 * 1024,
    MAX_DEPTH = 256, /* folders below the packed one */
};

struct seen {
    dev_t dev;
    ino_t ino;
    char *name;
};

struct pack {
    const struct tar_io *io;
    struct tar_error *e;
    unsigned char *out, *copy;
    size_t n;
    int64_t total;
    struct seen *seen; /* files with more than one link, by their first name */
    size_t nseen, capseen;
};

static int stop(struct pack *p, int code, int err, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    tar_fail(p->e, code, err, fmt, ap);
    va_end(ap);
    return code;
}

static int flush(struct pack *p) {
    if (p->n && !p->io->write(p->io->ctx, p->out, p->n))
        return p->e->code = TAR_STOPPED;
    p->n = 0;
    return TAR_OK;
}

static int put(struct pack *p, const void *data, size_t n) {
    const unsigned char *s = data;
    while (n) {
        size_t k = OUT - p->n < n ? OUT - p->n : n;
        memcpy(p->out + p->n, s, k);
        p->n += k, s += k, n -= k;
        p->total += (int64_t)k;
        if (p->n == OUT && flush(p))
            return TAR_STOPPED;
    }
    return TAR_OK;
}

static int zeros(struct pack *p, size_t n) {
    static const unsigned char z[BLOCK];
    for (size_t k; n; n -= k)
        if (put(p, z, (k = n < BLOCK ? n : BLOCK)))
            return TAR_STOPPED;
    return TAR_OK;
}

static int ascii(const char *s, size_t n) {
    for (size_t i = 0; i < n; i++)
        if ((unsigned char)s[i] >= 0x80)
            return 0;
    return 1;
}

/* "%d %s=%s\n" whose length counts itself, appended to *buf */
static int record(char **buf, size_t *len, const char *key, const char *value, size_t vn) {
    size_t base = strlen(key) + vn + 3, total = base;
    for (size_t digits = 1, was = 0; digits != was;) {
        was = digits;
        total = base + digits;
        digits = (size_t)snprintf(NULL, 0, "%zu", total);
    }
    char *more = realloc(*buf, *len + total + 1);
    if (!more)
        return -1;
    *buf = more;
    int head = snprintf(more + *len, total + 1, "%zu %s=", total, key);
    memcpy(more + *len + head, value, vn);
    more[*len + total - 1] = '\n';
    *len += total;
    return 0;
}

static void octal(unsigned char *field, size_t size, uint64_t v) {
    snprintf((char *)field, size, "%0*llo", (int)size - 1, (unsigned long long)v);
}

/* a ustar header block: name and link cut to their fields, non-ASCII bytes as '?' */
static int block(struct pack *p, const char *name, char type, unsigned mode, uint64_t uid,
                 uint64_t gid, uint64_t size, uint64_t mtime, const char *link) {
    unsigned char b[BLOCK] = {0};
    for (size_t i = 0; name[i] && i < 100; i++)
        b[i] = (unsigned char)name[i] < 0x80 ? (unsigned char)name[i] : '?';
    octal(b + 100, 8, mode);
    octal(b + 108, 8, uid < 07777777 ? uid : 0);
    octal(b + 116, 8, gid < 07777777 ? gid : 0);
    octal(b + 124, 12, size <= 077777777777ULL ? size : 0);
    octal(b + 136, 12, mtime <= 077777777777ULL ? mtime : 0);
    b[156] = (unsigned char)type;
    for (size_t i = 0; link && link[i] && i < 100; i++)
        b[157 + i] = (unsigned char)link[i] < 0x80 ? (unsigned char)link[i] : '?';
    memcpy(b + 257, "ustar\0" "00", 8);
    unsigned sum = 8 * ' ';
    for (size_t i = 0; i < BLOCK; i++)
        sum += i >= 148 && i < 156 ? 0 : b[i];
    snprintf((char *)b + 148, 8, "%06o", sum);
    b[155] = ' ';
    return put(p, b, BLOCK);
}

static int header(struct pack *p, const char *name, char type, const struct stat *st,
                  const char *link, uint64_t size) {
    size_t nn = strlen(name), ln = link ? strlen(link) : 0;
    char *pax = NULL, num[24];
    size_t pn = 0;
    int bad = 0;
    if (nn > 100 || !ascii(name, nn))
        bad |= record(&pax, &pn, "path", name, nn);
    if (ln > 100 || !ascii(link, ln))
        bad |= record(&pax, &pn, "linkpath", link, ln);
    const char *keys[] = {"size", "uid", "gid"};
    uint64_t values[] = {size, st->st_uid, st->st_gid}, limits[] = {077777777777ULL, 07777777,
                                                                    07777777};
    for (int i = 0; i < 3; i++)
        if (values[i] > limits[i])
            bad |= record(&pax, &pn, keys[i], num,
                          (size_t)snprintf(num, sizeof num, "%llu", (unsigned long long)values[i]));
    int rc = bad ? stop(p, TAR_OS, ENOMEM, "out of memory") : TAR_OK;
    if (!rc && pn)
        rc = block(p, "././@PaxHeader", 'x', 0, 0, 0, pn, 0, NULL) || put(p, pax, pn) ||
                     zeros(p, (BLOCK - pn % BLOCK) % BLOCK)
                 ? p->e->code
                 : TAR_OK;
    free(pax);
    uint64_t mtime = st->st_mtim.tv_sec > 0 ? (uint64_t)st->st_mtim.tv_sec : 0;
    return rc ? rc : block(p, name, type, st->st_mode & 07777, st->st_uid, st->st_gid, size,
                           mtime, link);
}

static int file(struct pack *p, int dir, const char *leaf, const char *name,
                const struct stat *st) {
    for (size_t i = 0; st->st_nlink > 1 && i < p->nseen; i++)
        if (p->seen[i].dev == st->st_dev && p->seen[i].ino == st->st_ino)
            return header(p, name, '1', st, p->seen[i].name, 0);
    if (st->st_nlink > 1) {
        if (p->nseen == p->capseen) {
            size_t cap = p->capseen ? 2 * p->capseen : 16;
            struct seen *more = realloc(p->seen, cap * sizeof *more);
            if (!more)
                return stop(p, TAR_OS, ENOMEM, "out of memory");
            p->seen = more, p->capseen = cap;
        }
        char *kept = strdup(name);
        if (!kept)
            return stop(p, TAR_OS, ENOMEM, "out of memory");
        p->seen[p->nseen++] = (struct seen){st->st_dev, st->st_ino, kept};
    }
    int fd = openat(dir, leaf, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0)
        return stop(p, TAR_OS, errno, "%s", name);
    uint64_t left = (uint64_t)st->st_size;
    int rc = header(p, name, '0', st, NULL, left);
    while (!rc && left) {
        ssize_t got = read(fd, p->copy, left < COPY ? (size_t)left : COPY);
        if (got < 0 && errno == EINTR)
            continue;
        if (got <= 0)
            rc = stop(p, TAR_OS, got < 0 ? errno : EIO, "%s", name); /* it shrank */
        else
            rc = put(p, p->copy, (size_t)got), left -= (uint64_t)got;
    }
    close(fd);
    return rc ? rc : zeros(p, (BLOCK - (uint64_t)st->st_size % BLOCK) % BLOCK);
}

static int by_name(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* the entries of `dir` but "." and "..", sorted, folders (links to one too) first */
static char **listing(DIR *dir, size_t *n, size_t *nfolders) {
    char **names = NULL;
    size_t cap = 0;
    *n = *nfolders = 0;
    for (struct dirent *d; (d = readdir(dir));) {
        if (!strcmp(d->d_name, ".") || !strcmp(d->d_name, ".."))
            continue;
        if (*n == cap) {
            char **more = realloc(names, (cap = cap ? 2 * cap : 32) * sizeof *names);
            if (!more)
                break;
            names = more;
        }
        struct stat st;
        int folder = !fstatat(dirfd(dir), d->d_name, &st, 0) && S_ISDIR(st.st_mode);
        size_t len = strlen(d->d_name);
        char *name = malloc(len + 2);
        if (!name)
            break;
        name[0] = folder ? 'd' : 'f'; /* sorts folders first */
        memcpy(name + 1, d->d_name, len + 1);
        names[(*n)++] = name;
        *nfolders += (size_t)folder;
    }
    if (*n)
        qsort(names, *n, sizeof *names, by_name);
    return names;
}

static int walk(struct pack *p, int fd, const char *prefix, int depth) {
    DIR *dir = fdopendir(fd);
    if (!dir) {
        close(fd);
        return TAR_OK; /* os.walk: a folder it cannot list is left out */
    }
    size_t n, nfolders;
    char **names = listing(dir, &n, &nfolders);
    int rc = TAR_OK;
    for (int pass = 0; pass < 2 && !rc; pass++) {
        for (size_t i = 0; i < (pass ? nfolders : n) && !rc; i++) {
            const char *leaf = names[i] + 1; /* pass 0: each entry; 1: into each folder */
            char *name = NULL;
            struct stat st;
            if (asprintf(&name, "%s%s", prefix, leaf) < 0)
                rc = stop(p, TAR_OS, ENOMEM, "out of memory");
            else if (fstatat(dirfd(dir), leaf, &st, AT_SYMLINK_NOFOLLOW))
                ; /* gone meanwhile */
            else if (!pass && S_ISREG(st.st_mode))
                rc = file(p, dirfd(dir), leaf, name, &st);
            else if (!pass && S_ISDIR(st.st_mode)) {
                char *slashed = NULL;
                rc = asprintf(&slashed, "%s/", name) < 0
                         ? stop(p, TAR_OS, ENOMEM, "out of memory")
                         : header(p, slashed, '5', &st, NULL, 0);
                free(slashed);
            } else if (!pass && S_ISLNK(st.st_mode)) {
                char target[4097];
                ssize_t tn = readlinkat(dirfd(dir), leaf, target, sizeof target - 1);
                if (tn < 0)
                    rc = stop(p, TAR_OS, errno, "%s", name);
                else
                    target[tn] = 0, rc = header(p, name, '2', &st, target, 0);
            } else if (pass && S_ISDIR(st.st_mode)) {
                char *below = NULL;
                int sub = depth >= MAX_DEPTH ? -1
                                             : openat(dirfd(dir), leaf,
                                                      O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
                if (depth >= MAX_DEPTH)
                    rc = stop(p, TAR_OS, ELOOP, "%s: folders nested deeper than %d", name,
                              MAX_DEPTH);
                else if (sub >= 0 && asprintf(&below, "%s/", name) < 0)
                    close(sub), rc = stop(p, TAR_OS, ENOMEM, "out of memory");
                else if (sub >= 0)
                    rc = walk(p, sub, below, depth + 1);
                free(below);
            }
            free(name);
        }
    }
    for (size_t i = 0; i < n; i++)
        free(names[i]);
    free(names);
    closedir(dir);
    return rc;
}

int tar_pack(const struct tar_io *io, const char *src, struct tar_error *e) {
    memset(e, 0, sizeof *e);
    struct pack p = {.io = io, .e = e, .out = malloc(OUT), .copy = malloc(COPY)};
    struct stat st;
    int fd = -1, rc;
    if (!p.out || !p.copy)
        rc = stop(&p, TAR_OS, ENOMEM, "out of memory");
    else if (stat(src, &st) || !S_ISDIR(st.st_mode) ||
             (fd = open(src, O_RDONLY | O_DIRECTORY | O_CLOEXEC)) < 0)
        rc = stop(&p, TAR_NOT_FOUND, 0, "no folder '%.4000s'", src);
    else
        rc = walk(&p, fd, "", 0);
    if (!rc)
        rc = zeros(&p, 2 * BLOCK);
    if (!rc)
        rc = zeros(&p, (RECORD - (size_t)(p.total % RECORD)) % RECORD);
    if (!rc)
        rc = flush(&p);
    for (size_t i = 0; i < p.nseen; i++)
        free(p.seen[i].name);
    free(p.seen);
    free(p.out);
    free(p.copy);
    return rc;
}
