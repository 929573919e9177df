/*
 * conv_out.h - an output file of k3-convert being written (conv_out.c).
 *
 * Usage: k3_conv_w_open (creates "<dir>/<name>.tmp" at its final size), any
 * number of k3_conv_w_write / k3_conv_w_write_zeros (each extent written
 * front to back, extents in any order), k3_conv_w_finish (SHA-256 of the logical file; the region CRCs
 * land in of->region_crc), k3_conv_w_publish (fsync, rename, fsync dir),
 * k3_conv_w_close (always; remove_tmp after a failure).
 */
#ifndef K3_CONV_OUT_H
#define K3_CONV_OUT_H

#include <openssl/evp.h>
#include <stdint.h>

#include "conv.h"

typedef struct k3_conv_w {
    k3_conv_ofile *of;
    char path[4096], tmp[4104];
    int fd;
    int dfd;                    /* the same temporary opened O_DIRECT, or -1 */
    int dense;
    EVP_MD_CTX *md;
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

/* zlib crc32(crc, buf, n) for n zero bytes, in O(log n) steps. */
uint32_t k3_conv_crc32_zeros(uint32_t crc, uint64_t n);

#endif
