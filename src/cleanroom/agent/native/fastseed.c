/* A clone's RESEED on a path of its own: see fastseed.h (it absorbed reseed.c). */
#define _GNU_SOURCE
#include "fastseed.h"

#include <errno.h>
#include <linux/random.h>
#include <stdint.h>
#include <string.h>
#include <sys/ioctl.h>
#include <time.h>
#include <unistd.h>

enum {
    MAX_FAST_HEADER = 512, /* the host's RESEED header is ~70 bytes */
    MAX_FAST_BODY = 1024,  /* its entropy: 64 bytes */
    OUT_CAP = 8192,
};

static char prefix[OUT_CAP / 2];
static size_t prefix_len;
static unsigned char out[OUT_CAP];
static struct {
    struct rand_pool_info info;
    unsigned char buf[MAX_FAST_BODY];
} pool_info;

int fastseed_prepare(const char *p, size_t n) {
    if (n >= sizeof prefix)
        return -1;
    memcpy(prefix, p, n);
    prefix_len = n;
    return 0;
}

static uint32_t be32(const unsigned char *p) {
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | (uint32_t)p[3];
}

static int plain(unsigned char c) { return c >= 0x20 && c < 0x7f && c != '"' && c != '\\'; }

static int id_char(unsigned char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
           c == '-' || c == '_' || c == '.';
}

int fastseed_parse(const unsigned char *p, size_t n, struct fastseed_header *s) {
    size_t i = 0;
    memset(s, 0, sizeof *s);
#define WS()                                                                                       \
    while (i < n && (p[i] == ' ' || p[i] == '\t' || p[i] == '\n' || p[i] == '\r'))             \
    i++
    WS();
    if (i >= n || p[i++] != '{')
        return 0;
    WS();
    if (i < n && p[i] == '}')
        return 0; /* no clone_id */
    for (;;) {
        WS();
        if (i >= n || p[i++] != '"')
            return 0;
        size_t k0 = i;
        while (i < n && plain(p[i]))
            i++;
        if (i >= n || p[i] != '"')
            return 0;
        size_t klen = i++ - k0;
        WS();
        if (i >= n || p[i++] != ':')
            return 0;
        WS();
        int is_id = klen == 8 && !memcmp(p + k0, "clone_id", 8);
        int is_time = klen == 7 && !memcmp(p + k0, "time_ns", 7);
        if (i < n && p[i] == '"') {
            size_t v0 = ++i;
            while (i < n && plain(p[i]))
                i++;
            if (i >= n || p[i] != '"')
                return 0;
            size_t vlen = i++ - v0;
            if (is_id) {
                if (vlen == 0 || vlen > FAST_MAX_ID)
                    return 0;
                for (size_t j = 0; j < vlen; j++)
                    if (!id_char(p[v0 + j]))
                        return 0;
                memcpy(s->id, p + v0, vlen);
                s->id[vlen] = 0;
                s->has_id = 1;
            } else if (is_time) {
                return 0;
            }
        } else {
            int neg = i < n && p[i] == '-';
            i += (size_t)neg;
            size_t d0 = i;
            uint64_t v = 0;
            while (i < n && p[i] >= '0' && p[i] <= '9' && i - d0 < 19) /* time_ns: 19 */
                v = v * 10 + (uint64_t)(p[i++] - '0');
            if (i == d0 || (i < n && p[i] >= '0' && p[i] <= '9') ||
                (p[d0] == '0' && i - d0 > 1) || v > (uint64_t)INT64_MAX)
                return 0; /* not a JSON integer, or too large for this path */
            if (is_id)
                return 0;
            if (is_time) {
                s->time_ns = neg ? -(int64_t)v : (int64_t)v;
                s->has_time = 1;
            }
        }
        WS();
        if (i < n && p[i] == ',') {
            i++;
            continue;
        }
        if (i < n && p[i] == '}') {
            i++;
            WS();
            return i == n && s->has_id;
        }
        return 0;
    }
#undef WS
}

/* -- the reply, without stdio or the heap --------------------------------------------------- */

struct text {
    unsigned char *p;
    size_t n, cap;
    int full;
};

static void put(struct text *t, const char *s, size_t n) {
    if (t->n + n > t->cap) {
        t->full = 1;
        return;
    }
    memcpy(t->p + t->n, s, n);
    t->n += n;
}

static void puts_(struct text *t, const char *s) { put(t, s, strlen(s)); }

static void put_u64(struct text *t, uint64_t v, int min_digits) {
    char buf[24];
    int i = sizeof buf;
    do {
        buf[--i] = (char)('0' + v % 10);
        v /= 10;
    } while (v || (int)sizeof buf - i < min_digits);
    put(t, buf + i, sizeof buf - (size_t)i);
}

static void put_fixed(struct text *t, uint64_t micros) { /* as jb_fixed: 6 decimals */
    put_u64(t, micros / 1000000, 1);
    put(t, ".", 1);
    put_u64(t, micros % 1000000, 6);
}

static uint64_t micros(clockid_t clock) {
    struct timespec ts;
    clock_gettime(clock, &ts);
    return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

static void put_errno(struct text *t, const char *key, int err) {
    puts_(t, key);
    puts_(t, "\"[Errno ");
    put_u64(t, (uint64_t)err, 1);
    puts_(t, "]\"");
}

int fastseed_try(struct reader *r, int pool, void (*send)(const void *data, size_t n),
                 unsigned char *entropy, size_t cap, size_t *nentropy) {
    if (!prefix_len)
        return FAST_NO;
    int st = frame_peek(r, PREFIX_LEN);
    if (st)
        return st == FRAME_EOF ? FAST_EOF : FAST_CLOSED;
    const unsigned char *p = r->buf + r->start;
    size_t hlen = be32(p + 3), blen = be32(p + 7);
    if (p[0] != 'C' || p[1] != 'R' || p[2] != K_RESEED || hlen > MAX_FAST_HEADER ||
        blen > MAX_FAST_BODY)
        return FAST_NO;
    st = frame_peek(r, PREFIX_LEN + hlen + blen);
    if (st)
        return st == FRAME_EOF ? FAST_EOF : FAST_CLOSED; /* FRAME_EOF cannot follow a prefix */
    p = r->buf + r->start; /* the peek may have moved it */
    struct fastseed_header s;
    if (!fastseed_parse(p + PREFIX_LEN, hlen, &s))
        return FAST_NO;
    const unsigned char *body = p + PREFIX_LEN + hlen;
    uint64_t started = micros(CLOCK_MONOTONIC);
    int reseed_err = 0, clock_err = 0;
    if (write(pool, body, blen) != (ssize_t)blen)
        reseed_err = errno ? errno : EIO;
    pool_info.info.entropy_count = (int)(8 * blen);
    pool_info.info.buf_size = (int)blen;
    memcpy(pool_info.info.buf, body, blen);
    if (!reseed_err && (ioctl(pool, RNDADDENTROPY, &pool_info.info) || ioctl(pool, RNDRESEEDCRNG)))
        reseed_err = errno;
    if (s.has_time && s.time_ns >= 0) {
        struct timespec ts = {(time_t)(s.time_ns / 1000000000), (long)(s.time_ns % 1000000000)};
        if (clock_settime(CLOCK_REALTIME, &ts))
            clock_err = errno;
    }
    uint64_t took = micros(CLOCK_MONOTONIC) - started;
    *nentropy = blen < cap ? blen : cap;
    memcpy(entropy, body, *nentropy);
    struct text t = {out + PREFIX_LEN, 0, sizeof out - PREFIX_LEN, 0};
    put(&t, prefix, prefix_len);
    puts_(&t, ",\"boot_time_s\":");
    put_fixed(&t, micros(CLOCK_BOOTTIME) / 10000 * 10000);
    puts_(&t, ",\"start\":\"snapshot\",\"reseeder\":\"native\",\"clone_id\":\"");
    puts_(&t, s.id);
    puts_(&t, reseed_err ? "\",\"reseeded\":false" : "\",\"reseeded\":true");
    if (reseed_err)
        put_errno(&t, ",\"reseed_error\":", reseed_err);
    if (clock_err)
        put_errno(&t, ",\"clock_error\":", clock_err);
    puts_(&t, ",\"reseed_ms\":");
    put_fixed(&t, took * 1000);
    puts_(&t, ",\"fast_reseed\":true}");
    r->start += PREFIX_LEN + hlen + blen; /* consumed: it was ours */
    if (t.full)
        return FAST_DONE; /* cannot happen (the prefix was checked); the host's wait says so */
    out[0] = 'C', out[1] = 'R', out[2] = K_HELLO;
    for (int i = 0; i < 4; i++) {
        out[3 + i] = (unsigned char)(t.n >> (24 - 8 * i));
        out[7 + i] = 0;
    }
    send(out, PREFIX_LEN + t.n);
    return FAST_DONE;
}
