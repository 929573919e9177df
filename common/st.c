/*
 * st.c - safetensors checkpoints: the checkpoint-wide tensor index over the
 * shards' headers (st_header.c), the index file, and tensor reads (see
 * k3_st.h). The name table is st_ntab.h.
 *
 * Invariants:
 * - A parsed header is fully validated before anything is returned: every
 *   tensor has a known dtype, at most K3_ST_MAX_DIMS dims, a byte size equal
 *   to product(shape) * dtype size computed without overflow, and the
 *   tensors tile the data area exactly: no overlap, no hole, nothing after
 *   the last tensor (the safetensors format requires the byte buffer to be
 *   entirely indexed). Tensors are kept sorted by offset.
 * - A k3_st's tensor array is the concatenation of its shards' sorted arrays
 *   (shards in name order), so it is sorted by (shard, offset); it is never
 *   reallocated after k3_st_open returns, so borrowed pointers stay valid.
 * - Names are unique in the whole checkpoint (one open-addressing table,
 *   power-of-two sized, at most half full, a word-at-a-time hash).
 * - With an index file, the index and the shards agree exactly (same tensor
 *   set, same tensor -> shard map, no unreferenced shard file in the folder).
 * - k3_st_open parses the index and the headers on worker threads that touch
 *   only their own shard slot and error record; everything after (merging,
 *   the table, cross-checks, the choice of error) runs on the caller's thread
 *   in a fixed order, so results never depend on timing.
 */
#include "k3_st.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <omp.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "k3_io.h"
#include "st_json.h"
#include "st_ntab.h"

#define INDEX_NAME "model.safetensors.index.json"
#define MAX_SHARD_NAME 255u
#define DIRECT_CHUNK (4u << 20)

/* ---- the checkpoint ------------------------------------------------------- */

typedef struct shard {
    char *path;
    const char *name;   /* points into path */
    int fd;
    int direct;
    uint64_t size;
    uint64_t data_start;
    char *names;        /* the names block of its header */
    char *standin;      /* NULL, or the stand-in file its header came from (no data here) */
} shard;

struct k3_st {
    shard *shards;
    uint32_t nshards;
    k3_st_tensor *tensors;
    uint64_t count;
    ntab table;
};

void k3_st_close(k3_st *st)
{
    if (!st)
        return;
    for (uint32_t i = 0; i < st->nshards; i++) {
        if (st->shards[i].fd >= 0)
            close(st->shards[i].fd);
        free(st->shards[i].path);
        free(st->shards[i].names);
        free(st->shards[i].standin);
    }
    free(st->shards);
    free(st->tensors);
    ntab_free(&st->table);
    free(st);
}

/* The index: tensor -> shard, decoded in place in its own text. */
typedef struct index_entry {
    const char *tensor;
    uint32_t shard;   /* into index_map.shard_names, later remapped to sorted order */
    uint64_t pos;     /* byte offset in the index file */
} index_entry;

typedef struct index_map {
    char *text;
    index_entry *entries;
    uint64_t count;
    const char **shard_names;
    uint32_t nshards;
} index_map;

static void index_free(index_map *m)
{
    free(m->text);
    free(m->entries);
    free(m->shard_names);
    memset(m, 0, sizeof *m);
}

static int shard_name_ok(const char *s)
{
    size_t n = strlen(s);
    static const char suffix[] = ".safetensors";
    return n > sizeof suffix - 1 && n <= MAX_SHARD_NAME && !strchr(s, '/') && !strchr(s, '\\') && s[0] != '.' &&
           !strcmp(s + n - (sizeof suffix - 1), suffix);
}

static int cmp_str(const void *a, const void *b)
{
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

static int parse_weight_map(k3_jc *j, index_map *m, ntab *shard_tab)
{
    int rc;
    uint64_t cap = 1024;
    uint32_t last = 0;
    k3_jc_ws(j);
    if (j->p >= j->end || *j->p != '{')
        return k3_jc_fail(j, NULL, K3_EFORMAT, "weight_map must be an object, found %s", k3_jc_kind(j));
    j->p++;
    m->entries = malloc(cap * sizeof *m->entries);
    m->shard_names = malloc(K3_ST_MAX_SHARDS * sizeof *m->shard_names);
    if (!m->entries || !m->shard_names || ntab_init(shard_tab, K3_ST_MAX_SHARDS))
        return k3_err_set(j->e, K3_ENOMEM, "%s: out of memory", j->file);
    k3_jc_ws(j);
    if (j->p < j->end && *j->p == '}') {
        j->p++;
        return 0;
    }
    for (;;) {
        k3_jc_ws(j);
        const uint8_t *kpos = j->p;
        char *name = (char *)j->p;
        size_t nlen;
        /* in place: the decoded string lands where its quote was */
        if ((rc = k3_jc_string(j, name, (size_t)(j->end - j->p), &nlen, "tensor name")))
            return rc;
        if (nlen == 0)
            return k3_jc_fail(j, kpos, K3_EFORMAT, "empty tensor name");
        if (nlen > K3_ST_MAX_NAME)
            return k3_jc_fail(j, kpos, K3_EFORMAT, "tensor name is longer than %u bytes", K3_ST_MAX_NAME);
        if ((rc = k3_jc_expect(j, ':', "after a tensor name")))
            return rc;
        j->tensor = name;
        k3_jc_ws(j);
        const uint8_t *vpos = j->p;
        char *sname = (char *)j->p;
        size_t slen;
        if ((rc = k3_jc_string(j, sname, (size_t)(j->end - j->p), &slen, "shard name")))
            return rc;
        if (!shard_name_ok(sname))
            return k3_jc_fail(j, vpos, K3_EFORMAT,
                              "shard name \"%.300s\" is not a plain file name ending in .safetensors", sname);
        if (m->count == cap) {
            if (cap >= K3_ST_MAX_TENSORS)
                return k3_jc_fail(j, kpos, K3_ELIMIT, "more than %llu tensors", (unsigned long long)K3_ST_MAX_TENSORS);
            cap *= 2;
            index_entry *ne = realloc(m->entries, cap * sizeof *ne);
            if (!ne)
                return k3_err_set(j->e, K3_ENOMEM, "%s: out of memory", j->file);
            m->entries = ne;
        }
        /* consecutive entries mostly name the same shard */
        int64_t s = m->nshards && !strcmp(m->shard_names[last], sname) ? (int64_t)last
                                                                         : ntab_find(shard_tab, sname);
        if (s < 0) {
            if (m->nshards == K3_ST_MAX_SHARDS)
                return k3_jc_fail(j, vpos, K3_ELIMIT, "more than %u shards", K3_ST_MAX_SHARDS);
            s = m->nshards;
            m->shard_names[m->nshards++] = sname;
            ntab_insert(shard_tab, sname, (uint32_t)s);
        }
        last = (uint32_t)s;
        m->entries[m->count].tensor = name;
        m->entries[m->count].shard = (uint32_t)s;
        m->entries[m->count].pos = (uint64_t)(kpos - j->start);
        m->count++;
        j->tensor = NULL;
        k3_jc_ws(j);
        if (j->p < j->end && *j->p == '}') {
            j->p++;
            return 0;
        }
        if ((rc = k3_jc_expect(j, ',', "or '}' in weight_map")))
            return rc;
    }
}

static int index_load(index_map *m, const char *path, k3_err *e)
{
    uint64_t len;
    int rc = k3_io_read_file(path, K3_ST_MAX_INDEX, &m->text, &len, e);
    if (rc)
        return rc;
    ntab shard_tab = {0};
    k3_jc j = {.start = (uint8_t *)m->text, .p = (uint8_t *)m->text, .end = (uint8_t *)m->text + len, .file = path, .e = e};
    int have_map = 0;
    k3_jc_ws(&j);
    if (j.p >= j.end || *j.p != '{') {
        rc = k3_jc_fail(&j, NULL, K3_EFORMAT, "index is not a JSON object (found %s)", k3_jc_kind(&j));
        goto out;
    }
    j.p++;
    k3_jc_ws(&j);
    if (j.p < j.end && *j.p == '}') {
        j.p++;
    } else {
        for (;;) {
            char key[64];
            k3_jc_ws(&j);
            const uint8_t *kpos = j.p;
            rc = k3_jc_string(&j, key, sizeof key, NULL, "index key");
            if (rc == K3_ELIMIT) {
                k3_err_clear(e);
                key[0] = '\0';
                j.p = kpos;
                rc = k3_jc_string(&j, NULL, 0, NULL, "index key");
            }
            if (rc || (rc = k3_jc_expect(&j, ':', "after a key")))
                goto out;
            if (!strcmp(key, "weight_map")) {
                if (have_map++) {
                    rc = k3_jc_fail(&j, kpos, K3_EFORMAT, "weight_map given twice");
                    goto out;
                }
                if ((rc = parse_weight_map(&j, m, &shard_tab)))
                    goto out;
            } else if ((rc = k3_jc_skip(&j))) {
                goto out;
            }
            k3_jc_ws(&j);
            if (j.p < j.end && *j.p == '}') {
                j.p++;
                break;
            }
            if ((rc = k3_jc_expect(&j, ',', "or '}' in the index")))
                goto out;
        }
    }
    k3_jc_ws(&j);
    if (j.p != j.end) {
        rc = k3_jc_fail(&j, NULL, K3_EFORMAT, "bytes after the index JSON");
        goto out;
    }
    if (!have_map) {
        rc = k3_err_set(e, K3_EFORMAT, "%s: no weight_map object", path);
        goto out;
    }
    if (m->nshards == 0) {
        rc = k3_err_set(e, K3_EFORMAT, "%s: weight_map is empty", path);
        goto out;
    }
    /* shards in name order; entries follow */
    {
        const char **sorted = malloc(m->nshards * sizeof *sorted);
        uint32_t *remap = malloc(m->nshards * sizeof *remap);
        if (!sorted || !remap) {
            free(sorted);
            free(remap);
            rc = k3_err_set(e, K3_ENOMEM, "%s: out of memory", path);
            goto out;
        }
        memcpy(sorted, m->shard_names, m->nshards * sizeof *sorted);
        qsort(sorted, m->nshards, sizeof *sorted, cmp_str);
        for (uint32_t i = 0; i < m->nshards; i++)
            remap[ntab_find(&shard_tab, sorted[i])] = i;
        for (uint64_t i = 0; i < m->count; i++)
            m->entries[i].shard = remap[m->entries[i].shard];
        memcpy(m->shard_names, sorted, m->nshards * sizeof *sorted);
        free(sorted);
        free(remap);
    }
out:
    ntab_free(&shard_tab);
    return rc;
}

static int has_suffix(const char *s, const char *suf)
{
    size_t n = strlen(s), k = strlen(suf);
    return n >= k && !strcmp(s + n - k, suf);
}

/* The sorted *.safetensors file names in dir (heap array of heap strings). */
static int list_shards(const char *dir, char ***names, uint32_t *count, k3_err *e)
{
    *names = NULL;
    *count = 0;
    DIR *d = opendir(dir);
    if (!d)
        return k3_err_sys(e, errno == ENOENT ? K3_ENOENT : K3_EIO, errno, "%s: cannot open directory", dir);
    uint32_t cap = 16, n = 0;
    char **v = malloc(cap * sizeof *v);
    int rc = v ? 0 : k3_err_set(e, K3_ENOMEM, "%s: out of memory", dir);
    struct dirent *de;
    while (!rc && (de = readdir(d))) {
        if (de->d_name[0] == '.' || !has_suffix(de->d_name, ".safetensors"))
            continue;
        if (n == K3_ST_MAX_SHARDS) {
            rc = k3_err_set(e, K3_ELIMIT, "%s: more than %u *.safetensors files", dir, K3_ST_MAX_SHARDS);
            break;
        }
        if (n == cap) {
            char **nv = realloc(v, 2 * cap * sizeof *v);
            if (!nv) {
                rc = k3_err_set(e, K3_ENOMEM, "%s: out of memory", dir);
                break;
            }
            v = nv;
            cap *= 2;
        }
        if (!(v[n] = strdup(de->d_name))) {
            rc = k3_err_set(e, K3_ENOMEM, "%s: out of memory", dir);
            break;
        }
        n++;
    }
    closedir(d);
    if (rc) {
        for (uint32_t i = 0; i < n; i++)
            free(v[i]);
        free(v);
        return rc;
    }
    qsort(v, n, sizeof *v, cmp_str);
    *names = v;
    *count = n;
    return 0;
}

static void free_names(char **v, uint32_t n)
{
    if (!v)
        return;
    for (uint32_t i = 0; i < n; i++)
        free(v[i]);
    free(v);
}

/* One shard opened and its header parsed: the parallel part of k3_st_open.
 * On error the fd stays in s (closed with the k3_st). */
typedef struct shard_load {
    k3_st_header h;
    k3_err err;
    int rc;
} shard_load;

/* A stand-in (k3_st.h): "K3STHDR1", u64 shard size, then the shard's first
 * data_start bytes (the length prefix and the header text). */
static void load_standin(shard *s, shard_load *l)
{
    char *buf = NULL;
    uint64_t len = 0;
    l->rc = k3_io_read_file(s->standin, 24 + (uint64_t)K3_ST_MAX_HEADER, &buf, &len, &l->err);
    if (l->rc)
        return;
    const uint8_t *b = (const uint8_t *)buf;
    uint64_t size = 0, n = 0, n2 = 0;
    for (int i = 7; len >= 32 && i >= 0; i--) {
        size = size << 8 | b[8 + i];
        n = n << 8 | b[16 + i];
        n2 = n2 << 8 | b[24 + i];
    }
    if (len < 32 || memcmp(buf, K3_ST_STANDIN_MAGIC, 8) || n != len - 32 || n2 != n)
        l->rc = k3_err_set(&l->err, K3_EFORMAT,
                           "%s: not a shard header stand-in (k3-convert --export-headers writes them)", s->standin);
    else
        l->rc = k3_st_header_parse(&l->h, s->path, b + 32, n, size, &l->err);
    if (!l->rc) {
        s->size = size;
        s->data_start = l->h.data_start;
    }
    free(buf);
}

static void load_shard(shard *s, shard_load *l, unsigned flags)
{
    k3_err_clear(&l->err);
    if (s->standin) {
        load_standin(s, l);
        return;
    }
    int fd = k3_io_open_read(s->path, (flags & K3_ST_DIRECT) != 0, &s->direct, &l->err);
    if (fd < 0) {
        l->rc = fd;
        return;
    }
    s->fd = fd;
    l->rc = k3_io_file_size(fd, &s->size, s->path, &l->err);
    if (!l->rc)
        l->rc = k3_st_header_read(&l->h, fd, s->path, &l->err);
    if (!l->rc)
        s->data_start = l->h.data_start;
}

/* The parallel phase of k3_st_open: job 0 is the index (if any), jobs 1..n
 * the shards. Plain threads that exit when the work is done (an OpenMP team
 * would leave threads spinning after every open, which costs a loaded
 * machine more than the parsing). */
typedef struct open_job {
    k3_st *st;
    shard_load *loads;
    unsigned flags;
    uint32_t nfiles;
    int have_index;
    index_map *m;
    const char *index_path;
    k3_err *index_err;
    int *index_rc;
    uint32_t next; /* atomic */
} open_job;

static void *open_worker(void *arg)
{
    open_job *j = arg;
    for (;;) {
        uint32_t k = __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED);
        if (k == 0) {
            if (j->have_index)
                *j->index_rc = index_load(j->m, j->index_path, j->index_err);
        } else if (k - 1 < j->nfiles) {
            load_shard(&j->st->shards[k - 1], &j->loads[k - 1], j->flags);
        } else {
            return NULL;
        }
    }
}

static void run_open_jobs(open_job *j)
{
    /* OMP_NUM_THREADS, as everywhere in k3, else the CPU count */
    long cpus = omp_get_max_threads();
    uint32_t jobs = j->nfiles + (j->have_index ? 1 : 0);
    uint32_t nthreads = cpus > 1 ? (uint32_t)(cpus < 16 ? cpus : 16) : 1;
    if (nthreads > jobs)
        nthreads = jobs ? jobs : 1;
    /* Fault injection (K3_FAULT) counts reads in a process-wide record: keep
     * it deterministic and race-free by loading shards one by one when it is
     * armed. A zero-byte read makes the hook load its settings now, before
     * any thread could race to do it. */
    const char *fault = getenv("K3_FAULT");
    if (fault && *fault)
        nthreads = 1;
    k3_io_pread(-1, NULL, 0, 0, "", NULL);
    pthread_t tid[16];
    uint32_t started = 0;
    for (uint32_t t = 1; t < nthreads; t++)
        if (pthread_create(&tid[started], NULL, open_worker, j) == 0)
            started++;
    open_worker(j); /* the caller works too; if no thread started it does all */
    for (uint32_t t = 0; t < started; t++)
        pthread_join(tid[t], NULL);
}

/* Append the parsed shards to st in shard order; the first failed shard (in
 * name order, whatever order the threads finished in) is the error. */
static int merge_shards(k3_st *st, shard_load *loads, k3_err *e)
{
    uint64_t total = 0;
    for (uint32_t i = 0; i < st->nshards; i++) {
        if (loads[i].rc) {
            if (e && !e->code)
                *e = loads[i].err;
            return loads[i].rc;
        }
        total += loads[i].h.count;
    }
    if (total > K3_ST_MAX_TENSORS)
        return k3_err_set(e, K3_ELIMIT, "%s: the checkpoint has %" PRIu64 " tensors, more than %llu",
                          st->shards[0].path, total, (unsigned long long)K3_ST_MAX_TENSORS);
    st->tensors = malloc((total ? total : 1) * sizeof *st->tensors);
    if (!st->tensors)
        return k3_err_set(e, K3_ENOMEM, "%s: out of memory for %" PRIu64 " tensors", st->shards[0].path, total);
    for (uint32_t i = 0; i < st->nshards; i++) {
        k3_st_header *h = &loads[i].h;
        for (uint64_t k = 0; k < h->count; k++) {
            h->tensors[k].shard = i;
            st->tensors[st->count + k] = h->tensors[k];
        }
        st->count += h->count;
        st->shards[i].names = h->names;
        h->names = NULL;
        k3_st_header_free(h);
    }
    return 0;
}

/* The index and the shards must list the same tensors in the same shards.
 * Each index entry is looked up in the checkpoint table; a tensor found twice
 * is a duplicate index entry, a tensor never found is missing from the index. */
static int check_against_index(k3_st *st, const index_map *m, const char *index_path, k3_err *e)
{
    uint8_t *seen = calloc((size_t)st->count + 1, 1);
    if (!seen)
        return k3_err_set(e, K3_ENOMEM, "%s: out of memory", index_path);
    int rc = 0;
    uint64_t matched = 0;
    hash_ring ring;
    for (uint64_t k = 0; k < m->count && k < PREFETCH_AHEAD; k++)
        ring_push(&ring, &st->table, m->entries[k].tensor, k);
    for (uint64_t k = 0; k < m->count && !rc; k++) {
        const index_entry *x = &m->entries[k];
        uint32_t h = ring.h[k % PREFETCH_AHEAD];
        if (k + PREFETCH_AHEAD < m->count)
            ring_push(&ring, &st->table, m->entries[k + PREFETCH_AHEAD].tensor, k + PREFETCH_AHEAD);
        int64_t i = ntab_find_h(&st->table, x->tensor, h);
        if (i < 0)
            rc = k3_err_set(e, K3_ENOENT, "%s: byte %" PRIu64 ": tensor \"%.200s\" is listed for %s but missing from it",
                            index_path, x->pos, x->tensor, m->shard_names[x->shard]);
        else if (seen[i])
            rc = k3_err_set(e, K3_EFORMAT, "%s: byte %" PRIu64 ": tensor \"%.200s\": listed twice in weight_map",
                            index_path, x->pos, x->tensor);
        else if (st->tensors[i].shard != x->shard)
            rc = k3_err_set(e, K3_EFORMAT, "%s: byte %" PRIu64 ": tensor \"%.200s\": the index puts it in %s, it is in %s",
                            index_path, x->pos, x->tensor, m->shard_names[x->shard],
                            st->shards[st->tensors[i].shard].name);
        else
            seen[i] = 1, matched++;
    }
    for (uint64_t i = 0; !rc && matched < st->count && i < st->count; i++)
        if (!seen[i])
            rc = k3_err_set(e, K3_EFORMAT, "%s: byte %" PRIu64 ": tensor \"%.200s\" is in the shard but not in %s",
                            st->shards[st->tensors[i].shard].path, st->tensors[i].offset, st->tensors[i].name,
                            INDEX_NAME);
    free(seen);
    return rc;
}

int k3_st_open(k3_st **out, const char *dir, unsigned flags, k3_err *e)
{
    return k3_st_open_headers(out, dir, NULL, flags, e);
}

int k3_st_open_headers(k3_st **out, const char *dir, const char *hdr_dir, unsigned flags, k3_err *e)
{
    *out = NULL;
    struct stat sb;
    if (stat(dir, &sb) != 0)
        return k3_err_sys(e, errno == ENOENT ? K3_ENOENT : K3_EIO, errno, "%s: cannot open", dir);
    k3_st *st = calloc(1, sizeof *st);
    if (!st)
        return k3_err_set(e, K3_ENOMEM, "%s: out of memory", dir);
    int rc = 0, have_index = 0, index_rc = 0;
    index_map m = {0};
    k3_err index_err = {0};
    char **files = NULL;
    uint32_t nfiles = 0;
    shard_load *loads = NULL;
    char index_path[4096] = "";

    /* the shards: the file itself, or the directory's *.safetensors in name
     * order (with an index, these must be exactly the files it names) */
    if (!S_ISDIR(sb.st_mode)) {
        nfiles = 1;
        if (!(files = malloc(sizeof *files)) || !(files[0] = strdup(dir))) {
            nfiles = 0;
            rc = k3_err_set(e, K3_ENOMEM, "%s: out of memory", dir);
            goto out;
        }
    } else {
        if ((rc = list_shards(dir, &files, &nfiles, e)))
            goto out;
        if ((rc = k3_io_path_join(index_path, sizeof index_path, dir, INDEX_NAME, e)))
            goto out;
        have_index = access(index_path, F_OK) == 0;
        if (!have_index && nfiles == 0) {
            rc = k3_err_set(e, K3_ENOENT, "%s: no *.safetensors files and no %s", dir, INDEX_NAME);
            goto out;
        }
    }
    char **standins = NULL;
    if (hdr_dir) {
        /* the shard list is the index's: the shards here are read, the
         * others stood in for by their headers (k3_st.h) */
        if (!have_index) {
            rc = k3_err_set(e, K3_ENOENT, "%s: no %s: shards that are not here can only be named by the index", dir,
                            INDEX_NAME);
            goto out;
        }
        if ((rc = index_load(&m, index_path, e)))
            goto out;
        for (uint32_t i = 0; i < nfiles; i++) {
            const char *key = files[i];
            if (!bsearch(&key, m.shard_names, m.nshards, sizeof *m.shard_names, cmp_str)) {
                rc = k3_err_set(e, K3_EFORMAT, "%s/%s: shard file is not referenced by %s", dir, files[i], INDEX_NAME);
                goto out;
            }
        }
        char **all = calloc(m.nshards ? m.nshards : 1, sizeof *all);
        standins = calloc(m.nshards ? m.nshards : 1, sizeof *standins);
        for (uint32_t i = 0; all && standins && i < m.nshards; i++) {
            const char *key = m.shard_names[i];
            char hp[4096];
            if (!(all[i] = strdup(key)))
                break;
            if (bsearch(&key, files, nfiles, sizeof *files, cmp_str))
                continue;
            if (snprintf(hp, sizeof hp, "%s/%s%s", hdr_dir, key, K3_ST_STANDIN_SUFFIX) >= (int)sizeof hp ||
                !(standins[i] = strdup(hp)))
                break;
            if (access(hp, F_OK) != 0) {
                rc = k3_err_set(e, K3_ENOENT, "%s/%s: shard named by %s is neither here nor stood in for by %s", dir,
                                key, INDEX_NAME, hp);
                break;
            }
        }
        uint32_t nall = m.nshards;
        free_names(files, nfiles);
        files = all;
        nfiles = all ? nall : 0;
        if (!rc && (!all || !standins || (nall && !all[nall - 1])))
            rc = k3_err_set(e, K3_ENOMEM, "%s: out of memory", dir);
        if (rc) {
            free_names(standins, nall);
            goto out;
        }
    }
    st->shards = calloc(nfiles ? nfiles : 1, sizeof *st->shards);
    loads = calloc(nfiles ? nfiles : 1, sizeof *loads);
    if (!st->shards || !loads) {
        rc = k3_err_set(e, K3_ENOMEM, "%s: out of memory", dir);
        goto out;
    }
    for (uint32_t i = 0; i < nfiles; i++) {
        shard *s = &st->shards[i];
        s->fd = -1;
        st->nshards++;
        char path[4096];
        if (S_ISDIR(sb.st_mode) && (rc = k3_io_path_join(path, sizeof path, dir, files[i], e)))
            goto out;
        if (!(s->path = strdup(S_ISDIR(sb.st_mode) ? path : dir))) {
            rc = k3_err_set(e, K3_ENOMEM, "%s: out of memory", dir);
            goto out;
        }
        const char *slash = strrchr(s->path, '/');
        s->name = slash ? slash + 1 : s->path;
        if (standins) {
            s->standin = standins[i];
            standins[i] = NULL;
        }
    }
    if (standins)
        free_names(standins, nfiles);

    /* the index and every header are parsed in parallel (headers are most
     * of the work: 76 MB of JSON for K3); results are used in a fixed order */
    {
        open_job job = {.st = st, .loads = loads, .flags = flags, .nfiles = nfiles, .have_index = have_index,
                        .m = &m, .index_path = index_path, .index_err = &index_err, .index_rc = &index_rc};
        job.have_index = have_index && !hdr_dir;
        run_open_jobs(&job);
    }

    if (have_index) {
        if (index_rc) {
            *e = index_err;
            rc = index_rc;
            goto out;
        }
        /* the index names exactly the shard files present */
        for (uint32_t i = 0; i < m.nshards; i++) {
            const char *key = m.shard_names[i];
            if (!bsearch(&key, files, nfiles, sizeof *files, cmp_str)) {
                rc = k3_err_set(e, K3_ENOENT, "%s/%s: shard named by %s is missing", dir, key, INDEX_NAME);
                goto out;
            }
        }
        for (uint32_t i = 0; i < nfiles; i++) {
            const char *key = files[i];
            if (!bsearch(&key, m.shard_names, m.nshards, sizeof *m.shard_names, cmp_str)) {
                rc = k3_err_set(e, K3_EFORMAT, "%s/%s: shard file is not referenced by %s", dir, files[i], INDEX_NAME);
                goto out;
            }
        }
        /* same sorted sets: shard numbers agree between index and files */
    }
    if ((rc = merge_shards(st, loads, e)))
        goto out;

    /* one table for the whole checkpoint */
    if (ntab_init(&st->table, st->count)) {
        rc = k3_err_set(e, K3_ENOMEM, "%s: out of memory for the tensor table", dir);
        goto out;
    }
    hash_ring ring;
    for (uint64_t i = 0; i < st->count && i < PREFETCH_AHEAD; i++)
        ring_push(&ring, &st->table, st->tensors[i].name, i);
    for (uint64_t i = 0; i < st->count; i++) {
        uint32_t h = ring.h[i % PREFETCH_AHEAD];
        if (i + PREFETCH_AHEAD < st->count)
            ring_push(&ring, &st->table, st->tensors[i + PREFETCH_AHEAD].name, i + PREFETCH_AHEAD);
        int64_t prev = ntab_insert_h(&st->table, st->tensors[i].name, h, (uint32_t)i);
        if (prev >= 0) {
            const k3_st_tensor *t = &st->tensors[i], *p = &st->tensors[prev];
            rc = k3_err_set(e, K3_EFORMAT, "%s: byte %" PRIu64 ": tensor \"%.200s\" is also in %s (byte %" PRIu64 ")",
                            st->shards[t->shard].path, t->offset, t->name, st->shards[p->shard].name, p->offset);
            goto out;
        }
    }
    if (have_index && (rc = check_against_index(st, &m, index_path, e)))
        goto out;
out:
    if (loads)
        for (uint32_t i = 0; i < nfiles; i++)
            k3_st_header_free(&loads[i].h);
    free(loads);
    index_free(&m);
    free_names(files, nfiles);
    if (rc) {
        k3_st_close(st);
        return rc;
    }
    *out = st;
    return 0;
}

uint64_t k3_st_tensor_count(const k3_st *st)
{
    return st->count;
}

const k3_st_tensor *k3_st_tensor_at(const k3_st *st, uint64_t i)
{
    return i < st->count ? &st->tensors[i] : NULL;
}

const k3_st_tensor *k3_st_find(const k3_st *st, const char *name)
{
    int64_t i = ntab_find(&st->table, name);
    return i < 0 ? NULL : &st->tensors[i];
}

uint32_t k3_st_shard_count(const k3_st *st)
{
    return st->nshards;
}

const char *k3_st_shard_path(const k3_st *st, uint32_t i)
{
    return i < st->nshards ? st->shards[i].path : NULL;
}

const char *k3_st_shard_name(const k3_st *st, uint32_t i)
{
    return i < st->nshards ? st->shards[i].name : NULL;
}

uint64_t k3_st_shard_size(const k3_st *st, uint32_t i)
{
    return i < st->nshards ? st->shards[i].size : 0;
}

int k3_st_shard_fd(const k3_st *st, uint32_t i)
{
    return i < st->nshards ? st->shards[i].fd : -1;
}

int k3_st_shard_present(const k3_st *st, uint32_t i)
{
    return i < st->nshards && !st->shards[i].standin;
}

int k3_st_standin_bytes(const k3_st *st, uint32_t i, uint8_t **buf, uint64_t *len, k3_err *e)
{
    *buf = NULL;
    *len = 0;
    if (i >= st->nshards)
        return k3_err_set(e, K3_EARG, "k3_st_standin_bytes: no shard %u", i);
    const shard *s = &st->shards[i];
    if (s->standin) {
        char *b;
        int rc = k3_io_read_file(s->standin, 24 + (uint64_t)K3_ST_MAX_HEADER, &b, len, e);
        *buf = (uint8_t *)b;
        return rc;
    }
    uint8_t *b = malloc((size_t)s->data_start + 24);
    if (!b)
        return k3_err_set(e, K3_ENOMEM, "%s: out of memory", s->path);
    memcpy(b, K3_ST_STANDIN_MAGIC, 8);
    for (int k = 0; k < 8; k++) {
        b[8 + k] = (uint8_t)(s->size >> (8 * k));
        b[16 + k] = (uint8_t)((s->data_start - 8) >> (8 * k));
    }
    /* a plain read: the header is small and need not be aligned */
    int fd = k3_io_open_read(s->path, 0, NULL, e);
    int rc = fd < 0 ? fd : k3_io_pread(fd, b + 24, s->data_start, 0, s->path, e);
    if (fd >= 0)
        close(fd);
    if (rc) {
        free(b);
        return rc;
    }
    *buf = b;
    *len = s->data_start + 24;
    return 0;
}

int k3_st_shard_is_direct(const k3_st *st, uint32_t i)
{
    return i < st->nshards ? st->shards[i].direct : 0;
}

uint64_t k3_st_shard_data_start(const k3_st *st, uint32_t i)
{
    return i < st->nshards ? st->shards[i].data_start : 0;
}

int k3_st_read_range_bounce(const k3_st *st, const k3_st_tensor *t, uint64_t off, uint64_t n, void *dst,
                            void *bounce, uint64_t bounce_cap, k3_err *e)
{
    if (!t || t->shard >= st->nshards)
        return k3_err_set(e, K3_EARG, "k3_st_read: tensor does not belong to this checkpoint");
    const shard *s = &st->shards[t->shard];
    if (s->standin)
        return k3_err_set(e, K3_ENOENT, "%s: tensor \"%.200s\": the shard is not here (only its header, %s)", s->path,
                          t->name, s->standin);
    if (off > t->nbytes || n > t->nbytes - off)
        return k3_err_set(e, K3_EARG, "%s: tensor \"%.200s\": range [%" PRIu64 ", +%" PRIu64 ") is outside its %" PRIu64
                          " bytes", s->path, t->name, off, n, t->nbytes);
    if (n == 0)
        return 0;
    uint64_t at = t->offset + off;
    if (!s->direct)
        return k3_io_pread(s->fd, dst, n, at, s->path, e);
    const uint64_t A = K3_IO_DIRECT_ALIGN;
    if ((uintptr_t)dst % A == 0 && at % A == 0 && n % A == 0)
        return k3_io_pread_direct(s->fd, dst, n, at, NULL, 0, s->path, e);
    /* unaligned: aligned pieces through a bounce buffer, the caller's or
     * one sized for this read (at most DIRECT_CHUNK + 2 blocks) */
    void *own = NULL;
    if (bounce) {
        if ((uintptr_t)bounce % A || bounce_cap < 3 * A)
            return k3_err_set(e, K3_EARG, "%s: bounce buffer must be %" PRIu64 "-aligned and hold 3 blocks", s->path, A);
    } else {
        bounce_cap = (n < DIRECT_CHUNK ? (n + A - 1) / A * A : DIRECT_CHUNK) + 2 * A;
        bounce = own = k3_io_alloc_aligned(bounce_cap, A);
        if (!bounce)
            return k3_err_set(e, K3_ENOMEM, "%s: out of memory for a read buffer", s->path);
    }
    /* a piece of `chunk` bytes at any offset widens to at most chunk + 2 blocks */
    uint64_t chunk = (bounce_cap - 2 * A) / A * A;
    int rc = 0;
    for (uint64_t done = 0; !rc && done < n;) {
        uint64_t k = n - done < chunk ? n - done : chunk;
        rc = k3_io_pread_direct(s->fd, (char *)dst + done, k, at + done, bounce, bounce_cap, s->path, e);
        done += k;
    }
    k3_io_free_aligned(own);
    return rc;
}

int k3_st_read_range(const k3_st *st, const k3_st_tensor *t, uint64_t off, uint64_t n, void *dst, k3_err *e)
{
    return k3_st_read_range_bounce(st, t, off, n, dst, NULL, 0, e);
}

int k3_st_read(const k3_st *st, const k3_st_tensor *t, void *dst, k3_err *e)
{
    return k3_st_read_range(st, t, 0, t ? t->nbytes : 0, dst, e);
}
