/*
 * dest.c - a writing tool's destination: checked against the source, owned,
 * locked (k3_dest.h has the rules).
 *
 * Invariants: a check that refuses leaves the file system as it was; an
 * entry is removed only after the whole directory passed the ownership
 * check; the lock is taken on a lock file whose inode is the one at its path
 * (a lock file removed and created again between open and flock is retried).
 */
#include "k3_dest.h"

#include <cjson/cJSON.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include "k3_io.h"

#define SYNTH_WRITER "k3-synth"

/* ------------------------------------------------------------ names */

static int ends_with(const char *s, const char *suf)
{
    size_t n = strlen(s), m = strlen(suf);
    return n >= m && !strcmp(s + n - m, suf);
}

static int starts_with(const char *s, const char *pre)
{
    return !strncmp(s, pre, strlen(pre));
}

/* A file name the kind of output has (without ".tmp"). */
static int known_name(k3_dest_kind kind, const char *n)
{
    if (kind == K3_DEST_PACKED) {
        static const char *fixed[] = {"manifest.json", "experts.idx", "embed.crc", "tiktoken.model",
                                      "tokenizer_config.json", "part.json"};
        for (size_t i = 0; i < sizeof fixed / sizeof *fixed; i++)
            if (!strcmp(n, fixed[i]))
                return 1;
        return (starts_with(n, "trunk") && ends_with(n, ".k3t")) || (starts_with(n, "experts") && ends_with(n, ".k3e"));
    }
    static const char *fixed[] = {"config.json", "model.safetensors.index.json", "tiktoken.model",
                                  "tokenizer_config.json"};
    for (size_t i = 0; i < sizeof fixed / sizeof *fixed; i++)
        if (!strcmp(n, fixed[i]))
            return 1;
    return ends_with(n, ".safetensors") && strlen(n) > strlen(".safetensors");
}

static int known_file(k3_dest_kind kind, const char *n)
{
    if (n[0] == '.')
        return 0;
    if (known_name(kind, n))
        return 1;
    size_t l = strlen(n);
    if (l > 4 && ends_with(n, ".tmp") && l < 512) {
        char base[512];
        memcpy(base, n, l - 4);
        base[l - 4] = 0;
        return known_name(kind, base);
    }
    return 0;
}

static int journal_name(k3_dest_kind kind, const char *n)
{
    return kind == K3_DEST_PACKED && (!strcmp(n, ".k3-convert-journal") || !strcmp(n, ".k3-pack-journal") ||
                                      !strcmp(n, ".k3-convert-part"));
}

/* ------------------------------------------------------------ signatures */

/* manifest.json in dir says "format": "k3-packed" */
static int packed_manifest(const char *dir)
{
    char path[PATH_MAX], *txt = NULL;
    uint64_t len;
    k3_err ignore = {0};
    if (k3_io_path_join(path, sizeof path, dir, "manifest.json", &ignore) ||
        k3_io_read_file(path, 1ull << 30, &txt, &len, &ignore))
        return 0;
    cJSON *root = cJSON_ParseWithLength(txt, (size_t)len);
    free(txt);
    const cJSON *f = cJSON_GetObjectItemCaseSensitive(root, "format");
    int ok = cJSON_IsString(f) && !strcmp(f->valuestring, "k3-packed");
    cJSON_Delete(root);
    return ok;
}

/* The safetensors file at path has "writer": "k3-synth" in its header's
 * __metadata__. */
static int synth_shard(const char *path)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0)
        return 0;
    uint8_t lenb[8];
    int ok = 0;
    char *hdr = NULL;
    k3_err ignore = {0};
    if (k3_io_pread(fd, lenb, 8, 0, path, &ignore) == 0) {
        uint64_t n = 0;
        for (int i = 0; i < 8; i++)
            n |= (uint64_t)lenb[i] << (8 * i);
        if (n > 0 && n <= (100u << 20) && (hdr = malloc((size_t)n)) && k3_io_pread(fd, hdr, n, 8, path, &ignore) == 0) {
            cJSON *root = cJSON_ParseWithLength(hdr, (size_t)n);
            const cJSON *m = cJSON_GetObjectItemCaseSensitive(root, "__metadata__");
            const cJSON *w = cJSON_GetObjectItemCaseSensitive(m, "writer");
            ok = cJSON_IsString(w) && !strcmp(w->valuestring, SYNTH_WRITER);
            cJSON_Delete(root);
        }
    }
    free(hdr);
    close(fd);
    return ok;
}

/* ------------------------------------------------------------ ownership */

/* A journal directory holds regular files only. */
static int journal_dir_ok(const char *path)
{
    DIR *d = opendir(path);
    if (!d)
        return 0;
    struct dirent *de;
    int ok = 1;
    char p[PATH_MAX];
    while (ok && (de = readdir(d))) {
        if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, ".."))
            continue;
        struct stat st;
        ok = snprintf(p, sizeof p, "%s/%s", path, de->d_name) < (int)sizeof p && lstat(p, &st) == 0 &&
             S_ISREG(st.st_mode);
    }
    closedir(d);
    return ok;
}

int k3_dest_check_dir(const k3_dest_tool *t, const char *dir, int temporary, k3_err *e)
{
    DIR *d = opendir(dir);
    if (!d)
        return k3_err_sys(e, K3_EIO, errno, "%s: cannot open directory", dir);
    const char *what = t->kind == K3_DEST_PACKED ? "a packed model" : "a k3-synth checkpoint";
    struct dirent *de;
    int rc = 0, entries = 0, journal = 0, config = 0, shards = 0;
    char path[PATH_MAX];
    while (!rc && (de = readdir(d))) {
        const char *n = de->d_name;
        if (!strcmp(n, ".") || !strcmp(n, ".."))
            continue;
        entries++;
        struct stat st;
        if (k3_io_path_join(path, sizeof path, dir, n, e)) {
            rc = k3_err_set(e, K3_EEXIST, "%s: holds %s, which %s did not write; not touching it", dir, n, t->name);
            break;
        }
        if (lstat(path, &st) != 0) {
            rc = k3_err_sys(e, K3_EIO, errno, "%s: cannot stat", path);
            break;
        }
        if (S_ISDIR(st.st_mode) && journal_name(t->kind, n) && journal_dir_ok(path)) {
            journal = 1;
            continue;
        }
        if (!S_ISREG(st.st_mode) || !known_file(t->kind, n)) {
            rc = k3_err_set(e, K3_EEXIST, "%s: holds %s, which is not part of %s (%s did not write it); not touching it",
                            dir, n, what, t->name);
            break;
        }
        if (t->kind == K3_DEST_CHECKPOINT) {
            config |= !strcmp(n, "config.json");
            if (ends_with(n, ".safetensors")) {
                shards++;
                if (!temporary && !synth_shard(path))
                    rc = k3_err_set(e, K3_EEXIST, "%s: %s was not written by k3-synth; not touching the directory",
                                    dir, n);
            }
        }
    }
    closedir(d);
    if (rc || !entries || temporary)
        return rc;
    if (t->kind == K3_DEST_PACKED && !journal && !packed_manifest(dir))
        return k3_err_set(e, K3_EEXIST,
                          "%s: is not a packed model (no manifest.json of format k3-packed, no k3 journal); not "
                          "touching it",
                          dir);
    if (t->kind == K3_DEST_CHECKPOINT && (!config || !shards))
        return k3_err_set(e, K3_EEXIST, "%s: is not a k3-synth checkpoint (no config.json or no shard); not touching it",
                          dir);
    return 0;
}

static int remove_journal_dir(const char *path, k3_err *e)
{
    DIR *d = opendir(path);
    if (!d)
        return k3_err_sys(e, K3_EIO, errno, "%s: cannot open", path);
    struct dirent *de;
    int rc = 0;
    char p[PATH_MAX];
    while (!rc && (de = readdir(d))) {
        if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, ".."))
            continue;
        if ((rc = k3_io_path_join(p, sizeof p, path, de->d_name, e)) == 0 && unlink(p) != 0)
            rc = k3_err_sys(e, K3_EIO, errno, "%s: cannot remove", p);
    }
    closedir(d);
    if (!rc && rmdir(path) != 0)
        rc = k3_err_sys(e, K3_EIO, errno, "%s: cannot remove", path);
    return rc;
}

int k3_dest_clear(const k3_dest_tool *t, const char *dir, int temporary, int remove_dir, k3_err *e)
{
    struct stat st;
    if (lstat(dir, &st) != 0)
        return errno == ENOENT ? 0 : k3_err_sys(e, K3_EIO, errno, "%s: cannot stat", dir);
    if (!S_ISDIR(st.st_mode))
        return k3_err_set(e, K3_EEXIST, "%s: exists and is not a directory; not touching it", dir);
    int rc = k3_dest_check_dir(t, dir, temporary, e);
    if (rc)
        return rc;
    char path[PATH_MAX];
    /* the file that makes the directory look complete goes first */
    const char *first = t->kind == K3_DEST_PACKED ? "manifest.json" : "config.json";
    if ((rc = k3_io_path_join(path, sizeof path, dir, first, e)))
        return rc;
    if (unlink(path) != 0 && errno != ENOENT)
        return k3_err_sys(e, K3_EIO, errno, "%s: cannot remove", path);
    /* so does a k3-convert --part's completion mark */
    if (t->kind == K3_DEST_PACKED) {
        if ((rc = k3_io_path_join(path, sizeof path, dir, "part.json", e)))
            return rc;
        if (unlink(path) != 0 && errno != ENOENT)
            return k3_err_sys(e, K3_EIO, errno, "%s: cannot remove", path);
    }
    DIR *d = opendir(dir);
    if (!d)
        return k3_err_sys(e, K3_EIO, errno, "%s: cannot open directory", dir);
    struct dirent *de;
    while (!rc && (de = readdir(d))) {
        const char *n = de->d_name;
        if (!strcmp(n, ".") || !strcmp(n, ".."))
            continue;
        if ((rc = k3_io_path_join(path, sizeof path, dir, n, e)))
            break;
        if (journal_name(t->kind, n))
            rc = remove_journal_dir(path, e);
        else if (known_file(t->kind, n) && unlink(path) != 0)
            rc = k3_err_sys(e, K3_EIO, errno, "%s: cannot remove", path);
    }
    closedir(d);
    if (rc)
        return rc;
    if (remove_dir)
        return rmdir(dir) == 0 ? 0 : k3_err_sys(e, K3_EIO, errno, "%s: cannot remove", dir);
    return k3_io_fsync_dir(dir, e);
}

/* ------------------------------------------------------------ paths */

/* The real path of p, which need not exist (its parent must). */
static int real_path_of(const char *p, char *out, size_t cap, k3_err *e)
{
    char buf[PATH_MAX];
    if (!*p)
        return k3_err_set(e, K3_EARG, "DST is an empty path");
    if (snprintf(buf, sizeof buf, "%s", p) >= (int)sizeof buf)
        return k3_err_set(e, K3_ELIMIT, "%.200s...: path too long", p);
    size_t n = strlen(buf);
    while (n > 1 && buf[n - 1] == '/')
        buf[--n] = 0;
    struct stat st;
    if (lstat(buf, &st) == 0) {
        char *r = realpath(buf, NULL);
        if (!r) {
            /* a dangling symbolic link: refused as a link by the caller */
            if (S_ISLNK(st.st_mode) && snprintf(out, cap, "%s", buf) < (int)cap)
                return 0;
            return k3_err_sys(e, K3_EIO, errno, "%s: cannot resolve", p);
        }
        int ok = snprintf(out, cap, "%s", r) < (int)cap;
        free(r);
        return ok ? 0 : k3_err_set(e, K3_ELIMIT, "%s: path too long", p);
    }
    if (errno == ENAMETOOLONG)
        return k3_err_set(e, K3_ELIMIT, "%.200s...: path too long", p);
    if (errno != ENOENT)
        return k3_err_sys(e, K3_EIO, errno, "%s: cannot stat", p);
    char *slash = strrchr(buf, '/');
    const char *base = slash ? slash + 1 : buf;
    char parent[PATH_MAX];
    if (!slash)
        snprintf(parent, sizeof parent, ".");
    else if (slash == buf)
        snprintf(parent, sizeof parent, "/");
    else
        snprintf(parent, sizeof parent, "%.*s", (int)(slash - buf), buf);
    char *r = realpath(parent, NULL);
    if (!r)
        return k3_err_sys(e, K3_EIO, errno, "%s: the directory to hold it, %s, cannot be used", p, parent);
    int ok = snprintf(out, cap, "%s%s%s", r, strcmp(r, "/") ? "/" : "", base) < (int)cap;
    free(r);
    return ok ? 0 : k3_err_set(e, K3_ELIMIT, "%s: path too long", p);
}

/* Is the object (dev, ino) on the real path a: a itself or one of the
 * directories above it? */
static int on_path(const char *a, dev_t dev, ino_t ino)
{
    char buf[PATH_MAX];
    snprintf(buf, sizeof buf, "%s", a);
    for (;;) {
        struct stat st;
        if (stat(buf, &st) == 0 && st.st_dev == dev && st.st_ino == ino)
            return 1;
        char *s = strrchr(buf, '/');
        if (!s || (s == buf && !buf[1]))
            return 0;
        if (s == buf)
            buf[1] = 0;
        else
            *s = 0;
    }
}

static int check_apart(const k3_dest_tool *t, const char *src, const char *dst, const char *rdst, k3_err *e)
{
    struct stat ss, ds;
    char *rsrc = realpath(src, NULL);
    if (!rsrc || stat(rsrc, &ss) != 0) {
        free(rsrc);
        return 0;   /* the tool reports its missing input itself */
    }
    int rc = 0;
    if (on_path(rdst, ss.st_dev, ss.st_ino))
        rc = k3_err_set(e, K3_EARG, "%s: DST %s the source %s; %s writes only outside its source", dst,
                        stat(rdst, &ds) == 0 && ds.st_ino == ss.st_ino && ds.st_dev == ss.st_dev ? "is"
                                                                                                 : "is inside",
                        src, t->name);
    else if (stat(rdst, &ds) == 0 && on_path(rsrc, ds.st_dev, ds.st_ino))
        rc = k3_err_set(e, K3_EARG, "%s: DST holds the source %s; %s never writes over its source", dst, src, t->name);
    for (const char *const *s = t->siblings; !rc && s && *s; s++) {
        char sib[PATH_MAX];
        struct stat xs;
        if (snprintf(sib, sizeof sib, "%s%s", rdst, *s) < (int)sizeof sib && stat(sib, &xs) == 0 &&
            on_path(rsrc, xs.st_dev, xs.st_ino))
            rc = k3_err_set(e, K3_EARG, "%s: the source %s is %s's working directory %s; not touching it", dst, src,
                            t->name, sib);
    }
    free(rsrc);
    return rc;
}

/* What is at rdst: sets *state, or refuses. */
static int inspect(const k3_dest_tool *t, const char *dst, const char *rdst, k3_dest_state *state, k3_err *e)
{
    struct stat st;
    if (lstat(rdst, &st) != 0) {
        if (errno != ENOENT)
            return k3_err_sys(e, K3_EIO, errno, "%s: cannot stat", dst);
        *state = K3_DEST_ABSENT;
        return 0;
    }
    if (S_ISLNK(st.st_mode))
        return k3_err_set(e, K3_EEXIST, "%s: DST is a symbolic link; %s does not write through it (name the "
                          "directory itself)", dst, t->name);
    if (!S_ISDIR(st.st_mode))
        return k3_err_set(e, K3_EEXIST, "%s: DST exists and is not a directory; %s never replaces it", dst, t->name);
    DIR *d = opendir(rdst);
    if (!d)
        return k3_err_sys(e, K3_EIO, errno, "%s: cannot open directory", dst);
    struct dirent *de;
    int empty = 1;
    while (empty && (de = readdir(d)))
        empty = !strcmp(de->d_name, ".") || !strcmp(de->d_name, "..");
    closedir(d);
    if (empty) {
        *state = K3_DEST_EMPTY;
        return 0;
    }
    int rc = k3_dest_check_dir(t, rdst, 0, e);
    if (rc)
        return rc;
    *state = K3_DEST_OURS;
    return 0;
}

/* ------------------------------------------------------------ lock */

static int lock(k3_dest *d, const char *dst, k3_err *e)
{
    for (int tries = 0; tries < 100; tries++) {
        int fd = open(d->lock_path, O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644);
        if (fd < 0)
            return k3_err_sys(e, K3_EIO, errno, "%s: cannot create the lock file", d->lock_path);
        if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
            int err = errno;
            char buf[32] = {0};
            ssize_t n = err == EWOULDBLOCK ? pread(fd, buf, sizeof buf - 1, 0) : -1;
            close(fd);
            if (err != EWOULDBLOCK)
                return k3_err_sys(e, K3_EIO, err, "%s: cannot lock", d->lock_path);
            char *end;
            long pid = n > 0 ? strtol(buf, &end, 10) : 0;
            if (pid > 0)
                return k3_err_set(e, K3_EEXIST, "%s is in use by process %ld (another %s run holds %s)", dst, pid,
                                  d->tool->name, d->lock_path);
            return k3_err_set(e, K3_EEXIST, "%s is in use by another process (it holds %s)", dst, d->lock_path);
        }
        /* the file at the path must still be the one locked: a holder
         * removes it at its end, after which a new one may be made */
        struct stat a, b;
        if (fstat(fd, &a) != 0 || stat(d->lock_path, &b) != 0 || a.st_dev != b.st_dev || a.st_ino != b.st_ino) {
            close(fd);
            continue;
        }
        char buf[32];
        int n = snprintf(buf, sizeof buf, "%ld\n", (long)getpid());
        if (ftruncate(fd, 0) != 0 || pwrite(fd, buf, (size_t)n, 0) != n) {
            int err = errno;
            unlink(d->lock_path);
            close(fd);
            return k3_err_sys(e, K3_EIO, err, "%s: cannot write", d->lock_path);
        }
        d->lock_fd = fd;
        return 0;
    }
    return k3_err_set(e, K3_EEXIST, "%s: its lock file %s keeps changing", dst, d->lock_path);
}

void k3_dest_close(k3_dest *d)
{
    if (!d || !d->tool || d->lock_fd < 0)
        return;
    unlink(d->lock_path);   /* while still holding it: see lock() */
    close(d->lock_fd);
    d->lock_fd = -1;
}

/* ------------------------------------------------------------ open */

int k3_dest_open(k3_dest *d, const k3_dest_tool *t, const char *src, const char *dst, k3_err *e)
{
    memset(d, 0, sizeof *d);
    d->lock_fd = -1;
    d->tool = t;
    int rc = real_path_of(dst, d->path, sizeof d->path, e);
    if (rc)
        return rc;
    if (!strcmp(d->path, "/"))
        return k3_err_set(e, K3_EEXIST, "%s: is the root directory; not writing there", dst);
    if (src && (rc = check_apart(t, src, dst, d->path, e)))
        return rc;
    /* first without the lock (a refusal creates nothing), then again under it */
    if ((rc = inspect(t, dst, d->path, &d->state, e)))
        return rc;
    if (snprintf(d->lock_path, sizeof d->lock_path, "%s" K3_DEST_LOCK_SUFFIX, d->path) >= (int)sizeof d->lock_path)
        return k3_err_set(e, K3_ELIMIT, "%s: path too long", dst);
    if ((rc = lock(d, dst, e)))
        return rc;
    if ((rc = inspect(t, dst, d->path, &d->state, e)))
        k3_dest_close(d);
    return rc;
}

int k3_dest_sibling(const k3_dest *d, const char *suffix, char *out, size_t cap, k3_err *e)
{
    if (snprintf(out, cap, "%s%s", d->path, suffix) >= (int)cap)
        return k3_err_set(e, K3_ELIMIT, "%s: path too long", d->path);
    return 0;
}
