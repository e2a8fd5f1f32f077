/* Reading and unpacking tar streams safely: see tar.h. Member by member, as Python's tarfile
 * reads a stream ("r|"): ustar and v7 headers (a ustar prefix joined), pax extended ('x')
 * and global ('g') headers, GNU long names ('L', 'K'); the first header of a chain wins. */
#define _GNU_SOURCE
#include "tar.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

enum {
    BLOCK = 512,
    MAX_HEADER = 1 << 20, /* bytes of a pax or GNU long-name header's data */
    MAX_NAME = 1024,      /* protocol.MAX_NAME */
    MAX_NAME_PART = 255,  /* protocol.MAX_NAME_PART */
    MAX_NAME_PARTS = 32,  /* protocol.MAX_NAME_PARTS */
    SHOWN = 200,          /* bytes of a name shown in a message */
    COPY = 64 * 1024,
};
#define DIR_FLAGS (O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC)

static long next_char(const unsigned char *p, size_t n, size_t *i);

void tar_clean_text(char *s) {
    size_t n = strlen(s);
    for (size_t i = 0; i < n;) {
        size_t at = i;
        if (next_char((const unsigned char *)s, n, &i) < 0) {
            s[at] = '?';
            i = at + 1;
        }
    }
}

void tar_fail(struct tar_error *e, int code, int err, const char *fmt, va_list ap) {
    e->code = code;
    e->err = err;
    vsnprintf(e->message, sizeof e->message, fmt, ap);
    tar_clean_text(e->message);
}

static int fail(struct tar_error *e, int code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    tar_fail(e, code, 0, fmt, ap);
    va_end(ap);
    return code;
}

const char *tar_code(int code) {
    return code == TAR_UNSAFE      ? "unsafe_path"
           : code == TAR_BAD       ? "bad_archive"
           : code == TAR_NOT_FOUND ? "not_found"
                                   : "os_error";
}

/* -- names (names.problem; member names, link targets) ---------------------- */

/* the code point at p[*i] (strict UTF-8: no overlong form, no surrogate), or -1 */
static long next_char(const unsigned char *p, size_t n, size_t *i) {
    unsigned c = p[*i];
    size_t len = c < 0x80 ? 1 : (c & 0xe0) == 0xc0 ? 2 : (c & 0xf0) == 0xe0 ? 3
                          : (c & 0xf8) == 0xf0 ? 4 : 0; /* fmt: the UTF-8 lead byte */
    if (!len || *i + len > n)
        return -1;
    long cp = len == 1 ? (long)c : (long)(c & (0x7f >> len));
    for (size_t k = 1; k < len; k++) {
        if ((p[*i + k] & 0xc0) != 0x80)
            return -1;
        cp = cp << 6 | (p[*i + k] & 0x3f);
    }
    static const long least[] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < least[len] || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff))
        return -1;
    *i += len;
    return cp;
}

/* names.bad_char over every character (invalid UTF-8: a lone surrogate to Python) */
static int has_bad_char(const char *s, size_t n) {
    for (size_t i = 0; i < n;) {
        long c = next_char((const unsigned char *)s, n, &i);
        if (c < 0x20 || (c >= 0x7f && c <= 0x9f) || c == '\\')
            return 1;
    }
    return 0;
}

const char *tar_name_problem(const char *name, size_t n) {
    if (!n)
        return "is not a non-empty string";
    if (has_bad_char(name, n))
        return "has a control character, backslash or lone surrogate";
    if (n > MAX_NAME)
        return "is more than 1024 bytes";
    if (name[0] == '/')
        return "escapes its folder";
    size_t parts = 0;
    for (size_t start = 0; start <= n; parts++) {
        const char *slash = memchr(name + start, '/', n - start);
        size_t len = (slash ? (size_t)(slash - name) : n) - start;
        const char *part = name + start;
        if (!len || (len == 1 && part[0] == '.') || (len == 2 && !memcmp(part, "..", 2)))
            return "escapes its folder";
        if (len > MAX_NAME_PART)
            return "has a component longer than 255 bytes";
        start += len + 1;
    }
    return parts > MAX_NAME_PARTS ? "has more than 32 components" : NULL;
}

int tar_member_name(const char *name, size_t n, const char **rel, size_t *rn,
                    struct tar_error *e) {
    while (n >= 2 && name[0] == '.' && name[1] == '/')
        name += 2, n -= 2;
    if (!(n == 1 && name[0] == '/'))
        while (n && name[n - 1] == '/')
            n--;
    if (!n || (n == 1 && name[0] == '.'))
        return 0;
    const char *why = tar_name_problem(name, n);
    if (why) {
        fail(e, TAR_UNSAFE, "tar member '%.*s' %s", (int)(n < SHOWN ? n : SHOWN), name, why);
        return -1;
    }
    *rel = name;
    *rn = n;
    return 1;
}

int tar_link_inside(const char *rel, const char *target, size_t n) {
    if (!n || target[0] == '/' || has_bad_char(target, n))
        return 0;
    long depth = 0; /* the folders above the link, inside the root */
    for (const char *p = rel; (p = strchr(p, '/')); p++)
        depth++;
    for (size_t start = 0; start <= n;) {
        const char *slash = memchr(target + start, '/', n - start);
        size_t len = (slash ? (size_t)(slash - target) : n) - start;
        const char *part = target + start;
        if (len == 2 && !memcmp(part, "..", 2)) {
            if (--depth < 0)
                return 0;
        } else if (len && !(len == 1 && part[0] == '.')) {
            depth++;
        }
        start += len + 1;
    }
    return 1;
}

/* -- the reader ---------------------------------------------------------------------------- */

static size_t read_full(struct tar_reader *r, unsigned char *p, size_t n) {
    size_t got = 0;
    while (got < n) {
        size_t k = r->io->read(r->io->ctx, p + got, n - got);
        if (!k)
            break;
        got += k;
    }
    r->offset += (int64_t)got;
    return got;
}

/* a numeric field (tarfile.nti): octal text, or base-256 with its first byte 0x80 */
static int number(const unsigned char *p, size_t n, int64_t *out) {
    uint64_t v = 0;
    if (p[0] == 0x80) {
        for (size_t i = 1; i < n; i++) {
            if (v >> 55)
                return -1;
            v = v << 8 | p[i];
        }
    } else {
        size_t i = 0, end = strnlen((const char *)p, n);
        while (i < end && p[i] == ' ')
            i++;
        for (; i < end && p[i] >= '0' && p[i] <= '7'; i++) {
            if (v >> 60)
                return -1;
            v = v << 3 | (uint64_t)(p[i] - '0');
        }
        while (i < end && p[i] == ' ')
            i++;
        if (i != end)
            return -1;
    }
    if (v > INT64_MAX / 2)
        return -1;
    *out = (int64_t)v;
    return 0;
}

static int checksum_ok(const unsigned char *b) {
    int64_t want;
    if (number(b + 148, 8, &want))
        return 0;
    int64_t u = 0, s = 0;
    for (size_t i = 0; i < BLOCK; i++) {
        unsigned char c = i >= 148 && i < 156 ? ' ' : b[i];
        u += c;
        s += (signed char)c;
    }
    return want == u || want == s;
}

/* a copy of n bytes, NUL-terminated; the old one freed */
static int keep(char **dst, size_t *dn, const void *p, size_t n) {
    char *s = malloc(n + 1);
    if (!s)
        return -1;
    memcpy(s, p, n);
    s[n] = 0;
    free(*dst);
    *dst = s;
    *dn = n;
    return 0;
}

struct pending { /* what extension headers set for the next member (NULL: nothing) */
    char *path, *link;
    size_t path_n, link_n;
    int64_t size;
    int has_size, any;
};

static int pax_records(struct tar_reader *r, const unsigned char *b, size_t n, int global,
                       struct pending *p, struct tar_error *e) {
    for (size_t pos = 0; pos < n && b[pos] >= '0' && b[pos] <= '9';) {
        size_t len = 0, i = pos;
        while (i < n && b[i] >= '0' && b[i] <= '9' && len < MAX_HEADER)
            len = len * 10 + (size_t)(b[i++] - '0');
        const unsigned char *eq = i < n && b[i] == ' ' ? memchr(b + i, '=', n - i) : NULL;
        if (!len || !eq || len > n - pos || b[pos + len - 1] != '\n' ||
            eq >= b + pos + len - 1 || eq == b + i + 1)
            return fail(e, TAR_BAD, "not a tar archive: a bad pax record");
        const char *key = (const char *)b + i + 1, *value = (const char *)eq + 1;
        size_t key_n = (size_t)((const char *)eq - key);
        size_t value_n = (size_t)((const char *)b + pos + len - 1 - value);
        int rc = 0;
#define KEY(k) (key_n == sizeof k - 1 && !memcmp(key, k, key_n))
        if (KEY("path") && global)
            rc = keep(&r->global_path, &r->global_path_n, value, value_n);
        else if (KEY("linkpath") && global)
            rc = keep(&r->global_link, &r->global_link_n, value, value_n);
        else if (KEY("path") && !p->path)
            rc = keep(&p->path, &p->path_n, value, value_n);
        else if (KEY("linkpath") && !p->link)
            rc = keep(&p->link, &p->link_n, value, value_n);
        else if (KEY("size") && !global && !p->has_size) {
            char digits[24];
            int64_t size = -1;
            if (value_n && value_n < sizeof digits && strspn(value, "0123456789") >= value_n) {
                memcpy(digits, value, value_n);
                digits[value_n] = 0;
                size = strtoll(digits, NULL, 10);
            }
            if (size < 0 || size > INT64_MAX / 2)
                return fail(e, TAR_BAD, "not a tar archive: a bad pax size");
            p->size = size;
            p->has_size = 1;
        } else if (key_n > 11 && !memcmp(key, "GNU.sparse.", 11)) {
            return fail(e, TAR_BAD, "a sparse file (not served by the native agent)");
        }
#undef KEY
        if (rc)
            return fail(e, TAR_BAD, "out of memory");
        pos += len;
    }
    return 0;
}

/* an extension header's data, whole (at most MAX_HEADER bytes); NULL with `e` if it is not */
static unsigned char *ext_data(struct tar_reader *r, int64_t size, struct tar_error *e) {
    size_t padded = ((size_t)size + BLOCK - 1) / BLOCK * BLOCK;
    unsigned char *b = size <= MAX_HEADER ? malloc(padded + 1) : NULL;
    if (!b) {
        fail(e, TAR_BAD, "not a tar archive: a header of %lld bytes", (long long)size);
        return NULL;
    }
    if (read_full(r, b, padded) != padded) {
        free(b);
        fail(e, TAR_BAD, "not a tar archive: unexpected end of data");
        return NULL;
    }
    b[size] = 0;
    return b;
}

static int regular(char type) { return type == '0' || type == 0 || type == '7'; }

/* a type tarfile knows (its data is skipped only for regular files and unknown types) */
static int known(char type) { return type && strchr("01234567LKS", type); }

int tar_next(struct tar_reader *r, struct tar_error *e) {
    unsigned char b[BLOCK], skip[4096];
    while (r->left > 0) { /* the rest of the last member's data and its padding */
        size_t n = r->left < (int64_t)sizeof skip ? (size_t)r->left : sizeof skip;
        size_t got = read_full(r, skip, n);
        r->left -= (int64_t)got;
        if (got < n) { /* truncated: tarfile finds no next header, the end */
            r->ended = 1;
            r->left = 0;
        }
    }
    struct pending p = {0};
    int rc = 0;
    while (!r->ended) {
        int64_t at = r->offset;
        size_t got = read_full(r, b, BLOCK);
        size_t zeros = 0;
        while (zeros < got && !b[zeros])
            zeros++;
        int64_t mode = 0, size = 0, ignored;
        int valid = got == BLOCK && zeros < BLOCK && checksum_ok(b) && !number(b + 100, 8, &mode) &&
                    !number(b + 108, 8, &ignored) && !number(b + 116, 8, &ignored) &&
                    !number(b + 124, 12, &size) && !number(b + 136, 12, &ignored);
        if (!valid) { /* the end; corrupt after an extension header, or as the first header */
            r->ended = 1;
            int eof = got == BLOCK && zeros == BLOCK;
            int packed = at == 0 && got >= 3 && (!memcmp(b, "\x1f\x8b", 2) ||
                                                 !memcmp(b, "BZh", 3) || !memcmp(b, "\xfd" "7zXZ", 5));
            if (p.any || (at == 0 && !eof))
                rc = -1, fail(e, TAR_BAD, "not a tar archive: %s",
                              packed ? "compressed (the native agent reads plain tar only)"
                              : eof  ? "its end after an extension header"
                              : !got ? "empty file"
                              : got < BLOCK ? "truncated header" : "invalid header");
            break;
        }
        char type = (char)b[156];
        if (type == 'x' || type == 'X' || type == 'g' || type == 'L' || type == 'K') {
            unsigned char *data = ext_data(r, size, e);
            if (!data) {
                rc = -1;
                break;
            }
            int bad = 0;
            if (type == 'L' && !p.path)
                bad = keep(&p.path, &p.path_n, data, strlen((char *)data));
            else if (type == 'K' && !p.link)
                bad = keep(&p.link, &p.link_n, data, strlen((char *)data));
            else if (type != 'L' && type != 'K')
                bad = pax_records(r, data, (size_t)size, type == 'g', &p, e) ? 2 : 0;
            free(data);
            if (bad) {
                if (bad == 1)
                    fail(e, TAR_BAD, "out of memory");
                r->ended = 1;
                rc = -1;
                break;
            }
            p.any = 1;
            continue;
        }
        struct tar_member *m = &r->m;
        size_t name_n = strnlen((char *)b, 100), prefix_n = strnlen((char *)b + 345, 155);
        char joined[100 + 1 + 155];
        size_t j = 0;
        if (prefix_n && type != 'S') {
            memcpy(joined, b + 345, prefix_n);
            joined[prefix_n] = '/';
            j = prefix_n + 1;
        }
        memcpy(joined + j, b, name_n);
        if (type == 0 && name_n && b[name_n - 1] == '/')
            type = '5';
        if (p.path ? keep(&m->name, &m->name_n, p.path, p.path_n)
            : r->global_path ? keep(&m->name, &m->name_n, r->global_path, r->global_path_n)
                             : keep(&m->name, &m->name_n, joined, j + name_n)) {
            rc = -1, fail(e, TAR_BAD, "out of memory");
            break;
        }
        size_t link_n = strnlen((char *)b + 157, 100);
        if (p.link ? keep(&m->link, &m->link_n, p.link, p.link_n)
            : r->global_link ? keep(&m->link, &m->link_n, r->global_link, r->global_link_n)
                             : keep(&m->link, &m->link_n, b + 157, link_n)) {
            rc = -1, fail(e, TAR_BAD, "out of memory");
            break;
        }
        m->type = type;
        m->mode = (unsigned)(mode & 07777);
        m->size = p.has_size ? p.size : size;
        r->left = regular(type) || !known(type) ? (m->size + BLOCK - 1) / BLOCK * BLOCK : 0;
        rc = 1;
        break;
    }
    free(p.path);
    free(p.link);
    return rc;
}

ssize_t tar_data(struct tar_reader *r, unsigned char *buf, size_t cap, struct tar_error *e) {
    int64_t pad = (BLOCK - r->m.size % BLOCK) % BLOCK, data = r->left - pad;
    if (data <= 0)
        return 0;
    size_t n = data < (int64_t)cap ? (size_t)data : cap;
    size_t got = r->io->read(r->io->ctx, buf, n);
    r->offset += (int64_t)got;
    r->left -= (int64_t)got;
    if (!got) {
        r->ended = 1;
        r->left = 0;
        return fail(e, TAR_BAD, "not a tar archive: unexpected end of data"), -1;
    }
    return (ssize_t)got;
}

void tar_reader_free(struct tar_reader *r) {
    free(r->global_path);
    free(r->global_link);
    free(r->m.name);
    free(r->m.link);
    memset(r, 0, sizeof *r);
}

/* -- unpacking ----------------------------------------------------------- */

static int os_fail(struct tar_error *e, const char *rel, int err) {
    fail(e, TAR_BAD, "tar member '%.*s': %s", SHOWN, rel, strerror(err));
    e->err = err;
    return TAR_BAD;
}

/* The folder holding `rel` (opened, no link followed; closed by the caller unless it is
 * `root`) into *parent, its last component into *leaf. */
static int walk(int root, const char *rel, int create, int *parent, const char **leaf,
                struct tar_error *e) {
    int fd = root;
    const char *p = rel;
    for (const char *slash; (slash = strchr(p, '/')); p = slash + 1) {
        char part[MAX_NAME_PART + 1];
        size_t n = (size_t)(slash - p);
        if (n > MAX_NAME_PART)
            n = MAX_NAME_PART; /* never: the name passed tar_name_problem */
        memcpy(part, p, n);
        part[n] = 0;
        int made = create ? mkdirat(fd, part, 0755) : 0, err = errno;
        int child = made && err != EEXIST ? -1 : openat(fd, part, DIR_FLAGS);
        if (child < 0) {
            if (fd != root)
                close(fd);
            if (made && err != EEXIST)
                return os_fail(e, rel, err);
            return fail(e, TAR_UNSAFE, "tar member '%.*s': '%s' is not a folder", SHOWN, rel,
                        part);
        }
        if (fd != root)
            close(fd);
        fd = child;
    }
    *parent = fd;
    *leaf = p;
    return TAR_OK;
}

/* make room for a new file or link named `leaf` (never removing a folder) */
static int replace(int parent, const char *leaf, const char *rel, struct tar_error *e) {
    struct stat st;
    if (fstatat(parent, leaf, &st, AT_SYMLINK_NOFOLLOW))
        return errno == ENOENT ? TAR_OK : os_fail(e, rel, errno);
    if (S_ISDIR(st.st_mode))
        return fail(e, TAR_UNSAFE, "tar member '%.*s' would replace a folder", SHOWN, rel);
    return unlinkat(parent, leaf, 0) ? os_fail(e, rel, errno) : TAR_OK;
}

static int write_file(struct tar_reader *r, int parent, const char *leaf, const char *rel,
                      struct tar_error *e) {
    int rc = replace(parent, leaf, rel, e);
    if (rc)
        return rc;
    int fd = openat(parent, leaf, O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0)
        return os_fail(e, rel, errno);
    unsigned char *buf = malloc(COPY);
    ssize_t got = buf ? 1 : -1;
    while (!rc && buf && (got = tar_data(r, buf, COPY, e)) > 0) {
        for (ssize_t off = 0; off < got && !rc;) {
            ssize_t w = write(fd, buf + off, (size_t)(got - off));
            if (w > 0)
                off += w;
            else if (!(w < 0 && errno == EINTR))
                rc = os_fail(e, rel, w < 0 ? errno : EIO);
        }
    }
    if (!rc && got < 0)
        rc = buf ? TAR_BAD : os_fail(e, rel, ENOMEM);
    if (!rc && fchmod(fd, r->m.mode & 0777))
        rc = os_fail(e, rel, errno);
    free(buf);
    close(fd);
    return rc;
}

static int member(struct tar_reader *r, int root, const char *rel, struct tar_error *e) {
    const struct tar_member *m = &r->m;
    char type = regular(m->type) ? '0' : m->type;
    if (type == 'S')
        return fail(e, TAR_BAD, "tar member '%.*s' is a sparse file (not served here)", SHOWN,
                    rel);
    if (type != '0' && type != '5' && type != '2' && type != '1')
        return fail(e, TAR_UNSAFE, "tar member '%.*s' is a device node, FIFO or special file",
                    SHOWN, rel);
    int parent;
    const char *leaf;
    int rc = walk(root, rel, 1, &parent, &leaf, e);
    if (rc)
        return rc;
    if (type == '5') {
        if (mkdirat(parent, leaf, (m->mode & 0777) | 0700)) {
            int fd = errno == EEXIST ? openat(parent, leaf, DIR_FLAGS) : -1; /* not a link */
            rc = fd < 0 ? os_fail(e, rel, errno) : TAR_OK;
            if (fd >= 0)
                close(fd);
        }
    } else if (type == '0') {
        rc = write_file(r, parent, leaf, rel, e);
    } else if (type == '2') {
        if (!tar_link_inside(rel, m->link, m->link_n))
            rc = fail(e, TAR_UNSAFE, "tar link '%.*s' points outside: '%.*s'", SHOWN, rel,
                      SHOWN, m->link);
        else if (!(rc = replace(parent, leaf, rel, e)) && symlinkat(m->link, parent, leaf))
            rc = os_fail(e, rel, errno);
    } else {
        const char *target;
        size_t tn;
        int named = tar_member_name(m->link, m->link_n, &target, &tn, e);
        char *copy = named > 0 ? strndup(target, tn) : NULL;
        int source = -1;
        const char *source_leaf;
        if (named == 0)
            rc = fail(e, TAR_UNSAFE, "tar hard link '%.*s' names the folder itself", SHOWN, rel);
        else if (named < 0)
            rc = TAR_UNSAFE;
        else if (!copy)
            rc = os_fail(e, rel, ENOMEM);
        else if (!(rc = walk(root, copy, 0, &source, &source_leaf, e)) &&
                 !(rc = replace(parent, leaf, rel, e)) &&
                 linkat(source, source_leaf, parent, leaf, 0))
            rc = os_fail(e, rel, errno);
        if (source >= 0 && source != root)
            close(source);
        free(copy);
    }
    if (parent != root)
        close(parent);
    return rc;
}

static int make_folder(const char *dest, struct tar_error *e) {
    char path[4096];
    size_t n = strlen(dest);
    if (n >= sizeof path)
        return fail(e, TAR_OS, "a folder name of %zu bytes", n);
    memcpy(path, dest, n + 1);
    for (size_t i = 1; i <= n; i++) {
        if (path[i] != '/' && path[i])
            continue;
        char c = path[i];
        path[i] = 0;
        if (mkdir(path, 0755) && errno != EEXIST) {
            int err = errno;
            fail(e, TAR_OS, "%.4000s", path);
            e->err = err;
            return TAR_OS;
        }
        path[i] = c;
    }
    return TAR_OK;
}

int tar_extract(const struct tar_io *io, const char *dest, struct tar_error *e) {
    memset(e, 0, sizeof *e);
    int rc = make_folder(dest, e);
    int root = rc ? -1 : open(dest, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (!rc && root < 0) {
        int err = errno;
        fail(e, TAR_OS, "%.4000s", dest);
        e->err = err;
        return TAR_OS;
    }
    if (rc)
        return rc;
    struct tar_reader r = {.io = io};
    int more = 0;
    while (!rc && (more = tar_next(&r, e)) > 0) {
        const char *rel;
        size_t rn;
        int named = tar_member_name(r.m.name, r.m.name_n, &rel, &rn, e);
        char *copy = named > 0 ? strndup(rel, rn) : NULL;
        rc = named < 0 ? TAR_UNSAFE : named && !copy ? os_fail(e, "", ENOMEM) : TAR_OK;
        if (copy && !rc)
            rc = member(&r, root, copy, e);
        free(copy);
    }
    if (!rc && more < 0)
        rc = e->code;
    tar_reader_free(&r);
    close(root);
    unsigned char rest[4096];
    while (!rc && io->read(io->ctx, rest, sizeof rest)) /* whatever follows the archive */
        ;
    return rc;
}
