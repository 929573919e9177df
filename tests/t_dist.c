/*
 * t_dist.c - k3-run-mpi and k3-serve-mpi under mpirun, ranks on this
 * machine (docs/DIST.md): the same logits and tokens as one process at 1 to
 * 4 ranks, on packed models streamed at the floor and on an upstream
 * checkpoint held resident; one rank's failure named by rank 0; a rank
 * killed or stopped ending the job instead of hanging.
 */
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "k3_test.h"
#include "serve_util.h"

/* mpirun as root, more ranks than cores, no network but loopback */
#define MPIRUN "env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 ASAN_OPTIONS=detect_leaks=0 " \
               "mpirun --oversubscribe --mca btl self,vader,tcp --mca btl_tcp_if_include lo "             \
               "--mca oob_tcp_if_include lo -x ASAN_OPTIONS -x K3_DIST_TIMEOUT"

static void need_mpi(void)
{
    char p[4096];
    snprintf(p, sizeof p, "%s/k3-run-mpi", k3t_bindir());
    if (access(p, X_OK) != 0)
        k3t_skip("no %s: the MPI build needs Open MPI's mpicc (scripts/install-deps)", p);
    if (k3t_runf(NULL, NULL, "command -v mpirun >/dev/null") != 0)
        k3t_skip("no mpirun on the PATH (scripts/install-deps installs Open MPI)");
}

/* A tiny checkpoint (mixed trunk dtypes) and its packed model under dir. */
static void models(const char *dir, const char *synth_opts)
{
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-synth %s/ck --preset tiny --quiet %s && k3-convert %s/ck %s/pk --quiet",
                          dir, synth_opts, dir, dir), 0);
}

static int same_file(const char *a, const char *b) { return k3t_runf(NULL, NULL, "cmp -s %s %s", a, b) == 0; }

/* The generated ids of a --json run's output. */
static char *gen_ids(const char *json)
{
    const char *p = json ? strstr(json, "\"generated_ids\"") : NULL;
    if (!p)
        return strdup("");
    const char *q = strchr(p, ']');
    return strndup(p, q ? (size_t)(q - p + 1) : strlen(p));
}

/* One process, then 1..4 ranks: the same --logits-all bytes, greedy tokens
 * and seeded sampled tokens. */
static void same_bits(const char *dir, const char *model, const char *ram)
{
    const char *args = "--ids 3,1,4,1,5,9,2,6,5,3,5 --gen 10 --json --quiet";
    char *one = NULL, *sampled = NULL;
    CHECK_EQ_INT(k3t_runf(&one, NULL, "k3-run %s %s %s --logits-all %s/ref.f32", model, ram, args, dir), 0);
    CHECK_EQ_INT(k3t_runf(&sampled, NULL, "k3-run %s %s %s --temperature 0.8 --seed 11", model, ram, args), 0);
    char *ref_g = gen_ids(one), *ref_s = gen_ids(sampled);
    CHECK(strlen(ref_g) > 20);
    for (int n = 1; n <= 4; n++) {
        char *out = NULL, *err = NULL, f[4200];
        snprintf(f, sizeof f, "%s/r%d.f32", dir, n);
        int rc = k3t_runf(&out, &err, MPIRUN " -np %d k3-run-mpi %s %s %s --logits-all %s", n, model, ram, args, f);
        if (rc != 0)
            fprintf(stderr, "%s", err ? err : "");
        CHECK_EQ_INT(rc, 0);
        char ref[4200];
        snprintf(ref, sizeof ref, "%s/ref.f32", dir);
        CHECK(same_file(ref, f));
        char *g = gen_ids(out);
        CHECK_STR_EQ(g, ref_g);
        free(g);
        free(out);
        free(err);
        out = NULL;
        CHECK_EQ_INT(k3t_runf(&out, NULL, MPIRUN " -np %d k3-run-mpi %s %s %s --temperature 0.8 --seed 11", n, model,
                              ram, args), 0);
        g = gen_ids(out);
        CHECK_STR_EQ(g, ref_s);
        free(g);
        free(out);
    }
    free(ref_g);
    free(ref_s);
    free(one);
    free(sampled);
}

K3_TEST_TIMEOUT(dist_ranks_give_the_bits_of_one_process_at_the_floor, 300)
{
    need_mpi();
    const char *dir = k3t_tmpdir();
    models(dir, "");
    char pk[4200];
    snprintf(pk, sizeof pk, "%s/pk", dir);
    same_bits(dir, pk, "--ram floor");
}

K3_TEST_TIMEOUT(dist_ranks_give_the_bits_of_one_process_resident_and_upstream, 300)
{
    need_mpi();
    const char *dir = k3t_tmpdir();
    /* other dtypes and a longer prompt chunk cut: bf16 matrices, f32 vectors */
    models(dir, "--trunk-dtype bf16 --vectors f32 --seed 5");
    char m[4200];
    snprintf(m, sizeof m, "%s/pk", dir);
    same_bits(dir, m, "--chunk 4");
    snprintf(m, sizeof m, "%s/ck", dir);
    same_bits(dir, m, "");
}

K3_TEST_TIMEOUT(dist_a_failing_rank_is_named_by_rank_0, 120)
{
    need_mpi();
    const char *dir = k3t_tmpdir();
    models(dir, "");
    /* every rank opens the path rank 0 names, on its own disk: here rank 2
     * works in another directory, whose copy has a damaged embed.crc */
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "mkdir %s/a %s/b && cp -r %s/pk %s/a/ && cp -r %s/pk %s/b/ && printf 'XXXX' | "
                          "dd of=%s/b/pk/embed.crc conv=notrunc status=none", dir, dir, dir, dir, dir, dir, dir), 0);
    char *err = NULL;
    int rc = k3t_runf(NULL, &err,
                      MPIRUN " -np 2 -wdir %s/a k3-run-mpi pk --ids 1,2 --gen 2 --ram floor --quiet : "
                      "-np 1 -wdir %s/b k3-run-mpi pk --ids 1,2 --gen 2 --ram floor --quiet", dir, dir);
    CHECK_EQ_INT(rc, 5);
    CHECK_STR_CONTAINS(err, "k3-run: error: rank 2: pk/embed.crc: SHA-256 differs from the manifest");
    free(err);
}

/* The pid of rank r of the job running the model in dir (its environment
 * names the rank). */
static int rank_pid(const char *dir, int r)
{
    char *out = NULL;
    char cmd[8192];
    snprintf(cmd, sizeof cmd,
             "for p in $(pgrep -f 'k3-run-mpi %s/pk'); do tr '\\0' '\\n' < /proc/$p/environ 2>/dev/null | "
             "grep -qx OMPI_COMM_WORLD_RANK=%d && echo $p; done | head -1", dir, r);
    if (k3t_run(cmd, &out, NULL) != 0 || !out)
        return -1;
    int pid = atoi(out);
    free(out);
    return pid;
}

/* pid is alive: not gone, not a zombie (the harness may have become its
 * parent: then it is reaped here). */
static int running(int pid)
{
    int st;
    if (waitpid(pid, &st, WNOHANG) == pid || kill(pid, 0) != 0)
        return 0;
    char p[64], *out = NULL;
    snprintf(p, sizeof p, "awk '{print $3}' /proc/%d/stat 2>/dev/null", pid);
    k3t_run(p, &out, NULL);
    int z = out && (out[0] == 'Z' || out[0] == 0);
    free(out);
    return !z;
}

/* Commas in the file at path: the ids printed so far, less one. */
static int commas(const char *path)
{
    FILE *f = fopen(path, "r");
    int n = 0, ch;
    if (!f)
        return 0;
    while ((ch = fgetc(f)) != EOF)
        n += ch == ',';
    fclose(f);
    return n;
}

/* A long run of 3 ranks; sig goes to rank 2 once the job has decoded (every
 * rank past its start, in the steps' collectives: a rank stopped before
 * MPI is up leaves the others waiting where no timeout of k3's runs); the
 * job must end within 60 s. *err: its stderr. */
static void hit_rank(const char *dir, int sig, const char *timeout, char **err)
{
    char cmd[8192], ids[4200];
    snprintf(ids, sizeof ids, "%s/out", dir);
    snprintf(cmd, sizeof cmd,
             "K3_DIST_TIMEOUT=%s " MPIRUN " -np 3 k3-run-mpi %s/pk --ids 1,2,3 --gen 100000 --ram floor "
             "> %s 2> %s/err & echo $!", timeout, dir, ids, dir);
    char *out = NULL;
    CHECK_EQ_INT(k3t_run(cmd, &out, NULL), 0);
    int job = atoi(out ? out : "0");
    free(out);
    CHECK(job > 0);
    int victim = -1;
    for (int i = 0; i < 200 && victim <= 0; i++) {
        usleep(50000);
        victim = rank_pid(dir, 2);
    }
    CHECK(victim > 0);
    for (int i = 0; i < 1200 && commas(ids) < 2; i++)   /* three ids out: decoding */
        usleep(50000);
    CHECK(commas(ids) >= 2);
    kill(victim, sig);
    int alive = 1;
    for (int i = 0; i < 600 && alive; i++) {   /* at most 60 s */
        usleep(100000);
        alive = running(job);
    }
    if (alive)
        kill(job, SIGKILL);
    if (sig == SIGSTOP)
        kill(victim, SIGKILL);
    CHECK(!alive);
    char p[4200];
    snprintf(p, sizeof p, "cat %s/err", dir);
    k3t_run(p, err, NULL);
}

K3_TEST_TIMEOUT(dist_a_killed_rank_ends_the_job, 120)
{
    need_mpi();
    const char *dir = k3t_tmpdir();
    models(dir, "--no-tokenizer");   /* no end-of-sequence id: the run goes on */
    char *err = NULL;
    hit_rank(dir, SIGKILL, "600", &err);
    /* the launcher sees the death and names the rank */
    CHECK_STR_CONTAINS(err, "rank 2");
    CHECK_STR_CONTAINS(err, "signal 9");
    free(err);
}

K3_TEST_TIMEOUT(dist_a_stopped_rank_ends_the_job_after_the_timeout, 120)
{
    need_mpi();
    const char *dir = k3t_tmpdir();
    models(dir, "--no-tokenizer");   /* no end-of-sequence id: the run goes on */
    char *err = NULL;
    hit_rank(dir, SIGSTOP, "3", &err);
    /* the launcher sees nothing: a waiting rank's timeout ends the job */
    CHECK_STR_CONTAINS(err, "no answer from the other ranks within 3 s");
    free(err);
}

/* k3-serve-mpi on 3 ranks answers as k3-serve does: the same bodies for
 * greedy and seeded requests sent together (one batch). */
K3_TEST_TIMEOUT(dist_serve_answers_as_one_process, 180)
{
    need_mpi();
    const char *dir = k3t_tmpdir();
    models(dir, "");
    char pk[4200];
    snprintf(pk, sizeof pk, "%s/pk", dir);
    const char *paths[3] = {"/v1/completions", "/v1/completions", "/v1/chat/completions"};
    char *bodies[3] = {
        "{\"prompt\":\"Hello there\",\"max_tokens\":12,\"temperature\":0}",
        "{\"prompt\":\"Once upon\",\"max_tokens\":10,\"temperature\":0.9,\"seed\":3}",
        "{\"messages\":[{\"role\":\"user\",\"content\":\"Hi\"}],\"max_tokens\":8,\"temperature\":0}",
    };
    char *want[3], *got[3];
    k3t_server s;
    k3t_serve_start(&s, pk, "--ram floor");
    k3t_http_all(&s, 3, paths, bodies, want);
    CHECK_EQ_INT(k3t_serve_stop(&s, SIGTERM), 0);
    k3t_serve_start_with(&s, MPIRUN " -np 3", "k3-serve-mpi", pk, "--ram floor");
    k3t_http_all(&s, 3, paths, bodies, got);
    k3t_serve_stop(&s, SIGTERM);
    for (int i = 0; i < 3; i++) {
        char *a = k3t_resp_strip(want[i]), *b = k3t_resp_strip(got[i]);
        CHECK(a && strstr(a, "\"choices\""));
        CHECK_STR_EQ(b, a);
        free(a);
        free(b);
        free(want[i]);
        free(got[i]);
    }
}

/* Streamed at the floor in small pieces, each rank reads only the pieces of
 * its own rows: a byte damaged in rank 1's rows of a matrix is found (the
 * unit's CRC, folded by every rank from every rank's pieces) when rank 1's
 * copy has it, and never read when only rank 0's copy has it. */
K3_TEST_TIMEOUT(dist_each_rank_reads_and_checks_only_its_rows, 180)
{
    need_mpi();
    const char *dir = k3t_tmpdir();
    models(dir, "--no-tokenizer");
    /* layers.0.mlp.gate_proj: its last row is rank 1's of 2; the byte goes
     * into the copy under bad/ */
    CHECK_EQ_INT(k3t_runf(NULL, NULL,
                          "cd %s && mkdir good bad && cp -r pk good/ && cp -r pk bad/ && /usr/bin/python3 -c \""
                          "import json; m = json.load(open('pk/manifest.json')); "
                          "t = [t for t in m['trunk']['tensors'] if t['name'].endswith('layers.0.mlp.gate_proj.weight')][0]; "
                          "p = t['pieces'][0]; u = m['trunk']['units'][p['unit']]; "
                          "f = open('bad/pk/' + m['files'][u['file']]['name'], 'r+b'); "
                          "f.seek(p['offset'] + p['nbytes'] - 7); b = f.read(1); f.seek(-1, 1); "
                          "f.write(bytes([b[0] ^ 0x40]))\"", dir), 0);
    const char *args = "--ids 3,1,4,1,5 --gen 6 --ram floor --ram-piece 8K";
    char *one = NULL, *err = NULL;
    CHECK_EQ_INT(k3t_runf(NULL, &one, "k3-run %s/pk %s --logits-gen %s/ref.f32", dir, args, dir), 0);
    /* the single process reads it: refused */
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-run %s/bad/pk %s", dir, args), 5);
    /* rank 1 has the damage: every rank refuses */
    int rc = k3t_runf(NULL, &err, MPIRUN " -np 1 -wdir %s/good k3-run-mpi pk %s : -np 1 -wdir %s/bad k3-run-mpi pk %s",
                      dir, args, dir, args);
    CHECK_EQ_INT(rc, 5);
    CHECK_STR_CONTAINS(err, "pieces read by 2 ranks");
    free(err);
    err = NULL;
    /* rank 0 has it, but those rows are rank 1's: never read, same logits */
    rc = k3t_runf(NULL, &err, MPIRUN " -np 1 -wdir %s/bad k3-run-mpi pk %s --logits-gen %s/two.f32 : "
                  "-np 1 -wdir %s/good k3-run-mpi pk %s", dir, args, dir, dir, args);
    if (rc)
        fprintf(stderr, "%s", err);
    CHECK_EQ_INT(rc, 0);
    char a[4200], b[4200];
    snprintf(a, sizeof a, "%s/ref.f32", dir);
    snprintf(b, sizeof b, "%s/two.f32", dir);
    CHECK(same_file(a, b));
    /* and rank 0 read less of the trunk per token than one process */
    const char *p1 = strstr(one, "decode"), *p2 = strstr(err, "decode");
    CHECK(p1 && p2);
    p1 = p1 ? strstr(p1, "trunk") : NULL;
    p2 = p2 ? strstr(p2, "trunk") : NULL;
    CHECK(p1 && p2 && strtod(p2 + 5, NULL) < 0.85 * strtod(p1 + 5, NULL));
    free(one);
    free(err);
}

/* k3-pack --ranks N --rank R: each rank's disk holds its slice only (the
 * other ranks' pieces and experts are holes), k3-verify checks a slice, the
 * slices run as their ranks with the bits of one process, and only so. */
K3_TEST_TIMEOUT(dist_rank_slices_hold_less_verify_and_run_as_their_ranks, 240)
{
    need_mpi();
    const char *dir = k3t_tmpdir();
    models(dir, "--no-tokenizer");
    const char *args = "--ids 3,1,4,1,5,9,2 --gen 6 --ram-piece 8K";
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-run %s/pk %s --ram floor --logits-gen %s/ref.f32", dir, args, dir), 0);
    char *out = NULL, *err = NULL;
    for (int n = 2; n <= 3; n++) {
        char cmd[8192] = "", big[8192] = "";
        for (int r = 0; r < n; r++) {
            CHECK_EQ_INT(k3t_runf(NULL, NULL, "mkdir -p %s/n%d/r%d && k3-pack --ranks %d --rank %d --ram-piece 8K "
                                  "--quiet %s/pk %s/n%d/r%d/pk", dir, n, r, n, r, dir, dir, n, r), 0);
            CHECK_EQ_INT(k3t_runf(&out, NULL, "k3-verify %s/n%d/r%d/pk", dir, n, r), 0);
            CHECK_STR_CONTAINS(out, "slice: rank");
            free(out);
            out = NULL;
            /* less on disk than the whole model */
            CHECK_EQ_INT(k3t_runf(&out, NULL, "echo $(( $(du -sk %s/n%d/r%d/pk | cut -f1) < $(du -sk %s/pk | cut -f1) ))",
                                  dir, n, r, dir), 0);
            CHECK_STR_EQ(out, "1\n");
            free(out);
            out = NULL;
            size_t l = strlen(cmd), lb = strlen(big);
            snprintf(cmd + l, sizeof cmd - l, "%s -np 1 -wdir %s/n%d/r%d k3-run-mpi pk %s %s", r ? " :" : "", dir, n, r,
                     args, r ? "" : "--logits-gen ../../slice.f32");
            snprintf(big + lb, sizeof big - lb, "%s -np 1 -wdir %s/n%d/r%d k3-run-mpi pk %s --ram resident %s",
                     r ? " :" : "", dir, n, r, args, r ? "" : "--logits-gen ../../big.f32");
        }
        /* at the floor, and with a budget that would pin everything (a
         * slice pins nothing: its groups have holes) */
        CHECK_EQ_INT(k3t_runf(NULL, NULL, MPIRUN " %s", cmd), 0);
        CHECK_EQ_INT(k3t_runf(NULL, NULL, MPIRUN " %s", big), 0);
        char a[4200], b[4200], c[4200];
        snprintf(a, sizeof a, "%s/ref.f32", dir);
        snprintf(b, sizeof b, "%s/slice.f32", dir);
        snprintf(c, sizeof c, "%s/big.f32", dir);
        CHECK(same_file(a, b));
        CHECK(same_file(a, c));
        CHECK_EQ_INT(k3t_runf(NULL, NULL, "rm %s %s", b, c), 0);
    }
    /* a slice alone, or as another rank: refused with one line */
    CHECK_EQ_INT(k3t_runf(NULL, &err, "k3-run %s/n2/r1/pk --ids 1,2 --gen 1", dir), 2);
    CHECK_STR_CONTAINS(err, "is the slice of rank 1 of 2 ranks (k3-pack --ranks)");
    free(err);
    err = NULL;
    CHECK(k3t_runf(NULL, &err, MPIRUN " -np 1 -wdir %s/n2/r1 k3-run-mpi pk --ids 1,2 --gen 1 : -np 1 -wdir %s/n2/r0 "
                   "k3-run-mpi pk --ids 1,2 --gen 1", dir, dir) == 2);
    CHECK_STR_CONTAINS(err, "it runs only as rank 1 of a 2-rank");
    free(err);
    err = NULL;
    /* a kept byte damaged: k3-verify names the unit; the destination is never overwritten */
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "cd %s/n2/r0/pk && /usr/bin/python3 -c \""
                          "import json; m = json.load(open('manifest.json')); u = m['plan']['slice']['units'][0]; "
                          "k = u['kept'][0]; f = open(m['files'][m['trunk']['units'][u['unit']]['file']]['name'], 'r+b'); "
                          "f.seek(k[0] + 100); b = f.read(1); f.seek(-1, 1); f.write(bytes([b[0] ^ 1]))\"", dir), 0);
    CHECK_EQ_INT(k3t_runf(&out, NULL, "k3-verify %s/n2/r0/pk", dir), 1);
    CHECK_STR_CONTAINS(out, "bytes kept by the slice");
    CHECK_STR_CONTAINS(out, "CRC32 mismatch");
    free(out);
    CHECK_EQ_INT(k3t_runf(NULL, &err, "k3-pack --ranks 2 --rank 0 %s/pk %s/n2/r0/pk", dir, dir), 7);
    CHECK_STR_CONTAINS(err, "exists");
    free(err);
}

/* The other paths over the engine API keep the bits too: a chat turn, a
 * saved state (the same bytes) and a loaded one, speculative decoding. */
K3_TEST_TIMEOUT(dist_chat_state_files_and_speculation_are_those_of_one_process, 240)
{
    need_mpi();
    const char *dir = k3t_tmpdir();
    models(dir, "");
    static const char *const runs[][2] = {
        {"printf 'Hello\\n' |", "--chat --gen 6 --ram floor"},
        {"", "--ids 1,2,3 --gen 3 --json --quiet --state-save %s/STATE"},
        {"", "--ids 1,2,3,4,5 --gen 4 --json --quiet --state-load %s/one.st"},
        {"", "--ids 5,6,5,6,5,6 --gen 12 --spec ngram:4 --json --quiet --ram floor"},
    };
    for (size_t i = 0; i < sizeof runs / sizeof runs[0]; i++) {
        char args[8192], a1[8192], an[8192];
        snprintf(args, sizeof args, runs[i][1], dir);
        /* the state files: one.st from one process, two.st from the ranks */
        snprintf(a1, sizeof a1, "%s", args);
        snprintf(an, sizeof an, "%s", args);
        char *p;
        if ((p = strstr(a1, "STATE")))
            memcpy(p, "one.st", 6), p[6] = 0;
        if ((p = strstr(an, "STATE")))
            memcpy(p, "two.st", 6), p[6] = 0;
        char *one = NULL, *many = NULL;
        CHECK_EQ_INT(k3t_runf(&one, NULL, "%s k3-run %s/pk %s 2>/dev/null", runs[i][0], dir, a1), 0);
        CHECK_EQ_INT(k3t_runf(&many, NULL, "%s " MPIRUN " -np 2 k3-run-mpi %s/pk %s 2>/dev/null", runs[i][0], dir, an),
                     0);
        if (strstr(args, "--json")) {
            char *g1 = gen_ids(one), *g2 = gen_ids(many);
            CHECK(strlen(g1) > 18);
            CHECK_STR_EQ(g2, g1);
            free(g1);
            free(g2);
        } else {
            CHECK(one && strlen(one) > 0);
            CHECK_STR_EQ(many, one);
        }
        free(one);
        free(many);
    }
    char a[4200], b[4200];
    snprintf(a, sizeof a, "%s/one.st", dir);
    snprintf(b, sizeof b, "%s/two.st", dir);
    CHECK(same_file(a, b));
}
