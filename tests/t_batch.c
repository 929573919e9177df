/*
 * t_batch.c - batched steps: eight sequences with different prompts, lengths
 * and sampling seeds, joining and leaving at different steps, each get
 * exactly the tokens and logits they get alone (streamed at the floor and
 * resident, one and two threads, passes split at max_chunk); decode steps of
 * up to max_chunk sequences and beyond allocate nothing; the memory plan
 * admits as many sequences as the budget holds and refuses one more; a
 * failed read inside a product stops the step at once with that error.
 */
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "alloc_guard.h"
#include "k3_engine.h"
#include "k3_gen.h"
#include "k3_io.h"
#include "k3_model.h"
#include "k3_pk.h"
#include "k3_test.h"
#include "k3_ws.h"

#define NSEQ 8
#define CTX 64
#define CHUNK 8

/* Per sequence: prompt length, tokens generated, the step it joins at, how
 * its prompt is fed (1: whole; 2: in two steps, the first without logits),
 * temperature (0: greedy), top-k, top-p, seed. */
static const uint32_t plen[NSEQ] = {1, 3, 7, 12, 2, 9, 5, 20};
static const uint32_t ngen[NSEQ] = {6, 4, 9, 3, 7, 5, 8, 4};
static const uint32_t join[NSEQ] = {0, 0, 1, 2, 2, 4, 5, 7};
static const int split[NSEQ] = {1, 2, 1, 2, 1, 1, 2, 1};
static const float temp[NSEQ] = {0.0f, 0.9f, 0.7f, 0.0f, 1.2f, 0.8f, 0.0f, 1.0f};
static const uint32_t topk[NSEQ] = {0, 40, 0, 0, 20, 0, 0, 60};
static const float topp[NSEQ] = {1.0f, 0.95f, 0.9f, 1.0f, 1.0f, 0.8f, 1.0f, 0.97f};

static uint32_t prompt_id(int i, uint32_t t, uint32_t V) { return (uint32_t)(7u * i + 31u * t + 1u) % V; }

static const char *model(void)
{
    static char up[4096], pk[4096];
    snprintf(up, sizeof up, "%s/up", k3t_tmpdir());
    snprintf(pk, sizeof pk, "%s/pk", k3t_tmpdir());
    if (k3t_runf(NULL, NULL, "test -f %s/manifest.json", pk) != 0) {
        CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-synth %s --preset tiny --quiet", up), 0);
        CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-convert %s %s >/dev/null 2>&1", up, pk), 0);
    }
    return pk;
}

static k3_engine *open_engine(const char *dir, const char *ram, uint32_t chunk, uint32_t seqs)
{
    k3_err e = {0};
    k3_engine_opts o;
    k3_engine_opts_init(&o);
    o.ram = ram;
    o.max_chunk = chunk;
    k3_engine *en = NULL;
    int rc = k3_engine_open(&en, dir, &o, &e);
    if (rc == 0) {
        k3_engine_size sz = {CTX, seqs, 0};
        rc = k3_engine_plan(en, &sz, NULL, &e);
    }
    if (rc == 0)
        rc = k3_engine_load(en, &e);
    if (rc)
        fprintf(stderr, "%s\n", e.msg);
    CHECK_EQ_INT(rc, 0);
    return en;
}

typedef struct run {
    uint32_t tok[16];
    float *lg;   /* ngen x V: the logits each token was drawn from */
} run;

static k3_sampler *sampler(int i, uint32_t V)
{
    k3_err e = {0};
    k3_sampler *s = NULL;
    CHECK_EQ_INT(k3_sampler_create(&s, V, temp[i], topk[i], topp[i], 1000u + (uint64_t)i, &e), 0);
    return s;
}

/* Sequence i alone: its prompt in one step, then one token per step. */
static void alone(k3_engine *en, int i, run *r)
{
    k3_err e = {0};
    const uint32_t V = k3_engine_cfg(en)->vocab_size;
    uint32_t ids[32];
    for (uint32_t t = 0; t < plen[i]; t++)
        ids[t] = prompt_id(i, t, V);
    r->lg = malloc((size_t)ngen[i] * V * sizeof(float));
    CHECK(r->lg != NULL);
    k3_sampler *smp = sampler(i, V);
    k3_seq *s;
    CHECK_EQ_INT(k3_seq_create(&s, en, CTX, &e), 0);
    k3_step_seq st = {s, ids, plen[i], K3_LOGITS_LAST, r->lg};
    CHECK_EQ_INT(k3_engine_step(en, &st, 1, &e), 0);
    for (uint32_t k = 0; k < ngen[i]; k++) {
        r->tok[k] = k3_sampler_next(smp, r->lg + (size_t)k * V);
        if (k + 1 == ngen[i])
            break;
        st = (k3_step_seq){s, &r->tok[k], 1, K3_LOGITS_LAST, r->lg + (size_t)(k + 1) * V};
        CHECK_EQ_INT(k3_engine_step(en, &st, 1, &e), 0);
    }
    k3_seq_free(s);
    k3_sampler_free(smp);
}

/* All eight on one engine: a sequence joins at its step (its prompt whole or
 * in two steps), then gets one token per step until it has its ngen tokens
 * and is freed. Entry order changes from step to step. Every token and
 * every logit compared with ref. */
static void together(k3_engine *en, const run *ref)
{
    k3_err e = {0};
    const uint32_t V = k3_engine_cfg(en)->vocab_size;
    k3_seq *s[NSEQ] = {0};
    k3_sampler *smp[NSEQ] = {0};
    float *lg[NSEQ];
    uint32_t ids[NSEQ][32], next[NSEQ], fed[NSEQ] = {0}, got[NSEQ] = {0};
    int done[NSEQ] = {0}, ndone = 0;
    for (int i = 0; i < NSEQ; i++) {
        lg[i] = malloc((size_t)V * sizeof(float));
        for (uint32_t t = 0; t < plen[i]; t++)
            ids[i][t] = prompt_id(i, t, V);
    }
    for (uint32_t step = 0; ndone < NSEQ; step++) {
        CHECK(step < 64);
        k3_step_seq st[NSEQ];
        int who[NSEQ];
        uint32_t n = 0;
        for (int j = 0; j < NSEQ; j++) {
            int i = step % 2 ? NSEQ - 1 - j : (j + (int)step) % NSEQ;
            if (done[i] || join[i] > step)
                continue;
            if (!s[i]) {
                CHECK_EQ_INT(k3_seq_create(&s[i], en, CTX, &e), 0);
                smp[i] = sampler(i, V);
            }
            if (fed[i] < plen[i]) {   /* the prompt, or its first or second part */
                uint32_t k = split[i] == 2 && fed[i] == 0 ? plen[i] / 2 + 1 : plen[i] - fed[i];
                if (k > plen[i] - fed[i])
                    k = plen[i] - fed[i];
                int last = fed[i] + k == plen[i];
                st[n] = (k3_step_seq){s[i], ids[i] + fed[i], k, last ? K3_LOGITS_LAST : K3_LOGITS_NONE,
                                      last ? lg[i] : NULL};
                fed[i] += k;
            } else {
                st[n] = (k3_step_seq){s[i], &next[i], 1, K3_LOGITS_LAST, lg[i]};
            }
            who[n++] = i;
        }
        if (n == 0)
            continue;
        CHECK_EQ_INT(k3_engine_step(en, st, n, &e), 0);
        for (uint32_t q = 0; q < n; q++) {
            int i = who[q];
            if (st[q].logits == K3_LOGITS_NONE)
                continue;
            if (memcmp(lg[i], ref[i].lg + (size_t)got[i] * V, (size_t)V * sizeof(float)))
                k3t_fail(__FILE__, __LINE__, "sequence %d, token %u (step %u, %u in the batch): logits differ from "
                         "the sequence alone", i, got[i], step, n);
            next[i] = k3_sampler_next(smp[i], lg[i]);
            if (next[i] != ref[i].tok[got[i]])
                k3t_fail(__FILE__, __LINE__, "sequence %d, token %u: %u, alone %u", i, got[i], next[i],
                         ref[i].tok[got[i]]);
            if (++got[i] == ngen[i]) {   /* leaves */
                k3_seq_free(s[i]);
                s[i] = NULL;
                done[i] = 1;
                ndone++;
            }
        }
    }
    for (int i = 0; i < NSEQ; i++) {
        k3_sampler_free(smp[i]);
        free(lg[i]);
    }
}

K3_TEST_TIMEOUT(batch_eight_sequences_joining_and_leaving_match_each_alone, 300)
{
    const char *dir = model();
    run ref[NSEQ];
    k3_engine *en = open_engine(dir, NULL, 64, 1);
    for (int i = 0; i < NSEQ; i++)
        alone(en, i, &ref[i]);
    k3_engine_close(en);
    const char *rams[2] = {"floor", NULL};
    const int threads[2] = {1, 2};
    const int nt0 = omp_get_max_threads();
    for (int ti = 0; ti < 2; ti++) {
        omp_set_num_threads(threads[ti]);
        /* every loop through its threaded path when there are threads */
        k3_model_set_parallel_threshold(threads[ti] > 1 ? 0 : 1u << 16);
        for (int ri = 0; ri < 2; ri++) {
            en = open_engine(dir, rams[ri], CHUNK, NSEQ);
            together(en, ref);
            k3_engine_close(en);
        }
    }
    k3_model_set_parallel_threshold(1u << 16);
    omp_set_num_threads(nt0);
    for (int i = 0; i < NSEQ; i++)
        free(ref[i].lg);
}

/* Decode steps of n sequences (one token each) with the counter armed. */
static uint64_t decode_allocs(const char *ram, uint32_t n)
{
    k3_err e = {0};
    k3_engine *en = open_engine(model(), ram, CHUNK, n);
    const uint32_t V = k3_engine_cfg(en)->vocab_size;
    k3_seq *s[16];
    float *lg = malloc((size_t)n * V * sizeof(float));
    k3_step_seq st[16];
    uint32_t id[16];
    for (uint32_t i = 0; i < n; i++) {
        CHECK_EQ_INT(k3_seq_create(&s[i], en, CTX, &e), 0);
        id[i] = prompt_id((int)i, 0, V);
        st[i] = (k3_step_seq){s[i], &id[i], 1, K3_LOGITS_LAST, lg + (size_t)i * V};
    }
    uint64_t a = 0;
    for (int k = 0; k < 4; k++) {
        if (k > 0)   /* the first step warms the thread pool */
            k3t_alloc_arm();
        int rc = k3_engine_step(en, st, n, &e);
        if (k > 0)
            a += k3t_alloc_disarm();
        CHECK_EQ_INT(rc, 0);
        for (uint32_t i = 0; i < n; i++)
            id[i] = (id[i] + 1) % V;
    }
    free(lg);
    k3_engine_close(en);
    return a;
}

K3_TEST(batch_decode_steps_allocate_nothing)
{
    /* one pass (8 = max_chunk) and two (16) */
    CHECK_EQ_U64(decode_allocs("floor", 8), 0);
    CHECK_EQ_U64(decode_allocs(NULL, 8), 0);
    CHECK_EQ_U64(decode_allocs("floor", 16), 0);
    CHECK_EQ_U64(decode_allocs(NULL, 16), 0);
}

K3_TEST(batch_plan_admits_what_the_budget_holds)
{
    k3_err e = {0};
    const char *dir = model();
    /* the floor for one sequence, then that plus room for 3 more */
    k3_engine *en = open_engine(dir, "floor", CHUNK, 1);
    k3_engine_mem m1;
    CHECK_EQ_INT(k3_engine_mem_get(en, &m1, &e), 0);
    CHECK(m1.seq_bytes > 0);
    CHECK_EQ_U64(m1.seq_bytes, m1.seq_state + m1.seq_kv + m1.seq_scores);
    CHECK_EQ_INT(m1.planned_seqs, 1);
    CHECK_EQ_INT(m1.max_seqs, 1);
    const k3_stream_plan *p = NULL;
    CHECK_EQ_INT(k3_engine_plan(en, NULL, &p, &e), 0);
    const uint64_t floor1 = p->floor;
    /* one sequence fits, a second is past the budget */
    k3_seq *a, *b;
    CHECK_EQ_INT(k3_seq_create(&a, en, CTX, &e), 0);
    k3_err_clear(&e);
    CHECK_EQ_INT(k3_seq_create(&b, en, CTX, &e), K3_EBUDGET);
    CHECK_STR_CONTAINS(e.msg, "memory plan counts 1 sequence");
    k3_engine_close(en);

    /* a budget with room for several more (the process's measured RSS, part
     * of every floor, moves a little between plans: the room is generous) */
    char ram[64];
    snprintf(ram, sizeof ram, "%llu", (unsigned long long)(floor1 + (16ull << 20) + 5 * m1.seq_bytes));
    k3_engine_opts o;
    k3_engine_opts_init(&o);
    o.ram = ram;
    o.max_chunk = CHUNK;
    CHECK_EQ_INT(k3_engine_open(&en, dir, &o, &e), 0);
    k3_engine_size sz = {CTX, K3_ENGINE_SEQS_FIT, 0};
    int rc = k3_engine_plan(en, &sz, &p, &e);
    if (rc)
        fprintf(stderr, "%s\n", e.msg);
    CHECK_EQ_INT(rc, 0);
    CHECK(p->total <= p->budget);
    CHECK(p->budget - p->floor < m1.seq_bytes);   /* no room left for one more */
    CHECK_EQ_INT(k3_engine_load(en, &e), 0);
    k3_engine_mem m;
    CHECK_EQ_INT(k3_engine_mem_get(en, &m, &e), 0);
    CHECK(m.planned_seqs >= 6);
    CHECK_EQ_INT(m.max_seqs, m.planned_seqs);
    const uint32_t N = m.planned_seqs;
    k3_seq **s = calloc(N + 1, sizeof *s);
    for (uint32_t i = 0; i < N; i++)
        CHECK_EQ_INT(k3_seq_create(&s[i], en, CTX, &e), 0);
    CHECK_EQ_INT(k3_engine_mem_get(en, &m, &e), 0);
    CHECK_EQ_INT(m.live_seqs, N);
    CHECK_EQ_U64(m.live_bytes, (uint64_t)N * m.seq_bytes);
    k3_err_clear(&e);
    CHECK_EQ_INT(k3_seq_create(&s[N], en, CTX, &e), K3_EBUDGET);
    /* shorter sequences take less; a freed sequence's room is taken again */
    k3_seq_free(s[0]);
    CHECK_EQ_INT(k3_seq_create(&s[0], en, CTX / 2, &e), 0);
    k3_seq_free(s[1]);
    CHECK_EQ_INT(k3_seq_create(&s[1], en, CTX, &e), 0);
    free(s);
    k3_engine_close(en);
}

K3_TEST(batch_run_plan_prints_the_sequence_cost_and_the_admitted_maximum)
{
    const char *dir = model();
    char *err = NULL;
    CHECK_EQ_INT(k3t_runf(NULL, &err, "k3-run %s --ids 1,2,3 --gen 4 --ram floor --plan", dir), 0);
    CHECK_STR_CONTAINS(err, "k3-run:   per sequence ");
    CHECK_STR_CONTAINS(err, "7 tokens)");
    CHECK_STR_CONTAINS(err, "sequences      1 planned; the budget admits at most 1 of 7 tokens each");
    free(err);
    CHECK_EQ_INT(k3t_runf(NULL, &err, "k3-run %s --ids 1,2,3 --gen 4 --ram 64M --plan", dir), 0);
    CHECK(!strstr(err, "admits at most 1 of"));
    free(err);
}

/* An I/O error in the last row piece of layer 1's first matrix (KDA q,
 * pieces of 2 KiB): the step fails with that read's error, and nothing after
 * the failed product runs - layer 1's router never asks for an expert. */
K3_TEST(batch_a_failed_read_inside_a_product_stops_the_step_at_once)
{
    const char *dir = model();
    k3_pk *p = NULL;
    CHECK_EQ_INT(k3_pk_open(&p, dir, 0, NULL), 0);
    char name[256];
    snprintf(name, sizeof name, "language_model.model.layers.1.%s", k3_wslot_name(K3_W_KDA_Q));
    const k3_pk_tensor *t = p ? k3_pk_tensor_find(p, name) : NULL;
    CHECK(t != NULL && t->nbytes > 4096);
    if (!t) {
        k3_pk_close(p);
        return;
    }
    const char *path = k3_pk_file_at(p, k3_pk_unit_at(p, t->pieces[0].unit)->file)->path;
    const char *base = strrchr(path, '/') ? strrchr(path, '/') + 1 : path;
    char fault[1024];
    snprintf(fault, sizeof fault, "eio:%s:%llu", base, (unsigned long long)(t->pieces[0].offset + t->nbytes - 64));
    k3_pk_close(p);

    k3_err e = {0};
    k3_engine_opts o;
    k3_engine_opts_init(&o);
    o.ram = "floor";
    o.piece_bytes = 2048;
    o.max_chunk = CHUNK;
    k3_engine *en = NULL;
    CHECK_EQ_INT(k3_engine_open(&en, dir, &o, &e), 0);
    k3_engine_size sz = {CTX, 2, 0};
    CHECK_EQ_INT(k3_engine_plan(en, &sz, NULL, &e), 0);
    CHECK_EQ_INT(k3_engine_load(en, &e), 0);
    const uint32_t V = k3_engine_cfg(en)->vocab_size;
    k3_seq *a, *b;
    CHECK_EQ_INT(k3_seq_create(&a, en, CTX, &e), 0);
    CHECK_EQ_INT(k3_seq_create(&b, en, CTX, &e), 0);
    float *lg = malloc(2 * (size_t)V * sizeof(float));
    uint32_t ids[2] = {3, 1};
    k3_step_seq st[2] = {{a, ids, 2, K3_LOGITS_LAST, lg}, {b, ids + 1, 1, K3_LOGITS_LAST, lg + V}};
    setenv("K3_FAULT", fault, 1);
    k3_io_fault_reset();
    int rc = k3_engine_step(en, st, 2, &e);
    unsetenv("K3_FAULT");
    k3_io_fault_reset();
    CHECK_EQ_INT(rc, K3_EIO);
    CHECK_STR_CONTAINS(e.msg, k3_wslot_name(K3_W_KDA_Q));
    k3_stream_stats ss;
    CHECK_EQ_INT(k3_engine_stream_stats(en, &ss), 0);
    CHECK_EQ_U64(ss.expert_requests, 0);
    /* and the engine stays failed */
    k3_err_clear(&e);
    CHECK_EQ_INT(k3_engine_step(en, st, 2, &e), K3_EIO);
    free(lg);
    k3_engine_close(en);
}
