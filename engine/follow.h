/*
 * follow.h - rank 0's orders to the follower ranks (private to engine/;
 * the protocol and the follower's loop: engine/follow.c, docs/DIST.md).
 *
 * Every call that changes what a model holds - an engine opened, planned,
 * loaded or closed, a sequence created, freed, reset, copied or loaded, a
 * batch run - is, on rank 0, first sent to the followers as an order, then
 * done on every rank, then (where a rank may fail alone) agreed: every rank
 * returns the lowest failing rank's error. A call made inside another
 * (k3_engine_load planning, k3_engine_close freeing its sequences) sends no
 * order of its own: the followers make the same inner call themselves.
 */
#ifndef K3_FOLLOW_H
#define K3_FOLLOW_H

#include <stdint.h>

#include "k3_dist.h"
#include "k3_engine.h"
#include "k3_model.h"

enum {
    K3_ORD_EXIT = 1, K3_ORD_OPEN, K3_ORD_PLAN, K3_ORD_LOAD, K3_ORD_CLOSE, K3_ORD_SEQ_NEW, K3_ORD_SEQ_FREE,
    K3_ORD_SEQ_RESET, K3_ORD_SEQ_COPY, K3_ORD_SEQ_LOAD, K3_ORD_FORWARD,
};

typedef struct k3_order {
    uint32_t op, engine, a, b;
    uint64_t len;              /* bytes of payload that follow */
} k3_order;

/* Rank 0, outermost call: send o and its payload (*sent = 1). Elsewhere
 * nothing (*sent = 0). With d NULL nothing at all. */
int k3_order_begin(k3_dist *d, const k3_order *o, const void *payload, int *sent, k3_err *e);
/* Close what k3_order_begin opened; with agree, code (and value, named by
 * what) agreed by every rank (k3_dist_agree). Returns the result. */
int k3_order_end(k3_dist *d, int sent, int agree, int code, uint32_t value, const char *what, k3_err *e);
/* The number of a new engine or sequence: rank 0 counts, a follower takes
 * the one of the order it carries out. */
uint32_t k3_order_id(void);
/* Rank 0's k3_engine_open (as k3_order_begin): the order with the options
 * and strings of o. */
int k3_order_open(k3_dist *d, uint32_t id, const char *dir, const k3_engine_opts *o, int *sent, k3_err *e);
/* Rank 0: the batch k3_model_forward_batch is about to run. */
int k3_order_forward(k3_model *m, const k3_model_seq *q, uint32_t n, k3_err *e);

/* For the follower (engine.c). */
k3_seq *k3_engine_seq_find(k3_engine *en, uint32_t id);
k3_model *k3_engine_model(k3_engine *en);
k3_sess *k3_seq_sess(k3_seq *q);
/* The numbers the orders name a model (its engine's) and a session by
 * (model.c). */
void k3_model_dist_id_set(k3_model *m, uint32_t id);
void k3_sess_dist_id_set(k3_sess *s, uint32_t id);

#endif
