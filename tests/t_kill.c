/*
 * t_kill.c - crash safety of the writers (Hardening item 4): k3-synth,
 * k3-convert and k3-pack are killed with SIGKILL at many points of a run on
 * a tiny checkpoint, and after every kill:
 *
 *   - DST is absent, or it is complete and byte-identical to an
 *     uninterrupted run (every file, compared with diff -r);
 *   - a DST with manifest.json always passes k3-verify (never a manifest
 *     whose files do not match it);
 *   - k3-run refuses whatever half model is there, before any token;
 *   - then --resume (k3-convert, k3-pack) or a plain rerun with --force
 *     (k3-synth, which has no --resume) completes to byte-identical output.
 *
 * Kill points are of two sorts: every stop point the tools' test hooks offer
 * (K3_CONVERT_CRASH, K3_PACK_CRASH: SIGKILL raised at a named step), and
 * SIGKILL after a delay drawn from a seeded generator across the measured
 * length of a run (fork, sleep, kill, reap), which also lands between the named
 * steps. K3_KILL_POINTS=N sets the number of random points per tool (default
 * 6; try 200 by hand), K3_KILL_SEED the seed (default 1).
 */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "k3_test.h"

#define RUN_IDS "--ids 5,9,2,7 --gen 2 --threads 1"

static uint64_t rng_state;

static uint64_t rng_next(void)
{
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static unsigned long env_ul(const char *name, unsigned long def, unsigned long max)
{
    const char *v = getenv(name);
    if (!v || !*v)
        return def;
    char *end;
    unsigned long x = strtoul(v, &end, 10);
    if (*end || x > max) {
        k3t_fail(__FILE__, __LINE__, "%s=%s: want a number up to %lu", name, v, max);
        return def;
    }
    return x;
}

static void rng_seed(void) { rng_state = env_ul("K3_KILL_SEED", 1, ~0ul); }

static int npoints(void) { return (int)env_ul("K3_KILL_POINTS", 6, 100000); }

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int exists(const char *path)
{
    struct stat st;
    return stat(path, &st) == 0;
}

static void join(char *out, const char *dir, const char *name)
{
    if (snprintf(out, 4096, "%s/%s", dir, name) >= 4096)
        k3t_fail(__FILE__, __LINE__, "path too long: %s/%s", dir, name);
}

/* a and b hold the same files with the same bytes */
static void same_tree(const char *what, const char *a, const char *b)
{
    char *out = NULL;
    int st = k3t_runf(&out, NULL, "diff -r %s %s", a, b);
    if (st != 0)
        fprintf(stderr, "  %s: %s and %s differ:\n%s\n", what, a, b, out ? out : "");
    CHECK_EQ_INT(st, 0);
    free(out);
}

/* What a kill may leave at dst, for a packed model: nothing, an incomplete
 * directory without manifest.json (which k3-verify and k3-run refuse), or
 * the complete model (then identical to ref). Returns 1 if complete. */
static int check_packed_after_kill(const char *what, const char *dst, const char *ref)
{
    char man[4096], *out = NULL, *err = NULL;
    join(man, dst, "manifest.json");
    char journal[4096];
    join(journal, dst, ".k3-convert-journal");
    if (exists(man) && exists(journal)) {
        /* k3-convert publishes manifest.json, then removes its journal: a
         * kill in between leaves the finished files with the journal
         * (manifests/FORMAT.md). k3-verify must say so - and only that -
         * and --resume removes the journal. */
        int st = k3t_runf(&out, NULL, "k3-verify %s", dst);
        if (st != 1 || !out || !strstr(out, "the journal of an unfinished k3-convert") ||
            !strstr(out, ": 1 problem(s) found"))
            fprintf(stderr, "  %s: %s has manifest.json and the journal; k3-verify says (%d):\n%s\n", what, dst, st,
                    out ? out : "");
        CHECK_EQ_INT(st, 1);
        CHECK(out && strstr(out, "the journal of an unfinished k3-convert") && strstr(out, ": 1 problem(s) found"));
        free(out);
        out = NULL;
        CHECK_EQ_INT(k3t_runf(&out, NULL, "diff -r -x .k3-convert-journal %s %s", dst, ref), 0);
        free(out);
        return 0;
    }
    if (exists(man)) {
        int st = k3t_runf(&out, NULL, "k3-verify %s", dst);
        if (st != 0)
            fprintf(stderr, "  %s: %s has manifest.json but k3-verify says:\n%s\n", what, dst, out ? out : "");
        CHECK_EQ_INT(st, 0);
        free(out);
        same_tree(what, dst, ref);
        return 1;
    }
    if (!exists(dst))
        return 0;
    int st = k3t_runf(&out, NULL, "k3-verify --quiet %s", dst);
    if (st == 0)
        fprintf(stderr, "  %s: k3-verify accepts the incomplete %s\n", what, dst);
    CHECK(st != 0);
    free(out);
    out = NULL;
    st = k3t_runf(&out, &err, "k3-run %s " RUN_IDS, dst);
    if (st == 0 || (out && *out))
        fprintf(stderr, "  %s: k3-run ran the incomplete %s: status %d, stdout \"%s\"\n", what, dst, st,
                out ? out : "");
    CHECK(st != 0);
    CHECK(!out || !*out);
    free(out);
    free(err);
    return 0;
}

/* Run cmd once without a kill and return its wall time. */
static double timed(const char *cmd)
{
    double t0 = now_s();
    char *err = NULL;
    int st = k3t_runf(NULL, &err, "%s", cmd);
    if (st != 0)
        fprintf(stderr, "  %s: %s\n", cmd, err ? err : "");
    CHECK_EQ_INT(st, 0);
    free(err);
    return now_s() - t0;
}

/* Run cmd under SIGKILL after delay seconds; returns the status (137:
 * killed). The process is reaped before this returns (timeout(1) would
 * signal its whole group and may return before the tool is gone, while it
 * still holds its lock), and the shell execs the tool so the signal reaches
 * it directly. */
static int killed_after(double delay, const char *cmd)
{
    char *full = NULL;
    CHECK(asprintf(&full, "exec %s", cmd) > 0);
    fflush(NULL);
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        int fd = open("/dev/null", O_RDWR);
        if (fd >= 0) {
            dup2(fd, 0);
            dup2(fd, 1);
            dup2(fd, 2);
        }
        execl("/bin/sh", "sh", "-c", full, (char *)NULL);
        _exit(127);
    }
    struct timespec ts = {(time_t)delay, (long)((delay - (double)(time_t)delay) * 1e9)};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
    kill(pid, SIGKILL);
    int status = 0;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    free(full);
    int st = WIFSIGNALED(status) ? 128 + WTERMSIG(status) : WEXITSTATUS(status);
    if (st != 0 && st != 137) {
        fprintf(stderr, "  after %.4f s: %s: status %d\n", delay, cmd, st);
        CHECK(st == 0 || st == 137);
    }
    return st;
}

static void fixture(char *up, char *pk, char *pf)
{
    const char *t = k3t_tmpdir();
    join(up, t, "up");
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-synth %s --preset tiny --quiet", up), 0);
    if (pk) {
        join(pk, t, "pk");
        CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-convert --quiet %s %s", up, pk), 0);
    }
    if (pf) {
        join(pf, t, "pf");
        CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-pack --quiet --ram floor %s %s", pk, pf), 0);
    }
    /* the references are made by the same binaries: they must at least be
     * what k3-verify accepts (no stray file, every hash and CRC right) */
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-verify --quiet %s", up), 0);
    if (pk)
        CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-verify --quiet %s", pk), 0);
    if (pf)
        CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-verify --quiet %s", pf), 0);
}

static int count_lines(const char *cmd)
{
    char *out = NULL;
    CHECK_EQ_INT(k3t_runf(&out, NULL, "%s", cmd), 0);
    int n = 0;
    for (const char *p = out; p && *p; p++)
        n += *p == '\n';
    free(out);
    return n;
}

/* ------------------------------------------------------------ k3-synth */

K3_TEST_TIMEOUT(kill_synth_leaves_nothing_or_the_whole_checkpoint, 300)
{
    rng_seed();
    char up[4096], dst[4096], cmd[8800];
    fixture(up, NULL, NULL);
    join(dst, k3t_tmpdir(), "s");
    snprintf(cmd, sizeof cmd, "k3-synth %s --preset tiny --quiet --force", dst);
    double t = timed(cmd);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "rm -rf %s", dst), 0);
    int n = npoints();
    for (int i = 0; i < n; i++) {
        double d = t * 1.1 * (double)(rng_next() >> 11) / 9007199254740992.0;
        char what[128];
        snprintf(what, sizeof what, "k3-synth killed after %.4f s", d);
        int st = killed_after(d, cmd);
        if (exists(dst))
            same_tree(what, dst, up); /* published means complete */
        CHECK(st == 137 || exists(dst));
        /* no --resume: a rerun replaces whatever is left */
        CHECK_EQ_INT(k3t_runf(NULL, NULL, "%s", cmd), 0);
        same_tree(what, dst, up);
        CHECK_EQ_INT(k3t_runf(NULL, NULL, "rm -rf %s %s.k3-synth-tmp", dst, dst), 0);
    }
}

/* ------------------------------------------------------------ k3-convert */

/* Kill k3-convert (at hook, or after delay seconds), check what is left;
 * if delay2 >= 0 kill the first --resume after delay2 seconds too and check
 * again; then --resume to the end. */
static void convert_point(const char *up, const char *pk, const char *dst, const char *what, const char *hook,
                          double delay, double delay2)
{
    char cmd[8800];
    snprintf(cmd, sizeof cmd, "env K3_CONVERT_CRASH=%s k3-convert --quiet %s %s", hook, up, dst);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "rm -rf %s", dst), 0);
    int st;
    if (delay >= 0) {
        st = killed_after(delay, cmd);
    } else {
        st = k3t_runf(NULL, NULL, "%s", cmd);
        if (st != 137)
            fprintf(stderr, "  %s: the hook did not fire (status %d)\n", what, st);
        CHECK_EQ_INT(st, 137);
    }
    check_packed_after_kill(what, dst, pk);
    if (delay2 >= 0) {
        char what2[256];
        snprintf(what2, sizeof what2, "%s, its --resume killed after %.4f s", what, delay2);
        snprintf(cmd, sizeof cmd, "k3-convert --quiet --resume %s %s", up, dst);
        killed_after(delay2, cmd);
        check_packed_after_kill(what2, dst, pk);
    }
    char *err = NULL;
    st = k3t_runf(NULL, &err, "k3-convert --quiet --resume %s %s", up, dst);
    if (st != 0)
        fprintf(stderr, "  %s: --resume: %s\n", what, err ? err : "");
    CHECK_EQ_INT(st, 0);
    free(err);
    same_tree(what, dst, pk);
}

K3_TEST_TIMEOUT(kill_convert_at_every_step_then_resume_is_byte_identical, 300)
{
    char up[4096], pk[4096], dst[4096];
    fixture(up, pk, NULL);
    join(dst, k3t_tmpdir(), "c");
    char cmd[8800];
    snprintf(cmd, sizeof cmd, "ls %s/*.safetensors", up);
    int groups = count_lines(cmd);
    CHECK(groups >= 2);
    static const char *stages[3] = {"chunk", "published", "journaled"};
    for (int s = 0; s < 3; s++)
        for (int g = 0; g < groups; g++) {
            char hook[64], what[128];
            snprintf(hook, sizeof hook, "%s:%d", stages[s], g);
            snprintf(what, sizeof what, "k3-convert killed at %s", hook);
            convert_point(up, pk, dst, what, hook, -1, -1);
        }
    convert_point(up, pk, dst, "k3-convert killed at index", "index:0", -1, -1);
}

K3_TEST_TIMEOUT(kill_convert_at_random_times_then_resume_is_byte_identical, 300)
{
    rng_seed();
    char up[4096], pk[4096], dst[4096], cmd[8800];
    fixture(up, pk, NULL);
    join(dst, k3t_tmpdir(), "c");
    snprintf(cmd, sizeof cmd, "k3-convert --quiet --force %s %s", up, dst);
    double t = timed(cmd);
    int n = npoints();
    for (int i = 0; i < n; i++) {
        double d = t * 1.1 * (double)(rng_next() >> 11) / 9007199254740992.0;
        char what[128];
        snprintf(what, sizeof what, "k3-convert killed after %.4f s (of %.4f)", d, t);
        /* every other point also kills the first --resume */
        double d2 = i % 2 ? t * (double)(rng_next() >> 11) / 9007199254740992.0 : -1;
        convert_point(up, pk, dst, what, "none", d, d2);
    }
}

/* ------------------------------------------------------------ k3-pack */

/* As convert_point, for k3-pack. */
static void pack_point(const char *pk, const char *pf, const char *dst, const char *what, const char *hook,
                       double delay, double delay2)
{
    char cmd[8800];
    snprintf(cmd, sizeof cmd, "env K3_PACK_CRASH=%s k3-pack --quiet --ram floor %s %s", hook, pk, dst);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "rm -rf %s %s.k3-pack-tmp", dst, dst), 0);
    int st;
    if (delay >= 0) {
        st = killed_after(delay, cmd);
    } else {
        st = k3t_runf(NULL, NULL, "%s", cmd);
        if (st != 137)
            fprintf(stderr, "  %s: the hook did not fire (status %d)\n", what, st);
        CHECK_EQ_INT(st, 137);
    }
    /* k3-pack builds in DST.k3-pack-tmp and renames: DST is whole or absent */
    if (check_packed_after_kill(what, dst, pf))
        return;
    CHECK(!exists(dst));
    if (delay2 >= 0) {
        char what2[256];
        snprintf(what2, sizeof what2, "%s, its --resume killed after %.4f s", what, delay2);
        snprintf(cmd, sizeof cmd, "k3-pack --quiet --resume --ram floor %s %s", pk, dst);
        killed_after(delay2, cmd);
        if (check_packed_after_kill(what2, dst, pf))
            return;
        CHECK(!exists(dst));
    }
    char *err = NULL;
    st = k3t_runf(NULL, &err, "k3-pack --quiet --resume --ram floor %s %s", pk, dst);
    if (st != 0)
        fprintf(stderr, "  %s: --resume: %s\n", what, err ? err : "");
    CHECK_EQ_INT(st, 0);
    free(err);
    same_tree(what, dst, pf);
    char tmp[4200];
    snprintf(tmp, sizeof tmp, "%s.k3-pack-tmp", dst);
    CHECK(!exists(tmp));
}

K3_TEST_TIMEOUT(kill_pack_at_every_step_then_resume_is_byte_identical, 300)
{
    rng_seed();
    char up[4096], pk[4096], pf[4096], dst[4096], cmd[8800];
    fixture(up, pk, pf);
    join(dst, k3t_tmpdir(), "p");
    /* output files in the journal's order = the manifest's files */
    snprintf(cmd, sizeof cmd, "ls %s", pf);
    int nfiles = count_lines(cmd) - 1; /* all but manifest.json */
    CHECK(nfiles >= 3);
    snprintf(cmd, sizeof cmd, "grep -o '\"unit\":' %s/manifest.json", pf);
    int pieces = count_lines(cmd);
    CHECK(pieces >= 2);
    char hook[64], what[128];
    for (int k = 0; k < 3; k++) {
        int piece = k == 0 ? 0 : k == 1 ? pieces - 1 : (int)(rng_next() % (uint64_t)pieces);
        snprintf(hook, sizeof hook, "trunk:%d", piece);
        snprintf(what, sizeof what, "k3-pack killed at %s", hook);
        pack_point(pk, pf, dst, what, hook, -1, -1);
    }
    static const char *stages[2] = {"file", "journaled"};
    for (int s = 0; s < 2; s++)
        for (int f = 0; f < nfiles; f++) {
            snprintf(hook, sizeof hook, "%s:%d", stages[s], f);
            snprintf(what, sizeof what, "k3-pack killed at %s", hook);
            pack_point(pk, pf, dst, what, hook, -1, -1);
        }
    pack_point(pk, pf, dst, "k3-pack killed at manifest", "manifest:0", -1, -1);
    pack_point(pk, pf, dst, "k3-pack killed at renaming", "renaming:0", -1, -1);
}

K3_TEST_TIMEOUT(kill_pack_at_random_times_then_resume_is_byte_identical, 300)
{
    rng_seed();
    char up[4096], pk[4096], pf[4096], dst[4096], cmd[8800];
    fixture(up, pk, pf);
    join(dst, k3t_tmpdir(), "p");
    snprintf(cmd, sizeof cmd, "k3-pack --quiet --force --ram floor %s %s", pk, dst);
    double t = timed(cmd);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "rm -rf %s", dst), 0);
    int n = npoints();
    for (int i = 0; i < n; i++) {
        double d = t * 1.1 * (double)(rng_next() >> 11) / 9007199254740992.0;
        char what[128];
        snprintf(what, sizeof what, "k3-pack killed after %.4f s (of %.4f)", d, t);
        double d2 = i % 2 ? t * (double)(rng_next() >> 11) / 9007199254740992.0 : -1;
        pack_point(pk, pf, dst, what, "none", d, d2);
    }
}

/* A kill inside the removal of the journal (after manifest.json is in the
 * temporary, before the rename): the journal's "plan" may already be gone
 * while other entries are still there. Simulated exactly: stop at the
 * "manifest" hook, then remove "plan" first. --resume must still publish
 * exactly the uninterrupted output, without the journal's remains. */
K3_TEST_TIMEOUT(kill_pack_inside_the_journal_removal_then_resume_is_byte_identical, 120)
{
    char up[4096], pk[4096], pf[4096], dst[4096];
    fixture(up, pk, pf);
    join(dst, k3t_tmpdir(), "p");
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "K3_PACK_CRASH=manifest:0 k3-pack --quiet --ram floor %s %s", pk, dst), 137);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "rm %s.k3-pack-tmp/.k3-pack-journal/plan", dst), 0);
    char *err = NULL;
    int st = k3t_runf(NULL, &err, "k3-pack --quiet --resume --ram floor %s %s", pk, dst);
    if (st != 0)
        fprintf(stderr, "  --resume: %s\n", err ? err : "");
    CHECK_EQ_INT(st, 0);
    free(err);
    CHECK(check_packed_after_kill("k3-pack --resume after a kill inside the journal removal", dst, pf));
}

/* k3-convert killed after manifest.json is published, before or while its
 * journal is removed. Simulated exactly: stop at the "index" hook (all data
 * and the whole journal written), then publish the manifest an
 * uninterrupted run writes; and the same with the journal's plan.json
 * already removed. k3-verify names the journal, --resume finishes. */
K3_TEST_TIMEOUT(kill_convert_while_removing_the_journal_then_resume_is_byte_identical, 120)
{
    char up[4096], pk[4096], dst[4096];
    fixture(up, pk, NULL);
    join(dst, k3t_tmpdir(), "c");
    for (int partial = 0; partial < 2; partial++) {
        CHECK_EQ_INT(k3t_runf(NULL, NULL, "rm -rf %s", dst), 0);
        CHECK_EQ_INT(k3t_runf(NULL, NULL, "K3_CONVERT_CRASH=index:0 k3-convert --quiet %s %s", up, dst), 137);
        CHECK_EQ_INT(k3t_runf(NULL, NULL, "cp %s/manifest.json %s/", pk, dst), 0);
        if (partial)
            CHECK_EQ_INT(k3t_runf(NULL, NULL, "rm %s/.k3-convert-journal/plan.json", dst), 0);
        const char *what = partial ? "k3-convert killed inside the journal removal"
                                   : "k3-convert killed after the manifest, before the journal removal";
        CHECK_EQ_INT(check_packed_after_kill(what, dst, pk), 0);
        char *err = NULL;
        int st = k3t_runf(NULL, &err, "k3-convert --quiet --resume %s %s", up, dst);
        if (st != 0)
            fprintf(stderr, "  %s: --resume: %s\n", what, err ? err : "");
        CHECK_EQ_INT(st, 0);
        free(err);
        same_tree(what, dst, pk);
    }
}

/* ------------------------------------------------------------ inside the trunk */

/* trunk_bytes_kept from k3-pack --json output */
static long long json_kept(const char *out)
{
    const char *k = out ? strstr(out, "\"trunk_bytes_kept\": ") : NULL;
    return k ? atoll(k + strlen("\"trunk_bytes_kept\": ")) : -1;
}

/* k3-pack journals the trunk file per unit: killed inside the trunk (after
 * unit U's checkpoint, or between checkpoints), --resume keeps every
 * finished unit (trunk_bytes_kept grows with U) and the result is
 * byte-identical. Whatever the killed run wrote past the checkpoint -
 * here overwritten with junk, as a torn write might leave it - is not
 * taken; a checkpoint that does not hash to its seal is not taken either
 * (nothing kept, still identical). */
K3_TEST_TIMEOUT(kill_pack_inside_the_trunk_keeps_finished_units, 300)
{
    char up[4096], pk[4096], ref[4096], dst[4096], tmpd[4200], part[4400];
    fixture(up, pk, NULL);
    const char *t = k3t_tmpdir();
    join(ref, t, "ref");
    join(dst, t, "p");
    snprintf(tmpd, sizeof tmpd, "%s.k3-pack-tmp", dst);
    snprintf(part, sizeof part, "%s/.k3-pack-journal/trunk-0000.k3t.part.json", tmpd);
    const char *opts = "--quiet --ram floor --unit-bytes 65536";
    char cmd[8800], *rout = NULL;
    CHECK_EQ_INT(k3t_runf(&rout, NULL, "k3-pack --json %s %s %s", opts, pk, ref), 0);
    const char *un = rout ? strstr(rout, "\"units\": ") : NULL;
    int units = un ? atoi(un + strlen("\"units\": ")) : 0;
    free(rout);
    CHECK(units >= 8);
    int at[3] = {0, units / 2, units - 2};
    long long last = 0;
    for (int k = 0; k < 3; k++) {
        for (int mode = 0; mode < 3; mode++) {
            char what[160], *out = NULL, *err = NULL;
            snprintf(what, sizeof what, "k3-pack killed after trunk unit %d%s", at[k],
                     mode == 1 ? ", junk past the checkpoint" : mode == 2 ? ", checkpoint tampered" : "");
            CHECK_EQ_INT(k3t_runf(NULL, NULL, "rm -rf %s %s", dst, tmpd), 0);
            CHECK_EQ_INT(k3t_runf(NULL, NULL, "K3_PACK_CRASH=unit:%d k3-pack %s %s %s", at[k], opts, pk, dst), 137);
            CHECK(!exists(dst));
            CHECK(exists(part));
            if (mode == 1) {
                /* junk from the checkpoint's frontier to the end of the temporary */
                CHECK_EQ_INT(k3t_runf(NULL, NULL,
                                      "f=$(grep -o '\"frontier\":[0-9]*' %s | cut -d: -f2) && "
                                      "s=$(stat -c %%s %s/trunk-0000.k3t.tmp) && "
                                      "head -c $((s - f)) /dev/urandom | dd of=%s/trunk-0000.k3t.tmp bs=4096 "
                                      "oflag=seek_bytes seek=$f conv=notrunc status=none",
                                      part, tmpd, tmpd),
                             0);
            } else if (mode == 2) {
                CHECK_EQ_INT(k3t_runf(NULL, NULL, "sed -i 's/\"frontier\":/\"frontier\": /' %s", part), 0);
            }
            int st = k3t_runf(&out, &err, "k3-pack --json %s --resume %s %s", opts, pk, dst);
            if (st != 0)
                fprintf(stderr, "  %s: --resume: %s\n", what, err ? err : "");
            CHECK_EQ_INT(st, 0);
            long long kept = json_kept(out);
            if (mode == 2) {
                CHECK_EQ_INT(kept, 0);
            } else {
                if (kept <= last)
                    fprintf(stderr, "  %s: %lld trunk bytes kept (after the previous unit: %lld)\n", what, kept, last);
                CHECK(kept > last);
            }
            free(out);
            free(err);
            same_tree(what, dst, ref);
            CHECK(!exists(tmpd));
        }
        snprintf(cmd, sizeof cmd, "K3_PACK_CRASH=unit:%d k3-pack %s --json %s %s", at[k], opts, pk, dst);
        char *out = NULL;
        CHECK_EQ_INT(k3t_runf(NULL, NULL, "rm -rf %s %s && %s", dst, tmpd, cmd), 137);
        CHECK_EQ_INT(k3t_runf(&out, NULL, "k3-pack --json %s --resume %s %s", opts, pk, dst), 0);
        last = json_kept(out);
        free(out);
    }
    /* killed between two checkpoints, then its --resume killed later in the
     * trunk, then resumed to the end */
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "rm -rf %s %s", dst, tmpd), 0);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "K3_PACK_CRASH=trunk:%d k3-pack %s %s %s", units + 1, opts, pk, dst), 137);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "K3_PACK_CRASH=unit:%d k3-pack %s --resume %s %s", units - 3, opts, pk, dst), 137);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-pack %s --resume %s %s", opts, pk, dst), 0);
    same_tree("k3-pack killed twice inside the trunk", dst, ref);
}
