/*
 * synth_write.c - writes a whole synthetic checkpoint directory: plans the
 * shards under the size limit, streams each one through the shard writer,
 * then writes the index, config and tokenizer files, and publishes.
 *
 * Crash safety: everything is built in "<dst>.k3-synth-tmp" (a directory of ours) and
 * renamed to dst at the very end, so dst is either absent, the old complete
 * checkpoint (with --force), or the new complete one. On any error or
 * interruption the files we created in "<dst>.k3-synth-tmp" are removed, and only
 * those (a directory that holds anything else is left alone). Every shard
 * says "writer": "k3-synth" in its header metadata: that is how --force
 * recognises a checkpoint of ours (k3_dest.h) and never replaces a real one.
 */
#include "synth.h"

#include "k3_dest.h"
#include "k3_io.h"
#include "k3_stw.h"

#include <cjson/cJSON.h>
#include <dirent.h>
#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <openssl/evp.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* k3-synth's destination (k3_dest.h): a checkpoint built in DST.k3-synth-tmp */
#define SYNTH_TMP_SUFFIX ".k3-synth-tmp"
#define SYNTH_OLD_SUFFIX ".k3-synth-old"
static const char *const synth_siblings[] = {SYNTH_TMP_SUFFIX, SYNTH_OLD_SUFFIX, NULL};
#define SYNTH_WRITER "k3-synth"   /* the shards' header metadata "writer" */
static const k3_dest_tool synth_tool = {"k3-synth", K3_DEST_CHECKPOINT, synth_siblings};

/* Remove a directory of ours (the temporary, the old DST), after checking
 * that it holds only a checkpoint's files. */
static int remove_checkpoint_dir(const char *dir, k3_err *e)
{
    return k3_dest_clear(&synth_tool, dir, 1, 1, e);
}

/* ---- tokenizer files ------------------------------------------------------ */

static int write_tokenizer(const char *dir, unsigned char **tok, const uint32_t *len, uint32_t ranks,
                           const k3_synth_opts *o, k3_err *e)
{
    uint64_t cap = 0;
    for (uint32_t r = 0; r < ranks; r++)
        cap += 4 * ((uint64_t)len[r] + 2) / 3 + 16;
    char *buf = malloc((size_t)cap + 1);
    if (!buf)
        return k3_err_set(e, K3_ENOMEM, "out of memory for tiktoken.model");
    uint64_t n = 0;
    for (uint32_t r = 0; r < ranks; r++) {
        n += (uint64_t)EVP_EncodeBlock((unsigned char *)buf + n, tok[r], (int)len[r]);
        n += (uint64_t)snprintf(buf + n, (size_t)(cap + 1 - n), " %u\n", r);
    }
    char path[PATH_MAX];
    int rc = k3_io_path_join(path, sizeof path, dir, "tiktoken.model", e);
    if (rc == 0)
        rc = k3_io_write_file_atomic(path, buf, n, e);
    free(buf);
    if (rc)
        return rc;

    cJSON *root = cJSON_CreateObject();
    cJSON *added = cJSON_AddObjectToObject(root, "added_tokens_decoder");
    for (uint32_t k = 0; k < o->m.n_specials; k++) {
        char id[16], name[64];
        snprintf(id, sizeof id, "%u", ranks + k);
        k3_synth_special_name(k, name, sizeof name);
        cJSON *t = cJSON_AddObjectToObject(added, id);
        cJSON_AddStringToObject(t, "content", name);
        cJSON_AddBoolToObject(t, "lstrip", 0);
        cJSON_AddBoolToObject(t, "normalized", 0);
        cJSON_AddBoolToObject(t, "rstrip", 0);
        cJSON_AddBoolToObject(t, "single_word", 0);
        cJSON_AddBoolToObject(t, "special", 1);
    }
    cJSON_AddStringToObject(root, "bos_token", "[BOS]");
    cJSON_AddStringToObject(root, "eos_token", "[EOS]");
    cJSON_AddStringToObject(root, "pad_token", "[EOS]");
    cJSON_AddNumberToObject(root, "model_max_length", 1048576);
    cJSON_AddStringToObject(root, "tokenizer_class", "TikTokenTokenizer");
    char *s = cJSON_Print(root);
    cJSON_Delete(root);
    if (!s)
        return k3_err_set(e, K3_ENOMEM, "out of memory for tokenizer_config.json");
    rc = k3_io_path_join(path, sizeof path, dir, "tokenizer_config.json", e);
    if (rc == 0)
        rc = k3_io_write_file_atomic(path, s, strlen(s), e);
    free(s);
    return rc;
}

/* ---- index ---------------------------------------------------------------- */

static int write_index(const char *dir, const k3_synth_tensor *t, uint64_t count, char (*shard_names)[64],
                       k3_err *e)
{
    char path[PATH_MAX], tmp[PATH_MAX];
    int rc = k3_io_path_join(path, sizeof path, dir, "model.safetensors.index.json", e);
    if (rc)
        return rc;
    int fd = k3_io_tmp_create(path, 1, tmp, sizeof tmp, e);
    if (fd < 0)
        return fd;
    uint64_t total = 0;
    for (uint64_t i = 0; i < count; i++)
        total += t[i].bytes;
    /* streamed as text: the real index has ~500k entries */
    enum { CAP = 1 << 20 };
    char *buf = malloc(CAP);
    if (!buf) {
        close(fd);
        unlink(tmp);
        return k3_err_set(e, K3_ENOMEM, "out of memory for the index");
    }
    uint64_t off = 0, n = 0;
    n += (uint64_t)snprintf(buf, CAP, "{\n  \"metadata\": {\n    \"total_size\": %" PRIu64 "\n  },\n  \"weight_map\": {", total);
    for (uint64_t i = 0; i < count && rc == 0; i++) {
        char name[256];
        k3_synth_tensor_name(&t[i], name, sizeof name);
        n += (uint64_t)snprintf(buf + n, CAP - n, "%s\n    \"%s\": \"%s\"", i ? "," : "", name,
                                shard_names[t[i].shard]);
        if (n > CAP - 1024) {
            rc = k3_io_pwrite(fd, buf, n, off, tmp, e);
            off += n;
            n = 0;
        }
    }
    n += (uint64_t)snprintf(buf + n, CAP - n, "\n  }\n}\n");
    if (rc == 0)
        rc = k3_io_pwrite(fd, buf, n, off, tmp, e);
    free(buf);
    if (rc == 0)
        return k3_io_publish(fd, tmp, path, e);
    close(fd);
    unlink(tmp);
    return rc;
}

/* ---- shards --------------------------------------------------------------- */

typedef struct fill_ctx {
    const k3_synth_opts *o;
    const k3_synth_tensor *t;   /* this shard's first tensor */
} fill_ctx;

static int fill_cb(void *ctx, uint64_t i, uint64_t off, uint64_t n, void *buf, k3_err *e)
{
    fill_ctx *c = ctx;
    (void)e;
    return k3_synth_fill(c->o, &c->t[i], off, n, buf);
}

static int zero_cb(void *ctx, uint64_t i)
{
    fill_ctx *c = ctx;
    return !k3_synth_has_data(c->o, c->t[i].kind);
}

/* Declare tensors [first, first+n) in a writer. */
static int declare(k3_stw *w, const k3_synth_tensor *t, uint64_t first, uint64_t n, k3_err *e)
{
    for (uint64_t i = first; i < first + n; i++) {
        char name[256];
        k3_synth_tensor_name(&t[i], name, sizeof name);
        int rc = k3_stw_add(w, name, (k3_dtype)t[i].dtype, t[i].ndim, t[i].shape, e);
        if (rc)
            return rc;
    }
    return 0;
}

/* Greedy plan: tensors in file order, a new shard when the next tensor would
 * push the file past max. Sets t[i].shard; returns the shard count. */
static int plan_shards(k3_synth_tensor *t, uint64_t count, uint64_t max, uint32_t *nshards, k3_err *e)
{
    k3_stw *w = NULL;
    uint32_t s = 0;
    int rc = k3_stw_create(&w, NULL, e);
    for (uint64_t i = 0; i < count && rc == 0; i++) {
        char name[256];
        k3_synth_tensor_name(&t[i], name, sizeof name);
        if (k3_stw_count(w) && k3_stw_size_with(w, name, (k3_dtype)t[i].dtype, t[i].ndim, t[i].shape) > max) {
            k3_stw_free(w);
            w = NULL;
            rc = k3_stw_create(&w, NULL, e);
            s++;
        }
        if (rc == 0 && k3_stw_count(w) == 0)
            rc = k3_stw_metadata(w, "writer", SYNTH_WRITER, e);
        if (rc == 0)
            rc = k3_stw_add(w, name, (k3_dtype)t[i].dtype, t[i].ndim, t[i].shape, e);
        t[i].shard = s;
    }
    k3_stw_free(w);
    *nshards = s + 1;
    return rc;
}

static int synth_write(k3_synth_opts *op, const k3_dest *dest, volatile sig_atomic_t *cancel, k3_synth_result *r,
                       k3_err *e);

int k3_synth_write(const k3_synth_opts *opts, const char *dst, volatile sig_atomic_t *cancel, k3_synth_result *r,
                   k3_err *e)
{
    double t0 = k3_now_s();
    memset(r, 0, sizeof *r);
    k3_synth_opts o = *opts;
    /* DST checked, owned and locked for the whole run */
    k3_dest dest;
    int rc0 = k3_dest_open(&dest, &synth_tool, NULL, dst, e);
    if (rc0)
        return rc0;
    int rc = synth_write(&o, &dest, cancel, r, e);
    k3_dest_close(&dest);
    r->seconds = k3_now_s() - t0;
    return rc;
}

static int synth_write(k3_synth_opts *op, const k3_dest *dest, volatile sig_atomic_t *cancel, k3_synth_result *r,
                       k3_err *e)
{
    k3_synth_opts o = *op;
    const char *dst = dest->path;
    char tmpdir[PATH_MAX];
    if (snprintf(tmpdir, sizeof tmpdir, "%s" SYNTH_TMP_SUFFIX, dst) >= (int)sizeof tmpdir)
        return k3_err_set(e, K3_ELIMIT, "%s: path too long", dst);
    struct stat st;
    int dst_exists = dest->state != K3_DEST_ABSENT;
    if (dst_exists && !o.force)
        return k3_err_set(e, K3_EEXIST, "%s: already exists (use --force to replace it)", dst);
    if (lstat(tmpdir, &st) == 0) {
        if (!o.force)
            return k3_err_set(e, K3_EEXIST, "%s: a temporary from an earlier run exists (remove it or use --force)",
                              tmpdir);
        int rc = S_ISDIR(st.st_mode) ? remove_checkpoint_dir(tmpdir, e)
                                     : k3_err_set(e, K3_EEXIST, "%s: exists and is not a directory; not touching it",
                                                  tmpdir);
        if (rc)
            return rc;
    }

    /* vocabulary first: tiny sizes its embedding from it */
    unsigned char **tok = NULL;
    uint32_t *tlen = NULL, ranks = 0;
    int rc = k3_synth_bpe_learn(o.m.max_ranks, &tok, &tlen, &ranks, e);
    if (rc)
        return rc;
    if (!o.m.vocab)
        o.m.vocab = ranks + o.m.n_specials;
    if (o.m.vocab < ranks + o.m.n_specials) {
        k3_synth_bpe_free(tok, tlen, ranks);
        return k3_err_set(e, K3_EARG, "vocabulary of %u is smaller than %u ranks + %u specials", o.m.vocab,
                          ranks, o.m.n_specials);
    }
    r->ranks = ranks;
    r->vocab = o.m.vocab;

    k3_synth_tensor *t = NULL;
    uint64_t count = 0;
    uint32_t nshards = 0;
    char (*names)[64] = NULL;
    int made_dir = 0;
    k3_progress *prog = NULL;
    rc = k3_synth_tensors(&o, &t, &count, e);
    if (rc == 0)
        rc = plan_shards(t, count, o.shard_size, &nshards, e);
    if (rc == 0 && !(names = calloc(nshards, sizeof *names)))
        rc = k3_err_set(e, K3_ENOMEM, "out of memory for %u shard names", nshards);
    for (uint32_t s = 0; rc == 0 && s < nshards; s++)
        if (nshards == 1)
            snprintf(names[s], sizeof names[s], "model.safetensors");
        else
            snprintf(names[s], sizeof names[s], "model-%05u-of-%05u.safetensors", s + 1, nshards);
    if (rc == 0) {
        if (mkdir(tmpdir, 0755) != 0)
            rc = k3_err_sys(e, errno == EEXIST ? K3_EEXIST : K3_EIO, errno, "%s: cannot create directory", tmpdir);
        else
            made_dir = 1;
    }
    uint64_t logical = 0;
    for (uint64_t i = 0; i < count; i++)
        logical += t[i].bytes;
    if (rc == 0)
        prog = k3_progress_create("k3-synth", logical, stderr, o.quiet);

    /* shards, in order */
    uint64_t first = 0;
    for (uint32_t s = 0; rc == 0 && s < nshards; s++) {
        uint64_t n = 0;
        while (first + n < count && t[first + n].shard == s)
            n++;
        char path[PATH_MAX];
        k3_stw *w = NULL;
        rc = k3_io_path_join(path, sizeof path, tmpdir, names[s], e);
        if (rc == 0)
            rc = k3_stw_create(&w, path, e);
        if (rc == 0)
            rc = k3_stw_metadata(w, "writer", SYNTH_WRITER, e);
        if (rc == 0)
            rc = declare(w, t, first, n, e);
        if (rc == 0)
            rc = k3_stw_begin(w, 0, e);
        if (rc == 0) {
            fill_ctx fc = {&o, t + first};
            k3_stw_stream_opts so = {o.chunk_bytes, o.threads, o.sparse, o.direct, prog, cancel, zero_cb};
            rc = k3_stw_stream(w, fill_cb, &fc, &so, e);
        }
        if (rc == 0)
            rc = k3_stw_finish(w, e);
        if (rc == 0) {
            r->written_bytes += k3_stw_bytes_written(w);
            r->logical_bytes += k3_stw_size(w);
        }
        k3_stw_free(w);
        first += n;
        if (rc == 0 && cancel && *cancel)
            rc = k3_err_set(e, K3_EINTR, "%s: interrupted", dst);
    }
    if (rc == 0 && o.write_index)
        rc = write_index(tmpdir, t, count, names, e);
    if (rc == 0 && o.write_tokenizer)
        rc = write_tokenizer(tmpdir, tok, tlen, ranks, &o, e);
    if (rc == 0) {
        char *cfg = k3_synth_config_json(&o);
        char path[PATH_MAX];
        if (!cfg)
            rc = k3_err_set(e, K3_ENOMEM, "out of memory for config.json");
        if (rc == 0)
            rc = k3_io_path_join(path, sizeof path, tmpdir, "config.json", e);
        if (rc == 0)
            rc = k3_io_write_file_atomic(path, cfg, strlen(cfg), e);
        free(cfg);
    }
    if (rc == 0)
        rc = k3_io_fsync_dir(tmpdir, e);
    /* publish: move an old checkpoint aside, rename ours into place */
    if (rc == 0) {
        char old[PATH_MAX + 16];
        snprintf(old, sizeof old, "%s" SYNTH_OLD_SUFFIX, dst);
        int moved = 0;
        if (dst_exists && (rc = remove_checkpoint_dir(old, e)) == 0) {
            if (rename(dst, old) != 0)
                rc = k3_err_sys(e, K3_EIO, errno, "%s: cannot move aside", dst);
            else
                moved = 1;
        }
        if (rc == 0 && rename(tmpdir, dst) != 0) {
            rc = k3_err_sys(e, K3_EIO, errno, "%s: cannot rename to %s", tmpdir, dst);
            if (moved)
                rename(old, dst);
            moved = 0;
        }
        if (rc == 0) {
            made_dir = 0;
            rc = k3_io_fsync_dir(dst, e);
        }
        if (moved) {
            k3_err e2 = {0};
            remove_checkpoint_dir(old, &e2);   /* the old one held only checkpoint files, checked below */
        }
    }
    if (rc && made_dir) {
        k3_err e2 = {0};
        remove_checkpoint_dir(tmpdir, &e2);
    }
    if (rc == 0)
        k3_progress_finish(prog);
    k3_progress_free(prog);
    r->tensors = count;
    r->shards = nshards;
    free(names);
    free(t);
    k3_synth_bpe_free(tok, tlen, ranks);
    return rc;
}
