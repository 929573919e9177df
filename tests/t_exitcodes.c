/*
 * t_exitcodes.c - the exit-code table of README.md, walked row by row for
 * every tool: each (tool, code) is either a command line that must end with
 * that code (and, for an error, exactly one line "k3-TOOL: error: ..." on
 * stderr), or listed here as a row that cannot happen for that tool, with
 * the reason (k3-serve, a server, has an exit-0 case stopped by SIGINT).
 * The README table itself is read, so that a new row without a case here
 * fails the test. Then the exact diagnoses: permission, a file, the
 * wrong kind of directory naming the tool to use, a truncated shard, a path
 * named once, an error of k3-pack without its plan.
 */
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "k3_test.h"

static const char *const tools[] = {"k3-synth", "k3-convert", "k3-pack", "k3-verify", "k3-run", "k3-serve"};
#define NTOOLS 6

typedef struct row {
    int code;
    int tool;                   /* index in tools */
    const char *cmd;            /* %1$s is the fixture directory; NULL: cannot happen */
    const char *why;            /* why it cannot happen (cmd NULL) */
} row;

#define CANNOT(c, t, w) {c, t, NULL, w}

static const row rows[] = {
    {0, 0, "k3-synth %1$s/o0 --preset tiny --quiet", NULL},
    {0, 1, "k3-convert --quiet %1$s/up %1$s/c0", NULL},
    {0, 2, "k3-pack --quiet %1$s/pk %1$s/p0", NULL},
    {0, 3, "k3-verify --quick %1$s/pk", NULL},
    {0, 4, "k3-run %1$s/pk --ids 1,2 --gen 2", NULL},
    /* k3-serve ends with 0 on SIGINT once its requests are done */
    {0, 5, "timeout --preserve-status -s INT 3 k3-serve %1$s/pk --port 0 --quiet", NULL},

    CANNOT(1, 0, "only k3-verify reports problems"),
    CANNOT(1, 1, "only k3-verify reports problems"),
    CANNOT(1, 2, "only k3-verify reports problems"),
    {1, 3, "k3-verify %1$s/cr", NULL},
    CANNOT(1, 4, "only k3-verify reports problems"),
    CANNOT(1, 5, "only k3-verify reports problems"),

    {2, 0, "k3-synth --bogus", NULL},
    {2, 1, "k3-convert --bogus", NULL},
    {2, 2, "k3-pack --bogus", NULL},
    {2, 3, "k3-verify --bogus", NULL},
    {2, 4, "k3-run --bogus", NULL},
    {2, 5, "k3-serve --bogus", NULL},

    CANNOT(3, 0, "k3-synth reads no input file"),
    {3, 1, "k3-convert --quiet %1$s/badcfg %1$s/c3", NULL},
    {3, 2, "k3-pack --quiet %1$s/badman %1$s/p3", NULL},
    {3, 3, "k3-verify --sums %1$s/bad.sums %1$s/pk", NULL},
    {3, 4, "k3-run %1$s/badcfg --ids 1", NULL},
    {3, 5, "k3-serve %1$s/badcfg --port 0 --quiet", NULL},

    {4, 0, "k3-synth %1$s/no/such/parent --preset tiny --quiet", NULL},
    {4, 1, "k3-convert %1$s/nothing %1$s/c4", NULL},
    {4, 2, "k3-pack %1$s/nothing %1$s/p4", NULL},
    {4, 3, "k3-verify %1$s/nothing", NULL},
    {4, 4, "k3-run %1$s/trunc --ids 1", NULL},
    {4, 5, "k3-serve %1$s/trunc --port 0 --quiet", NULL},

    CANNOT(5, 0, "k3-synth reads no input file"),
    CANNOT(5, 1, "upstream shards carry no checksums: a flipped byte is converted as read "
                 "(k3-verify --sums finds it, exit 1)"),
    {5, 2, "k3-pack --quiet --copy %1$s/cr %1$s/p5", NULL},
    CANNOT(5, 3, "corrupt data is a problem k3-verify lists: exit 1"),
    {5, 4, "k3-run %1$s/cr --ids 1,2,3 --gen 3", NULL},
    CANNOT(5, 5, "a corrupt record is found when a request routes to it: that request fails (500), "
                 "/health turns 503, the server goes on"),

    {6, 0, "k3-synth %1$s/$(printf '%%04100d' 0) --preset tiny --quiet", NULL},
    {6, 1, "k3-convert --quiet %1$s/hl %1$s/c6", NULL},
    {6, 2, "k3-pack --quiet %1$s/pk %1$s/p6 --ram 1K", NULL},
    {6, 3, "k3-verify --sums %1$s/big.sums %1$s/pk", NULL},
    {6, 4, "k3-run %1$s/pk --ids 1 --ram 1K", NULL},
    {6, 5, "k3-serve %1$s/pk --ram 1K --port 0 --quiet", NULL},

    {7, 0, "k3-synth %1$s/up --preset tiny --quiet", NULL},
    {7, 1, "k3-convert --quiet %1$s/up %1$s/pk", NULL},
    {7, 2, "k3-pack --quiet %1$s/pk %1$s/exists", NULL},
    CANNOT(7, 3, "k3-verify writes nothing"),
    CANNOT(7, 4, "k3-run writes no directory; --logits and --trace files are replaced as asked"),
    CANNOT(7, 5, "k3-serve writes no file"),

    /* full disks for the model files: t_diskfull.c; every output: t_outputs.c */
    {8, 0, "k3-synth %1$s/o8 --preset tiny > /dev/full", NULL},
    {8, 1, "k3-convert --quiet --json %1$s/up %1$s/c8 > /dev/full", NULL},
    {8, 2, "k3-pack --quiet --json %1$s/pk %1$s/p8 > /dev/full", NULL},
    {8, 3, "k3-verify %1$s/pk > /dev/full", NULL},
    {8, 4, "k3-run %1$s/pk --ids 1 > /dev/full", NULL},
    {8, 5, "k3-serve --help > /dev/full", NULL},

    CANNOT(9, 0, "a bug in k3: no input gives it"),
    CANNOT(9, 1, "a bug in k3: no input gives it"),
    CANNOT(9, 2, "a bug in k3: no input gives it"),
    CANNOT(9, 3, "a bug in k3: no input gives it"),
    CANNOT(9, 4, "a bug in k3: no input gives it"),
    CANNOT(9, 5, "a bug in k3: no input gives it"),

    /* k3-verify and k3-run write nothing to resume: SIGINT ends them (128 + 2) */
    {130, 0, "timeout --preserve-status -s INT 1 k3-synth %1$s/o130 --preset k3 --sparse --quiet", NULL},
    {130, 1, "K3_CONVERT_CRASH=interrupt:1 k3-convert --quiet %1$s/up %1$s/c130", NULL},
    {130, 2, "K3_PACK_CRASH=interrupt:0 k3-pack --quiet %1$s/pk %1$s/p130", NULL},
    {130, 3, "timeout --preserve-status -s INT 1 k3-verify --sums %1$s/fifo %1$s/pk", NULL},
    {130, 4, "timeout --preserve-status -s INT 1 k3-run %1$s/pk --prompt-file %1$s/fifo", NULL},
    CANNOT(130, 5, "SIGINT and SIGTERM are how k3-serve is stopped: it drains and exits 0"),
};

static int count_lines(const char *s)
{
    int n = 0;
    for (; s && *s; s++)
        n += *s == '\n';
    return n;
}

/* The codes of the README's exit-code table ("| N | meaning |" rows after
 * "## Exit codes"). */
static int readme_codes(int *codes, int cap)
{
    char path[4096], *txt = NULL;
    snprintf(path, sizeof path, "cat %s/README.md", k3t_root());
    CHECK_EQ_INT(k3t_runf(&txt, NULL, "%s", path), 0);
    int n = 0;
    const char *p = txt ? strstr(txt, "## Exit codes") : NULL;
    CHECK(p != NULL);
    for (; p && *p && n < cap;) {
        const char *nl = strchr(p, '\n');
        if (!nl)
            break;
        p = nl + 1;
        if (!strncmp(p, "## ", 3))
            break;
        int c;
        if (sscanf(p, "| %d |", &c) == 1)
            codes[n++] = c;
    }
    free(txt);
    return n;
}

static void fixture(const char *t)
{
    CHECK_EQ_INT(k3t_runf(NULL, NULL,
                          "set -e; cd %s; k3-synth up --preset tiny --seed 1 --quiet; k3-convert --quiet up pk; "
                          "cp -a up badcfg; echo '{bad' > badcfg/config.json; "
                          "cp -a pk badman; echo '{bad' > badman/manifest.json; "
                          "cp -a up trunc; truncate -s 300000 trunc/model-00002-of-00005.safetensors; "
                          "cp -a up hl; printf '\\000\\302\\353\\013\\000\\000\\000\\000' | "
                          "dd of=hl/model-00001-of-00005.safetensors bs=8 count=1 conv=notrunc 2>/dev/null; "
                          "cp -a pk cr; printf '\\377' | dd of=cr/experts-0001.k3e bs=1 seek=100 count=1 "
                          "conv=notrunc 2>/dev/null; "
                          "echo xyz > bad.sums; truncate -s 70M big.sums; mkfifo fifo; "
                          "mkdir exists; echo mine > exists/notes.txt",
                          t),
                 0);
}

K3_TEST_TIMEOUT(exit_codes_every_row_of_the_readme_table_for_every_tool, 240)
{
    const char *t = k3t_tmpdir();
    fixture(t);
    int codes[32];
    int nc = readme_codes(codes, 32);
    CHECK(nc >= 11);
    const int nrows = (int)(sizeof rows / sizeof rows[0]);
    /* every row of the table has a case (or a reason) for every tool */
    for (int c = 0; c < nc; c++)
        for (int k = 0; k < NTOOLS; k++) {
            int found = 0;
            for (int r = 0; r < nrows; r++)
                found |= rows[r].code == codes[c] && rows[r].tool == k;
            if (!found)
                k3t_fail(__FILE__, __LINE__, "README exit code %d has no case for %s", codes[c], tools[k]);
        }
    for (int r = 0; r < nrows; r++) {
        const row *w = &rows[r];
        int in_table = 0;
        for (int c = 0; c < nc; c++)
            in_table |= codes[c] == w->code;
        if (!in_table)
            k3t_fail(__FILE__, __LINE__, "case for exit %d (%s) is not a row of the README table", w->code,
                     tools[w->tool]);
        if (!w->cmd) {
            CHECK(w->why && *w->why);
            continue;
        }
        char cmd[8192];
        snprintf(cmd, sizeof cmd, w->cmd, t);
        char *out = NULL, *err = NULL;
        int rc = k3t_runf(&out, &err, "%s", cmd);
        char prefix[64];
        snprintf(prefix, sizeof prefix, "%s: error: ", tools[w->tool]);
        int killed = w->code == 130 && (w->tool == 3 || w->tool == 4);
        int want_line = w->code >= 2 && !killed;
        if (rc != w->code || (want_line && (strncmp(err, prefix, strlen(prefix)) || count_lines(err) != 1)))
            k3t_fail(__FILE__, __LINE__, "%s: want exit %d%s, got %d; stderr:\n%s", cmd, w->code,
                     want_line ? " and one error line" : "", rc, err ? err : "");
        free(out);
        free(err);
    }
}

/* the message names the path once */
static void once(const char *msg, const char *path)
{
    const char *a = strstr(msg, path);
    if (!a || strstr(a + strlen(path), path))
        k3t_fail(__FILE__, __LINE__, "want %s named once in: %s", path, msg);
}

K3_TEST(diagnoses_say_permission_file_wrong_kind_and_truncation_exactly)
{
    const char *t = k3t_tmpdir();
    char up[4096], pk[4096], np[4096], c[9000];
    snprintf(up, sizeof up, "%s/up", t);
    snprintf(pk, sizeof pk, "%s/pk", t);
    snprintf(np, sizeof np, "%s/np", t);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-synth %s --preset tiny --quiet && k3-convert --quiet %s %s", up, up, pk),
                 0);
    char *out = NULL, *err = NULL;
    /* permission: a user without it (a user namespace drops root's override) */
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "cp -a %s %s && chmod 700 %s/* && chmod 300 %s", pk, np, np, np), 0);
    int have_userns = k3t_runf(NULL, NULL, "unshare -U true") == 0;
    if (have_userns) {
        for (int k = 1; k < NTOOLS; k++) {
            const char *fmt = k == 1 ? "unshare -U %s %s %s/x" : k == 2 ? "unshare -U %s %s %s/x"
                              : k == 3 ? "unshare -U %s %s" : k == 4 ? "unshare -U %s %s --ids 1"
                                                                     : "unshare -U %s %s --port 0 --quiet";
            snprintf(c, sizeof c, fmt, tools[k], np, t);
            CHECK_EQ_INT(k3t_runf(NULL, &err, "%s", c), 4);
            CHECK_STR_CONTAINS(err, "permission denied: the directory cannot be listed");
            CHECK_EQ_INT(count_lines(err), 1);
            once(err, np);
            free(err);
        }
        CHECK_EQ_INT(k3t_runf(NULL, NULL, "chmod 000 %s", np), 0);
        CHECK_EQ_INT(k3t_runf(NULL, &err, "unshare -U k3-run %s --ids 1", np), 4);
        CHECK_STR_CONTAINS(err, "permission denied: the directory cannot be entered");
        free(err);
    } else {
        fprintf(stderr, "  (permission cases skipped: no user namespaces here)\n");
    }
    /* a file */
    for (int k = 1; k < NTOOLS; k++) {
        snprintf(c, sizeof c, k == 5 ? "%s %s/config.json --port 0 --quiet" : k == 4 ? "%s %s/config.json --ids 1"
                              : k == 3 ? "%s %s/config.json" : "%s %s/config.json %s/x",
                 tools[k], up, t);
        int rc = k3t_runf(NULL, &err, "%s", c);
        CHECK_EQ_INT(rc, k == 3 ? 4 : 2);
        CHECK_STR_CONTAINS(err, "config.json: a file, not a model directory");
        CHECK_EQ_INT(count_lines(err), 1);
        free(err);
    }
    /* the wrong kind names the tool to use */
    CHECK_EQ_INT(k3t_runf(NULL, &err, "k3-pack %s %s/x", up, t), 2);
    CHECK_STR_CONTAINS(err, "an upstream checkpoint (config.json, no manifest.json): k3-pack needs a packed model; "
                            "make one with k3-convert ");
    CHECK_EQ_INT(count_lines(err), 1);
    free(err);
    CHECK_EQ_INT(k3t_runf(NULL, &err, "k3-convert %s %s/x", pk, t), 2);
    CHECK_STR_CONTAINS(err, "a packed model (manifest.json), not an upstream checkpoint: k3-convert reads upstream "
                            "checkpoints; to lay a packed model out again use k3-pack ");
    free(err);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "mkdir %s/empty", t), 0);
    CHECK_EQ_INT(k3t_runf(NULL, &err, "k3-run %s/empty --ids 1", t), 4);
    CHECK_STR_CONTAINS(err, "not a model: no manifest.json (packed model) and no config.json (upstream checkpoint)");
    free(err);
    CHECK_EQ_INT(k3t_runf(NULL, &err, "mkdir %s/half && cp %s/trunk-0000.k3t %s/half/ && k3-pack %s/half %s/y", t, pk,
                          t, t, t), 4);
    CHECK_STR_CONTAINS(err, "an incomplete packed model (no manifest.json): an interrupted k3-convert or k3-pack; run "
                            "it again with --resume");
    free(err);
    /* a truncated shard is an I/O error (exit 4) for every reader */
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "cp -a %s %s/tr && truncate -s 300000 %s/tr/model-00002-of-00005.safetensors",
                          up, t, t), 0);
    const char *rd[2] = {"k3-run %s/tr --ids 1", "k3-convert --quiet %s/tr %s/trx"};
    for (int i = 0; i < 2; i++) {
        snprintf(c, sizeof c, rd[i], t, t);
        CHECK_EQ_INT(k3t_runf(NULL, &err, "%s", c), 4);
        CHECK_STR_CONTAINS(err, "the file is truncated");
        CHECK_EQ_INT(count_lines(err), 1);
        free(err);
    }
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "truncate -s 100 %s/tr/model-00002-of-00005.safetensors", t), 0);
    CHECK_EQ_INT(k3t_runf(NULL, &err, "k3-run %s/tr --ids 1", t), 4);
    CHECK_STR_CONTAINS(err, "runs past end of file (100 bytes): the file is truncated");
    free(err);
    /* k3-verify names the path once */
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "cp -a %s %s/bc && echo '{bad' > %s/bc/config.json", up, t, t), 0);
    CHECK_EQ_INT(k3t_runf(&out, NULL, "k3-verify %s/bc", t), 1);
    char bc[4200];
    snprintf(bc, sizeof bc, "%s/bc/config.json", t);
    once(out, bc);
    free(out);
    /* k3-pack: an error is one line, no plan before it */
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "mkdir %s/taken", t), 0);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "touch %s/taken/f", t), 0);
    CHECK_EQ_INT(k3t_runf(NULL, &err, "k3-pack %s %s/taken", pk, t), 7);
    CHECK_EQ_INT(count_lines(err), 1);
    CHECK(strncmp(err, "k3-pack: error: ", 16) == 0);
    free(err);
    CHECK_EQ_INT(k3t_runf(NULL, &err, "k3-pack %s %s/lo --ram 1K", pk, t), 6);
    CHECK_EQ_INT(count_lines(err), 1);
    free(err);
}
