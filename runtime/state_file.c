/*
 * state_file.c - state files (layout in state_file.h): the engine's state
 * bytes wrapped with the ids and the model's fingerprint. The bytes of the
 * sequence are the engine's own (k3_seq_state_save / _load); this file only
 * frames, checks and publishes them.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <openssl/evp.h>

#include "k3_crc.h"
#include "k3_io.h"
#include "state_file.h"

#define MAGIC "K3STATE1"
#define HDR 72u
#define VERSION 1u

static void put32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static uint32_t get32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static uint64_t get64(const uint8_t *p) { return (uint64_t)get32(p) | (uint64_t)get32(p + 4) << 32; }

static int hash_file(EVP_MD_CTX *md, const char *dir, const char *name, int required, int *found, k3_err *e)
{
    char path[PATH_MAX];
    int rc = k3_io_path_join(path, sizeof path, dir, name, e);
    if (rc < 0)
        return rc;
    *found = 0;
    if (access(path, F_OK) != 0 && !required)
        return 0;
    char *buf;
    uint64_t len;
    rc = k3_io_read_file(path, 256ull << 20, &buf, &len, e);
    if (rc < 0)
        return rc;
    EVP_DigestUpdate(md, buf, (size_t)len);
    free(buf);
    *found = 1;
    return 0;
}

static int by_name(const struct dirent **a, const struct dirent **b) { return strcmp((*a)->d_name, (*b)->d_name); }

static int is_shard(const struct dirent *d)
{
    size_t n = strlen(d->d_name);
    return n > 12 && !strcmp(d->d_name + n - 12, ".safetensors");
}

/* An upstream checkpoint's weights are too big to hash: each shard (in name
 * order) contributes its name, its size and SAMPLES blocks of 4 KiB evenly
 * spread over it (the whole file when smaller). */
#define SAMPLES 16u
static int hash_shards(EVP_MD_CTX *md, const char *dir, k3_err *e)
{
    struct dirent **list = NULL;
    int n = scandir(dir, &list, is_shard, by_name);
    if (n < 0)
        return k3_err_sys(e, K3_EIO, errno, "%s: cannot list the directory", dir);
    int rc = 0;
    uint8_t *blk = malloc(4096 * SAMPLES);
    if (!blk)
        rc = k3_err_set(e, K3_ENOMEM, "out of memory");
    for (int i = 0; i < n && rc == 0; i++) {
        char path[PATH_MAX];
        rc = k3_io_path_join(path, sizeof path, dir, list[i]->d_name, e);
        int fd = rc == 0 ? k3_io_open_read(path, 0, NULL, e) : -1;
        if (fd < 0) {
            rc = rc ? rc : fd;
            break;
        }
        uint64_t size = 0;
        rc = k3_io_file_size(fd, &size, path, e);
        EVP_DigestUpdate(md, list[i]->d_name, strlen(list[i]->d_name) + 1);
        EVP_DigestUpdate(md, &size, sizeof size);
        uint64_t got = 0;
        if (rc == 0 && size <= 4096ull * SAMPLES) {
            rc = k3_io_pread(fd, blk, size, 0, path, e);
            got = size;
        } else {
            for (uint32_t k = 0; k < SAMPLES && rc == 0; k++) {
                uint64_t off = (size - 4096) / (SAMPLES - 1) * k;
                rc = k3_io_pread(fd, blk + got, 4096, off, path, e);
                got += 4096;
            }
        }
        if (rc == 0)
            EVP_DigestUpdate(md, blk, (size_t)got);
        close(fd);
    }
    for (int i = 0; i < n; i++)
        free(list[i]);
    free(list);
    free(blk);
    return rc;
}

int k3_state_fingerprint(const char *dir, uint8_t fp[32], k3_err *e)
{
    EVP_MD_CTX *md = EVP_MD_CTX_new();
    if (!md || EVP_DigestInit_ex(md, EVP_sha256(), NULL) != 1) {
        EVP_MD_CTX_free(md);
        return k3_err_set(e, K3_ENOMEM, "out of memory for SHA-256");
    }
    static const char tag[] = "k3-state-model-v1\n";
    EVP_DigestUpdate(md, tag, sizeof tag - 1);
    int found = 0;
    int rc = hash_file(md, dir, "manifest.json", 0, &found, e);
    if (rc == 0 && !found) {
        rc = hash_file(md, dir, "config.json", 1, &found, e);
        if (rc == 0)
            rc = hash_file(md, dir, "model.safetensors.index.json", 0, &found, e);
        if (rc == 0)
            rc = hash_shards(md, dir, e);
    }
    unsigned int n = 0;
    if (rc == 0 && EVP_DigestFinal_ex(md, fp, &n) != 1)
        rc = k3_err_set(e, K3_EINTERNAL, "SHA-256 failed");
    EVP_MD_CTX_free(md);
    return rc;
}

static void hex8(const uint8_t *fp, char *out)
{
    static const char h[] = "0123456789abcdef";
    for (int i = 0; i < 8; i++) {
        out[2 * i] = h[fp[i] >> 4];
        out[2 * i + 1] = h[fp[i] & 15];
    }
    out[16] = 0;
}

int k3_state_save(const char *path, int overwrite, const uint8_t fp[32], const k3_seq *s, const uint32_t *ids,
                  uint32_t n_ids, k3_err *e)
{
    if (n_ids != k3_seq_pos(s))
        return k3_err_set(e, K3_EINTERNAL, "%s: %u ids for a sequence at position %u", path, n_ids, k3_seq_pos(s));
    struct stat st;
    if (!overwrite && lstat(path, &st) == 0)
        return k3_err_set(e, K3_EEXIST, "%s exists (use --force to replace it)", path);
    uint64_t sb = k3_seq_state_size(s), len = 0;
    uint64_t idb = (uint64_t)n_ids * 4;
    uint8_t *buf = malloc((size_t)(HDR + idb + sb));
    if (!buf)
        return k3_err_set(e, K3_ENOMEM, "%s: out of memory for %llu bytes of state", path,
                          (unsigned long long)(HDR + idb + sb));
    int rc = k3_seq_state_save(s, buf + HDR + idb, sb, &len, e);
    if (rc == 0) {
        memset(buf, 0, HDR);
        memcpy(buf, MAGIC, 8);
        put32(buf + 8, VERSION);
        put32(buf + 12, HDR);
        memcpy(buf + 16, fp, 32);
        put32(buf + 48, n_ids);
        for (uint32_t i = 0; i < n_ids; i++)
            put32(buf + HDR + 4ull * i, ids[i]);
        put32(buf + 52, k3_crc32(0, buf + HDR, (size_t)idb));
        put32(buf + 56, (uint32_t)len);
        put32(buf + 60, (uint32_t)(len >> 32));
        put32(buf + 64, k3_crc32(0, buf + HDR + idb, (size_t)len));
        put32(buf + 68, k3_crc32(0, buf, HDR - 4));
        char tmp[PATH_MAX];
        int fd = k3_io_tmp_create(path, 0, tmp, sizeof tmp, e);
        if (fd < 0) {
            rc = fd;
        } else {
            rc = k3_io_pwrite(fd, buf, HDR + idb + len, 0, tmp, e);
            if (rc == 0)
                rc = k3_io_publish(fd, tmp, path, e);
            else
                close(fd);
            if (rc < 0)
                unlink(tmp);   /* ours: nothing half-written stays */
        }
    }
    free(buf);
    return rc;
}

/* Read and check the header and the ids; the engine bytes follow them. */
static int open_checked(const char *path, const uint8_t *fp, int *fd_out, uint32_t **ids, uint32_t *n_ids,
                        uint64_t *state_bytes, uint32_t *state_crc, k3_err *e)
{
    *ids = NULL;
    int fd = k3_io_open_read(path, 0, NULL, e);
    if (fd < 0)
        return fd;
    uint64_t size = 0;
    uint8_t h[HDR] = {0};
    int rc = k3_io_file_size(fd, &size, path, e);
    if (rc == 0)
        rc = k3_io_pread(fd, h, size < HDR ? size : HDR, 0, path, e);
    if (rc == 0 && size >= 8 && memcmp(h, MAGIC, 8) != 0)
        rc = k3_err_set(e, K3_EFORMAT, "%s: not a k3 state file (no K3STATE1 magic)", path);
    if (rc == 0 && size < HDR)
        rc = k3_err_set(e, K3_EIO, "%s: truncated: %llu bytes, a state file has at least %u", path,
                        (unsigned long long)size, HDR);
    if (rc == 0 && (get32(h + 8) != VERSION || get32(h + 12) != HDR))
        rc = k3_err_set(e, K3_EFORMAT, "%s: state file version %u (header %u bytes); this k3 reads version %u",
                        path, get32(h + 8), get32(h + 12), VERSION);
    if (rc == 0 && k3_crc32(0, h, HDR - 4) != get32(h + HDR - 4))
        rc = k3_err_set(e, K3_ECORRUPT, "%s: the header fails its CRC-32", path);
    if (rc == 0 && fp && memcmp(h + 16, fp, 32) != 0) {
        char a[17], b[17];
        hex8(h + 16, a);
        hex8(fp, b);
        rc = k3_err_set(e, K3_EFORMAT, "%s: a state of another model (model fingerprint %s..., this model %s...)",
                        path, a, b);
    }
    uint32_t n = rc == 0 ? get32(h + 48) : 0;
    uint64_t sb = rc == 0 ? get64(h + 56) : 0;
    if (rc == 0 && n > K3_STATE_MAX_IDS)
        rc = k3_err_set(e, K3_ELIMIT, "%s: %u ids, more than %u", path, n, K3_STATE_MAX_IDS);
    if (rc == 0 && sb > (1ull << 50))
        rc = k3_err_set(e, K3_EFORMAT, "%s: a state of %llu bytes is not plausible", path, (unsigned long long)sb);
    uint64_t need = HDR + 4ull * n + sb;
    if (rc == 0 && size < need)
        rc = k3_err_set(e, K3_EIO, "%s: truncated: %llu bytes, the header says %llu", path, (unsigned long long)size,
                        (unsigned long long)need);
    if (rc == 0 && size > need)
        rc = k3_err_set(e, K3_EFORMAT, "%s: %llu bytes, the header says %llu (bytes after the state)", path,
                        (unsigned long long)size, (unsigned long long)need);
    uint32_t *v = NULL;
    if (rc == 0 && !(v = malloc((size_t)(4ull * n + 4))))
        rc = k3_err_set(e, K3_ENOMEM, "%s: out of memory for %u ids", path, n);
    if (rc == 0)
        rc = k3_io_pread(fd, v, 4ull * n, HDR, path, e);
    if (rc == 0 && k3_crc32(0, v, 4ull * n) != get32(h + 52))
        rc = k3_err_set(e, K3_ECORRUPT, "%s: the token ids fail their CRC-32", path);
    if (rc < 0) {
        free(v);
        close(fd);
        return rc;
    }
    for (uint32_t i = 0; i < n; i++)
        v[i] = get32((const uint8_t *)&v[i]);
    *ids = v;
    *n_ids = n;
    *state_bytes = sb;
    *state_crc = get32(h + 64);
    *fd_out = fd;
    return 0;
}

int k3_state_peek(const char *path, const uint8_t fp[32], uint32_t *n_ids, k3_err *e)
{
    int fd;
    uint32_t *ids, crc;
    uint64_t sb;
    int rc = open_checked(path, fp, &fd, &ids, n_ids, &sb, &crc, e);
    if (rc == 0) {
        free(ids);
        close(fd);
    }
    return rc;
}

int k3_state_load(const char *path, const uint8_t fp[32], k3_seq *s, uint32_t **ids, uint32_t *n_ids, k3_err *e)
{
    int fd;
    uint32_t crc;
    uint64_t sb;
    int rc = open_checked(path, fp, &fd, ids, n_ids, &sb, &crc, e);
    if (rc < 0)
        return rc;
    uint8_t *buf = malloc((size_t)(sb ? sb : 1));
    if (!buf)
        rc = k3_err_set(e, K3_ENOMEM, "%s: out of memory for %llu bytes of state", path, (unsigned long long)sb);
    if (rc == 0)
        rc = k3_io_pread(fd, buf, sb, HDR + 4ull * *n_ids, path, e);
    close(fd);
    if (rc == 0 && k3_crc32(0, buf, (size_t)sb) != crc)
        rc = k3_err_set(e, K3_ECORRUPT, "%s: the sequence state fails its CRC-32", path);
    if (rc == 0) {
        k3_err le = {0};
        rc = k3_seq_state_load(s, buf, sb, &le);
        if (rc < 0)
            rc = k3_err_set(e, rc, "%s: %s", path, le.msg);
        else if (k3_seq_pos(s) != *n_ids)
            rc = k3_err_set(e, K3_EFORMAT, "%s: the state is at position %u but records %u ids", path, k3_seq_pos(s),
                            *n_ids);
        if (rc < 0)
            k3_seq_reset(s);
    }
    free(buf);
    if (rc < 0) {
        free(*ids);
        *ids = NULL;
    }
    return rc;
}

int k3_state_use_load(const char *path, const char *model_dir, k3_seq *s, const uint32_t *ids, uint32_t n,
                      uint32_t *reuse, k3_err *e)
{
    *reuse = 0;
    uint8_t fp[32];
    uint32_t ns = 0, *sids = NULL;
    int rc = k3_state_fingerprint(model_dir, fp, e);
    if (rc == 0)
        rc = k3_state_peek(path, fp, &ns, e);
    if (rc < 0)
        return rc;
    if (ns >= n || ns > k3_seq_max_ctx(s)) {
        fprintf(stderr, "k3-run: warning: %s holds %u ids, not a proper prefix of the prompt's %u: the prompt is "
                        "computed from the start\n", path, ns, n);
        return 0;
    }
    rc = k3_state_load(path, fp, s, &sids, &ns, e);
    if (rc < 0)
        return rc;
    if (memcmp(sids, ids, (size_t)ns * sizeof *ids) != 0) {
        uint32_t i = 0;
        while (sids[i] == ids[i])
            i++;
        fprintf(stderr, "k3-run: warning: %s: its ids differ from the prompt's at position %u: the prompt is "
                        "computed from the start\n", path, i);
        k3_seq_reset(s);
        ns = 0;
    }
    free(sids);
    *reuse = ns;
    return 0;
}

int k3_state_use_save(const char *path, int overwrite, const char *model_dir, k3_engine *en, k3_seq *s,
                      const uint32_t *ids, uint32_t n, uint32_t *reuse, k3_err *e)
{
    uint8_t fp[32];
    int rc = k3_state_fingerprint(model_dir, fp, e);
    if (rc < 0)
        return rc;
    struct stat st;
    if (!overwrite && lstat(path, &st) == 0)   /* before the work, not after */
        return k3_err_set(e, K3_EEXIST, "%s exists (use --force to replace it)", path);
    if (n - 1 > *reuse) {
        k3_step_seq one = {s, ids + *reuse, n - 1 - *reuse, K3_LOGITS_NONE, NULL};
        if ((rc = k3_engine_step(en, &one, 1, e)) < 0)
            return rc;
    }
    rc = k3_state_save(path, overwrite, fp, s, ids, n - 1, e);
    if (rc == 0)
        *reuse = n - 1;
    return rc;
}
