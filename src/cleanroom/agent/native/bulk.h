/*
 * The bulk disk (protocol.py, "bulk"): a raw virtio-blk disk of the qemu driver's (serial
 * BULK_SERIAL) that a file's bytes cross instead of the agent channel. The host writes a piece
 * at the disk's start and sends BULK_PUT; the agent copies it into the file. For BULK_GET the
 * agent copies a piece of the file to the disk's start and says how much; the host reads it
 * there. Only the host's requests move bytes, one at a time; every access is O_DIRECT, so the
 * guest's page cache never holds a stale copy of what the host wrote.
 */
#ifndef CLEANROOM_BULK_H
#define CLEANROOM_BULK_H

#include <stdint.h>

#define BULK_SERIAL "cr-bulk"

/* Find and open the disk (by PID 1 of a VM, before it forks the agent's serving process;
 * elsewhere there is none): 0, or -1. */
int bulk_open(void);

/* Its size in bytes (0: no bulk disk). */
int64_t bulk_size(void);

/* Copy `n` bytes from the disk's start into `fd` at `at`: 0, or an errno. */
int bulk_to_file(int fd, int64_t at, int64_t n);

/* Copy up to `max` bytes of `fd` from `at` to the disk's start; how many in *got (fewer
 * only at the file's end): 0, or an errno. */
int bulk_from_file(int fd, int64_t at, int64_t max, int64_t *got);

#endif
