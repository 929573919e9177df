/*
 * conv_journal.c - k3-convert's resume journal (k3_journal.h): a group's
 * entry (its files' sizes and SHA-256, the embedding row CRCs it holds)
 * written after the group is published, and checked when --resume keeps it.
 */
#include "conv_run.h"

#include <cjson/cJSON.h>
#include <dirent.h>
#include <errno.h>
#include <inttypes.h>
#include <omp.h>
#include <openssl/evp.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "k3_outfile.h"
#include "k3_crc.h"
#include "k3_dest.h"
#include "k3_io.h"
#include "k3_journal.h"
#include "k3_kern.h"
#include "k3_progress.h"


/* ---- journal ------------------------------------------------------------------ */

/* DST's journal (k3_journal.h): plan.json, group-NNNN.json, embed-crc.bin */
int k3_conv_journal(k3_journal *j, const char *dst, k3_err *e)
{
    return k3_journal_init(j, dst, JOURNAL, "plan.json", e);
}

static cJSON *crc_array(const uint32_t *crc, uint32_t n)
{
    cJSON *a = cJSON_CreateArray();
    for (uint32_t i = 0; a && i < n; i++) {
        char h[9];
        snprintf(h, sizeof h, "%08x", crc[i]);
        cJSON_AddItemToArray(a, cJSON_CreateString(h));
    }
    return a;
}

cJSON *k3_conv_named_hash(const char *name, uint64_t size, const uint8_t sha[32])
{
    cJSON *o = cJSON_CreateObject();
    char hex[65];
    k3_man_hex(sha, hex);
    cJSON_AddStringToObject(o, "name", name);
    cJSON_AddNumberToObject(o, "size", (double)size);
    cJSON_AddStringToObject(o, "sha256", hex);
    return o;
}

int k3_conv_journal_write_group(conv *cv, uint32_t g, k3_err *e)
{
    k3_conv_plan *p = cv->p;
    const k3_conv_group *G = &p->groups[g];
    char hex[65], name[64];
    k3_journal j;
    int jrc = k3_conv_journal(&j, p->dst, e);
    if (jrc)
        return jrc;
    cJSON *root = cJSON_CreateObject();
    k3_man_hex(p->fingerprint, hex);
    cJSON_AddStringToObject(root, "fingerprint", hex);
    cJSON_AddNumberToObject(root, "group", g);
    cJSON *sh = cJSON_AddArrayToObject(root, "shards");
    for (uint32_t s = G->shard_first; s < G->shard_end; s++)
        cJSON_AddItemToArray(sh, k3_conv_named_hash(k3_st_shard_name(p->st, s), k3_st_shard_size(p->st, s),
                                                    cv->shard_sha[s]));
    cJSON *fs = cJSON_AddArrayToObject(root, "files");
    const k3_conv_ofile *of[2] = {&G->trunk, &G->experts};
    for (int k = 0; k < 2; k++)
        if (of[k]->size)
            cJSON_AddItemToArray(fs, k3_conv_named_hash(of[k]->name, of[k]->size,
                                                        p->man.files[of[k]->file_index].sha256));
    cJSON_AddItemToObject(root, "unit_crcs", crc_array(G->trunk.region_crc, G->trunk.nregions));
    cJSON_AddItemToObject(root, "record_crcs", crc_array(G->experts.region_crc, G->experts.nregions));
    if (g == cv->embed_group && cv->embed_t >= 0) {
        /* the embedding's row CRCs, kept beside the entry that names their hash */
        const uint64_t V = p->cfg.vocab_size;
        uint8_t *b = malloc(4 * V + 1);
        int rc = b ? 0 : k3_err_set(e, K3_ENOMEM, "out of memory");
        if (rc == 0 && cv->erow_at != V * cv->erow_rb)
            rc = k3_err_set(e, K3_EINTERNAL, "embedding: %" PRIu64 " bytes written, %" PRIu64 " expected", cv->erow_at,
                            V * cv->erow_rb);
        for (uint64_t i = 0; rc == 0 && i < V; i++)
            for (int k = 0; k < 4; k++)
                b[4 * i + k] = (uint8_t)(cv->erow[i] >> (8 * k));
        unsigned int hl;
        if (rc == 0) {
            EVP_Digest(b, 4 * V, cv->erow_sha, &hl, EVP_sha256(), NULL);
            rc = k3_journal_put_blob(&j, "embed-crc.bin", b, 4 * V, e);
        }
        free(b);
        if (rc) {
            cJSON_Delete(root);
            return rc;
        }
        k3_man_hex(cv->erow_sha, hex);
        cJSON_AddStringToObject(root, "embed_crc_sha256", hex);
    }
    /* sealed with its SHA-256, so that --resume never takes a value that
     * reads back differently from what was written */
    snprintf(name, sizeof name, "group-%04u.json", g);
    int rc = k3_journal_put(&j, name, root, e);
    cJSON_Delete(root);
    return rc;
}

static int sha_file(const char *path, uint8_t sha[32], k3_err *e)
{
    int fd = k3_io_open_read(path, 0, NULL, e);
    if (fd < 0)
        return fd;
    uint64_t size, off = 0;
    int rc = k3_io_file_size(fd, &size, path, e);
    uint8_t *buf = rc ? NULL : malloc(4u << 20);
    EVP_MD_CTX *md = EVP_MD_CTX_new();
    if (rc == 0 && (!buf || !md || EVP_DigestInit_ex(md, EVP_sha256(), NULL) != 1))
        rc = k3_err_set(e, K3_ENOMEM, "out of memory");
    while (rc == 0 && off < size) {
        uint64_t n = size - off < (4u << 20) ? size - off : (4u << 20);
        if ((rc = k3_io_pread(fd, buf, n, off, path, e)) == 0)
            EVP_DigestUpdate(md, buf, (size_t)n);
        off += n;
    }
    unsigned int len;
    if (rc == 0)
        EVP_DigestFinal_ex(md, sha, &len);
    EVP_MD_CTX_free(md);
    free(buf);
    close(fd);
    return rc;
}

static int parse_crcs(const cJSON *a, uint32_t *out, uint32_t n)
{
    if (!cJSON_IsArray(a) || (uint32_t)cJSON_GetArraySize(a) != n)
        return -1;
    uint32_t i = 0;
    for (const cJSON *it = a->child; it; it = it->next, i++) {
        char *end;
        if (!cJSON_IsString(it) || strlen(it->valuestring) != 8)
            return -1;
        out[i] = (uint32_t)strtoul(it->valuestring, &end, 16);
        if (*end)
            return -1;
    }
    return 0;
}

static int check_named(const cJSON *o, const char *name, uint64_t size, uint8_t sha[32])
{
    const cJSON *n = cJSON_GetObjectItemCaseSensitive(o, "name");
    const cJSON *s = cJSON_GetObjectItemCaseSensitive(o, "size");
    const cJSON *h = cJSON_GetObjectItemCaseSensitive(o, "sha256");
    if (!cJSON_IsString(n) || strcmp(n->valuestring, name) || !cJSON_IsNumber(s) || s->valuedouble != (double)size ||
        !cJSON_IsString(h) || k3_man_unhex(h->valuestring, sha))
        return -1;
    return 0;
}

/* Is group g finished according to the journal, and are its files what the
 * journal says? Returns 1 (done, results loaded), 0 (redo), <0 on error. */
int k3_conv_journal_load_group(conv *cv, uint32_t g, const char **why, k3_err *e)
{
    k3_conv_plan *p = cv->p;
    k3_conv_group *G = &p->groups[g];
    char name[64], hex[65];
    k3_journal j;
    int rc = k3_conv_journal(&j, p->dst, e);
    if (rc)
        return rc;
    snprintf(name, sizeof name, "group-%04u.json", g);
    k3_err ignore = {0};
    cJSON *root = k3_journal_get(&j, name, why);
    if (!root)
        return 0;
    int ok = 0;
    k3_man_hex(p->fingerprint, hex);
    const cJSON *fp = cJSON_GetObjectItemCaseSensitive(root, "fingerprint");
    const cJSON *sh = cJSON_GetObjectItemCaseSensitive(root, "shards");
    const cJSON *fs = cJSON_GetObjectItemCaseSensitive(root, "files");
    *why = "journal entry from another plan";
    if (!root || !cJSON_IsString(fp) || strcmp(fp->valuestring, hex) || !cJSON_IsArray(sh) || !cJSON_IsArray(fs) ||
        (uint32_t)cJSON_GetArraySize(sh) != G->shard_end - G->shard_first)
        goto out;
    const cJSON *it = sh->child;
    for (uint32_t s = G->shard_first; s < G->shard_end; s++, it = it->next)
        if (check_named(it, k3_st_shard_name(p->st, s), k3_st_shard_size(p->st, s), cv->shard_sha[s]))
            goto out;
    it = fs->child;
    k3_conv_ofile *of[2] = {&G->trunk, &G->experts};
    for (int k = 0; k < 2; k++) {
        if (!of[k]->size)
            continue;
        uint8_t *sha = p->man.files[of[k]->file_index].sha256;
        if (!it || check_named(it, of[k]->name, of[k]->size, sha))
            goto out;
        it = it->next;
        char fpath[4200];
        struct stat st;
        *why = "output file missing or of the wrong size";
        if (k3_io_path_join(fpath, sizeof fpath, p->dst, of[k]->name, e) || stat(fpath, &st) != 0 ||
            (uint64_t)st.st_size != of[k]->size)
            goto out;
        if (cv->o->rehash) {
            uint8_t now[32];
            *why = "output file does not hash to the journal's SHA-256";
            if (sha_file(fpath, now, &ignore) || memcmp(now, sha, 32))
                goto out;
        }
    }
    *why = "bad CRC table in the journal entry";
    if (parse_crcs(cJSON_GetObjectItemCaseSensitive(root, "unit_crcs"), G->trunk.region_crc, G->trunk.nregions) ||
        parse_crcs(cJSON_GetObjectItemCaseSensitive(root, "record_crcs"), G->experts.region_crc, G->experts.nregions))
        goto out;
    if (g == cv->embed_group && cv->embed_t >= 0) {
        const cJSON *h = cJSON_GetObjectItemCaseSensitive(root, "embed_crc_sha256");
        const uint64_t V = p->cfg.vocab_size;
        uint8_t *b = malloc(4 * V + 1);
        uint8_t want[32];
        *why = "the embedding's row CRCs in the journal are missing or do not hash to the entry's SHA-256";
        if (!b || !cJSON_IsString(h) || k3_man_unhex(h->valuestring, want) ||
            k3_journal_get_blob(&j, "embed-crc.bin", 4 * V, want, b)) {
            free(b);
            goto out;
        }
        for (uint64_t i = 0; i < V; i++) {
            const uint8_t *q = b + 4 * i;
            cv->erow[i] = (uint32_t)q[0] | (uint32_t)q[1] << 8 | (uint32_t)q[2] << 16 | (uint32_t)q[3] << 24;
        }
        free(b);
    }
    ok = 1;
out:
    cJSON_Delete(root);
    return ok;
}
