/*
 * t_state.c - k3-run --state-save / --state-load: a prompt saved and
 * continued gives the logits and tokens of the uninterrupted run bit for bit
 * (resident, and streamed at --ram floor), only the ids after the saved ones
 * are computed, and a state of another model or a truncated or corrupt state
 * file is refused with one line and its exit status.
 */
#include <stdlib.h>
#include <string.h>

#include "k3_test.h"

static const char *synth(const char *name, int seed)
{
    static char dir[2][4096];
    char *d = dir[seed & 1];
    snprintf(d, 4096, "%s/%s", k3t_tmpdir(), name);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-synth %s --preset tiny --seed %d --quiet", d, seed), 0);
    return d;
}

static int count_lines(const char *s)
{
    int n = 0;
    for (; s && *s; s++)
        n += *s == '\n';
    return n;
}

/* The generated ids of a --json line (heap copy of the list). */
static char *gen_ids(const char *json)
{
    const char *g = json ? strstr(json, "\"generated_ids\":[") : NULL;
    if (!g)
        return strdup("?");
    g += 17;
    size_t n = strcspn(g, "]");
    char *r = malloc(n + 1);
    memcpy(r, g, n);
    r[n] = 0;
    return r;
}

static long json_num(const char *s, const char *key)
{
    char pat[64];
    snprintf(pat, sizeof pat, "\"%s\":", key);
    const char *p = s ? strstr(s, pat) : NULL;
    return p ? strtol(p + strlen(pat), NULL, 10) : -1;
}

#define PREFIX "5,17,300,42,7,99,123,256,1,2,3,4"
#define FULL PREFIX ",77,78,79,500,501,8,9"

/* save after PREFIX, continue with FULL (and with PREFIX itself): the same
 * logits and tokens as one uninterrupted run */
static void continue_matches(const char *model, const char *ram)
{
    const char *tmp = k3t_tmpdir();
    char *ref = NULL, *got = NULL, *err = NULL;
    CHECK_EQ_INT(k3t_runf(&ref, NULL, "k3-run %s %s --ids " FULL " --gen 6 --json --logits %s/ref.bin", model, ram,
                          tmp), 0);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "rm -f %s/S", tmp), 0);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-run %s %s --ids " PREFIX " --gen 0 --state-save %s/S", model, ram, tmp),
                 0);
    CHECK_EQ_INT(k3t_runf(&got, &err, "k3-run %s %s --ids " FULL " --gen 6 --json --logits %s/got.bin --state-load %s/S",
                          model, ram, tmp, tmp), 0);
    char *a = gen_ids(ref), *b = gen_ids(got);
    CHECK_STR_EQ(b, a);
    free(a);
    free(b);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "cmp %s/ref.bin %s/got.bin", tmp, tmp), 0);
    CHECK_EQ_INT(json_num(got, "reused_tokens"), 11);    /* PREFIX less its last id */
    CHECK_EQ_INT(json_num(got, "computed_tokens"), 8);   /* the rest of FULL */
    free(ref);
    free(got);
    free(err);
    /* the same prompt again: only its last id is computed */
    CHECK_EQ_INT(k3t_runf(&ref, NULL, "k3-run %s %s --ids " PREFIX " --gen 6 --json --logits %s/ref.bin", model, ram,
                          tmp), 0);
    CHECK_EQ_INT(k3t_runf(&got, NULL, "k3-run %s %s --ids " PREFIX " --gen 6 --json --logits %s/got.bin --state-load "
                                      "%s/S", model, ram, tmp, tmp), 0);
    a = gen_ids(ref);
    b = gen_ids(got);
    CHECK_STR_EQ(b, a);
    free(a);
    free(b);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "cmp %s/ref.bin %s/got.bin", tmp, tmp), 0);
    CHECK_EQ_INT(json_num(got, "computed_tokens"), 1);
    free(ref);
    free(got);
}

K3_TEST(state_save_load_continue_is_bit_identical_resident)
{
    continue_matches(synth("tiny", 1), "");
}

K3_TEST(state_save_load_continue_is_bit_identical_at_the_floor)
{
    const char *ck = synth("tiny", 1), *tmp = k3t_tmpdir();
    char pk[4200];
    snprintf(pk, sizeof pk, "%s/pk", tmp);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-convert %s %s", ck, pk), 0);
    continue_matches(pk, "--ram floor");
    /* a state saved at the floor continues resident with the same bits */
    char *ref = NULL, *got = NULL;
    CHECK_EQ_INT(k3t_runf(&ref, NULL, "k3-run %s --ram floor --ids " FULL " --gen 6 --json --logits %s/ref.bin", pk,
                          tmp), 0);
    CHECK_EQ_INT(k3t_runf(&got, NULL, "k3-run %s --ram resident --ids " FULL " --gen 6 --json --logits %s/got.bin "
                                      "--state-load %s/S", pk, tmp, tmp), 0);
    char *a = gen_ids(ref), *b = gen_ids(got);
    CHECK_STR_EQ(b, a);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "cmp %s/ref.bin %s/got.bin", tmp, tmp), 0);
    free(a);
    free(b);
    free(ref);
    free(got);
}

static void refused(const char *model, const char *state, int code, const char *msg)
{
    char *out = NULL, *err = NULL;
    int rc = k3t_runf(&out, &err, "k3-run %s --ids " FULL " --gen 2 --state-load %s", model, state);
    if (rc != code || !err || !strstr(err, msg))
        fprintf(stderr, "state %s: %d %s\n", state, rc, err ? err : "");
    CHECK_EQ_INT(rc, code);
    CHECK(err && strncmp(err, "k3-run: error: ", 15) == 0);
    CHECK_EQ_INT(count_lines(err), 1);
    CHECK_STR_CONTAINS(err, msg);
    CHECK_STR_CONTAINS(err, state);
    CHECK_STR_EQ(out, "");
    free(out);
    free(err);
}

K3_TEST(state_of_another_model_or_a_damaged_file_is_refused_in_one_line)
{
    const char *a = synth("a", 1), *tmp = k3t_tmpdir();
    char ab[4200];
    snprintf(ab, sizeof ab, "%s", a);
    const char *b = synth("b", 2);
    char S[4200];
    snprintf(S, sizeof S, "%s/S", tmp);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-run %s --ids " PREFIX " --gen 0 --state-save %s", ab, S), 0);
    refused(b, S, 3, "a state of another model");
    /* the size runtime/CHAT.md documents: 136 + 57,600 + 644 per id, 11 ids */
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "test $(stat -c %%s %s) = 64820", S), 0);
    /* cut short anywhere: in the state, in the ids, in the header */
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "cp %s %s.t && truncate -s -100 %s.t", S, S, S), 0);
    char T[4300];
    snprintf(T, sizeof T, "%s.t", S);
    refused(ab, T, 4, "truncated");
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "head -c 80 %s > %s.h", S, S), 0);
    snprintf(T, sizeof T, "%s.h", S);
    refused(ab, T, 4, "truncated");
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "head -c 30 %s > %s.s", S, S), 0);
    snprintf(T, sizeof T, "%s.s", S);
    refused(ab, T, 4, "truncated");
    /* one byte changed: in the state payload, in the ids, in the header */
    static const struct { const char *name; long at; int code; const char *msg; } flips[] = {
        {"f1", -50, 5, "sequence state fails its CRC-32"},
        {"f2", 73, 5, "token ids fail their CRC-32"},
        {"f3", 50, 5, "header fails its CRC-32"},
        {"f4", 2, 3, "not a k3 state file"},
    };
    for (size_t i = 0; i < sizeof flips / sizeof flips[0]; i++) {
        snprintf(T, sizeof T, "%s.%s", S, flips[i].name);
        CHECK_EQ_INT(k3t_runf(NULL, NULL,
                              "cp %s %s && sz=$(stat -c %%s %s) && at=%ld && [ $at -lt 0 ] && at=$((sz + at)); "
                              "printf '\\377' | dd of=%s bs=1 seek=$at conv=notrunc status=none",
                              S, T, T, flips[i].at, T), 0);
        refused(ab, T, flips[i].code, flips[i].msg);
    }
    /* bytes after the state */
    snprintf(T, sizeof T, "%s.long", S);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "cp %s %s && printf x >> %s", S, T, T), 0);
    refused(ab, T, 3, "bytes after the state");
    /* not a prefix of the prompt: a warning, and the prompt computed from the start */
    char *out = NULL, *err = NULL;
    CHECK_EQ_INT(k3t_runf(&out, &err, "k3-run %s --ids 9,9,9,9,9,9,9,9,9,9,9,9,9,9 --gen 2 --json --state-load %s", ab,
                          S), 0);
    CHECK_STR_CONTAINS(err, "computed from the start");
    CHECK_EQ_INT(json_num(out, "computed_tokens"), 14);
    free(out);
    free(err);
    /* --state-save does not replace a file unless --force; usage errors */
    CHECK_EQ_INT(k3t_runf(NULL, &err, "k3-run %s --ids " PREFIX " --gen 0 --state-save %s", ab, S), 7);
    CHECK_STR_CONTAINS(err, "exists");
    CHECK_EQ_INT(count_lines(err), 1);
    free(err);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-run %s --ids " PREFIX " --gen 0 --state-save %s --force", ab, S), 0);
    CHECK_EQ_INT(k3t_runf(NULL, &err, "k3-run %s --ids " FULL " --state-load %s --logits-all %s/x", ab, S, tmp), 2);
    CHECK_EQ_INT(count_lines(err), 1);
    free(err);
}
