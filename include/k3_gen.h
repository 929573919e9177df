/*
 * k3_gen.h - generation: the sampler and the prompt-then-decode loop.
 *
 * Sampler (k3_sampler_next), exactly:
 *   - temperature <= 0: greedy, the argmax of the logits, ties to the lowest
 *     id. No random number is drawn.
 *   - otherwise: z_i = logit_i / temperature (float); ids sorted by z
 *     descending, ties by id ascending; keep the first top_k (0 = all); p_i =
 *     exp(z_i - z_max) / sum (sum in double, in sorted order); keep the
 *     shortest sorted prefix whose cumulative p reaches top_p (1 = all; at
 *     least one id); draw one uniform u in [0, 1) (the top 53 bits of draw
 *     number j times 2^-53), scale it by the kept mass and return the first
 *     kept id whose cumulative p (double, sorted order) exceeds it.
 *   - draws are counter-based: draw j = mix64(mix64(seed) + (j + 1) *
 *     0x9e3779b97f4a7c15), mix64 being the splitmix64 finaliser (so draw j is
 *     output j+1 of splitmix64 started at mix64(seed)). A draw depends only on
 *     (seed, j), never on what was drawn before: the same seed, options and
 *     logits give the same tokens on every machine, and a caller that
 *     produces several tokens per step (speculative decoding) gets the tokens
 *     of one-at-a-time decoding. k3_sampler_next(s, logits) is
 *     k3_sampler_at(s, logits, n) with n the number of k3_sampler_next calls
 *     before it. (Until this scheme the draws came from one xoshiro256**
 *     stream; the seeded outputs of that version differ from this one.)
 */
#ifndef K3_GEN_H
#define K3_GEN_H

#include <stdint.h>

#include "k3_err.h"

/* The forward pass (k3_model.h); only k3_gen_run needs it. */
typedef struct k3_model k3_model;
typedef struct k3_sess k3_sess;

typedef struct k3_sampler k3_sampler;

/* A sampler over a vocabulary of V ids (scratch sized here, never later). */
int k3_sampler_create(k3_sampler **out, uint32_t V, float temperature, uint32_t top_k, float top_p,
                      uint64_t seed, k3_err *e);
void k3_sampler_free(k3_sampler *s);   /* accepts NULL */
/* The next id for these logits (V floats): draw number k3_sampler_count(s),
 * which it then advances. */
uint32_t k3_sampler_next(k3_sampler *s, const float *logits);
/* The id for these logits with draw number j (the j-th token generated,
 * from 0); the count of k3_sampler_next is left alone. */
uint32_t k3_sampler_at(k3_sampler *s, const float *logits, uint64_t j);
/* The draw number k3_sampler_next uses next; set it to resume a stream. */
uint64_t k3_sampler_count(const k3_sampler *s);
void k3_sampler_set_count(k3_sampler *s, uint64_t n);

/* Called with each generated id as soon as it is chosen; a negative return
 * stops generation with that code. */
typedef int (*k3_gen_cb)(void *ud, uint32_t id);

typedef struct k3_gen_opts {
    uint32_t max_new;          /* tokens to generate at most */
    const uint32_t *eos;       /* stop after generating one of these (included in the output) */
    uint32_t n_eos;
    float *logits;             /* required scratch: V floats */
    float *first_logits;       /* if set: V floats, logits of the last prompt position */
    float *all_logits;         /* if set: n_prompt x V floats, every prompt position */
    k3_gen_cb cb;
    void *ud;
    struct k3_progress *progress;  /* if set: prompt tokens done, counted per chunk (same bits) */
    float *gen_logits;         /* if set: max_new x V floats, row i = the logits id i was drawn from */
} k3_gen_opts;

typedef struct k3_gen_stats {
    double prompt_s, decode_s;   /* wall time of prompt processing / of the decode steps */
    uint32_t n_prompt, n_gen;
    int stopped_by_eos;
} k3_gen_stats;

/* Process the prompt (chunks of the model's max_chunk), then generate up to
 * max_new ids into out (capacity max_new) with sampler; *n_out receives the
 * count. The session must be empty with room for prompt + max_new tokens. */
int k3_gen_run(k3_model *m, k3_sess *s, k3_sampler *smp, const uint32_t *prompt, uint32_t n_prompt,
               const k3_gen_opts *o, uint32_t *out, uint32_t *n_out, k3_gen_stats *st, k3_err *e);

/* The same over the engine API: the sequence must be empty. */
typedef struct k3_engine k3_engine;
typedef struct k3_seq k3_seq;
int k3_gen_seq(k3_engine *en, k3_seq *seq, k3_sampler *smp, const uint32_t *prompt, uint32_t n_prompt,
               const k3_gen_opts *o, uint32_t *out, uint32_t *n_out, k3_gen_stats *st, k3_err *e);

#endif
