/*
 * conv_part.c - a conversion across machines: k3-convert --part SPEC SRC
 * PART converts only some shard groups (each machine holds some of the
 * shards; the others are stood in for by their headers, k3_st.h), and
 * k3-convert --merge DST PART... puts the parts together into the packed
 * model a single run writes, byte for byte, without copying a data file.
 *
 * Why it is byte-identical: every output file belongs to one group (one
 * upstream shard) and its bytes depend only on the plan, which depends only
 * on the headers, the config and the options (conv_plan.c); a part computes
 * the same plan from the stand-ins as a whole run from the shards. A part
 * keeps what a whole run keeps until its end: its groups' files, their
 * journal entries (sizes, SHA-256, CRCs, the embedding's row CRCs), and adds
 * the small inputs the merge needs (.k3-convert-part/: config, index,
 * tokenizer files, every shard's stand-in) and part.json, written last. The
 * merge rebuilds the plan from a part's skeleton, checks the parts against
 * it and each other, renames the files in and runs the same last step as a
 * whole run (k3_conv_finish).
 *
 * Invariants: a part without part.json is unfinished and never merged; a
 * group's journal entry is written into DST before its files are renamed
 * there, so an interrupted merge continues (the same command again) without
 * losing a file; nothing is copied, and parts on another filesystem than DST
 * are refused before anything moves.
 */
#include "conv_run.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <inttypes.h>
#include <signal.h>
#include <openssl/evp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "k3_cli.h"
#include "k3_dest.h"
#include "k3_io.h"
#include "k3_journal.h"

#define PART_DIR ".k3-convert-part"
#define PART_MARK "part.json"
#define PART_FORMAT "k3-convert-part"

static const char *small_names[] = {"config.json", "model.safetensors.index.json", "tiktoken.model",
                                    "tokenizer_config.json"};

/* ---- which groups a part converts --------------------------------------------- */

static int shard_by_name(const k3_conv_plan *p, const char *name, size_t len)
{
    for (uint32_t s = 0; s < k3_st_shard_count(p->st); s++) {
        const char *n = k3_st_shard_name(p->st, s);
        if (strlen(n) == len && !memcmp(n, name, len))
            return (int)s;
    }
    return -1;
}

int k3_conv_part_select(const k3_conv_plan *p, const char *spec, uint8_t *sel, FILE *progress, k3_err *e)
{
    const uint32_t ng = p->ngroups;
    int present = !strcmp(spec, "present");
    const char *slash = strchr(spec, '/');
    uint64_t j, n;
    if (present) {
        for (uint32_t g = 0; g < ng; g++)
            sel[g] = k3_st_shard_present(p->st, p->groups[g].shard_first);
    } else if (slash && strspn(spec, "0123456789") == (size_t)(slash - spec) && slash > spec) {
        /* job j of n (1-based, as batch array indexes usually are): the
         * contiguous run of shards [(j-1)*S/n, j*S/n) */
        char jb[32];
        size_t jl = (size_t)(slash - spec);
        if (jl >= sizeof jb || (memcpy(jb, spec, jl), jb[jl] = 0, k3_cli_parse_u64(slash + 1, 1, 65536, &n)) ||
            k3_cli_parse_u64(jb, 1, n, &j))
            return k3_err_set(e, K3_EARG, "--part %s: J/N needs 1 <= J <= N <= 65536", spec);
        for (uint32_t g = 0; g < ng; g++)
            sel[g] = (uint64_t)g >= (j - 1) * ng / n && (uint64_t)g < j * ng / n;
    } else {
        /* shard file names, comma-separated */
        for (const char *a = spec; *a;) {
            const char *c = strchr(a, ',');
            size_t len = c ? (size_t)(c - a) : strlen(a);
            int s = len ? shard_by_name(p, a, len) : -1;
            if (s < 0)
                return k3_err_set(e, K3_EARG, "--part: %.*s is not a shard of %s (SPEC: present, J/N or shard file "
                                  "names separated by commas)", (int)len, a, p->src);
            for (uint32_t g = 0; g < ng; g++)
                if ((uint32_t)s >= p->groups[g].shard_first && (uint32_t)s < p->groups[g].shard_end) {
                    if (sel[g])
                        return k3_err_set(e, K3_EARG, "--part: %.*s is named twice", (int)len, a);
                    sel[g] = 1;
                }
            a = c ? c + 1 : a + len;
        }
    }
    uint32_t nsel = 0;
    for (uint32_t g = 0; g < ng; g++) {
        if (!sel[g])
            continue;
        uint32_t sh;
        const char *t;
        if (!k3_conv_group_inputs_here(p, g, &sh, &t)) {
            const char *gname = k3_st_shard_name(p->st, p->groups[g].shard_first);
            if (!present)
                return t ? k3_err_set(e, K3_ENOENT, "%s: converting %s needs tensor %s of %s, which is not here "
                                      "(only its header): put that shard here too", p->src, gname, t,
                                      k3_st_shard_name(p->st, sh))
                         : k3_err_set(e, K3_ENOENT, "%s: %s is not here (only its header)", p->src, gname);
            if (progress)
                fprintf(progress, "k3-convert: %s left out: it needs tensor %s of %s, which is not here\n", gname,
                        t, k3_st_shard_name(p->st, sh));
            sel[g] = 0;
            continue;
        }
        nsel++;
    }
    if (!nsel)
        return k3_err_set(e, K3_EARG, "--part %s: selects no shard of %s that can be converted here", spec, p->src);
    return 0;
}

/* ---- the end of a part ----------------------------------------------------------- */

int k3_conv_part_finish(conv *cv, const uint8_t *sel, k3_err *e)
{
    k3_conv_plan *p = cv->p;
    char dir[4200], path[4400], hex[65];
    int rc = k3_io_path_join(dir, sizeof dir, p->dst, PART_DIR, e);
    if (rc)
        return rc;
    if (mkdir(dir, 0755) != 0 && errno != EEXIST)
        return k3_err_sys(e, K3_EIO, errno, "%s: cannot create directory", dir);
    cJSON *root = cJSON_CreateObject();
    cJSON_AddStringToObject(root, "format", PART_FORMAT);
    k3_man_hex(p->fingerprint, hex);
    cJSON_AddStringToObject(root, "fingerprint", hex);
    cJSON_AddStringToObject(root, "trunk_dtype", p->man.trunk_dtypes);
    cJSON *files = cJSON_AddArrayToObject(root, "source_files");
    /* the small upstream files, as they are, for the merge's plan and manifest */
    for (int i = 0; rc == 0 && i < 4; i++) {
        char *buf = NULL;
        uint64_t len = 0;
        if ((rc = k3_io_path_join(path, sizeof path, p->src, small_names[i], e)))
            break;
        if (access(path, F_OK) != 0)
            continue;
        if ((rc = k3_io_read_file(path, 1ull << 30, &buf, &len, e)))
            break;
        uint8_t sha[32];
        unsigned int hl;
        EVP_Digest(buf, (size_t)len, sha, &hl, EVP_sha256(), NULL);
        cJSON_AddItemToArray(files, k3_conv_named_hash(small_names[i], len, sha));
        if ((rc = k3_io_path_join(path, sizeof path, dir, small_names[i], e)) == 0)
            rc = k3_io_write_file_atomic(path, buf, len, e);
        free(buf);
    }
    /* every shard's stand-in: the merge plans from them */
    for (uint32_t s = 0; rc == 0 && s < k3_st_shard_count(p->st); s++) {
        uint8_t *buf;
        uint64_t len;
        char name[300];
        if ((rc = k3_st_standin_bytes(p->st, s, &buf, &len, e)))
            break;
        snprintf(name, sizeof name, "%s%s", k3_st_shard_name(p->st, s), K3_ST_STANDIN_SUFFIX);
        if ((rc = k3_io_path_join(path, sizeof path, dir, name, e)) == 0)
            rc = k3_io_write_file_atomic(path, buf, len, e);
        free(buf);
    }
    cJSON *gs = cJSON_AddArrayToObject(root, "groups");
    for (uint32_t g = 0; g < p->ngroups; g++)
        if (sel[g]) {
            cJSON *o = cJSON_CreateObject();
            cJSON_AddNumberToObject(o, "group", g);
            cJSON_AddStringToObject(o, "shard", k3_st_shard_name(p->st, p->groups[g].shard_first));
            cJSON_AddItemToArray(gs, o);
        }
    char *txt = rc ? NULL : cJSON_Print(root);
    cJSON_Delete(root);
    if (rc == 0 && !txt)
        rc = k3_err_set(e, K3_ENOMEM, "out of memory");
    if (rc == 0)
        rc = k3_io_fsync_dir(dir, e);
    /* last: what makes the part look finished */
    if (rc == 0 && (rc = k3_io_path_join(path, sizeof path, p->dst, PART_MARK, e)) == 0)
        rc = k3_io_write_file_atomic(path, txt, strlen(txt), e);
    free(txt);
    return rc;
}

/* ---- stand-ins --------------------------------------------------------------------- */

int k3_conv_headers(const char *src, const char *out, k3_err *e)
{
    k3_st *st = NULL;
    int rc = k3_st_open(&st, src, 0, e);
    if (rc)
        return rc;
    struct stat sb;
    if (stat(out, &sb) != 0) {
        if (errno != ENOENT || mkdir(out, 0755) != 0)
            rc = k3_err_sys(e, K3_EIO, errno, "%s: cannot create directory", out);
    } else if (!S_ISDIR(sb.st_mode)) {
        rc = k3_err_set(e, K3_EEXIST, "%s: exists and is not a directory", out);
    }
    for (uint32_t s = 0; rc == 0 && s < k3_st_shard_count(st); s++) {
        uint8_t *buf;
        uint64_t len;
        char name[300], path[4400];
        if ((rc = k3_st_standin_bytes(st, s, &buf, &len, e)))
            break;
        snprintf(name, sizeof name, "%s%s", k3_st_shard_name(st, s), K3_ST_STANDIN_SUFFIX);
        rc = k3_io_path_join(path, sizeof path, out, name, e);
        /* never replace a file we did not write: an existing stand-in must be this one */
        char *old = NULL;
        uint64_t olen = 0;
        if (rc == 0 && access(path, F_OK) == 0) {
            if ((rc = k3_io_read_file(path, len + 1, &old, &olen, e)) == 0 && (olen != len || memcmp(old, buf, len)))
                rc = k3_err_set(e, K3_EEXIST, "%s: exists and is not the header of %s; not replacing it", path,
                                k3_st_shard_path(st, s));
            free(old);
        } else if (rc == 0) {
            rc = k3_io_write_file_atomic(path, buf, len, e);
        }
        free(buf);
    }
    k3_st_close(st);
    return rc;
}

/* ---- the merge ------------------------------------------------------------------- */

typedef struct part {
    const char *arg;
    k3_dest dest;               /* checked and locked */
    cJSON *mark;                /* part.json */
    dev_t dev;
    ino_t ino;
} part;

static int read_mark(part *pt, k3_err *e)
{
    char path[4400], *txt;
    uint64_t len;
    int rc = k3_io_path_join(path, sizeof path, pt->dest.path, PART_MARK, e);
    if (rc)
        return rc;
    if (access(path, F_OK) != 0)
        return k3_err_set(e, K3_ENOENT, "%s: not a finished part (no %s): run its k3-convert --part again with "
                          "--resume", pt->arg, PART_MARK);
    if ((rc = k3_io_read_file(path, 64u << 20, &txt, &len, e)))
        return rc;
    pt->mark = cJSON_ParseWithLength(txt, (size_t)len);
    free(txt);
    const cJSON *f = cJSON_GetObjectItemCaseSensitive(pt->mark, "format");
    if (!cJSON_IsString(f) || strcmp(f->valuestring, PART_FORMAT) ||
        !cJSON_IsString(cJSON_GetObjectItemCaseSensitive(pt->mark, "fingerprint")) ||
        !cJSON_IsString(cJSON_GetObjectItemCaseSensitive(pt->mark, "trunk_dtype")) ||
        !cJSON_IsArray(cJSON_GetObjectItemCaseSensitive(pt->mark, "groups")) ||
        !cJSON_IsArray(cJSON_GetObjectItemCaseSensitive(pt->mark, "source_files")))
        return k3_err_set(e, K3_EFORMAT, "%s: %s is not a k3-convert part mark", pt->arg, PART_MARK);
    return 0;
}

static const char *mark_str(const part *pt, const char *key)
{
    return cJSON_GetObjectItemCaseSensitive(pt->mark, key)->valuestring;
}

/* name in dir exists? */
static int here(const char *dir, const char *name)
{
    char path[4400];
    k3_err ignore = {0};
    return k3_io_path_join(path, sizeof path, dir, name, &ignore) == 0 && access(path, F_OK) == 0;
}

/* Move group g's files from the part into DST: its journal entry first (a
 * kill after it leaves the files findable), then the files by rename. */
static int move_group(conv *cv, uint32_t g, part *pt, const char *dst, k3_err *e)
{
    k3_conv_plan *p = cv->p;
    const k3_conv_group *G = &p->groups[g];
    const char *why = "";
    const char *gname = k3_st_shard_name(p->st, G->shard_first);
    p->dst = (char *)dst;
    int ok = k3_conv_journal_load_group(cv, g, &why, e);
    if (ok)
        return ok < 0 ? ok : 0; /* moved by an earlier, interrupted merge */
    p->dst = (char *)pt->dest.path;
    ok = k3_conv_journal_load_group(cv, g, &why, e);
    p->dst = (char *)dst;
    if (ok < 0)
        return ok;
    int rc;
    if (ok && g == cv->embed_group)
        cv->erow_at = (uint64_t)p->cfg.vocab_size * cv->erow_rb; /* the row CRCs loaded whole */
    if (ok && (rc = k3_conv_journal_write_group(cv, g, e)))
        return rc;
    if (!ok) {
        /* an interrupted merge may have moved some of the files after
         * writing DST's entry: finish moving them, then check again */
        const k3_conv_ofile *of[2] = {&G->trunk, &G->experts};
        int some = 0;
        for (int k = 0; k < 2; k++)
            some |= of[k]->size && here(dst, of[k]->name) && !here(pt->dest.path, of[k]->name);
        if (!some)
            return k3_err_set(e, K3_ECORRUPT, "%s: %s (group %u): %s", pt->arg, gname, g, why);
    }
    const k3_conv_ofile *of[2] = {&G->trunk, &G->experts};
    for (int k = 0; k < 2; k++) {
        char from[4400], to[4400];
        if (!of[k]->size || !here(pt->dest.path, of[k]->name))
            continue;
        if ((rc = k3_io_path_join(from, sizeof from, pt->dest.path, of[k]->name, e)) ||
            (rc = k3_io_path_join(to, sizeof to, dst, of[k]->name, e)))
            return rc;
        if (rename(from, to) != 0)
            return k3_err_sys(e, errno == EXDEV ? K3_EARG : K3_EIO, errno, "%s: cannot move it to %s", from, to);
        /* test hook, as conv_run.c's: K3_CONVERT_CRASH=merge:G kills the
         * merge after group G's first file is moved */
        const char *v = getenv("K3_CONVERT_CRASH");
        char want[32];
        snprintf(want, sizeof want, "merge:%u", g);
        if (v && !strcmp(v, want))
            raise(SIGKILL);
    }
    if ((rc = k3_io_fsync_dir(dst, e)) || (rc = k3_io_fsync_dir(pt->dest.path, e)))
        return rc;
    if (!ok && k3_conv_journal_load_group(cv, g, &why, e) != 1)
        return k3_err_set(e, K3_ECORRUPT, "%s: %s (group %u): %s", pt->arg, gname, g, why);
    return 0;
}

/* DST for a merge: absent, empty, or an interrupted merge of the same plan
 * (its journal); anything else only with --force, as for a whole run. */
static int merge_prepare(const k3_conv_plan *p, const k3_conv_opts *o, k3_dest_state state, k3_err *e)
{
    char hex[65];
    k3_man_hex(p->fingerprint, hex);
    k3_journal j;
    int rc = k3_conv_journal(&j, p->dst, e);
    if (rc)
        return rc;
    if (state == K3_DEST_ABSENT) {
        if (mkdir(p->dst, 0755) != 0)
            return k3_err_sys(e, K3_EIO, errno, "%s: cannot create directory", p->dst);
    } else if (state == K3_DEST_OURS) {
        int cmp = k3_journal_exists(&j) && !here(p->dst, "manifest.json") ? k3_journal_plan_cmp(&j, hex, e) : 1;
        if (cmp < 0)
            return cmp;
        if (cmp == 0)
            return 0; /* an interrupted merge of these parts: go on */
        if (!o->force)
            return k3_err_set(e, K3_EEXIST, "%s: exists and is not empty (--force to replace it)", p->dst);
        if ((rc = k3_dest_clear(&k3_conv_dest_tool, p->dst, 0, 0, e)))
            return rc;
    }
    rc = k3_journal_begin(&j, hex, e);
    return rc ? rc : k3_io_fsync_dir(p->dst, e);
}

int k3_conv_merge(const char *dst, const char *const *parts, int nparts, const k3_conv_opts *o, k3_conv_stats *s,
                  k3_err *e)
{
    memset(s, 0, sizeof *s);
    part *pt = calloc((size_t)nparts, sizeof *pt);
    if (!pt)
        return k3_err_set(e, K3_ENOMEM, "out of memory");
    int rc = 0, np = 0;
    k3_dest dest = {0};
    dest.lock_fd = -1;
    k3_conv_plan plan;
    memset(&plan, 0, sizeof plan);
    conv cv;
    memset(&cv, 0, sizeof cv);
    uint32_t *owner = NULL;
    char skel[4200], *own_dst = NULL;
    /* every part: ours, not being written, finished, of the first one's conversion */
    for (; rc == 0 && np < nparts; np++) {
        part *q = &pt[np];
        q->arg = parts[np];
        q->dest.lock_fd = -1;
        struct stat sb;
        if (stat(q->arg, &sb) != 0 || !S_ISDIR(sb.st_mode)) {
            rc = k3_err_sys(e, K3_ENOENT, errno ? errno : ENOTDIR, "%s: not a part directory", q->arg);
            break;
        }
        q->dev = sb.st_dev;
        q->ino = sb.st_ino;
        for (int k = 0; rc == 0 && k < np; k++)
            if (pt[k].dev == q->dev && pt[k].ino == q->ino)
                rc = k3_err_set(e, K3_EARG, "%s: the same part as %s, given twice", q->arg, pt[k].arg);
        if (rc || (rc = k3_dest_open(&q->dest, &k3_conv_dest_tool, NULL, q->arg, e)) || (rc = read_mark(q, e)))
            break;
        if (np && strcmp(mark_str(q, "fingerprint"), mark_str(&pt[0], "fingerprint")))
            rc = k3_err_set(e, K3_EARG, "%s: a part of another conversion than %s (the checkpoint's headers, "
                            "config or --trunk-dtype differ)", q->arg, pt[0].arg);
        else if (np && !cJSON_Compare(cJSON_GetObjectItemCaseSensitive(q->mark, "source_files"),
                                      cJSON_GetObjectItemCaseSensitive(pt[0].mark, "source_files"), 1))
            rc = k3_err_set(e, K3_EARG, "%s: a part of another checkpoint than %s (config, index or tokenizer "
                            "files differ)", q->arg, pt[0].arg);
    }
    struct stat dsb;
    for (int k = 0; rc == 0 && k < np && stat(dst, &dsb) == 0; k++)
        if (pt[k].dev == dsb.st_dev && pt[k].ino == dsb.st_ino)
            rc = k3_err_set(e, K3_EARG, "%s: DST is one of the parts (%s); merge into a new directory", dst,
                            pt[k].arg);
    if (rc)
        goto out;
    /* the plan, from the first part's copy of the small inputs and headers */
    if ((rc = k3_io_path_join(skel, sizeof skel, pt[0].dest.path, PART_DIR, e)))
        goto out;
    if ((rc = k3_dest_open(&dest, &k3_conv_dest_tool, NULL, dst, e)))
        goto out;
    if ((rc = k3_conv_plan_build(&plan, skel, dest.path, !strcmp(mark_str(&pt[0], "trunk_dtype"), "bf16"), skel, e)))
        goto out;
    own_dst = plan.dst; /* move_group points plan.dst at a part for a while */
    char hex[65];
    k3_man_hex(plan.fingerprint, hex);
    if (strcmp(hex, mark_str(&pt[0], "fingerprint"))) {
        rc = k3_err_set(e, K3_ECORRUPT, "%s: %s does not give the plan its %s names (edited?)", pt[0].arg, PART_DIR,
                        PART_MARK);
        goto out;
    }
    /* every group exactly once */
    owner = malloc((plan.ngroups ? plan.ngroups : 1) * sizeof *owner);
    if (!owner) {
        rc = k3_err_set(e, K3_ENOMEM, "out of memory");
        goto out;
    }
    for (uint32_t g = 0; g < plan.ngroups; g++)
        owner[g] = UINT32_MAX;
    for (int k = 0; rc == 0 && k < nparts; k++) {
        const cJSON *it;
        cJSON_ArrayForEach(it, cJSON_GetObjectItemCaseSensitive(pt[k].mark, "groups")) {
            const cJSON *gj = cJSON_GetObjectItemCaseSensitive(it, "group");
            const cJSON *sj = cJSON_GetObjectItemCaseSensitive(it, "shard");
            if (!cJSON_IsNumber(gj) || gj->valuedouble < 0 || gj->valuedouble >= plan.ngroups ||
                gj->valuedouble != (double)(uint32_t)gj->valuedouble || !cJSON_IsString(sj) ||
                strcmp(sj->valuestring, k3_st_shard_name(plan.st, plan.groups[(uint32_t)gj->valuedouble].shard_first))) {
                rc = k3_err_set(e, K3_EFORMAT, "%s: %s: a group that is not in the plan", pt[k].arg, PART_MARK);
                break;
            }
            uint32_t g = (uint32_t)gj->valuedouble;
            if (owner[g] != UINT32_MAX) {
                rc = k3_err_set(e, K3_EARG, "%s: %s is also in %s: give each shard's part once", pt[k].arg,
                                sj->valuestring, pt[owner[g]].arg);
                break;
            }
            owner[g] = (uint32_t)k;
        }
    }
    uint32_t gaps = 0, first_gap = 0;
    for (uint32_t g = 0; rc == 0 && g < plan.ngroups; g++)
        if (owner[g] == UINT32_MAX && !gaps++)
            first_gap = g;
    if (rc == 0 && gaps)
        rc = k3_err_set(e, K3_ENOENT, "%s is in none of the parts%s%u shard(s) missing): convert it with k3-convert "
                        "--part %s", k3_st_shard_name(plan.st, plan.groups[first_gap].shard_first), " (", gaps,
                        k3_st_shard_name(plan.st, plan.groups[first_gap].shard_first));
    if (rc)
        goto out;
    /* rename only: a part on another filesystem is refused before anything moves */
    {
        char parent[4200];
        snprintf(parent, sizeof parent, "%s", dest.path);
        char *sl = strrchr(parent, '/');
        if (sl)
            *(sl == parent ? sl + 1 : sl) = 0;
        struct stat ds;
        if (stat(dest.state == K3_DEST_ABSENT ? parent : dest.path, &ds) != 0) {
            rc = k3_err_sys(e, K3_EIO, errno, "%s: cannot stat", dest.state == K3_DEST_ABSENT ? parent : dest.path);
            goto out;
        }
        for (int k = 0; k < nparts; k++)
            if (pt[k].dev != ds.st_dev) {
                rc = k3_err_set(e, K3_EARG, "%s: on another filesystem than %s; the merge moves files, it does not "
                                "copy them: move the part next to DST first (mv), then merge", pt[k].arg, dst);
                goto out;
            }
    }
    if ((rc = k3_conv_cv_init(&cv, &plan, o, s, e)) || (rc = merge_prepare(&plan, o, dest.state, e)))
        goto out;
    for (uint32_t g = 0; rc == 0 && g < plan.ngroups; g++) {
        if (k3_conv_stop_requested) {
            rc = k3_err_set(e, K3_EINTR, "interrupted");
            break;
        }
        rc = move_group(&cv, g, &pt[owner[g]], own_dst, e);
        s->groups++;
    }
    plan.dst = own_dst;
    if (rc == 0)
        rc = k3_conv_finish(&cv, e);
    /* the parts are spent: what is left of them goes (only what k3-convert wrote) */
    for (int k = 0; rc == 0 && k < nparts; k++) {
        k3_err ignore = {0};
        if (k3_dest_clear(&k3_conv_dest_tool, pt[k].dest.path, 0, 1, &ignore) && o->progress)
            fprintf(o->progress, "k3-convert: %s: left in place: %s\n", pt[k].arg, ignore.msg);
    }
out:
    if (own_dst)
        plan.dst = own_dst;
    k3_conv_cv_free(&cv);
    k3_conv_plan_free(&plan);
    free(owner);
    for (int k = 0; k < np; k++) {
        cJSON_Delete(pt[k].mark);
        k3_dest_close(&pt[k].dest);
    }
    free(pt);
    k3_dest_close(&dest);
    return rc;
}
