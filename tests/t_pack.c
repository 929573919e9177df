/*
 * t_pack.c - k3-pack through the CLI on a tiny model: four floors each pass
 * k3-verify and give k3-run logits and tokens byte-identical to the
 * original; untouched expert files are hard links (same inode); the plan is
 * in the manifest with provenance; --plan writes nothing and its floor
 * equals k3-run's for the same session; kills at every stage leave DST
 * absent and resumable to the same bytes; --expert-order puts each layer's
 * most used expert first; bad inputs are refused with the documented status.
 */
#include <cjson/cJSON.h>
#include <openssl/evp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "k3_io.h"
#include "k3_pk.h"
#include "k3_test.h"

#define RUN_ARGS "--ids 5,9,2,7,3,11,4,8 --gen 6 --chunk 4"

static const char *make_src(void)
{
    static char dir[4096];
    char up[4096];
    snprintf(up, sizeof up, "%s/up", k3t_tmpdir());
    snprintf(dir, sizeof dir, "%s/src", k3t_tmpdir());
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-synth %s --preset tiny --quiet", up), 0);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-convert --quiet %s %s", up, dir), 0);
    return dir;
}

static char *slurp(const char *path, uint64_t *len)
{
    char *buf = NULL;
    uint64_t n = 0;
    k3_err e = {0};
    if (k3_io_read_file(path, 1u << 30, &buf, &n, &e))
        return NULL;
    if (len)
        *len = n;
    return buf;
}

static int same_file(const char *a, const char *b)
{
    uint64_t la = 0, lb = 0;
    char *x = slurp(a, &la), *y = slurp(b, &lb);
    int same = x && y && la == lb && !memcmp(x, y, la);
    free(x);
    free(y);
    return same;
}

static cJSON *manifest(const char *dir)
{
    char p[4200];
    snprintf(p, sizeof p, "%s/manifest.json", dir);
    char *t = slurp(p, NULL);
    cJSON *j = t ? cJSON_Parse(t) : NULL;
    free(t);
    return j;
}

/* k3-run with logits to FILE; returns the generated ids as JSON text (heap) */
static char *run_ids(const char *dir, const char *extra, const char *logits, int *status)
{
    char *out = NULL;
    *status = k3t_runf(&out, NULL, "OMP_NUM_THREADS=1 k3-run %s " RUN_ARGS " %s --json --logits-all %s", dir, extra,
                       logits);
    cJSON *j = out ? cJSON_Parse(out) : NULL;
    char *ids = j ? cJSON_PrintUnformatted(cJSON_GetObjectItemCaseSensitive(j, "generated_ids")) : NULL;
    cJSON_Delete(j);
    free(out);
    return ids;
}

static ino_t inode(const char *dir, const char *name)
{
    char p[4200];
    struct stat st;
    if (snprintf(p, sizeof p, "%s/%s", dir, name) >= (int)sizeof p)
        return 0;
    return stat(p, &st) == 0 ? st.st_ino : 0;
}

K3_TEST_TIMEOUT(pack_four_floors_verify_and_run_bit_identical_with_experts_linked, 300)
{
    const char *src = make_src();
    const char *tmp = k3t_tmpdir();
    char ref[4200], path[4200], dst[4][4200];
    snprintf(ref, sizeof ref, "%s/ref.bin", tmp);
    int st;
    char *ref_ids = run_ids(src, "", ref, &st);
    CHECK_EQ_INT(st, 0);
    CHECK(ref_ids && strlen(ref_ids) > 4);
    /* server: whole layers, everything pinned; floor: whole layers, nothing
     * pinned; 16 KiB units with tensors split by rows; a pinned list with
     * 64 KiB units (larger tensors in units of their own) */
    const char *opts[4] = {"--ram resident", "--ram floor", "--ram floor --unit-bytes 16384 --split-rows",
                           "--ram 64M --unit-bytes 65536 --pin 0-3,head"};
    for (int i = 0; i < 4; i++) {
        snprintf(dst[i], sizeof dst[i], "%s/d%d", tmp, i);
        CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-pack --quiet %s %s %s", opts[i], src, dst[i]), 0);
        char *out = NULL;
        CHECK_EQ_INT(k3t_runf(&out, NULL, "k3-verify %s", dst[i]), 0);
        CHECK_STR_CONTAINS(out, "OK");
        free(out);
        snprintf(path, sizeof path, "%s/l%d.bin", tmp, i);
        char *ids = run_ids(dst[i], "", path, &st);
        CHECK_EQ_INT(st, 0);
        CHECK_STR_EQ(ids, ref_ids);
        CHECK(same_file(path, ref));
        free(ids);
        /* the streaming runtime at its floor: identical too, except that it
         * refuses row-split tensors (exit 3, naming the tensor) */
        snprintf(path, sizeof path, "%s/r%d.bin", tmp, i);
        ids = run_ids(dst[i], "--ram floor", path, &st);
        if (i != 2) {
            CHECK_EQ_INT(st, 0);
            CHECK_STR_EQ(ids, ref_ids);
            CHECK(same_file(path, ref));
        } else {
            CHECK(st == 0 || st == 3);
            if (st == 0)
                CHECK(same_file(path, ref));
        }
        free(ids);
        /* untouched files are the source's inodes */
        CHECK(inode(dst[i], "experts-0000.k3e") != 0);
        CHECK(inode(dst[i], "experts-0000.k3e") == inode(src, "experts-0000.k3e"));
        CHECK(inode(dst[i], "experts-0003.k3e") == inode(src, "experts-0003.k3e"));
        CHECK(inode(dst[i], "tiktoken.model") == inode(src, "tiktoken.model"));
        CHECK(inode(dst[i], "trunk-0000.k3t") != inode(src, "trunk-0000.k3t"));
    }
    free(ref_ids);

    /* the plan and provenance in the manifest */
    cJSON *sm = manifest(src), *m0 = manifest(dst[0]), *m2 = manifest(dst[2]), *m3 = manifest(dst[3]);
    CHECK(sm && m0 && m2 && m3);
    const cJSON *plan = cJSON_GetObjectItemCaseSensitive(m3, "plan");
    CHECK_STR_EQ(cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(plan, "tool")), "k3-pack");
    char *a = cJSON_PrintUnformatted(cJSON_GetObjectItemCaseSensitive(sm, "source"));
    char *b = cJSON_PrintUnformatted(cJSON_GetObjectItemCaseSensitive(m3, "source"));
    CHECK_STR_EQ(a, b);   /* the upstream shards, through the source packed model */
    free(a);
    free(b);
    {
        snprintf(path, sizeof path, "%s/manifest.json", src);
        uint64_t n = 0;
        char *t = slurp(path, &n);
        uint8_t sha[32];
        unsigned hl = 0;
        char hex[65];
        CHECK(t != NULL);
        EVP_Digest(t, n, sha, &hl, EVP_sha256(), NULL);
        for (int i = 0; i < 32; i++)
            snprintf(hex + 2 * i, 3, "%02x", sha[i]);
        free(t);
        const cJSON *ps = cJSON_GetObjectItemCaseSensitive(plan, "source");
        CHECK_STR_EQ(cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(ps, "manifest_sha256")), hex);
    }
    /* pinned units form the prefix of the trunk file: layers 0-3 and the head */
    const cJSON *units = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(m3, "trunk"), "units");
    double last_pinned_end = 0, first_unpinned = 1e18;
    int npinned = 0, head_pinned = 0;
    const cJSON *u;
    cJSON_ArrayForEach(u, units)
    {
        double off = cJSON_GetObjectItemCaseSensitive(u, "offset")->valuedouble;
        double nb = cJSON_GetObjectItemCaseSensitive(u, "nbytes")->valuedouble;
        int layer = (int)cJSON_GetObjectItemCaseSensitive(u, "layer")->valuedouble;
        if (cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(u, "pinned"))) {
            npinned++;
            head_pinned |= layer == -2;
            CHECK(layer == -2 || (layer >= 0 && layer <= 3));
            if (off + nb > last_pinned_end)
                last_pinned_end = off + nb;
        } else if (off < first_unpinned) {
            first_unpinned = off;
            CHECK(!(layer >= 0 && layer <= 3) && layer != -2);
        }
    }
    CHECK(npinned >= 5 && head_pinned);
    CHECK(last_pinned_end <= first_unpinned);
    /* the 16 KiB layout really split tensors by rows, every unit at most 16 KiB */
    CHECK(cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(m2, "plan"), "split_tensors")->valuedouble >=
          1);
    int multi = 0;
    const cJSON *t;
    cJSON_ArrayForEach(t, cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(m2, "trunk"), "tensors"))
    {
        const cJSON *pcs = cJSON_GetObjectItemCaseSensitive(t, "pieces");
        int np = cJSON_GetArraySize(pcs);
        multi += np > 1;
        /* the pieces of a split tensor are back to back in the file: a layer's
         * units read in order give the whole tensor contiguous */
        for (int k = 0; k + 1 < np; k++) {
            const cJSON *x = cJSON_GetArrayItem(pcs, k), *y = cJSON_GetArrayItem(pcs, k + 1);
            CHECK(cJSON_GetObjectItemCaseSensitive(x, "offset")->valuedouble +
                      cJSON_GetObjectItemCaseSensitive(x, "nbytes")->valuedouble ==
                  cJSON_GetObjectItemCaseSensitive(y, "offset")->valuedouble);
            CHECK((long long)cJSON_GetObjectItemCaseSensitive(x, "nbytes")->valuedouble % 4096 == 0);
        }
    }
    CHECK(multi >= 1);
    cJSON_ArrayForEach(u, cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(m2, "trunk"), "units"))
        if ((int)cJSON_GetObjectItemCaseSensitive(u, "layer")->valuedouble != -1)
            CHECK(cJSON_GetObjectItemCaseSensitive(u, "nbytes")->valuedouble <= 16384);
    /* everything pinned for the server layout */
    cJSON_ArrayForEach(u, cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(m0, "trunk"), "units"))
        if ((int)cJSON_GetObjectItemCaseSensitive(u, "layer")->valuedouble != -1)
            CHECK(cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(u, "pinned")));
    cJSON_Delete(sm);
    cJSON_Delete(m0);
    cJSON_Delete(m2);
    cJSON_Delete(m3);

    /* a repack of a repack (multi-piece source) still runs identically */
    snprintf(path, sizeof path, "%s/d5", tmp);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-pack --quiet --ram resident %s %s", dst[2], path), 0);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-verify %s", path), 0);
    char again[4200];
    snprintf(again, sizeof again, "%s/l5.bin", tmp);
    ref_ids = run_ids(path, "--ram floor", again, &st);
    CHECK_EQ_INT(st, 0);
    CHECK(same_file(again, ref));
    free(ref_ids);
}

static double jget(const cJSON *o, const char *a, const char *b, const char *c)
{
    const cJSON *x = cJSON_GetObjectItemCaseSensitive(o, a);
    if (b)
        x = cJSON_GetObjectItemCaseSensitive(x, b);
    if (c)
        x = cJSON_GetObjectItemCaseSensitive(x, c);
    return cJSON_IsNumber(x) ? x->valuedouble : -1.0;
}

K3_TEST(pack_plan_writes_nothing_and_its_floor_equals_k3_run_floor)
{
    const char *src = make_src();
    const char *tmp = k3t_tmpdir();
    char dst[4200], *out = NULL;
    snprintf(dst, sizeof dst, "%s/d", tmp);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-pack --quiet --ram floor %s %s", src, dst), 0);
    /* what k3-run computes on the packed layout, with its measured baseline */
    CHECK_EQ_INT(k3t_runf(&out, NULL, "OMP_NUM_THREADS=1 k3-run %s " RUN_ARGS " --ram floor --json", dst), 0);
    cJSON *r = out ? cJSON_Parse(out) : NULL;
    free(out);
    double floor = jget(r, "stream", "plan", "floor"), runtime = jget(r, "stream", "plan", "runtime");
    cJSON_Delete(r);
    CHECK(floor > 0 && runtime > (16 << 20));
    /* k3-pack --plan for the same session (8 prompt + 6 generated, chunk 4, 1 thread) */
    char plan_dst[4200];
    snprintf(plan_dst, sizeof plan_dst, "%s/never", tmp);
    CHECK_EQ_INT(k3t_runf(&out, NULL, "k3-pack --plan --json --ram floor --ctx 14 --chunk 4 --threads 1 --baseline %llu %s",
                          (unsigned long long)(runtime - (16 << 20)), dst),
                 0);
    r = out ? cJSON_Parse(out) : NULL;
    free(out);
    CHECK(r != NULL);
    CHECK_EQ_U64((uint64_t)jget(r, "floor", NULL, NULL), (uint64_t)floor);
    CHECK(cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(r, "plan_only")));
    cJSON_Delete(r);
    CHECK(access(plan_dst, F_OK) != 0);
    /* --plan prints the floor and writes nothing next to the source either */
    CHECK_EQ_INT(k3t_runf(&out, NULL, "k3-pack --plan --ram laptop %s", src), 0);
    CHECK_STR_CONTAINS(out, "floor");
    CHECK_STR_CONTAINS(out, "linked from the source");
    free(out);
}

K3_TEST_TIMEOUT(pack_killed_at_every_stage_leaves_dst_absent_then_resumes_to_the_same_bytes, 300)
{
    const char *src = make_src();
    const char *tmp = k3t_tmpdir();
    char ref[4200], dst[4200], tdir[4300], a[4300], b[4400], *err = NULL;
    const char *opts = "--ram floor --unit-bytes 65536 --pin 2,head";
    snprintf(ref, sizeof ref, "%s/ref", tmp);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-pack --quiet %s %s %s", opts, src, ref), 0);
    /* outputs: 0 trunk, 1-4 experts (links), 5 experts.idx, 6-7 tokenizer */
    const char *stages[] = {"trunk:3", "file:0", "journaled:0", "file:2", "journaled:5", "file:7", "manifest:0", "renaming:0"};
    for (unsigned i = 0; i < sizeof stages / sizeof *stages; i++) {
        snprintf(dst, sizeof dst, "%s/d%u", tmp, i);
        snprintf(tdir, sizeof tdir, "%s.k3-pack-tmp", dst);
        int st = k3t_runf(NULL, NULL, "K3_PACK_CRASH=%s k3-pack --quiet %s %s %s", stages[i], opts, src, dst);
        CHECK_EQ_INT(st, 128 + 9);
        CHECK(access(dst, F_OK) != 0);        /* DST absent */
        CHECK(access(tdir, F_OK) == 0);       /* the temporary is there to resume */
        CHECK(k3t_runf(NULL, NULL, "k3-run %s --ids 1,2 --gen 1", dst) != 0);
        if (!strstr(stages[i], "manifest") && !strstr(stages[i], "renaming")) {
            /* before the manifest, the temporary is refused too */
            CHECK(k3t_runf(NULL, &err, "k3-run %s --ids 1,2 --gen 1", tdir) != 0);
            free(err);
            CHECK(k3t_runf(NULL, NULL, "k3-verify %s", tdir) != 0);
            k3_pk *pk = NULL;
            k3_err e = {0};
            CHECK_EQ_INT(k3_pk_open(&pk, tdir, 0, &e), K3_ENOENT);
            CHECK_STR_CONTAINS(e.msg, "no manifest.json");
            k3_pk_close(pk);
        }
        /* without --resume: refused, exit 7 */
        CHECK_EQ_INT(k3t_runf(NULL, &err, "k3-pack --quiet %s %s %s", opts, src, dst), 7);
        CHECK_STR_CONTAINS(err, "--resume");
        free(err);
        /* nor while another process holds DST's lock */
        if (i == 0) {
            CHECK_EQ_INT(k3t_runf(NULL, &err, "flock %s.k3-lock k3-pack --quiet --resume %s %s %s", dst, opts, src, dst),
                         7);
            CHECK_STR_CONTAINS(err, "is in use by");
            free(err);
        }
        /* a different plan does not resume into it */
        CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-pack --quiet --resume --ram resident %s %s", src, dst), 7);
        CHECK(access(dst, F_OK) != 0);
        CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-pack --quiet --resume %s %s %s", opts, src, dst), 0);
        CHECK(access(tdir, F_OK) != 0);
        CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-verify %s", dst), 0);
        snprintf(a, sizeof a, "%s/manifest.json", ref);
        snprintf(b, sizeof b, "%s/manifest.json", dst);
        CHECK(same_file(a, b));
        snprintf(a, sizeof a, "%s/trunk-0000.k3t", ref);
        snprintf(b, sizeof b, "%s/trunk-0000.k3t", dst);
        CHECK(same_file(a, b));
    }
    /* the stand-in a kill during planning leaves next to DST goes with the next run */
    snprintf(dst, sizeof dst, "%s/stale", tmp);
    snprintf(a, sizeof a, "%s.k3-pack-probe.Ab3dEf", dst);
    CHECK_EQ_INT(mkdir(a, 0700), 0);
    snprintf(b, sizeof b, "%s/trunk-0000.k3t", a);
    FILE *sf = fopen(b, "w");
    CHECK(sf != NULL);
    if (sf)
        fclose(sf);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-pack --quiet %s %s %s", opts, src, dst), 0);
    CHECK(access(a, F_OK) != 0);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "ls -d %s/*.k3-pack-probe.* 2>/dev/null | grep -c . | grep -qx 0", tmp), 0);
    /* --force replaces a complete DST, and only once the new one is complete */
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-pack --quiet %s %s %s", opts, src, ref), 7);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "K3_PACK_CRASH=trunk:2 k3-pack --quiet --force --ram resident %s %s", src, ref),
                 128 + 9);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-verify %s", ref), 0);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-pack --quiet --force --ram resident %s %s", src, ref), 0);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-verify %s", ref), 0);
}

K3_TEST(pack_expert_order_puts_the_most_used_expert_of_each_layer_first)
{
    const char *src = make_src();
    const char *tmp = k3t_tmpdir();
    char trace[4200], dst[4200], ref[4200], got[4200];
    snprintf(trace, sizeof trace, "%s/trace.txt", tmp);
    snprintf(dst, sizeof dst, "%s/hot", tmp);
    snprintf(ref, sizeof ref, "%s/ref.bin", tmp);
    snprintf(got, sizeof got, "%s/got.bin", tmp);
    int st;
    char *ids_ref = run_ids(src, "", ref, &st);
    CHECK_EQ_INT(st, 0);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-run %s " RUN_ARGS " --ram floor --trace %s", src, trace), 0);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-pack --quiet --ram double --expert-order %s %s %s", trace, src, dst), 0);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-verify %s", dst), 0);
    char *ids = run_ids(dst, "--ram floor", got, &st);
    CHECK_EQ_INT(st, 0);
    CHECK_STR_EQ(ids, ids_ref);
    CHECK(same_file(got, ref));
    free(ids);
    free(ids_ref);
    /* counts from the trace itself; the first of each layer's order has the most */
    cJSON *m = manifest(dst);
    const cJSON *x = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(m, "plan"), "experts");
    const cJSON *order = cJSON_GetObjectItemCaseSensitive(x, "order");
    const cJSON *hot = cJSON_GetObjectItemCaseSensitive(x, "hot");
    CHECK_EQ_INT(cJSON_GetArraySize(order), 12);   /* tiny: 13 layers, the first dense */
    uint64_t cnt[13][16];
    memset(cnt, 0, sizeof cnt);
    FILE *f = fopen(trace, "r");
    char line[256];
    while (f && fgets(line, sizeof line, f)) {
        unsigned long long fw;
        unsigned l, e;
        char hm;
        if (sscanf(line, "%llu %u %u %c", &fw, &l, &e, &hm) == 4 && l < 13 && e < 16)
            cnt[l][e]++;
    }
    if (f)
        fclose(f);
    for (int li = 0; li < 12; li++) {
        const cJSON *o = cJSON_GetArrayItem(order, li);
        CHECK_EQ_INT(cJSON_GetArraySize(o), 16);
        int first = (int)cJSON_GetArrayItem(o, 0)->valuedouble;
        for (int e = 0; e < 16; e++)
            CHECK(cnt[li + 1][first] >= cnt[li + 1][e]);
        CHECK(cJSON_GetArraySize(cJSON_GetArrayItem(hot, li)) >= 1);
    }
    cJSON_Delete(m);
    /* and its record is the first of its layer's file */
    char idx[4300];
    snprintf(idx, sizeof idx, "%s/experts.idx", dst);
    uint64_t n = 0;
    char *buf = slurp(idx, &n);
    CHECK(buf && n >= 64 + 16 * 12 * 16);
    if (buf) {
        /* entry (moe 0, expert order[0][0]): offset 0 */
        cJSON *mm = manifest(dst);
        const cJSON *o0 = cJSON_GetArrayItem(
            cJSON_GetObjectItemCaseSensitive(
                cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(mm, "plan"), "experts"), "order"),
            0);
        int e0 = (int)cJSON_GetArrayItem(o0, 0)->valuedouble;
        uint64_t off = 0;
        memcpy(&off, buf + 64 + 16 * e0 + 8, 8);
        CHECK_EQ_U64(off, 0);
        cJSON_Delete(mm);
    }
    free(buf);
}

K3_TEST(pack_refuses_bad_inputs_with_the_documented_status)
{
    const char *src = make_src();
    const char *tmp = k3t_tmpdir();
    char dst[4200], bad[4200], *err = NULL;
    snprintf(dst, sizeof dst, "%s/d", tmp);
    /* below any reachable floor: 6, naming the floor */
    CHECK_EQ_INT(k3t_runf(NULL, &err, "k3-pack --ram 1M %s %s", src, dst), 6);
    CHECK_STR_CONTAINS(err, "floor");
    free(err);
    CHECK(access(dst, F_OK) != 0);
    /* a malformed trace: 3, naming the line */
    snprintf(bad, sizeof bad, "%s/bad.trace", tmp);
    FILE *f = fopen(bad, "w");
    fputs("# k3-run expert trace\n1 1 2 M\n1 1 99 M\n", f);
    fclose(f);
    CHECK_EQ_INT(k3t_runf(NULL, &err, "k3-pack --expert-order %s %s %s", bad, src, dst), 3);
    CHECK_STR_CONTAINS(err, "line 3");
    free(err);
    /* not a packed model: refused, nothing written */
    CHECK(k3t_runf(NULL, &err, "k3-pack %s %s/up %s", "--ram floor", tmp, dst) != 0);
    CHECK_STR_CONTAINS(err, "no manifest.json");
    free(err);
    CHECK(access(dst, F_OK) != 0);
    /* DST inside the source, or the source itself: usage, nothing written */
    CHECK_EQ_INT(k3t_runf(NULL, &err, "k3-pack --ram floor %s %s/inner", src, src), 2);
    CHECK_STR_CONTAINS(err, "inside");
    free(err);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-pack --ram floor --force %s %s", src, src), 2);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-verify %s", src), 0);
    /* usage */
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-pack --ram floor --pin 99 %s %s", src, dst), 2);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-pack --ram lots %s %s", src, dst), 2);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-pack %s", src), 2);
    /* a corrupt source trunk unit: 5, and no DST */
    char sdir[4200], cp[4400];
    snprintf(sdir, sizeof sdir, "%s/corrupt", tmp);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-pack --quiet --copy --ram floor %s %s", src, sdir), 0);
    snprintf(cp, sizeof cp, "%s/trunk-0000.k3t", sdir);
    FILE *t = fopen(cp, "r+b");
    CHECK(t != NULL);
    if (t) {
        fseek(t, 5000, SEEK_SET);
        int c = fgetc(t);
        fseek(t, 5000, SEEK_SET);
        fputc(c ^ 0x10, t);
        fclose(t);
    }
    CHECK_EQ_INT(k3t_runf(NULL, &err, "k3-pack --quiet --ram floor %s %s", sdir, dst), 5);
    CHECK_STR_CONTAINS(err, "CRC32");
    free(err);
    CHECK(access(dst, F_OK) != 0);
    /* the same in the zero padding after the last tensor of the last unit
     * (bytes no tensor copy reads) */
    t = fopen(cp, "r+b");
    CHECK(t != NULL);
    if (t) {
        fseek(t, 5000, SEEK_SET);
        int c = fgetc(t);
        fseek(t, 5000, SEEK_SET);
        fputc(c ^ 0x10, t);
        fseek(t, -1, SEEK_END);
        fputc(0x01, t);
        fclose(t);
    }
    CHECK_EQ_INT(k3t_runf(NULL, &err, "k3-pack --quiet --force --ram floor %s %s", sdir, dst), 5);
    CHECK_STR_CONTAINS(err, "CRC32");
    free(err);
    CHECK(access(dst, F_OK) != 0);
    /* --copy: no shared inode, still verifies */
    CHECK(inode(sdir, "experts-0000.k3e") != inode(src, "experts-0000.k3e"));
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-pack --quiet --force --ram floor %s %s", src, sdir), 0);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-verify %s", sdir), 0);
}

/* The meter's lines ("k3-pack: DONE / TOTAL (P%), ...") in stderr text, and
 * the bytes done of the first one (-1 if none). */
static unsigned meter_lines(const char *err, double *first_done)
{
    unsigned n = 0;
    *first_done = -1;
    for (const char *l = err; l && *l;) {
        const char *nl = strchr(l, '\n');
        size_t len = nl ? (size_t)(nl - l) : strlen(l);
        if (len > 9 && !strncmp(l, "k3-pack: ", 9) && memchr(l, '%', len) && strstr(l, " / ") &&
            strstr(l, " / ") < l + len) {
            if (n++ == 0) {
                char *end;
                double v = strtod(l + 9, &end);
                *first_done = v * (!strncmp(end, " kB", 3) ? 1e3 : !strncmp(end, " MB", 3) ? 1e6 : 1);
            }
        }
        l += len + (nl != NULL);
    }
    return n;
}

K3_TEST(pack_progress_moves_per_unit_and_counts_a_resumed_trunk)
{
    const char *src = make_src();
    const char *tmp = k3t_tmpdir();
    char dst[4200], dst2[4200], *err = NULL;
    const char *opts = "--ram floor --unit-bytes 65536 --pin 2,head";
    double first;
    snprintf(dst, sizeof dst, "%s/d", tmp);
    snprintf(dst2, sizeof dst2, "%s/d2", tmp);
    /* with every line due at once, the meter speaks after every trunk unit
     * piece and expert: at least one line per unit */
    CHECK_EQ_INT(k3t_runf(NULL, &err, "K3_PROGRESS_EVERY_MS=0 k3-pack --progress %s %s %s", opts, src, dst), 0);
    cJSON *m = manifest(dst);
    int units = cJSON_GetArraySize(cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(m, "trunk"), "units"));
    cJSON_Delete(m);
    CHECK(units >= 4);
    CHECK((int)meter_lines(err, &first) >= units);
    CHECK_STR_CONTAINS(err, "(100.0%)");
    free(err);
    /* off a terminal without --progress, and with --quiet: no meter */
    err = NULL;
    CHECK_EQ_INT(k3t_runf(NULL, &err, "K3_PROGRESS_EVERY_MS=0 k3-pack --force %s %s %s", opts, src, dst), 0);
    CHECK_EQ_INT((int)meter_lines(err, &first), 0);
    free(err);
    err = NULL;
    CHECK_EQ_INT(k3t_runf(NULL, &err, "K3_PROGRESS_EVERY_MS=0 k3-pack --quiet --progress --force %s %s %s", opts, src, dst), 0);
    CHECK(err == NULL || err[0] == 0);
    free(err);
    /* killed after the third unit, resumed: the kept bytes count from the
     * first line on */
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "K3_PACK_CRASH=unit:3 k3-pack --quiet %s %s %s", opts, src, dst2), 128 + 9);
    err = NULL;
    CHECK_EQ_INT(k3t_runf(NULL, &err, "K3_PROGRESS_EVERY_MS=0 k3-pack --progress --resume %s %s %s", opts, src, dst2), 0);
    const char *k = err ? strstr(err, "kept from the interrupted run") : NULL;
    CHECK(k != NULL);
    while (k && k > err && k[-1] != ':')
        k--;
    double kept = k ? strtod(k, NULL) : 0;   /* "...trunk.bin: N bytes (...) kept" */
    CHECK(kept >= 3 * 65536.0 * 0.5);
    CHECK(meter_lines(err, &first) > 0);
    CHECK(first >= kept * 0.995);   /* the meter starts at what was kept, not at zero */
    free(err);
}
