/*
 * k3_stream.h - the streaming weight source: run a packed model in a RAM
 * budget, as planned by k3_plan.h.
 */
#ifndef K3_STREAM_H
#define K3_STREAM_H

#include <stdint.h>

#include "k3_plan.h"
#include "k3_ws.h"

/* The matrices that may be streamed in row pieces, in the order the model
 * multiplies them within a layer (attention, then MLP; then the head): each
 * is used once, whole, through k3_model_mm outside parallel regions. MLA
 * kv_b is not among them (read per head inside a parallel loop). If the
 * model's order changes, results stay the same (a piece asked out of order
 * is read again) and the run report's ring drops show it. */
uint32_t k3_stream_piece_slots(const k3_wslot **slots);

/*
 * Open a packed model for streaming. Nothing big is allocated yet: the
 * source can be described (k3_model_open) but not read until
 * k3_ws_stream_start. direct: O_DIRECT where the filesystem allows
 * (k3_ws_stream_direct tells whether it did).
 * k3_ws_stream_plan measures the baseline RSS (unless o->baseline is set),
 * makes the plan, keeps it and copies it to *plan (may be NULL); K3_EBUDGET
 * with the floor in the message if the budget is below the floor.
 * k3_ws_stream_start uses the kept plan (making it first if needed), maps
 * and touches the arenas, reads the pinned groups and starts the reader and
 * I/O threads.
 */
int k3_ws_stream_open(k3_ws **out, const char *dir, int direct, k3_err *e);
int k3_ws_stream_plan(k3_ws *ws, const k3_stream_opts *o, k3_stream_plan *plan, k3_err *e);
/* The byte ranges of the model at dir that rank `rank` of `ranks` never reads
 * when it streams with row pieces of piece bytes (k3_dist.h): the pieces of
 * the other ranks' rows of every streamed matrix, as (file index, [a, b))
 * in file order. For k3-pack --ranks, which leaves them out of a rank's
 * slice. */
int k3_ws_stream_foreign(const char *dir, uint32_t ranks, uint32_t rank, uint64_t piece,
                         void (*cb)(void *arg, uint32_t file, uint64_t a, uint64_t b), void *arg, k3_err *e);
int k3_ws_stream_start(k3_ws *ws, const k3_stream_opts *o, k3_stream_plan *plan, k3_err *e);
/* Publish what the run wrote (the --trace file: flushed, fsynced, renamed
 * from "<path>.tmp"); a write error, a full disk included, is returned and
 * nothing is left. Closing without it removes the unfinished trace. */
int k3_ws_stream_finish(k3_ws *ws, k3_err *e);
/* 1 if every data file is read with O_DIRECT. */
int k3_ws_stream_direct(const k3_ws *ws);
void k3_ws_stream_stats(const k3_ws *ws, k3_stream_stats *st);

#endif
