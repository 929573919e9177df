/*
 * sample.c - the sampler documented in k3_gen.h: greedy, or temperature ->
 * top-k -> top-p -> inverse CDF with one counter-based draw per token: draw
 * number j depends only on (seed, j), so a caller that produces tokens out of
 * order or several at a time (speculative decoding, engine/spec.c) gets the
 * same tokens as one that calls k3_sampler_next once per token.
 * All scratch (V ids and V probabilities) is allocated at create.
 */
#include <math.h>
#include <stdlib.h>

#include "k3_gen.h"
#include "k3_kern.h"

struct k3_sampler {
    uint32_t V;
    float temperature, top_p;
    uint32_t top_k;
    uint64_t key;    /* mix64(seed) */
    uint64_t count;  /* draws k3_sampler_next has made */
    uint32_t *idx;
    float *z;
    double *p;
};

/* The splitmix64 finaliser (a bijection of 64-bit words). */
static uint64_t mix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

#define GOLDEN 0x9e3779b97f4a7c15ull

/* Draw j: the (j+1)-th output of a splitmix64 generator started at
 * mix64(seed), i.e. mix64(key + (j + 1) * golden), as a word. */
static uint64_t draw(const k3_sampler *s, uint64_t j) { return mix64(s->key + (j + 1) * GOLDEN); }

int k3_sampler_create(k3_sampler **out, uint32_t V, float temperature, uint32_t top_k, float top_p,
                      uint64_t seed, k3_err *e)
{
    *out = NULL;
    if (V == 0 || !(top_p > 0.0f && top_p <= 1.0f) || !(temperature >= 0.0f) || isinf(temperature))
        return k3_err_set(e, K3_EARG, "sampler: need V > 0, temperature >= 0 and 0 < top-p <= 1");
    k3_sampler *s = calloc(1, sizeof *s);
    if (!s)
        return k3_err_set(e, K3_ENOMEM, "out of memory for the sampler");
    s->V = V;
    s->temperature = temperature;
    s->top_k = top_k;
    s->top_p = top_p;
    s->key = mix64(seed);
    if (temperature > 0.0f) {
        s->idx = malloc((size_t)V * sizeof *s->idx);
        s->z = malloc((size_t)V * sizeof *s->z);
        s->p = malloc((size_t)V * sizeof *s->p);
        if (!s->idx || !s->z || !s->p) {
            k3_sampler_free(s);
            return k3_err_set(e, K3_ENOMEM, "out of memory for the sampler");
        }
    }
    *out = s;
    return 0;
}

void k3_sampler_free(k3_sampler *s)
{
    if (!s)
        return;
    free(s->idx);
    free(s->z);
    free(s->p);
    free(s);
}

/* 1 if id x comes before id y: z descending, then id ascending; NaN last.
 * A strict total order, so the sorted result does not depend on the
 * algorithm. */
static int before(const float *z, uint32_t x, uint32_t y)
{
    float zx = z[x], zy = z[y];
    int nx = zx != zx, ny = zy != zy;
    if (nx != ny)
        return ny;
    if (!nx && zx != zy)
        return zx > zy;
    return x < y;
}

static void sift_down(uint32_t *a, uint32_t n, uint32_t i, const float *z)
{
    for (;;) {
        uint32_t c = 2 * i + 1;
        if (c >= n)
            return;
        /* a max-heap of "after": the root is the id that comes last */
        if (c + 1 < n && before(z, a[c], a[c + 1]))
            c++;
        if (!before(z, a[i], a[c]))
            return;
        uint32_t t = a[i];
        a[i] = a[c];
        a[c] = t;
        i = c;
    }
}

/* In-place heapsort (no allocation, unlike qsort). */
static void sort_ids(uint32_t *a, uint32_t n, const float *z)
{
    for (uint32_t i = n / 2; i-- > 0;)
        sift_down(a, n, i, z);
    for (uint32_t end = n; end > 1; end--) {
        uint32_t t = a[0];
        a[0] = a[end - 1];
        a[end - 1] = t;
        sift_down(a, end - 1, 0, z);
    }
}

/* The argmax, ties to the lowest id, NaN never chosen over a number. */
static uint32_t greedy(const float *logits, uint32_t V)
{
    uint32_t best = 0;
    for (uint32_t i = 1; i < V; i++)
        if (logits[i] > logits[best] || (logits[best] != logits[best] && logits[i] == logits[i]))
            best = i;
    return best;
}

uint32_t k3_sampler_next(k3_sampler *s, const float *logits)
{
    return k3_sampler_at(s, logits, s->count++);
}

uint64_t k3_sampler_count(const k3_sampler *s) { return s->count; }
void k3_sampler_set_count(k3_sampler *s, uint64_t n) { s->count = n; }

uint32_t k3_sampler_at(k3_sampler *s, const float *logits, uint64_t j)
{
    const uint32_t V = s->V;
    if (s->temperature <= 0.0f)
        return greedy(logits, V);
    for (uint32_t i = 0; i < V; i++) {
        s->z[i] = logits[i] / s->temperature;
        s->idx[i] = i;
    }
    uint32_t n = V;
    sort_ids(s->idx, V, s->z);
    if (s->top_k && s->top_k < n)
        n = s->top_k;
    const float zmax = s->z[s->idx[0]];
    /* A temperature so small that the largest logit / temperature overflows
     * float (inf - inf would make every probability NaN): the limit of the
     * distribution as the temperature goes to 0 is the argmax, so greedy.
     * Also every logit NaN. */
    if (!isfinite(zmax))
        return greedy(logits, V);
    double sum = 0.0;
    for (uint32_t i = 0; i < n; i++) {
        float zi = s->z[s->idx[i]];
        s->p[i] = zi == zi ? k3_exp((double)(zi - zmax)) : 0.0;
        sum += s->p[i];
    }
    double cum = 0.0;
    uint32_t keep = n;
    for (uint32_t i = 0; i < n; i++) {
        s->p[i] /= sum;
        cum += s->p[i];
        if (s->top_p < 1.0f && cum >= (double)s->top_p) {
            keep = i + 1;
            break;
        }
    }
    double mass = 0.0;
    for (uint32_t i = 0; i < keep; i++)
        mass += s->p[i];
    const double u = (double)(draw(s, j) >> 11) * 0x1.0p-53 * mass;
    cum = 0.0;
    for (uint32_t i = 0; i < keep; i++) {
        cum += s->p[i];
        if (cum > u)
            return s->idx[i];
    }
    return s->idx[keep - 1];
}
