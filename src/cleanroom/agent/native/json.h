/*
 * A small JSON reader over spans of a validated document, and a writer into a growable buffer.
 *
 * The reader never allocates: json_check validates a whole document (depth and size bounded)
 * once; after that, json_get / json_next walk it by position. Strings are decoded (escapes,
 * \u surrogate pairs) on demand into a caller's buffer.
 */
#ifndef CLEANROOM_JSON_H
#define CLEANROOM_JSON_H

#include <stddef.h>
#include <stdint.h>

enum { JSON_MAX_DEPTH = 64 };

typedef struct {
    const char *p; /* first byte of the value */
    size_t n;      /* its length in bytes */
} jspan;

/* 0 if [s, s+n) is exactly one JSON value (whitespace around it allowed), else -1. */
int json_check(const char *s, size_t n);
/* 0 if it is one JSON object. */
int json_check_object(const char *s, size_t n);

/* The value of `key` in a validated object (0), or -1 if absent or `obj` is not an object. */
int json_get(jspan obj, const char *key, jspan *out);
/* Iterate a validated array or object: *pos starts at 0; returns 1 and the next item (and its
 * key, for an object: the raw string span with quotes), 0 at the end. */
int json_next(jspan container, size_t *pos, jspan *key, jspan *value);

int json_is(jspan v, char first); /* '"' string, '{', '[', 'n' null, 't'/'f' bool, '-'/digit */
/* Decode a string value into buf (NUL-terminated); -1 if not a string, too long, or holding
 * a NUL (which no C string can carry). */
int json_string(jspan v, char *buf, size_t cap, size_t *len);
/* A string value, decoded into malloc'd memory (NULL on error). */
char *json_strdup(jspan v);
int json_int(jspan v, int64_t *out);    /* an integer literal in range */
int json_number(jspan v, double *out);  /* any number */
int json_true(jspan v);                 /* 1 only for the literal true */

/* -- writing ------------------------------------------------------------------------------- */

typedef struct {
    char *p;
    size_t n;
    size_t cap;
    int failed; /* out of memory: the text is incomplete */
} jbuf;

void jb_raw(jbuf *b, const char *s, size_t n);
void jb_lit(jbuf *b, const char *s);
void jb_str(jbuf *b, const char *s, size_t n); /* a JSON string (bytes >= 0x80 copied as is) */
/* A file name as a JSON string the way Python writes os.fsdecode(name): valid UTF-8 as is, each
 * byte that does not decode as a lone surrogate \udcXX (the host refuses those by name). */
void jb_name(jbuf *b, const char *s, size_t n);
void jb_int(jbuf *b, int64_t v);
void jb_fixed(jbuf *b, uint64_t micros); /* micros / 1e6 with 6 decimals */
void jb_key(jbuf *b, const char *key);   /* ,"key": (the comma unless right after '{') */
void jb_free(jbuf *b);

/* 1 if [s, s+n) is valid UTF-8 (what a JSON header may hold). */
int utf8_valid(const unsigned char *s, size_t n);

#endif
