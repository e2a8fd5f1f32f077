/*
 * libFuzzer target: the native agent's tar reader (tar.c) over arbitrary bytes, as a tar
 * upload from the host (or whatever reaches it) gives them, in short reads. Every member is
 * named and its link judged as tar_extract does; a name the checks accept must be relative
 * with no empty, "." or ".." component, no NUL, control character or backslash; a link they
 * accept must not climb above the folder; every error message must be valid UTF-8 (the host
 * refuses a frame header that is not, and would break the channel).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "tar.h"

struct mem {
    const uint8_t *p;
    size_t n;
};

static size_t mem_read(void *ctx, unsigned char *buf, size_t cap) {
    struct mem *m = ctx;
    size_t n = cap < m->n ? cap : m->n;
    if (n > 7) /* short reads, as DATA frames give them */
        n = n / 2 + 1;
    memcpy(buf, m->p, n);
    m->p += n;
    m->n -= n;
    return n;
}

/* valid UTF-8, decoded on its own here (not with tar.c's decoder) */
static int utf8(const unsigned char *s, size_t n) {
    for (size_t i = 0; i < n;) {
        unsigned c = s[i];
        size_t len = c < 0x80 ? 1 : c >= 0xc2 && c <= 0xdf ? 2 : c >= 0xe0 && c <= 0xef ? 3
                     : c >= 0xf0 && c <= 0xf4                    ? 4
                                                                 : 0;
        if (!len || i + len > n)
            return 0;
        for (size_t k = 1; k < len; k++)
            if ((s[i + k] & 0xc0) != 0x80)
                return 0;
        if ((c == 0xe0 && s[i + 1] < 0xa0) || (c == 0xed && s[i + 1] >= 0xa0) ||
            (c == 0xf0 && s[i + 1] < 0x90) || (c == 0xf4 && s[i + 1] >= 0x90))
            return 0;
        i += len;
    }
    return 1;
}

static void judged(const struct tar_error *e) {
    if (!utf8((const unsigned char *)e->message, strlen(e->message)))
        abort();
}

static void safe_name(const char *rel, size_t n) {
    if (!n || rel[0] == '/' || memchr(rel, 0, n) || memchr(rel, '\\', n))
        abort();
    for (size_t i = 0; i < n; i++)
        if ((unsigned char)rel[i] < 0x20)
            abort();
    for (size_t start = 0; start <= n;) {
        const char *slash = memchr(rel + start, '/', n - start);
        size_t len = (slash ? (size_t)(slash - rel) : n) - start;
        if (!len || (len == 1 && rel[start] == '.') || (len == 2 && !memcmp(rel + start, "..", 2)))
            abort();
        start += len + 1;
    }
}

/* a link target the checks accept, resolved lexically from its folder: never above the root */
static void link_stays(const char *rel, const char *target, size_t n) {
    long depth = 0;
    for (const char *p = rel; *p; p++)
        depth += *p == '/';
    if (!n || target[0] == '/')
        abort();
    for (size_t i = 0; i < n;) {
        size_t j = i;
        while (j < n && target[j] != '/')
            j++;
        if (j - i == 2 && target[i] == '.' && target[i + 1] == '.')
            depth--;
        else if (j > i && !(j - i == 1 && target[i] == '.'))
            depth++;
        if (depth < 0)
            abort();
        i = j + 1;
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    struct mem m = {data, size};
    struct tar_io io = {.ctx = &m, .read = mem_read};
    struct tar_reader r = {.io = &io};
    struct tar_error e = {0};
    unsigned char buf[700];
    int rc;
    for (int n = 0; n < 64 && (rc = tar_next(&r, &e)) > 0; n++) {
        const char *rel;
        size_t rn;
        struct tar_error named = {0};
        int ok = tar_member_name(r.m.name, r.m.name_n, &rel, &rn, &named);
        if (ok < 0)
            judged(&named);
        if (ok > 0) {
            safe_name(rel, rn);
            char *copy = strndup(rel, rn);
            if (copy && r.m.type == '2' && tar_link_inside(copy, r.m.link, r.m.link_n))
                link_stays(copy, r.m.link, r.m.link_n);
            free(copy);
        }
        ssize_t got;
        while ((got = tar_data(&r, buf, sizeof buf, &e)) > 0)
            ;
        if (got < 0) {
            judged(&e);
            break;
        }
    }
    if (rc < 0)
        judged(&e);
    tar_reader_free(&r);
    return 0;
}
