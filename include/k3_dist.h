/*
 * k3_dist.h - one model over several processes (ranks): what the forward pass
 * needs from a message layer, and how the work is split (docs/DIST.md).
 *
 * Rank 0 runs the tool (k3-run, k3-serve) as on one machine. Every other
 * rank is a follower: it runs no tool code, only what rank 0 tells it, in
 * the same order: open an engine, plan, load, create a sequence, run a
 * step... (engine/follow.c). Each rank opens the model from its own disk
 * under its own budget and computes only its share of every product:
 *   - a trunk product's output rows are split in one range per rank
 *     (k3_dist_rows): each output row is computed wholly by one rank, with
 *     the one kernel of every rank count, then every rank gets every row
 *     (allgather, in rounds of at most K3_DIST_ROUND_ROWS rows per rank);
 *   - routed expert e runs on rank e mod N (k3_dist_expert_rank) for the
 *     rows that route to it; the outputs go to every rank, which sums them in
 *     each row's top-k order, as one process does.
 * Everything else (norms, attention, routing, sampling's inputs) is computed
 * on every rank from the same bits, so it gives the same bits: at any rank
 * count the logits are those of one process.
 *
 * Every collective carries each rank's status: a rank that failed (a read,
 * a CRC) still takes part, and then every rank returns the error of the
 * lowest failing rank, so the ranks stay in step and rank 0 names the rank
 * and the problem. A collective that does not complete within the timeout
 * (a rank stopped or lost without the launcher noticing) ends the job with
 * one line naming the rank that waited and how long (k3_dist_ops.abort).
 */
#ifndef K3_DIST_H
#define K3_DIST_H

#include <stdint.h>

#include "k3_err.h"

/* The status every contribution starts with (when one is not 0, every rank
 * then sends its message: a second collective, only on failure). */
typedef struct k3_dist_status {
    int32_t code;              /* 0 or the K3_E* of this rank's failure */
    uint32_t value;            /* a number every rank must agree on (k3_dist_agree) */
    uint64_t pad;
} k3_dist_status;

/* What a run sent and received, per rank: for the cost model. */
typedef struct k3_dist_stats {
    uint64_t collectives;      /* every collective (gathers, broadcasts, agreements) */
    uint64_t trunk_gathers;    /* of which: trunk product rounds */
    uint64_t expert_gathers;   /* expert output exchanges (one per MoE layer and pass) */
    uint64_t commands;         /* rank 0's orders to the followers */
    uint64_t bytes_out, bytes_in;   /* payload this rank contributed and received */
} k3_dist_stats;

typedef struct k3_dist k3_dist;

/* The most ranks a job may have. */
#define K3_DIST_MAX_RANKS 256u

/* The message layer (engine/dist.c holds none: the MPI build gives one). All
 * calls are collective: every rank calls them in the same order. */
typedef struct k3_dist_ops {
    /* Every rank's n[q] bytes, in rank order, end to end into all, on
     * every rank. */
    int (*gather)(k3_dist *d, const void *mine, uint64_t n_mine, void *all, const uint64_t *n, k3_err *e);
    /* n bytes from rank 0 to every rank. wait_forever: a follower waiting
     * for its next order (rank 0 may be waiting for a user). */
    int (*bcast)(k3_dist *d, void *buf, uint64_t n, int wait_forever, k3_err *e);
    /* End the whole job now with this exit status (after one line on stderr). */
    void (*abort)(k3_dist *d, int status);
} k3_dist_ops;

struct k3_dist {
    const k3_dist_ops *ops;
    uint32_t rank, size;
    double timeout_s;          /* a collective that takes longer ends the job */
    k3_dist_stats st;
    void *impl;
};

/* The process's ranks: NULL in a single process (the default). Set once by
 * the MPI build's launcher before anything is opened. */
k3_dist *k3_dist_get(void);
void k3_dist_set(k3_dist *d);

/* A follower rank's life (engine/follow.c): carry out rank 0's orders
 * until it says exit. An error of an order is rank 0's to report; the
 * result is a failure of the messages themselves. */
int k3_follow(k3_dist *d, k3_err *e);
/* Rank 0, leaving: the followers' last order. */
int k3_follow_stop(k3_dist *d, k3_err *e);

/* The output rows of a matrix of rows rows that rank q of size computes:
 * [*lo, *hi), one contiguous range per rank, its ends multiples of 16 (but
 * the last). A streaming source reads only these rows of each streamed
 * matrix (its pieces are cut at these ends). */
void k3_dist_rows(uint64_t rows, uint32_t q, uint32_t size, uint64_t *lo, uint64_t *hi);
/* Rows per rank per gather round: the buffers hold this many rows per rank. */
#define K3_DIST_ROUND_ROWS 4096u
static inline uint32_t k3_dist_expert_rank(uint32_t expert, uint32_t size) { return expert % size; }

/* Every rank's code and value: 0 if every code is 0 and every value equals
 * rank 0's; otherwise the lowest failing rank's error ("rank R: ..."), or a
 * value mismatch named by what. */
int k3_dist_agree(k3_dist *d, int code, const k3_err *mine, uint32_t value, const char *what, k3_err *e);

/* As ops->gather, with each rank's status in front of its bytes: send holds
 * sizeof(k3_dist_status) bytes for it, then this rank's n[rank] bytes and
 * room to round them up to a multiple of 8; recv takes size statuses and
 * the sum of n, each rounded up to a multiple of 8. parts[q]
 * is set to rank q's bytes in recv. Returns as k3_dist_agree. */
int k3_dist_gather(k3_dist *d, int code, const k3_err *mine, void *send, const uint64_t *n, void *recv,
                   const void **parts, k3_err *e);

#endif
