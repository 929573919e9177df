/*
 * t_engine.c - the engine API driven directly: several sequences in one step
 * get exactly the bits each gets alone (resident and streamed), a saved state
 * continues bit-identically and refuses damaged bytes, a bad step entry moves
 * no sequence, and a decode step allocates nothing (alloc_guard.h).
 */
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "alloc_guard.h"
#include "k3_engine.h"
#include "k3_model.h"
#include "k3_test.h"

#define NDEC 6

static uint32_t p0[] = {1, 2, 3, 4, 5};
static uint32_t p1[] = {7, 8};
static uint32_t p2[] = {9, 10, 11, 12, 13, 14, 15, 16, 17, 300, 301, 40};
static const uint32_t *prompts[3] = {p0, p1, p2};
static const uint32_t plen[3] = {5, 2, 12};

/* An upstream tiny model, and (packed != 0) its packed form. */
static const char *model(int packed)
{
    static char up[4096], pk[4096];
    snprintf(up, sizeof up, "%s/up", k3t_tmpdir());
    snprintf(pk, sizeof pk, "%s/pk", k3t_tmpdir());
    if (k3t_runf(NULL, NULL, "test -f %s/config.json", up) != 0)
        CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-synth %s --preset tiny --quiet", up), 0);
    if (packed && k3t_runf(NULL, NULL, "test -f %s/manifest.json", pk) != 0)
        CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-convert %s %s >/dev/null 2>&1", up, pk), 0);
    return packed ? pk : up;
}

static k3_engine *open_engine(const char *dir, const char *ram, uint32_t chunk)
{
    k3_err e = {0};
    k3_engine_opts o;
    k3_engine_opts_init(&o);
    o.ram = ram;
    o.max_chunk = chunk;
    k3_engine *en = NULL;
    int rc = k3_engine_open(&en, dir, &o, &e);
    if (rc == 0) {
        k3_engine_size sz = {64, 4, 0};
        rc = k3_engine_plan(en, &sz, NULL, &e);
    }
    if (rc == 0)
        rc = k3_engine_load(en, &e);
    if (rc)
        fprintf(stderr, "%s\n", e.msg);
    CHECK_EQ_INT(rc, 0);
    return en;
}

static uint32_t argmax(const float *x, uint32_t n)
{
    uint32_t b = 0;
    for (uint32_t i = 1; i < n; i++)
        if (x[i] > x[b])
            b = i;
    return b;
}

/* Logits of sequence i alone: the prompt's last position, then NDEC greedy
 * decode steps; (1 + NDEC) x V floats. */
static float *alone(k3_engine *en, int i)
{
    k3_err e = {0};
    const uint32_t V = k3_engine_cfg(en)->vocab_size;
    float *lg = malloc((size_t)(1 + NDEC) * V * sizeof(float));
    CHECK(lg != NULL);
    k3_seq *s;
    CHECK_EQ_INT(k3_seq_create(&s, en, 64, &e), 0);
    k3_step_seq st = {s, prompts[i], plen[i], K3_LOGITS_LAST, lg};
    CHECK_EQ_INT(k3_engine_step(en, &st, 1, &e), 0);
    for (int k = 0; k < NDEC; k++) {
        uint32_t id = argmax(lg + (size_t)k * V, V);
        k3_step_seq d = {s, &id, 1, K3_LOGITS_LAST, lg + (size_t)(k + 1) * V};
        CHECK_EQ_INT(k3_engine_step(en, &d, 1, &e), 0);
    }
    CHECK_EQ_INT(k3_seq_pos(s), plen[i] + NDEC);
    k3_seq_free(s);
    return lg;
}

/* The three sequences stepped together (in the order given), the same
 * tokens; each sequence's logits compared bit for bit with ref[i]. */
static void together(k3_engine *en, float *const ref[3], const int order[3])
{
    k3_err e = {0};
    const uint32_t V = k3_engine_cfg(en)->vocab_size;
    k3_seq *s[3];
    float *lg[3];
    uint32_t id[3];
    for (int i = 0; i < 3; i++) {
        CHECK_EQ_INT(k3_seq_create(&s[i], en, 64, &e), 0);
        lg[i] = malloc((size_t)V * sizeof(float));
    }
    k3_step_seq st[3];
    for (int j = 0; j < 3; j++) {
        int i = order[j];
        st[j] = (k3_step_seq){s[i], prompts[i], plen[i], K3_LOGITS_LAST, lg[i]};
    }
    CHECK_EQ_INT(k3_engine_step(en, st, 3, &e), 0);
    for (int k = 0; k <= NDEC; k++) {
        for (int i = 0; i < 3; i++) {
            if (memcmp(lg[i], ref[i] + (size_t)k * V, (size_t)V * sizeof(float)))
                k3t_fail(__FILE__, __LINE__, "sequence %d, step %d: logits differ from the sequence alone", i, k);
            id[i] = argmax(lg[i], V);
        }
        if (k == NDEC)
            break;
        for (int j = 0; j < 3; j++) {
            int i = order[j];
            st[j] = (k3_step_seq){s[i], &id[i], 1, K3_LOGITS_LAST, lg[i]};
        }
        CHECK_EQ_INT(k3_engine_step(en, st, 3, &e), 0);
    }
    for (int i = 0; i < 3; i++) {
        k3_seq_free(s[i]);
        free(lg[i]);
    }
}

K3_TEST(engine_three_sequences_in_one_step_match_each_alone)
{
    k3_engine *en = open_engine(model(1), NULL, 4);
    float *ref[3];
    for (int i = 0; i < 3; i++)
        ref[i] = alone(en, i);
    const int fwd[3] = {0, 1, 2}, rev[3] = {2, 0, 1};
    together(en, ref, fwd);
    together(en, ref, rev);
    k3_engine_close(en);
    /* the same bits streamed at the floor, from the upstream checkpoint, and
     * with another chunk size */
    const char *dirs[3] = {model(1), model(0), model(0)};
    const char *rams[3] = {"floor", NULL, NULL};
    const uint32_t chunks[3] = {4, 64, 1};
    for (int k = 0; k < 3; k++) {
        en = open_engine(dirs[k], rams[k], chunks[k]);
        together(en, ref, fwd);
        k3_engine_close(en);
    }
    for (int i = 0; i < 3; i++)
        free(ref[i]);
}

K3_TEST(engine_saved_state_continues_bit_identically)
{
    k3_err e = {0};
    k3_engine *en = open_engine(model(0), NULL, 4);
    const uint32_t V = k3_engine_cfg(en)->vocab_size;
    float *ref = alone(en, 2);
    k3_seq *a, *b, *c;
    CHECK_EQ_INT(k3_seq_create(&a, en, 64, &e), 0);
    CHECK_EQ_INT(k3_seq_create(&b, en, 40, &e), 0);
    CHECK_EQ_INT(k3_seq_create(&c, en, 20, &e), 0);
    float *lg = malloc((size_t)V * sizeof(float));
    k3_step_seq st = {a, p2, plen[2], K3_LOGITS_LAST, lg};
    CHECK_EQ_INT(k3_engine_step(en, &st, 1, &e), 0);
    uint64_t n = k3_seq_state_size(a), len = 0;
    CHECK(n > 64);
    uint8_t *buf = malloc(n);
    /* too small a buffer: refused, nothing written */
    k3_err_clear(&e);
    CHECK_EQ_INT(k3_seq_state_save(a, buf, n - 1, &len, &e), K3_ELIMIT);
    CHECK_EQ_INT(len, 0);
    k3_err_clear(&e);
    CHECK_EQ_INT(k3_seq_state_save(a, buf, n, &len, &e), 0);
    CHECK_EQ_U64(len, n);
    /* damaged bytes are refused and leave the sequence as it was */
    buf[n - 3] ^= 0x10;
    k3_err_clear(&e);
    CHECK_EQ_INT(k3_seq_state_load(b, buf, n, &e), K3_EFORMAT);
    CHECK_STR_CONTAINS(e.msg, "CRC32");
    buf[n - 3] ^= 0x10;
    k3_err_clear(&e);
    CHECK_EQ_INT(k3_seq_state_load(b, buf, n - 4, &e), K3_EFORMAT);
    buf[20] ^= 1;   /* hidden size */
    k3_err_clear(&e);
    CHECK_EQ_INT(k3_seq_state_load(b, buf, n, &e), K3_EFORMAT);
    CHECK_STR_CONTAINS(e.msg, "another model shape");
    buf[20] ^= 1;
    k3_err_clear(&e);
    CHECK_EQ_INT(k3_seq_state_load(b, "not a state at all, but long enough to have a header of 64 bytes", 64, &e),
                 K3_EFORMAT);
    CHECK_EQ_INT(k3_seq_pos(b), 0);
    /* a sequence too short for the position */
    k3_seq *tiny;
    CHECK_EQ_INT(k3_seq_create(&tiny, en, 8, &e), 0);
    k3_err_clear(&e);
    CHECK_EQ_INT(k3_seq_state_load(tiny, buf, n, &e), K3_ELIMIT);
    k3_err_clear(&e);
    CHECK_EQ_INT(k3_seq_copy(tiny, a, &e), K3_ELIMIT);
    k3_seq_free(tiny);
    /* b: loaded from the bytes; c: a copy; a: goes on. All three match the
     * sequence that was never stopped. */
    k3_err_clear(&e);
    CHECK_EQ_INT(k3_seq_state_load(b, buf, n, &e), 0);
    CHECK_EQ_INT(k3_seq_copy(c, a, &e), 0);
    CHECK_EQ_INT(k3_seq_pos(b), plen[2]);
    CHECK_EQ_INT(k3_seq_pos(c), plen[2]);
    k3_seq *all[3] = {a, b, c};
    float *out[3];
    for (int i = 0; i < 3; i++)
        out[i] = malloc((size_t)V * sizeof(float));
    uint32_t id = argmax(lg, V);
    for (int k = 0; k < NDEC; k++) {
        k3_step_seq s3[3];
        for (int i = 0; i < 3; i++)
            s3[i] = (k3_step_seq){all[i], &id, 1, K3_LOGITS_LAST, out[i]};
        CHECK_EQ_INT(k3_engine_step(en, s3, 3, &e), 0);
        for (int i = 0; i < 3; i++)
            if (memcmp(out[i], ref + (size_t)(k + 1) * V, (size_t)V * sizeof(float)))
                k3t_fail(__FILE__, __LINE__, "sequence %d (0 ran on, 1 loaded, 2 copied), step %d: logits differ",
                         i, k);
        id = argmax(out[0], V);
    }
    /* a reset sequence starts over */
    k3_seq_reset(b);
    CHECK_EQ_INT(k3_seq_pos(b), 0);
    for (int i = 0; i < 3; i++)
        free(out[i]);
    free(buf);
    free(lg);
    free(ref);
    k3_engine_close(en);   /* frees a, b, c */
}

K3_TEST(engine_a_bad_step_entry_moves_no_sequence)
{
    k3_err e = {0};
    k3_engine *en = open_engine(model(0), NULL, 4);
    const uint32_t V = k3_engine_cfg(en)->vocab_size;
    k3_seq *a, *b;
    CHECK_EQ_INT(k3_seq_create(&a, en, 8, &e), 0);
    CHECK_EQ_INT(k3_seq_create(&b, en, 8, &e), 0);
    float *lg = malloc((size_t)V * sizeof(float));
    uint32_t bad = V;
    k3_step_seq st[2] = {{a, p0, 5, K3_LOGITS_LAST, lg}, {b, &bad, 1, K3_LOGITS_LAST, lg}};
    k3_err_clear(&e);
    CHECK_EQ_INT(k3_engine_step(en, st, 2, &e), K3_EARG);
    CHECK_STR_CONTAINS(e.msg, "out of range");
    st[1] = (k3_step_seq){a, p1, 2, K3_LOGITS_NONE, NULL};
    k3_err_clear(&e);
    CHECK_EQ_INT(k3_engine_step(en, st, 2, &e), K3_EARG);
    CHECK_STR_CONTAINS(e.msg, "already in this step");
    st[1] = (k3_step_seq){b, p2, 12, K3_LOGITS_NONE, NULL};
    k3_err_clear(&e);
    CHECK_EQ_INT(k3_engine_step(en, st, 2, &e), K3_ELIMIT);
    st[1] = (k3_step_seq){b, p1, 2, K3_LOGITS_LAST, NULL};
    k3_err_clear(&e);
    CHECK_EQ_INT(k3_engine_step(en, st, 2, &e), K3_EARG);
    CHECK_EQ_INT(k3_seq_pos(a), 0);
    CHECK_EQ_INT(k3_seq_pos(b), 0);
    free(lg);
    k3_engine_close(en);
}

/* Decode steps of three sequences, one token each, with the counter armed. */
static uint64_t decode_allocs(const char *dir, const char *ram)
{
    k3_err e = {0};
    k3_engine *en = open_engine(dir, ram, 4);
    const uint32_t V = k3_engine_cfg(en)->vocab_size;
    k3_seq *s[3];
    float *lg[3];
    k3_step_seq st[3];
    for (int i = 0; i < 3; i++) {
        CHECK_EQ_INT(k3_seq_create(&s[i], en, 64, &e), 0);
        lg[i] = malloc((size_t)V * sizeof(float));
        st[i] = (k3_step_seq){s[i], prompts[i], plen[i], K3_LOGITS_LAST, lg[i]};
    }
    CHECK_EQ_INT(k3_engine_step(en, st, 3, &e), 0);
    uint32_t id[3];
    uint64_t n = 0;
    for (int k = 0; k < NDEC; k++) {
        for (int i = 0; i < 3; i++) {
            id[i] = argmax(lg[i], V);
            st[i] = (k3_step_seq){s[i], &id[i], 1, K3_LOGITS_LAST, lg[i]};
        }
        if (k > 0)   /* the first decode step warms the thread pool */
            k3t_alloc_arm();
        int rc = k3_engine_step(en, st, 3, &e);
        if (k > 0)
            n += k3t_alloc_disarm();
        CHECK_EQ_INT(rc, 0);
    }
    for (int i = 0; i < 3; i++)
        free(lg[i]);
    k3_engine_close(en);
    return n;
}

K3_TEST(engine_decode_step_allocates_nothing)
{
    /* the guard itself counts */
    k3t_alloc_arm();
    void *volatile p = malloc(16);
    uint64_t seen = k3t_alloc_disarm();
    free(p);
    CHECK(seen >= 1);
    /* packed models only: an upstream checkpoint reads (and allocates) each
     * expert the first time a step routes to it (k3_engine.h) */
    CHECK_EQ_U64(decode_allocs(model(1), NULL), 0);
    CHECK_EQ_U64(decode_allocs(model(1), "floor"), 0);
    CHECK_EQ_U64(decode_allocs(model(1), "resident"), 0);
    /* every loop on the threads, then one thread only */
    k3_model_set_parallel_threshold(0);
    CHECK_EQ_U64(decode_allocs(model(1), NULL), 0);
    omp_set_num_threads(1);
    CHECK_EQ_U64(decode_allocs(model(1), "floor"), 0);
}
