/*
 * conv_out.h - an output file of k3-convert being written (conv_out.c).
 *
 * Usage: k3_conv_w_open (creates "<dir>/<name>.tmp" at its final size), any
 * number of k3_conv_w_write / k3_conv_w_write_zeros (each extent written
 * front to back, extents in any order), k3_conv_w_finish (SHA-256 of the logical file; the region CRCs
 * land in of->region_crc), k3_conv_w_publish (fsync, rename, fsync dir),
 * k3_conv_w_close (always; remove_tmp after a failure).
 *
 * Resumable within a file: after extents [0, next) are complete,
 * k3_conv_w_checkpoint fsyncs the temporary and describes the writer's whole
 * state (hash frontier, SHA-256 state, region CRCs) as JSON for a journal
 * entry; k3_conv_w_resume opens the temporary again at that state (bytes
 * past the state's frontier are zeroed: they are written again), so the
 * finished file is byte- and hash-identical to an uninterrupted write.
 */
#ifndef K3_CONV_OUT_H
#define K3_CONV_OUT_H

#include <cjson/cJSON.h>
#include <openssl/sha.h>
#include <stdint.h>

#include "conv.h"

typedef struct k3_conv_w {
    k3_conv_ofile *of;
    char path[4096], tmp[4104];
    int fd;
    int dfd;                    /* the same temporary opened O_DIRECT, or -1 */
    int dense;
    SHA256_CTX sha;             /* a plain struct, so that a checkpoint can keep it */
    uint32_t crc;               /* running CRC of region creg */
    uint32_t creg;              /* first region whose CRC is not final */
    uint64_t frontier;          /* bytes [0, frontier) are hashed */
    uint32_t cur;               /* first extent not completely hashed */
    uint64_t *done;             /* bytes written per extent */
    uint8_t *rb;                /* read-back buffer */
    uint64_t written, synced, holes, readback;
} k3_conv_w;

int k3_conv_w_open(k3_conv_w *w, const char *dir, k3_conv_ofile *of, int dense, k3_err *e);
int k3_conv_w_write(k3_conv_w *w, uint32_t ext, uint64_t off_in_ext, const void *buf, uint64_t n, k3_err *e);
/* The same as k3_conv_w_write of n zero bytes, without a buffer: nothing is
 * written (the bytes stay holes; --dense writes zero blocks) and the hashes
 * take the zeros without scanning them (CRC32 by k3_conv_crc32_zeros). */
int k3_conv_w_write_zeros(k3_conv_w *w, uint32_t ext, uint64_t off_in_ext, uint64_t n, k3_err *e);
int k3_conv_w_finish(k3_conv_w *w, uint8_t sha[32], k3_err *e);
int k3_conv_w_publish(k3_conv_w *w, k3_err *e);
void k3_conv_w_close(k3_conv_w *w, int remove_tmp);

/* The state after extents [0, next) (all written, in file order) as a new
 * JSON object (caller deletes it), after an fsync of the temporary. *out is
 * NULL (and 0 returned) when the writer is not at such a point. */
int k3_conv_w_checkpoint(k3_conv_w *w, uint32_t next, cJSON **out, k3_err *e);

/* Like k3_conv_w_open, but continue the temporary from state (from
 * k3_conv_w_checkpoint on the same plan): returns 1 and sets *next when
 * resumed, 0 when state or the temporary does not fit (then w is opened
 * fresh, as by k3_conv_w_open), <0 on error. */
int k3_conv_w_resume(k3_conv_w *w, const char *dir, k3_conv_ofile *of, int dense, const cJSON *state,
                     uint32_t *next, k3_err *e);

/* zlib crc32(crc, buf, n) for n zero bytes, in O(log n) steps. */
uint32_t k3_conv_crc32_zeros(uint32_t crc, uint64_t n);

#endif
