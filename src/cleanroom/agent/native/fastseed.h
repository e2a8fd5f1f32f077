/*
 * A clone's RESEED answered on a path of its own, as the old reseed.c helper did.
 *
 * Under TCG every clone translates each code block it runs for the first time, and the general
 * path (the frame reader's JSON validation and walk, heap allocations, the growable JSON
 * writer) is ~2.6x the blocks of reseed.c's (bench/results/native_ready.txt). This one reads the
 * first frame a clone gets in place from the reader's buffer; if it is a RESEED with a flat
 * header of plain strings and integers (as the host writes it) it mixes in the entropy
 * (credited), forces a CRNG reseed, sets the clock and sends HELLO from a prefix made before
 * the snapshot, with fixed buffers and no allocation. Anything else is left, unconsumed, to the
 * general reader.
 */
#ifndef CLEANROOM_FASTSEED_H
#define CLEANROOM_FASTSEED_H

#include <stddef.h>
#include <stdint.h>

#include "frame.h"

enum { FAST_DONE = 0, FAST_NO = 1, FAST_EOF = 2, FAST_CLOSED = 3, FAST_MAX_ID = 128 };

/* What this path reads of a RESEED header. */
struct fastseed_header {
    char id[FAST_MAX_ID + 1]; /* clone_id: 1-128 of [A-Za-z0-9._-] */
    int has_id, has_time;
    int64_t time_ns;
};

/* 1 if [p, p+n) is a flat JSON object of plain strings and integers with a clone_id (then
 * *h holds it, and time_ns if given), else 0: the general reader decides what it is. */
int fastseed_parse(const unsigned char *p, size_t n, struct fastseed_header *h);

/* Before the snapshot: the clone's HELLO up to its reseed facts ("{...", no closing brace);
 * -1 if it does not fit (then every RESEED takes the general path). */
int fastseed_prepare(const char *prefix, size_t n);

/* The first frame of a clone's host: FAST_DONE (answered: the frame is consumed, the host's
 * bytes copied to `entropy`, at most `cap`, their count in *n), FAST_NO (not one for this
 * path: nothing consumed), or FAST_EOF / FAST_CLOSED from the port. `send` writes a whole
 * encoded frame to the port. */
int fastseed_try(struct reader *r, int pool, void (*send)(const void *data, size_t n),
                 unsigned char *entropy, size_t cap, size_t *n);

#endif
