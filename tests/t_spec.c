/*
 * t_spec.c - speculative decoding never changes the output.
 *
 *   - k3-run --spec ngram against plain decoding, greedy and temperature 0.8
 *     with three seeds, on a random tiny checkpoint and on the trained
 *     models/kjv-tiny (which repeats text, so guesses are kept and rejected),
 *     at --ram floor and resident, 1 and 2 threads: the same generated ids,
 *     the same --logits-all and --logits-gen bytes.
 *   - the verifier over the engine API with a drafter that knows the plain
 *     continuation and spoils one guess in three (at every place of the
 *     draft, for every draft length): the same ids, the same logits, and the
 *     sequence left behind continues with the bytes of plain decoding's.
 */
#include <cjson/cJSON.h>
#include <stdlib.h>
#include <string.h>

#include "k3_engine.h"
#include "k3_spec.h"
#include "k3_test.h"

static const char *tiny_packed(void)
{
    static char up[4096], pk[4096];
    snprintf(up, sizeof up, "%s/up", k3t_tmpdir());
    snprintf(pk, sizeof pk, "%s/pk", k3t_tmpdir());
    if (k3t_runf(NULL, NULL, "test -f %s/manifest.json", pk) != 0)
        CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-synth %s --preset tiny --quiet && k3-convert %s %s --quiet", up, up,
                              pk), 0);
    return pk;
}

static const char *kjv_packed(void)
{
    static char pk[4096];
    snprintf(pk, sizeof pk, "%s/kjv", k3t_tmpdir());
    if (k3t_runf(NULL, NULL, "test -f %s/manifest.json", pk) != 0)
        CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-convert %s/models/kjv-tiny %s --quiet", k3t_root(), pk), 0);
    return pk;
}

/* One k3-run; returns its JSON (caller frees) and leaves logits in tag.all / tag.gen. */
static cJSON *run_json(const char *model, const char *input, const char *opts, const char *tag)
{
    char *out = NULL, *err = NULL;
    const char *d = k3t_tmpdir();
    int rc = k3t_runf(&out, &err, "k3-run %s %s --gen 40 --json --quiet %s --logits-all %s/%s.all "
                      "--logits-gen %s/%s.gen", model, input, opts, d, tag, d, tag);
    if (rc != 0)
        k3t_fail(__FILE__, __LINE__, "k3-run %s: exit %d: %s", opts, rc, err ? err : "");
    cJSON *j = cJSON_Parse(out);
    CHECK(j != NULL);
    free(out);
    free(err);
    return j;
}

static int same_file(const char *a, const char *b)
{
    const char *d = k3t_tmpdir();
    return k3t_runf(NULL, NULL, "cmp -s %s/%s %s/%s", d, a, d, b) == 0;
}

/* Sweeps one model; adds the guesses fed and kept to *drafted / *kept. */
static void sweep(const char *model, const char *input, double *drafted, double *kept)
{
    static const char *sampling[] = {"", "--temperature 0.8 --seed 1", "--temperature 0.8 --seed 2",
                                     "--temperature 0.8 --seed 3"};
    static const char *where[] = {"--ram floor --threads 1", "--ram floor --threads 2",
                                  "--ram resident --threads 1", "--ram resident --threads 2"};
    for (int si = 0; si < 4; si++) {
        char opts[512];
        snprintf(opts, sizeof opts, "--ram resident --threads 1 %s", sampling[si]);
        cJSON *ref = run_json(model, input, opts, "ref");
        char *ref_ids = cJSON_PrintUnformatted(cJSON_GetObjectItem(ref, "generated_ids"));
        for (int wi = 0; wi < 4; wi++) {
            snprintf(opts, sizeof opts, "%s %s --spec ngram:%d", where[wi], sampling[si], 2 + 2 * wi);
            cJSON *sp = run_json(model, input, opts, "spec");
            char *ids = cJSON_PrintUnformatted(cJSON_GetObjectItem(sp, "generated_ids"));
            if (strcmp(ids, ref_ids))
                k3t_fail(__FILE__, __LINE__, "%s %s: ids %s, plain decoding %s", model, opts, ids, ref_ids);
            if (!same_file("spec.all", "ref.all") || !same_file("spec.gen", "ref.gen"))
                k3t_fail(__FILE__, __LINE__, "%s %s: the logits differ from plain decoding", model, opts);
            cJSON *s = cJSON_GetObjectItem(sp, "spec");
            CHECK(s != NULL);
            *drafted += cJSON_GetNumberValue(cJSON_GetObjectItem(s, "drafted"));
            *kept += cJSON_GetNumberValue(cJSON_GetObjectItem(s, "accepted"));
            free(ids);
            cJSON_Delete(sp);
        }
        free(ref_ids);
        cJSON_Delete(ref);
    }
}

K3_TEST_TIMEOUT(spec_cli_gives_the_ids_and_logits_of_plain_decoding, 600)
{
    double d = 0, k = 0;
    sweep(tiny_packed(), "--ids 5,6,7,8,9,5,6,7,8,9,5,6,7", &d, &k);
    sweep(kjv_packed(), "--prompt 'And God said, Let there be light: and there was light. And God saw the light, "
                        "that it was good. And God said, Let there be'", &d, &k);
    /* the sweep must have gone through the verifier's both branches */
    if (!(k > 0 && k < d))
        k3t_fail(__FILE__, __LINE__, "guesses kept %g of %g: the sweep did not exercise keep and reject", k, d);
}

K3_TEST(spec_cli_refuses_a_bad_drafter)
{
    const char *m = tiny_packed();
    static const char *bad[] = {"medusa", "ngram:0", "ngram:33", "ngram:", "ngram:2x", "ngramx"};
    for (int i = 0; i < 6; i++) {
        char *err = NULL;
        CHECK_EQ_INT(k3t_runf(NULL, &err, "k3-run %s --ids 1,2 --spec %s", m, bad[i]), 2);
        CHECK_STR_CONTAINS(err, "--spec");
        free(err);
    }
}

/* ---------------------------------------------------------- library */

/* Guesses the known continuation ref[], spoiling about one guess in three
 * (which ones depends on phase; phase 3 spoils none). */
typedef struct oracle {
    k3_drafter d;
    const uint32_t *ref;
    uint32_t n_ref, n_prompt, phase;
} oracle;

static uint32_t oracle_propose(k3_drafter *d, const uint32_t *hist, uint32_t n, uint32_t max, uint32_t *out)
{
    const oracle *o = (const oracle *)d;
    (void)hist;
    uint32_t g = n - o->n_prompt, k = 0;
    for (; k < max && g + k < o->n_ref; k++)
        out[k] = o->phase < 3 && ((g + k + o->phase) * 2654435761u >> 9) % 3 == 0 ? (o->ref[g + k] + 1) % 200
                                                                                  : o->ref[g + k];
    return k;
}

static void oracle_free(k3_drafter *d) { (void)d; }

static k3_engine *open_engine(const char *dir, const char *ram)
{
    k3_err e = {0};
    k3_engine_opts o;
    k3_engine_opts_init(&o);
    o.ram = ram;
    k3_engine *en = NULL;
    int rc = k3_engine_open(&en, dir, &o, &e);
    k3_engine_size sz = {64, 3, 0};
    if (rc == 0)
        rc = k3_engine_plan(en, &sz, NULL, &e);
    if (rc == 0)
        rc = k3_engine_load(en, &e);
    if (rc)
        fprintf(stderr, "%s\n", e.msg);
    CHECK_EQ_INT(rc, 0);
    return en;
}

#define NGEN 24

K3_TEST_TIMEOUT(spec_verifier_rolls_back_exactly_whatever_the_guesses, 300)
{
    static const char *rams[] = {"resident", "floor"};
    const uint32_t prompt[] = {3, 1, 4, 1, 5, 9, 2, 6};
    const uint32_t np = 8;
    for (int ri = 0; ri < 2; ri++) {
        k3_engine *en = open_engine(tiny_packed(), rams[ri]);
        const uint32_t V = k3_engine_cfg(en)->vocab_size;
        k3_err e = {0};
        float *lg = malloc((uint64_t)V * sizeof *lg), *first = malloc((uint64_t)V * sizeof *first);
        float *gl_ref = malloc((uint64_t)NGEN * V * sizeof *gl_ref), *gl = malloc((uint64_t)NGEN * V * sizeof *gl);
        uint64_t cap = 1u << 24;
        uint8_t *st_ref = malloc(cap), *st_got = malloc(cap);
        for (int temp = 0; temp < 2; temp++) {
            float T = temp ? 0.8f : 0.0f;
            /* plain decoding: ids, logits, and the state it leaves (all but the last id fed) */
            k3_seq *q;
            k3_sampler *smp;
            CHECK_EQ_INT(k3_seq_create(&q, en, 64, &e), 0);
            CHECK_EQ_INT(k3_sampler_create(&smp, V, T, 0, 1.0f, 11, &e), 0);
            k3_gen_opts go = {NGEN, NULL, 0, lg, first, NULL, NULL, NULL, NULL, gl_ref};
            uint32_t ref[NGEN], n_ref = 0;
            k3_gen_stats gs;
            CHECK_EQ_INT(k3_gen_seq(en, q, smp, prompt, np, &go, ref, &n_ref, &gs, &e), 0);
            CHECK_EQ_INT(n_ref, NGEN);
            uint64_t len_ref = 0;
            CHECK_EQ_INT(k3_seq_state_save(q, st_ref, cap, &len_ref, &e), 0);
            k3_sampler_free(smp);
            for (uint32_t k_max = 1; k_max <= 6; k_max++) {
                uint64_t spoiled_fed = 0, spoiled_kept = 0;
                for (uint32_t phase = 0; phase < 4; phase++) {   /* phase 3: never spoiled */
                    oracle o = {{"oracle", oracle_propose, oracle_free}, ref, NGEN, np, phase};
                    k3_seq_reset(q);
                    CHECK_EQ_INT(k3_sampler_create(&smp, V, T, 0, 1.0f, 11, &e), 0);
                    go.gen_logits = gl;
                    uint32_t got[NGEN], n = 0;
                    k3_spec_stats sp;
                    int rc = k3_spec_gen_seq(en, q, smp, &o.d, k_max, prompt, np, &go, got, &n, &gs, &sp, &e);
                    if (rc)
                        fprintf(stderr, "%s\n", e.msg);
                    CHECK_EQ_INT(rc, 0);
                    CHECK_EQ_INT(n, NGEN);
                    CHECK_EQ_INT(k3_sampler_count(smp), NGEN);
                    if (memcmp(got, ref, sizeof ref) || memcmp(gl, gl_ref, (uint64_t)NGEN * V * sizeof *gl))
                        k3t_fail(__FILE__, __LINE__, "%s T=%g K=%u phase %u: ids or logits differ", rams[ri], T,
                                 k_max, phase);
                    CHECK(sp.accepted > 0);
                    if (phase < 3) {
                        spoiled_fed += sp.drafted;
                        spoiled_kept += sp.accepted;
                    }
                    if (phase == 2 && spoiled_kept >= spoiled_fed)
                        k3t_fail(__FILE__, __LINE__, "%s T=%g K=%u: no guess rejected", rams[ri], T, k_max);
                    if (phase == 3 && sp.accepted != sp.drafted)
                        k3t_fail(__FILE__, __LINE__, "%s T=%g K=%u: right guesses rejected", rams[ri], T, k_max);
                    /* the sequence holds the first n_fed ids: feed the rest but the last */
                    CHECK_EQ_INT(k3_seq_pos(q), np + sp.n_fed);
                    if (sp.n_fed < NGEN - 1) {
                        k3_step_seq s = {q, got + sp.n_fed, NGEN - 1 - sp.n_fed, K3_LOGITS_NONE, NULL};
                        CHECK_EQ_INT(k3_engine_step(en, &s, 1, &e), 0);
                    }
                    uint64_t len = 0;
                    CHECK_EQ_INT(k3_seq_state_save(q, st_got, cap, &len, &e), 0);
                    if (len != len_ref || memcmp(st_got, st_ref, len))
                        k3t_fail(__FILE__, __LINE__, "%s T=%g K=%u phase %u: the state differs from plain "
                                 "decoding's", rams[ri], T, k_max, phase);
                    k3_sampler_free(smp);
                }
            }
            k3_seq_free(q);
        }
        free(lg);
        free(first);
        free(gl_ref);
        free(gl);
        free(st_ref);
        free(st_got);
        k3_engine_close(en);
    }
}
