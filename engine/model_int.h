/*
 * model_int.h - private structures of the forward pass shared by model.c,
 * kda.c, mla.c and moe.c. Nothing here is API.
 *
 * Invariants: every scratch buffer is sized at k3_model_open for max_chunk
 * rows; per-session buffers (state, caches, attention scores) at
 * k3_sess_create for max_ctx positions. Nothing is allocated per token.
 *
 * A pass: up to max_chunk rows, the tokens of one or more sessions laid end
 * to end (m->segs, each session at most once). Every row-wise part (norms,
 * products, attention residuals, routing, experts) runs over all rows at
 * once; the KDA conv and recurrence and the MLA attention run per segment on
 * its own session's state and positions.
 */
#ifndef K3_MODEL_INT_H
#define K3_MODEL_INT_H

#include <math.h>
#include <omp.h>
#include <stdint.h>

#include "k3_dist.h"
#include "k3_kern.h"
#include "k3_model.h"
#include "k3_ws.h"

typedef struct k3_dims {
    uint32_t E, V, NL, H, D, P, CW, MH, NOPE, ROPE, VD, QK, QL, KVL;
    uint32_t NE, TOPK, LAT, I, NSH, IDN, B, NB;
    uint32_t n_kda, n_mla;
    float eps, lb, b1, b2, rsf;
    int mla_gate, renorm, moe_norm;
} k3_dims;

/* One session's rows in a pass: rows [row, row + n), positions s->pos on. */
typedef struct k3_seg {
    k3_sess *s;
    uint32_t row, n;
} k3_seg;

/* Rows of the product tmp buffer per pass row (k3_model_mm's row blocks). */
#define K3_MM_BLOCK 4096u

struct k3_model {
    k3_ws *ws;
    k3_cfg cfg;
    k3_dims d;
    uint32_t max_chunk;
    int nthreads;
    uint32_t *layer_slot;     /* per layer: index among KDA layers or among MLA layers */
    /* the current group's vectors widened to f32 (NULL if absent) */
    float *vf[K3_W_COUNT];
    float *smalls;            /* storage for vf, sized for the largest group */
    uint64_t smalls_cap;
    float *f_sa, *f_mlp, *f_out;  /* folded AttnRes query norm_w * proj_w, [E] */
    /* trunk scratch, T = max_chunk */
    float *h, *prefix, *stack, *xn, *attn, *mlp, *head_x;
    /* KDA */
    float *kq, *kk, *kv, *kg, *kb, *kfa, *kz, *kcq, *kck, *kcv, *ko;
    /* MLA */
    float *mqa, *mq, *mc, *mqlat, *molat, *mov, *mo, *mg;
    /* dense MLP and shared experts */
    float *dg, *du;
    /* MoE */
    float *rs, *rw, *mz, *mx, *m1, *m3, *my, *mout, *macc, *mup;
    uint32_t *rsel, *eids, *etok, *eslot, *ecount;
    /* the pass: segments, row -> segment, ids, the rows the head computes
     * and where each goes */
    k3_seg *segs;
    uint32_t nseg, rows, nhead;
    uint32_t *rowseg, *ids, *head_row;
    float **head_dst;
    float *mmtmp;             /* max_chunk x K3_MM_BLOCK: product row blocks */
    k3_model_times times;
    double *layer_s;          /* per layer compute seconds */
    /* over several ranks (k3_dist.h; NULL in one process): this model's
     * number in rank 0's orders, and the gather buffers: dsend a status and
     * this rank's share of a product round or of the expert outputs, drecv
     * every rank's */
    k3_dist *dist;
    uint32_t dist_id;
    uint64_t dist_round_rows;  /* the most rows of a streamed matrix's piece (a round holds one) */
    uint8_t *dsend, *drecv;
    const void **dparts;
};

struct k3_sess {
    const k3_model *m;
    uint32_t pos, max_ctx;
    float *kda_state;   /* n_kda x H x D x D, rows = key channels */
    float *conv_hist;   /* n_kda x 3 x (CW-1) x P, oldest first; q, k, v */
    float *mla_cache;   /* n_mla x max_ctx x (KVL + ROPE) */
    float *scores;      /* nthreads x head group x max_ctx (mla.c) */
    uint32_t dist_id;   /* its number in rank 0's orders (k3_dist.h) */
};

/* MLA attends one row for a group of up to K3_MLA_HEAD_GROUP heads at a
 * time (mla.c), each with a score row of max_ctx floats per thread. */
#define K3_MLA_HEAD_GROUP 8u
static inline uint32_t k3_mla_head_group(uint32_t heads)
{
    return heads == 0 ? 1 : heads < K3_MLA_HEAD_GROUP ? heads : K3_MLA_HEAD_GROUP;
}

/* Below this much work (multiply-adds) a loop is not worth waking threads
 * for: on a busy machine a fork/join costs milliseconds. Never affects
 * results (work is only ever split over independent outputs). */
extern uint64_t k3_model_par_min;
#define K3_PAR_MIN k3_model_par_min

/* K3_PAR_FOR(cond, for (...) {...}): the loop (over independent outputs) on
 * the OpenMP threads when cond holds, we are not inside a parallel region
 * and there is more than one thread; otherwise on this thread without
 * entering a parallel region at all. libgomp allocates a fresh team for
 * every one-thread region (an `if` clause that is false included), and a
 * decode step must not allocate. Which threads run which outputs never
 * changes a number. K3_PAR_FOR_DYNAMIC: schedule(dynamic, 1) on nt threads. */
#define K3_PAR_OK(cond) ((cond) && !omp_in_parallel() && omp_get_max_threads() > 1)
#define K3_PAR_FOR(cond, ...)                                  \
    do {                                                       \
        if (K3_PAR_OK(cond)) {                                 \
            _Pragma("omp parallel for schedule(static)")       \
            __VA_ARGS__                                        \
        } else {                                               \
            __VA_ARGS__                                        \
        }                                                      \
    } while (0)
#define K3_PAR_FOR_DYNAMIC(cond, nt, ...)                                       \
    do {                                                                        \
        int k3_par_nt = (int)(nt);                                              \
        if (K3_PAR_OK(cond) && k3_par_nt > 1) {                                 \
            _Pragma("omp parallel for schedule(dynamic, 1) num_threads(k3_par_nt)") \
            __VA_ARGS__                                                         \
        } else {                                                                \
            __VA_ARGS__                                                         \
        }                                                                       \
    } while (0)

/* ---- helpers (model.c) ---- */
/* k3_expf/k3_tanhf (kernels/ref.c), not libm's: the same bits on every
 * architecture and C library */
static inline float k3_sigmoidf(float x) { return 1.0f / (1.0f + k3_expf(-x)); }
static inline float k3_siluf(float x) { return x * k3_sigmoidf(x); }
/* SiTU-GLU: k3_situ (the kernels' paths) */

/* Y[T][rows] = X[T][cols] . W^T for a BF16, F16 or F32 matrix view (T <=
 * max_chunk; outside parallel regions: it may use m->mmtmp). 0, or the
 * first error of a streamed matrix's read (in *e; the rest of the product is
 * not computed and the caller returns it at once). */
int k3_model_mm(k3_model *m, const k3_view *W, const float *X, uint32_t T, float *Y, k3_err *e);

/* For each of H heads h: rows [h * rows_per_head + off, + rows) of W times
 * the head's own X + h * x_stride, into Y + h * T * rows. Over several
 * ranks each rank computes whole heads and one gather gives every rank
 * every head. */
int k3_model_mm_heads(k3_model *m, const k3_view *W, uint32_t H, uint64_t rows_per_head, uint64_t off, uint64_t rows,
                      const float *X, uint64_t x_stride, uint32_t T, float *Y, k3_err *e);
/* Over several ranks: every rank's share of the expert outputs m->mout of
 * the pass's T rows (rank e mod N ran expert e), into every rank's m->mout;
 * code is this rank's status (0 or its failure), the result as
 * k3_dist_gather. */
int k3_model_dist_experts(k3_model *m, uint32_t T, int code, k3_err *e);
/* Over several ranks: code agreed by every rank (k3_dist_agree); code
 * itself in one process. */
int k3_model_agree(k3_model *m, int code, k3_err *e);

/* Return a negative status at once. */
#define K3_TRY(x)                  \
    do {                           \
        int k3_try_rc = (x);       \
        if (k3_try_rc < 0)         \
            return k3_try_rc;      \
    } while (0)
/* RMSNorm of T rows of n floats (y may equal x); w may be NULL (no weight). */
void k3_model_rmsnorm(const float *x, const float *w, uint32_t n, uint32_t T, float eps, float *y);

/* ---- layer parts ---- */
/* Over the pass's m->rows rows, each segment on its own session. */
int k3_kda_forward(k3_model *m, uint32_t layer, const k3_view *v, uint32_t T, k3_err *e);
int k3_mla_forward(k3_model *m, uint32_t layer, const k3_view *v, uint32_t T, k3_err *e);
int k3_mlp_dense_forward(k3_model *m, const k3_view *v, uint32_t T, k3_err *e);
int k3_moe_forward(k3_model *m, uint32_t layer, const k3_view *v, uint32_t T, k3_err *e);
/* Route the T rows of x (what the MoE input would be if the attention added
 * nothing) and give the experts picked to the source as a guess
 * (k3_ws_experts_guess). Uses the routing scratch; changes no number. */
void k3_moe_guess(k3_model *m, uint32_t layer, const k3_view *v, const float *x, uint32_t T);

#endif
