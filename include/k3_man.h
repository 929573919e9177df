/*
 * k3_man.h - the manifest of a packed model (manifests/FORMAT.md) as a data
 * structure: parse + validate, serialise, the experts.idx table, the expert
 * record layout, and the list of tensors a config expects (docs/MODEL.md §2.3).
 *
 * k3_pk (the read API) is built on this; k3-convert fills a k3_man and
 * serialises it; k3-verify parses it and checks the files against it.
 * Parsing validates everything that can be checked without the data files:
 * schema, types, ranges, alignment, overlaps, tables against the config.
 */
#ifndef K3_MAN_H
#define K3_MAN_H

#include <stdint.h>

#include "k3_cfg.h"
#include "k3_err.h"
#include "k3_pk.h"
#include "k3_schema.h"
#include "k3_st.h"

#define K3_MAN_MAX_BYTES   (64u << 20)
#define K3_MAN_MAX_FILES   65536u
#define K3_MAN_MAX_ITEMS   (16u << 20)
#define K3_MAN_MAX_FNAME   255u
#define K3_MAN_MAX_IDX_BYTES (256u << 20)  /* experts.idx: 16M records; K3 needs 1.3 MB */
#define K3_MAN_IDX_MAGIC   "K3EXIDX1"
#define K3_MAN_IDX_HEADER  64u
#define K3_MAN_IDX_ENTRY   16u

/* One upstream file the packed model came from. */
typedef struct k3_man_src {
    char *name;
    uint64_t size;
    uint8_t sha256[32];
} k3_man_src;

typedef struct k3_man {
    uint32_t schema_version;
    char *producer;
    k3_cfg cfg;
    char *cfg_json;                /* the normalised config text as stored */
    k3_pk_file *files;             /* path is NULL here (k3_pk fills it) */
    uint32_t nfiles;
    k3_man_src *src_shards;
    uint32_t nsrc_shards;
    k3_man_src *src_files;
    uint32_t nsrc_files;
    char expert_format[16];        /* "mxfp4", "bf16", ..., "none" */
    /* Tensors of the source not in the model: outside "language_model."
     * (the vision tower) and inside it but not used by the config. */
    uint64_t left_outside_n, left_outside_bytes, left_unused_n, left_unused_bytes;
    /* Trunk dtypes: "source" (every tensor as stored upstream) or "bf16"
     * (k3-convert --trunk-dtype bf16: F16/F32 rounded); trunk_rounded counts
     * the tensors whose dtype changed (src_dtype != dtype); lossy iff > 0. */
    char trunk_dtypes[16];
    uint32_t trunk_rounded;
    k3_pk_unit *units;
    uint32_t nunits;
    k3_pk_tensor *tensors;         /* sorted by name; names/pieces owned by the k3_man */
    uint32_t ntensors;
    int has_experts;
    uint32_t expert_index_file;    /* index into files */
    uint32_t embed_crc_file;       /* index into files: the one file of kind embed_row_crcs */
    k3_pk_expert_layout xl;
    char *plan_json;               /* a JSON object text */
} k3_man;

/* Parse and validate manifest text. path is for messages. On error *m is
 * freed and zeroed. */
int k3_man_parse(k3_man *m, const char *text, uint64_t len, const char *path, k3_err *e);
/* Serialise (heap text, caller frees; NULL on allocation failure). Tensors
 * must already be sorted by name. */
char *k3_man_to_json(const k3_man *m);
/* Frees everything a k3_man owns (as allocated by k3_man_parse or by a
 * producer using malloc/strdup), then zeroes it. Accepts NULL. */
void k3_man_free(k3_man *m);

/* The record layout of FORMAT.md §1.2 for W1/W3 [I][L], W2 [L][I]. */
int k3_man_expert_layout(k3_pk_expert_layout *xl, uint64_t I, uint64_t L, k3_err *e);

/* Number of MoE layers and (layer -> moe index) mapping. */
uint32_t k3_man_moe_layers(const k3_cfg *cfg);

/* experts.idx: size, encode (buf of k3_man_idx_size bytes), decode +
 * validate against the manifest (file kinds, alignment, bounds, overlaps with
 * each other and with trunk units). recs has n_moe_layers*n_experts entries. */
uint64_t k3_man_idx_size(const k3_cfg *cfg);
void k3_man_idx_encode(uint8_t *buf, const k3_cfg *cfg, uint64_t stride, const k3_pk_record *recs);
int k3_man_idx_decode(const k3_man *m, const uint8_t *buf, uint64_t len, k3_pk_record *recs,
                      const char *path, k3_err *e);

/* embed.crc: the little-endian u32 CRC32 of each embedding row, row order. */
#define K3_MAN_EMBED_CRC_NAME "embed.crc"
static inline uint64_t k3_man_embed_crc_size(const k3_cfg *cfg) { return 4ull * cfg->vocab_size; }

/* SHA-256 hex helpers: out has room for 65 bytes. */
void k3_man_hex(const uint8_t sha[32], char out[65]);
int k3_man_unhex(const char *s, uint8_t sha[32]);   /* 0 or -1 */

/* Sealed journal entries (k3-convert and k3-pack --resume): the lowercase
 * hex SHA-256 of the body, a newline, then the body. k3_man_seal returns a
 * malloc'd entry of *out_len bytes (NULL when out of memory). k3_man_unseal
 * returns the body inside txt and its length, or NULL when the entry does
 * not hash to its first line: such an entry is never trusted. */
char *k3_man_seal(const char *body, size_t len, size_t *out_len);
const char *k3_man_unseal(const char *txt, uint64_t len, size_t *body_len);

/* ---- what a config expects (docs/MODEL.md §2.3) ---------------------------------- */

#define K3_MAN_PREFIX K3_SCH_PREFIX
#define K3_MAN_HEAD_NAME "language_model." K3_SCH_HEAD_NAME

typedef enum k3_man_tkind {
    K3_MAN_T_MATRIX = 0,   /* shape must match exactly */
    K3_MAN_T_VECTOR,       /* element count must match (any rank) */
    K3_MAN_T_ALOG,         /* element count H or D */
} k3_man_tkind;

typedef struct k3_man_expect {
    char *name;
    k3_man_tkind kind;
    int32_t layer;           /* unit layer: 0..n-1, K3_PK_LAYER_EMBED, K3_PK_LAYER_HEAD */
    uint32_t ndim;
    uint64_t shape[3];
} k3_man_expect;

/* Every trunk (non-expert) tensor the config expects, sorted by name. Free
 * with k3_man_expect_free. */
int k3_man_expect_trunk(const k3_cfg *cfg, k3_man_expect **out, uint32_t *n, k3_err *e);
void k3_man_expect_free(k3_man_expect *x, uint32_t n);
const k3_man_expect *k3_man_expect_find(const k3_man_expect *x, uint32_t n, const char *name);
/* 1 if t matches x (shape/count), 0 if not. */
int k3_man_expect_match(const k3_man_expect *x, const k3_st_tensor *t);

/* Routed expert tensor names: "...layers.{L}.block_sparse_moe.experts.{e}.{w1|w2|w3}.{part}"
 * part: weight_packed, weight_scale, weight, weight_scale_inv. */
enum { K3_MAN_XP_PACKED = 0, K3_MAN_XP_SCALE, K3_MAN_XP_WEIGHT, K3_MAN_XP_SCALE_INV, K3_MAN_XP_COUNT };
/* Parse an expert tensor name; which is 0 for w1, 1 for w2, 2 for w3.
 * Returns 1 if name is an expert tensor, 0 if not. */
int k3_man_expert_name(const char *name, uint32_t *layer, uint32_t *expert, int *which, int *part);

#endif
