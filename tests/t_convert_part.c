/*
 * t_convert_part.c - k3-convert across machines: --part on three "machines"
 * (directories each holding some of the shards, the others as header
 * stand-ins from --export-headers), --merge, and the result cmp-equal, file
 * by file, to one k3-convert of the whole checkpoint; the refusals (a part
 * missing, a part twice, parts of different conversions, an unfinished
 * part, a shard needed but not here) and an interrupted merge continued.
 */
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "k3_test.h"

static char *path_in(const char *name)
{
    static char buf[8][4096];
    static int i;
    char *p = buf[i++ & 7];
    snprintf(p, 4096, "%s/%s", k3t_tmpdir(), name);
    return p;
}

static void run_ok(const char *cmd)
{
    char *err = NULL;
    int st = k3t_runf(NULL, &err, "%s", cmd);
    if (st != 0)
        k3t_fail(__FILE__, __LINE__, "%s: exit %d: %s", cmd, st, err ? err : "");
    free(err);
}

/* Shard i (1-based) of the checkpoint last counted by count_shards. */
static int nshards = 5;

static void count_shards(const char *src)
{
    char *out = NULL;
    CHECK_EQ_INT(k3t_runf(&out, NULL, "ls %s | grep -c 'safetensors$'", src), 0);
    nshards = out ? atoi(out) : 0;
    free(out);
    CHECK(nshards >= 4 && nshards <= 64);
}

static const char *shard(int i)
{
    static char b[64][64];
    snprintf(b[i - 1], sizeof b[0], "model-%05d-of-%05d.safetensors", i, nshards);
    return b[i - 1];
}

/* A machine: the small files of src, and hard links to the given shards. */
static void machine(const char *src, const char *dir, const int *shards, int n)
{
    char cmd[32768];
    int l = snprintf(cmd, sizeof cmd, "mkdir -p %s && cd %s && for f in config.json model.safetensors.index.json "
                                      "tiktoken.model tokenizer_config.json; do ln %s/$f .; done",
                     dir, dir, src);
    for (int i = 0; i < n; i++)
        l += snprintf(cmd + l, sizeof cmd - (size_t)l, " && ln %s/%s .", src, shard(shards[i]));
    run_ok(cmd);
}

/* Three parts of one checkpoint of n shards: machine 1 holds shards 1-2,
 * machine 2 shards 2-3 (2 only for the tensors of shard 3's units and
 * records that lie in it), machine 3 shards 3-n; they convert 1-2, 3 and
 * 4-n. */
static void three_parts(const char *src, const char *opts)
{
    char cmd[32768], list[4096] = "";
    static const int m1[] = {1, 2}, m2[] = {2, 3};
    int m3[64];
    count_shards(src);
    for (int i = 3; i <= nshards; i++)
        m3[i - 3] = i;
    for (int i = 4; i <= nshards; i++)
        snprintf(list + strlen(list), sizeof list - strlen(list), "%s%s", i > 4 ? "," : "", shard(i));
    machine(src, path_in("m1"), m1, 2);
    machine(src, path_in("m2"), m2, 2);
    machine(src, path_in("m3"), m3, nshards - 2);
    snprintf(cmd, sizeof cmd, "k3-convert --export-headers %s %s", src, path_in("hdrs"));
    run_ok(cmd);
    snprintf(cmd, sizeof cmd, "k3-convert --quiet %s --part %s,%s --headers %s %s %s", opts, shard(1), shard(2),
             path_in("hdrs"), path_in("m1"), path_in("p1"));
    run_ok(cmd);
    snprintf(cmd, sizeof cmd, "k3-convert --quiet %s --part %s --headers %s %s %s", opts, shard(3), path_in("hdrs"),
             path_in("m2"), path_in("p2"));
    run_ok(cmd);
    /* stand-ins may also sit in SRC itself */
    snprintf(cmd, sizeof cmd, "cp %s/%s.k3hdr %s/%s.k3hdr %s && k3-convert --quiet %s --part %s %s %s",
             path_in("hdrs"), shard(1), path_in("hdrs"), shard(2), path_in("m3"), opts, list, path_in("m3"),
             path_in("p3"));
    run_ok(cmd);
}

/* Every file of a and b (dot files included) cmp-equal, and the same set. */
static void same_files(const char *a, const char *b)
{
    char *out = NULL;
    int st = k3t_runf(&out, NULL, "cd %s && ls -A | sort > ../la && cd %s && ls -A | sort > ../lb && cmp ../la ../lb"
                                  " && for f in $(ls -A); do cmp %s/$f %s/$f || exit 1; done", a, b, a, b);
    if (st != 0)
        fprintf(stderr, "differ: %s\n", out ? out : "");
    CHECK_EQ_INT(st, 0);
    free(out);
}

K3_TEST(convert_part_three_machines_merged_is_cmp_equal_to_one_conversion)
{
    char src[1024]; /* path_in's buffers are reused */
    snprintf(src, sizeof src, "%s", path_in("src"));
    char cmd[32768];
    snprintf(cmd, sizeof cmd, "k3-synth %s --preset tiny --quiet && k3-convert --quiet %s %s", src, src,
             path_in("whole"));
    run_ok(cmd);
    three_parts(src, "");
    snprintf(cmd, sizeof cmd, "k3-convert --quiet --merge %s %s %s %s", path_in("merged"), path_in("p3"),
             path_in("p1"), path_in("p2"));
    run_ok(cmd);
    same_files(path_in("whole"), path_in("merged"));
    snprintf(cmd, sizeof cmd, "k3-verify %s", path_in("merged"));
    run_ok(cmd);
    /* the parts are spent: nothing of them is left */
    CHECK(access(path_in("p1"), F_OK) != 0 && access(path_in("p2"), F_OK) != 0 && access(path_in("p3"), F_OK) != 0);
}

/* A mixed-dtype checkpoint (BF16 experts quantized, F16/F32 trunk tensors
 * kept), and --trunk-dtype bf16 carried by the parts into the merge. */
K3_TEST(convert_part_mixed_dtypes_and_trunk_bf16_merge_cmp_equal)
{
    char src[1024]; /* path_in's buffers are reused */
    snprintf(src, sizeof src, "%s", path_in("src"));
    char cmd[32768];
    snprintf(cmd, sizeof cmd, "k3-synth %s --preset tiny --quiet --experts bf16 --trunk-dtype mixed && "
                              "k3-convert --quiet --trunk-dtype bf16 %s %s", src, src, path_in("whole"));
    run_ok(cmd);
    three_parts(src, "--trunk-dtype bf16");
    snprintf(cmd, sizeof cmd, "k3-convert --quiet --merge %s %s %s %s", path_in("merged"), path_in("p1"),
             path_in("p2"), path_in("p3"));
    run_ok(cmd);
    same_files(path_in("whole"), path_in("merged"));
}

static void merge_fails(const char *parts, int want, const char *msg)
{
    char *err = NULL;
    int st = k3t_runf(NULL, &err, "k3-convert --quiet --merge %s %s", path_in("merged"), parts);
    CHECK_EQ_INT(st, want);
    CHECK_STR_CONTAINS(err, msg);
    /* one line */
    CHECK(err && strchr(err, '\n') == err + strlen(err) - 1);
    free(err);
    /* nothing was made */
    CHECK(access(path_in("merged"), F_OK) != 0);
}

K3_TEST(convert_part_merge_refuses_a_gap_an_overlap_a_twice_and_another_checkpoint)
{
    char src[1024]; /* path_in's buffers are reused */
    snprintf(src, sizeof src, "%s", path_in("src"));
    char cmd[32768], parts[4096];
    snprintf(cmd, sizeof cmd, "k3-synth %s --preset tiny --quiet", src);
    run_ok(cmd);
    three_parts(src, "");
    /* a part missing */
    snprintf(parts, sizeof parts, "%s %s", path_in("p1"), path_in("p3"));
    merge_fails(parts, 4, "model-00003-of-00005.safetensors is in none of the parts");
    /* a part twice (by another path too) */
    snprintf(parts, sizeof parts, "%s %s %s/../p1 %s", path_in("p1"), path_in("p2"), path_in("m1"), path_in("p3"));
    merge_fails(parts, 2, "given twice");
    /* overlapping parts: shard 3 converted on machine 3 as well */
    snprintf(cmd, sizeof cmd, "k3-convert --quiet --part %s --headers %s %s %s", shard(3), path_in("hdrs"),
             path_in("m3"), path_in("p3b"));
    run_ok(cmd);
    snprintf(parts, sizeof parts, "%s %s %s %s", path_in("p1"), path_in("p2"), path_in("p3"), path_in("p3b"));
    merge_fails(parts, 2, "model-00003-of-00005.safetensors is also in");
    /* DST one of the parts */
    char *err = NULL;
    CHECK_EQ_INT(k3t_runf(NULL, &err, "k3-convert --quiet --merge %s %s %s %s", path_in("p2"), path_in("p1"),
                          path_in("p2"), path_in("p3")), 2);
    CHECK_STR_CONTAINS(err, "DST is one of the parts");
    free(err);
    /* a part of another checkpoint: the small preset's other layout */
    snprintf(cmd, sizeof cmd, "k3-synth %s --preset tiny --quiet --trunk-dtype f32 && k3-convert --quiet --part 3/5 "
                              "%s %s", path_in("other"), path_in("other"), path_in("po"));
    run_ok(cmd);
    snprintf(parts, sizeof parts, "%s %s %s", path_in("p1"), path_in("po"), path_in("p3"));
    merge_fails(parts, 2, "a part of another conversion");
    /* a part of the same layout but other bytes (another seed): the plan is
     * the same, so the merge cannot tell; the manifest records each
     * shard's SHA-256 as its part read it, and k3-verify --sums finds it */
    snprintf(cmd, sizeof cmd, "k3-synth %s --preset tiny --quiet --seed 2 && k3-convert --quiet --part %s %s %s && "
                              "cd %s && sha256sum *.safetensors > %s", path_in("seed2"), shard(3), path_in("seed2"),
             path_in("ps2"), src, path_in("SUMS"));
    run_ok(cmd);
    snprintf(cmd, sizeof cmd, "k3-convert --quiet --merge %s %s %s %s && k3-verify %s --sums %s", path_in("mixed"),
             path_in("p1"), path_in("ps2"), path_in("p3"), path_in("mixed"), path_in("SUMS"));
    char *out = NULL;
    CHECK_EQ_INT(k3t_runf(&out, NULL, "%s", cmd), 1);
    CHECK_STR_CONTAINS(out, "shard model-00003-of-00005.safetensors: converted from bytes whose SHA-256 differs");
    free(out);
}

K3_TEST(convert_part_merge_of_an_unfinished_part_goes_once_it_is_finished)
{
    char src[1024]; /* path_in's buffers are reused */
    snprintf(src, sizeof src, "%s", path_in("src"));
    char cmd[32768], parts[4096];
    snprintf(cmd, sizeof cmd, "k3-synth %s --preset tiny --quiet", src);
    run_ok(cmd);
    three_parts(src, "");
    snprintf(cmd, sizeof cmd, "mv %s/part.json %s", path_in("p2"), path_in("keep.json"));
    run_ok(cmd);
    snprintf(parts, sizeof parts, "%s %s %s", path_in("p1"), path_in("p2"), path_in("p3"));
    merge_fails(parts, 4, "not a finished part");
    /* --resume finishes it: every group kept, part.json written */
    snprintf(cmd, sizeof cmd, "k3-convert --quiet --resume --part %s --headers %s %s %s && k3-convert --quiet "
                              "--merge %s %s && k3-verify %s", shard(3), path_in("hdrs"), path_in("m2"),
             path_in("p2"), path_in("merged"), parts, path_in("merged"));
    run_ok(cmd);
}

K3_TEST(convert_part_needs_the_shard_it_reads_and_says_which)
{
    char src[1024]; /* path_in's buffers are reused */
    snprintf(src, sizeof src, "%s", path_in("src"));
    char cmd[32768], *err = NULL;
    static const int only2[] = {2};
    snprintf(cmd, sizeof cmd, "k3-synth %s --preset tiny --quiet && k3-convert --export-headers %s %s", src, src,
             path_in("hdrs"));
    run_ok(cmd);
    count_shards(src);
    machine(src, path_in("m"), only2, 1);
    /* tensors of shard 2's units or records lie in shard 1, which this
     * machine does not hold */
    int st = k3t_runf(NULL, &err, "k3-convert --quiet --part %s --headers %s %s %s", shard(2), path_in("hdrs"),
                      path_in("m"), path_in("p"));
    CHECK_EQ_INT(st, 4);
    CHECK_STR_CONTAINS(err, "of model-00001-of-00005.safetensors, which is not here");
    free(err);
    CHECK(access(path_in("p"), F_OK) != 0);
    /* a shard neither here nor stood in for */
    st = k3t_runf(NULL, &err, "k3-convert --quiet --part present %s %s", path_in("m"), path_in("p"));
    CHECK_EQ_INT(st, 4);
    CHECK_STR_CONTAINS(err, "neither here nor stood in for");
    free(err);
    /* usage */
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-convert --part 0/3 %s %s", src, path_in("p")), 2);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-convert --part 4/3 %s %s", src, path_in("p")), 2);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-convert --part nosuch.safetensors %s %s", src, path_in("p")), 2);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-convert --merge %s", path_in("p")), 2);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-convert --headers %s %s %s", path_in("hdrs"), src, path_in("p")), 2);
    CHECK(access(path_in("p"), F_OK) != 0);
}

/* J/N jobs of one shared directory, a merge killed after it moved some
 * files, run again: the same bytes. */
K3_TEST(convert_part_jobs_of_n_and_an_interrupted_merge_continued)
{
    char src[1024]; /* path_in's buffers are reused */
    snprintf(src, sizeof src, "%s", path_in("src"));
    char cmd[32768];
    snprintf(cmd, sizeof cmd, "k3-synth %s --preset tiny --quiet && k3-convert --quiet %s %s", src, src,
             path_in("whole"));
    run_ok(cmd);
    for (int j = 1; j <= 3; j++) {
        snprintf(cmd, sizeof cmd, "k3-convert --quiet --part %d/3 %s %s/j%d", j, src, k3t_tmpdir(), j);
        run_ok(cmd);
    }
    /* a merge stopped by hand halfway: group 2's entry is in DST, one of
     * its files moved, the other not yet (what a kill there leaves) */
    snprintf(cmd, sizeof cmd, "cd %s && K3_CONVERT_CRASH=merge:2 k3-convert --quiet --merge merged j1 j2 j3; "
                              "test $? -eq 137", k3t_tmpdir());
    run_ok(cmd);
    CHECK(access(path_in("merged/manifest.json"), F_OK) != 0);
    snprintf(cmd, sizeof cmd, "cd %s && k3-convert --quiet --merge --rehash merged j1 j2 j3", k3t_tmpdir());
    run_ok(cmd);
    same_files(path_in("whole"), path_in("merged"));
}

/* A part on another file system: refused before anything moves (the merge
 * renames, it does not copy). /dev/shm is a tmpfs where there is one. */
K3_TEST(convert_part_merge_refuses_a_part_on_another_filesystem_and_moves_nothing)
{
    char src[1024]; /* path_in's buffers are reused */
    snprintf(src, sizeof src, "%s", path_in("src"));
    char cmd[32768];
    struct stat a, b;
    if (stat("/dev/shm", &b) != 0 || access("/dev/shm", W_OK) != 0 || stat(k3t_tmpdir(), &a) != 0 ||
        a.st_dev == b.st_dev) {
        fprintf(stderr, "  (no second file system at /dev/shm: nothing to check)\n");
        return;
    }
    snprintf(cmd, sizeof cmd, "k3-synth %s --preset tiny --quiet", src);
    run_ok(cmd);
    three_parts(src, "");
    snprintf(cmd, sizeof cmd, "cd %s && d=$(mktemp -d /dev/shm/k3-convert-part.XXXXXX) && "
                              "k3-convert --quiet --part 3/5 src $d/p && "
                              "{ k3-convert --quiet --merge merged p1 $d/p p3 2> err; echo $? > rc; "
                              "test -f $d/p/part.json && test -f $d/p/trunk-0002.k3t; echo $? > kept; rm -rf $d; }",
             k3t_tmpdir());
    run_ok(cmd);
    char *out = NULL;
    CHECK_EQ_INT(k3t_runf(&out, NULL, "cd %s && cat rc kept err", k3t_tmpdir()), 0);
    CHECK_STR_CONTAINS(out, "2\n0\n");
    CHECK_STR_CONTAINS(out, "on another filesystem than merged");
    free(out);
    CHECK(access(path_in("merged"), F_OK) != 0);
    CHECK(access(path_in("p1/part.json"), F_OK) == 0);
}
