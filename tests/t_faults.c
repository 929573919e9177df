/*
 * t_faults.c - fault injection over the real binaries (Hardening item 3).
 *
 * K3_FAULT (include/k3_io.h) makes reads through k3_io_pread fail with EIO,
 * come back one byte short, or come back with one bit flipped. Each test
 * here builds a tiny checkpoint (k3-synth), its packed form (k3-convert) and
 * a re-layout (k3-pack --ram floor), computes the byte to hit from the files
 * themselves (safetensors header, manifest.json, experts.idx, the expert
 * trace of a run) and runs one tool per fault. What every cell checks:
 *
 *   - the exit status is the documented one: 4 for EIO and short reads; 3 for
 *     a flipped byte in a header or JSON; 5 for a flipped byte a CRC or hash
 *     catches; k3-verify reports every problem with status 1;
 *   - stderr carries exactly one "k3-TOOL: error: " line, naming the file;
 *   - nothing is left that passes k3-verify (DST absent or rejected);
 *   - k3-run prints no token and creates no --logits file.
 *
 * What k3 can and cannot know. A flipped byte in a shard's tensor data (or in
 * a tokenizer file) of an upstream checkpoint has nothing to be checked
 * against: safetensors carry no checksums. k3-convert hashes every byte as it
 * reads it and records those hashes as the packed model's provenance, so the
 * guarantee is: `k3-verify --sums SUMS DST` (SUMS: the publisher's sha256
 * list) rejects a model converted from bytes that were not the published
 * ones, and `k3-verify --sums SUMS SRC` rejects the source under the same
 * fault. Packed data carries CRC32 per unit/record and SHA-256 per file, so
 * from there on every flipped byte is caught where it is read. k3-run on an
 * upstream checkpoint can only catch what a header check sees: run
 * `k3-verify --sums` on it first.
 *
 * "short" is simulated by asking the kernel for one byte less; on a file
 * opened with O_DIRECT that request itself fails (EINVAL), so there it tests
 * the error path rather than a short count - the status is 4 either way.
 *
 * The matrices report every failing cell before the test fails, so one run
 * shows the whole picture.
 */
#include <cjson/cJSON.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "faults_util.h"
#include "k3_test.h"


/* ------------------------------------------------------------ k3-convert */


K3_TEST(faults_convert_read_errors_exit_4_and_leave_no_model)
{
    ft_fixture f;
    ft_fixture_make(&f, 0);
    ft_target t[16];
    int n = ft_upstream_targets(&f, t);
    for (int i = 0; i < n; i++)
        for (int k = 0; k < 2; k++) {
            char cell[256], *err = NULL;
            snprintf(cell, sizeof cell, "k3-convert %s %s@%llu (%s)", ft_kinds[k], t[i].file,
                     (unsigned long long)t[i].off, t[i].what);
            ft_clean(f.out);
            int st = k3t_runf(NULL, &err, "K3_FAULT=%s:%s:%llu k3-convert --quiet %s %s", ft_kinds[k], t[i].file,
                              (unsigned long long)t[i].off, f.up, f.out);
            if (st != 4)
                ft_bad(cell, "status %d, want 4 (%s)", st, ft_tail(err));
            ft_one_error_line(cell, "k3-convert", err, t[i].file);
            ft_no_valid_output(cell, f.out);
            free(err);
        }
    CHECK_EQ_INT(ft_nbad, 0);
}

K3_TEST(faults_convert_flipped_header_or_json_byte_exits_3)
{
    ft_fixture f;
    ft_fixture_make(&f, 0);
    ft_target t[16];
    int n = ft_upstream_targets(&f, t);
    for (int i = 0; i < n; i++) {
        if (t[i].flip != 3)
            continue;
        char cell[256], *err = NULL;
        snprintf(cell, sizeof cell, "k3-convert flip %s@%llu (%s)", t[i].file, (unsigned long long)t[i].off,
                 t[i].what);
        ft_clean(f.out);
        int st = k3t_runf(NULL, &err, "K3_FAULT=flip:%s:%llu k3-convert --quiet %s %s", t[i].file,
                          (unsigned long long)t[i].off, f.up, f.out);
        if (st != 3)
            ft_bad(cell, "status %d, want 3 (%s)", st, ft_tail(err));
        ft_one_error_line(cell, "k3-convert", err, t[i].file);
        ft_no_valid_output(cell, f.out);
        free(err);
    }
    CHECK_EQ_INT(ft_nbad, 0);
}

/* A flipped byte that no header or JSON rule can see: convert cannot know it
 * (exit 0), but the ft_packed model's provenance carries the hash of what was
 * read, so `k3-verify --sums` rejects the result, and the source too. */
static void flipped_data_caught_by_sums(int tokenizer)
{
    ft_fixture f;
    ft_fixture_make(&f, 0);
    ft_target t[16];
    int n = ft_upstream_targets(&f, t);
    int tried = 0;
    for (int i = 0; i < n; i++) {
        if (t[i].flip != 0 || (strstr(t[i].file, "token") != NULL) != tokenizer)
            continue;
        tried++;
        char cell[256], *err = NULL, *out = NULL;
        snprintf(cell, sizeof cell, "k3-convert flip %s@%llu (%s)", t[i].file, (unsigned long long)t[i].off,
                 t[i].what);
        ft_clean(f.out);
        int st = k3t_runf(NULL, &err, "K3_FAULT=flip:%s:%llu k3-convert --quiet %s %s", t[i].file,
                          (unsigned long long)t[i].off, f.up, f.out);
        if (st != 0) {
            ft_bad(cell, "status %d: convert cannot know this byte is wrong (%s)", st, ft_tail(err));
        } else {
            st = k3t_runf(&out, NULL, "k3-verify %s", f.out);
            if (st != 0)
                ft_bad(cell, "without --sums k3-verify should accept what convert wrote: %d", st);
            free(out);
            out = NULL;
            st = k3t_runf(&out, NULL, "k3-verify --sums %s %s", f.sums, f.out);
            if (st != 1)
                ft_bad(cell, "k3-verify --sums of the converted model: status %d, want 1: %s", st, out ? out : "");
            else if (!out || !strstr(out, t[i].file))
                ft_bad(cell, "k3-verify --sums does not name %s: %s", t[i].file, out ? out : "");
        }
        free(out);
        out = NULL;
        st = k3t_runf(&out, NULL, "K3_FAULT=flip:%s:%llu k3-verify --sums %s %s", t[i].file,
                      (unsigned long long)t[i].off, f.sums, f.up);
        if (st != 1 || !out || !strstr(out, t[i].file))
            ft_bad(cell, "k3-verify --sums of the source under the same fault: status %d: %s", st, out ? out : "");
        free(out);
        free(err);
    }
    CHECK(tried >= 2);
    CHECK_EQ_INT(ft_nbad, 0);
}

K3_TEST(faults_convert_flipped_tensor_byte_is_caught_by_verify_sums)
{
    flipped_data_caught_by_sums(0);
}

/* ------------------------------------------------------------ k3-verify */

K3_TEST(faults_verify_upstream_reports_read_errors_as_problems)
{
    ft_fixture f;
    ft_fixture_make(&f, 0);
    ft_target t[16];
    int n = ft_upstream_targets(&f, t);
    for (int i = 0; i < n; i++)
        for (int k = 0; k < 3; k++) {
            /* the tokenizer files are read only with --sums; a flip in tensor
             * data is only visible with --sums */
            int sums = strstr(t[i].file, "token") != NULL || (k == 2 && t[i].flip == 0);
            char cell[256], *out = NULL;
            snprintf(cell, sizeof cell, "k3-verify%s %s %s@%llu (%s)", sums ? " --sums" : "", ft_kinds[k], t[i].file,
                     (unsigned long long)t[i].off, t[i].what);
            int st = k3t_runf(&out, NULL, "K3_FAULT=%s:%s:%llu k3-verify %s%s %s", ft_kinds[k], t[i].file,
                              (unsigned long long)t[i].off, sums ? "--sums " : "", sums ? f.sums : "", f.up);
            if (st != 1)
                ft_bad(cell, "status %d, want 1: %s", st, out ? out : "");
            else if (!out || !strstr(out, t[i].file))
                ft_bad(cell, "the problems do not name %s: %s", t[i].file, out ? out : "");
            free(out);
        }
    CHECK_EQ_INT(ft_nbad, 0);
}

/* Every file of a ft_packed model, with the byte to hit and the status a flip
 * there must give k3-run / k3-pack (k3-verify always says 1). */

K3_TEST(faults_verify_packed_full_check_reports_every_fault)
{
    ft_fixture f;
    ft_fixture_make(&f, 1);
    const char *dirs[2] = {f.pk, f.pf};
    for (int d = 0; d < 2; d++) {
        ft_target t[16];
        int n = ft_packed_targets(dirs[d], t, &f);
        for (int i = 0; i < n; i++)
            for (int k = 0; k < 3; k++) {
                char cell[256], *out = NULL;
                snprintf(cell, sizeof cell, "k3-verify %s %s %s@%llu (%s)", d ? "pf" : "pk", ft_kinds[k], t[i].file,
                         (unsigned long long)t[i].off, t[i].what);
                int st = k3t_runf(&out, NULL, "K3_FAULT=%s:%s:%llu k3-verify %s", ft_kinds[k], t[i].file,
                                  (unsigned long long)t[i].off, dirs[d]);
                if (st != 1)
                    ft_bad(cell, "status %d, want 1: %s", st, out ? out : "");
                else if (!out || !strstr(out, t[i].file))
                    ft_bad(cell, "the problems do not name %s: %s", t[i].file, out ? out : "");
                free(out);
            }
    }
    CHECK_EQ_INT(ft_nbad, 0);
}

/* ------------------------------------------------------------ k3-pack */

static void pack_cell(const ft_fixture *f, const ft_target *t, int k, const char *opts)
{
    char cell[512], *err = NULL;
    snprintf(cell, sizeof cell, "k3-pack %s %s %s@%llu (%s)", opts, ft_kinds[k], t->file, (unsigned long long)t->off,
             t->what);
    ft_clean(f->out);
    int st = k3t_runf(NULL, &err, "K3_FAULT=%s:%s:%llu k3-pack --quiet %s --ram floor %s %s", ft_kinds[k], t->file,
                      (unsigned long long)t->off, opts, f->pk, f->out);
    int want = ft_want_for(t, k);
    if (st != want)
        ft_bad(cell, "status %d, want %d (%s)", st, want, ft_tail(err));
    else
        ft_one_error_line(cell, "k3-pack", err, t->file);
    ft_no_valid_output(cell, f->out);
    free(err);
}

K3_TEST(faults_pack_fails_on_bad_source_reads_without_a_model)
{
    ft_fixture f;
    ft_fixture_make(&f, 0);
    char trace[4096];
    ft_join(trace, k3t_tmpdir(), "trace.txt");
    ft_target t[16];
    int n = ft_packed_targets(f.pk, t, &f);
    char order[4200];
    snprintf(order, sizeof order, "--expert-order %s", trace);
    for (int i = 0; i < n; i++) {
        /* default k3-pack links the expert and tokenizer files without
         * reading them: faults there only matter when it reorders */
        int linked = strstr(t[i].file, "experts-") || strstr(t[i].file, "token");
        for (int k = 0; k < 3; k++) {
            if (!linked)
                pack_cell(&f, &t[i], k, "");
            else if (strstr(t[i].file, "experts-"))
                pack_cell(&f, &t[i], k, order);
        }
    }
    CHECK_EQ_INT(ft_nbad, 0);
}

/* ------------------------------------------------------------ journals */

/* A digit of the value after k2 after k1 in the file whose flip is still a
 * digit of the same kind (the text still parses). */
static uint64_t flip_after(const char *path, const char *k1, const char *k2)
{
    uint64_t n;
    char *b = ft_slurp(path, &n);
    CHECK(b != NULL);
    char *p = strstr(b, k1);
    CHECK(p != NULL);
    p = strstr(p + strlen(k1), k2);
    CHECK(p != NULL);
    p += strlen(k2);
    while (*p && !(ft_hexd(*p) && ft_hexd(*p ^ 1)))
        p++;
    CHECK(*p);
    uint64_t off = (uint64_t)(p - b);
    free(b);
    return off;
}

/* Interrupt k3-convert after group 2's journal entry (groups 0-2 done). */
static void convert_interrupted(const ft_fixture *f)
{
    ft_clean(f->out);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "K3_CONVERT_CRASH=journaled:2 k3-convert --quiet %s %s", f->up, f->out), 137);
}

/* A journal read that fails is no reason to stop: the group is redone. A
 * plan that cannot be read stops --resume with 4 and leaves DST resumable;
 * one that reads as another plan's asks for --force (7). */
K3_TEST(faults_convert_resume_with_an_unreadable_journal_redoes_or_stops_cleanly)
{
    ft_fixture f;
    ft_fixture_make(&f, 0);
    for (int k = 0; k < 2; k++) {
        char cell[256], *out = NULL, *err = NULL;
        snprintf(cell, sizeof cell, "k3-convert --resume, %s reading group-0000.json", ft_kinds[k]);
        convert_interrupted(&f);
        int st = k3t_runf(&out, &err, "K3_FAULT=%s:group-0000.json:0 k3-convert --quiet --json --resume %s %s", ft_kinds[k],
                          f.up, f.out);
        if (st != 0 || !out || !strstr(out, "\"groups_skipped\": 2"))
            ft_bad(cell, "status %d, want 0 with group 0 redone: %s %s", st, out ? out : "", ft_tail(err));
        free(out);
        free(err);
        out = NULL;
        if (k3t_runf(&out, NULL, "diff -r %s %s", f.out, f.pk) != 0)
            ft_bad(cell, "the result differs from an uninterrupted run: %s", out ? out : "");
        free(out);
    }
    char plan[4096];
    ft_join(plan, f.out, ".k3-convert-journal/plan.json");
    for (int k = 0; k < 3; k++) {
        char cell[256], *err = NULL, *out = NULL;
        snprintf(cell, sizeof cell, "k3-convert --resume, %s reading plan.json", ft_kinds[k]);
        convert_interrupted(&f);
        uint64_t off = k < 2 ? 0 : flip_after(plan, "\"fingerprint\"", ":");
        int st = k3t_runf(NULL, &err, "K3_FAULT=%s:plan.json:%llu k3-convert --quiet --resume %s %s", ft_kinds[k],
                          (unsigned long long)off, f.up, f.out);
        int want = k < 2 ? 4 : 7;
        if (st != want)
            ft_bad(cell, "status %d, want %d (%s)", st, want, ft_tail(err));
        else
            ft_one_error_line(cell, "k3-convert", err, k < 2 ? "plan.json" : f.out);
        ft_no_valid_output(cell, f.out);
        free(err);
        if ((st = k3t_runf(NULL, &err, "k3-convert --quiet --resume %s %s", f.up, f.out)) != 0)
            ft_bad(cell, "a ft_clean --resume afterwards: status %d (%s)", st, ft_tail(err));
        else if (k3t_runf(&out, NULL, "diff -r %s %s", f.out, f.pk) != 0)
            ft_bad(cell, "a ft_clean --resume afterwards differs from an uninterrupted run: %s", out ? out : "");
        free(out);
        free(err);
    }
    CHECK_EQ_INT(ft_nbad, 0);
}

/* k3-pack, interrupted after output file 3's journal entry (the trunk file
 * is journaled): an unreadable entry means the file is written again. */
K3_TEST(faults_pack_resume_with_an_unreadable_journal_entry_redoes_the_file)
{
    ft_fixture f;
    ft_fixture_make(&f, 1);
    for (int k = 0; k < 2; k++) {
        char cell[256], *out = NULL, *err = NULL;
        snprintf(cell, sizeof cell, "k3-pack --resume, %s reading trunk-0000.k3t.json", ft_kinds[k]);
        ft_clean(f.out);
        CHECK_EQ_INT(k3t_runf(NULL, NULL, "K3_PACK_CRASH=journaled:3 k3-pack --quiet --ram floor %s %s", f.pk, f.out),
                     137);
        int st = k3t_runf(NULL, &err, "K3_FAULT=%s:trunk-0000.k3t.json:0 k3-pack --quiet --resume --ram floor %s %s",
                          ft_kinds[k], f.pk, f.out);
        if (st != 0)
            ft_bad(cell, "status %d, want 0 (%s)", st, ft_tail(err));
        else if (k3t_runf(&out, NULL, "diff -r %s %s", f.out, f.pf) != 0)
            ft_bad(cell, "the result differs from an uninterrupted run: %s", out ? out : "");
        free(out);
        free(err);
    }
    CHECK_EQ_INT(ft_nbad, 0);
}

/* ------------------------------------------------------------ gaps found */

/* The small source files are hashed as read and recorded in the manifest's
 * source.files; a tokenizer file read with a flipped byte is copied as read,
 * so `k3-verify --sums` must compare those entries too, as it does shards. */
K3_TEST(faults_convert_flipped_tokenizer_byte_is_caught_by_verify_sums)
{
    flipped_data_caught_by_sums(1);
}

/* k3-pack --copy (and the copy fallback when linking fails) copies files it
 * does not change: what it read must be what the source manifest says, or
 * the published DST carries bytes its manifest does not describe. */
K3_TEST(faults_pack_copy_checks_what_it_copies)
{
    ft_fixture f;
    ft_fixture_make(&f, 0);
    ft_target t[16];
    int n = ft_packed_targets(f.pk, t, &f);
    for (int i = 0; i < n; i++) {
        if (!strstr(t[i].file, "experts-") && !strstr(t[i].file, "token"))
            continue;
        ft_target c = t[i];
        c.flip = 5; /* the source manifest's SHA-256 says the bytes are wrong */
        for (int k = 0; k < 3; k++)
            pack_cell(&f, &c, k, "--copy");
    }
    CHECK_EQ_INT(ft_nbad, 0);
}

/* The embedding table is read a row at a time (the unit's CRC covers the
 * whole table): a flipped byte in the row of a prompt id must still not
 * reach a token. */
static void journal_value_cell(const ft_fixture *f, const char *tool, const char *file, uint64_t off, const char *what,
                               const char *ref)
{
    char cell[512], *out = NULL, *err = NULL;
    snprintf(cell, sizeof cell, "%s --resume, flip %s@%llu (%s)", tool, file, (unsigned long long)off, what);
    int st;
    if (!strcmp(tool, "k3-convert"))
        st = k3t_runf(NULL, &err, "K3_FAULT=flip:%s:%llu k3-convert --quiet --resume %s %s", file,
                      (unsigned long long)off, f->up, f->out);
    else
        st = k3t_runf(NULL, &err, "K3_FAULT=flip:%s:%llu k3-pack --quiet --resume --ram floor %s %s", file,
                      (unsigned long long)off, f->pk, f->out);
    char man[4096];
    ft_join(man, f->out, "manifest.json");
    if (st == 0) {
        if (k3t_runf(&out, NULL, "diff -r %s %s", f->out, ref) != 0)
            ft_bad(cell, "status 0 but the result differs from an uninterrupted run: %s", out ? out : "");
    } else {
        ft_one_error_line(cell, tool, err, file);
        if (ft_exists(man))
            ft_no_valid_output(cell, f->out);
    }
    free(out);
    out = NULL;
    if (ft_exists(man) && k3t_runf(&out, NULL, "k3-verify %s", f->out) != 0)
        ft_bad(cell, "manifest.json published and k3-verify rejects it: %s", out ? out : "");
    free(out);
    free(err);
}

K3_TEST(faults_convert_resume_never_trusts_a_journal_value_that_reads_differently)
{
    ft_fixture f;
    ft_fixture_make(&f, 0);
    static const char *k1[3] = {"\"shards\"", "\"files\"", "\"unit_crcs\""};
    static const char *k2[3] = {"\"sha256\":", "\"sha256\":", "["};
    static const char *what[3] = {"the shard's SHA-256 (provenance)", "trunk-0000.k3t's SHA-256",
                                  "unit 0's CRC32"};
    for (int i = 0; i < 3; i++) {
        convert_interrupted(&f);
        char entry[4096];
        ft_join(entry, f.out, ".k3-convert-journal/group-0000.json");
        uint64_t off = flip_after(entry, k1[i], k2[i]);
        journal_value_cell(&f, "k3-convert", "group-0000.json", off, what[i], f.pk);
    }
    CHECK_EQ_INT(ft_nbad, 0);
}

K3_TEST(faults_pack_resume_never_trusts_a_journal_value_that_reads_differently)
{
    ft_fixture f;
    ft_fixture_make(&f, 1);
    static const char *k1[2] = {"\"sha256\"", "\"crc32\""};
    static const char *what[2] = {"trunk-0000.k3t's SHA-256", "unit 0's CRC32"};
    for (int i = 0; i < 2; i++) {
        ft_clean(f.out);
        CHECK_EQ_INT(k3t_runf(NULL, NULL, "K3_PACK_CRASH=journaled:3 k3-pack --quiet --ram floor %s %s", f.pk, f.out),
                     137);
        char entry[4200];
        snprintf(entry, sizeof entry, "%s.k3-pack-tmp/.k3-pack-journal/trunk-0000.k3t.json", f.out);
        uint64_t off = flip_after(entry, k1[i], ":");
        journal_value_cell(&f, "k3-pack", "trunk-0000.k3t.json", off, what[i], f.pf);
    }
    CHECK_EQ_INT(ft_nbad, 0);
}

