/*
 * t_diskfull.c - the tools that write (k3-synth, k3-convert, k3-pack) on a
 * full disk: they must stop with exit 8 and a one-line "... No space left on
 * device" error, leave no *.tmp file behind, and leave nothing that looks
 * complete (no manifest.json, no DST directory for k3-synth, which publishes
 * its directory in one rename).
 *
 * k3-run writes only with --logits / --logits-all: same contract.
 *
 * The full disk is a tmpfs with a size limit, mounted inside a private mount
 * namespace (unshare -m), so it disappears with the test and the host never
 * sees it. That needs root (CAP_SYS_ADMIN); where mounting is not permitted
 * the tests say "skipped" on stderr and pass. RLIMIT_FSIZE is not a substitute:
 * it raises SIGXFSZ / EFBIG, not ENOSPC, so it would test a different path.
 *
 * Each tool is run against several limits (one page, then about 1/4, 1/2 and
 * 9/10 of what the job writes), so the failure lands in the first file, in
 * the middle of a shard and near the final publish.
 */
#include "k3_test.h"

#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

static int have_tool(const char *name)
{
    char p[4096];
    snprintf(p, sizeof p, "%s/%s", k3t_bindir(), name);
    return access(p, X_OK) == 0;
}

/* 1 if a size-limited tmpfs can be mounted in a private namespace here. */
static int can_mount(const char *mnt)
{
    int rc = k3t_runf(NULL, NULL, "unshare -m sh -c 'mount -t tmpfs -o size=64k k3-diskfull %s'", mnt);
    if (rc != 0)
        fprintf(stderr, "  (skipped: cannot mount a tmpfs in a private namespace here; needs root)\n");
    return rc == 0;
}

/* Bytes a command writes into a directory, measured on the real disk. */
static uint64_t du_bytes(const char *dir)
{
    char *out = NULL;
    CHECK_EQ_INT(k3t_runf(&out, NULL, "du -sk --apparent-size %s | cut -f1", dir), 0);
    uint64_t kb = strtoull(out, NULL, 10);
    free(out);
    return kb * 1024;
}

/*
 * Run `cmd` (which writes under MNT, spelled literally "MNT" in it) with a
 * tmpfs of limit_kb mounted at mnt. Checks the disk-full contract and that no
 * temporary or complete-looking output is left. forbidden lists names that
 * must not exist in the mount afterwards (NULL-terminated).
 */
static void run_full(const char *tool, const char *mnt, const char *cmd, uint64_t limit_kb,
                     const char *const *forbidden)
{
    char *out = NULL, *err = NULL;
    char *script;
    CHECK(asprintf(&script,
                   "mount -t tmpfs -o size=%lluk k3-diskfull %s || exit 99\n"
                   "cd %s\n"
                   "%s\n"
                   "echo \"rc=$?\"\n"
                   "find . -mindepth 1 | sort\n",
                   (unsigned long long)limit_kb, mnt, mnt, cmd) > 0);
    char spath[4200];
    snprintf(spath, sizeof spath, "%s.sh", mnt);
    FILE *f = fopen(spath, "w");
    CHECK(f != NULL);
    fputs(script, f);
    fclose(f);
    free(script);
    CHECK_EQ_INT(k3t_runf(&out, &err, "unshare -m sh %s", spath), 0);
    char want[64];
    snprintf(want, sizeof want, "rc=%d\n", 8);
    if (!strstr(out, want))
        k3t_fail(__FILE__, __LINE__, "%s with a %llu KiB disk: want exit 8 (disk full), got %s; stderr: %s",
                 tool, (unsigned long long)limit_kb, out, err);
    char prefix[64];
    snprintf(prefix, sizeof prefix, "%s: error: ", tool);
    CHECK_STR_CONTAINS(err, prefix);
    CHECK_STR_CONTAINS(err, "No space left on device");
    /* exactly one line on stderr */
    CHECK(strchr(err, '\n') == err + strlen(err) - 1);
    const char *files = strchr(strstr(out, want), '\n') + 1;
    if (strstr(files, ".tmp\n") || strstr(files, ".tmp/"))
        k3t_fail(__FILE__, __LINE__, "%s with a %llu KiB disk left temporaries:\n%s", tool,
                 (unsigned long long)limit_kb, files);
    for (const char *const *p = forbidden; p && *p; p++) {
        char line[256];
        snprintf(line, sizeof line, "./%s\n", *p);
        if (strstr(files, line))
            k3t_fail(__FILE__, __LINE__, "%s with a %llu KiB disk left %s:\n%s", tool,
                     (unsigned long long)limit_kb, *p, files);
    }
    free(out);
    free(err);
}

static void limits_for(uint64_t total, uint64_t kb[4])
{
    uint64_t t = total / 1024;
    kb[0] = 4;
    kb[1] = t / 4;
    kb[2] = t / 2;
    kb[3] = t * 9 / 10;
}

K3_TEST(diskfull_synth_exits_8_and_leaves_nothing)
{
    if (!have_tool("k3-synth")) {
        fprintf(stderr, "  (skipped: no k3-synth)\n");
        return;
    }
    const char *tmp = k3t_tmpdir();
    char ref[4096], mnt[4096];
    snprintf(ref, sizeof ref, "%s/ref", tmp);
    snprintf(mnt, sizeof mnt, "%s/mnt", tmp);
    CHECK_EQ_INT(mkdir(mnt, 0755), 0);
    if (!can_mount(mnt))
        return;
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-synth %s --preset tiny --seed 1 --quiet", ref), 0);
    uint64_t kb[4];
    limits_for(du_bytes(ref), kb);
    static const char *const forbidden[] = {"out", NULL};
    for (int i = 0; i < 4; i++)
        run_full("k3-synth", mnt, "k3-synth out --preset tiny --seed 1 --quiet", kb[i], forbidden);
}

K3_TEST(diskfull_convert_exits_8_and_leaves_no_manifest_or_temporary)
{
    if (!have_tool("k3-synth") || !have_tool("k3-convert")) {
        fprintf(stderr, "  (skipped: no k3-convert)\n");
        return;
    }
    const char *tmp = k3t_tmpdir();
    char up[4096], ref[4096], mnt[4096], cmd[8400];
    snprintf(up, sizeof up, "%s/up", tmp);
    snprintf(ref, sizeof ref, "%s/ref", tmp);
    snprintf(mnt, sizeof mnt, "%s/mnt", tmp);
    CHECK_EQ_INT(mkdir(mnt, 0755), 0);
    if (!can_mount(mnt))
        return;
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-synth %s --preset tiny --seed 1 --quiet", up), 0);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-convert %s %s --quiet", up, ref), 0);
    uint64_t kb[4];
    limits_for(du_bytes(ref), kb);
    static const char *const forbidden[] = {"out/manifest.json", NULL};
    snprintf(cmd, sizeof cmd, "k3-convert %s out --quiet", up);
    for (int i = 0; i < 4; i++)
        run_full("k3-convert", mnt, cmd, kb[i], forbidden);
}

K3_TEST(diskfull_pack_exits_8_and_leaves_no_manifest_or_temporary)
{
    if (!have_tool("k3-synth") || !have_tool("k3-convert") || !have_tool("k3-pack")) {
        fprintf(stderr, "  (skipped: no k3-pack)\n");
        return;
    }
    const char *tmp = k3t_tmpdir();
    char up[4096], pk[4096], ref[4096], mnt[4096], cmd[8400];
    snprintf(up, sizeof up, "%s/up", tmp);
    snprintf(pk, sizeof pk, "%s/pk", tmp);
    snprintf(ref, sizeof ref, "%s/ref", tmp);
    snprintf(mnt, sizeof mnt, "%s/mnt", tmp);
    CHECK_EQ_INT(mkdir(mnt, 0755), 0);
    if (!can_mount(mnt))
        return;
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-synth %s --preset tiny --seed 1 --quiet", up), 0);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-convert %s %s --quiet", up, pk), 0);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-pack %s %s --quiet", pk, ref), 0);
    uint64_t kb[4];
    limits_for(du_bytes(ref), kb);
    static const char *const forbidden[] = {"out/manifest.json", NULL};
    snprintf(cmd, sizeof cmd, "k3-pack %s out --quiet", pk);
    for (int i = 0; i < 4; i++)
        run_full("k3-pack", mnt, cmd, kb[i], forbidden);
}

K3_TEST(diskfull_run_logits_file_exits_8_and_leaves_no_partial_file)
{
    if (!have_tool("k3-synth") || !have_tool("k3-run")) {
        fprintf(stderr, "  (skipped: no k3-run)\n");
        return;
    }
    const char *tmp = k3t_tmpdir();
    char up[4096], mnt[4096], cmd[8400];
    snprintf(up, sizeof up, "%s/up", tmp);
    snprintf(mnt, sizeof mnt, "%s/mnt", tmp);
    CHECK_EQ_INT(mkdir(mnt, 0755), 0);
    if (!can_mount(mnt))
        return;
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-synth %s --preset tiny --seed 1 --quiet", up), 0);
    /* 16 positions x the tiny vocabulary in float32: well over 8 KiB */
    snprintf(cmd, sizeof cmd,
             "k3-run %s --ids 1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16 --gen 1 --logits-all l.bin", up);
    static const char *const forbidden[] = {"l.bin", NULL};
    run_full("k3-run", mnt, cmd, 4, forbidden);
    run_full("k3-run", mnt, cmd, 8, forbidden);
}
