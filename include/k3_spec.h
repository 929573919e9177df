/*
 * k3_spec.h - speculative decoding that never changes the output.
 *
 * A drafter guesses the next ids; the verifier feeds the ids it has not yet
 * fed plus the guesses to the model as one chunk (one pass over the weights),
 * samples every position of the chunk exactly as one-at-a-time decoding
 * would (the sampler's draw j depends only on (seed, j), k3_gen.h), keeps the
 * guesses up to the first one the model would not have produced, and adds
 * the model's own token there. Tokens and logits are the bits of
 * k3_gen_seq: the engine gives a chunk of T tokens the bits of T single
 * steps, and rejected positions never reach the caller's sequence.
 *
 * Rollback: before a pass with guesses the committed sequence is copied
 * (k3_seq_copy) into a second one and the chunk runs there. All guesses
 * right: the two swap roles (nothing recomputed). A guess wrong: the copy is
 * dropped; the ids the pass confirmed (fed, but in the dropped copy) are
 * carried into the next pass's chunk instead of being re-fed alone, so a
 * rejection costs a state copy and a longer next chunk, never an extra pass
 * over the weights. runtime/RUN.md (Speculative decoding) has the costs at K3
 * size.
 *
 * Draft length adapts: it doubles (up to k_max) after a pass whose guesses
 * were all right, falls to one more than the accepted count otherwise, and
 * after two passes in a row with nothing accepted drafting pauses for 1, 2,
 * 4 ... 64 tokens (plain decode steps), probing again after each pause.
 */
#ifndef K3_SPEC_H
#define K3_SPEC_H

#include <stdint.h>

#include "k3_err.h"
#include "k3_engine.h"
#include "k3_gen.h"

/*
 * A drafter: propose(d, hist, n, max, out) writes at most max guessed ids to
 * follow hist[0..n) (the prompt and every id generated so far) into out and
 * returns how many (0: no guess). It must not allocate per call if the
 * caller's decode is to stay allocation-free. A draft model or a multi-token
 * head is another drafter; the verifier does not change.
 */
typedef struct k3_drafter k3_drafter;
struct k3_drafter {
    const char *name;
    uint32_t (*propose)(k3_drafter *d, const uint32_t *hist, uint32_t n, uint32_t max, uint32_t *out);
    void (*free)(k3_drafter *d);
};

/* Prompt/n-gram lookup: the longest suffix of hist of n_max down to n_min ids
 * that occurred before; the ids that followed its latest earlier occurrence
 * are the guess. */
int k3_drafter_ngram(k3_drafter **out, uint32_t n_min, uint32_t n_max, k3_err *e);
void k3_drafter_free(k3_drafter *d);   /* accepts NULL */

/* "ngram" or "ngram:K" (K from 1 to K3_SPEC_K_MAX): the drafter and k_max;
 * K3_EARG with the reason otherwise. */
#define K3_SPEC_K_MAX 32
#define K3_SPEC_K_DEFAULT 8
int k3_spec_parse(const char *arg, k3_drafter **out, uint32_t *k_max, k3_err *e);

typedef struct k3_spec_stats {
    uint32_t passes;       /* decode passes (engine steps after the prompt) */
    uint32_t spec_passes;  /* of them, passes that carried guesses */
    uint64_t drafted;      /* guessed ids fed */
    uint64_t accepted;     /* guessed ids kept */
    uint64_t chunk_ids;    /* ids fed in decode passes (carried ones included) */
    uint32_t copies;       /* state copies (rollback checkpoints) */
    double copy_s;         /* wall time of those copies */
    uint64_t copy_bytes;   /* state bytes they moved (k3_seq_state_size less its header) */
    uint32_t n_fed;        /* generated ids the caller's sequence holds on return */
} k3_spec_stats;

/*
 * k3_gen_seq with speculation: the same arguments, tokens, logits (o->
 * first_logits, all_logits, gen_logits) and callbacks, and st the same
 * meaning; k_max guesses per pass at most. The sequence must be empty. On
 * return it holds the prompt and the first sp->n_fed generated ids (plain
 * decoding leaves all but the last: a caller that continues the sequence
 * feeds the rest first). A second sequence of the same size is created for
 * the rollback (the engine plan needs room for two).
 */
int k3_spec_gen_seq(k3_engine *en, k3_seq *seq, k3_sampler *smp, k3_drafter *dr, uint32_t k_max,
                    const uint32_t *prompt, uint32_t n_prompt, const k3_gen_opts *o, uint32_t *out,
                    uint32_t *n_out, k3_gen_stats *st, k3_spec_stats *sp, k3_err *e);


/*
 * Step-wise verification, for a caller that runs many sequences in one
 * engine step (k3-serve): one k3_spec per sequence that speculates, the same
 * verifier k3_spec_gen_seq runs.
 *
 *   k3_spec_create  two sequences of max_ctx (the committed one and the
 *                   rollback copy; the engine plan must count both) and the
 *                   rows of logits for a pass of up to 2 k_max + 1 ids;
 *                   the drafter stays the caller's
 *   k3_spec_seq     the committed sequence: feed the prompt into it with
 *                   plain steps, sample the first id from its last logits
 *   k3_spec_begin   after that: the prompt and the first id (not yet fed)
 *   k3_spec_plan    this sequence's entry of the next step: the ids
 *                   generated but not yet fed plus the guesses, logits into
 *                   the k3_spec's rows; room = how many ids may still be
 *                   generated after the pass's first (guesses past it could
 *                   never be emitted)
 *   k3_spec_row     after the step: the logits the pass's i-th id is drawn
 *                   from (i = 0 first); the caller may change them (a logit
 *                   bias) before sampling
 *   k3_spec_take    the pass's next id was drawn: 1 if another can be drawn
 *                   from this pass (it was the guess and a guess follows)
 *   k3_spec_end     the pass is over (after the last take, or earlier if the
 *                   caller stops): keep the copy or carry the confirmed ids
 *   k3_spec_reset   for another sequence: position 0, no history
 * The ids drawn are those of plain decoding if the caller draws the i-th id
 * of the whole generation at draw number i (k3_sampler_next in order).
 */
typedef struct k3_spec k3_spec;
int k3_spec_create(k3_spec **out, k3_engine *en, uint32_t max_ctx, k3_drafter *dr, uint32_t k_max, k3_err *e);
void k3_spec_free(k3_spec *s);   /* accepts NULL; frees both sequences */
void k3_spec_reset(k3_spec *s);
k3_seq *k3_spec_seq(k3_spec *s);
int k3_spec_begin(k3_spec *s, const uint32_t *prompt, uint32_t n_prompt, uint32_t first, k3_err *e);
int k3_spec_plan(k3_spec *s, uint32_t room, k3_step_seq *q, k3_err *e);
float *k3_spec_row(k3_spec *s, uint32_t i);
int k3_spec_take(k3_spec *s, uint32_t id);
void k3_spec_end(k3_spec *s);
/* What the passes did (k3_spec_stats; n_fed = generated ids the committed
 * sequence holds). */
void k3_spec_get_stats(const k3_spec *s, k3_spec_stats *st);

#endif
