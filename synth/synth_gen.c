/*
 * synth_gen.c - the weights: a counter-based generator and the scales that
 * keep the model numerically alive (docs/MODEL.md §7).
 *
 * Generator: each tensor has a 64-bit key (FNV-1a of its name, mixed with the
 * seed). Word j of its stream is mix(key + (j+1)·φ) with mix the splitmix64
 * finalizer and φ = 0x9E3779B97F4A7C15. Element i of a 2-byte tensor is
 * 16-bit lane i%4 of word i/4, of a 4-byte tensor lane i%2 of word i/2, of a
 * byte tensor lane i%8 of word i/8 (lane 0 = low bits). So any byte range of
 * any tensor is computed on its own: no state, any order, any thread.
 *
 * Values (gain g: output rms ≈ g for unit-rms input, i.e. uniform ±g·√(3/fan_in)):
 *   embedding U(-1,1); norms 1+U(-.5,.5); AttnRes proj U(±2.5/√E) so that
 *   block scores spread by ~1.5 (softmax far from uniform); attention g=1;
 *   dense/shared gate g=3, up g=12 (so |g|>4 and |u|>25 happen: SiTU caps
 *   engage), down g=.08; router g=1.5 and correction bias U(±.15) (changes
 *   some top-k choices); lm_head g=3 (logits not flat).
 *   MXFP4 experts: random nibbles (all 16 codes), per-group scale byte
 *   s0+{-2,-1,0,+1} with s0 chosen so rows reach rms ≈ 3 (w1), 12 (w3), 1 (w2).
 */
#include "synth.h"

#include "k3_stw.h"

#include <math.h>
#include <string.h>

#ifdef __SSE2__
#include <emmintrin.h>
#endif

#define PHI 0x9E3779B97F4A7C15ull

uint64_t k3_synth_mix(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

uint64_t k3_synth_key(uint64_t seed, const char *name)
{
    uint64_t h = 0xcbf29ce484222325ull;
    for (const unsigned char *p = (const unsigned char *)name; *p; p++)
        h = (h ^ *p) * 0x100000001b3ull;
    return k3_synth_mix(h ^ k3_synth_mix(seed + PHI));
}

static inline uint64_t word(uint64_t key, uint64_t j)
{
    return k3_synth_mix(key + (j + 1) * PHI);
}

enum { G_UNIFORM, G_BYTES, G_SCALE };

typedef struct gen {
    int kind;
    float center, half;     /* G_UNIFORM */
    int scale0;             /* G_SCALE: centre byte */
} gen;

static double fan_in_of(const k3_synth_tensor *t)
{
    switch (t->kind) {
    case SK_EXP_W1_P: case SK_EXP_W2_P: case SK_EXP_W3_P:
        return (double)t->shape[1] * 2;
    case SK_EXP_W1_S: case SK_EXP_W2_S: case SK_EXP_W3_S:
        return (double)t->shape[1] * 32;
    default:
        return (double)t->shape[t->ndim - 1];
    }
}

static gen gen_for(const k3_synth_tensor *t)
{
    gen g = {G_UNIFORM, 0.0f, 0.0f, 127};
    double gain = 1.0, fan = fan_in_of(t);
    switch (t->kind) {
    case K3_SCH_EMBED:
        g.half = 1.0f;
        return g;
    case K3_W_FINAL_NORM: case K3_W_OUT_RES_NORM: case K3_W_INPUT_NORM: case K3_W_POST_NORM: case K3_W_SA_RES_NORM:
    case K3_W_MLP_RES_NORM: case K3_W_KDA_ONORM: case K3_W_MLA_QA_NORM: case K3_W_MLA_KVA_NORM: case K3_W_MOE_NORM:
        g.center = 1.0f;
        g.half = 0.5f;
        return g;
    case K3_W_OUT_RES_PROJ: case K3_W_SA_RES_PROJ: case K3_W_MLP_RES_PROJ:   /* [E] or [1][E] */
        g.half = (float)(2.5 / sqrt((double)t->shape[t->ndim - 1]));
        return g;
    case K3_W_KDA_ALOG:
        g.center = -0.25f;
        g.half = 0.75f;
        return g;
    case K3_W_KDA_DTBIAS:
        g.half = 1.0f;
        return g;
    case K3_W_MOE_BIAS:
        g.half = 0.15f;
        return g;
    case K3_W_LM_HEAD: gain = 3.0; break;
    case K3_W_MLP_GATE: case K3_W_MOE_SH_GATE: case SK_EXP_W1: gain = 3.0; break;
    case K3_W_MLP_UP: case K3_W_MOE_SH_UP: case SK_EXP_W3: gain = 12.0; break;
    case K3_W_MLP_DOWN: case K3_W_MOE_SH_DOWN: gain = 0.08; break;
    case SK_EXP_W2: gain = 1.0; break;
    case K3_W_MOE_ROUTER: gain = 1.5; break;
    case SK_EXP_W1_P: case SK_EXP_W2_P: case SK_EXP_W3_P:
        g.kind = G_BYTES;
        return g;
    case SK_EXP_W1_S: case SK_EXP_W2_S: case SK_EXP_W3_S: {
        /* random E2M1 codes have rms 2.93; the jitter {-2..+1} adds ~15% */
        double target = t->kind == SK_EXP_W1_S ? 3.0 : t->kind == SK_EXP_W3_S ? 12.0 : 1.0;
        double ex = log2(target / (2.93 * 1.15 * sqrt(fan)));
        g.kind = G_SCALE;
        g.scale0 = 127 + (int)lround(ex);
        if (g.scale0 < 3)
            g.scale0 = 3;
        if (g.scale0 > 253)
            g.scale0 = 253;
        return g;
    }
    default:
        break;
    }
    g.half = (float)(gain * sqrt(3.0 / fan));
    return g;
}

/* IEEE half of a finite f32, round to nearest even (overflow to inf;
 * subnormal halves kept). The generator's values are finite and small. */
static uint16_t f32_to_f16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    float a = fabsf(f);
    if (a >= 65520.0f)
        return (uint16_t)(sign | 0x7c00u);
    if (a < 0x1p-14f) {                          /* subnormal half: a multiple of 2^-24 */
        float q = nearbyintf(a * 0x1p24f);       /* exact scaling; ties to even */
        return (uint16_t)(sign | (uint16_t)q);
    }
    uint32_t au = u & 0x7fffffffu;
    au += 0xfffu + ((au >> 13) & 1u);            /* round the 13 dropped bits to nearest even */
    return (uint16_t)(sign | (uint16_t)(((au >> 23) - 112u) << 10 | ((au >> 13) & 0x3ffu)));
}

#define BLOCK_WORDS 512   /* 4 KiB of random words per step */

/* Generate whole words [w0, w0+nw) of tensor t into out (8*nw bytes). */
static void gen_words(const k3_synth_tensor *t, const gen *g, uint64_t w0, uint64_t nw, unsigned char *out)
{
    uint64_t key = t->key;
    if (g->kind == G_BYTES) {
        for (uint64_t j = 0; j < nw; j++) {
            uint64_t r = word(key, w0 + j);
            memcpy(out + 8 * j, &r, 8);   /* little-endian: lane 0 = low byte */
        }
    } else if (g->kind == G_SCALE) {
        /* each byte: s0 - 2 + (two random bits); no carries since s0 + 1 <= 254 */
        const uint64_t base = 0x0101010101010101ull * (uint64_t)(g->scale0 - 2);
        for (uint64_t j = 0; j < nw; j++) {
            uint64_t r = (word(key, w0 + j) & 0x0303030303030303ull) + base;
            memcpy(out + 8 * j, &r, 8);
        }
    } else if (t->dtype == K3_DT_F32) {
        const float c = g->center, s = g->half / 2147483647.5f;
        for (uint64_t j = 0; j < nw; j++) {
            uint64_t r = word(key, w0 + j);
            float x[2];
            x[0] = c + s * (float)((double)(uint32_t)r - 2147483647.5);
            x[1] = c + s * (float)((double)(uint32_t)(r >> 32) - 2147483647.5);
            memcpy(out + 8 * j, x, 8);
        }
    } else if (t->dtype == K3_DT_F16) {
        /* the BF16 values below, rounded to F16 instead (to nearest even) */
        const float mul = 2.0f * g->half, add = g->center - 3.0f * g->half;
        for (uint64_t j = 0; j < nw; j++) {
            uint64_t r = word(key, w0 + j), packed = 0;
            for (int k = 0; k < 4; k++) {
                uint32_t u = 0x3F800000u | ((uint32_t)(r >> (16 * k)) & 0xFFFFu) << 7;
                float f;
                memcpy(&f, &u, 4);
                packed |= (uint64_t)f32_to_f16(add + mul * f) << (16 * k);
            }
            memcpy(out + 8 * j, &packed, 8);
        }
    } else {
        /* 16 random bits as the mantissa of a float in [1, 2), then an affine
         * map onto [c-a, c+a) (multiply, then add: no FMA), rounded to bf16
         * to nearest even. The SSE2 path does two words at once and gives
         * the same bits as the scalar one. */
        const float mul = 2.0f * g->half, add = g->center - 3.0f * g->half;
        uint64_t j = 0;
#ifdef __SSE2__
        const __m128 vmul = _mm_set1_ps(mul), vadd = _mm_set1_ps(add);
        const __m128i one = _mm_set1_epi32(0x3F800000), rnd = _mm_set1_epi32(0x7FFF), lsb = _mm_set1_epi32(1);
        for (; j + 2 <= nw; j += 2) {
            __m128i w = _mm_set_epi64x((long long)word(key, w0 + j + 1), (long long)word(key, w0 + j));
            __m128i lo = _mm_unpacklo_epi16(w, _mm_setzero_si128()), hi = _mm_unpackhi_epi16(w, _mm_setzero_si128());
            __m128 fl = _mm_castsi128_ps(_mm_or_si128(one, _mm_slli_epi32(lo, 7)));
            __m128 fh = _mm_castsi128_ps(_mm_or_si128(one, _mm_slli_epi32(hi, 7)));
            __m128i ul = _mm_castps_si128(_mm_add_ps(vadd, _mm_mul_ps(vmul, fl)));
            __m128i uh = _mm_castps_si128(_mm_add_ps(vadd, _mm_mul_ps(vmul, fh)));
            ul = _mm_srli_epi32(_mm_add_epi32(ul, _mm_add_epi32(rnd, _mm_and_si128(_mm_srli_epi32(ul, 16), lsb))), 16);
            uh = _mm_srli_epi32(_mm_add_epi32(uh, _mm_add_epi32(rnd, _mm_and_si128(_mm_srli_epi32(uh, 16), lsb))), 16);
            /* sign-extend the 16-bit results so the saturating pack keeps them */
            ul = _mm_srai_epi32(_mm_slli_epi32(ul, 16), 16);
            uh = _mm_srai_epi32(_mm_slli_epi32(uh, 16), 16);
            _mm_storeu_si128((__m128i *)(void *)(out + 8 * j), _mm_packs_epi32(ul, uh));
        }
#endif
        for (; j < nw; j++) {
            uint64_t r = word(key, w0 + j), packed = 0;
            for (int k = 0; k < 4; k++) {
                uint32_t u = 0x3F800000u | ((uint32_t)(r >> (16 * k)) & 0xFFFFu) << 7;
                float f;
                memcpy(&f, &u, 4);
                f = add + mul * f;
                memcpy(&u, &f, 4);
                packed |= (uint64_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16) << (16 * k);
            }
            memcpy(out + 8 * j, &packed, 8);
        }
    }
}

int k3_synth_fill(const k3_synth_opts *o, const k3_synth_tensor *t, uint64_t off, uint64_t n, void *buf)
{
    if (!k3_synth_has_data(o, t->kind))
        return K3_STW_ZERO;
    gen g = gen_for(t);
    unsigned char *dst = buf;
    /* the stream is 8 bytes per word whatever the dtype */
    uint64_t end = off + n;
    if (off % 8 == 0) {
        /* fast path: whole words straight into the destination */
        uint64_t nw = n / 8;
        gen_words(t, &g, off / 8, nw, dst);
        off += nw * 8;
        dst += nw * 8;
    }
    unsigned char tmp[8 * BLOCK_WORDS];
    while (off < end) {
        uint64_t w0 = off / 8;
        uint64_t wend = (end + 7) / 8;
        uint64_t nw = wend - w0 < BLOCK_WORDS ? wend - w0 : BLOCK_WORDS;
        gen_words(t, &g, w0, nw, tmp);
        uint64_t lo = off - w0 * 8;
        uint64_t m = nw * 8 - lo < end - off ? nw * 8 - lo : end - off;
        memcpy(dst, tmp + lo, (size_t)m);
        dst += m;
        off += m;
    }
    return 0;
}
