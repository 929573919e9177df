/*
 * t_verify.c - k3-verify's fault matrix: for an upstream checkpoint and for a
 * packed model, truncations (inside a header, inside a tensor, at a record or
 * tensor boundary), flipped bits (header, tensor, expert record), a shard or
 * file swapped with one from a checkpoint of another seed, a missing file, an
 * extra file, a hand-edited manifest. The full check must catch every one and
 * name the right file; the quick check every size and header case. Also:
 * clean directories pass, nothing is written into the checked directory.
 */
#include <stdlib.h>
#include <string.h>
#include <openssl/evp.h>
#include <unistd.h>

#include "k3_io.h"
#include "k3_man.h"
#include "k3_test.h"

#define FLIP "python3 -c \"import sys;p=sys.argv[1];o=int(sys.argv[2]);b=bytearray(open(p,'rb').read());" \
             "b[o]^=1;open(p,'wb').write(b)\" "

typedef struct fault {
    const char *what;
    const char *cmd;     /* shell, %1$s = the damaged directory, %2$s = the other-seed directory */
    const char *file;    /* the file the report must name */
    int quick;           /* the quick check must catch it too */
} fault;

static char fixture[4096], other[4096], sums[4200];

/* tiny checkpoint (seed 1), its sums, and one of seed 2; packed: converted */
static void make_fixtures(int packed)
{
    snprintf(fixture, sizeof fixture, "%s/up1", k3t_tmpdir());
    snprintf(other, sizeof other, "%s/up2", k3t_tmpdir());
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-synth %s --preset tiny --quiet --seed 1", fixture), 0);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-synth %s --preset tiny --quiet --seed 2", other), 0);
    snprintf(sums, sizeof sums, "%s/up1.sums", k3t_tmpdir());
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "cd %s && sha256sum * > %s", fixture, sums), 0);
    if (packed) {
        CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-convert --quiet %s %s/pk1", fixture, k3t_tmpdir()), 0);
        CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-convert --quiet %s %s/pk2", other, k3t_tmpdir()), 0);
        snprintf(fixture, sizeof fixture, "%s/pk1", k3t_tmpdir());
        snprintf(other, sizeof other, "%s/pk2", k3t_tmpdir());
    }
}

static void run_matrix(const fault *f, size_t n, const char *extra_args)
{
    char dir[4200];
    snprintf(dir, sizeof dir, "%s/bad", k3t_tmpdir());
    for (size_t i = 0; i < n; i++) {
        char *cperr = NULL;
        if (k3t_runf(NULL, &cperr, "rm -rf %s && cp -r %s %s", dir, fixture, dir) != 0)
            k3t_fail(__FILE__, __LINE__, "%s: could not copy the fixture: %s", f[i].what, cperr ? cperr : "");
        free(cperr);
        char cmd[8192];
        snprintf(cmd, sizeof cmd, f[i].cmd, dir, other);
        char *err = NULL;
        if (k3t_runf(NULL, &err, "%s", cmd) != 0)
            k3t_fail(__FILE__, __LINE__, "%s: could not plant the fault: %s", f[i].what, err ? err : "");
        free(err);
        char want[4400];
        snprintf(want, sizeof want, "%s/%s", dir, f[i].file);
        for (int quick = 0; quick <= f[i].quick; quick++) {
            char *out = NULL;
            int st = k3t_runf(&out, NULL, "k3-verify %s %s %s", quick ? "--quick" : "", extra_args, dir);
            if (st != 1 || !out || !strstr(out, want))
                k3t_fail(__FILE__, __LINE__, "%s (%s): status %d, report does not name %s:\n%s", f[i].what,
                         quick ? "quick" : "full", st, f[i].file, out ? out : "");
            free(out);
        }
    }
}

K3_TEST_TIMEOUT(verify_full_and_quick_catch_every_upstream_fault, 240)
{
    make_fixtures(0);
    char args[4400];
    snprintf(args, sizeof args, "--sums %s", sums);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-verify %s %s", args, fixture), 0);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-verify --quick %s %s", args, fixture), 0);
    static const fault f[] = {
        {"truncated inside the header", "truncate -s 100 %1$s/model-00002-of-00005.safetensors",
         "model-00002-of-00005.safetensors", 1},
        {"truncated inside a tensor", "truncate -s -1000 %1$s/model-00002-of-00005.safetensors",
         "model-00002-of-00005.safetensors", 1},
        {"truncated at a tensor boundary (the last tensor gone)",
         "python3 -c \"import json,struct,sys,os;p=sys.argv[1];f=open(p,'rb');n=struct.unpack('<Q',f.read(8))[0];"
         "h=json.loads(f.read(n));e=max(v['data_offsets'][0] for k,v in h.items() if k!='__metadata__');"
         "os.truncate(p,8+n+e)\" %1$s/model-00003-of-00005.safetensors",
         "model-00003-of-00005.safetensors", 1},
        {"bit flipped in the header length", FLIP "%1$s/model-00004-of-00005.safetensors 5",
         "model-00004-of-00005.safetensors", 1},
        {"bit flipped in the header JSON", FLIP "%1$s/model-00002-of-00005.safetensors 200",
         "model-00002-of-00005.safetensors", 0},
        {"bit flipped in a tensor", FLIP "%1$s/model-00002-of-00005.safetensors -3000",
         "model-00002-of-00005.safetensors", 0},
        {"shard swapped with the other seed's", "cp %2$s/model-00003-of-00005.safetensors %1$s/",
         "model-00003-of-00005.safetensors", 0},
        {"missing shard", "rm %1$s/model-00003-of-00005.safetensors", "model-00003-of-00005.safetensors", 1},
        {"extra file", "cp %1$s/model-00001-of-00005.safetensors %1$s/model-00006-of-00005.safetensors",
         "model-00006-of-00005.safetensors", 1},
        {"missing config", "rm %1$s/config.json", "config.json", 1},
    };
    run_matrix(f, sizeof f / sizeof *f, args);
}

K3_TEST_TIMEOUT(verify_full_and_quick_catch_every_packed_fault, 240)
{
    make_fixtures(1);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-verify %s", fixture), 0);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-verify --quick %s", fixture), 0);
    static const fault f[] = {
        {"manifest truncated", "truncate -s 100 %1$s/manifest.json", "manifest.json", 1},
        {"manifest edited by hand",
         "python3 -c \"import json,sys;p=sys.argv[1];m=json.load(open(p));m['trunk']['units'][1]['offset']+=4096;"
         "json.dump(m,open(p,'w'),indent='\\t')\" %1$s/manifest.json",
         "manifest.json", 1},
        {"manifest edited: config", "sed -i 's/\"rms_norm_eps\":\\t1e-05/\"rms_norm_eps\":\\t1e-06/' %1$s/manifest.json",
         "manifest.json", 1},
        {"record table truncated (header)", "truncate -s 40 %1$s/experts.idx", "experts.idx", 1},
        {"bit flipped in the record table", FLIP "%1$s/experts.idx 100", "experts.idx", 1},
        {"trunk truncated inside a tensor", "truncate -s 5000 %1$s/trunk-0001.k3t", "trunk-0001.k3t", 1},
        {"experts truncated at a record boundary", "truncate -s 65536 %1$s/experts-0002.k3e", "experts-0002.k3e", 1},
        {"bit flipped in a trunk tensor", FLIP "%1$s/trunk-0001.k3t 100", "trunk-0001.k3t", 0},
        {"bit flipped in an expert record", FLIP "%1$s/experts-0001.k3e 5000", "experts-0001.k3e", 0},
        {"file swapped with the other seed's", "cp %2$s/experts-0002.k3e %1$s/", "experts-0002.k3e", 0},
        {"missing file", "rm %1$s/trunk-0002.k3t", "trunk-0002.k3t", 1},
        {"extra file", "echo x > %1$s/notes.txt", "notes.txt", 1},
        {"tokenizer file corrupted", FLIP "%1$s/tiktoken.model 10", "tiktoken.model", 0},
    };
    run_matrix(f, sizeof f / sizeof *f, "");
    /* a flipped expert bit is named down to the record */
    char *out = NULL;
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "cp -r %s %s/b2 && " FLIP "%s/b2/experts-0001.k3e 5000", fixture, k3t_tmpdir(),
                          k3t_tmpdir()), 0);
    CHECK_EQ_INT(k3t_runf(&out, NULL, "k3-verify %s/b2", k3t_tmpdir()), 1);
    CHECK_STR_CONTAINS(out, "record layer");
    CHECK_STR_CONTAINS(out, "CRC32 mismatch");
    free(out);
}

K3_TEST(verify_lists_every_problem_not_only_the_first)
{
    make_fixtures(1);
    char *out = NULL;
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "cp -r %s %s/b && rm %s/b/trunk-0000.k3t && truncate -s 4096 %s/b/experts-0001.k3e "
                          "&& touch %s/b/extra && " FLIP "%s/b/trunk-0002.k3t 10",
                          fixture, k3t_tmpdir(), k3t_tmpdir(), k3t_tmpdir(), k3t_tmpdir(), k3t_tmpdir()), 0);
    CHECK_EQ_INT(k3t_runf(&out, NULL, "k3-verify %s/b", k3t_tmpdir()), 1);
    CHECK_STR_CONTAINS(out, "trunk-0000.k3t: missing");
    CHECK_STR_CONTAINS(out, "experts-0001.k3e: truncated at byte 4096 of");
    CHECK_STR_CONTAINS(out, "extra: unexpected extra file");
    CHECK_STR_CONTAINS(out, "trunk-0002.k3t: SHA-256 mismatch");
    CHECK_STR_CONTAINS(out, "problem(s) found");
    free(out);
}

K3_TEST(verify_provenance_against_sums_names_a_foreign_source)
{
    make_fixtures(1);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-verify --sums %s %s", sums, fixture), 0);
    /* the packed model of seed 2 does not descend from seed 1's shards */
    char *out = NULL;
    CHECK_EQ_INT(k3t_runf(&out, NULL, "k3-verify --quick --sums %s %s", sums, other), 1);
    CHECK_STR_CONTAINS(out, "provenance: shard model-00001-of-00005.safetensors");
    free(out);
}

K3_TEST(verify_never_writes_into_the_checked_directory)
{
    make_fixtures(1);
    char *before = NULL, *after = NULL;
    CHECK_EQ_INT(k3t_runf(&before, NULL, "ls -lA --time-style=full-iso %s", fixture), 0);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-verify %s && k3-verify --quick %s",
                          fixture, fixture), 0);
    CHECK_EQ_INT(k3t_runf(&after, NULL, "ls -lA --time-style=full-iso %s", fixture), 0);
    CHECK_STR_EQ(before, after);
    free(before);
    free(after);
}

K3_TEST(verify_reports_read_errors_as_problems_and_uses_documented_statuses)
{
    make_fixtures(1);
    char *out = NULL, *err = NULL;
    CHECK_EQ_INT(k3t_runf(&out, NULL, "K3_FAULT=eio:experts-0001:0 k3-verify %s", fixture), 1);
    CHECK_STR_CONTAINS(out, "experts-0001.k3e: read failed");
    free(out);
    CHECK_EQ_INT(k3t_runf(NULL, &err, "k3-verify %s/nowhere", k3t_tmpdir()), 4);
    CHECK_STR_CONTAINS(err, "k3-verify: error:");
    free(err);
    CHECK_EQ_INT(k3t_runf(NULL, &err, "k3-verify --sample x %s", fixture), 2);
    free(err);
    CHECK_EQ_INT(k3t_runf(NULL, &err, "k3-verify"), 2);
    free(err);
    CHECK_EQ_INT(k3t_runf(NULL, &err, "echo nonsense > %s/bad.sums && k3-verify --sums %s/bad.sums %s", k3t_tmpdir(),
                          k3t_tmpdir(), fixture), 3);
    free(err);
}

/* embed.crc that is consistent with the manifest (its SHA-256 re-recorded,
 * the manifest re-hashed) but wrong for one row's bytes - what a converter
 * bug would write: the full check names the row, k3-run refuses that row
 * (exit 5) and still runs ids whose rows are right. */
K3_TEST(verify_and_run_catch_an_embedding_row_crc_that_does_not_match_the_row)
{
    make_fixtures(1);
    char dir[4200], path[4400], *txt = NULL, *out = NULL, *err = NULL;
    uint64_t len;
    k3_err e = {0};
    snprintf(dir, sizeof dir, "%s/b", k3t_tmpdir());
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "cp -r %s %s", fixture, dir), 0);
    snprintf(path, sizeof path, "%s/embed.crc", dir);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, FLIP "%s 12", path), 0); /* row 3's CRC */
    char *tab = NULL;
    uint64_t tl;
    CHECK_EQ_INT(k3_io_read_file(path, 1u << 30, &tab, &tl, &e), 0);
    snprintf(path, sizeof path, "%s/manifest.json", dir);
    CHECK_EQ_INT(k3_io_read_file(path, K3_MAN_MAX_BYTES, &txt, &len, &e), 0);
    k3_man m;
    CHECK_EQ_INT(k3_man_parse(&m, txt, len, path, &e), 0);
    unsigned int hl = 0;
    EVP_Digest(tab, (size_t)tl, m.files[m.embed_crc_file].sha256, &hl, EVP_sha256(), NULL);
    free(txt);
    free(tab);
    txt = k3_man_to_json(&m);
    CHECK(txt != NULL);
    CHECK_EQ_INT(k3_io_write_file_atomic(path, txt, strlen(txt), &e), 0);
    free(txt);
    k3_man_free(&m);
    CHECK_EQ_INT(k3t_runf(&out, NULL, "k3-verify %s", dir), 1);
    CHECK_STR_CONTAINS(out, "trunk-0000.k3t: embedding row 3 at offset");
    free(out);
    CHECK_EQ_INT(k3t_runf(&out, &err, "k3-run %s --ids 3,1 --gen 1", dir), 5);
    CHECK_STR_CONTAINS(err, "embedding row 3");
    free(out);
    free(err);
    CHECK_EQ_INT(k3t_runf(&out, &err, "k3-run %s --ids 1,2 --gen 1 --ram floor", dir), 0);
    free(out);
    free(err);
    CHECK_EQ_INT(k3t_runf(&out, &err, "k3-run %s --ids 2,3 --gen 1 --ram floor", dir), 5);
    CHECK_STR_CONTAINS(err, "embedding row 3");
    free(out);
    free(err);
}
