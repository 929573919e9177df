/*
 * t_act.c - the runtime's exp, tanh, SiTU-GLU and attention primitives
 * (kernels/ref.c and the vector paths): exp and tanh close to libm's, their
 * bits pinned, every path's SiTU the same bits as the scalar one, and every
 * path's attention dots and sums those of their definition.
 */
#include "k3_kern.h"
#include "k3_test.h"
#include "../kernels/kern_impl.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static uint64_t rnd(void) { return k3t_xorshift(&rng_state); }

/* k3_exp/k3_expf/k3_tanhf (the runtime's, the same bits everywhere) stay
 * within a couple of ulps of libm's over their whole range, and keep the
 * special values. */
K3_TEST(kern_exp_and_tanh_close_to_libm_with_special_values)
{
    double worst = 0, worstf = 0, worstt = 0;
    for (int i = 0; i < 200000; i++) {
        double x = -745.0 + 1454.0 * (double)(rnd() >> 11) * 0x1p-53;
        double a = k3_exp(x), b = exp(x);
        if (b > 0x1p-1022 && isfinite(b))
            worst = fmax(worst, fabs(a - b) / (nextafter(b, INFINITY) - b));
        float xf = (float)(x / 8.0);
        float af = k3_expf(xf), bf = expf(xf);
        if (bf > 0x1p-126f && isfinite(bf))
            worstf = fmax(worstf, fabs((double)af - bf) / ((double)nextafterf(bf, INFINITY) - bf));
        float xt = (float)(x / 64.0) * (i % 3 == 0 ? 1e-6f : 1.0f);
        float at = k3_tanhf(xt), bt = tanhf(xt);
        double ut = fabs((double)nextafterf(fabsf(bt), INFINITY) - fabsf(bt));
        if (bt != 0)
            worstt = fmax(worstt, fabs((double)at - bt) / ut);
    }
    if (worst > 2 || worstf > 1 || worstt > 2)
        k3t_fail(__FILE__, __LINE__, "ulps from libm: exp %g, expf %g, tanhf %g", worst, worstf, worstt);
    CHECK(isnan(k3_exp(NAN)) && isnan(k3_expf(NAN)) && isnan(k3_tanhf(NAN)));
    CHECK(k3_exp(INFINITY) == INFINITY && k3_exp(-INFINITY) == 0.0 && k3_exp(0.0) == 1.0);
    CHECK(k3_expf(INFINITY) == INFINITY && k3_expf(-INFINITY) == 0.0f && k3_expf(0.0f) == 1.0f);
    CHECK(k3_exp(710.0) == INFINITY && k3_expf(89.0f) == expf(89.0f) && k3_expf(-104.0f) >= 0.0f);
    CHECK(k3_tanhf(INFINITY) == 1.0f && k3_tanhf(-INFINITY) == -1.0f);
    CHECK(k3_tanhf(0.0f) == 0.0f && !signbit(k3_tanhf(0.0f)) && signbit(k3_tanhf(-0.0f)));
    CHECK(k3_tanhf(1e-30f) == 1e-30f && k3_tanhf(25.0f) == 1.0f);
}

/* Their bits are pinned: a hash of k3_exp, k3_expf and k3_tanhf over 5
 * million points of their ranges (the subnormal results and overflow of
 * exp, tanh's series near 0 and its saturation). Every architecture and
 * build must give this one value; a change to any of these functions that
 * moves one bit changes every logit it touches, so it must change this
 * constant on purpose. */
K3_TEST(kern_exp_and_tanh_bits_are_pinned)
{
    uint64_t h = 1469598103934665603ull;
    const uint32_t N = 1u << 20;
    for (uint32_t i = 0; i <= N; i++) {
        union {
            double d;
            float f;
            uint64_t u;
        } v[5];
        memset(v, 0, sizeof v);
        v[0].d = k3_exp(-750.0 + 1462.0 * i / N);
        v[1].f = k3_expf(-105.0f + 195.0f * (float)i / (float)N);
        v[2].f = k3_tanhf(-25.0f + 50.0f * (float)i / (float)N);
        const float xs = (float)i / (float)N * 0.5f - 0.25f;
        v[3].f = k3_tanhf(xs);
        v[4].d = k3_exp(xs * 1e-3);
        for (int k = 0; k < 5; k++) {   /* 8 bytes each, a float's upper 4 zero */
            for (int b = 0; b < 8; b++) {
                h ^= (v[k].u >> (8 * b)) & 0xff;
                h *= 1099511628211ull;
            }
        }
    }
    if (h != 0x37b92438504bb665ull)
        k3t_fail(__FILE__, __LINE__, "exp/tanh bits changed: hash 0x%016llx", (unsigned long long)h);
}

/* SiTU on every path the CPU runs: the same bits as the scalar one, over
 * values that take every branch of tanh and exp (the series near 0, the
 * saturation past 20, exp's overflow and underflow edges), the specials
 * (+-0, subnormals, +-inf, NaN) and tails of every length. */
K3_TEST(kern_situ_every_path_bit_identical_to_scalar)
{
    enum { N = 200003 };
    float *g = malloc(N * sizeof *g), *u = malloc(N * sizeof *u), *a = malloc(N * sizeof *a),
          *b = malloc(N * sizeof *b);
    CHECK(g && u && a && b);
    static const float special[] = {0.0f, -0.0f, 1e-40f, -1e-40f, INFINITY, -INFINITY, NAN, 0.68f, 0.679f,
                                    0.681f, 80.0f, -80.0f, 89.0f, -89.0f, 104.0f, -104.0f, 104.1f, 3e38f};
    for (uint32_t i = 0; i < N; i++) {
        const double r = (double)(rnd() >> 11) * 0x1p-53 * 2 - 1;
        const uint32_t kind = (uint32_t)(rnd() % 8);
        g[i] = kind == 0 ? special[rnd() % (sizeof special / sizeof *special)]
               : kind == 1 ? (float)(r * 1e-3)
               : kind == 2 ? (float)(r * 1.4)
               : kind == 3 ? (float)(r * 120)
               : (float)(r * 30);
        u[i] = (float)((double)(rnd() >> 11) * 0x1p-53 * 200 - 100) * (i % 5 == 0 ? 1e-4f : 1.0f);
        if (i % 997 == 0)
            u[i] = special[i % (sizeof special / sizeof *special)];
    }
    static const float betas[][2] = {{4.0f, 25.0f}, {1.0f, 1.0f}, {0.5f, 3.0f}};
    const char *const vec[] = {"avx2", "avx512", "neon"};
    int ran = 0;
    for (int k = 0; k < 3; k++) {
        const k3_kern_path *p = k3_kern_path_find(vec[k]);
        if (!p || !p->situ)
            continue;
        ran++;
        for (int bi = 0; bi < 3; bi++)
            for (uint32_t n = N - 7; n <= N; n++) {   /* tails of 0 .. 7 */
                memcpy(a, g, n * sizeof *a);
                memcpy(b, g, n * sizeof *b);
                k3_kern_path_scalar.situ(a, u, n, betas[bi][0], betas[bi][1]);
                p->situ(b, u, n, betas[bi][0], betas[bi][1]);
                if (memcmp(a, b, n * sizeof *a)) {
                    uint32_t i = 0;
                    while (!memcmp(&a[i], &b[i], sizeof *a))
                        i++;
                    k3t_fail(__FILE__, __LINE__, "%s: situ(%g, %g) with betas %g, %g: %a against the scalar %a",
                             vec[k], (double)g[i], (double)u[i], (double)betas[bi][0], (double)betas[bi][1],
                             (double)b[i], (double)a[i]);
                }
            }
    }
    (void)ran;
    free(g), free(u), free(a), free(b);
}

/* One value for the attention tests: mostly ordinary, some tiny, huge (so
 * sums overflow), signed zeros, subnormals, infinities and NaN. */
static float attn_value(void)
{
    static const float special[] = {0.0f, -0.0f, 1e-40f, -1e-40f, INFINITY, -INFINITY, NAN, 3e38f, -3e38f};
    const double r = (double)(rnd() >> 11) * 0x1p-53 * 2 - 1;
    const uint32_t kind = (uint32_t)(rnd() % 64);
    return kind == 0 ? special[rnd() % (sizeof special / sizeof *special)]
           : kind == 1 ? (float)(r * 1e-30)
           : kind == 2 ? (float)(r * 1e30)
           : (float)(r * 4);
}

/* The same bits, or both NaN (which NaN an add of two NaNs keeps is the
 * compiler's choice of operand order, not the path's). */
static int same_floats(const float *a, const float *b, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++)
        if (memcmp(&a[i], &b[i], sizeof *a) && !(isnan(a[i]) && isnan(b[i])))
            return 0;
    return 1;
}

/* k3_dot8x4 and k3_axpy4 on every path against their definitions in
 * k3_kern.h written out here: eight partial sums (the tail into sums 0, 1,
 * ...) and the fixed combine; four weighted sums in order. Lengths 0 .. 70
 * and the MLA widths (rope 64, latent 512, both 576); inputs with every
 * special value, so a changed order or a fused multiply-add shows. */
K3_TEST(kern_attention_dots_and_sums_every_path_match_their_definition)
{
    enum { NMAX = 600 };
    float *a = malloc(NMAX * sizeof *a), *x[4], *y0 = malloc(NMAX * sizeof *y0), *y1 = malloc(NMAX * sizeof *y1),
          *yr = malloc(NMAX * sizeof *yr);
    CHECK(a && y0 && y1 && yr);
    for (int j = 0; j < 4; j++) {
        x[j] = malloc(NMAX * sizeof *x[j]);
        CHECK(x[j] != NULL);
    }
    const char *const paths[] = {"scalar", "avx2", "avx512", "neon"};
    uint32_t lens[80], nl = 0;
    for (uint32_t n = 0; n <= 70; n++)
        lens[nl++] = n;
    lens[nl++] = 512, lens[nl++] = 576, lens[nl++] = 575, lens[nl++] = 600;
    for (int round = 0; round < 40; round++)
        for (uint32_t li = 0; li < nl; li++) {
            const uint32_t n = lens[li];
            const int plain = round % 2 == 0;   /* half the rounds without special values */
            for (uint32_t c = 0; c < NMAX; c++) {
                a[c] = plain ? (float)((double)(rnd() >> 11) * 0x1p-53 * 2 - 1) : attn_value();
                y0[c] = plain ? (float)((double)(rnd() >> 11) * 0x1p-53 * 2 - 1) : attn_value();
                for (int j = 0; j < 4; j++)
                    x[j][c] = plain ? (float)((double)(rnd() >> 11) * 0x1p-53 * 2 - 1) : attn_value();
            }
            const float w[4] = {attn_value(), attn_value(), plain ? 0.25f : -0.0f, attn_value()};
            float want[4];
            for (int j = 0; j < 4; j++) {
                float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
                const uint32_t body = n - n % 8;
                for (uint32_t c = 0; c < n; c++) {
                    const float pr = a[c] * x[j][c];
                    s[c < body ? c % 8 : c - body] += pr;
                }
                want[j] = ((s[0] + s[4]) + (s[1] + s[5])) + ((s[2] + s[6]) + (s[3] + s[7]));
            }
            for (uint32_t c = 0; c < n; c++) {
                float v = y0[c];
                for (int j = 0; j < 4; j++) {
                    const float pr = w[j] * x[j][c];
                    v = v + pr;
                }
                yr[c] = v;
            }
            for (int k = 0; k < 4; k++) {
                const k3_kern_path *p = k3_kern_path_find(paths[k]);
                if (!p || !p->dot8x4 || !p->axpy4)
                    continue;
                float got[4];
                p->dot8x4(a, (const float *const *)x, n, got);
                if (!same_floats(got, want, 4))
                    k3t_fail(__FILE__, __LINE__, "%s: dot8x4 of length %u: %a %a %a %a, defined %a %a %a %a", paths[k],
                             n, (double)got[0], (double)got[1], (double)got[2], (double)got[3], (double)want[0],
                             (double)want[1], (double)want[2], (double)want[3]);
                memcpy(y1, y0, NMAX * sizeof *y1);
                p->axpy4(y1, w, (const float *const *)x, n);
                if (!same_floats(y1, yr, n) || memcmp(y1 + n, y0 + n, (NMAX - n) * sizeof *y1))
                    k3t_fail(__FILE__, __LINE__, "%s: axpy4 of length %u differs from its definition", paths[k], n);
            }
        }
    for (int j = 0; j < 4; j++)
        free(x[j]);
    free(a), free(y0), free(y1), free(yr);
}

/* k3_kda_step on every path against its definition in k3_kern.h written
 * out here (the whole state decayed, then updated, as engine/kda.c once
 * did it): head sizes 1 .. 40 and 64, 128, 130 (every block width and
 * tail), states and inputs with signed zeros, subnormals, huge values,
 * infinities and NaN, and rounds that make the last bits of the first sum
 * visible; the state and o compared bit for bit. */
K3_TEST(kern_kda_step_every_path_matches_its_definition)
{
    enum { DMAX = 130 };
    float *S0 = malloc(DMAX * DMAX * sizeof *S0), *S1 = malloc(DMAX * DMAX * sizeof *S1),
          *Sr = malloc(DMAX * DMAX * sizeof *Sr), v[DMAX];
    double decay[DMAX], k[DMAX], q[DMAX], u[DMAX], dl[DMAX], o[DMAX], orf[DMAX];
    CHECK(S0 && S1 && Sr);
    const char *const paths[] = {"scalar", "avx2", "avx512", "neon"};
    uint32_t dims[48], nd = 0;
    for (uint32_t D = 1; D <= 40; D++)
        dims[nd++] = D;
    dims[nd++] = 64, dims[nd++] = 128, dims[nd++] = 130;
    for (int round = 0; round < 24; round++)
        for (uint32_t di = 0; di < nd; di++) {
            const uint32_t D = dims[di];
            const int plain = round % 3 != 0;
            for (uint32_t i = 0; i < D * D; i++)
                S0[i] = plain ? (float)((double)(rnd() >> 11) * 0x1p-53 * 2 - 1) : attn_value();
            for (uint32_t i = 0; i < D; i++) {
                const double r = (double)(rnd() >> 11) * 0x1p-53;
                decay[i] = plain || i % 7 ? r : (double)attn_value();
                k[i] = plain || i % 5 ? r * 2 - 1 : (double)attn_value();
                q[i] = plain || i % 3 ? 1 - r : (double)attn_value();
                v[i] = plain || i % 4 ? (float)(r * 8 - 4) : attn_value();
            }
            /* every third round cancels: v is u rounded to float and odd
             * rows of the state are zero, so dl is u's own rounding error
             * and those rows store k dl to float: u's last bits show */
            const int cancel = round % 3 == 2;
            if (cancel)
                for (uint32_t i = 1; i < D; i += 2)
                    memset(S0 + (size_t)i * D, 0, D * sizeof *S0);
            const double beta = plain ? 0.75 : (double)attn_value();
            memcpy(Sr, S0, (size_t)D * D * sizeof *Sr);
            for (uint32_t j = 0; j < D; j++)
                u[j] = 0.0, o[j] = 0.0;
            for (uint32_t i = 0; i < D; i++)
                for (uint32_t j = 0; j < D; j++) {
                    Sr[i * D + j] = (float)((double)Sr[i * D + j] * decay[i]);
                    const double pr = (double)Sr[i * D + j] * k[i];
                    u[j] = u[j] + pr;
                }
            for (uint32_t j = 0; j < D && cancel; j++)
                v[j] = (float)u[j];
            for (uint32_t j = 0; j < D; j++)
                dl[j] = beta * ((double)v[j] - u[j]);
            for (uint32_t i = 0; i < D; i++)
                for (uint32_t j = 0; j < D; j++) {
                    const double up = k[i] * dl[j];
                    Sr[i * D + j] = (float)((double)Sr[i * D + j] + up);
                    const double pr = (double)Sr[i * D + j] * q[i];
                    o[j] = o[j] + pr;
                }
            for (int p = 0; p < 4; p++) {
                const k3_kern_path *kp = k3_kern_path_find(paths[p]);
                if (!kp || !kp->kda_step)
                    continue;
                memcpy(S1, S0, (size_t)D * D * sizeof *S1);
                kp->kda_step(S1, D, decay, k, q, v, beta, orf);
                int bad = !same_floats(S1, Sr, D * D);
                for (uint32_t j = 0; j < D && !bad; j++)
                    bad = memcmp(&orf[j], &o[j], sizeof o[j]) && !(isnan(orf[j]) && isnan(o[j]));
                if (bad)
                    k3t_fail(__FILE__, __LINE__, "%s: kda_step of head size %u (round %d) differs from its definition",
                             paths[p], D, round);
            }
        }
    free(S0), free(S1), free(Sr);
}

/* k3_exp_n on every path: k3_exp's bits for every element, over the whole
 * range (overflow past 709.8, results that are subnormal below -708, zero
 * past -745.2), the edges of the vector paths' range, the special values,
 * and lengths 0 .. 19 (tails) and a long one; y may be x. */
K3_TEST(kern_exp_n_every_path_gives_k3_exp)
{
    enum { N = 100003 };
    double *x = malloc(N * sizeof *x), *want = malloc(N * sizeof *want), *y = malloc(N * sizeof *y);
    CHECK(x && want && y);
    static const double edge[] = {0.0, -0.0, 1e-310, -1e-310, INFINITY, -INFINITY, NAN, -NAN, -708.0, 709.0,
                                  -708.0000001, 709.0000001, -708.4, 709.4, -745.2, -745.1, 709.8, 709.79, -1e300,
                                  1e300, 0.5, -0.5, 1e-17};
    const uint32_t ne = sizeof edge / sizeof *edge;
    for (uint32_t i = 0; i < N; i++) {
        const double r = (double)(rnd() >> 11) * 0x1p-53;
        const uint32_t kind = (uint32_t)(rnd() % 16);
        x[i] = kind == 0 ? edge[rnd() % ne] : kind == 1 ? -760 + 1480 * r : kind == 2 ? -1e-3 + 2e-3 * r : -30 + 60 * r;
        want[i] = k3_exp(x[i]);
    }
    const char *const paths[] = {"scalar", "avx2", "avx512", "neon"};
    for (int p = 0; p < 4; p++) {
        const k3_kern_path *kp = k3_kern_path_find(paths[p]);
        if (!kp || !kp->exp_n)
            continue;
        for (uint32_t n = 0; n < 20; n++)
            for (uint32_t s = 0; s + n <= 200; s += 37) {
                memset(y, 0xa5, 64 * sizeof *y);
                kp->exp_n(y, x + s, n);
                for (uint32_t i = 0; i < n; i++)
                    if (memcmp(&y[i], &want[s + i], sizeof *y))
                        k3t_fail(__FILE__, __LINE__, "%s: exp_n(%a) = %a, k3_exp %a", paths[p], x[s + i], y[i],
                                 want[s + i]);
            }
        memcpy(y, x, N * sizeof *y);
        kp->exp_n(y, y, N);   /* in place */
        for (uint32_t i = 0; i < N; i++)
            if (memcmp(&y[i], &want[i], sizeof *y) && !(isnan(y[i]) && isnan(want[i]))) {
                k3t_fail(__FILE__, __LINE__, "%s: exp_n(%a) = %a in place, k3_exp %a", paths[p], x[i], y[i], want[i]);
                break;
            }
    }
    free(x), free(want), free(y);
}

/* k3_expf_n on every path: k3_expf's bits for every element, over its whole
 * range (inf past 89, 0 below -104), the special values, tails and in place. */
K3_TEST(kern_expf_n_every_path_gives_k3_expf)
{
    enum { N = 100003 };
    float *x = malloc(N * sizeof *x), *want = malloc(N * sizeof *want), *y = malloc(N * sizeof *y);
    CHECK(x && want && y);
    static const float edge[] = {0.0f, -0.0f, 1e-40f, -1e-40f, INFINITY, -INFINITY, NAN, 89.0f, 89.00001f,
                                 -104.0f, -104.00001f, -87.5f, -100.0f, 88.7f, 3e38f, -3e38f};
    const uint32_t ne = sizeof edge / sizeof *edge;
    for (uint32_t i = 0; i < N; i++) {
        const float r = (float)((double)(rnd() >> 11) * 0x1p-53);
        const uint32_t kind = (uint32_t)(rnd() % 16);
        x[i] = kind == 0 ? edge[rnd() % ne] : kind == 1 ? -110 + 200 * r : kind == 2 ? -1e-3f + 2e-3f * r : -30 * r;
        want[i] = k3_expf(x[i]);
    }
    const char *const paths[] = {"scalar", "avx2", "avx512", "neon"};
    for (int p = 0; p < 4; p++) {
        const k3_kern_path *kp = k3_kern_path_find(paths[p]);
        if (!kp || !kp->expf_n)
            continue;
        for (uint32_t n = 0; n < 20; n++)
            for (uint32_t s = 0; s + n <= 200; s += 37) {
                kp->expf_n(y, x + s, n);
                for (uint32_t i = 0; i < n; i++)
                    if (memcmp(&y[i], &want[s + i], sizeof *y))
                        k3t_fail(__FILE__, __LINE__, "%s: expf_n(%a) = %a, k3_expf %a", paths[p], (double)x[s + i],
                                 (double)y[i], (double)want[s + i]);
            }
        memcpy(y, x, N * sizeof *y);
        kp->expf_n(y, y, N);
        if (!same_floats(y, want, N))
            k3t_fail(__FILE__, __LINE__, "%s: expf_n in place differs from k3_expf", paths[p]);
    }
    free(x), free(want), free(y);
}
