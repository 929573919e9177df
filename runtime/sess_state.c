/*
 * sess_state.c - a session's state copied, and as bytes (the layout is
 * documented at k3_seq_state_save in k3_engine.h).
 *
 * The state is exactly what the next token depends on besides the weights:
 * the position, every KDA layer's recurrent state and short-conv history, and
 * every MLA layer's latents of the positions before it. Restoring it and
 * running on gives the same bits as never having stopped.
 */
#include <string.h>

#include "k3_crc.h"
#include "model_int.h"

#define STATE_MAGIC "K3SEQST1"
#define STATE_HDR 64u

static uint64_t kda_floats(const k3_dims *d) { return (uint64_t)d->n_kda * d->H * d->D * d->D; }
static uint64_t conv_floats(const k3_dims *d) { return (uint64_t)d->n_kda * 3 * (d->CW - 1) * d->P; }
static uint64_t lat_floats(const k3_dims *d) { return (uint64_t)d->KVL + d->ROPE; }

static uint64_t payload_bytes(const k3_dims *d, uint32_t pos)
{
    return (kda_floats(d) + conv_floats(d) + (uint64_t)d->n_mla * pos * lat_floats(d)) * sizeof(float);
}

int k3_sess_copy(k3_sess *dst, const k3_sess *src, k3_err *e)
{
    if (dst->m != src->m)
        return k3_err_set(e, K3_EARG, "copying a sequence: the two belong to different models");
    if (src->pos > dst->max_ctx)
        return k3_err_set(e, K3_ELIMIT, "copying a sequence at position %u into one of %u tokens", src->pos,
                          dst->max_ctx);
    const k3_dims *d = &src->m->d;
    memcpy(dst->kda_state, src->kda_state, kda_floats(d) * sizeof(float));
    memcpy(dst->conv_hist, src->conv_hist, conv_floats(d) * sizeof(float));
    uint64_t lat = lat_floats(d);
    for (uint32_t l = 0; l < d->n_mla; l++)
        memcpy(dst->mla_cache + (uint64_t)l * dst->max_ctx * lat, src->mla_cache + (uint64_t)l * src->max_ctx * lat,
               (uint64_t)src->pos * lat * sizeof(float));
    dst->pos = src->pos;
    return 0;
}

uint64_t k3_sess_state_size(const k3_sess *s) { return STATE_HDR + payload_bytes(&s->m->d, s->pos); }

static void put32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static uint32_t get32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* The shape words of the header (after the magic, the header size and the
 * position): they must match for a state to load. */
#define N_SHAPE 9
static void shape_words(const k3_dims *d, uint32_t w[N_SHAPE])
{
    uint32_t v[N_SHAPE] = {d->NL, d->E, d->H, d->D, d->CW, d->KVL + d->ROPE, d->n_kda, d->n_mla, d->V};
    memcpy(w, v, sizeof v);
}

static const char *shape_name[N_SHAPE] = {"layers", "hidden size", "KDA heads", "KDA head dim", "conv kernel",
                                          "MLA floats per position", "KDA layers", "MLA layers", "vocabulary"};

/* The payload pieces in order: (pointer, floats). */
static uint32_t pieces(const k3_sess *s, uint32_t pos, float **p, uint64_t *n, uint32_t cap)
{
    const k3_dims *d = &s->m->d;
    uint32_t k = 0;
    p[k] = s->kda_state, n[k++] = kda_floats(d);
    p[k] = s->conv_hist, n[k++] = conv_floats(d);
    for (uint32_t l = 0; l < d->n_mla && k < cap; l++)
        p[k] = s->mla_cache + (uint64_t)l * s->max_ctx * lat_floats(d), n[k++] = (uint64_t)pos * lat_floats(d);
    return k;
}

int k3_sess_state_save(const k3_sess *s, void *buf, uint64_t cap, uint64_t *len, k3_err *e)
{
    const k3_dims *d = &s->m->d;
    uint64_t need = k3_sess_state_size(s);
    if (len)
        *len = 0;
    if (!buf || cap < need)
        return k3_err_set(e, K3_ELIMIT, "saving a sequence's state: %llu bytes needed, the buffer holds %llu",
                          (unsigned long long)need, (unsigned long long)cap);
    uint8_t *b = buf;
    memset(b, 0, STATE_HDR);
    memcpy(b, STATE_MAGIC, 8);
    put32(b + 8, STATE_HDR);
    put32(b + 12, s->pos);
    uint32_t w[N_SHAPE];
    shape_words(d, w);
    for (int i = 0; i < N_SHAPE; i++)
        put32(b + 16 + 4 * i, w[i]);
    uint64_t pay = payload_bytes(d, s->pos);
    put32(b + 52, (uint32_t)pay);
    put32(b + 56, (uint32_t)(pay >> 32));
    uint8_t *o = b + STATE_HDR;
    uint32_t crc = 0;
    float *p[2 + K3_CFG_MAX_LAYERS];
    uint64_t n[2 + K3_CFG_MAX_LAYERS];
    uint32_t np = pieces(s, s->pos, p, n, 2 + K3_CFG_MAX_LAYERS);
    for (uint32_t i = 0; i < np; i++) {
        memcpy(o, p[i], n[i] * sizeof(float));   /* float32 LE: little-endian hosts only */
        crc = k3_crc32(crc, o, n[i] * sizeof(float));
        o += n[i] * sizeof(float);
    }
    put32(b + 60, crc);
    if (len)
        *len = need;
    return 0;
}

int k3_sess_state_load(k3_sess *s, const void *buf, uint64_t len, k3_err *e)
{
    const k3_dims *d = &s->m->d;
    const uint8_t *b = buf;
    if (!buf || len < STATE_HDR || memcmp(b, STATE_MAGIC, 8) || get32(b + 8) != STATE_HDR)
        return k3_err_set(e, K3_EFORMAT, "loading a sequence's state: not a k3 sequence state (%llu bytes)",
                          (unsigned long long)len);
    uint32_t pos = get32(b + 12);
    uint32_t w[N_SHAPE];
    shape_words(d, w);
    for (int i = 0; i < N_SHAPE; i++)
        if (get32(b + 16 + 4 * i) != w[i])
            return k3_err_set(e, K3_EFORMAT, "loading a sequence's state: it is of another model shape (%s %u, "
                                             "this model %u)", shape_name[i], get32(b + 16 + 4 * i), w[i]);
    uint64_t pay = (uint64_t)get32(b + 52) | (uint64_t)get32(b + 56) << 32;
    if (pay != payload_bytes(d, pos) || len != STATE_HDR + pay)
        return k3_err_set(e, K3_EFORMAT, "loading a sequence's state: %llu bytes, a state at position %u has %llu",
                          (unsigned long long)len, pos, (unsigned long long)(STATE_HDR + payload_bytes(d, pos)));
    if (pos > s->max_ctx)
        return k3_err_set(e, K3_ELIMIT, "loading a sequence's state at position %u into a sequence of %u tokens",
                          pos, s->max_ctx);
    if (k3_crc32(0, b + STATE_HDR, pay) != get32(b + 60))
        return k3_err_set(e, K3_EFORMAT, "loading a sequence's state: CRC32 mismatch (the bytes are damaged)");
    const uint8_t *in = b + STATE_HDR;
    float *p[2 + K3_CFG_MAX_LAYERS];
    uint64_t n[2 + K3_CFG_MAX_LAYERS];
    uint32_t np = pieces(s, pos, p, n, 2 + K3_CFG_MAX_LAYERS);
    for (uint32_t i = 0; i < np; i++) {
        memcpy(p[i], in, n[i] * sizeof(float));
        in += n[i] * sizeof(float);
    }
    s->pos = pos;
    return 0;
}
