/*
 * k3_pk.h - read a packed model directory (the output of k3-convert/k3-pack).
 *
 * Layout (every byte is documented in manifests/FORMAT.md):
 *
 *   DIR/manifest.json      written last; its presence means the rest is complete
 *   DIR/trunk-GGGG.k3t     trunk units: tensors in their upstream dtype (BF16, F16, F32),
 *                          each unit 4096-aligned, tensors 64-aligned inside it;
 *                          k3-convert writes one unit per layer (GGGG: the
 *                          upstream shard the unit was completed in)
 *   DIR/experts-GGGG.k3e   expert records, each at a 4096-aligned offset, all of
 *                          one fixed stride (record_bytes rounded up to 4096)
 *   DIR/experts.idx        binary record table: (layer, expert) -> file, offset,
 *                          CRC32; covered by its SHA-256 in the manifest
 *   DIR/tiktoken.model, DIR/tokenizer_config.json   copied when the source had them
 *
 * One expert record (offsets from the record start, each section 64-aligned):
 *   W1 packed [I][L/2] | W1 scales [I][L/32] | W3 packed [I][L/2] |
 *   W3 scales [I][L/32] | W2 packed [L][I/2] | W2 scales [L][I/32] | zero pad
 * Packed bytes and scales are exactly the OCP MXFP4 bytes of docs/MODEL.md §2.5 (low
 * nibble = even element), i.e. what k3_gemm_mx takes. CRC32 (zlib) of a
 * record covers the whole stride (padding included); CRC32 of a unit covers
 * its nbytes (padding included).
 *
 * k3_pk_open parses and validates manifest.json completely (schema version,
 * bounds, alignment, no overlaps, every table consistent with the config) and
 * checks the SHA-256 of experts.idx; it does NOT hash the data files (that is
 * k3-verify's job); it only checks their sizes. A directory without
 * manifest.json is refused: "incomplete packed model: no manifest.json".
 *
 * Lifetime: every pointer returned is borrowed and valid until k3_pk_close.
 * A k3_pk is read-only after open and safe to use from several threads.
 */
#ifndef K3_PK_H
#define K3_PK_H

#include <stdint.h>

#include "k3_cfg.h"
#include "k3_err.h"
#include "k3_st.h"

/* 2: trunk tensors in the dtype they were stored in upstream (BF16, F16 or
 * F32) unless rounding was asked for and recorded; the manifest names what
 * was left out. Schema 1 (every F16/F32 matrix rounded to BF16, silently) is
 * refused with a message to convert again. */
#define K3_PK_SCHEMA_VERSION 2
#define K3_PK_ALIGN          4096u  /* file offsets of units and records, unit sizes, stride */
#define K3_PK_SECTION_ALIGN  64u    /* tensors in a unit, sections in a record */

/* Flags for k3_pk_open. */
#define K3_PK_DIRECT 1u  /* open data files with O_DIRECT where the filesystem allows it */

/* Unit "layer" values besides 0..num_hidden_layers-1. */
#define K3_PK_LAYER_EMBED (-1)   /* embed_tokens */
#define K3_PK_LAYER_HEAD  (-2)   /* norm, output_attn_res_*, lm_head */

/* Unit flags. */
#define K3_PK_UNIT_PINNED 1u     /* k3-pack asked for this unit to stay resident */

typedef enum k3_pk_file_kind {
    K3_PK_FILE_TRUNK = 0,        /* trunk units */
    K3_PK_FILE_EXPERTS,          /* expert records */
    K3_PK_FILE_EXPERT_INDEX,     /* experts.idx */
    K3_PK_FILE_TOKENIZER,        /* tiktoken.model, tokenizer_config.json */
    K3_PK_FILE_EMBED_CRC,        /* embed.crc: CRC32 of each embedding row */
    K3_PK_FILE_KIND_COUNT
} k3_pk_file_kind;

typedef struct k3_pk_file {
    const char *name;            /* file name inside the directory */
    const char *path;            /* DIR/name */
    k3_pk_file_kind kind;
    uint64_t size;
    uint8_t sha256[32];
} k3_pk_file;

/* A contiguous row range of a trunk tensor stored in one unit. k3-convert
 * always writes one piece covering all rows; k3-pack may split a tensor by
 * rows (dimension 0) over several units. */
typedef struct k3_pk_piece {
    uint32_t unit;               /* index into the unit table */
    uint64_t row_begin, row_end; /* [row_begin, row_end) of shape[0] */
    uint64_t offset;             /* absolute byte offset in the unit's file */
    uint64_t nbytes;             /* (row_end - row_begin) * row bytes */
} k3_pk_piece;

typedef struct k3_pk_tensor {
    const char *name;            /* the upstream name (the tensor schema's, with its prefix) */
    k3_dtype dtype;              /* as stored: K3_DT_BF16, K3_DT_F16 or K3_DT_F32 */
    k3_dtype src_dtype;          /* upstream dtype; differs from dtype only when
                                  * k3-convert --trunk-dtype bf16 rounded it */
    uint32_t ndim;
    uint64_t shape[K3_ST_MAX_DIMS];
    uint64_t nbytes;             /* whole tensor */
    uint32_t npieces;            /* >= 1 */
    const k3_pk_piece *pieces;   /* sorted by row_begin, covering all rows */
} k3_pk_tensor;

typedef struct k3_pk_unit {
    uint32_t file;               /* index into the file table */
    uint64_t offset;             /* multiple of 4096 */
    uint64_t nbytes;             /* multiple of 4096 */
    int32_t layer;               /* 0..n-1, K3_PK_LAYER_EMBED or K3_PK_LAYER_HEAD */
    uint32_t flags;              /* K3_PK_UNIT_* */
    uint32_t crc32;              /* zlib crc32 of the nbytes bytes at offset */
} k3_pk_unit;

/* Where the six matrices of a record live, relative to the record start. */
typedef struct k3_pk_expert_layout {
    uint32_t rows_w13, cols_w13;       /* I, L: W1 and W3 are [I][L] */
    uint32_t rows_w2, cols_w2;         /* L, I: W2 is [L][I] */
    uint64_t w1_packed, w1_scales;     /* offsets */
    uint64_t w3_packed, w3_scales;
    uint64_t w2_packed, w2_scales;
    uint64_t w13_packed_bytes;         /* I*L/2 */
    uint64_t w13_scales_bytes;         /* I*L/32 */
    uint64_t w2_packed_bytes;          /* L*I/2 */
    uint64_t w2_scales_bytes;          /* L*I/32 */
    uint64_t record_bytes;             /* end of the W2 scales */
    uint64_t stride;                   /* record_bytes rounded up to 4096 */
} k3_pk_expert_layout;

/* One entry of the record table (also the on-disk entry of experts.idx,
 * little-endian). */
typedef struct k3_pk_record {
    uint32_t file;               /* index into the file table */
    uint32_t crc32;              /* zlib crc32 of the stride bytes at offset */
    uint64_t offset;             /* multiple of 4096 */
} k3_pk_record;

typedef struct k3_pk k3_pk;

/* Open DIR: parse and validate manifest.json and experts.idx, open the data
 * files read-only (O_DIRECT with K3_PK_DIRECT where possible), check their
 * sizes. Errors: K3_ENOENT (no manifest.json: "incomplete packed model"),
 * K3_EFORMAT (schema/consistency), K3_EIO (missing/short file), K3_ECORRUPT
 * (experts.idx hash). */
int k3_pk_open(k3_pk **out, const char *dir, unsigned flags, k3_err *e);
void k3_pk_close(k3_pk *pk);   /* accepts NULL */

const k3_cfg *k3_pk_cfg(const k3_pk *pk);
const char *k3_pk_dir(const k3_pk *pk);
/* The directory holding the tokenizer files (the packed dir itself), and the
 * path of one of them ("tiktoken.model", "tokenizer_config.json"), NULL if
 * the packed model has none. */
const char *k3_pk_tokenizer_dir(const k3_pk *pk);
const char *k3_pk_tokenizer_file(const k3_pk *pk, const char *name);
/* The SHA-256 the manifest records for that tokenizer file (32 bytes,
 * borrowed), NULL if the packed model has no such file. */
const uint8_t *k3_pk_tokenizer_sha256(const k3_pk *pk, const char *name);

/* Data files. */
uint32_t k3_pk_file_count(const k3_pk *pk);
const k3_pk_file *k3_pk_file_at(const k3_pk *pk, uint32_t i);
/* 1 if file i was opened with O_DIRECT (reads must then go through
 * k3_pk_read with an aligned bounce buffer, or be aligned themselves). */
int k3_pk_file_is_direct(const k3_pk *pk, uint32_t i);

/* Trunk. Tensors are sorted by name; units by (file, offset). */
uint32_t k3_pk_tensor_count(const k3_pk *pk);
const k3_pk_tensor *k3_pk_tensor_at(const k3_pk *pk, uint32_t i);
const k3_pk_tensor *k3_pk_tensor_find(const k3_pk *pk, const char *name); /* NULL if absent */
uint32_t k3_pk_unit_count(const k3_pk *pk);
const k3_pk_unit *k3_pk_unit_at(const k3_pk *pk, uint32_t i);
/* The units holding a layer's trunk (layer 0..n-1, K3_PK_LAYER_EMBED or
 * K3_PK_LAYER_HEAD), in file order: *ids borrowed, *n may be 0. */
void k3_pk_layer_units(const k3_pk *pk, int32_t layer, const uint32_t **ids, uint32_t *n);

/* Experts. NULL / 0 when the model has no MoE layer. */
const k3_pk_expert_layout *k3_pk_experts(const k3_pk *pk);
/* Record of (layer, expert); NULL if layer is not a MoE layer or expert is out
 * of range. */
const k3_pk_record *k3_pk_record_find(const k3_pk *pk, uint32_t layer, uint32_t expert);

/* The embedding table is read a row at a time (its unit's CRC covers the
 * whole table): compare the n bytes of row `row` as read (from path at off,
 * for the message) with that row's CRC32 in embed.crc (loaded and checked
 * against the manifest's SHA-256 at open). A mismatch is K3_ECORRUPT naming
 * the file, the row and the offset. */
int k3_pk_embed_row_check(const k3_pk *pk, uint32_t row, const void *bytes, uint64_t n, const char *path,
                          uint64_t off, k3_err *e);

/* The one embedding lookup of the packed sources (resident and streaming):
 * row id of the embedding tensor embed, read from the piece that holds it
 * into rowbuf (room for one row in the stored dtype) through k3_pk_read
 * (bounce as there), checked with k3_pk_embed_row_check, widened to
 * hidden_size floats at out. *cost (may be NULL) gets the bytes the read
 * took from the disk: whole pages when the file is O_DIRECT. K3_EARG for an
 * id past the vocabulary; dir names the model in messages. */
int k3_pk_embed_row(const k3_pk *pk, const k3_pk_tensor *embed, uint32_t id, void *rowbuf, void *bounce,
                    uint64_t bounce_cap, float *out, uint64_t *cost, const char *dir, k3_err *e);

/* The table itself: vocab_size CRC32s, row order (borrowed). */
const uint32_t *k3_pk_embed_row_crcs(const k3_pk *pk);

/* The plan k3-convert/k3-pack recorded (a JSON object text), borrowed. */
const char *k3_pk_plan_json(const k3_pk *pk);

/* Read n bytes at off of data file i into dst, through k3_io_pread (or
 * k3_io_pread_direct with bounce/bounce_cap when the file is O_DIRECT and the
 * request is not aligned), so fault injection applies. */
int k3_pk_read(const k3_pk *pk, uint32_t file, void *dst, uint64_t n, uint64_t off,
               void *bounce, uint64_t bounce_cap, k3_err *e);

/* Read a whole record (stride bytes) into dst (4096-aligned, capacity >=
 * stride) and, if check_crc, compare its CRC32: a mismatch is K3_ECORRUPT
 * naming the file, layer, expert and offset. */
int k3_pk_read_record(const k3_pk *pk, uint32_t layer, uint32_t expert, void *dst,
                      int check_crc, k3_err *e);
/* Read a whole unit (nbytes) into dst (4096-aligned), CRC-checked if asked. */
int k3_pk_read_unit(const k3_pk *pk, uint32_t unit, void *dst, int check_crc, k3_err *e);

#endif
