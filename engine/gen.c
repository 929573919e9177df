/*
 * gen.c - prompt processing then incremental decode (k3_gen.h).
 *
 * The prompt goes through k3_model_forward in chunks of the model's
 * max_chunk (each weight read once per chunk); then one token per step with
 * the session carrying the KDA state, conv history and MLA latents. Nothing
 * is allocated here: the logits buffer belongs to the caller's options or to
 * the sampler-sized scratch passed in.
 */
#include <string.h>

#include "k3_gen.h"
#include "k3_io.h"
#include "k3_model.h"
#include "k3_progress.h"

/* The prompt through the model. With a progress, chunk by chunk at the
 * model's own chunk boundaries (k3_model_forward cuts the same way), so the
 * numbers do not change; each chunk is counted when done. */
static int forward_prompt(k3_model *m, k3_sess *s, const uint32_t *ids, uint32_t n, int mode, float *logits,
                          struct k3_progress *pr, k3_err *e)
{
    if (!pr)
        return k3_model_forward(m, s, ids, n, mode, logits, e);
    const uint64_t V = k3_model_cfg(m)->vocab_size;
    const uint32_t C = k3_model_max_chunk(m);
    k3_progress_set_total(pr, n);
    for (uint32_t off = 0; off < n;) {
        uint32_t T = n - off < C ? n - off : C;
        int last = off + T == n;
        int rc = mode == K3_LOGITS_ALL ? k3_model_forward(m, s, ids + off, T, K3_LOGITS_ALL, logits + off * V, e)
                 : last                ? k3_model_forward(m, s, ids + off, T, mode, logits, e)
                                       : k3_model_forward(m, s, ids + off, T, K3_LOGITS_NONE, NULL, e);
        if (rc < 0)
            return rc;
        k3_progress_add(pr, T);
        off += T;
    }
    k3_progress_finish(pr);
    return 0;
}

int k3_gen_run(k3_model *m, k3_sess *s, k3_sampler *smp, const uint32_t *prompt, uint32_t n_prompt,
               const k3_gen_opts *o, uint32_t *out, uint32_t *n_out, k3_gen_stats *st, k3_err *e)
{
    memset(st, 0, sizeof *st);
    *n_out = 0;
    if (n_prompt == 0)
        return k3_err_set(e, K3_EARG, "empty prompt: at least one token is needed");
    if ((uint64_t)k3_sess_pos(s) + n_prompt + o->max_new > k3_sess_max_ctx(s))
        return k3_err_set(e, K3_ELIMIT, "prompt (%u) + generation (%u) exceed the context (%u)", n_prompt,
                          o->max_new, k3_sess_max_ctx(s));
    float *logits = o->logits;
    const uint64_t V = k3_model_cfg(m)->vocab_size;
    if (!logits)
        return k3_err_set(e, K3_EARG, "k3_gen_run needs a logits buffer");
    st->n_prompt = n_prompt;
    double t0 = k3_now_s();
    int rc;
    if (o->all_logits) {
        rc = forward_prompt(m, s, prompt, n_prompt, K3_LOGITS_ALL, o->all_logits, o->progress, e);
        if (rc == 0)
            memcpy(logits, o->all_logits + (uint64_t)(n_prompt - 1) * V, V * sizeof(float));
    } else {
        rc = forward_prompt(m, s, prompt, n_prompt, K3_LOGITS_LAST, logits, o->progress, e);
    }
    if (rc < 0)
        return rc;
    if (o->first_logits)
        memcpy(o->first_logits, logits, V * sizeof(float));
    double t1 = k3_now_s();
    st->prompt_s = t1 - t0;
    for (uint32_t i = 0; i < o->max_new; i++) {
        if (o->gen_logits)
            memcpy(o->gen_logits + (uint64_t)i * V, logits, V * sizeof(float));
        uint32_t id = k3_sampler_next(smp, logits);
        out[(*n_out)++] = id;
        st->n_gen = *n_out;
        if (o->cb && (rc = o->cb(o->ud, id)) < 0)
            return rc;
        int eos = 0;
        for (uint32_t k = 0; k < o->n_eos; k++)
            eos |= o->eos[k] == id;
        if (eos) {
            st->stopped_by_eos = 1;
            break;
        }
        if (i + 1 == o->max_new)
            break;
        rc = k3_model_forward(m, s, &id, 1, K3_LOGITS_LAST, logits, e);
        if (rc < 0)
            return rc;
    }
    st->decode_s = k3_now_s() - t1;
    return 0;
}
