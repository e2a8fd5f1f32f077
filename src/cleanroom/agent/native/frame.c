/* Frame reader and encoder: see frame.h. */
#include "frame.h"

#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static uint32_t be32(const unsigned char *p) {
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | (uint32_t)p[3];
}

static void put_be32(unsigned char *p, uint32_t v) {
    p[0] = (unsigned char)(v >> 24);
    p[1] = (unsigned char)(v >> 16);
    p[2] = (unsigned char)(v >> 8);
    p[3] = (unsigned char)v;
}

int frame_prefix(const unsigned char *p, size_t max_body, int *kind, size_t *hlen, size_t *blen,
                 const char **why) {
    if (p[0] != 'C' || p[1] != 'R') {
        *why = "bad magic";
        return -1;
    }
    if ((p[2] < 1 || p[2] > KIND_MAX) && (p[2] < K_GYM_MAKE || p[2] > K_GYM_ERROR)) {
        *why = "unknown frame type";
        return -1;
    }
    uint32_t h = be32(p + 3), b = be32(p + 7);
    if (h > MAX_HEADER) {
        *why = "header too large";
        return -1;
    }
    if (b > max_body) {
        *why = "body too large";
        return -1;
    }
    *kind = p[2];
    *hlen = h;
    *blen = b;
    return 0;
}

/* what is left of a read this large goes straight into its destination, not through r->buf */
enum { DIRECT_READ = 4096 };

/* fill `dst` with exactly n bytes: 0, or FRAME_EOF / FRAME_CLOSED */
static int read_exact(struct reader *r, unsigned char *dst, size_t n, int first) {
    size_t got = 0;
    while (got < n) {
        if (r->start == r->end && n - got >= DIRECT_READ) { /* a body: no copy through buf */
            ssize_t k;
            do
                k = r->read(r->ctx, dst + got, n - got);
            while (k < 0 && errno == EINTR);
            if (k <= 0)
                return first && got == 0 ? FRAME_EOF : FRAME_CLOSED;
            got += (size_t)k;
            continue;
        }
        if (r->start == r->end) {
            ssize_t k;
            do
                k = r->read(r->ctx, r->buf, sizeof r->buf);
            while (k < 0 && errno == EINTR);
            if (k <= 0)
                return first && got == 0 ? FRAME_EOF : FRAME_CLOSED;
            r->start = 0;
            r->end = (size_t)k;
        }
        size_t take = r->end - r->start;
        if (take > n - got)
            take = n - got;
        memcpy(dst + got, r->buf + r->start, take);
        r->start += take;
        got += take;
    }
    return 0;
}

int frame_peek(struct reader *r, size_t n) {
    if (n > sizeof r->buf)
        return FRAME_CLOSED;
    if (r->end - r->start >= n)
        return 0;
    if (r->start) { /* keep what is there at the front: room to read the rest */
        memmove(r->buf, r->buf + r->start, r->end - r->start);
        r->end -= r->start;
        r->start = 0;
    }
    while (r->end < n) {
        ssize_t k;
        do
            k = r->read(r->ctx, r->buf + r->end, sizeof r->buf - r->end);
        while (k < 0 && errno == EINTR);
        if (k <= 0)
            return r->end == 0 ? FRAME_EOF : FRAME_CLOSED;
        r->end += (size_t)k;
    }
    return 0;
}

int frame_read(struct reader *r, struct frame *f, const char **why) {
    unsigned char prefix[PREFIX_LEN];
    memset(f, 0, sizeof *f);
    *why = "";
    int st = read_exact(r, prefix, PREFIX_LEN, 1);
    if (st)
        return st;
    size_t hlen, blen;
    if (frame_prefix(prefix, MAX_BODY, &f->kind, &hlen, &blen, why))
        return FRAME_BAD;
    f->header = malloc(hlen + 3);
    if (!f->header)
        return FRAME_NOMEM;
    st = read_exact(r, (unsigned char *)f->header, hlen, 0);
    if (st)
        goto fail;
    if (hlen == 0) {
        memcpy(f->header, "{}", 2);
        hlen = 2;
    }
    f->header[hlen] = 0;
    f->hlen = hlen;
    if (!utf8_valid((const unsigned char *)f->header, hlen) ||
        json_check_object(f->header, hlen)) {
        *why = "header is not a JSON object";
        st = FRAME_BAD;
        goto fail;
    }
    if (blen) {
        f->body = malloc(blen);
        if (!f->body) {
            st = FRAME_NOMEM;
            goto fail;
        }
        st = read_exact(r, f->body, blen, 0);
        if (st)
            goto fail;
    }
    f->blen = blen;
    return FRAME_OK;
fail:
    frame_free(f);
    return st;
}

void frame_free(struct frame *f) {
    free(f->header);
    free(f->body);
    memset(f, 0, sizeof *f);
}

unsigned char *frame_encode(int kind, const char *header, size_t hlen, const void *body,
                            size_t blen, size_t *total) {
    if (!header) {
        header = "{}";
        hlen = 2;
    }
    unsigned char *out = malloc(PREFIX_LEN + hlen + blen);
    if (!out)
        return NULL;
    out[0] = 'C';
    out[1] = 'R';
    out[2] = (unsigned char)kind;
    put_be32(out + 3, (uint32_t)hlen);
    put_be32(out + 7, (uint32_t)blen);
    memcpy(out + PREFIX_LEN, header, hlen);
    if (blen)
        memcpy(out + PREFIX_LEN + hlen, body, blen);
    *total = PREFIX_LEN + hlen + blen;
    return out;
}

jspan frame_header(const struct frame *f) {
    jspan s = {f->header, f->hlen};
    return s;
}
