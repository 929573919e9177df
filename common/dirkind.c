/*
 * dirkind.c - what a model directory is (see k3_io.h, k3_io_dir_kind): the
 * one place that tells a packed model from an upstream checkpoint, an
 * unfinished packing, a file, a missing path and a directory the user may
 * not read, so that every tool says the same exact thing.
 */
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "k3_io.h"

/* 1 if dir/name exists; 0 if not; negative (permission, I/O) with e set. */
static int has(const char *dir, const char *name, k3_err *e)
{
    char p[4200];
    struct stat st;
    if (snprintf(p, sizeof p, "%s/%s", dir, name) >= (int)sizeof p)
        return k3_err_set(e, K3_ELIMIT, "%s: path too long", dir);
    if (stat(p, &st) == 0)
        return 1;
    if (errno == ENOENT || errno == ENOTDIR)
        return 0;
    if (errno == EACCES)
        return k3_err_set(e, K3_EIO, "%s: permission denied: cannot look at %s", dir, name);
    return k3_err_sys(e, K3_EIO, errno, "%s: cannot look at %s", dir, name);
}

int k3_io_dir_kind(const char *dir, k3_err *e)
{
    struct stat st;
    if (stat(dir, &st) != 0) {
        if (errno == ENOENT || errno == ENOTDIR)
            return k3_err_set(e, K3_ENOENT, "%s: no such directory", dir);
        if (errno == EACCES)
            return k3_err_set(e, K3_EIO, "%s: permission denied (a directory above it cannot be entered)", dir);
        return k3_err_sys(e, K3_EIO, errno, "%s: cannot open", dir);
    }
    if (!S_ISDIR(st.st_mode))
        return k3_err_set(e, K3_EARG, "%s: a file, not a model directory", dir);
    /* listing and opening files inside both need permission: say so now
     * rather than "no manifest.json" later */
    if (access(dir, R_OK | X_OK) != 0)
        return errno == EACCES
                   ? k3_err_set(e, K3_EIO, "%s: permission denied: the directory cannot be %s", dir,
                                access(dir, X_OK) != 0 ? "entered" : "listed")
                   : k3_err_sys(e, K3_EIO, errno, "%s: cannot read the directory", dir);
    int rc = has(dir, "manifest.json", e);
    if (rc)
        return rc < 0 ? rc : K3_DIR_PACKED;
    if ((rc = has(dir, "config.json", e)))
        return rc < 0 ? rc : K3_DIR_UPSTREAM;
    static const char *const partial[] = {".k3-convert-journal", ".k3-pack-journal", "experts.idx",
                                          "trunk-0000.k3t", "embed.crc", "manifest.json.tmp"};
    for (size_t i = 0; i < sizeof partial / sizeof partial[0]; i++)
        if ((rc = has(dir, partial[i], e)))
            return rc < 0 ? rc : K3_DIR_PACKED_PARTIAL;
    DIR *d = opendir(dir);
    if (!d)
        return k3_err_sys(e, K3_EIO, errno, "%s: cannot list the directory", dir);
    int shards = 0;
    struct dirent *de;
    while ((de = readdir(d))) {
        size_t l = strlen(de->d_name);
        shards |= l > 12 && !strcmp(de->d_name + l - 12, ".safetensors");
    }
    closedir(d);
    return shards ? K3_DIR_UPSTREAM : K3_DIR_UNKNOWN;
}

int k3_io_dir_expect(const char *dir, int want, const char *tool, k3_err *e)
{
    int k = k3_io_dir_kind(dir, e);
    if (k < 0)
        return k;
    if (k == want || (want == K3_DIR_UPSTREAM && k == K3_DIR_UPSTREAM))
        return k;
    if (k == K3_DIR_UNKNOWN)
        return k3_err_set(e, K3_ENOENT, "%s: not a model: no manifest.json (packed model) and no config.json "
                                       "(upstream checkpoint)", dir);
    if (want == K3_DIR_PACKED && k == K3_DIR_UPSTREAM)
        return k3_err_set(e, K3_EARG, "%s: an upstream checkpoint (config.json, no manifest.json): %s needs a "
                                     "packed model; make one with k3-convert %s DST", dir, tool, dir);
    if (want == K3_DIR_PACKED && k == K3_DIR_PACKED_PARTIAL)
        return k3_err_set(e, K3_ENOENT, "%s: an incomplete packed model (no manifest.json): an interrupted "
                                       "k3-convert or k3-pack; run it again with --resume", dir);
    if (want == K3_DIR_UPSTREAM && (k == K3_DIR_PACKED || k == K3_DIR_PACKED_PARTIAL))
        return k3_err_set(e, K3_EARG, "%s: a packed model (%s), not an upstream checkpoint: %s reads upstream "
                                     "checkpoints; to lay a packed model out again use k3-pack %s DST", dir,
                          k == K3_DIR_PACKED ? "manifest.json" : "packed files, no manifest.json yet", tool, dir);
    return k;
}
