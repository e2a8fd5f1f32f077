/*
 * cleanroom-reseed: answers a restored clone's RESEED without waking Python.
 *
 * Under TCG a clone translates every guest code path it runs for the first time, and the
 * Python agent's RESEED -> HELLO path is ~4,300 translation blocks of the interpreter. This
 * helper is that path in a few hundred. The agent (guest.py) starts it at SNAPSHOT_PREPARE,
 * before the snapshot, and waits on a pipe; the helper owns the control port until it has read
 * one frame:
 *
 *   reseed PORT_FD PIPE_FD POOL_FD HELLO_PREFIX
 *
 * PORT_FD: the control port. PIPE_FD: the pipe to the agent. POOL_FD: /dev/urandom opened for
 * writing. HELLO_PREFIX: the HELLO header the agent would send, as compact JSON without its
 * closing brace (this helper adds the clone's facts and the brace).
 *
 * It locks its pages in RAM (so a clone reads nothing from disk for it), writes 'R' to the pipe
 * (the agent then lets the snapshot happen) and blocks reading the port. In a clone it reads
 * one frame. If it is a RESEED whose header it can read (a flat JSON object of plain strings
 * and integers, as the host writes it) it does what guest.reseed does - the host's entropy into
 * the kernel's pool, credited (RNDADDENTROPY), a forced CRNG reseed (RNDRESEEDCRNG), the wall
 * clock set - sends the HELLO and writes 'H' plus the RESEED frame to the pipe. Anything else
 * (another frame, a malformed or oversized one) it leaves to the agent: 'P' plus the bytes it
 * consumed. Then it exits; the agent reads the pipe to its end and serves the port again.
 *
 * Frame layout (protocol.py): "CR", kind (1 byte), header length, body length (4 bytes each,
 * big-endian), the JSON header, the body.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/random.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

enum {
    PREFIX_LEN = 11,
    MAX_PART = 4096,     /* a RESEED's header and body are far smaller */
    MAX_HELLO = 16384,   /* the agent's prefix plus this helper's facts */
    MAX_ID = 100,
    KIND_HELLO = 1,
    KIND_RESEED = 19,
};

static unsigned char in[PREFIX_LEN + 2 * MAX_PART];
static size_t in_len;
static unsigned char out[PREFIX_LEN + MAX_HELLO];

struct reseed {
    char clone_id[MAX_ID + 1];
    int has_time;
    int64_t time_ns;
};

struct pool_entropy { /* struct rand_pool_info with a byte buffer */
    int entropy_count;
    int buf_size;
    unsigned char buf[MAX_PART];
};

static struct pool_entropy entropy;

/* -- output ----------------------------------------------------------------------------------- */

struct text {
    char *at;
    char *end;
    int full;
};

static void put(struct text *t, const char *s, size_t n) {
    if (t->full || (size_t)(t->end - t->at) < n) {
        t->full = 1;
        return;
    }
    memcpy(t->at, s, n);
    t->at += n;
}

static void puts_(struct text *t, const char *s) { put(t, s, strlen(s)); }

/* a non-negative integer, at least `digits` digits (zero-padded) */
static void putnum(struct text *t, uint64_t v, int digits) {
    char buf[24];
    int i = sizeof buf;
    do {
        buf[--i] = (char)('0' + v % 10);
        v /= 10;
        digits--;
    } while (v || digits > 0);
    put(t, buf + i, sizeof buf - (size_t)i);
}

static void putfixed(struct text *t, uint64_t v, uint64_t scale, int decimals) {
    putnum(t, v / scale, 1);
    put(t, ".", 1);
    putnum(t, v % scale, decimals);
}

static int write_all(int fd, const unsigned char *p, size_t n) {
    while (n) {
        ssize_t w = write(fd, p, n);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return -1;
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

static uint64_t now_ns(clockid_t clock) {
    struct timespec ts;
    clock_gettime(clock, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static void put_be32(unsigned char *p, uint32_t v) {
    p[0] = (unsigned char)(v >> 24);
    p[1] = (unsigned char)(v >> 16);
    p[2] = (unsigned char)(v >> 8);
    p[3] = (unsigned char)v;
}

static uint32_t get_be32(const unsigned char *p) {
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

/* The HELLO frame into `out`; returns its length (0: it does not fit). */
static size_t hello_frame(const char *prefix, const struct reseed *r, int reseed_errno,
                          int clock_errno, uint64_t reseed_ns) {
    struct text t = {(char *)out + PREFIX_LEN, (char *)out + sizeof out, 0};
    puts_(&t, prefix);
    puts_(&t, ",\"boot_time_s\":");
    putfixed(&t, now_ns(CLOCK_BOOTTIME) / 10000000u, 100, 2);
    puts_(&t, ",\"start\":\"snapshot\",\"reseeder\":\"native\",\"clone_id\":\"");
    puts_(&t, r->clone_id);
    if (reseed_errno) {
        puts_(&t, "\",\"reseeded\":false,\"reseed_error\":\"OSError: errno ");
        putnum(&t, (uint64_t)reseed_errno, 1);
        puts_(&t, "\"");
    } else {
        puts_(&t, "\",\"reseeded\":true");
    }
    if (clock_errno) {
        puts_(&t, ",\"clock_error\":\"errno ");
        putnum(&t, (uint64_t)clock_errno, 1);
        puts_(&t, "\"");
    }
    puts_(&t, ",\"reseed_ms\":");
    putfixed(&t, reseed_ns / 1000u, 1000, 3);
    puts_(&t, "}");
    if (t.full)
        return 0;
    size_t hlen = (size_t)(t.at - ((char *)out + PREFIX_LEN));
    out[0] = 'C';
    out[1] = 'R';
    out[2] = KIND_HELLO;
    put_be32(out + 3, (uint32_t)hlen);
    put_be32(out + 7, 0);
    return PREFIX_LEN + hlen;
}

/* -- input ------------------------------------------------------------------------------------ */

/* Read exactly n more bytes into `in`. The port reads EOF until a clone's host connects:
 * then wait and read again. -1 on an error. */
static int read_more(int fd, size_t n) {
    while (n) {
        ssize_t r = read(fd, in + in_len, n);
        if (r < 0 && (errno == EINTR || errno == EAGAIN))
            continue;
        if (r < 0)
            return -1;
        if (r == 0) {
            struct timespec pause = {0, 2000000};
            nanosleep(&pause, NULL);
            continue;
        }
        in_len += (size_t)r;
        n -= (size_t)r;
    }
    return 0;
}

static int plain_char(unsigned char c) { return c >= 0x20 && c < 0x7f && c != '"' && c != '\\'; }

static int id_char(unsigned char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
           c == '-' || c == '_' || c == '.';
}

/* A string without escapes: [p, *end) holds its text. 0 if it is not one. */
static int scan_string(const unsigned char *p, const unsigned char *stop, const unsigned char **s,
                       const unsigned char **e) {
    if (p >= stop || *p != '"')
        return 0;
    *s = ++p;
    while (p < stop && plain_char(*p))
        p++;
    if (p >= stop || *p != '"')
        return 0;
    *e = p;
    return 1;
}

/* The RESEED header: a flat JSON object of plain strings and integers, as the host writes it
 * (compact, no escapes). clone_id is required and must be an id; time_ns is optional. */
static int parse_header(const unsigned char *p, size_t n, struct reseed *r) {
    const unsigned char *stop = p + n, *ks, *ke, *vs, *ve;
    int have_id = 0;
    memset(r, 0, sizeof *r);
    if (n < 2 || *p++ != '{')
        return 0;
    if (*p == '}')
        return 0;
    for (;;) {
        if (!scan_string(p, stop, &ks, &ke))
            return 0;
        p = ke + 1;
        if (p >= stop || *p++ != ':')
            return 0;
        size_t klen = (size_t)(ke - ks);
        if (p < stop && *p == '"') {
            if (!scan_string(p, stop, &vs, &ve))
                return 0;
            p = ve + 1;
            if (klen == 8 && memcmp(ks, "clone_id", 8) == 0) {
                size_t vlen = (size_t)(ve - vs);
                if (vlen == 0 || vlen > MAX_ID)
                    return 0;
                for (size_t i = 0; i < vlen; i++)
                    if (!id_char(vs[i]))
                        return 0;
                memcpy(r->clone_id, vs, vlen);
                r->clone_id[vlen] = 0;
                have_id = 1;
            }
        } else {
            int64_t v = 0;
            int digits = 0;
            while (p < stop && *p >= '0' && *p <= '9') {
                int d = *p++ - '0';
                if (v > (INT64_MAX - d) / 10)
                    return 0;
                v = v * 10 + d;
                digits++;
            }
            if (!digits)
                return 0;
            if (klen == 7 && memcmp(ks, "time_ns", 7) == 0) {
                r->has_time = 1;
                r->time_ns = v;
            }
        }
        if (p >= stop)
            return 0;
        if (*p == '}')
            return p + 1 == stop && have_id;
        if (*p++ != ',')
            return 0;
    }
}

/* -- the clone's side ------------------------------------------------------------------------- */

static int reseed_pool(int pool, const unsigned char *body, size_t n, int credit) {
    if (write(pool, body, n) != (ssize_t)n)
        return errno ? errno : EIO;
    entropy.entropy_count = credit ? (int)(8 * n) : 0;
    entropy.buf_size = (int)n;
    memcpy(entropy.buf, body, n);
    if (ioctl(pool, RNDADDENTROPY, &entropy) < 0 || ioctl(pool, RNDRESEEDCRNG) < 0)
        return errno;
    return 0;
}

static int set_clock(const struct reseed *r) {
    if (!r->has_time)
        return 0;
    struct timespec ts = {(time_t)(r->time_ns / 1000000000), (long)(r->time_ns % 1000000000)};
    return clock_settime(CLOCK_REALTIME, &ts) < 0 ? errno : 0;
}

/* Hand the agent what it needs: 'H' (answered) or 'P' (its to handle), and the bytes read. */
static int hand_over(int pipe_fd, char status) {
    unsigned char s = (unsigned char)status;
    if (write_all(pipe_fd, &s, 1) < 0 || write_all(pipe_fd, in, in_len) < 0)
        return 1;
    return 0;
}

static int serve(int port, int pipe_fd, int pool, const char *prefix) {
    if (read_more(port, PREFIX_LEN) < 0)
        return hand_over(pipe_fd, 'P') | 1;
    uint32_t hlen = get_be32(in + 3), blen = get_be32(in + 7);
    if (in[0] != 'C' || in[1] != 'R' || in[2] != KIND_RESEED || hlen > MAX_PART ||
        blen > MAX_PART)
        return hand_over(pipe_fd, 'P');
    if (read_more(port, hlen + blen) < 0)
        return hand_over(pipe_fd, 'P') | 1;
    struct reseed r;
    if (!parse_header(in + PREFIX_LEN, hlen, &r))
        return hand_over(pipe_fd, 'P');
    uint64_t started = now_ns(CLOCK_MONOTONIC);
    int reseed_errno = reseed_pool(pool, in + PREFIX_LEN + hlen, blen, 1);
    int clock_errno = set_clock(&r);
    uint64_t took = now_ns(CLOCK_MONOTONIC) - started;
    size_t n = hello_frame(prefix, &r, reseed_errno, clock_errno, took);
    if (n == 0 || write_all(port, out, n) < 0)
        return hand_over(pipe_fd, 'P') | 1;  /* nothing (or part) sent: the agent's problem */
    return hand_over(pipe_fd, 'H');
}

/* Run the clone's code once here, so its pages are present and locked in the snapshot. */
static void rehearse(const char *prefix) {
    static const char probe[] = "{\"clone_id\":\"env-0\",\"time_ns\":1}";
    struct reseed r;
    parse_header((const unsigned char *)probe, sizeof probe - 1, &r);
    hello_frame(prefix, &r, EIO, EIO, now_ns(CLOCK_MONOTONIC) % 1000000u);
    memset(out, 0, sizeof out);
}

static int arg_fd(const char *s) {
    char *end;
    long v = strtol(s, &end, 10);
    return (*s && !*end && v >= 0 && v < 65536) ? (int)v : -1;
}

int main(int argc, char **argv) {
    if (argc != 5)
        return 2;
    int port = arg_fd(argv[1]), pipe_fd = arg_fd(argv[2]), pool = arg_fd(argv[3]);
    const char *prefix = argv[4];
    if (port < 0 || pipe_fd < 0 || pool < 0 || prefix[0] != '{' || prefix[1] != '"' || strlen(prefix) > MAX_HELLO / 2)
        return 2;
    mlockall(MCL_CURRENT | MCL_FUTURE);  /* best effort: root in a VM, maybe not in a test */
    rehearse(prefix);
    unsigned char ready = 'R';
    if (write_all(pipe_fd, &ready, 1) < 0)
        return 1;
    _exit(serve(port, pipe_fd, pool, prefix));
}
