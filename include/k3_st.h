/*
 * k3_st.h - safetensors checkpoints: parse, index and read.
 *
 * A shard is: u64 little-endian header length N, N bytes of JSON
 *   {"name": {"dtype": "BF16", "shape": [r, c], "data_offsets": [b, e]}, ...,
 *    "__metadata__": {...}}
 * then the data; data_offsets are relative to byte 8 + N.
 *
 * k3_st_open indexes every tensor of every shard of a checkpoint directory in
 * one hash table (with or without model.safetensors.index.json; when present
 * the index and the shards must agree exactly). Every header is hostile: each
 * rejection is one line naming the shard, the byte offset in the file and,
 * where there is one, the tensor: "DIR/x.safetensors: byte 913: tensor "w":
 * data_offsets [0, 8) run past the data area (4 bytes)".
 *
 * What a header must be (the safetensors format, strictly):
 * - N <= K3_ST_MAX_HEADER and 8 + N <= file size;
 * - the JSON starts at its first byte with '{' and may be followed only by
 *   whitespace (writers pad with spaces); valid UTF-8, escapes included
 *   (surrogates paired, no \u0000 in names);
 * - every member other than "__metadata__" is a tensor: a non-empty name of at
 *   most K3_ST_MAX_NAME bytes, unique in the shard (and in the checkpoint),
 *   whose value is an object with exactly the keys dtype (one of the eight
 *   k3_dtype names), shape (at most K3_ST_MAX_DIMS integers; [] is a scalar,
 *   a 0 dim an empty tensor) and data_offsets ([begin, end], begin <= end);
 *   integers are plain JSON integers <= 2^53 (no sign, fraction, exponent or
 *   leading zero);
 * - end - begin == product(shape) * dtype size, computed without overflow;
 * - the tensors tile the data area exactly: no overlap, no hole, and no byte
 *   after the last tensor (the format requires the byte buffer to be entirely
 *   indexed, which rules out hidden payloads);
 * - "__metadata__", if present (once), is an object of string -> string.
 * The index (model.safetensors.index.json) is an object whose "weight_map" is
 * an object of tensor name -> shard file name; other members are skipped
 * (nested at most 64 deep). Shard names are plain file names ending in
 * ".safetensors" (no '/', '\\', leading '.'), and every *.safetensors file in
 * the directory must be named by the index.
 *
 * Lifetime: a k3_st owns its shard fds, names and tensor table; pointers it
 * returns are borrowed and valid until k3_st_close. After k3_st_open returns,
 * every function here only reads the k3_st, so threads may share one.
 */
#ifndef K3_ST_H
#define K3_ST_H

#include <stddef.h>
#include <stdint.h>

#include "k3_err.h"

typedef enum k3_dtype {
    K3_DT_BF16 = 0,
    K3_DT_F16,
    K3_DT_F32,
    K3_DT_U8,
    K3_DT_I8,
    K3_DT_I32,
    K3_DT_F8_E4M3,
    K3_DT_F8_E5M2,
    K3_DT_COUNT
} k3_dtype;

#define K3_ST_MAX_DIMS 8
/* Bounds on what a file may make us allocate (documented in FORMAT.md). */
#define K3_ST_MAX_HEADER   (100u << 20)   /* 100 MiB of header JSON per shard */
#define K3_ST_MAX_SHARDS   65536u
#define K3_ST_MAX_NAME     1024u
#define K3_ST_MAX_TENSORS  (1u << 22)     /* per checkpoint: 8x K3's 497,220; ~1 GB of index at most */
#define K3_ST_MAX_INDEX    (256u << 20)   /* model.safetensors.index.json (K3's is ~40 MB) */

const char *k3_dtype_name(k3_dtype t);          /* "BF16", ... */
int k3_dtype_from_name(const char *s, k3_dtype *t); /* 0 or K3_EFORMAT */
uint32_t k3_dtype_size(k3_dtype t);             /* bytes per element */

typedef struct k3_st_tensor {
    const char *name;
    k3_dtype dtype;
    uint32_t ndim;
    uint64_t shape[K3_ST_MAX_DIMS];
    uint32_t shard;          /* index into the checkpoint's shard list */
    uint64_t offset;         /* absolute byte offset in the shard file */
    uint64_t nbytes;
} k3_st_tensor;

typedef struct k3_st k3_st;

/* Flags for k3_st_open. */
#define K3_ST_DIRECT 1u   /* open shards with O_DIRECT where allowed */

/* Open a checkpoint: dir is a directory (all *.safetensors in it, or those
 * named by model.safetensors.index.json) or a single .safetensors file.
 * Shards are numbered in file-name order. Returns 0, K3_EFORMAT (bad header
 * or index, or they disagree), K3_ELIMIT, K3_ENOENT (no shards, a shard the
 * index names is missing, a tensor the index lists is missing), K3_EIO or
 * K3_ENOMEM; on error *out is NULL. Memory: about 210 bytes per tensor
 * (~106 MB for K3's 497,220 tensors). The index and the headers are parsed
 * on up to OMP_NUM_THREADS threads (one when K3_FAULT is set); which error is
 * reported does not depend on thread timing (index first, then shards in
 * name order). */
int k3_st_open(k3_st **out, const char *dir, unsigned flags, k3_err *e);

/*
 * The same for a checkpoint of which only some shards are here (k3-convert
 * --part: each machine holds some of the shards). dir must hold the index;
 * its shard list is the checkpoint's. A shard the index names that is not in
 * dir is stood in for by hdr_dir/NAME.k3hdr, which holds its header only:
 *
 *   0   8  magic "K3STHDR1"
 *   8   8  u64 the shard's size in bytes
 *   16  8  u64 N, the shard's header length
 *   24  8+N the shard's first 8+N bytes, as they are (length prefix, JSON)
 *
 * Its tensors are in the table as if the shard were here (same shard
 * numbers, offsets and sizes: everything that depends only on the headers is
 * the same as with every shard present), k3_st_shard_present says 0, its fd
 * is -1 and reading one of its tensors fails with K3_ENOENT naming it.
 * hdr_dir NULL is k3_st_open. Missing stand-in: K3_ENOENT.
 */
#define K3_ST_STANDIN_MAGIC "K3STHDR1"
#define K3_ST_STANDIN_SUFFIX ".k3hdr"
int k3_st_open_headers(k3_st **out, const char *dir, const char *hdr_dir, unsigned flags, k3_err *e);
/* 1 if shard i's data is here, 0 if only a stand-in is. */
int k3_st_shard_present(const k3_st *st, uint32_t i);
/* Shard i's stand-in bytes (the layout above; read from the shard, or the
 * stand-in's own): a heap buffer the caller frees. */
int k3_st_standin_bytes(const k3_st *st, uint32_t i, uint8_t **buf, uint64_t *len, k3_err *e);
void k3_st_close(k3_st *st);   /* accepts NULL */

uint64_t k3_st_tensor_count(const k3_st *st);
const k3_st_tensor *k3_st_tensor_at(const k3_st *st, uint64_t i);   /* sorted by (shard, offset) */
const k3_st_tensor *k3_st_find(const k3_st *st, const char *name); /* NULL if absent */

uint32_t k3_st_shard_count(const k3_st *st);
const char *k3_st_shard_path(const k3_st *st, uint32_t shard);
const char *k3_st_shard_name(const k3_st *st, uint32_t shard);  /* file name only */
uint64_t k3_st_shard_size(const k3_st *st, uint32_t shard);
int k3_st_shard_fd(const k3_st *st, uint32_t shard);
/* 1 if the shard's fd was opened with O_DIRECT (K3_ST_DIRECT and the
 * filesystem allows it): reads on it must be aligned (k3_io_pread_direct). */
int k3_st_shard_is_direct(const k3_st *st, uint32_t shard);
uint64_t k3_st_shard_data_start(const k3_st *st, uint32_t shard); /* 8 + N */

/* Read a whole tensor / a byte range [off, off+n) of it into dst (any
 * alignment). A range outside the tensor is K3_EARG. On an O_DIRECT shard
 * an aligned request (dst, offset and n multiples of K3_IO_DIRECT_ALIGN)
 * goes straight into dst; anything else goes through a bounce buffer of at
 * most 4 MiB allocated per call (see k3_st_read_range_bounce). Reads go
 * through k3_io_pread*, so K3_FAULT reaches them. */
int k3_st_read(const k3_st *st, const k3_st_tensor *t, void *dst, k3_err *e);
int k3_st_read_range(const k3_st *st, const k3_st_tensor *t, uint64_t off, uint64_t n,
                     void *dst, k3_err *e);
/* The same with a caller-owned bounce buffer for O_DIRECT shards (aligned to
 * K3_IO_DIRECT_ALIGN, at least 3 blocks; unused on buffered shards), so that
 * a loop of reads allocates and faults in nothing. Pieces of bounce_cap - 2
 * blocks are read at a time. */
int k3_st_read_range_bounce(const k3_st *st, const k3_st_tensor *t, uint64_t off, uint64_t n, void *dst,
                            void *bounce, uint64_t bounce_cap, k3_err *e);

/*
 * One shard's header on its own, for k3-verify (which must report every bad
 * shard, not stop at the first) and for fuzzing. hdr/hdr_len is the JSON text
 * (the N bytes after the length prefix), file_size the shard's size. On
 * success *out holds a heap array of *count tensors (names point into *names,
 * one heap block); free both with k3_st_header_free.
 */
typedef struct k3_st_header {
    k3_st_tensor *tensors;
    uint64_t count;
    char *names;
    uint64_t data_start;     /* 8 + N */
} k3_st_header;

int k3_st_header_parse(k3_st_header *h, const char *shard_name, const uint8_t *hdr, uint64_t hdr_len,
                       uint64_t file_size, k3_err *e);
/* Tensors in *h are sorted by offset, with absolute offsets (data_start
 * added) and shard 0. On error h is zeroed (nothing to free). */
/* Read the length prefix and header from an open shard and parse it. */
int k3_st_header_read(k3_st_header *h, int fd, const char *path, k3_err *e);
void k3_st_header_free(k3_st_header *h);

#endif
