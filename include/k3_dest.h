/*
 * k3_dest.h - the destination directory of a writing tool (k3-convert,
 * k3-pack, k3-synth): checked, owned and locked (common/dest.c).
 *
 * Rules, the same for every tool:
 *   - SRC == DST, DST inside SRC and SRC inside DST are refused (K3_EARG,
 *     exit 2: no option makes them right), compared by device and inode
 *     along the real paths (symbolic links and ".." do not hide them); so is
 *     SRC being one of the directories the tool makes next to DST (its
 *     temporary, its old copy).
 *   - DST must be absent, an empty directory, or a directory the tool
 *     recognises as its own kind of output: every entry is a file name that
 *     kind of output has (or a temporary or journal of it), and it carries
 *     that kind's signature (a packed model: manifest.json with "format":
 *     "k3-packed", or a k3-convert / k3-pack journal (a k3-convert --part
 *     output is one: its journal, part.json, .k3-convert-part/); a k3-synth checkpoint:
 *     config.json and shards whose header metadata says "writer": "k3-synth").
 *     Anything else - a regular file, a symbolic link, a directory holding
 *     one file the tool did not write - is refused with K3_EEXIST (exit 7),
 *     with or without --force, and nothing in it is touched.
 *   - k3_dest_clear removes only entries that pass the same check (it checks
 *     again first), so --force never deletes a file the tool did not write.
 *   - DST is locked for the whole run: "DST.k3-lock" next to DST (created and
 *     removed by the tool, holding its process id) is flock()ed exclusively;
 *     a second run on the same DST (by any path) fails at once with
 *     "DST is in use by process N" (K3_EEXIST, exit 7). A kill leaves the
 *     lock file, unlocked: the next run takes it over.
 *
 * Usage: k3_dest_open (check + lock), the tool's own decisions on
 * d->state with --force / --resume, k3_dest_check_dir on its temporaries,
 * k3_dest_clear to replace, k3_dest_close (always; accepts a zeroed one).
 */
#ifndef K3_DEST_H
#define K3_DEST_H

#include <stddef.h>

#include "k3_err.h"

typedef enum k3_dest_kind {
    K3_DEST_PACKED,       /* a packed model (k3-convert, k3-pack) */
    K3_DEST_CHECKPOINT,   /* an upstream-format checkpoint (k3-synth) */
} k3_dest_kind;

typedef struct k3_dest_tool {
    const char *name;               /* "k3-pack": for messages */
    k3_dest_kind kind;
    const char *const *siblings;    /* suffixes of directories made next to DST
                                       (".k3-pack-tmp", ...), NULL-terminated; may be NULL */
} k3_dest_tool;

typedef enum k3_dest_state {
    K3_DEST_ABSENT,   /* nothing at DST */
    K3_DEST_EMPTY,    /* an empty directory */
    K3_DEST_OURS,     /* a directory of the tool's kind of output */
} k3_dest_state;

#define K3_DEST_PATH_MAX 4096

typedef struct k3_dest {
    const k3_dest_tool *tool;
    char path[K3_DEST_PATH_MAX];        /* DST's real path: use it for every file operation */
    char lock_path[K3_DEST_PATH_MAX + 16];
    k3_dest_state state;
    int lock_fd;                        /* -1 when not held */
} k3_dest;

#define K3_DEST_LOCK_SUFFIX ".k3-lock"

/* Check DST against SRC (src may be NULL: k3-synth has none) and the rules
 * above, then lock it. On success d->path is DST's real path and d->state
 * says what is there. On failure nothing was created and the lock is not
 * held (k3_dest_close is still safe). */
int k3_dest_open(k3_dest *d, const k3_dest_tool *t, const char *src, const char *dst, k3_err *e);

/* Release the lock and remove the lock file. Accepts NULL and a zeroed d. */
void k3_dest_close(k3_dest *d);

/* d->path with suffix appended (a sibling the tool makes). */
int k3_dest_sibling(const k3_dest *d, const char *suffix, char *out, size_t cap, k3_err *e);

/* Is dir (which must exist) empty or the tool's kind of output? temporary:
 * dir is a temporary or old copy the tool named itself (its file names are
 * enough, no signature needed). 0 if so, K3_EEXIST with a message naming
 * the first foreign entry if not. */
int k3_dest_check_dir(const k3_dest_tool *t, const char *dir, int temporary, k3_err *e);

/* Remove what dir holds (after k3_dest_check_dir with the same temporary
 * passes again), and dir itself if remove_dir. An absent dir is not an error. */
int k3_dest_clear(const k3_dest_tool *t, const char *dir, int temporary, int remove_dir, k3_err *e);

#endif
