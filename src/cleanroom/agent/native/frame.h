/*
 * Frames of the agent protocol (agent/protocol.py): "CR", kind (1 byte), header length and
 * body length (4 bytes each, big-endian), the JSON header (an object), the body.
 *
 * frame_read checks the magic, the kind, both lengths against the limits and that the header
 * is one JSON object before it allocates the body; anything else is an error, never a crash.
 */
#ifndef CLEANROOM_FRAME_H
#define CLEANROOM_FRAME_H

#include <stddef.h>
#include <sys/types.h>

#include "json.h"

enum {
    PREFIX_LEN = 11,
    MAX_HEADER = 256 * 1024,   /* protocol.MAX_HEADER */
    MAX_BODY = 1024 * 1024,    /* protocol.DEFAULT_MAX_BODY */
    CHUNK = 256 * 1024,        /* protocol.CHUNK: FILE, RESULT and DATA chunks */
    RESULT_MAX_BYTES = 4 * 1024 * 1024,
    KIND_MAX = 33, /* protocol.Kind.CONNECT: the multiplexed kinds too (mux.c) */
};

enum kind {
    K_HELLO = 1,
    K_RUN = 2,
    K_EXEC = 3,
    /* 4, 5: retired (the first protocol's unnumbered PUT and GET) */
    K_STDOUT = 6,
    K_STDERR = 7,
    K_FILE = 8,
    K_RESULT = 9,
    K_EXIT = 10,
    K_ERROR = 11,
    K_PING = 12,
    K_PONG = 13,
    K_SHUTDOWN = 14,
    K_DONE = 15,
    K_OK = 16,
    K_HEARTBEAT = 17,
    K_SNAPSHOT_PREPARE = 18,
    K_RESEED = 19,
    K_STDIN = 20,
    K_KILL = 21,
    K_RESIZE = 22,
    K_STARTED = 23,
    K_FAILED = 24,
    K_UPLOAD = 25,
    K_DOWNLOAD = 26,
    K_DATA = 27,
    K_ACK = 28,
    K_WARM_UP = 29, /* a spare: run the warm worker's episode paths once (warm.c: warm_up) */
    K_BULK_PUT = 30, /* a piece of a file through the bulk disk (bulk.h; mux.c) */
    K_BULK_GET = 31,
    K_FS = 32, /* stat / list / mkdir / rename / remove of a guest path (mux.c: fs_request) */
    K_CONNECT = 33, /* a TCP connection to a guest port, relayed (port.h; mux.c) */
    K_GYM_MAKE = 40, /* protocol.Kind.GYM_*: relayed to the gym process (gym.c) */
    K_GYM_SPACES = 41,
    K_GYM_RESET = 42,
    K_GYM_STEP = 43,
    K_GYM_OBS = 44,
    K_GYM_CLOSE = 45,
    K_GYM_ERROR = 46,
};

/* Where frame bytes come from: returns bytes read, 0 at end of stream, -1 on error. */
typedef ssize_t (*read_fn)(void *ctx, void *buf, size_t n);

struct reader {
    read_fn read;
    void *ctx;
    unsigned char buf[64 * 1024];
    size_t start, end;
};

struct frame {
    int kind;
    char *header; /* NUL-terminated JSON object text ("{}" when empty) */
    size_t hlen;
    unsigned char *body;
    size_t blen;
};

enum frame_status {
    FRAME_OK = 0,
    FRAME_EOF = 1,     /* closed before a frame began */
    FRAME_CLOSED = 2,  /* closed mid-frame */
    FRAME_BAD = 3,     /* wrong magic, kind, size or header */
    FRAME_NOMEM = 4,
};

/* Validate a prefix: the kind and both lengths, or -1 with a reason in *why. */
int frame_prefix(const unsigned char *p, size_t max_body, int *kind, size_t *hlen, size_t *blen,
                 const char **why);
/* Have at least n bytes buffered (r->buf + r->start on), consuming none: 0, FRAME_EOF (the
 * stream ended with nothing buffered), FRAME_CLOSED (it ended before n, or n exceeds the buffer). */
int frame_peek(struct reader *r, size_t n);

/* Read one frame; on FRAME_BAD, *why says what was wrong. The frame owns its memory. */
int frame_read(struct reader *r, struct frame *f, const char **why);
void frame_free(struct frame *f);
/* Encode a frame into one malloc'd buffer (NULL when out of memory). */
unsigned char *frame_encode(int kind, const char *header, size_t hlen, const void *body,
                            size_t blen, size_t *total);
/* The header as a span (for json_get). */
jspan frame_header(const struct frame *f);

#endif
