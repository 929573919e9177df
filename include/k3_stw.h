/*
 * k3_stw.h - a streaming safetensors shard writer.
 *
 * Byte layout of what it writes (the safetensors format, docs/MODEL.md §2.2):
 *   [0, 8)        u64 little-endian N
 *   [8, 8+N)      JSON: {"__metadata__":{"format":"pt"[, key: value...]},
 *                        "NAME":{"dtype":"BF16","shape":[r,c],"data_offsets":[b,e]}, ...}
 *                 padded with spaces so that 8+N is a multiple of 8
 *   [8+N, end)    tensor data in declaration order, contiguous, no gaps;
 *                 data_offsets are relative to 8+N.
 *
 * Use: declare every tensor up front (k3_stw_add), then k3_stw_begin (which
 * fixes the header, creates "<path>.tmp", writes the header and sizes the file
 * so that anything not written reads as zero - a hole), then either write
 * tensors yourself (k3_stw_write) or let k3_stw_stream pull the data from a
 * fill callback in large chunks (generation on OpenMP threads overlapped with
 * O_DIRECT writes on a writer thread, constant memory). k3_stw_finish fsyncs
 * and renames the temporary into place; k3_stw_free of an unfinished writer
 * removes the temporary.
 *
 * A writer created with path NULL is a dry run: it only computes sizes, which
 * is how a caller plans shards under a size limit (k3_stw_size_with).
 */
#ifndef K3_STW_H
#define K3_STW_H

#include <signal.h>
#include <stdint.h>

#include "k3_err.h"
#include "k3_progress.h"
#include "k3_st.h"

typedef struct k3_stw k3_stw;

/* Create a writer for the shard that will be published at path (NULL: dry
 * run). Nothing is created on disk before k3_stw_begin. */
int k3_stw_create(k3_stw **out, const char *path, k3_err *e);
/* Removes "<path>.tmp" unless k3_stw_finish succeeded. Accepts NULL. */
void k3_stw_free(k3_stw *w);

/* Add a "__metadata__" string entry (before begin). key and value are copied. */
int k3_stw_metadata(k3_stw *w, const char *key, const char *value, k3_err *e);

/* Declare the next tensor (before begin). The name is copied; the shape
 * product times the dtype size must not overflow. */
int k3_stw_add(k3_stw *w, const char *name, k3_dtype dtype, uint32_t ndim, const uint64_t *shape,
               k3_err *e);

/* File size the shard would have with what has been added so far, and with
 * one more tensor added; UINT64_MAX if the shape overflows. */
uint64_t k3_stw_size(const k3_stw *w);
uint64_t k3_stw_size_with(const k3_stw *w, const char *name, k3_dtype dtype, uint32_t ndim,
                          const uint64_t *shape);

uint64_t k3_stw_count(const k3_stw *w);
/* Absolute file offset of tensor i's data and its size in bytes. */
uint64_t k3_stw_tensor_offset(const k3_stw *w, uint64_t i);
uint64_t k3_stw_tensor_bytes(const k3_stw *w, uint64_t i);
/* Header length N (without the 8-byte prefix). */
uint64_t k3_stw_header_len(const k3_stw *w);

/* Create "<path>.tmp" (an existing one is replaced only if overwrite_tmp),
 * write the header and extend the file to its final size. */
int k3_stw_begin(k3_stw *w, int overwrite_tmp, k3_err *e);

/* Write n bytes at byte off of tensor i (after begin). */
int k3_stw_write(k3_stw *w, uint64_t i, uint64_t off, const void *buf, uint64_t n, k3_err *e);

/*
 * Fill callback for k3_stw_stream: put bytes [off, off+n) of tensor i into
 * buf. Return 0 when filled, K3_STW_ZERO when those bytes are all zero (buf is
 * then left untouched and may be skipped), or a negative K3_E* code. Called
 * concurrently from several threads, for disjoint ranges.
 */
#define K3_STW_ZERO 1
typedef int (*k3_stw_fill_fn)(void *ctx, uint64_t i, uint64_t off, uint64_t n, void *buf, k3_err *e);

typedef struct k3_stw_stream_opts {
    uint64_t chunk_bytes;   /* bytes per write request; 0: 16 MiB */
    int threads;            /* generator threads; 0: OpenMP's default */
    int sparse;             /* don't write all-zero pieces (they stay holes) */
    int direct;             /* write with O_DIRECT where the filesystem allows */
    k3_progress *progress;  /* may be NULL; gets the logical bytes done */
    volatile sig_atomic_t *cancel; /* may be NULL; nonzero stops with K3_EINTR */
    /* May be NULL. When sparse, a chunk whose tensors all answer 1 here is
     * skipped without calling fill: a fast path for huge mostly-hole files. */
    int (*tensor_is_zero)(void *ctx, uint64_t i);
} k3_stw_stream_opts;

/* Write the whole file (header included) from fill, after begin. Memory use
 * is three chunk buffers whatever the file size. */
int k3_stw_stream(k3_stw *w, k3_stw_fill_fn fill, void *ctx, const k3_stw_stream_opts *o, k3_err *e);

/* Bytes actually written by k3_stw_stream (less than the size when sparse). */
uint64_t k3_stw_bytes_written(const k3_stw *w);

/* fsync, close, rename "<path>.tmp" to path, fsync the directory. */
int k3_stw_finish(k3_stw *w, k3_err *e);

#endif
