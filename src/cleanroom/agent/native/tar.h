/*
 * Tar archives of folders, trusting no member, for the native agent's UPLOAD and
 * DOWNLOAD with "tar": true (mux.c lends the stream: its DATA in, DATA out within the window).
 *
 * tar_extract unpacks an uncompressed ustar / pax / GNU stream into a folder without trusting
 * it: every member name must pass tar_name_problem (names.problem) after a leading "./";
 * every folder on its way is opened without following links (O_NOFOLLOW relative to the one
 * above), so nothing lands outside, even through a link an earlier member made; a symbolic
 * link's target stays inside (tar_link_inside), a hard link names a member inside; device
 * nodes, FIFOs and anything else are refused; modes keep their permission bits only; owners
 * are not applied (the agent's own). Refused: TAR_UNSAFE ("unsafe_path"); corrupt:
 * TAR_BAD ("bad_archive"); members before stay unpacked.
 *
 * tar_pack writes a folder (regular files, folders, symbolic links; a file seen again under
 * another name as a hard link) as pax-format tar, names relative to it, in os.walk's order.
 */
#ifndef CLEANROOM_TAR_H
#define CLEANROOM_TAR_H

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

enum { TAR_OK, TAR_UNSAFE, TAR_BAD, TAR_NOT_FOUND, TAR_OS, TAR_STOPPED };

struct tar_error {
    int code;
    int err; /* the errno behind a TAR_OS or TAR_BAD, or 0 */
    char message[640];
};

/* Set `e` (its message made valid UTF-8 for the host: a byte that does not decode is '?'). */
void tar_fail(struct tar_error *e, int code, int err, const char *fmt, va_list ap);
void tar_clean_text(char *s);

/* FAILED's code for a tar_error's ("unsafe_path", "bad_archive", ...: transfers.FAILURES) */
const char *tar_code(int code);

/* The stream: `read` gives up to `cap` bytes of input (0 at its end); `write` sends `n`
 * bytes (n <= 256 KiB, one DATA frame) and returns 0 once the receiver stopped. */
struct tar_io {
    void *ctx;
    size_t (*read)(void *ctx, unsigned char *buf, size_t cap);
    int (*write)(void *ctx, const unsigned char *p, size_t n);
};

/* Unpack the stream into `dest` (made if missing), then read whatever follows the archive's
 * end. TAR_OK, or the code with `e` set. */
int tar_extract(const struct tar_io *io, const char *dest, struct tar_error *e);

/* Pack the folder `src` onto io->write. TAR_OK, TAR_STOPPED, or the code with `e` set. */
int tar_pack(const struct tar_io *io, const char *src, struct tar_error *e);

/* -- the reader, on its own for the fuzzer ------------------------------------------------ */

struct tar_member {
    char *name, *link; /* as stored (NUL-terminated; name_n / link_n bytes, NULs included) */
    size_t name_n, link_n;
    char type;         /* typeflag: '0' a file ('\0', '7' too), '1', '2', '5', ... */
    unsigned mode;
    int64_t size;
};

struct tar_reader {
    const struct tar_io *io;
    int64_t offset, left; /* bytes read so far; of the current member's data (and padding) */
    int ended;
    char *global_path, *global_link; /* a pax global header's (NULL: none) */
    size_t global_path_n, global_link_n;
    struct tar_member m;
};

/* The next member into r->m: 1, 0 at the archive's end, -1 with `e` (TAR_BAD) if corrupt. */
int tar_next(struct tar_reader *r, struct tar_error *e);
/* Up to `cap` bytes of the current member's data: > 0, 0 at its end, -1 truncated (`e`). */
ssize_t tar_data(struct tar_reader *r, unsigned char *buf, size_t cap, struct tar_error *e);
void tar_reader_free(struct tar_reader *r);

/* Why `name` (n bytes) is no safe relative name (names.problem), or NULL. */
const char *tar_name_problem(const char *name, size_t n);
/* A member's name made relative (a leading "./" and trailing "/" dropped): 1 and *rel, *rn
 * set; 0 for the folder itself; -1 with `e` if it is unsafe. */
int tar_member_name(const char *name, size_t n, const char **rel, size_t *rn,
                    struct tar_error *e);
/* Does a symbolic link at `rel` pointing to `target` (n bytes) stay inside the folder? */
int tar_link_inside(const char *rel, const char *target, size_t n);

#endif
