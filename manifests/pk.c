/*
 * pk.c - the read API of a packed model directory (k3_pk.h).
 *
 * Invariant: a k3_pk that k3_pk_open returned has a manifest that passed
 * k3_man_parse, an experts.idx whose SHA-256 matches the manifest and whose
 * entries are aligned, inside their files and not overlapping, an embed.crc
 * whose SHA-256 matches the manifest (loaded: the per-row CRC32 of the
 * embedding), and every data
 * file open with the size the manifest gives. Data bytes are not hashed here.
 */
#include "k3_pk.h"

#include <inttypes.h>
#include <openssl/evp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "k3_crc.h"
#include "k3_io.h"
#include "k3_kern.h"
#include "k3_man.h"

struct k3_pk {
    char *dir;
    k3_man man;
    int *fds;
    int *direct;
    char **paths;
    k3_pk_record *recs;        /* n_moe_layers * num_experts */
    uint32_t *row_crc;         /* vocab_size: CRC32 of each embedding row (embed.crc) */
    uint32_t *layer_units;     /* unit ids grouped by layer */
    uint32_t *layer_first;     /* per slot (layer + 2): start in layer_units; nslots + 1 entries */
    uint32_t nslots;
};

static int crc_check(const void *buf, uint64_t n, uint32_t want, uint32_t *got)
{
    uint32_t c = k3_crc32(0, buf, (size_t)n);
    *got = c;
    return c == want;
}

static int sha256_buf(const void *buf, uint64_t n, uint8_t out[32])
{
    unsigned int len = 0;
    return EVP_Digest(buf, (size_t)n, out, &len, EVP_sha256(), NULL) == 1 && len == 32 ? 0 : -1;
}

static int build_layer_index(k3_pk *pk, k3_err *e)
{
    uint32_t nl = pk->man.cfg.num_hidden_layers;
    pk->nslots = nl + 2;
    pk->layer_first = calloc(pk->nslots + 1, sizeof *pk->layer_first);
    pk->layer_units = calloc(pk->man.nunits ? pk->man.nunits : 1, sizeof *pk->layer_units);
    if (!pk->layer_first || !pk->layer_units)
        return k3_err_set(e, K3_ENOMEM, "%s: out of memory", pk->dir);
    /* counting sort by slot; units are already in (file, offset) order in the
     * manifest as k3-convert writes them, and stay in manifest order here */
    for (uint32_t u = 0; u < pk->man.nunits; u++)
        pk->layer_first[(uint32_t)(pk->man.units[u].layer + 2) + 1]++;
    for (uint32_t s = 0; s < pk->nslots; s++)
        pk->layer_first[s + 1] += pk->layer_first[s];
    uint32_t *fill = calloc(pk->nslots, sizeof *fill);
    if (!fill)
        return k3_err_set(e, K3_ENOMEM, "%s: out of memory", pk->dir);
    for (uint32_t u = 0; u < pk->man.nunits; u++) {
        uint32_t s = (uint32_t)(pk->man.units[u].layer + 2);
        pk->layer_units[pk->layer_first[s] + fill[s]++] = u;
    }
    free(fill);
    return 0;
}

int k3_pk_open(k3_pk **out, const char *dir, unsigned flags, k3_err *e)
{
    *out = NULL;
    char mpath[4096];
    int rc = k3_io_path_join(mpath, sizeof mpath, dir, "manifest.json", e);
    if (rc)
        return rc;
    struct stat st;
    if (stat(dir, &st) != 0 || !S_ISDIR(st.st_mode))
        return k3_err_set(e, K3_ENOENT, "%s: not a directory", dir);
    if (stat(mpath, &st) != 0)
        return k3_err_set(e, K3_ENOENT, "%s: incomplete packed model: no manifest.json", dir);
    k3_pk *pk = calloc(1, sizeof *pk);
    if (!pk || !(pk->dir = strdup(dir))) {
        free(pk);
        return k3_err_set(e, K3_ENOMEM, "%s: out of memory", dir);
    }
    char *text = NULL;
    uint64_t len = 0;
    if ((rc = k3_io_read_file(mpath, K3_MAN_MAX_BYTES, &text, &len, e)))
        goto fail;
    rc = k3_man_parse(&pk->man, text, len, mpath, e);
    free(text);
    if (rc)
        goto fail;
    k3_man *m = &pk->man;
    pk->fds = malloc((m->nfiles ? m->nfiles : 1) * sizeof *pk->fds);
    pk->direct = calloc(m->nfiles ? m->nfiles : 1, sizeof *pk->direct);
    pk->paths = calloc(m->nfiles ? m->nfiles : 1, sizeof *pk->paths);
    if (!pk->fds || !pk->direct || !pk->paths) {
        rc = k3_err_set(e, K3_ENOMEM, "%s: out of memory", dir);
        goto fail;
    }
    for (uint32_t i = 0; i < m->nfiles; i++)
        pk->fds[i] = -1;
    for (uint32_t i = 0; i < m->nfiles; i++) {
        char p[4096];
        if ((rc = k3_io_path_join(p, sizeof p, dir, m->files[i].name, e)))
            goto fail;
        if (!(pk->paths[i] = strdup(p))) {
            rc = k3_err_set(e, K3_ENOMEM, "%s: out of memory", dir);
            goto fail;
        }
        m->files[i].path = pk->paths[i];
        int want_direct = (flags & K3_PK_DIRECT) &&
                          (m->files[i].kind == K3_PK_FILE_TRUNK || m->files[i].kind == K3_PK_FILE_EXPERTS);
        int fd = k3_io_open_read(p, want_direct, &pk->direct[i], e);
        if (fd < 0) {
            rc = fd;
            goto fail;
        }
        pk->fds[i] = fd;
        uint64_t size;
        if ((rc = k3_io_file_size(fd, &size, p, e)))
            goto fail;
        if (size != m->files[i].size) {
            rc = k3_err_set(e, K3_EIO, "%s: truncated or wrong size: %" PRIu64 " bytes, the manifest says %" PRIu64,
                            p, size, m->files[i].size);
            goto fail;
        }
    }
    if (m->has_experts) {
        const k3_pk_file *f = &m->files[m->expert_index_file];
        if (f->size > K3_MAN_MAX_IDX_BYTES) {
            rc = k3_err_set(e, K3_ELIMIT, "%s: %" PRIu64 " bytes is larger than the %u-byte limit", f->path,
                            f->size, K3_MAN_MAX_IDX_BYTES);
            goto fail;
        }
        uint8_t *buf = malloc((size_t)f->size);
        if (!buf) {
            rc = k3_err_set(e, K3_ENOMEM, "%s: out of memory", f->path);
            goto fail;
        }
        rc = k3_io_pread(pk->fds[m->expert_index_file], buf, f->size, 0, f->path, e);
        uint8_t sha[32];
        if (rc == 0 && (sha256_buf(buf, f->size, sha) || memcmp(sha, f->sha256, 32)))
            rc = k3_err_set(e, K3_ECORRUPT, "%s: SHA-256 differs from the manifest", f->path);
        uint64_t n = (uint64_t)k3_man_moe_layers(&m->cfg) * m->cfg.num_experts;
        if (rc == 0 && !(pk->recs = calloc(n ? n : 1, sizeof *pk->recs)))
            rc = k3_err_set(e, K3_ENOMEM, "%s: out of memory", f->path);
        if (rc == 0)
            rc = k3_man_idx_decode(m, buf, f->size, pk->recs, f->path, e);
        free(buf);
        if (rc)
            goto fail;
    }
    {
        const k3_pk_file *f = &m->files[m->embed_crc_file];
        uint8_t *buf = malloc((size_t)f->size + 1), sha[32];
        pk->row_crc = malloc((size_t)f->size + 1);
        if (!buf || !pk->row_crc) {
            free(buf);
            rc = k3_err_set(e, K3_ENOMEM, "%s: out of memory", f->path);
            goto fail;
        }
        rc = k3_io_pread(pk->fds[m->embed_crc_file], buf, f->size, 0, f->path, e);
        if (rc == 0 && (sha256_buf(buf, f->size, sha) || memcmp(sha, f->sha256, 32)))
            rc = k3_err_set(e, K3_ECORRUPT, "%s: SHA-256 differs from the manifest", f->path);
        for (uint64_t i = 0; rc == 0 && i < f->size / 4; i++)
            pk->row_crc[i] = (uint32_t)buf[4 * i] | (uint32_t)buf[4 * i + 1] << 8 | (uint32_t)buf[4 * i + 2] << 16 |
                             (uint32_t)buf[4 * i + 3] << 24;
        free(buf);
        if (rc)
            goto fail;
    }
    if ((rc = build_layer_index(pk, e)))
        goto fail;
    *out = pk;
    return 0;
fail:
    k3_pk_close(pk);
    return rc;
}

void k3_pk_close(k3_pk *pk)
{
    if (!pk)
        return;
    for (uint32_t i = 0; pk->fds && i < pk->man.nfiles; i++)
        if (pk->fds[i] >= 0)
            close(pk->fds[i]);
    if (pk->paths)
        for (uint32_t i = 0; i < pk->man.nfiles; i++)
            free(pk->paths[i]);
    free(pk->paths);
    free(pk->fds);
    free(pk->direct);
    free(pk->recs);
    free(pk->row_crc);
    free(pk->layer_units);
    free(pk->layer_first);
    k3_man_free(&pk->man);
    free(pk->dir);
    free(pk);
}

const k3_cfg *k3_pk_cfg(const k3_pk *pk) { return &pk->man.cfg; }
const char *k3_pk_dir(const k3_pk *pk) { return pk->dir; }
const char *k3_pk_tokenizer_dir(const k3_pk *pk) { return pk->dir; }

const char *k3_pk_tokenizer_file(const k3_pk *pk, const char *name)
{
    for (uint32_t i = 0; i < pk->man.nfiles; i++)
        if (pk->man.files[i].kind == K3_PK_FILE_TOKENIZER && !strcmp(pk->man.files[i].name, name))
            return pk->man.files[i].path;
    return NULL;
}

const uint8_t *k3_pk_tokenizer_sha256(const k3_pk *pk, const char *name)
{
    for (uint32_t i = 0; i < pk->man.nfiles; i++)
        if (pk->man.files[i].kind == K3_PK_FILE_TOKENIZER && !strcmp(pk->man.files[i].name, name))
            return pk->man.files[i].sha256;
    return NULL;
}

int k3_pk_embed_row_check(const k3_pk *pk, uint32_t row, const void *bytes, uint64_t n, const char *path,
                          uint64_t off, k3_err *e)
{
    const k3_pk_file *f = &pk->man.files[pk->man.embed_crc_file];
    if (row >= f->size / 4)
        return k3_err_set(e, K3_EINTERNAL, "embedding row %u out of range", row);
    uint32_t got;
    if (!crc_check(bytes, n, pk->row_crc[row], &got))
        return k3_err_set(e, K3_ECORRUPT, "%s: embedding row %u at offset %" PRIu64 " has CRC32 %08x, %s says %08x",
                          path, row, off, got, f->name, pk->row_crc[row]);
    return 0;
}

int k3_pk_embed_row(const k3_pk *pk, const k3_pk_tensor *embed, uint32_t id, void *rowbuf, void *bounce,
                    uint64_t bounce_cap, float *out, uint64_t *cost, const char *dir, k3_err *e)
{
    const k3_cfg *c = &pk->man.cfg;
    const uint64_t E = c->hidden_size, row = E * k3_dtype_size(embed->dtype);
    if (id >= c->vocab_size)
        return k3_err_set(e, K3_EARG, "token id %u out of range (vocabulary %u)", id, c->vocab_size);
    const k3_pk_piece *p = NULL;
    for (uint32_t k = 0; k < embed->npieces; k++)
        if (id >= embed->pieces[k].row_begin && id < embed->pieces[k].row_end)
            p = &embed->pieces[k];
    if (!p)
        return k3_err_set(e, K3_EFORMAT, "%s: no piece of embed_tokens holds row %u", dir, id);
    const k3_pk_unit *u = k3_pk_unit_at(pk, p->unit);
    const uint64_t off = p->offset + (id - p->row_begin) * row;
    int rc = k3_pk_read(pk, u->file, rowbuf, row, off, bounce, bounce_cap, e);
    if (rc == 0) /* the unit's CRC covers the whole table: each row has its own in embed.crc */
        rc = k3_pk_embed_row_check(pk, id, rowbuf, row, k3_pk_file_at(pk, u->file)->path, off, e);
    if (rc < 0)
        return rc;
    if (cost)
        *cost = k3_pk_file_is_direct(pk, u->file) ? (off + row + 4095) / 4096 * 4096 - off / 4096 * 4096 : row;
    if (embed->dtype == K3_DT_BF16)
        k3_bf16_to_f32_n((const uint16_t *)rowbuf, out, E);
    else if (embed->dtype == K3_DT_F16)
        k3_f16_to_f32_n((const uint16_t *)rowbuf, out, E);
    else
        memcpy(out, rowbuf, E * sizeof(float));
    return 0;
}

const uint32_t *k3_pk_embed_row_crcs(const k3_pk *pk) { return pk->row_crc; }

uint32_t k3_pk_file_count(const k3_pk *pk) { return pk->man.nfiles; }

const k3_pk_file *k3_pk_file_at(const k3_pk *pk, uint32_t i)
{
    return i < pk->man.nfiles ? &pk->man.files[i] : NULL;
}

int k3_pk_file_is_direct(const k3_pk *pk, uint32_t i)
{
    return i < pk->man.nfiles ? pk->direct[i] : 0;
}

uint32_t k3_pk_tensor_count(const k3_pk *pk) { return pk->man.ntensors; }

const k3_pk_tensor *k3_pk_tensor_at(const k3_pk *pk, uint32_t i)
{
    return i < pk->man.ntensors ? &pk->man.tensors[i] : NULL;
}

const k3_pk_tensor *k3_pk_tensor_find(const k3_pk *pk, const char *name)
{
    uint32_t lo = 0, hi = pk->man.ntensors;
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        int c = strcmp(pk->man.tensors[mid].name, name);
        if (c == 0)
            return &pk->man.tensors[mid];
        if (c < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    return NULL;
}

uint32_t k3_pk_unit_count(const k3_pk *pk) { return pk->man.nunits; }

const k3_pk_unit *k3_pk_unit_at(const k3_pk *pk, uint32_t i)
{
    return i < pk->man.nunits ? &pk->man.units[i] : NULL;
}

void k3_pk_layer_units(const k3_pk *pk, int32_t layer, const uint32_t **ids, uint32_t *n)
{
    *ids = NULL;
    *n = 0;
    if (layer < K3_PK_LAYER_HEAD || layer >= (int32_t)pk->man.cfg.num_hidden_layers)
        return;
    uint32_t s = (uint32_t)(layer + 2);
    *ids = pk->layer_units + pk->layer_first[s];
    *n = pk->layer_first[s + 1] - pk->layer_first[s];
}

const k3_pk_expert_layout *k3_pk_experts(const k3_pk *pk)
{
    return pk->man.has_experts ? &pk->man.xl : NULL;
}

const k3_pk_record *k3_pk_record_find(const k3_pk *pk, uint32_t layer, uint32_t expert)
{
    const k3_cfg *c = &pk->man.cfg;
    if (!pk->man.has_experts || layer < c->first_k_dense_replace || layer >= c->num_hidden_layers ||
        expert >= c->num_experts)
        return NULL;
    return &pk->recs[(uint64_t)(layer - c->first_k_dense_replace) * c->num_experts + expert];
}

const char *k3_pk_plan_json(const k3_pk *pk) { return pk->man.plan_json; }

int k3_pk_read(const k3_pk *pk, uint32_t file, void *dst, uint64_t n, uint64_t off,
               void *bounce, uint64_t bounce_cap, k3_err *e)
{
    if (file >= pk->man.nfiles)
        return k3_err_set(e, K3_EARG, "%s: no data file %u", pk->dir, file);
    const k3_pk_file *f = &pk->man.files[file];
    if (off > f->size || n > f->size - off)
        return k3_err_set(e, K3_EARG, "%s: read of %" PRIu64 " bytes at offset %" PRIu64 " is outside the file (%" PRIu64
                          " bytes)", f->path, n, off, f->size);
    if (pk->direct[file])
        return k3_io_pread_direct(pk->fds[file], dst, n, off, bounce, bounce_cap, f->path, e);
    return k3_io_pread(pk->fds[file], dst, n, off, f->path, e);
}

int k3_pk_read_record(const k3_pk *pk, uint32_t layer, uint32_t expert, void *dst, int check_crc, k3_err *e)
{
    const k3_pk_record *r = k3_pk_record_find(pk, layer, expert);
    if (!r)
        return k3_err_set(e, K3_EARG, "%s: no record for layer %u expert %u", pk->dir, layer, expert);
    int rc = k3_pk_read(pk, r->file, dst, pk->man.xl.stride, r->offset, NULL, 0, e);
    uint32_t got;
    if (rc == 0 && check_crc && !crc_check(dst, pk->man.xl.stride, r->crc32, &got))
        return k3_err_set(e, K3_ECORRUPT, "%s: layer %u expert %u: record at offset %" PRIu64
                          " has CRC32 %08x, expected %08x", pk->man.files[r->file].path, layer, expert, r->offset,
                          got, r->crc32);
    return rc;
}

int k3_pk_read_unit(const k3_pk *pk, uint32_t unit, void *dst, int check_crc, k3_err *e)
{
    if (unit >= pk->man.nunits)
        return k3_err_set(e, K3_EARG, "%s: no unit %u", pk->dir, unit);
    const k3_pk_unit *u = &pk->man.units[unit];
    int rc = k3_pk_read(pk, u->file, dst, u->nbytes, u->offset, NULL, 0, e);
    uint32_t got;
    if (rc == 0 && check_crc && !crc_check(dst, u->nbytes, u->crc32, &got))
        return k3_err_set(e, K3_ECORRUPT, "%s: unit %u (layer %d) at offset %" PRIu64 " has CRC32 %08x, expected %08x",
                          pk->man.files[u->file].path, unit, u->layer, u->offset, got, u->crc32);
    return rc;
}
