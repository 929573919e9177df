/*
 * t_synth.c - k3-synth, the streaming shard writer and progress lines:
 * determinism per seed, the shard size limit, optional index/tokenizer,
 * sparse = dense minus the zeroed kinds (and holes on disk), the reader
 * indexes what is written, DST is never clobbered, interruption leaves
 * nothing behind, and the tiny model is numerically alive.
 */
#include "k3_cfg.h"
#include "k3_io.h"
#include "k3_kern.h"
#include "k3_progress.h"
#include "k3_st.h"
#include "k3_stw.h"
#include "k3_test.h"

#include "../synth/synth.h"

#include <dirent.h>
#include <fcntl.h>
#include <math.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static char *path_in(const char *dir, const char *name)
{
    char *p;
    if (asprintf(&p, "%s/%s", dir, name) < 0)
        k3t_fail(__FILE__, __LINE__, "out of memory");
    return p;
}

static int exists(const char *dir, const char *name)
{
    char *p = path_in(dir, name);
    struct stat st;
    int r = stat(p, &st) == 0;
    free(p);
    return r;
}

static char *slurp(const char *path, uint64_t *len)
{
    char *buf = NULL;
    k3_err e = {0};
    if (k3_io_read_file(path, 1ull << 30, &buf, len, &e))
        k3t_fail(__FILE__, __LINE__, "%s", e.msg);
    return buf;
}

/* Same file names and byte-identical contents in both directories. */
static int same_dirs(const char *a, const char *b)
{
    DIR *d = opendir(a);
    struct dirent *de;
    int same = 1, n = 0;
    while (d && (de = readdir(d))) {
        if (de->d_name[0] == '.')
            continue;
        n++;
        char *pa = path_in(a, de->d_name), *pb = path_in(b, de->d_name);
        uint64_t la, lb;
        char *x = slurp(pa, &la);
        struct stat st;
        if (stat(pb, &st) != 0) {
            same = 0;
        } else {
            char *y = slurp(pb, &lb);
            if (la != lb || memcmp(x, y, la))
                same = 0;
            free(y);
        }
        free(x);
        free(pa);
        free(pb);
    }
    if (d)
        closedir(d);
    return same && n > 0;
}

static void synth(const char *dst, const char *extra)
{
    char *err = NULL;
    int rc = k3t_runf(NULL, &err, "k3-synth '%s' --preset tiny --quiet %s", dst, extra);
    if (rc != 0)
        k3t_fail(__FILE__, __LINE__, "k3-synth %s: exit %d: %s", extra, rc, err ? err : "");
    free(err);
}

K3_TEST(synth_tiny_is_deterministic_per_seed)
{
    const char *t = k3t_tmpdir();
    char *a = path_in(t, "a"), *b = path_in(t, "b"), *c = path_in(t, "c");
    synth(a, "--seed 7");
    synth(b, "--seed 7");
    synth(c, "--seed 8");
    CHECK(same_dirs(a, b));
    CHECK(!same_dirs(a, c));
    /* the different seed changes the weights, not the layout */
    char *ia = path_in(a, "model.safetensors.index.json"), *ic = path_in(c, "model.safetensors.index.json");
    uint64_t la, lc;
    char *x = slurp(ia, &la), *y = slurp(ic, &lc);
    CHECK_EQ_U64(la, lc);
    CHECK(!memcmp(x, y, la));
    free(x), free(y), free(ia), free(ic), free(a), free(b), free(c);
}

K3_TEST(synth_respects_the_shard_size_limit_and_the_reader_indexes_it)
{
    const char *t = k3t_tmpdir();
    char *d = path_in(t, "ck");
    synth(d, "--shard-size 200K");
    DIR *dir = opendir(d);
    struct dirent *de;
    int shards = 0;
    while ((de = readdir(dir))) {
        size_t n = strlen(de->d_name);
        if (n < 12 || strcmp(de->d_name + n - 12, ".safetensors"))
            continue;
        shards++;
        char *p = path_in(d, de->d_name);
        struct stat st;
        CHECK(stat(p, &st) == 0);
        CHECK(st.st_size <= 200 * 1024);
        free(p);
    }
    closedir(dir);
    CHECK(shards >= 8);
    k3_st *st = NULL;
    k3_err e = {0};
    CHECK_EQ_INT(k3_st_open(&st, d, 0, &e), 0);
    CHECK_EQ_U64(k3_st_shard_count(st), shards);
    const k3_st_tensor *x = k3_st_find(st, "language_model.model.layers.1.block_sparse_moe.experts.15.w2.weight_scale");
    CHECK(x != NULL);
    CHECK_EQ_INT(x->dtype, K3_DT_U8);
    CHECK_EQ_U64(x->shape[0], 64);
    CHECK_EQ_U64(x->shape[1], 1);
    CHECK(k3_st_find(st, "language_model.lm_head.weight") != NULL);
    CHECK(k3_st_find(st, "language_model.model.layers.3.self_attn.kv_a_proj_with_mqa.weight") != NULL);
    CHECK(k3_st_find(st, "language_model.model.layers.2.self_attn.q_conv1d.weight") != NULL);
    k3_st_close(st);
    free(d);
}

K3_TEST(synth_index_and_tokenizer_are_optional)
{
    const char *t = k3t_tmpdir();
    char *d = path_in(t, "ck");
    synth(d, "--no-index --no-tokenizer --shard-size 1G");
    CHECK(exists(d, "config.json"));
    CHECK(exists(d, "model.safetensors"));
    CHECK(!exists(d, "model.safetensors.index.json"));
    CHECK(!exists(d, "tiktoken.model"));
    CHECK(!exists(d, "tokenizer_config.json"));
    k3_st *st = NULL;
    k3_err e = {0};
    CHECK_EQ_INT(k3_st_open(&st, d, 0, &e), 0);
    CHECK(k3_st_tensor_count(st) > 1000);
    k3_st_close(st);
    free(d);
}

/* Count of logical bytes and of bytes allocated on disk in a directory. */
static void dir_sizes(const char *dir, uint64_t *logical, uint64_t *alloc)
{
    DIR *d = opendir(dir);
    struct dirent *de;
    *logical = *alloc = 0;
    while ((de = readdir(d))) {
        if (de->d_name[0] == '.')
            continue;
        char *p = path_in(dir, de->d_name);
        struct stat st;
        CHECK(stat(p, &st) == 0);
        *logical += (uint64_t)st.st_size;
        *alloc += (uint64_t)st.st_blocks * 512;
        free(p);
    }
    closedir(d);
}

static int all_zero(const unsigned char *p, uint64_t n)
{
    for (uint64_t i = 0; i < n; i++)
        if (p[i])
            return 0;
    return 1;
}

/* --sparse keeps the data kinds; --sparse-live the output head and the MXFP4
 * scale bytes too. Both: byte for byte the dense checkpoint where they carry
 * data, zero elsewhere, and holes on disk. */
static void check_sparse_mode(const char *dn, const char *sp, int live)
{
    k3_st *a = NULL, *b = NULL;
    k3_err e = {0};
    CHECK_EQ_INT(k3_st_open(&a, dn, 0, &e), 0);
    CHECK_EQ_INT(k3_st_open(&b, sp, 0, &e), 0);
    CHECK_EQ_U64(k3_st_tensor_count(a), k3_st_tensor_count(b));
    int zeroed = 0, kept = 0, scales = 0;
    for (uint64_t i = 0; i < k3_st_tensor_count(a); i++) {
        const k3_st_tensor *x = k3_st_tensor_at(a, i), *y = k3_st_find(b, x->name);
        CHECK(y != NULL);
        CHECK_EQ_U64(x->nbytes, y->nbytes);
        unsigned char *px = malloc(x->nbytes), *py = malloc(y->nbytes);
        CHECK_EQ_INT(k3_st_read(a, x, px, &e), 0);
        CHECK_EQ_INT(k3_st_read(b, y, py, &e), 0);
        int data = strstr(x->name, "norm") || strstr(x->name, "res_proj") || strstr(x->name, "embed_tokens") ||
                   strstr(x->name, "gate.weight") || strstr(x->name, "bias") || strstr(x->name, "A_log");
        if (strstr(x->name, "gate_proj"))
            data = 0;
        if (live && (strstr(x->name, "lm_head") || strstr(x->name, "weight_scale"))) {
            scales += strstr(x->name, "weight_scale") != NULL;
            data = 1;
        }
        CHECK(!all_zero(px, x->nbytes));
        if (data) {
            if (memcmp(px, py, x->nbytes))
                k3t_fail(__FILE__, __LINE__, "%s differs between dense and sparse", x->name);
            kept++;
        } else {
            if (!all_zero(py, y->nbytes))
                k3t_fail(__FILE__, __LINE__, "%s is not zero in the sparse checkpoint", x->name);
            zeroed++;
        }
        free(px);
        free(py);
    }
    CHECK(zeroed > (live ? 500 : 1000));
    CHECK(kept > 100);
    CHECK(!live || scales > 100);
    k3_st_close(a);
    k3_st_close(b);
    uint64_t ld, ad, ls, as;
    dir_sizes(dn, &ld, &ad);
    dir_sizes(sp, &ls, &as);
    CHECK_EQ_U64(ld, ls);
    CHECK(as < (live ? ad * 9 / 10 : ad / 2));    /* the zeroed kinds are holes */
}

K3_TEST(synth_sparse_equals_dense_except_the_zeroed_kinds)
{
    const char *t = k3t_tmpdir();
    char *dn = path_in(t, "dense"), *sp = path_in(t, "sparse"), *lv = path_in(t, "live");
    synth(dn, "--seed 3 --shard-size 4M");
    synth(sp, "--seed 3 --shard-size 4M --sparse");
    synth(lv, "--seed 3 --shard-size 4M --sparse-live");
    check_sparse_mode(dn, sp, 0);
    check_sparse_mode(dn, lv, 1);
    free(dn);
    free(sp);
    free(lv);
}

/* In a --sparse-live model every block adds zero, so the next id depends on
 * the last id alone: a passage it wrote once, it writes again (what a
 * speculative-decoding benchmark at width needs). */
K3_TEST(synth_sparse_live_text_depends_on_the_last_id_alone)
{
    const char *t = k3t_tmpdir();
    char *lv = path_in(t, "live");
    synth(lv, "--seed 5 --sparse-live");
    char *a = NULL, *b = NULL;
    CHECK_EQ_INT(k3t_runf(&a, NULL, "k3-run %s --ids 7,8,9,40 --gen 12 --json", lv), 0);
    CHECK_EQ_INT(k3t_runf(&b, NULL, "k3-run %s --ids 300,2,40 --gen 12 --json", lv), 0);
    const char *ga = a ? strstr(a, "\"generated_ids\"") : NULL, *gb = b ? strstr(b, "\"generated_ids\"") : NULL;
    CHECK(ga && gb);
    if (ga && gb) {
        size_t n = strcspn(ga, "]");
        CHECK(n == strcspn(gb, "]") && !memcmp(ga, gb, n));
        CHECK(strstr(a, "\"generated_ids\":[0,0,0") == NULL);   /* the head is not zero */
    }
    free(a);
    free(b);
    free(lv);
}

K3_TEST(synth_refuses_an_existing_destination)
{
    const char *t = k3t_tmpdir();
    char *d = path_in(t, "ck");
    synth(d, "");
    char *err = NULL;
    CHECK_EQ_INT(k3t_runf(NULL, &err, "k3-synth '%s' --preset tiny --quiet --seed 2", d), 7);
    CHECK_STR_CONTAINS(err, "k3-synth: error: ");
    CHECK_STR_CONTAINS(err, "already exists");
    free(err);
    /* --force replaces a checkpoint ... */
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-synth '%s' --preset tiny --quiet --seed 2 --force", d), 0);
    CHECK(!exists(t, "ck.tmp"));
    CHECK(!exists(t, "ck.k3-synth-tmp"));
    /* ... but never a directory holding anything else */
    char *other = path_in(d, "notes.txt");
    CHECK_EQ_INT(k3_io_write_file_atomic(other, "keep", 4, &(k3_err){0}), 0);
    CHECK_EQ_INT(k3t_runf(NULL, &err, "k3-synth '%s' --preset tiny --quiet --force", d), 7);
    CHECK_STR_CONTAINS(err, "not part of a k3-synth checkpoint");
    CHECK(exists(d, "notes.txt"));
    CHECK(exists(d, "config.json"));
    free(err);
    free(other);
    free(d);
}

K3_TEST(synth_rejects_bad_options_with_usage_status)
{
    const char *t = k3t_tmpdir();
    char *err = NULL;
    CHECK_EQ_INT(k3t_runf(NULL, &err, "k3-synth %s/x --preset tiny --layers 12x", t), 2);
    CHECK_STR_CONTAINS(err, "k3-synth: error: --layers");
    free(err);
    CHECK_EQ_INT(k3t_runf(NULL, &err, "k3-synth %s/x --preset huge", t), 2);
    CHECK_STR_CONTAINS(err, "unknown preset");
    free(err);
    CHECK_EQ_INT(k3t_runf(NULL, &err, "k3-synth %s/x --preset tiny --shard-size 5Q", t), 2);
    free(err);
    CHECK_EQ_INT(k3t_runf(NULL, &err, "k3-synth --preset tiny"), 2);
    free(err);
    CHECK(!exists(t, "x"));
    char *out = NULL;
    CHECK_EQ_INT(k3t_runf(&out, NULL, "k3-synth --version"), 0);
    CHECK_STR_CONTAINS(out, "k3-synth ");
    CHECK_STR_CONTAINS(out, "kernels: ");
    free(out);
}

K3_TEST_TIMEOUT(synth_interrupted_leaves_nothing_behind, 60)
{
    const char *t = k3t_tmpdir();
    char *d = path_in(t, "big");
    /* a real-width single layer is big enough to be caught mid-write */
    char *cmd;
    CHECK(asprintf(&cmd, "%s/k3-synth", k3t_bindir()) > 0);
    pid_t pid = fork();
    if (pid == 0) {
        int nul = open("/dev/null", O_WRONLY);
        dup2(nul, 2);
        execl(cmd, "k3-synth", d, "--preset", "k3-width", "--layers", "1", "--vocab", "4096", "--quiet", (char *)NULL);
        _exit(127);
    }
    /* Catch it mid-write whatever the machine's speed: as soon as its temporary
       directory appears, stop it, queue the interrupt, and let it run on. */
    char *tmp = path_in(t, "big.k3-synth-tmp");
    struct stat st;
    time_t t0 = time(NULL);
    while (stat(tmp, &st) != 0 && time(NULL) - t0 < 30)
        ;
    CHECK(stat(tmp, &st) == 0);
    kill(pid, SIGSTOP);
    kill(pid, SIGINT);
    kill(pid, SIGCONT);
    int status;
    CHECK(waitpid(pid, &status, 0) == pid);
    CHECK(WIFEXITED(status));
    CHECK_EQ_INT(WEXITSTATUS(status), 130);
    /* nothing of it is left: no checkpoint, no temporary, no sibling */
    DIR *dir = opendir(t);
    CHECK(dir != NULL);
    for (struct dirent *de; dir && (de = readdir(dir));) {
        if (strncmp(de->d_name, "big", 3) == 0)
            fprintf(stderr, "  left behind: %s\n", de->d_name);
        CHECK(strncmp(de->d_name, "big", 3) != 0);
    }
    if (dir)
        closedir(dir);
    free(tmp);
    free(cmd);
    free(d);
}

/* ---- aliveness of the tiny model, straight from the raw weights ---------- */

static float bf16(const unsigned char *p, uint64_t i)
{
    uint32_t u = (uint32_t)(p[2 * i] | p[2 * i + 1] << 8) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Tensor as floats (BF16 or F32), heap. */
static float *load_f(k3_st *st, const char *name, uint64_t *n)
{
    const k3_st_tensor *t = k3_st_find(st, name);
    if (!t)
        k3t_fail(__FILE__, __LINE__, "missing %s", name);
    unsigned char *raw = malloc(t->nbytes);
    k3_err e = {0};
    CHECK_EQ_INT(k3_st_read(st, t, raw, &e), 0);
    uint64_t cnt = t->nbytes / (t->dtype == K3_DT_F32 ? 4 : 2);
    float *f = malloc(cnt * sizeof *f);
    for (uint64_t i = 0; i < cnt; i++)
        if (t->dtype == K3_DT_F32)
            memcpy(&f[i], raw + 4 * i, 4);
        else if (t->dtype == K3_DT_F16)
            f[i] = k3_f16_to_f32((uint16_t)(raw[2 * i] | raw[2 * i + 1] << 8));
        else
            f[i] = bf16(raw, i);
    free(raw);
    if (n)
        *n = cnt;
    return f;
}

static unsigned char *load_u8(k3_st *st, const char *name)
{
    const k3_st_tensor *t = k3_st_find(st, name);
    CHECK(t != NULL);
    unsigned char *raw = malloc(t->nbytes);
    k3_err e = {0};
    CHECK_EQ_INT(k3_st_read(st, t, raw, &e), 0);
    return raw;
}

static void rmsnorm(const float *x, const float *w, float *y, int n)
{
    double ss = 0;
    for (int i = 0; i < n; i++)
        ss += (double)x[i] * x[i];
    float r = (float)(1.0 / sqrt(ss / n + 1e-5));
    for (int i = 0; i < n; i++)
        y[i] = w[i] * x[i] * r;
}

static void topk(const float *s, int n, int k, int *idx)
{
    for (int j = 0; j < k; j++) {
        int best = -1;
        for (int e = 0; e < n; e++) {
            int used = 0;
            for (int q = 0; q < j; q++)
                used |= idx[q] == e;
            if (!used && (best < 0 || s[e] > s[best]))
                best = e;
        }
        idx[j] = best;
    }
}

/* Row r of an MXFP4 matrix with `cols` inputs, dotted with z. */
static float mx_dot(const unsigned char *packed, const unsigned char *scale, int r, int cols, const float *z)
{
    static const float e2m1[16] = {0, .5f, 1, 1.5f, 2, 3, 4, 6, -0.f, -.5f, -1, -1.5f, -2, -3, -4, -6};
    float acc = 0;
    for (int c = 0; c < cols; c++) {
        unsigned char b = packed[r * cols / 2 + c / 2];
        int nib = c % 2 ? b >> 4 : b & 15;
        unsigned char s = scale[r * cols / 32 + c / 32];
        float sc = s == 255 ? 0 : ldexpf(1.0f, (int)s - 127);
        acc += e2m1[nib] * sc * z[c];
    }
    return acc;
}

K3_TEST(synth_tiny_model_is_alive)
{
    const char *t = k3t_tmpdir();
    char *d = path_in(t, "ck");
    synth(d, "--seed 1");
    k3_st *st = NULL;
    k3_err e = {0};
    CHECK_EQ_INT(k3_st_open(&st, d, 0, &e), 0);
    enum { E = 64, NE = 16, K = 2, LAT = 64, I = 32, TOK = 32 };
    const char *P = "language_model.model.layers.1.";
    char name[256];
    float *emb = load_f(st, "language_model.model.embed_tokens.weight", NULL);
    snprintf(name, sizeof name, "%spost_attention_layernorm.weight", P);
    float *nw = load_f(st, name, NULL);
    snprintf(name, sizeof name, "%sblock_sparse_moe.gate.weight", P);
    float *gate = load_f(st, name, NULL);
    snprintf(name, sizeof name, "%sblock_sparse_moe.gate.e_score_correction_bias", P);
    float *bias = load_f(st, name, NULL);
    snprintf(name, sizeof name, "%sblock_sparse_moe.routed_expert_down_proj.weight", P);
    float *down = load_f(st, name, NULL);
    snprintf(name, sizeof name, "%sblock_sparse_moe.experts.0.w1.weight_packed", P);
    unsigned char *w1p = load_u8(st, name);
    snprintf(name, sizeof name, "%sblock_sparse_moe.experts.0.w1.weight_scale", P);
    unsigned char *w1s = load_u8(st, name);
    snprintf(name, sizeof name, "%sblock_sparse_moe.experts.0.w3.weight_packed", P);
    unsigned char *w3p = load_u8(st, name);
    snprintf(name, sizeof name, "%sblock_sparse_moe.experts.0.w3.weight_scale", P);
    unsigned char *w3s = load_u8(st, name);

    int sets[TOK][K], bias_changed = 0, gate_capped = 0, up_capped = 0;
    for (int tk = 0; tk < TOK; tk++) {
        float x[E], s[NE], sb[NE], z[LAT];
        rmsnorm(emb + (uint64_t)tk * 7 * E, nw, x, E);
        for (int ex = 0; ex < NE; ex++) {
            float a = 0;
            for (int c = 0; c < E; c++)
                a += gate[ex * E + c] * x[c];
            s[ex] = 1.0f / (1.0f + expf(-a));
            sb[ex] = s[ex] + bias[ex];
        }
        int plain[K];
        topk(sb, NE, K, sets[tk]);
        topk(s, NE, K, plain);
        if (sets[tk][0] != plain[0] || sets[tk][1] != plain[1])
            bias_changed++;
        for (int l = 0; l < LAT; l++) {
            z[l] = 0;
            for (int c = 0; c < E; c++)
                z[l] += down[l * E + c] * x[c];
        }
        for (int r = 0; r < I; r++) {
            gate_capped += fabsf(mx_dot(w1p, w1s, r, LAT, z)) > 4.0f;
            up_capped += fabsf(mx_dot(w3p, w3s, r, LAT, z)) > 25.0f;
        }
    }
    int distinct = 0;
    for (int a = 0; a < TOK; a++) {
        int seen = 0;
        for (int b = 0; b < a; b++)
            seen |= (sets[a][0] == sets[b][0] && sets[a][1] == sets[b][1]) ||
                    (sets[a][0] == sets[b][1] && sets[a][1] == sets[b][0]);
        distinct += !seen;
    }
    /* routing varies with the token, the bias matters, SiTU caps engage */
    CHECK(distinct >= 8);
    CHECK(bias_changed >= 2);
    CHECK(bias_changed <= TOK - 4);
    CHECK(gate_capped >= TOK * I / 50);
    CHECK(up_capped >= 1);
    /* AttnRes projection makes the block softmax clearly non-uniform */
    float *rn = load_f(st, "language_model.model.layers.5.mlp_res_norm.weight", NULL);
    float *rp = load_f(st, "language_model.model.layers.5.mlp_res_proj.weight", NULL);
    float one[E], sc[4], lo = 1e9f, hi = -1e9f;
    for (int c = 0; c < E; c++)
        one[c] = 1;
    for (int sidx = 0; sidx < 4; sidx++) {
        float k[E];
        rmsnorm(emb + (uint64_t)(sidx * 31 + 2) * E, one, k, E);
        sc[sidx] = 0;
        for (int c = 0; c < E; c++)
            sc[sidx] += k[c] * rn[c] * rp[c];
        lo = fminf(lo, sc[sidx]);
        hi = fmaxf(hi, sc[sidx]);
    }
    CHECK(hi - lo > 0.5f);
    /* KDA conv taps are asymmetric (a tap-order reversal must show) */
    float *cv = load_f(st, "language_model.model.layers.0.self_attn.q_conv1d.weight", NULL);
    int asym = 0;
    for (int ch = 0; ch < 64; ch++)
        asym += fabsf(cv[ch * 4] - cv[ch * 4 + 3]) > 0.05f;
    CHECK(asym > 32);
    free(cv), free(rn), free(rp);
    free(emb), free(nw), free(gate), free(bias), free(down), free(w1p), free(w1s), free(w3p), free(w3s);
    k3_st_close(st);
    free(d);
}

/* ---- the shard writer on its own ---------------------------------------- */

static int fill_pattern(void *ctx, uint64_t i, uint64_t off, uint64_t n, void *buf, k3_err *e)
{
    (void)ctx, (void)e;
    if (i == 1)
        return K3_STW_ZERO;
    for (uint64_t k = 0; k < n; k++)
        ((unsigned char *)buf)[k] = (unsigned char)((off + k) * 31 + i);
    return 0;
}

K3_TEST(stw_stream_matches_dry_run_sizes_and_reads_back)
{
    const char *t = k3t_tmpdir();
    for (int sparse = 0; sparse < 2; sparse++) {
        char *p = path_in(t, sparse ? "s.safetensors" : "d.safetensors");
        k3_stw *dry = NULL, *w = NULL;
        k3_err e = {0};
        CHECK_EQ_INT(k3_stw_create(&dry, NULL, &e), 0);
        CHECK_EQ_INT(k3_stw_create(&w, p, &e), 0);
        uint64_t s0[2] = {3, 5}, s1[1] = {3u << 20}, s2[2] = {1000, 1001};
        const char *names[3] = {"a \"quoted\" name", "zeros", "tail"};
        const uint64_t *shapes[3] = {s0, s1, s2};
        k3_dtype dts[3] = {K3_DT_BF16, K3_DT_U8, K3_DT_U8};
        uint32_t nd[3] = {2, 1, 2};
        for (int i = 0; i < 3; i++) {
            uint64_t pred = k3_stw_size_with(w, names[i], dts[i], nd[i], shapes[i]);
            CHECK_EQ_INT(k3_stw_add(dry, names[i], dts[i], nd[i], shapes[i], &e), 0);
            CHECK_EQ_INT(k3_stw_add(w, names[i], dts[i], nd[i], shapes[i], &e), 0);
            CHECK_EQ_U64(k3_stw_size(w), pred);
        }
        CHECK_EQ_U64(k3_stw_size(dry), k3_stw_size(w));
        CHECK_EQ_INT(k3_stw_begin(w, 0, &e), 0);
        k3_stw_stream_opts so = {256u << 10, 2, sparse, 1, NULL, NULL, NULL};
        CHECK_EQ_INT(k3_stw_stream(w, fill_pattern, NULL, &so, &e), 0);
        CHECK(exists(t, sparse ? "s.safetensors.tmp" : "d.safetensors.tmp"));
        CHECK_EQ_INT(k3_stw_finish(w, &e), 0);
        if (sparse)
            CHECK(k3_stw_bytes_written(w) < k3_stw_size(w) - (2u << 20));
        else
            CHECK_EQ_U64(k3_stw_bytes_written(w), k3_stw_size(w));
        uint64_t size = k3_stw_size(w);
        k3_stw_free(w);
        k3_stw_free(dry);
        struct stat sb;
        CHECK(stat(p, &sb) == 0);
        CHECK_EQ_U64((uint64_t)sb.st_size, size);
        k3_st *st = NULL;
        CHECK_EQ_INT(k3_st_open(&st, p, 0, &e), 0);
        CHECK_EQ_U64(k3_st_tensor_count(st), 3);
        for (int i = 0; i < 3; i++) {
            const k3_st_tensor *x = k3_st_find(st, names[i]);
            CHECK(x != NULL);
            unsigned char *b = malloc(x->nbytes);
            CHECK_EQ_INT(k3_st_read(st, x, b, &e), 0);
            for (uint64_t k = 0; k < x->nbytes; k++) {
                unsigned char want = i == 1 ? 0 : (unsigned char)(k * 31 + (uint64_t)i);
                if (b[k] != want)
                    k3t_fail(__FILE__, __LINE__, "%s byte %llu: %u != %u", names[i], (unsigned long long)k, b[k], want);
            }
            free(b);
        }
        k3_st_close(st);
        free(p);
    }
}

K3_TEST(stw_unfinished_writer_removes_its_temporary)
{
    const char *t = k3t_tmpdir();
    char *p = path_in(t, "x.safetensors");
    k3_stw *w = NULL;
    k3_err e = {0};
    uint64_t shape[1] = {16};
    CHECK_EQ_INT(k3_stw_create(&w, p, &e), 0);
    CHECK_EQ_INT(k3_stw_add(w, "v", K3_DT_F32, 1, shape, &e), 0);
    CHECK_EQ_INT(k3_stw_begin(w, 0, &e), 0);
    CHECK(exists(t, "x.safetensors.tmp"));
    float v[16] = {1};
    CHECK_EQ_INT(k3_stw_write(w, 0, 0, v, sizeof v, &e), 0);
    CHECK_EQ_INT(k3_stw_write(w, 0, 8, v, sizeof v, &e), K3_EARG);
    k3_stw_free(w);
    CHECK(!exists(t, "x.safetensors.tmp"));
    CHECK(!exists(t, "x.safetensors"));
    free(p);
}

/* ---- progress ------------------------------------------------------------ */

K3_TEST(progress_prints_plain_lines_off_a_terminal_and_nothing_when_quiet)
{
    /* off a terminal: plain lines only when asked (K3_PROGRESS_FORCE, --progress);
     * K3_PROGRESS_AUTO prints nothing into a file, nor does quiet */
    FILE *f = tmpfile(), *q = tmpfile(), *au = tmpfile();
    k3_progress *p = k3_progress_create("job", 1000, f, K3_PROGRESS_FORCE);
    k3_progress *pq = k3_progress_create("job", 1000, q, K3_PROGRESS_QUIET);
    k3_progress *pa = k3_progress_create("job", 1000, au, K3_PROGRESS_AUTO);
    k3_progress_add(p, 10);
    usleep(1100 * 1000);
    k3_progress_add(p, 490);   /* past the silent first second: a line */
    k3_progress_add(pq, 500);
    k3_progress_add(pa, 500);
    k3_progress_finish(p);
    k3_progress_finish(pq);
    k3_progress_finish(pa);
    k3_progress_free(p);
    k3_progress_free(pq);
    k3_progress_free(pa);
    CHECK_EQ_INT(ftell(au), 0);
    fclose(au);
    k3_progress_add(NULL, 1);
    k3_progress_free(NULL);
    char buf[1024] = {0};
    rewind(f);
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    CHECK(n > 0);
    CHECK(strchr(buf, '\r') == NULL);
    CHECK_STR_CONTAINS(buf, "job: 500 B / 1.00 kB (50.0%)");
    CHECK_STR_CONTAINS(buf, "ETA");
    CHECK_STR_CONTAINS(buf, "job: 500 B in");
    CHECK_EQ_INT(ftell(q), 0);
    fclose(f);
    fclose(q);
}

K3_TEST(synth_bpe_vocabulary_is_deterministic_and_decomposable)
{
    unsigned char **a, **b;
    uint32_t *la, *lb, na, nb;
    k3_err e = {0};
    CHECK_EQ_INT(k3_synth_bpe_learn(600, &a, &la, &na, &e), 0);
    CHECK_EQ_INT(k3_synth_bpe_learn(600, &b, &lb, &nb, &e), 0);
    CHECK_EQ_INT(na, nb);
    CHECK(na > 400);
    CHECK(na <= 600);
    for (uint32_t r = 0; r < na; r++) {
        CHECK(la[r] == lb[r] && !memcmp(a[r], b[r], la[r]));
        if (r < 256) {
            CHECK(la[r] == 1 && a[r][0] == r);
            continue;
        }
        int ok = 0;   /* some split into two lower ranks exists */
        for (uint32_t cut = 1; cut < la[r] && !ok; cut++) {
            int left = 0, right = 0;
            for (uint32_t q = 0; q < r; q++) {
                left |= la[q] == cut && !memcmp(a[q], a[r], cut);
                right |= la[q] == la[r] - cut && !memcmp(a[q], a[r] + cut, la[r] - cut);
            }
            ok = left && right;
        }
        CHECK(ok);
        for (uint32_t q = 0; q < r; q++)
            CHECK(!(la[q] == la[r] && !memcmp(a[q], a[r], la[r])));
    }
    k3_synth_bpe_free(a, la, na);
    k3_synth_bpe_free(b, lb, nb);
}

/* ---- config forms and expert dtypes -------------------------------------- */

K3_TEST(synth_config_forms_parse_to_the_same_model)
{
    const char *t = k3t_tmpdir();
    char *f = path_in(t, "flat"), *n = path_in(t, "nested");
    synth(f, "--config-form flat");
    synth(n, "--config-form nested");
    k3_cfg a, b;
    k3_err e = {0};
    CHECK_EQ_INT(k3_cfg_load(&a, f, &e), 0);
    CHECK_EQ_INT(k3_cfg_load(&b, n, &e), 0);
    char *ja = k3_cfg_to_json(&a), *jb = k3_cfg_to_json(&b);
    CHECK_STR_EQ(ja, jb);
    CHECK_EQ_INT(a.num_hidden_layers, 13);
    CHECK(a.is_mla[3] && a.is_mla[12] && !a.is_mla[0]);
    CHECK_EQ_INT(a.attn_res_block_size, 4);
    free(ja), free(jb), free(f), free(n);

    /* the full K3 shape: 93 layers, MLA at one-based 4,8,...,92,93 */
    k3_synth_opts o;
    memset(&o, 0, sizeof o);
    CHECK_EQ_INT(k3_synth_preset(&o, "k3", 0, 0, &e), 0);
    char *js = k3_synth_config_json(&o);
    k3_cfg c;
    CHECK_EQ_INT(k3_cfg_parse(&c, js, strlen(js), "config.json", &e), 0);
    CHECK_STR_CONTAINS(js, "\"text_config\"");
    CHECK_STR_CONTAINS(js, "\"linear_attn_config\"");
    int mla = 0;
    for (uint32_t l = 0; l < c.num_hidden_layers; l++)
        mla += c.is_mla[l];
    CHECK_EQ_INT(mla, 24);
    CHECK(c.is_mla[91] && c.is_mla[92] && c.is_mla[87] && !c.is_mla[88]);
    CHECK_EQ_INT(c.num_experts, 896);
    CHECK_EQ_INT(c.vocab_size, 163840);
    free(js);
}

K3_TEST(synth_k3_tensor_list_has_the_real_expert_size)
{
    k3_synth_opts o;
    memset(&o, 0, sizeof o);
    k3_err e = {0};
    CHECK_EQ_INT(k3_synth_preset(&o, "k3", 0, 0, &e), 0);
    k3_synth_tensor *t = NULL;
    uint64_t n = 0, expert = 0;
    CHECK_EQ_INT(k3_synth_tensors(&o, &t, &n, &e), 0);
    /* docs/MODEL.md §2.3 names: 497,052; the real checkpoint has 497,220 (see README) */
    CHECK_EQ_U64(n, 497052);
    for (uint64_t i = 0; i < n; i++)
        if (t[i].layer == 5 && t[i].expert == 9 && t[i].kind >= SK_EXP_W1_P)
            expert += t[i].bytes;
    CHECK_EQ_U64(expert, 17547264);
    free(t);
}

K3_TEST(synth_bf16_experts_use_plain_weight_names)
{
    const char *t = k3t_tmpdir();
    char *d = path_in(t, "ck");
    synth(d, "--experts bf16 --alog padded");
    k3_st *st = NULL;
    k3_err e = {0};
    CHECK_EQ_INT(k3_st_open(&st, d, 0, &e), 0);
    const k3_st_tensor *w2 = k3_st_find(st, "language_model.model.layers.4.block_sparse_moe.experts.3.w2.weight");
    CHECK(w2 != NULL);
    CHECK_EQ_INT(w2->dtype, K3_DT_BF16);
    CHECK_EQ_U64(w2->shape[0], 64);
    CHECK_EQ_U64(w2->shape[1], 32);
    CHECK(k3_st_find(st, "language_model.model.layers.4.block_sparse_moe.experts.3.w2.weight_packed") == NULL);
    const k3_st_tensor *al = k3_st_find(st, "language_model.model.layers.0.self_attn.A_log");
    CHECK(al != NULL);
    CHECK_EQ_U64(al->shape[0], 16);
    k3_st_close(st);
    char *cfg = path_in(d, "config.json");
    uint64_t len;
    char *txt = slurp(cfg, &len);
    CHECK(strstr(txt, "quantization_config") == NULL);
    free(txt), free(cfg), free(d);
}

K3_TEST(synth_any_byte_range_generates_the_same_bytes)
{
    k3_synth_opts o;
    memset(&o, 0, sizeof o);
    k3_err e = {0};
    CHECK_EQ_INT(k3_synth_preset(&o, "tiny", 0, 600, &e), 0);
    o.vec_dtype = K3_SYNTH_VEC_MIXED;
    k3_synth_tensor *t = NULL;
    uint64_t n = 0;
    CHECK_EQ_INT(k3_synth_tensors(&o, &t, &n, &e), 0);
    int kinds_seen[4] = {0};
    for (uint64_t i = 0; i < n; i++) {
        int cls = t[i].dtype == K3_DT_BF16 ? 0 : t[i].dtype == K3_DT_F32 ? 1 : t[i].kind == SK_EXP_W1_S ? 2 : 3;
        if (kinds_seen[cls]++ > 2)
            continue;
        uint64_t nb = t[i].bytes;
        unsigned char *whole = malloc(nb), *parts = malloc(nb);
        CHECK_EQ_INT(k3_synth_fill(&o, &t[i], 0, nb, whole), 0);
        /* ragged pieces: odd offsets, single words (the scalar path), tails */
        uint64_t off = 0, step = 1;
        while (off < nb) {
            uint64_t m = step < nb - off ? step : nb - off;
            CHECK_EQ_INT(k3_synth_fill(&o, &t[i], off, m, parts + off), 0);
            off += m;
            step = step * 3 % 37 + 1;
        }
        if (memcmp(whole, parts, nb)) {
            char name[256];
            k3_synth_tensor_name(&t[i], name, sizeof name);
            k3t_fail(__FILE__, __LINE__, "%s: piecewise generation differs", name);
        }
        free(whole);
        free(parts);
    }
    CHECK(kinds_seen[0] && kinds_seen[1] && kinds_seen[2] && kinds_seen[3]);
    free(t);
}
