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

#include "k3_test.h"

#define RUN_IDS "--ids 5,9,2,7 --gen 3 --threads 1"

/* ------------------------------------------------------------ soft checks */

static int nbad;

static void bad(const char *cell, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void bad(const char *cell, const char *fmt, ...)
{
    va_list ap;
    nbad++;
    fprintf(stderr, "  cell %s: ", cell);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
}

/* The last line of a tool's stderr (k3-run --ram prints its plan first). */
static const char *tail(const char *err)
{
    static char buf[1024];
    if (!err)
        return "";
    size_t n = strlen(err);
    while (n && err[n - 1] == '\n')
        n--;
    size_t b = n;
    while (b && err[b - 1] != '\n')
        b--;
    snprintf(buf, sizeof buf, "%.*s", (int)(n - b), err + b);
    return buf;
}

/* ------------------------------------------------------------ files */

static char *slurp(const char *path, uint64_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *b = malloc((size_t)n + 1);
    if (b && fread(b, 1, (size_t)n, f) != (size_t)n) {
        free(b);
        b = NULL;
    }
    fclose(f);
    if (b) {
        b[n] = 0;
        if (len)
            *len = (uint64_t)n;
    }
    return b;
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

/* Offset of the first occurrence of c in the file. */
static uint64_t first_char(const char *path, char c)
{
    uint64_t n;
    char *b = slurp(path, &n);
    CHECK(b != NULL);
    char *p = memchr(b, c, n);
    CHECK(p != NULL);
    uint64_t off = (uint64_t)(p - b);
    free(b);
    return off;
}

static int hexd(int c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); }

/* A hex digit of the first "sha256" value of a manifest whose flip is still
 * a hex digit: the JSON parses, only the self-hash can tell. */
static uint64_t hash_digit(const char *path)
{
    uint64_t n;
    char *b = slurp(path, &n);
    CHECK(b != NULL);
    char *p = strstr(b, "\"sha256\":");
    CHECK(p != NULL);
    p = strchr(p + 9, '"');
    CHECK(p != NULL);
    p++;
    while (*p && !(hexd(*p) && hexd(*p ^ 1)))
        p++;
    CHECK(*p);
    uint64_t off = (uint64_t)(p - b);
    free(b);
    return off;
}

/* ------------------------------------------------------------ safetensors */

static uint64_t st_hlen(const char *path)
{
    uint64_t n;
    char *b = slurp(path, &n);
    CHECK(b != NULL && n >= 8);
    uint64_t h = 0;
    for (int i = 7; i >= 0; i--)
        h = h << 8 | (uint8_t)b[i];
    free(b);
    CHECK(h + 8 <= n);
    return h;
}

/* Middle byte of the data of the first tensor whose name contains sub. */
static uint64_t st_tensor_mid(const char *path, const char *sub)
{
    uint64_t h = st_hlen(path), n;
    char *b = slurp(path, &n);
    cJSON *j = cJSON_ParseWithLength(b + 8, (size_t)h);
    CHECK(j != NULL);
    uint64_t off = 0;
    for (cJSON *t = j->child; t && !off; t = t->next) {
        if (!strcmp(t->string, "__metadata__") || !strstr(t->string, sub))
            continue;
        cJSON *d = cJSON_GetObjectItemCaseSensitive(t, "data_offsets");
        uint64_t a = (uint64_t)cJSON_GetArrayItem(d, 0)->valuedouble;
        uint64_t e = (uint64_t)cJSON_GetArrayItem(d, 1)->valuedouble;
        if (e > a)
            off = 8 + h + (a + e) / 2;
    }
    cJSON_Delete(j);
    free(b);
    CHECK(off != 0);
    return off;
}

/* The first digit of the first "data_offsets" in the header. */
static uint64_t st_offsets_digit(const char *path)
{
    uint64_t h = st_hlen(path), n;
    char *b = slurp(path, &n);
    b[8 + h] = 0;
    char *p = strstr(b + 8, "\"data_offsets\"");
    CHECK(p != NULL);
    p = strchr(p, '[');
    CHECK(p != NULL);
    while (*p < '0' || *p > '9')
        p++;
    uint64_t off = (uint64_t)(p - b);
    free(b);
    return off;
}

/* ------------------------------------------------------------ packed model */

typedef struct packed {
    cJSON *man;
    uint8_t *idx;
    uint64_t idx_len;
} packed;

static void packed_open(packed *p, const char *dir)
{
    char path[4096];
    join(path, dir, "manifest.json");
    char *t = slurp(path, NULL);
    CHECK(t != NULL);
    p->man = cJSON_Parse(t);
    free(t);
    CHECK(p->man != NULL);
    join(path, dir, "experts.idx");
    p->idx = (uint8_t *)slurp(path, &p->idx_len);
    CHECK(p->idx != NULL);
}

static void packed_close(packed *p)
{
    cJSON_Delete(p->man);
    free(p->idx);
}

static uint64_t jnum(const cJSON *o, const char *k)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, k);
    CHECK(cJSON_IsNumber(v));
    return (uint64_t)v->valuedouble;
}

static const char *file_name(const packed *p, uint64_t i)
{
    const cJSON *f = cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(p->man, "files"), (int)i);
    const cJSON *n = cJSON_GetObjectItemCaseSensitive(f, "name");
    CHECK(cJSON_IsString(n));
    return n->valuestring;
}

static int nunits(const packed *p)
{
    return cJSON_GetArraySize(
        cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(p->man, "trunk"), "units"));
}

/* The middle byte of trunk unit u: file name and offset. */
static uint64_t unit_mid(const packed *p, int u, const char **name)
{
    const cJSON *units =
        cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(p->man, "trunk"), "units");
    const cJSON *x = cJSON_GetArrayItem(units, u);
    CHECK(x != NULL);
    *name = file_name(p, jnum(x, "file"));
    return jnum(x, "offset") + jnum(x, "nbytes") / 2;
}

static uint32_t le32(const uint8_t *b) { return (uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 | (uint32_t)b[3] << 24; }

/* A byte inside the record of expert e of absolute layer l. */
static uint64_t expert_byte(const packed *p, uint32_t l, uint32_t e, const char **name)
{
    const cJSON *cfg = cJSON_GetObjectItemCaseSensitive(p->man, "config");
    uint32_t first = (uint32_t)jnum(cfg, "first_k_dense_replace");
    uint32_t ne = le32(p->idx + 20);
    CHECK(l >= first && e < ne);
    uint64_t k = (uint64_t)(l - first) * ne + e;
    CHECK(64 + 16 * (k + 1) <= p->idx_len);
    const uint8_t *ent = p->idx + 64 + 16 * k;
    uint64_t off = le32(ent + 8) | (uint64_t)le32(ent + 12) << 32;
    *name = file_name(p, le32(ent));
    return off + 777;
}

/* The first expert a run of RUN_IDS asks for (from its --trace). */
static void first_expert(const char *pk, uint32_t *l, uint32_t *e)
{
    char tr[4096];
    join(tr, k3t_tmpdir(), "trace.txt");
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-run %s " RUN_IDS " --ram floor --trace %s", pk, tr), 0);
    char *t = slurp(tr, NULL);
    CHECK(t != NULL);
    char *line = t;
    while (*line == '#')
        line = strchr(line, '\n') + 1;
    unsigned long fw, ll, ee;
    CHECK_EQ_INT(sscanf(line, "%lu %lu %lu", &fw, &ll, &ee), 3);
    *l = (uint32_t)ll;
    *e = (uint32_t)ee;
    free(t);
}

/* ------------------------------------------------------------ fixture */

typedef struct fixture {
    char up[4096], pk[4096], pf[4096], sums[4096], out[4096];
} fixture;

static void fixture_make(fixture *f, int repack)
{
    const char *t = k3t_tmpdir();
    join(f->up, t, "up");
    join(f->pk, t, "pk");
    join(f->pf, t, "pf");
    join(f->sums, t, "sums.txt");
    join(f->out, t, "out");
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-synth %s --preset tiny --quiet", f->up), 0);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-convert --quiet %s %s", f->up, f->pk), 0);
    if (repack)
        CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-pack --quiet --ram floor %s %s", f->pk, f->pf), 0);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "cd %s && sha256sum * > %s", f->up, f->sums), 0);
}

/* Remove what a failed run may have left at dst. */
static void clean(const char *dst)
{
    k3t_runf(NULL, NULL, "rm -rf %s %s.k3-pack-tmp %s.tmp", dst, dst, dst);
}

/* ------------------------------------------------------------ checks */

/* Exactly one "error:" line, "k3-TOOL: error: ...", naming file. */
static void one_error_line(const char *cell, const char *tool, const char *err, const char *file)
{
    int n = 0;
    const char *line = err ? err : "", *hit = NULL;
    while (*line) {
        const char *nl = strchr(line, '\n');
        size_t len = nl ? (size_t)(nl - line) : strlen(line);
        const char *e = strstr(line, "error:");
        if (e && e < line + len) {
            n++;
            hit = line;
        }
        line += len + (nl ? 1 : 0);
    }
    if (n != 1) {
        bad(cell, "%d error lines on stderr (want 1): %s", n, tail(err));
        return;
    }
    char pre[64];
    snprintf(pre, sizeof pre, "%s: error: ", tool);
    const char *nl = strchr(hit, '\n');
    char buf[2048];
    snprintf(buf, sizeof buf, "%.*s", (int)(nl ? nl - hit : (long)strlen(hit)), hit);
    if (strncmp(buf, pre, strlen(pre)))
        bad(cell, "the error line does not start with \"%s\": %s", pre, buf);
    if (!strstr(buf, file))
        bad(cell, "the error line does not name %s: %s", file, buf);
}

/* dst is absent, or k3-verify rejects it. */
static void no_valid_output(const char *cell, const char *dst)
{
    if (!exists(dst))
        return;
    char *out = NULL;
    int st = k3t_runf(&out, NULL, "k3-verify %s", dst);
    if (st == 0)
        bad(cell, "the failed run left %s and k3-verify accepts it", dst);
    free(out);
    /* and k3-run refuses it before any token */
    out = NULL;
    st = k3t_runf(&out, NULL, "k3-run %s " RUN_IDS, dst);
    if (st == 0 || (out && *out))
        bad(cell, "k3-run ran the model left at %s (status %d, stdout \"%s\")", dst, st, out ? out : "");
    free(out);
}

typedef struct target {
    const char *what;
    char file[256]; /* basename (K3_FAULT's SUBSTR) */
    uint64_t off;
    int flip;       /* expected status for a flipped byte */
} target;

static const char *kinds[3] = {"eio", "short", "flip"};

static int want_for(const target *t, int kind) { return kind < 2 ? 4 : t->flip; }

static void tset(target *t, const char *what, const char *file, uint64_t off, int flip)
{
    t->what = what;
    snprintf(t->file, sizeof t->file, "%s", file);
    t->off = off;
    t->flip = flip;
}

/* ------------------------------------------------------------ k3-convert */

static int upstream_targets(const fixture *f, target *t)
{
    char shard[4096], p[4096];
    const char *sname = "model-00002-of-00005.safetensors";
    join(shard, f->up, sname);
    int n = 0;
    tset(&t[n++], "shard header length", sname, 3, 3);
    tset(&t[n++], "shard header data_offsets", sname, st_offsets_digit(shard), 3);
    tset(&t[n++], "shard trunk tensor data", sname, st_tensor_mid(shard, "norm"), 0);
    tset(&t[n++], "shard expert tensor data", sname, st_tensor_mid(shard, ".experts."), 0);
    join(p, f->up, "model.safetensors.index.json");
    tset(&t[n++], "index json", "model.safetensors.index.json", first_char(p, ':'), 3);
    join(p, f->up, "config.json");
    tset(&t[n++], "config json", "config.json", first_char(p, ':'), 3);
    join(p, f->up, "tiktoken.model");
    tset(&t[n++], "tiktoken.model", "tiktoken.model", 100, 0);
    join(p, f->up, "tokenizer_config.json");
    tset(&t[n++], "tokenizer_config.json", "tokenizer_config.json", first_char(p, ':'), 0);
    return n;
}

K3_TEST(faults_convert_read_errors_exit_4_and_leave_no_model)
{
    fixture f;
    fixture_make(&f, 0);
    target t[16];
    int n = upstream_targets(&f, t);
    for (int i = 0; i < n; i++)
        for (int k = 0; k < 2; k++) {
            char cell[256], *err = NULL;
            snprintf(cell, sizeof cell, "k3-convert %s %s@%llu (%s)", kinds[k], t[i].file,
                     (unsigned long long)t[i].off, t[i].what);
            clean(f.out);
            int st = k3t_runf(NULL, &err, "K3_FAULT=%s:%s:%llu k3-convert --quiet %s %s", kinds[k], t[i].file,
                              (unsigned long long)t[i].off, f.up, f.out);
            if (st != 4)
                bad(cell, "status %d, want 4 (%s)", st, tail(err));
            one_error_line(cell, "k3-convert", err, t[i].file);
            no_valid_output(cell, f.out);
            free(err);
        }
    CHECK_EQ_INT(nbad, 0);
}

K3_TEST(faults_convert_flipped_header_or_json_byte_exits_3)
{
    fixture f;
    fixture_make(&f, 0);
    target t[16];
    int n = upstream_targets(&f, t);
    for (int i = 0; i < n; i++) {
        if (t[i].flip != 3)
            continue;
        char cell[256], *err = NULL;
        snprintf(cell, sizeof cell, "k3-convert flip %s@%llu (%s)", t[i].file, (unsigned long long)t[i].off,
                 t[i].what);
        clean(f.out);
        int st = k3t_runf(NULL, &err, "K3_FAULT=flip:%s:%llu k3-convert --quiet %s %s", t[i].file,
                          (unsigned long long)t[i].off, f.up, f.out);
        if (st != 3)
            bad(cell, "status %d, want 3 (%s)", st, tail(err));
        one_error_line(cell, "k3-convert", err, t[i].file);
        no_valid_output(cell, f.out);
        free(err);
    }
    CHECK_EQ_INT(nbad, 0);
}

/* A flipped byte that no header or JSON rule can see: convert cannot know it
 * (exit 0), but the packed model's provenance carries the hash of what was
 * read, so `k3-verify --sums` rejects the result, and the source too. */
static void flipped_data_caught_by_sums(int tokenizer)
{
    fixture f;
    fixture_make(&f, 0);
    target t[16];
    int n = upstream_targets(&f, t);
    int tried = 0;
    for (int i = 0; i < n; i++) {
        if (t[i].flip != 0 || (strstr(t[i].file, "token") != NULL) != tokenizer)
            continue;
        tried++;
        char cell[256], *err = NULL, *out = NULL;
        snprintf(cell, sizeof cell, "k3-convert flip %s@%llu (%s)", t[i].file, (unsigned long long)t[i].off,
                 t[i].what);
        clean(f.out);
        int st = k3t_runf(NULL, &err, "K3_FAULT=flip:%s:%llu k3-convert --quiet %s %s", t[i].file,
                          (unsigned long long)t[i].off, f.up, f.out);
        if (st != 0) {
            bad(cell, "status %d: convert cannot know this byte is wrong (%s)", st, tail(err));
        } else {
            st = k3t_runf(&out, NULL, "k3-verify %s", f.out);
            if (st != 0)
                bad(cell, "without --sums k3-verify should accept what convert wrote: %d", st);
            free(out);
            out = NULL;
            st = k3t_runf(&out, NULL, "k3-verify --sums %s %s", f.sums, f.out);
            if (st != 1)
                bad(cell, "k3-verify --sums of the converted model: status %d, want 1: %s", st, out ? out : "");
            else if (!out || !strstr(out, t[i].file))
                bad(cell, "k3-verify --sums does not name %s: %s", t[i].file, out ? out : "");
        }
        free(out);
        out = NULL;
        st = k3t_runf(&out, NULL, "K3_FAULT=flip:%s:%llu k3-verify --sums %s %s", t[i].file,
                      (unsigned long long)t[i].off, f.sums, f.up);
        if (st != 1 || !out || !strstr(out, t[i].file))
            bad(cell, "k3-verify --sums of the source under the same fault: status %d: %s", st, out ? out : "");
        free(out);
        free(err);
    }
    CHECK(tried >= 2);
    CHECK_EQ_INT(nbad, 0);
}

K3_TEST(faults_convert_flipped_tensor_byte_is_caught_by_verify_sums)
{
    flipped_data_caught_by_sums(0);
}

/* ------------------------------------------------------------ k3-verify */

K3_TEST(faults_verify_upstream_reports_read_errors_as_problems)
{
    fixture f;
    fixture_make(&f, 0);
    target t[16];
    int n = upstream_targets(&f, t);
    for (int i = 0; i < n; i++)
        for (int k = 0; k < 3; k++) {
            /* the tokenizer files are read only with --sums; a flip in tensor
             * data is only visible with --sums */
            int sums = strstr(t[i].file, "token") != NULL || (k == 2 && t[i].flip == 0);
            char cell[256], *out = NULL;
            snprintf(cell, sizeof cell, "k3-verify%s %s %s@%llu (%s)", sums ? " --sums" : "", kinds[k], t[i].file,
                     (unsigned long long)t[i].off, t[i].what);
            int st = k3t_runf(&out, NULL, "K3_FAULT=%s:%s:%llu k3-verify %s%s %s", kinds[k], t[i].file,
                              (unsigned long long)t[i].off, sums ? "--sums " : "", sums ? f.sums : "", f.up);
            if (st != 1)
                bad(cell, "status %d, want 1: %s", st, out ? out : "");
            else if (!out || !strstr(out, t[i].file))
                bad(cell, "the problems do not name %s: %s", t[i].file, out ? out : "");
            free(out);
        }
    CHECK_EQ_INT(nbad, 0);
}

/* Every file of a packed model, with the byte to hit and the status a flip
 * there must give k3-run / k3-pack (k3-verify always says 1). */
static int packed_targets(const char *dir, target *t, const fixture *f)
{
    packed p;
    packed_open(&p, dir);
    char path[4096];
    const char *name;
    int n = 0;
    join(path, dir, "manifest.json");
    tset(&t[n++], "manifest.json syntax", "manifest.json", first_char(path, ':'), 3);
    tset(&t[n++], "manifest.json hash digit", "manifest.json", hash_digit(path), 5);
    tset(&t[n++], "experts.idx entry", "experts.idx", 64 + 16 * 5 + 4, 5);
    int nu = nunits(&p);
    /* unit 0 holds the embedding table, read a row at a time: see
     * embed_row_byte */
    int us[3] = {1, nu / 2, nu - 1};
    static const char *uw[3] = {"trunk unit 1", "middle trunk unit", "last trunk unit"};
    for (int i = 0; i < 3; i++) {
        uint64_t off = unit_mid(&p, us[i], &name);
        tset(&t[n++], uw[i], name, off, 5);
    }
    uint32_t l, e;
    first_expert(f->pk, &l, &e);
    uint64_t off = expert_byte(&p, l, e, &name);
    tset(&t[n++], "expert record the run reads", name, off, 5);
    join(path, dir, "tiktoken.model");
    tset(&t[n++], "tiktoken.model", "tiktoken.model", 0, 3);
    join(path, dir, "tokenizer_config.json");
    tset(&t[n++], "tokenizer_config.json", "tokenizer_config.json", first_char(path, ':'), 3);
    packed_close(&p);
    return n;
}

K3_TEST(faults_verify_packed_full_check_reports_every_fault)
{
    fixture f;
    fixture_make(&f, 1);
    const char *dirs[2] = {f.pk, f.pf};
    for (int d = 0; d < 2; d++) {
        target t[16];
        int n = packed_targets(dirs[d], t, &f);
        for (int i = 0; i < n; i++)
            for (int k = 0; k < 3; k++) {
                char cell[256], *out = NULL;
                snprintf(cell, sizeof cell, "k3-verify %s %s %s@%llu (%s)", d ? "pf" : "pk", kinds[k], t[i].file,
                         (unsigned long long)t[i].off, t[i].what);
                int st = k3t_runf(&out, NULL, "K3_FAULT=%s:%s:%llu k3-verify %s", kinds[k], t[i].file,
                                  (unsigned long long)t[i].off, dirs[d]);
                if (st != 1)
                    bad(cell, "status %d, want 1: %s", st, out ? out : "");
                else if (!out || !strstr(out, t[i].file))
                    bad(cell, "the problems do not name %s: %s", t[i].file, out ? out : "");
                free(out);
            }
    }
    CHECK_EQ_INT(nbad, 0);
}

/* ------------------------------------------------------------ k3-pack */

static void pack_cell(const fixture *f, const target *t, int k, const char *opts)
{
    char cell[512], *err = NULL;
    snprintf(cell, sizeof cell, "k3-pack %s %s %s@%llu (%s)", opts, kinds[k], t->file, (unsigned long long)t->off,
             t->what);
    clean(f->out);
    int st = k3t_runf(NULL, &err, "K3_FAULT=%s:%s:%llu k3-pack --quiet %s --ram floor %s %s", kinds[k], t->file,
                      (unsigned long long)t->off, opts, f->pk, f->out);
    int want = want_for(t, k);
    if (st != want)
        bad(cell, "status %d, want %d (%s)", st, want, tail(err));
    else
        one_error_line(cell, "k3-pack", err, t->file);
    no_valid_output(cell, f->out);
    free(err);
}

K3_TEST(faults_pack_fails_on_bad_source_reads_without_a_model)
{
    fixture f;
    fixture_make(&f, 0);
    char trace[4096];
    join(trace, k3t_tmpdir(), "trace.txt");
    target t[16];
    int n = packed_targets(f.pk, t, &f);
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
    CHECK_EQ_INT(nbad, 0);
}

/* ------------------------------------------------------------ k3-run */

static void run_cell(const char *cell, const char *dir, const char *ram, const char *fault, const char *file,
                     int want, const char *lg)
{
    char *out = NULL, *err = NULL, lga[4200];
    snprintf(lga, sizeof lga, "%s.all", lg);
    unlink(lg);
    unlink(lga);
    int st = k3t_runf(&out, &err, "K3_FAULT=%s k3-run %s " RUN_IDS " %s --logits %s --logits-all %s", fault, dir, ram,
                      lg, lga);
    if (st != want)
        bad(cell, "status %d, want %d (%s)", st, want, tail(err));
    else
        one_error_line(cell, "k3-run", err, file);
    if (out && *out)
        bad(cell, "tokens on stdout: \"%s\"", out);
    if (exists(lg))
        bad(cell, "the --logits file was created");
    if (exists(lga))
        bad(cell, "the --logits-all file was created");
    free(out);
    free(err);
}

K3_TEST(faults_run_stops_before_any_token_at_every_budget)
{
    fixture f;
    fixture_make(&f, 1);
    char lg[4096];
    join(lg, k3t_tmpdir(), "logits.bin");
    const char *dirs[2] = {f.pk, f.pf};
    static const char *rams[4] = {"", "--ram floor", "--ram double", "--ram resident"};
    for (int d = 0; d < 2; d++) {
        target t[16];
        int n = packed_targets(dirs[d], t, &f);
        for (int r = 0; r < 4; r++)
            for (int i = 0; i < n; i++)
                for (int k = 0; k < 3; k++) {
                    char cell[1024], fault[512];
                    snprintf(fault, sizeof fault, "%s:%s:%llu", kinds[k], t[i].file, (unsigned long long)t[i].off);
                    snprintf(cell, sizeof cell, "k3-run %s %s %s (%s)", d ? "pf" : "pk", rams[r], fault, t[i].what);
                    run_cell(cell, dirs[d], rams[r], fault, t[i].file, want_for(&t[i], k), lg);
                }
    }
    CHECK_EQ_INT(nbad, 0);
}

K3_TEST(faults_run_upstream_read_errors_exit_4_before_any_token)
{
    fixture f;
    fixture_make(&f, 0);
    char lg[4096];
    join(lg, k3t_tmpdir(), "logits.bin");
    target t[16];
    int n = upstream_targets(&f, t);
    for (int i = 0; i < n; i++) {
        if (strstr(t[i].file, "experts"))
            continue;
        for (int k = 0; k < 2; k++) {
            char cell[1024], fault[512];
            snprintf(fault, sizeof fault, "%s:%s:%llu", kinds[k], t[i].file, (unsigned long long)t[i].off);
            snprintf(cell, sizeof cell, "k3-run upstream %s (%s)", fault, t[i].what);
            if (strstr(t[i].what, "expert"))
                continue; /* routed experts are read only when chosen */
            run_cell(cell, f.up, "", fault, t[i].file, 4, lg);
        }
    }
    CHECK_EQ_INT(nbad, 0);
}

/* --resume --rehash re-reads the kept output files: a kept file that reads
 * bad (EIO, short, or other bytes than its journal entry's hash) is not
 * kept - its group is converted again, and the result is still exactly the
 * uninterrupted one. */
K3_TEST(faults_convert_resume_rehash_redoes_a_group_whose_kept_file_reads_bad)
{
    fixture f;
    fixture_make(&f, 0);
    for (int k = 0; k < 3; k++) {
        char cell[128], *out = NULL, *err = NULL;
        snprintf(cell, sizeof cell, "k3-convert --resume --rehash, %s in the kept trunk-0000.k3t", kinds[k]);
        clean(f.out);
        CHECK_EQ_INT(k3t_runf(NULL, NULL, "K3_CONVERT_CRASH=journaled:2 k3-convert --quiet %s %s", f.up, f.out),
                     137);
        int st = k3t_runf(&out, &err, "K3_FAULT=%s:trunk-0000.k3t:1000 k3-convert --quiet --json --resume --rehash %s %s",
                          kinds[k], f.up, f.out);
        if (st != 0)
            bad(cell, "status %d (%s)", st, tail(err));
        else if (!out || !strstr(out, "\"groups_skipped\": 2"))
            bad(cell, "group 0 was kept although its file read bad: %s", out ? out : "");
        free(out);
        free(err);
        out = NULL;
        st = k3t_runf(&out, NULL, "diff -r %s %s", f.out, f.pk);
        if (st != 0)
            bad(cell, "the result differs from an uninterrupted run: %s", out ? out : "");
        free(out);
    }
    CHECK_EQ_INT(nbad, 0);
}

/* An expert first asked for by a decode step (from the trace of a run of
 * RUN_IDS with --gen 6): its record is first read after the first token is
 * out. */
static void decode_expert(const char *pk, uint32_t *l, uint32_t *e)
{
    char tr[4096];
    join(tr, k3t_tmpdir(), "trace6.txt");
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-run %s --ids 5,9,2,7 --gen 6 --threads 1 --ram floor --trace %s", pk, tr), 0);
    FILE *f = fopen(tr, "r");
    CHECK(f != NULL);
    char line[256];
    static uint8_t seen[64][256];
    memset(seen, 0, sizeof seen);
    int found = 0;
    while (!found && fgets(line, sizeof line, f)) {
        unsigned long fw, ll, ee;
        if (line[0] == '#' || sscanf(line, "%lu %lu %lu", &fw, &ll, &ee) != 3 || ll >= 64 || ee >= 256)
            continue;
        if (!seen[ll][ee] && fw >= 2) {
            *l = (uint32_t)ll;
            *e = (uint32_t)ee;
            found = 1;
        }
        seen[ll][ee] = 1;
    }
    fclose(f);
    CHECK(found);
}

/* A fault met during generation (an expert record first read by a decode
 * step) stops the run there with the documented status: what was printed
 * before is a prefix of the clean run's text (those tokens came from good
 * bytes), nothing after; --json prints nothing. */
K3_TEST(faults_run_fault_during_generation_stops_with_only_good_tokens_out)
{
    fixture f;
    fixture_make(&f, 1);
    const char *dirs[2] = {f.pk, f.pf};
    static const char *rams[3] = {"", "--ram floor", "--ram resident"};
    for (int d = 0; d < 2; d++) {
        char *clean = NULL;
        CHECK_EQ_INT(k3t_runf(&clean, NULL, "k3-run %s --ids 5,9,2,7 --gen 6 --threads 1", dirs[d]), 0);
        CHECK(clean != NULL && *clean);
        packed p;
        packed_open(&p, dirs[d]);
        uint32_t l = 0, e = 0;
        decode_expert(dirs[d], &l, &e);
        const char *name;
        uint64_t off = expert_byte(&p, l, e, &name);
        for (int r = 0; r < 3; r++)
            for (int k = 0; k < 3; k++)
                for (int j = 0; j < 2; j++) {
                    char cell[1024], *out = NULL, *err = NULL;
                    snprintf(cell, sizeof cell, "k3-run %s %s%s %s:%s:%llu (layer %u expert %u, first read by a decode step)",
                             d ? "pf" : "pk", rams[r], j ? " --json" : "", kinds[k], name, (unsigned long long)off, l, e);
                    int st = k3t_runf(&out, &err, "K3_FAULT=%s:%s:%llu k3-run %s --ids 5,9,2,7 --gen 6 --threads 1 %s %s",
                                      kinds[k], name, (unsigned long long)off, dirs[d], rams[r], j ? "--json" : "");
                    int want = k < 2 ? 4 : 5;
                    if (st != want)
                        bad(cell, "status %d, want %d (%s)", st, want, tail(err));
                    else
                        one_error_line(cell, "k3-run", err, name);
                    size_t n = out ? strlen(out) : 0;
                    if (j && n)
                        bad(cell, "--json printed \"%s\"", out);
                    if (!j && (n == 0 || n >= strlen(clean) || strncmp(out ? out : "", clean, n)))
                        bad(cell, "stdout \"%s\" is not a non-empty strict prefix of the clean run's \"%s\"", out ? out : "", clean);
                    free(out);
                    free(err);
                }
        packed_close(&p);
        free(clean);
    }
    CHECK_EQ_INT(nbad, 0);
}

/* ------------------------------------------------------------ journals */

/* A digit of the value after k2 after k1 in the file whose flip is still a
 * digit of the same kind (the text still parses). */
static uint64_t flip_after(const char *path, const char *k1, const char *k2)
{
    uint64_t n;
    char *b = slurp(path, &n);
    CHECK(b != NULL);
    char *p = strstr(b, k1);
    CHECK(p != NULL);
    p = strstr(p + strlen(k1), k2);
    CHECK(p != NULL);
    p += strlen(k2);
    while (*p && !(hexd(*p) && hexd(*p ^ 1)))
        p++;
    CHECK(*p);
    uint64_t off = (uint64_t)(p - b);
    free(b);
    return off;
}

/* Interrupt k3-convert after group 2's journal entry (groups 0-2 done). */
static void convert_interrupted(const fixture *f)
{
    clean(f->out);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "K3_CONVERT_CRASH=journaled:2 k3-convert --quiet %s %s", f->up, f->out), 137);
}

/* A journal read that fails is no reason to stop: the group is redone. A
 * plan that cannot be read stops --resume with 4 and leaves DST resumable;
 * one that reads as another plan's asks for --force (7). */
K3_TEST(faults_convert_resume_with_an_unreadable_journal_redoes_or_stops_cleanly)
{
    fixture f;
    fixture_make(&f, 0);
    for (int k = 0; k < 2; k++) {
        char cell[256], *out = NULL, *err = NULL;
        snprintf(cell, sizeof cell, "k3-convert --resume, %s reading group-0000.json", kinds[k]);
        convert_interrupted(&f);
        int st = k3t_runf(&out, &err, "K3_FAULT=%s:group-0000.json:0 k3-convert --quiet --json --resume %s %s", kinds[k],
                          f.up, f.out);
        if (st != 0 || !out || !strstr(out, "\"groups_skipped\": 2"))
            bad(cell, "status %d, want 0 with group 0 redone: %s %s", st, out ? out : "", tail(err));
        free(out);
        free(err);
        out = NULL;
        if (k3t_runf(&out, NULL, "diff -r %s %s", f.out, f.pk) != 0)
            bad(cell, "the result differs from an uninterrupted run: %s", out ? out : "");
        free(out);
    }
    char plan[4096];
    join(plan, f.out, ".k3-convert-journal/plan.json");
    for (int k = 0; k < 3; k++) {
        char cell[256], *err = NULL, *out = NULL;
        snprintf(cell, sizeof cell, "k3-convert --resume, %s reading plan.json", kinds[k]);
        convert_interrupted(&f);
        uint64_t off = k < 2 ? 0 : flip_after(plan, "\"fingerprint\"", ":");
        int st = k3t_runf(NULL, &err, "K3_FAULT=%s:plan.json:%llu k3-convert --quiet --resume %s %s", kinds[k],
                          (unsigned long long)off, f.up, f.out);
        int want = k < 2 ? 4 : 7;
        if (st != want)
            bad(cell, "status %d, want %d (%s)", st, want, tail(err));
        else
            one_error_line(cell, "k3-convert", err, k < 2 ? "plan.json" : f.out);
        no_valid_output(cell, f.out);
        free(err);
        if ((st = k3t_runf(NULL, &err, "k3-convert --quiet --resume %s %s", f.up, f.out)) != 0)
            bad(cell, "a clean --resume afterwards: status %d (%s)", st, tail(err));
        else if (k3t_runf(&out, NULL, "diff -r %s %s", f.out, f.pk) != 0)
            bad(cell, "a clean --resume afterwards differs from an uninterrupted run: %s", out ? out : "");
        free(out);
        free(err);
    }
    CHECK_EQ_INT(nbad, 0);
}

/* k3-pack, interrupted after output file 3's journal entry (the trunk file
 * is journaled): an unreadable entry means the file is written again. */
K3_TEST(faults_pack_resume_with_an_unreadable_journal_entry_redoes_the_file)
{
    fixture f;
    fixture_make(&f, 1);
    for (int k = 0; k < 2; k++) {
        char cell[256], *out = NULL, *err = NULL;
        snprintf(cell, sizeof cell, "k3-pack --resume, %s reading trunk-0000.k3t.json", kinds[k]);
        clean(f.out);
        CHECK_EQ_INT(k3t_runf(NULL, NULL, "K3_PACK_CRASH=journaled:3 k3-pack --quiet --ram floor %s %s", f.pk, f.out),
                     137);
        int st = k3t_runf(NULL, &err, "K3_FAULT=%s:trunk-0000.k3t.json:0 k3-pack --quiet --resume --ram floor %s %s",
                          kinds[k], f.pk, f.out);
        if (st != 0)
            bad(cell, "status %d, want 0 (%s)", st, tail(err));
        else if (k3t_runf(&out, NULL, "diff -r %s %s", f.out, f.pf) != 0)
            bad(cell, "the result differs from an uninterrupted run: %s", out ? out : "");
        free(out);
        free(err);
    }
    CHECK_EQ_INT(nbad, 0);
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
    fixture f;
    fixture_make(&f, 0);
    target t[16];
    int n = packed_targets(f.pk, t, &f);
    for (int i = 0; i < n; i++) {
        if (!strstr(t[i].file, "experts-") && !strstr(t[i].file, "token"))
            continue;
        target c = t[i];
        c.flip = 5; /* the source manifest's SHA-256 says the bytes are wrong */
        for (int k = 0; k < 3; k++)
            pack_cell(&f, &c, k, "--copy");
    }
    CHECK_EQ_INT(nbad, 0);
}

/* The embedding table is read a row at a time (the unit's CRC covers the
 * whole table): a flipped byte in the row of a prompt id must still not
 * reach a token. */
K3_TEST(faults_run_flipped_embedding_row_is_caught)
{
    fixture f;
    fixture_make(&f, 1);
    char lg[4096];
    join(lg, k3t_tmpdir(), "logits.bin");
    const char *dirs[2] = {f.pk, f.pf};
    static const char *rams[3] = {"", "--ram floor", "--ram resident"};
    for (int d = 0; d < 2; d++) {
        packed p;
        packed_open(&p, dirs[d]);
        const cJSON *ts =
            cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(p.man, "trunk"), "tensors");
        const cJSON *emb = NULL;
        for (const cJSON *x = ts ? ts->child : NULL; x && !emb; x = x->next) {
            const cJSON *nm = cJSON_GetObjectItemCaseSensitive(x, "name");
            if (cJSON_IsString(nm) && strstr(nm->valuestring, "embed_tokens"))
                emb = x;
        }
        CHECK(emb != NULL);
        const cJSON *pc = cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(emb, "pieces"), 0);
        const cJSON *rows = cJSON_GetObjectItemCaseSensitive(pc, "rows");
        uint64_t r0 = (uint64_t)cJSON_GetArrayItem(rows, 0)->valuedouble;
        uint64_t r1 = (uint64_t)cJSON_GetArrayItem(rows, 1)->valuedouble;
        CHECK(r0 <= 5 && 5 < r1);
        uint64_t rb = jnum(pc, "nbytes") / (r1 - r0);
        const cJSON *units =
            cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(p.man, "trunk"), "units");
        const cJSON *u = cJSON_GetArrayItem(units, (int)jnum(pc, "unit"));
        const char *name = file_name(&p, jnum(u, "file"));
        uint64_t off = jnum(u, "offset") + jnum(pc, "offset") + (5 - r0) * rb + 10; /* RUN_IDS starts with 5 */
        for (int r = 0; r < 3; r++) {
            char cell[1024], fault[512];
            snprintf(fault, sizeof fault, "flip:%s:%llu", name, (unsigned long long)off);
            snprintf(cell, sizeof cell, "k3-run %s %s %s (embedding row 5)", d ? "pf" : "pk", rams[r], fault);
            run_cell(cell, dirs[d], rams[r], fault, name, 5, lg);
        }
        packed_close(&p);
    }
    CHECK_EQ_INT(nbad, 0);
}

static int b64(int c) { return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9'); }

/* The manifest carries the SHA-256 of the tokenizer files: a flipped byte
 * that still parses (another token's bytes) must not turn into text. */
K3_TEST(faults_run_flipped_tokenizer_byte_is_refused)
{
    fixture f;
    fixture_make(&f, 0);
    char *out = NULL;
    CHECK_EQ_INT(k3t_runf(&out, NULL, "k3-run %s " RUN_IDS " --json", f.pk), 0);
    const char *g = out ? strstr(out, "\"generated_ids\":[") : NULL;
    CHECK(g != NULL);
    unsigned long id = strtoul(g + 17, NULL, 10);
    free(out);
    char path[4096];
    join(path, f.pk, "tiktoken.model");
    uint64_t n;
    char *tk = slurp(path, &n);
    CHECK(tk != NULL);
    uint64_t at = 0;
    for (unsigned long line = 0; line < id && at < n; at++)
        line += tk[at] == '\n';
    while (at < n && tk[at] != ' ' && !(b64(tk[at]) && b64(tk[at] ^ 1)))
        at++;
    CHECK(at < n && tk[at] != ' ');
    free(tk);
    char lg[4096], cell[1024], fault[512];
    join(lg, k3t_tmpdir(), "logits.bin");
    snprintf(fault, sizeof fault, "flip:tiktoken.model:%llu", (unsigned long long)at);
    snprintf(cell, sizeof cell, "k3-run pk %s (the line of generated id %lu)", fault, id);
    run_cell(cell, f.pk, "", fault, "tiktoken.model", 5, lg);
    CHECK_EQ_INT(nbad, 0);
}

/* The journals are our own files, but read back they are input like any
 * other: a value in an entry that reads differently (still valid JSON) must
 * not end up in the manifest. --resume must then redo the work or stop; it
 * must never publish a manifest whose hashes, CRCs or provenance are not
 * those of an uninterrupted run. */
static void journal_value_cell(const fixture *f, const char *tool, const char *file, uint64_t off, const char *what,
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
    join(man, f->out, "manifest.json");
    if (st == 0) {
        if (k3t_runf(&out, NULL, "diff -r %s %s", f->out, ref) != 0)
            bad(cell, "status 0 but the result differs from an uninterrupted run: %s", out ? out : "");
    } else {
        one_error_line(cell, tool, err, file);
        if (exists(man))
            no_valid_output(cell, f->out);
    }
    free(out);
    out = NULL;
    if (exists(man) && k3t_runf(&out, NULL, "k3-verify %s", f->out) != 0)
        bad(cell, "manifest.json published and k3-verify rejects it: %s", out ? out : "");
    free(out);
    free(err);
}

K3_TEST(faults_convert_resume_never_trusts_a_journal_value_that_reads_differently)
{
    fixture f;
    fixture_make(&f, 0);
    static const char *k1[3] = {"\"shards\"", "\"files\"", "\"unit_crcs\""};
    static const char *k2[3] = {"\"sha256\":", "\"sha256\":", "["};
    static const char *what[3] = {"the shard's SHA-256 (provenance)", "trunk-0000.k3t's SHA-256",
                                  "unit 0's CRC32"};
    for (int i = 0; i < 3; i++) {
        convert_interrupted(&f);
        char entry[4096];
        join(entry, f.out, ".k3-convert-journal/group-0000.json");
        uint64_t off = flip_after(entry, k1[i], k2[i]);
        journal_value_cell(&f, "k3-convert", "group-0000.json", off, what[i], f.pk);
    }
    CHECK_EQ_INT(nbad, 0);
}

K3_TEST(faults_pack_resume_never_trusts_a_journal_value_that_reads_differently)
{
    fixture f;
    fixture_make(&f, 1);
    static const char *k1[2] = {"\"sha256\"", "\"crc32\""};
    static const char *what[2] = {"trunk-0000.k3t's SHA-256", "unit 0's CRC32"};
    for (int i = 0; i < 2; i++) {
        clean(f.out);
        CHECK_EQ_INT(k3t_runf(NULL, NULL, "K3_PACK_CRASH=journaled:3 k3-pack --quiet --ram floor %s %s", f.pk, f.out),
                     137);
        char entry[4200];
        snprintf(entry, sizeof entry, "%s.k3-pack-tmp/.k3-pack-journal/trunk-0000.k3t.json", f.out);
        uint64_t off = flip_after(entry, k1[i], ":");
        journal_value_cell(&f, "k3-pack", "trunk-0000.k3t.json", off, what[i], f.pf);
    }
    CHECK_EQ_INT(nbad, 0);
}
