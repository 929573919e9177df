/*
 * t_faults_run.c - fault injection into k3-run: every budget stops before
 * any token, a fault during generation leaves only good tokens out, a flipped
 * embedding row or tokenizer byte is refused (the cells and what they check:
 * t_faults.c).
 */
#include <cjson/cJSON.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "faults_util.h"
#include "k3_test.h"

/* ------------------------------------------------------------ k3-run */

static void run_cell(const char *cell, const char *dir, const char *ram, const char *fault, const char *file,
                     int want, const char *lg)
{
    char *out = NULL, *err = NULL, lga[4200];
    snprintf(lga, sizeof lga, "%s.all", lg);
    unlink(lg);
    unlink(lga);
    int st = k3t_runf(&out, &err, "K3_FAULT=%s k3-run %s " RUN_IDS " %s --logits %s --logits-all %s", fault, dir, ram,
                      lg, lga);
    if (st != want)
        ft_bad(cell, "status %d, want %d (%s)", st, want, ft_tail(err));
    else
        ft_one_error_line(cell, "k3-run", err, file);
    if (out && *out)
        ft_bad(cell, "tokens on stdout: \"%s\"", out);
    if (ft_exists(lg))
        ft_bad(cell, "the --logits file was created");
    if (ft_exists(lga))
        ft_bad(cell, "the --logits-all file was created");
    free(out);
    free(err);
}

K3_TEST(faults_run_stops_before_any_token_at_every_budget)
{
    ft_fixture f;
    ft_fixture_make(&f, 1);
    char lg[4096];
    ft_join(lg, k3t_tmpdir(), "logits.bin");
    const char *dirs[2] = {f.pk, f.pf};
    static const char *rams[4] = {"", "--ram floor", "--ram double", "--ram resident"};
    for (int d = 0; d < 2; d++) {
        ft_target t[16];
        int n = ft_packed_targets(dirs[d], t, &f);
        for (int r = 0; r < 4; r++)
            for (int i = 0; i < n; i++)
                for (int k = 0; k < 3; k++) {
                    char cell[1024], fault[512];
                    snprintf(fault, sizeof fault, "%s:%s:%llu", ft_kinds[k], t[i].file, (unsigned long long)t[i].off);
                    snprintf(cell, sizeof cell, "k3-run %s %s %s (%s)", d ? "pf" : "pk", rams[r], fault, t[i].what);
                    run_cell(cell, dirs[d], rams[r], fault, t[i].file, ft_want_for(&t[i], k), lg);
                }
    }
    CHECK_EQ_INT(ft_nbad, 0);
}

K3_TEST(faults_run_upstream_read_errors_exit_4_before_any_token)
{
    ft_fixture f;
    ft_fixture_make(&f, 0);
    char lg[4096];
    ft_join(lg, k3t_tmpdir(), "logits.bin");
    ft_target t[16];
    int n = ft_upstream_targets(&f, t);
    for (int i = 0; i < n; i++) {
        if (strstr(t[i].file, "experts"))
            continue;
        for (int k = 0; k < 2; k++) {
            char cell[1024], fault[512];
            snprintf(fault, sizeof fault, "%s:%s:%llu", ft_kinds[k], t[i].file, (unsigned long long)t[i].off);
            snprintf(cell, sizeof cell, "k3-run upstream %s (%s)", fault, t[i].what);
            if (strstr(t[i].what, "expert"))
                continue; /* routed experts are read only when chosen */
            run_cell(cell, f.up, "", fault, t[i].file, 4, lg);
        }
    }
    CHECK_EQ_INT(ft_nbad, 0);
}

/* --resume --rehash re-reads the kept output files: a kept file that reads
 * ft_bad (EIO, short, or other bytes than its journal entry's hash) is not
 * kept - its group is converted again, and the result is still exactly the
 * uninterrupted one. */
K3_TEST(faults_convert_resume_rehash_redoes_a_group_whose_kept_file_reads_bad)
{
    ft_fixture f;
    ft_fixture_make(&f, 0);
    for (int k = 0; k < 3; k++) {
        char cell[128], *out = NULL, *err = NULL;
        snprintf(cell, sizeof cell, "k3-convert --resume --rehash, %s in the kept trunk-0000.k3t", ft_kinds[k]);
        ft_clean(f.out);
        CHECK_EQ_INT(k3t_runf(NULL, NULL, "K3_CONVERT_CRASH=journaled:2 k3-convert --quiet %s %s", f.up, f.out),
                     137);
        int st = k3t_runf(&out, &err, "K3_FAULT=%s:trunk-0000.k3t:1000 k3-convert --quiet --json --resume --rehash %s %s",
                          ft_kinds[k], f.up, f.out);
        if (st != 0)
            ft_bad(cell, "status %d (%s)", st, ft_tail(err));
        else if (!out || !strstr(out, "\"groups_skipped\": 2"))
            ft_bad(cell, "group 0 was kept although its file read bad: %s", out ? out : "");
        free(out);
        free(err);
        out = NULL;
        st = k3t_runf(&out, NULL, "diff -r %s %s", f.out, f.pk);
        if (st != 0)
            ft_bad(cell, "the result differs from an uninterrupted run: %s", out ? out : "");
        free(out);
    }
    CHECK_EQ_INT(ft_nbad, 0);
}

/* An expert first asked for by a decode step (from the trace of a run of
 * RUN_IDS with --gen 6): its record is first read after the first token is
 * out. */
static void decode_expert(const char *pk, uint32_t *l, uint32_t *e)
{
    char tr[4096];
    ft_join(tr, k3t_tmpdir(), "trace6.txt");
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-run %s --ids 5,9,2,7 --gen 6 --threads 1 --ram floor --trace %s", pk, tr), 0);
    FILE *f = fopen(tr, "r");
    CHECK(f != NULL);
    char line[256];
    static uint8_t seen[64][256];
    memset(seen, 0, sizeof seen);
    int found = 0;
    while (!found && fgets(line, sizeof line, f)) {
        unsigned long fw, ll, ee;
        if (line[0] == '#' || sscanf(line, "%lu %lu %lu", &fw, &ll, &ee) != 3 || ll >= 64 || ee >= 256)
            continue;
        if (!seen[ll][ee] && fw >= 2) {
            *l = (uint32_t)ll;
            *e = (uint32_t)ee;
            found = 1;
        }
        seen[ll][ee] = 1;
    }
    fclose(f);
    CHECK(found);
}

/* A fault met during generation (an expert record first read by a decode
 * step) stops the run there with the documented status: what was printed
 * before is a prefix of the ft_clean run's text (those tokens came from good
 * bytes), nothing after; --json prints nothing. */
K3_TEST(faults_run_fault_during_generation_stops_with_only_good_tokens_out)
{
    ft_fixture f;
    ft_fixture_make(&f, 1);
    const char *dirs[2] = {f.pk, f.pf};
    static const char *rams[3] = {"", "--ram floor", "--ram resident"};
    for (int d = 0; d < 2; d++) {
        char *ft_clean = NULL;
        CHECK_EQ_INT(k3t_runf(&ft_clean, NULL, "k3-run %s --ids 5,9,2,7 --gen 6 --threads 1", dirs[d]), 0);
        CHECK(ft_clean != NULL && *ft_clean);
        ft_packed p;
        ft_packed_open(&p, dirs[d]);
        uint32_t l = 0, e = 0;
        decode_expert(dirs[d], &l, &e);
        const char *name;
        uint64_t off = ft_expert_byte(&p, l, e, &name);
        for (int r = 0; r < 3; r++)
            for (int k = 0; k < 3; k++)
                for (int j = 0; j < 2; j++) {
                    char cell[1024], *out = NULL, *err = NULL;
                    snprintf(cell, sizeof cell, "k3-run %s %s%s %s:%s:%llu (layer %u expert %u, first read by a decode step)",
                             d ? "pf" : "pk", rams[r], j ? " --json" : "", ft_kinds[k], name, (unsigned long long)off, l, e);
                    int st = k3t_runf(&out, &err, "K3_FAULT=%s:%s:%llu k3-run %s --ids 5,9,2,7 --gen 6 --threads 1 %s %s",
                                      ft_kinds[k], name, (unsigned long long)off, dirs[d], rams[r], j ? "--json" : "");
                    int want = k < 2 ? 4 : 5;
                    if (st != want)
                        ft_bad(cell, "status %d, want %d (%s)", st, want, ft_tail(err));
                    else
                        ft_one_error_line(cell, "k3-run", err, name);
                    size_t n = out ? strlen(out) : 0;
                    if (j && n)
                        ft_bad(cell, "--json printed \"%s\"", out);
                    if (!j && (n == 0 || n >= strlen(ft_clean) || strncmp(out ? out : "", ft_clean, n)))
                        ft_bad(cell, "stdout \"%s\" is not a non-empty strict prefix of the ft_clean run's \"%s\"", out ? out : "", ft_clean);
                    free(out);
                    free(err);
                }
        ft_packed_close(&p);
        free(ft_clean);
    }
    CHECK_EQ_INT(ft_nbad, 0);
}

K3_TEST(faults_run_flipped_embedding_row_is_caught)
{
    ft_fixture f;
    ft_fixture_make(&f, 1);
    char lg[4096];
    ft_join(lg, k3t_tmpdir(), "logits.bin");
    const char *dirs[2] = {f.pk, f.pf};
    static const char *rams[3] = {"", "--ram floor", "--ram resident"};
    for (int d = 0; d < 2; d++) {
        ft_packed p;
        ft_packed_open(&p, dirs[d]);
        const cJSON *ts =
            cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(p.man, "trunk"), "tensors");
        const cJSON *emb = NULL;
        for (const cJSON *x = ts ? ts->child : NULL; x && !emb; x = x->next) {
            const cJSON *nm = cJSON_GetObjectItemCaseSensitive(x, "name");
            if (cJSON_IsString(nm) && strstr(nm->valuestring, "embed_tokens"))
                emb = x;
        }
        CHECK(emb != NULL);
        const cJSON *pc = cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(emb, "pieces"), 0);
        const cJSON *rows = cJSON_GetObjectItemCaseSensitive(pc, "rows");
        uint64_t r0 = (uint64_t)cJSON_GetArrayItem(rows, 0)->valuedouble;
        uint64_t r1 = (uint64_t)cJSON_GetArrayItem(rows, 1)->valuedouble;
        CHECK(r0 <= 5 && 5 < r1);
        uint64_t rb = ft_jnum(pc, "nbytes") / (r1 - r0);
        const cJSON *units =
            cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(p.man, "trunk"), "units");
        const cJSON *u = cJSON_GetArrayItem(units, (int)ft_jnum(pc, "unit"));
        const char *name = ft_file_name(&p, ft_jnum(u, "file"));
        uint64_t off = ft_jnum(u, "offset") + ft_jnum(pc, "offset") + (5 - r0) * rb + 10; /* RUN_IDS starts with 5 */
        for (int r = 0; r < 3; r++) {
            char cell[1024], fault[512];
            snprintf(fault, sizeof fault, "flip:%s:%llu", name, (unsigned long long)off);
            snprintf(cell, sizeof cell, "k3-run %s %s %s (embedding row 5)", d ? "pf" : "pk", rams[r], fault);
            run_cell(cell, dirs[d], rams[r], fault, name, 5, lg);
        }
        ft_packed_close(&p);
    }
    CHECK_EQ_INT(ft_nbad, 0);
}

static int b64(int c) { return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9'); }

/* The manifest carries the SHA-256 of the tokenizer files: a flipped byte
 * that still parses (another token's bytes) must not turn into text. */
K3_TEST(faults_run_flipped_tokenizer_byte_is_refused)
{
    ft_fixture f;
    ft_fixture_make(&f, 0);
    char *out = NULL;
    CHECK_EQ_INT(k3t_runf(&out, NULL, "k3-run %s " RUN_IDS " --json", f.pk), 0);
    const char *g = out ? strstr(out, "\"generated_ids\":[") : NULL;
    CHECK(g != NULL);
    unsigned long id = strtoul(g + 17, NULL, 10);
    free(out);
    char path[4096];
    ft_join(path, f.pk, "tiktoken.model");
    uint64_t n;
    char *tk = ft_slurp(path, &n);
    CHECK(tk != NULL);
    uint64_t at = 0;
    for (unsigned long line = 0; line < id && at < n; at++)
        line += tk[at] == '\n';
    while (at < n && tk[at] != ' ' && !(b64(tk[at]) && b64(tk[at] ^ 1)))
        at++;
    CHECK(at < n && tk[at] != ' ');
    free(tk);
    char lg[4096], cell[1024], fault[512];
    ft_join(lg, k3t_tmpdir(), "logits.bin");
    snprintf(fault, sizeof fault, "flip:tiktoken.model:%llu", (unsigned long long)at);
    snprintf(cell, sizeof cell, "k3-run pk %s (the line of generated id %lu)", fault, id);
    run_cell(cell, f.pk, "", fault, "tiktoken.model", 5, lg);
    CHECK_EQ_INT(ft_nbad, 0);
}

/* The journals are our own files, but read back they are input like any
 * other: a value in an entry that reads differently (still valid JSON) must
 * not end up in the manifest. --resume must then redo the work or stop; it
 * must never publish a manifest whose hashes, CRCs or provenance are not
 * those of an uninterrupted run. */
