/*
 * t_edges.c - edge cases a careless or hostile user reaches: temperatures
 * from 1e-40 to 1e6, a plan larger than the machine's memory, paths that
 * are not UTF-8 in every JSON output and manifest, the prompt from stdin.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "k3_gen.h"
#include "k3_json.h"
#include "k3_test.h"

static uint32_t argmax(const float *z, uint32_t n)
{
    uint32_t b = 0;
    for (uint32_t i = 1; i < n; i++)
        if (z[i] > z[b])
            b = i;
    return b;
}

/* Temperatures small enough that logit / T overflows float are greedy
 * (the limit of the distribution), never the lowest-ranked ids; larger
 * ones sample valid ids reproducibly, and 1e6 spreads over the vocabulary. */
K3_TEST(sampler_sweep_from_1e_40_to_1e6_is_greedy_when_tiny_and_valid_everywhere)
{
    static const float pos[8] = {1.5f, -2.0f, 3.25f, 3.0f, -100.0f, 0.0f, 2.0f, 3.24f};
    static const float neg[8] = {-50.0f, -30.0f, -40.0f, -31.0f, -1e30f, -45.0f, -99.0f, -60.0f};
    static const float big[8] = {1e30f, -1e30f, 3e38f, 2e38f, 0.0f, -3e38f, 1.0f, 2.9e38f};
    const float *sets[3] = {pos, neg, big};
    const double temps[] = {1e-40, 1e-39, 1e-38, 1e-37, 1e-36, 1e-30, 1e-20, 1e-10, 1e-5,
                            1e-3, 0.1, 1.0, 10.0, 1e3, 1e6};
    const int ntemps = (int)(sizeof temps / sizeof temps[0]);
    const uint32_t tks[3] = {0, 1, 3};
    const float tps[2] = {1.0f, 0.5f};
    for (int si = 0; si < 3; si++) {
        const uint32_t g = argmax(sets[si], 8);
        for (int ti = 0; ti < ntemps; ti++) {
            for (int k = 0; k < 3; k++)
                for (int pi = 0; pi < 2; pi++) {
                    uint32_t seen = 0;
                    for (uint64_t seed = 0; seed < 40; seed++) {
                        k3_sampler *a = NULL, *b = NULL;
                        k3_err e = {0};
                        CHECK_EQ_INT(k3_sampler_create(&a, 8, (float)temps[ti], tks[k], tps[pi], seed, &e), 0);
                        CHECK_EQ_INT(k3_sampler_create(&b, 8, (float)temps[ti], tks[k], tps[pi], seed, &e), 0);
                        uint32_t x = k3_sampler_next(a, sets[si]);
                        uint32_t y = k3_sampler_next(b, sets[si]);
                        k3_sampler_free(a);
                        k3_sampler_free(b);
                        CHECK(x < 8);
                        CHECK_EQ_INT(x, y);
                        seen |= 1u << x;
                        /* where the scaled gap to the runner-up is > 1e3 nats, only
                         * the argmax can come out (for the vectors above, T <= 1e-5) */
                        if (temps[ti] <= 1e-5 && x != g)
                            k3t_fail(__FILE__, __LINE__, "set %d T=%g top-k %u top-p %g seed %llu: id %u, want the "
                                     "argmax %u", si, temps[ti], tks[k], tps[pi], (unsigned long long)seed, x, g);
                    }
                    if (temps[ti] >= 1e6 && tks[k] == 0 && tps[pi] == 1.0f && si == 0 && __builtin_popcount(seen) < 4)
                        k3t_fail(__FILE__, __LINE__, "T=1e6 drew only ids %#x in 40 seeds", seen);
                }
        }
    }
}

K3_TEST(sampler_cli_temperature_1e_40_gives_the_greedy_tokens)
{
    char dir[4096], *g = NULL, *t = NULL;
    snprintf(dir, sizeof dir, "%s/tiny", k3t_tmpdir());
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-synth %s --preset tiny --quiet --no-tokenizer", dir), 0);
    CHECK_EQ_INT(k3t_runf(&g, NULL, "k3-run %s --ids 11,12,13 --gen 12", dir), 0);
    CHECK_EQ_INT(k3t_runf(&t, NULL, "k3-run %s --ids 11,12,13 --gen 12 --temperature 1e-40 --seed 3", dir), 0);
    CHECK_STR_EQ(t, g);
    free(t);
    CHECK_EQ_INT(k3t_runf(&t, NULL, "k3-run %s --ids 11,12,13 --gen 12 --temperature 1e6 --seed 3", dir), 0);
    CHECK(strlen(t) > 12);
    free(t);
    free(g);
}

static int count_lines(const char *s)
{
    int n = 0;
    for (; s && *s; s++)
        n += *s == '\n';
    return n;
}

/* A plan larger than the memory available is refused with exit 6 before
 * anything big is mapped, naming both numbers. */
K3_TEST(run_refuses_a_plan_over_the_available_memory_with_exit_6)
{
    char up[4096], pk[4096], *out = NULL, *err = NULL;
    snprintf(up, sizeof up, "%s/up", k3t_tmpdir());
    snprintf(pk, sizeof pk, "%s/pk", k3t_tmpdir());
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-synth %s --preset tiny --quiet", up), 0);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-convert --quiet %s %s", up, pk), 0);
    /* the floor over the memory */
    CHECK_EQ_INT(k3t_runf(&out, &err, "K3_MEM_AVAILABLE=1000000 k3-run %s --ids 1 --gen 1 --ram floor", pk), 6);
    CHECK_STR_CONTAINS(err, "k3-run: error: the floor of this model is ");
    CHECK_STR_CONTAINS(err, "more than the memory available: 1000000 bytes");
    CHECK_STR_CONTAINS(err, "K3_MEM_AVAILABLE");
    CHECK_EQ_INT(count_lines(err), 1);
    CHECK_STR_EQ(out, "");
    free(out);
    free(err);
    /* a budget over the memory, the floor under it; --plan too */
    const char *plan[2] = {"", "--plan"};
    for (int i = 0; i < 2; i++) {
        CHECK_EQ_INT(k3t_runf(&out, &err, "K3_MEM_AVAILABLE=200000000 k3-run %s --ids 1 --gen 1 --ram 1G %s", pk,
                              plan[i]), 6);
        CHECK_STR_CONTAINS(err, "k3-run: error: RAM budget 1073741824 bytes (1.00 GiB) is more than the memory "
                                "available: 200000000 bytes");
        CHECK_EQ_INT(count_lines(err), 1);
        free(out);
        free(err);
    }
    /* enough memory: runs */
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "K3_MEM_AVAILABLE=2000000000 k3-run %s --ids 1 --gen 1 --ram 1G", pk), 0);
    /* the machine's own numbers: a budget of 1 PiB is over any machine's */
    CHECK_EQ_INT(k3t_runf(NULL, &err, "k3-run %s --ids 1 --gen 1 --ram 1024T", pk), 6);
    CHECK_STR_CONTAINS(err, "more than the memory available");
    free(err);
    /* resident (no --ram): weights over the memory are refused before the
       load, upstream and packed, by k3-run and k3-serve, naming the way out */
    const char *dirs[2] = {up, pk};
    for (int i = 0; i < 2; i++) {
        CHECK_EQ_INT(k3t_runf(&out, &err, "K3_MEM_AVAILABLE=100000 k3-run %s --ids 1 --gen 1", dirs[i]), 6);
        CHECK_STR_CONTAINS(err, "k3-run: error: ");
        CHECK_STR_CONTAINS(err, dirs[i]);
        CHECK_STR_CONTAINS(err, "held resident without --ram, more than the memory available: 100000 bytes");
        CHECK_STR_CONTAINS(err, "--ram floor");
        CHECK(!i == (strstr(err, "after k3-convert") != NULL));
        CHECK_EQ_INT(count_lines(err), 1);
        free(out);
        free(err);
        CHECK_EQ_INT(k3t_runf(NULL, &err, "K3_MEM_AVAILABLE=100000 k3-serve %s --port 0", dirs[i]), 6);
        CHECK_STR_CONTAINS(err, "held resident without --ram");
        CHECK_EQ_INT(count_lines(err), 1);
        free(err);
    }
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "K3_MEM_AVAILABLE=2000000000 k3-run %s --ids 1 --gen 1", up), 0);
}

/* 1 if the text is one valid JSON value and valid UTF-8 throughout. */
static int valid_json(const char *s)
{
    if (!s || !k3_utf8_valid(s, strlen(s)))
        return 0;
    cJSON *j = cJSON_Parse(s);
    cJSON_Delete(j);
    return j != NULL;
}

/* Paths that are not UTF-8 (and paths with quotes and backslashes) give
 * valid UTF-8 JSON in every --json and in the manifests. */
K3_TEST(json_outputs_and_manifests_are_valid_utf8_whatever_the_paths)
{
    const char *t = k3t_tmpdir();
    /* \xff\xfe is never UTF-8; a quote and a backslash need escapes */
    char up[4096], pk[4096], rp[4096];
    snprintf(up, sizeof up, "%s/u\xff\xfe\"q\\b", t);
    snprintf(pk, sizeof pk, "%s/p\xc3\x28\xe2\x82", t);
    snprintf(rp, sizeof rp, "%s/r\x80\x81", t);
    char *out = NULL;
    CHECK_EQ_INT(k3t_runf(&out, NULL, "k3-synth '%s' --preset tiny --quiet --json", up), 0);
    CHECK(valid_json(out));
    free(out);
    CHECK_EQ_INT(k3t_runf(&out, NULL, "k3-convert --quiet --json '%s' '%s'", up, pk), 0);
    CHECK(valid_json(out));
    free(out);
    CHECK_EQ_INT(k3t_runf(&out, NULL, "k3-pack --quiet --json '%s' '%s' --ram floor", pk, rp), 0);
    CHECK(valid_json(out));
    free(out);
    CHECK_EQ_INT(k3t_runf(&out, NULL, "k3-pack --json '%s' --plan --ram floor 2>/dev/null", pk), 0);
    CHECK(valid_json(out));
    free(out);
    CHECK_EQ_INT(k3t_runf(&out, NULL, "k3-verify --json '%s'", rp), 0);
    CHECK(valid_json(out));
    free(out);
    CHECK_EQ_INT(k3t_runf(&out, NULL, "k3-verify --info --json '%s'", rp), 0);
    CHECK(valid_json(out));
    free(out);
    const char *dirs[2] = {pk, rp};
    for (int i = 0; i < 2; i++) {
        char mp[4200];
        snprintf(mp, sizeof mp, "cat '%s/manifest.json'", dirs[i]);
        CHECK_EQ_INT(k3t_runf(&out, NULL, "%s", mp), 0);
        CHECK(valid_json(out));
        free(out);
    }
    /* the packed layout records its source directory: recognisable, U+FFFD for the bad bytes */
    CHECK_EQ_INT(k3t_runf(&out, NULL, "cat '%s/manifest.json'", rp), 0);
    CHECK_STR_CONTAINS(out, "/p\xef\xbf\xbd(\xef\xbf\xbd");
    free(out);
}

K3_TEST(run_prompt_file_dash_reads_stdin)
{
    char dir[4096], *a = NULL, *b = NULL;
    snprintf(dir, sizeof dir, "%s/tiny", k3t_tmpdir());
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-synth %s --preset tiny --quiet", dir), 0);
    CHECK_EQ_INT(k3t_runf(&a, NULL, "k3-run %s --prompt 'hello world' --gen 4 --json", dir), 0);
    CHECK_EQ_INT(k3t_runf(&b, NULL, "printf 'hello world' | k3-run %s --prompt-file - --gen 4 --json", dir), 0);
    /* the same ids and text (timings differ) */
    CHECK(strstr(a, "\"timings\"") && strstr(b, "\"timings\""));
    *strstr(a, "\"timings\"") = 0;
    *strstr(b, "\"timings\"") = 0;
    CHECK_STR_EQ(b, a);
    free(a);
    free(b);
    CHECK_EQ_INT(k3t_runf(&a, NULL, "printf 'hello world' | k3-run --tokenize --prompt-file - --tok %s", dir), 0);
    CHECK_EQ_INT(k3t_runf(&b, NULL, "k3-run --tokenize --prompt 'hello world' --tok %s", dir), 0);
    CHECK_STR_EQ(a, b);
    free(a);
    free(b);
}

/* Flip one byte in the middle of the file's [lo, hi) range. */
static void flip_at(const char *path, long off)
{
    FILE *f = fopen(path, "r+b");
    CHECK(f != NULL);
    CHECK_EQ_INT(fseek(f, off, SEEK_SET), 0);
    int c = fgetc(f);
    CHECK(c != EOF);
    CHECK_EQ_INT(fseek(f, off, SEEK_SET), 0);
    fputc(c ^ 0x40, f);
    fclose(f);
}

/* --quick catches a flipped byte in every kind of file of a packed model:
 * small files are hashed whole; with the whole-file limit at 0 (every file
 * "large") and a sample as large as the model, the tokenizer is still
 * hashed and the sampled units, records and embedding rows are CRC-checked
 * (the default sample of 32 is first, last and evenly between). */
K3_TEST_TIMEOUT(verify_quick_catches_a_flipped_byte_in_every_file_kind, 240)
{
    char up[4096], pk[4096], *out = NULL;
    snprintf(up, sizeof up, "%s/up", k3t_tmpdir());
    snprintf(pk, sizeof pk, "%s/pk", k3t_tmpdir());
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-synth %s --preset tiny --quiet", up), 0);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-convert --quiet %s %s", up, pk), 0);
    CHECK_EQ_INT(k3t_runf(&out, NULL, "cd %s && ls | grep -v manifest.json", pk), 0);
    int nfiles = 0;
    for (char *save = NULL, *name = strtok_r(out, "\n", &save); name; name = strtok_r(NULL, "\n", &save)) {
        char cp[4200], path[4300];
        snprintf(cp, sizeof cp, "%s/c%d", k3t_tmpdir(), nfiles++);
        CHECK_EQ_INT(k3t_runf(NULL, NULL, "cp -a %s %s", pk, cp), 0);
        snprintf(path, sizeof path, "%s/%s", cp, name);
        flip_at(path, 1);   /* inside the first unit, record or row of every kind */
        char *r = NULL;
        int rc = k3t_runf(&r, NULL, "k3-verify --quick %s", cp);
        if (rc != 1 || !strstr(r, name))
            k3t_fail(__FILE__, __LINE__, "--quick missed a flipped byte in %s: exit %d\n%s", name, rc, r);
        free(r);
        rc = k3t_runf(&r, NULL, "K3_QUICK_HASH_MAX=0 k3-verify --quick --sample 1000000 %s", cp);
        if (rc != 1 || !strstr(r, name))
            k3t_fail(__FILE__, __LINE__, "sampled --quick missed a flipped byte in %s: exit %d\n%s", name, rc, r);
        free(r);
        CHECK_EQ_INT(k3t_runf(NULL, NULL, "rm -rf %s", cp), 0);
    }
    CHECK(nfiles >= 6);
    free(out);
}

K3_TEST(verify_json_and_info_describe_the_directory)
{
    char up[4096], pk[4096], rp[4096], *out = NULL;
    snprintf(up, sizeof up, "%s/up", k3t_tmpdir());
    snprintf(pk, sizeof pk, "%s/pk", k3t_tmpdir());
    snprintf(rp, sizeof rp, "%s/rp", k3t_tmpdir());
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-synth %s --preset tiny --quiet", up), 0);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-convert --quiet %s %s", up, pk), 0);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-pack --quiet %s %s --ram double", pk, rp), 0);
    /* progress: none when stderr is not a terminal, unless asked */
    char *err = NULL;
    CHECK_EQ_INT(k3t_runf(NULL, &err, "k3-verify %s", rp), 0);
    CHECK_STR_EQ(err, "");
    free(err);
    CHECK_EQ_INT(k3t_runf(&out, NULL, "k3-verify --json %s", pk), 0);
    CHECK(valid_json(out));
    CHECK_STR_CONTAINS(out, "\"ok\":true");
    CHECK_STR_CONTAINS(out, "\"problems\":[]");
    free(out);
    CHECK_EQ_INT(k3t_runf(&out, NULL, "k3-verify --info %s", rp), 0);
    CHECK_STR_CONTAINS(out, "packed model (made by k3-pack");
    free(out);
    char tk[4200];
    snprintf(tk, sizeof tk, "%s/tiktoken.model", pk);   /* hard-linked into rp too */
    flip_at(tk, 10);
    CHECK_EQ_INT(k3t_runf(&out, NULL, "k3-verify --json %s", pk), 1);
    CHECK(valid_json(out));
    CHECK_STR_CONTAINS(out, "\"ok\":false");
    CHECK_STR_CONTAINS(out, "tiktoken.model\",\"problem\":\"SHA-256 mismatch");
    free(out);
    CHECK_EQ_INT(k3t_runf(&out, NULL, "k3-verify --info %s", rp), 0);
    CHECK_STR_CONTAINS(out, "packed model (made by k3-pack");
    CHECK_STR_CONTAINS(out, "layout: k3-pack for a RAM budget of ");
    CHECK_STR_CONTAINS(out, "trunk tensors stored as: ");
    CHECK_STR_CONTAINS(out, "provenance: 5 upstream shards");
    free(out);
    CHECK_EQ_INT(k3t_runf(&out, NULL, "k3-verify --info --json %s", rp), 0);
    CHECK(valid_json(out));
    CHECK_STR_CONTAINS(out, "\"streams\":true");
    free(out);
    CHECK_EQ_INT(k3t_runf(&out, NULL, "k3-verify --info %s", up), 0);
    CHECK_STR_CONTAINS(out, "upstream checkpoint");
    CHECK_STR_CONTAINS(out, "shards: 5 safetensors files");
    free(out);
}
