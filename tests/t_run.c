/*
 * t_run.c - k3-run on the command line: usage and errors (one line, the
 * documented exit status), the tokenizer-only modes, text in and out, --json,
 * logits files, sampling reproducibility, thread-count invariance, and the
 * packed-model path giving the same numbers as the upstream checkpoint.
 */
#include <stdlib.h>
#include <string.h>

#include "k3_test.h"

static const char *tiny(void)
{
    static char dir[4096];
    snprintf(dir, sizeof dir, "%s/tiny", k3t_tmpdir());
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-synth %s --preset tiny --quiet", dir), 0);
    return dir;
}

static int count_lines(const char *s)
{
    int n = 0;
    for (; s && *s; s++)
        n += *s == '\n';
    return n;
}

static int files_equal(const char *a, const char *b)
{
    return k3t_runf(NULL, NULL, "cmp -s %s %s", a, b) == 0;
}

K3_TEST(run_help_and_version)
{
    char *out = NULL;
    CHECK_EQ_INT(k3t_runf(&out, NULL, "k3-run --help"), 0);
    CHECK_STR_CONTAINS(out, "usage: k3-run MODEL_DIR");
    CHECK_STR_CONTAINS(out, "--logits-all");
    free(out);
    CHECK_EQ_INT(k3t_runf(&out, NULL, "k3-run --version"), 0);
    CHECK_STR_CONTAINS(out, "k3-run ");
    CHECK_STR_CONTAINS(out, "kernels: ");
    CHECK_STR_CONTAINS(out, "crc32: ");
    free(out);
    CHECK_EQ_INT(k3t_runf(&out, NULL, "K3_CRC=zlib k3-run --version"), 0);
    CHECK_STR_CONTAINS(out, "crc32: zlib (K3_CRC)");
    free(out);
}

K3_TEST(run_usage_errors_are_one_line_and_exit_2)
{
    const char *cases[] = {
        "k3-run",
        "k3-run /nonexistent",
        "k3-run /x --ids 1,2,",
        "k3-run /x --ids 1,,2",
        "k3-run /x --ids -1",
        "k3-run /x --ids 99999999999",
        "k3-run /x --gen 12x --ids 1",
        "k3-run /x --chunk 0 --ids 1",
        "k3-run /x --top-p 0 --ids 1",
        "k3-run /x --temperature -1 --ids 1",
        "k3-run /x --threads 0 --ids 1",
        "k3-run /x --bogus",
        "k3-run /x --ids 1 --prompt hi",
        "k3-run /x /y --ids 1",
        "k3-run --tokenize",
        "k3-run --detokenize --tok /x",
        "k3-run /x --gen",
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char *out = NULL, *err = NULL;
        int rc = k3t_runf(&out, &err, "%s", cases[i]);
        if (rc != 2)
            fprintf(stderr, "case: %s -> %d\n", cases[i], rc);
        CHECK_EQ_INT(rc, 2);
        CHECK(strncmp(err, "k3-run: error: ", 15) == 0);
        CHECK_EQ_INT(count_lines(err), 1);
        CHECK_STR_EQ(out, "");
        free(out);
        free(err);
    }
}

K3_TEST(run_reports_missing_model_and_bad_ids)
{
    char *err = NULL;
    CHECK_EQ_INT(k3t_runf(NULL, &err, "k3-run %s/none --ids 1,2", k3t_tmpdir()), 4);
    CHECK_STR_CONTAINS(err, "k3-run: error: ");
    free(err);
    const char *ck = tiny();
    /* a packed model whose manifest is missing is incomplete, not "some directory" */
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-convert %s %s/pk && rm %s/pk/manifest.json", ck, k3t_tmpdir(), k3t_tmpdir()), 0);
    CHECK_EQ_INT(k3t_runf(NULL, &err, "k3-run %s/pk --ids 1,2", k3t_tmpdir()), 4);
    CHECK_STR_CONTAINS(err, "no manifest.json");
    CHECK_EQ_INT(count_lines(err), 1);
    free(err);
    CHECK_EQ_INT(k3t_runf(NULL, &err, "k3-run %s/config.json --ids 1,2", ck), 2);
    free(err);
    CHECK_EQ_INT(k3t_runf(NULL, &err, "k3-run %s --ids 1,592", ck), 2);
    CHECK_STR_CONTAINS(err, "out of range");
    free(err);
    /* a config that does not match the tensors */
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "sed -i 's/\"hidden_size\":\\t64/\"hidden_size\":\\t96/' %s/config.json", ck), 0);
    CHECK_EQ_INT(k3t_runf(NULL, &err, "k3-run %s --ids 1,2", ck), 3);
    CHECK_STR_CONTAINS(err, "expected");
    CHECK_EQ_INT(count_lines(err), 1);
    free(err);
}

K3_TEST(run_tokenize_and_detokenize_need_only_the_tokenizer)
{
    const char *ck = tiny(), *tmp = k3t_tmpdir();
    char *ids = NULL, *text = NULL;
    /* a directory with only the tokenizer files */
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "mkdir %s/tok && cp %s/tiktoken.model %s/tokenizer_config.json %s/tok/", tmp, ck,
                          ck, tmp), 0);
    CHECK_EQ_INT(k3t_runf(&ids, NULL, "k3-run --tokenize --prompt 'Hello world, again.' --tok %s/tok", tmp), 0);
    CHECK(strlen(ids) > 2);
    ids[strcspn(ids, "\n")] = 0;
    CHECK_EQ_INT(k3t_runf(&text, NULL, "k3-run --detokenize --ids %s --tok %s/tok", ids, tmp), 0);
    CHECK_STR_EQ(text, "Hello world, again.");
    free(text);
    /* --prompt-file is the same bytes */
    char *ids2 = NULL;
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "printf 'Hello world, again.' > %s/p.txt", tmp), 0);
    CHECK_EQ_INT(k3t_runf(&ids2, NULL, "k3-run %s --tokenize --prompt-file %s/p.txt", ck, tmp), 0);
    ids2[strcspn(ids2, "\n")] = 0;
    CHECK_STR_EQ(ids, ids2);
    free(ids);
    free(ids2);
}

K3_TEST(run_text_in_text_out_and_json_agree)
{
    const char *ck = tiny(), *tmp = k3t_tmpdir();
    char *streamed = NULL, *json = NULL;
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-run %s --prompt 'Once upon a time' --gen 12 > %s/out.txt", ck, tmp), 0);
    CHECK_EQ_INT(k3t_runf(&json, NULL, "k3-run %s --prompt 'Once upon a time' --gen 12 --json", ck), 0);
    CHECK_EQ_INT(count_lines(json), 1);
    CHECK_STR_CONTAINS(json, "\"prompt_ids\":[");
    CHECK_STR_CONTAINS(json, "\"generated_ids\":[");
    CHECK_STR_CONTAINS(json, "\"text\":");
    CHECK_STR_CONTAINS(json, "\"timings\":{");
    /* the streamed bytes are the detokenized generated ids */
    char *g = strstr(json, "\"generated_ids\":[") + 17;
    char *end = strchr(g, ']');
    *end = 0;
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-run --detokenize --ids %s --tok %s > %s/dec.txt", g, ck, tmp), 0);
    char a[4200], b[4200];
    snprintf(a, sizeof a, "%s/out.txt", tmp);
    snprintf(b, sizeof b, "%s/dec.txt", tmp);
    CHECK(files_equal(a, b));
    free(streamed);
    free(json);
}

K3_TEST(run_ids_without_tokenizer_print_ids)
{
    const char *ck = tiny();
    char *out = NULL;
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "rm %s/tiktoken.model %s/tokenizer_config.json", ck, ck), 0);
    CHECK_EQ_INT(k3t_runf(&out, NULL, "k3-run %s --ids 3,4,5 --gen 5", ck), 0);
    int commas = 0;
    for (char *p = out; *p; p++)
        commas += *p == ',';
    CHECK_EQ_INT(commas, 4);
    CHECK_EQ_INT(count_lines(out), 1);
    free(out);
    CHECK_EQ_INT(k3t_runf(&out, NULL, "k3-run %s --ids 3,4,5 --gen 2 --json", ck), 0);
    CHECK_STR_CONTAINS(out, "\"text\":null");
    free(out);
    char *err = NULL;
    CHECK_EQ_INT(k3t_runf(NULL, &err, "k3-run %s --prompt hi", ck), 4);
    CHECK_STR_CONTAINS(err, "tokenizer");
    free(err);
}

K3_TEST(run_logits_file_is_the_first_generated_position)
{
    const char *ck = tiny(), *tmp = k3t_tmpdir();
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-run %s --ids 7,8,9,10 --gen 3 --logits %s/l.bin --logits-all %s/a.bin", ck,
                          tmp, tmp), 0);
    /* [V] floats = the last row of the [T][V] file */
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "test $(stat -c %%s %s/l.bin) -eq %d", tmp, 592 * 4), 0);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "test $(stat -c %%s %s/a.bin) -eq %d", tmp, 4 * 592 * 4), 0);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "tail -c %d %s/a.bin | cmp -s - %s/l.bin", 592 * 4, tmp, tmp), 0);
}

K3_TEST(run_thread_count_changes_no_bit)
{
    const char *ck = tiny(), *tmp = k3t_tmpdir();
    for (int t = 1; t <= 3; t++)
        CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-run %s --ids 1,2,3,4,5,6,7,8,9 --gen 4 --threads %d --chunk 4 "
                              "--logits-all %s/t%d.bin", ck, t, tmp, t), 0);
    char a[4200], b[4200];
    snprintf(a, sizeof a, "%s/t1.bin", tmp);
    for (int t = 2; t <= 3; t++) {
        snprintf(b, sizeof b, "%s/t%d.bin", tmp, t);
        CHECK(files_equal(a, b));
    }
}

static char *gen_of(const char *cmd_fmt, const char *ck, const char *extra)
{
    char *out = NULL;
    CHECK_EQ_INT(k3t_runf(&out, NULL, cmd_fmt, ck, extra), 0);
    char *g = strstr(out, "\"generated_ids\":[");
    CHECK(g != NULL);
    g += 17;
    *strchr(g, ']') = 0;
    char *r = strdup(g);
    free(out);
    return r;
}

K3_TEST(run_sampling_is_reproducible_from_the_seed)
{
    const char *ck = tiny();
    const char *fmt = "k3-run %s --ids 11,12,13 --gen 16 --json %s";
    char *a = gen_of(fmt, ck, "--temperature 1.5 --seed 42");
    char *b = gen_of(fmt, ck, "--temperature 1.5 --seed 42 --threads 1 --chunk 1");
    char *c = gen_of(fmt, ck, "--temperature 1.5 --seed 43");
    CHECK_STR_EQ(a, b);
    CHECK(strcmp(a, c) != 0);
    /* top-k 1 and a tiny top-p are greedy whatever the temperature and seed */
    char *g = gen_of(fmt, ck, "");
    char *k1 = gen_of(fmt, ck, "--temperature 3 --top-k 1 --seed 5");
    char *p0 = gen_of(fmt, ck, "--temperature 3 --top-p 0.000001 --seed 6");
    CHECK_STR_EQ(g, k1);
    CHECK_STR_EQ(g, p0);
    free(a); free(b); free(c); free(g); free(k1); free(p0);
}

/* The product path: k3-convert's packed model gives the very same logits as
 * the upstream checkpoint it came from (experts as MXFP4, and as BF16 that
 * both sides quantize by the same rule), and finds its tokenizer. */
K3_TEST_TIMEOUT(run_packed_model_matches_the_upstream_checkpoint_bit_for_bit, 300)
{
    const char *tmp = k3t_tmpdir();
    static const char *forms[2] = {"mxfp4", "bf16"};
    for (int f = 0; f < 2; f++) {
        char *err = NULL;
        CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-synth %s/up%d --preset tiny --experts %s --quiet", tmp, f, forms[f]), 0);
        int rc = k3t_runf(NULL, &err, "k3-convert %s/up%d %s/pk%d", tmp, f, tmp, f);
        if (rc)
            fprintf(stderr, "%s", err ? err : "");
        CHECK_EQ_INT(rc, 0);
        free(err);
        CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-run %s/up%d --ids 4,8,15,16,23,42,99 --gen 0 --logits-all %s/a%d.bin",
                              tmp, f, tmp, f), 0);
        CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-run %s/pk%d --ids 4,8,15,16,23,42,99 --gen 0 --logits-all %s/b%d.bin",
                              tmp, f, tmp, f), 0);
        char a[4200], b[4200];
        snprintf(a, sizeof a, "%s/a%d.bin", tmp, f);
        snprintf(b, sizeof b, "%s/b%d.bin", tmp, f);
        CHECK(files_equal(a, b));
    }
    char *x = NULL, *y = NULL;
    CHECK_EQ_INT(k3t_runf(&x, NULL, "k3-run %s/up0 --prompt 'The packed path' --gen 6 --json", tmp), 0);
    CHECK_EQ_INT(k3t_runf(&y, NULL, "k3-run %s/pk0 --prompt 'The packed path' --gen 6 --json", tmp), 0);
    char *gx = strstr(x, "\"timings\""), *gy = strstr(y, "\"timings\"");
    CHECK(gx && gy);
    *gx = *gy = 0;
    CHECK_STR_EQ(x, y);
    free(x);
    free(y);
}

K3_TEST(run_refuses_corrupted_or_unreadable_packed_data)
{
    const char *tmp = k3t_tmpdir();
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-synth %s/up --preset tiny --quiet && k3-convert %s/up %s/pk", tmp, tmp, tmp), 0);
    /* a bit flipped in layer 0's trunk unit as it is read: the unit CRC catches it */
    char *out = NULL, *err = NULL;
    char unit0[8192];
    snprintf(unit0, sizeof unit0, "$(/usr/bin/python3 -c \"import json,sys; u=[x for x in json.load(open(sys.argv[1]))"
                        "['trunk']['units'] if x['layer']==0][0]; print(u['file'], u['offset'])\" %s/pk/manifest.json)", tmp);
    int rc = k3t_runf(&out, &err, "set -- %s; f=$(printf 'trunk-%%04d.k3t' $1); "
                      "K3_FAULT=flip:$f:$(($2+100)) k3-run %s/pk --ids 1,2,3,4,5,6,7,8 --gen 2", unit0, tmp);
    CHECK_EQ_INT(rc, 5);
    CHECK_STR_CONTAINS(err, "k3-run: error: ");
    CHECK_EQ_INT(count_lines(err), 1);
    CHECK_STR_EQ(out, "");
    free(out);
    free(err);
    /* an I/O error while reading */
    rc = k3t_runf(NULL, &err, "set -- %s; f=$(printf 'trunk-%%04d.k3t' $1); "
                  "K3_FAULT=eio:$f:$2 k3-run %s/pk --ids 1,2,3 --gen 2", unit0, tmp);
    CHECK_EQ_INT(rc, 4);
    CHECK_EQ_INT(count_lines(err), 1);
    free(err);
}

K3_TEST(run_json_is_valid_utf8_json_whatever_the_bytes)
{
    const char *ck = tiny(), *tmp = k3t_tmpdir();
    /* random weights produce stray bytes (partial UTF-8, controls) */
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-run %s --prompt 'x' --gen 48 --temperature 2 --seed 3 --json > %s/o.json", ck,
                          tmp), 0);
    char *out = NULL;
    int rc = k3t_runf(&out, NULL, "/usr/bin/python3 -c \"import json,sys; d=json.loads(open(sys.argv[1],'rb')"
                      ".read().decode('utf-8')); print(len(d['generated_ids']), type(d['text']).__name__, "
                      "sorted(d['timings']))\" %s/o.json", tmp);
    CHECK_EQ_INT(rc, 0);
    CHECK_STR_CONTAINS(out, "48 str ['decode_s', 'decode_tokens_per_s', 'load_s', 'prompt_s', 'prompt_tokens_per_s']");
    free(out);
}

/* The kernels promise the same bits on every exact ISA path; the whole model
 * must then too (avx512bf16 rounds activations and is excluded: opt-in). */
K3_TEST(run_exact_isa_paths_give_the_same_logits)
{
    const char *ck = tiny(), *tmp = k3t_tmpdir();
    static const char *isa[3] = {"scalar", "avx2", "avx512"};
    for (int i = 0; i < 3; i++)
        CHECK_EQ_INT(k3t_runf(NULL, NULL, "K3_ISA=%s k3-run %s --ids 1,2,3,4,5,6,7 --gen 0 --logits-all %s/%s.bin",
                              isa[i], ck, tmp, isa[i]), 0);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "cmp -s %s/scalar.bin %s/avx2.bin && cmp -s %s/scalar.bin %s/avx512.bin", tmp,
                          tmp, tmp, tmp), 0);
}
