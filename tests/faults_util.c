/*
 * faults_util.c - the fault-injection tests' shared probes and checks (see
 * faults_util.h).
 */
#include "faults_util.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "k3_test.h"

/* ------------------------------------------------------------ soft checks */

int ft_nbad;

void ft_bad(const char *cell, const char *fmt, ...)
{
    va_list ap;
    ft_nbad++;
    fprintf(stderr, "  cell %s: ", cell);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
}

/* The last line of a tool's stderr (k3-run --ram prints its plan first). */
const char *ft_tail(const char *err)
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

char *ft_slurp(const char *path, uint64_t *len)
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

int ft_exists(const char *path)
{
    struct stat st;
    return stat(path, &st) == 0;
}

void ft_join(char *out, const char *dir, const char *name)
{
    if (snprintf(out, 4096, "%s/%s", dir, name) >= 4096)
        k3t_fail(__FILE__, __LINE__, "path too long: %s/%s", dir, name);
}

/* Offset of the first occurrence of c in the file. */
uint64_t ft_first_char(const char *path, char c)
{
    uint64_t n;
    char *b = ft_slurp(path, &n);
    CHECK(b != NULL);
    char *p = memchr(b, c, n);
    CHECK(p != NULL);
    uint64_t off = (uint64_t)(p - b);
    free(b);
    return off;
}

int ft_hexd(int c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); }

/* A hex digit of the first "sha256" value of a manifest whose flip is still
 * a hex digit: the JSON parses, only the self-hash can tell. */
uint64_t ft_hash_digit(const char *path)
{
    uint64_t n;
    char *b = ft_slurp(path, &n);
    CHECK(b != NULL);
    char *p = strstr(b, "\"sha256\":");
    CHECK(p != NULL);
    p = strchr(p + 9, '"');
    CHECK(p != NULL);
    p++;
    while (*p && !(ft_hexd(*p) && ft_hexd(*p ^ 1)))
        p++;
    CHECK(*p);
    uint64_t off = (uint64_t)(p - b);
    free(b);
    return off;
}

/* ------------------------------------------------------------ safetensors */

uint64_t ft_st_hlen(const char *path)
{
    uint64_t n;
    char *b = ft_slurp(path, &n);
    CHECK(b != NULL && n >= 8);
    uint64_t h = 0;
    for (int i = 7; i >= 0; i--)
        h = h << 8 | (uint8_t)b[i];
    free(b);
    CHECK(h + 8 <= n);
    return h;
}

/* Middle byte of the data of the first tensor whose name contains sub. */
uint64_t ft_st_tensor_mid(const char *path, const char *sub)
{
    uint64_t h = ft_st_hlen(path), n;
    char *b = ft_slurp(path, &n);
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
uint64_t ft_st_offsets_digit(const char *path)
{
    uint64_t h = ft_st_hlen(path), n;
    char *b = ft_slurp(path, &n);
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

/* ------------------------------------------------------------ ft_packed model */


void ft_packed_open(ft_packed *p, const char *dir)
{
    char path[4096];
    ft_join(path, dir, "manifest.json");
    char *t = ft_slurp(path, NULL);
    CHECK(t != NULL);
    p->man = cJSON_Parse(t);
    free(t);
    CHECK(p->man != NULL);
    ft_join(path, dir, "experts.idx");
    p->idx = (uint8_t *)ft_slurp(path, &p->idx_len);
    CHECK(p->idx != NULL);
}

void ft_packed_close(ft_packed *p)
{
    cJSON_Delete(p->man);
    free(p->idx);
}

uint64_t ft_jnum(const cJSON *o, const char *k)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, k);
    CHECK(cJSON_IsNumber(v));
    return (uint64_t)v->valuedouble;
}

const char *ft_file_name(const ft_packed *p, uint64_t i)
{
    const cJSON *f = cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(p->man, "files"), (int)i);
    const cJSON *n = cJSON_GetObjectItemCaseSensitive(f, "name");
    CHECK(cJSON_IsString(n));
    return n->valuestring;
}

int ft_nunits(const ft_packed *p)
{
    return cJSON_GetArraySize(
        cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(p->man, "trunk"), "units"));
}

/* The middle byte of trunk unit u: file name and offset. */
uint64_t ft_unit_mid(const ft_packed *p, int u, const char **name)
{
    const cJSON *units =
        cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(p->man, "trunk"), "units");
    const cJSON *x = cJSON_GetArrayItem(units, u);
    CHECK(x != NULL);
    *name = ft_file_name(p, ft_jnum(x, "file"));
    return ft_jnum(x, "offset") + ft_jnum(x, "nbytes") / 2;
}

uint32_t ft_le32(const uint8_t *b) { return (uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 | (uint32_t)b[3] << 24; }

/* A byte inside the record of expert e of absolute layer l. */
uint64_t ft_expert_byte(const ft_packed *p, uint32_t l, uint32_t e, const char **name)
{
    const cJSON *cfg = cJSON_GetObjectItemCaseSensitive(p->man, "config");
    uint32_t first = (uint32_t)ft_jnum(cfg, "first_k_dense_replace");
    uint32_t ne = ft_le32(p->idx + 20);
    CHECK(l >= first && e < ne);
    uint64_t k = (uint64_t)(l - first) * ne + e;
    CHECK(64 + 16 * (k + 1) <= p->idx_len);
    const uint8_t *ent = p->idx + 64 + 16 * k;
    uint64_t off = ft_le32(ent + 8) | (uint64_t)ft_le32(ent + 12) << 32;
    *name = ft_file_name(p, ft_le32(ent));
    return off + 777;
}

/* The first expert a run of RUN_IDS asks for (from its --trace). */
void ft_first_expert(const char *pk, uint32_t *l, uint32_t *e)
{
    char tr[4096];
    ft_join(tr, k3t_tmpdir(), "trace.txt");
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-run %s " RUN_IDS " --ram floor --trace %s", pk, tr), 0);
    char *t = ft_slurp(tr, NULL);
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

/* ------------------------------------------------------------ ft_fixture */


void ft_fixture_make(ft_fixture *f, int repack)
{
    const char *t = k3t_tmpdir();
    ft_join(f->up, t, "up");
    ft_join(f->pk, t, "pk");
    ft_join(f->pf, t, "pf");
    ft_join(f->sums, t, "sums.txt");
    ft_join(f->out, t, "out");
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-synth %s --preset tiny --quiet", f->up), 0);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-convert --quiet %s %s", f->up, f->pk), 0);
    if (repack)
        CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-pack --quiet --ram floor %s %s", f->pk, f->pf), 0);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "cd %s && sha256sum * > %s", f->up, f->sums), 0);
}

/* Remove what a failed run may have left at dst. */
void ft_clean(const char *dst)
{
    k3t_runf(NULL, NULL, "rm -rf %s %s.k3-pack-tmp %s.tmp", dst, dst, dst);
}

/* ------------------------------------------------------------ checks */

/* Exactly one "error:" line, "k3-TOOL: error: ...", naming file. */
void ft_one_error_line(const char *cell, const char *tool, const char *err, const char *file)
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
        ft_bad(cell, "%d error lines on stderr (want 1): %s", n, ft_tail(err));
        return;
    }
    char pre[64];
    snprintf(pre, sizeof pre, "%s: error: ", tool);
    const char *nl = strchr(hit, '\n');
    char buf[2048];
    snprintf(buf, sizeof buf, "%.*s", (int)(nl ? nl - hit : (long)strlen(hit)), hit);
    if (strncmp(buf, pre, strlen(pre)))
        ft_bad(cell, "the error line does not start with \"%s\": %s", pre, buf);
    if (!strstr(buf, file))
        ft_bad(cell, "the error line does not name %s: %s", file, buf);
}

/* dst is absent, or k3-verify rejects it. */
void ft_no_valid_output(const char *cell, const char *dst)
{
    if (!ft_exists(dst))
        return;
    char *out = NULL;
    int st = k3t_runf(&out, NULL, "k3-verify %s", dst);
    if (st == 0)
        ft_bad(cell, "the failed run left %s and k3-verify accepts it", dst);
    free(out);
    /* and k3-run refuses it before any token */
    out = NULL;
    st = k3t_runf(&out, NULL, "k3-run %s " RUN_IDS, dst);
    if (st == 0 || (out && *out))
        ft_bad(cell, "k3-run ran the model left at %s (status %d, stdout \"%s\")", dst, st, out ? out : "");
    free(out);
}


const char *ft_kinds[3] = {"eio", "short", "flip"};

int ft_want_for(const ft_target *t, int kind) { return kind < 2 ? 4 : t->flip; }

void ft_tset(ft_target *t, const char *what, const char *file, uint64_t off, int flip)
{
    t->what = what;
    snprintf(t->file, sizeof t->file, "%s", file);
    t->off = off;
    t->flip = flip;
}


int ft_upstream_targets(const ft_fixture *f, ft_target *t)
{
    char shard[4096], p[4096];
    const char *sname = "model-00002-of-00005.safetensors";
    ft_join(shard, f->up, sname);
    int n = 0;
    ft_tset(&t[n++], "shard header length", sname, 3, 3);
    ft_tset(&t[n++], "shard header data_offsets", sname, ft_st_offsets_digit(shard), 3);
    ft_tset(&t[n++], "shard trunk tensor data", sname, ft_st_tensor_mid(shard, "norm"), 0);
    ft_tset(&t[n++], "shard expert tensor data", sname, ft_st_tensor_mid(shard, ".experts."), 0);
    ft_join(p, f->up, "model.safetensors.index.json");
    ft_tset(&t[n++], "index json", "model.safetensors.index.json", ft_first_char(p, ':'), 3);
    ft_join(p, f->up, "config.json");
    ft_tset(&t[n++], "config json", "config.json", ft_first_char(p, ':'), 3);
    ft_join(p, f->up, "tiktoken.model");
    ft_tset(&t[n++], "tiktoken.model", "tiktoken.model", 100, 0);
    ft_join(p, f->up, "tokenizer_config.json");
    ft_tset(&t[n++], "tokenizer_config.json", "tokenizer_config.json", ft_first_char(p, ':'), 0);
    return n;
}

int ft_packed_targets(const char *dir, ft_target *t, const ft_fixture *f)
{
    ft_packed p;
    ft_packed_open(&p, dir);
    char path[4096];
    const char *name;
    int n = 0;
    ft_join(path, dir, "manifest.json");
    ft_tset(&t[n++], "manifest.json syntax", "manifest.json", ft_first_char(path, ':'), 3);
    ft_tset(&t[n++], "manifest.json hash digit", "manifest.json", ft_hash_digit(path), 5);
    ft_tset(&t[n++], "experts.idx entry", "experts.idx", 64 + 16 * 5 + 4, 5);
    int nu = ft_nunits(&p);
    /* unit 0 holds the embedding table, read a row at a time: see
     * embed_row_byte */
    int us[3] = {1, nu / 2, nu - 1};
    static const char *uw[3] = {"trunk unit 1", "middle trunk unit", "last trunk unit"};
    for (int i = 0; i < 3; i++) {
        uint64_t off = ft_unit_mid(&p, us[i], &name);
        ft_tset(&t[n++], uw[i], name, off, 5);
    }
    uint32_t l, e;
    ft_first_expert(f->pk, &l, &e);
    uint64_t off = ft_expert_byte(&p, l, e, &name);
    ft_tset(&t[n++], "expert record the run reads", name, off, 5);
    ft_join(path, dir, "tiktoken.model");
    ft_tset(&t[n++], "tiktoken.model", "tiktoken.model", 0, 3);
    ft_join(path, dir, "tokenizer_config.json");
    ft_tset(&t[n++], "tokenizer_config.json", "tokenizer_config.json", ft_first_char(path, ':'), 3);
    ft_packed_close(&p);
    return n;
}
