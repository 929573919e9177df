/*
 * t_limits.c - every size read from a file is bounded before anything is
 * allocated for it (LIMITS.md lists the bounds).
 *
 * Each test caps the process's address space (RLIMIT_AS) a few MiB above what
 * it uses, then hands a parser a file that claims (or is) more than that: a
 * length prefix, a file size, an id. A parser that checks first answers with
 * the format or limit error; one that allocates first gets NULL from malloc
 * and answers K3_ENOMEM (or crashes) - and the test fails. Big files are
 * sparse (ftruncate), so they cost no disk.
 *
 * Skipped under ASan, whose allocator reserves its address space up front
 * (the cap would not bite); fuzz/run's -malloc_limit_mb covers that build.
 */
#include "k3_cfg.h"
#include "k3_io.h"
#include "k3_man.h"
#include "k3_pk.h"
#include "k3_st.h"
#include "k3_test.h"
#include "k3_tok.h"

#include <fcntl.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#if defined(__SANITIZE_ADDRESS__)
#define K3T_LIM_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define K3T_LIM_ASAN 1
#endif
#endif

#define MiB (1ull << 20)

/* Cap the address space at what the process maps now plus extra bytes.
 * Returns 0 (and the test should stop) where the cap would mean nothing. */
static int cap_address_space(uint64_t extra)
{
#ifdef K3T_LIM_ASAN
    fprintf(stderr, "  (skipped: RLIMIT_AS means nothing under ASan)\n");
    (void)extra;
    return 0;
#else
    FILE *f = fopen("/proc/self/statm", "r");
    CHECK(f != NULL);
    unsigned long long pages = 0;
    CHECK(fscanf(f, "%llu", &pages) == 1);
    fclose(f);
    uint64_t now = pages * (uint64_t)sysconf(_SC_PAGESIZE);
    struct rlimit rl = {now + extra, now + extra};
    CHECK_EQ_INT(setrlimit(RLIMIT_AS, &rl), 0);
    /* the cap bites: a block the size of the claims below cannot be had */
    void *p = malloc(extra + 16 * MiB);
    CHECK(p == NULL);
    return 1;
#endif
}

static void path_in(char *out, size_t cap, const char *name)
{
    snprintf(out, cap, "%s/%s", k3t_tmpdir(), name);
}

/* A file of exactly size bytes, starting with head (the rest a hole). */
static void sparse_file(const char *path, const void *head, size_t head_len, uint64_t size)
{
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    CHECK(fd >= 0);
    CHECK(write(fd, head, head_len) == (ssize_t)head_len);
    CHECK_EQ_INT(ftruncate(fd, (off_t)size), 0);
    close(fd);
}

static void put_le64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

K3_TEST(limits_st_header_length_is_checked_against_the_file_before_allocating)
{
    char path[4096];
    path_in(path, sizeof path, "claims.safetensors");
    /* 99 MiB claimed (under the 100 MiB bound), 4 KiB present */
    uint8_t head[64] = {0};
    put_le64(head, 99 * MiB);
    memcpy(head + 8, "{\"a\":", 5);
    sparse_file(path, head, sizeof head, 4096);
    if (!cap_address_space(48 * MiB))
        return;
    k3_err e = {0};
    k3_st_header h;
    memset(&h, 0, sizeof h);
    int fd = open(path, O_RDONLY);
    CHECK(fd >= 0);
    CHECK_EQ_INT(k3_st_header_read(&h, fd, path, &e), K3_EFORMAT);
    CHECK_STR_CONTAINS(e.msg, "past end of file");
    close(fd);
}

K3_TEST(limits_st_header_longer_than_the_bound_is_refused_even_when_present)
{
    char path[4096];
    path_in(path, sizeof path, "huge.safetensors");
    uint8_t head[16] = {0};
    put_le64(head, (uint64_t)K3_ST_MAX_HEADER + 1);
    sparse_file(path, head, sizeof head, (uint64_t)K3_ST_MAX_HEADER + 4096);
    if (!cap_address_space(48 * MiB))
        return;
    k3_err e = {0};
    k3_st_header h;
    memset(&h, 0, sizeof h);
    int fd = open(path, O_RDONLY);
    CHECK(fd >= 0);
    CHECK_EQ_INT(k3_st_header_read(&h, fd, path, &e), K3_ELIMIT);
    CHECK_STR_CONTAINS(e.msg, "limit");
    close(fd);
}

K3_TEST(limits_st_index_over_its_bound_is_refused_before_reading)
{
    char dir[4096], path[4200];
    snprintf(dir, sizeof dir, "%s", k3t_tmpdir());
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
    sparse_file(path, "{", 1, (1ull << 30) + 1);
    char shard[4200];
    snprintf(shard, sizeof shard, "%s/model-00001-of-00001.safetensors", dir);
    static const char hdr[] = "{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}";
    uint8_t file[128] = {0};
    put_le64(file, sizeof hdr - 1);
    memcpy(file + 8, hdr, sizeof hdr - 1);
    sparse_file(shard, file, 8 + sizeof hdr - 1 + 1, 8 + sizeof hdr - 1 + 1);
    if (!cap_address_space(48 * MiB))
        return;
    k3_err e = {0};
    k3_st *st = NULL;
    CHECK_EQ_INT(k3_st_open(&st, dir, 0, &e), K3_ELIMIT);
    CHECK_STR_CONTAINS(e.msg, "model.safetensors.index.json");
}

K3_TEST(limits_config_over_its_bound_is_refused_before_reading)
{
    char path[4096];
    path_in(path, sizeof path, "config.json");
    sparse_file(path, "{", 1, 16 * MiB + 1);
    if (!cap_address_space(8 * MiB))
        return;
    k3_cfg *cfg = malloc(sizeof *cfg);
    CHECK(cfg != NULL);
    k3_err e = {0};
    CHECK_EQ_INT(k3_cfg_load(cfg, path, &e), K3_ELIMIT);
    CHECK_STR_CONTAINS(e.msg, "config.json");
    free(cfg);
}

K3_TEST(limits_config_counts_are_bounded)
{
    static const char *const cases[] = {
        "{\"num_hidden_layers\": 4294967295}",
        "{\"num_hidden_layers\": 1025}",
        "{\"vocab_size\": 1099511627776}",
        "{\"num_experts\": 16777217}",
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        k3_cfg *cfg = malloc(sizeof *cfg);
        CHECK(cfg != NULL);
        k3_err e = {0};
        int rc = k3_cfg_parse(cfg, cases[i], strlen(cases[i]), "config.json", &e);
        if (rc != K3_EFORMAT && rc != K3_ELIMIT)
            k3t_fail(__FILE__, __LINE__, "%s: rc %d (%s)", cases[i], rc, e.msg);
        free(cfg);
    }
}

K3_TEST(limits_tokenizer_files_over_their_bounds_are_refused_before_reading)
{
    char model[4096], config[4096];
    path_in(model, sizeof model, "tiktoken.model");
    path_in(config, sizeof config, "tokenizer_config.json");
    sparse_file(model, "AA== 0\n", 7, K3_TOK_MODEL_MAX_BYTES + 1);
    sparse_file(config, "{", 1, K3_TOK_CONFIG_MAX_BYTES + 1);
    if (!cap_address_space(8 * MiB))
        return;
    k3_err e = {0};
    k3_tok *tok = NULL;
    CHECK_EQ_INT(k3_tok_open_files(&tok, model, NULL, &e), K3_ELIMIT);
    CHECK_STR_CONTAINS(e.msg, "tiktoken.model");
    /* a valid model, an oversized config */
    char *m = malloc(256 * 16);
    size_t at = 0;
    static const char b64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    for (int b = 0; b < 256; b++)
        at += (size_t)sprintf(m + at, "%c%c== %d\n", b64[b >> 2], b64[(b & 3) << 4], b);
    sparse_file(model, m, at, at);
    free(m);
    k3_err_clear(&e);
    CHECK_EQ_INT(k3_tok_open_files(&tok, model, config, &e), K3_ELIMIT);
    CHECK_STR_CONTAINS(e.msg, "tokenizer_config.json");
}

K3_TEST(limits_tokenizer_special_id_far_past_the_ranks_is_refused)
{
    char model[4096], config[4096];
    path_in(model, sizeof model, "tiktoken.model");
    path_in(config, sizeof config, "tokenizer_config.json");
    char *m = malloc(256 * 16);
    size_t at = 0;
    static const char b64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    for (int b = 0; b < 256; b++)
        at += (size_t)sprintf(m + at, "%c%c== %d\n", b64[b >> 2], b64[(b & 3) << 4], b);
    sparse_file(model, m, at, at);
    free(m);
    /* one special with id 2^32 - 2: a table indexed by id would be 16 GiB */
    static const char cfg[] = "{\"added_tokens_decoder\": {\"4294967294\": {\"content\": \"<x>\"}}}";
    sparse_file(config, cfg, sizeof cfg - 1, sizeof cfg - 1);
    if (!cap_address_space(48 * MiB))
        return;
    k3_err e = {0};
    k3_tok *tok = NULL;
    int rc = k3_tok_open_files(&tok, model, config, &e);
    CHECK(rc == K3_ELIMIT || rc == K3_EFORMAT);
    CHECK_STR_CONTAINS(e.msg, "tokenizer_config.json");
}

K3_TEST(limits_manifest_over_its_bound_is_refused_before_reading)
{
    char path[4200];
    snprintf(path, sizeof path, "%s/manifest.json", k3t_tmpdir());
    sparse_file(path, "{", 1, (uint64_t)K3_MAN_MAX_BYTES + 1);
    if (!cap_address_space(8 * MiB))
        return;
    k3_err e = {0};
    k3_pk *pk = NULL;
    CHECK_EQ_INT(k3_pk_open(&pk, k3t_tmpdir(), 0, &e), K3_ELIMIT);
    CHECK_STR_CONTAINS(e.msg, "manifest.json");
}

K3_TEST(limits_prompt_file_over_its_bound_is_exit_6)
{
#ifdef K3T_LIM_ASAN
    fprintf(stderr, "  (skipped: ASan binaries cannot run under ulimit -v)\n");
    return;
#endif
    char path[4096];
    path_in(path, sizeof path, "prompt.txt");
    sparse_file(path, "hello", 5, (64ull << 20) + 1);
    char *err = NULL;
    /* the tool runs in its own process: cap it with ulimit -v (KiB) */
    int rc = k3t_runf(NULL, &err, "ulimit -v 262144; k3-run --tokenize --prompt-file %s --tok %s", path,
                      k3t_tmpdir());
    CHECK_EQ_INT(rc, 6);
    CHECK_STR_CONTAINS(err, "k3-run: error: ");
    CHECK_STR_CONTAINS(err, "prompt.txt");
    free(err);
}
