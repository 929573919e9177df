/*
 * t_outputs.c - the disk-full matrix: every tool, every output it has
 * (stdout text, --json, --help, --version, --trace, --logits,
 * --logits-all) pointed at /dev/full must end with exit 8 and exactly one
 * line "k3-TOOL: error: ... No space left on device" on stderr, never exit 0.
 * Files written as a stream (--trace) and stdout redirected into a file are
 * also run on a tiny tmpfs (private mount namespace; skipped where mounting
 * is not allowed; t_diskfull.c does the same for the model files): exit 8,
 * one line, and no file or temporary left that looks complete.
 * Then the other ways an output can go: a closed stdout (exit 4, and a
 * generation of 10^6 tokens must stop at once), a pipe whose reader left
 * (SIGPIPE ignored: exit 4 "Broken pipe"; default: killed by SIGPIPE at
 * once), and an output path that is a device (never renamed over).
 *
 * Rows that cannot happen for a tool: k3-synth, k3-convert and k3-pack
 * have no --trace/--logits; k3-verify writes no file at all.
 */
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "k3_test.h"

static int count_lines(const char *s)
{
    int n = 0;
    for (; s && *s; s++)
        n += *s == '\n';
    return n;
}

/* One shared fixture per test: a tiny upstream checkpoint and its packing. */
static void fixture(char *up, char *pk, size_t cap)
{
    snprintf(up, cap, "%s/up", k3t_tmpdir());
    snprintf(pk, cap, "%s/pk", k3t_tmpdir());
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-synth %s --preset tiny --seed 1 --quiet", up), 0);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-convert --quiet %s %s", up, pk), 0);
}

/* cmd (a shell command line) must fail with `want` and one error line of
 * tool containing `reason`. */
static void expect_fail(const char *cmd, const char *tool, int want, const char *reason)
{
    char *out = NULL, *err = NULL;
    int rc = k3t_runf(&out, &err, "%s", cmd);
    char prefix[64];
    snprintf(prefix, sizeof prefix, "%s: error: ", tool);
    if (rc != want || !err || !strstr(err, prefix) || !strstr(err, reason) || count_lines(err) != 1)
        k3t_fail(__FILE__, __LINE__, "%s: want exit %d and one line \"%s...%s\", got exit %d, stderr:\n%s", cmd,
                 want, prefix, reason, rc, err ? err : "");
    free(out);
    free(err);
}

#define FULL(cmd, tool) expect_fail(cmd, tool, 8, "No space left on device")

K3_TEST(outputs_every_tool_to_dev_full_exits_8_with_one_line)
{
    char up[4096], pk[4096], c[9000];
    fixture(up, pk, sizeof up);
    const char *t = k3t_tmpdir();
    const char *tools[] = {"k3-synth", "k3-convert", "k3-pack", "k3-verify", "k3-run"};
    for (int i = 0; i < 5; i++) {
        snprintf(c, sizeof c, "%s --help > /dev/full", tools[i]);
        FULL(c, tools[i]);
        snprintf(c, sizeof c, "%s --version > /dev/full", tools[i]);
        FULL(c, tools[i]);
    }
    /* k3-synth: the summary line and --json */
    snprintf(c, sizeof c, "k3-synth %s/s1 --preset tiny > /dev/full 2>/dev/null; k3-synth %s/s2 --preset tiny --quiet "
             "--json > /dev/full", t, t);
    FULL(c, "k3-synth");
    /* k3-convert --json, k3-pack --json and --plan */
    snprintf(c, sizeof c, "k3-convert --quiet --json %s %s/c1 > /dev/full", up, t);
    FULL(c, "k3-convert");
    snprintf(c, sizeof c, "k3-pack --quiet --json %s %s/p1 > /dev/full", pk, t);
    FULL(c, "k3-pack");
    snprintf(c, sizeof c, "k3-pack %s --plan --ram floor > /dev/full", pk);
    FULL(c, "k3-pack");
    /* k3-verify: the report of both kinds, quick and full */
    snprintf(c, sizeof c, "k3-verify %s > /dev/full", pk);
    FULL(c, "k3-verify");
    snprintf(c, sizeof c, "k3-verify --quick %s > /dev/full", up);
    FULL(c, "k3-verify");
    /* k3-run: ids, text, --json, the tokenizer modes, --trace, --logits* */
    snprintf(c, sizeof c, "k3-run %s --ids 1,2,3 --gen 4 > /dev/full", pk);
    FULL(c, "k3-run");
    snprintf(c, sizeof c, "k3-run %s --prompt hello --gen 4 > /dev/full", up);
    FULL(c, "k3-run");
    snprintf(c, sizeof c, "k3-run %s --prompt hello --gen 4 --json > /dev/full", up);
    FULL(c, "k3-run");
    snprintf(c, sizeof c, "k3-run --tokenize --prompt hello --tok %s > /dev/full", up);
    FULL(c, "k3-run");
    snprintf(c, sizeof c, "k3-run --detokenize --ids 300,301 --tok %s > /dev/full", up);
    FULL(c, "k3-run");
    snprintf(c, sizeof c, "k3-run %s --ids 1,2,3 --gen 4 --ram floor --trace /dev/full > /dev/null 2>%s/e; "
             "r=$?; grep error: %s/e >&2; exit $r", pk, t, t);
    FULL(c, "k3-run");
    snprintf(c, sizeof c, "k3-run %s --ids 1,2,3 --gen 1 --logits /dev/full > /dev/null", up);
    FULL(c, "k3-run");
    snprintf(c, sizeof c, "k3-run %s --ids 1,2,3 --gen 0 --logits-all /dev/full > /dev/null", up);
    FULL(c, "k3-run");
    /* /dev/full is still the device: an output path that is not a regular
     * file is written in place, never renamed over */
    struct stat st;
    CHECK_EQ_INT(stat("/dev/full", &st), 0);
    CHECK(S_ISCHR(st.st_mode));
}

/* 1 if a size-limited tmpfs can be mounted in a private namespace here. */
static int can_mount(const char *mnt)
{
    int rc = k3t_runf(NULL, NULL, "unshare -m sh -c 'mount -t tmpfs -o size=64k k3-full %s'", mnt);
    if (rc != 0)
        fprintf(stderr, "  (skipped: cannot mount a tmpfs in a private namespace here; needs root)\n");
    return rc == 0;
}

/* Run cmd in a private namespace with a tmpfs of kb KiB at mnt (cd'ed
 * into); it must exit 8 with one error line, and none of the names in
 * gone (NULL-terminated) may exist afterwards, nor any *.tmp. */
static void on_small_disk(const char *mnt, unsigned kb, const char *cmd, const char *tool, const char *const *gone)
{
    char *out = NULL, *err = NULL;
    int rc = k3t_runf(&out, &err,
                      "unshare -m sh -c 'mount -t tmpfs -o size=%uk k3-full %s || exit 99; cd %s; %s; "
                      "r=$?; ls -A; exit $r'",
                      kb, mnt, mnt, cmd);
    char prefix[64];
    snprintf(prefix, sizeof prefix, "%s: error: ", tool);
    if (rc != 8 || !strstr(err, prefix) || !strstr(err, "No space left on device") || count_lines(err) != 1)
        k3t_fail(__FILE__, __LINE__, "%s on a %u KiB disk: want exit 8 and one line, got %d:\n%s", cmd, kb, rc, err);
    if (strstr(out, ".tmp"))
        k3t_fail(__FILE__, __LINE__, "%s on a %u KiB disk left a temporary:\n%s", cmd, kb, out);
    for (const char *const *g = gone; g && *g; g++) {
        char line[256], *hay = NULL;
        snprintf(line, sizeof line, "\n%s\n", *g);
        CHECK(asprintf(&hay, "\n%s", out) > 0);
        int left = strstr(hay, line) != NULL;
        free(hay);
        if (left)
            k3t_fail(__FILE__, __LINE__, "%s on a %u KiB disk left %s:\n%s", cmd, kb, *g, out);
    }
    free(out);
    free(err);
}

K3_TEST(outputs_on_a_small_disk_exit_8_and_leave_nothing_complete)
{
    char up[4096], pk[4096], mnt[4096], c[9000];
    fixture(up, pk, sizeof up);
    snprintf(mnt, sizeof mnt, "%s/mnt", k3t_tmpdir());
    CHECK_EQ_INT(mkdir(mnt, 0755), 0);
    if (!can_mount(mnt))
        return;
    /* the trace of 40 tokens is well over 8 KiB */
    static const char *const trace[] = {"t.txt", NULL};
    snprintf(c, sizeof c, "k3-run %s --ids 1,2,3 --gen 40 --ram floor --trace t.txt >/dev/null 2>e.log; r=$?; "
             "grep error: e.log >&2; rm e.log; exit $r", pk);
    on_small_disk(mnt, 4, c, "k3-run", trace);
    on_small_disk(mnt, 8, c, "k3-run", trace);
    /* ids streamed into a file on a full disk (no tokenizer, so no
     * end-of-sequence stops it early): the run stops with exit 8 */
    char bare[4200];
    snprintf(bare, sizeof bare, "%s/bare", k3t_tmpdir());
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-synth %s --preset tiny --seed 1 --quiet --no-tokenizer", bare), 0);
    snprintf(c, sizeof c, "k3-run %s --ids 1 --gen 3000 > out.txt; r=$?; rm out.txt; exit $r", bare);
    on_small_disk(mnt, 4, c, "k3-run", NULL);
    snprintf(c, sizeof c, "k3-run %s --ids 1 --gen 3000 --json > out.json; r=$?; rm out.json; exit $r", bare);
    on_small_disk(mnt, 4, c, "k3-run", NULL);
}

K3_TEST(outputs_closed_stdout_stops_generation_with_exit_4)
{
    char up[4096], pk[4096], c[9000];
    fixture(up, pk, sizeof up);
    /* 10^6 tokens would take hours: the run must stop at the first one */
    snprintf(c, sizeof c, "k3-run %s --ids 1,2 --gen 1000000 >&-", up);
    expect_fail(c, "k3-run", 4, "stdout: write failed: Bad file descriptor");
    snprintf(c, sizeof c, "k3-run %s --prompt hello --gen 1000000 >&-", up);
    expect_fail(c, "k3-run", 4, "stdout: write failed");
    snprintf(c, sizeof c, "k3-verify %s >&-", pk);
    expect_fail(c, "k3-verify", 4, "stdout: write failed");
    snprintf(c, sizeof c, "k3-pack --help >&-");
    expect_fail(c, "k3-pack", 4, "stdout: write failed");
    /* a closed stdout never becomes a file the tool writes */
    snprintf(c, sizeof c, "k3-run %s --ids 1,2 --gen 2 --logits %s/l.bin >&-", up, k3t_tmpdir());
    expect_fail(c, "k3-run", 4, "stdout: write failed");
}

K3_TEST(outputs_a_reader_that_left_stops_generation)
{
    char up[4096], pk[4096], c[9000];
    fixture(up, pk, sizeof up);
    /* SIGPIPE ignored by the caller: EPIPE, exit 4, one line */
    snprintf(c, sizeof c, "trap '' PIPE; k3-run %s --ids 1,2 --gen 1000000 2>%s/e | head -c 1 >/dev/null; "
             "cat %s/e >&2; exit 0", up, k3t_tmpdir(), k3t_tmpdir());
    char *err = NULL;
    CHECK_EQ_INT(k3t_runf(NULL, &err, "%s", c), 0);
    CHECK_STR_CONTAINS(err, "k3-run: error: stdout: write failed: Broken pipe");
    CHECK_EQ_INT(count_lines(err), 1);
    free(err);
    /* default SIGPIPE: killed by it, at once (the test's timeout is the bound) */
    snprintf(c, sizeof c, "k3-run %s --ids 1,2 --gen 1000000 | head -c 1 >/dev/null", up);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "%s", c), 0);
}
