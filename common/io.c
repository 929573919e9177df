/*
 * io.c - full read/write loops, aligned and huge-page memory, atomic publish,
 * and the K3_FAULT fault-injection hook (see k3_io.h).
 *
 * Invariant: no function here returns success having transferred fewer bytes
 * than asked. Every message names the path and the offset.
 */
#include "k3_io.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <libgen.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <sys/stat.h>
#include <unistd.h>

/* ---- fault injection ------------------------------------------------------ */

enum { FAULT_NONE, FAULT_EIO, FAULT_SHORT, FAULT_FLIP };

static struct {
    int loaded;
    int kind;
    char substr[256];
    uint64_t offset;
    long remaining; /* -1: unlimited */
    long skip;      /* matching reads still to leave alone */
} fault;

void k3_io_fault_reset(void)
{
    fault.loaded = 1;
    fault.kind = FAULT_NONE;
    const char *v = getenv("K3_FAULT");
    if (!v || !*v)
        return;
    char kind[16];
    char sub[256];
    unsigned long long off = 0;
    long count = -1, skip = 0;
    /* KIND:SUBSTR:OFFSET[:COUNT[:SKIP]]; SUBSTR may not contain ':' */
    const char *c1 = strchr(v, ':');
    if (!c1 || (size_t)(c1 - v) >= sizeof kind)
        return;
    memcpy(kind, v, (size_t)(c1 - v));
    kind[c1 - v] = '\0';
    const char *c2 = strchr(c1 + 1, ':');
    if (!c2 || (size_t)(c2 - c1 - 1) >= sizeof sub)
        return;
    memcpy(sub, c1 + 1, (size_t)(c2 - c1 - 1));
    sub[c2 - c1 - 1] = '\0';
    char *end;
    errno = 0;
    off = strtoull(c2 + 1, &end, 10);
    if (errno || end == c2 + 1)
        return;
    if (*end == ':') {
        count = strtol(end + 1, &end, 10);
        if (count < 0)
            return;
        if (*end == ':') {
            skip = strtol(end + 1, &end, 10);
            if (skip < 0)
                return;
        }
    }
    if (*end)
        return;
    if (!strcmp(kind, "eio"))
        fault.kind = FAULT_EIO;
    else if (!strcmp(kind, "short"))
        fault.kind = FAULT_SHORT;
    else if (!strcmp(kind, "flip"))
        fault.kind = FAULT_FLIP;
    else
        return;
    snprintf(fault.substr, sizeof fault.substr, "%s", sub);
    fault.offset = off;
    fault.remaining = count;
    fault.skip = skip;
}

/* Returns the fault to apply to a read of [off, off+n) of path, consuming one
 * use of it. */
static int fault_for(const char *path, uint64_t n, uint64_t off)
{
    if (!fault.loaded)
        k3_io_fault_reset();
    if (fault.kind == FAULT_NONE || !path || fault.remaining == 0)
        return FAULT_NONE;
    if (!strstr(path, fault.substr) || fault.offset < off || fault.offset >= off + n)
        return FAULT_NONE;
    if (fault.skip > 0) {
        fault.skip--;
        return FAULT_NONE;
    }
    if (fault.remaining > 0)
        fault.remaining--;
    return fault.kind;
}

/* ---- reads and writes ----------------------------------------------------- */

static int truncated(k3_err *e, int fd, const char *path, uint64_t n, uint64_t off, uint64_t got)
{
    struct stat st;
    if (fstat(fd, &st) == 0)
        return k3_err_set(e, K3_EIO,
                          "%s: truncated: wanted %" PRIu64 " bytes at offset %" PRIu64
                          ", file ends at byte %" PRIu64,
                          path, n, off, (uint64_t)st.st_size);
    return k3_err_set(e, K3_EIO, "%s: short read: %" PRIu64 " of %" PRIu64 " bytes at offset %" PRIu64,
                      path, got, n, off);
}

static int read_loop(int fd, void *buf, uint64_t n, uint64_t off, const char *path, k3_err *e)
{
    int f = fault_for(path, n, off);
    if (f == FAULT_EIO)
        return k3_err_sys(e, K3_EIO, EIO, "%s: read of %" PRIu64 " bytes at offset %" PRIu64, path, n, off);
    uint64_t want = f == FAULT_SHORT ? n - 1 : n;
    uint64_t done = 0;
    while (done < want) {
        size_t chunk = want - done > (1u << 30) ? (1u << 30) : (size_t)(want - done);
        ssize_t r = pread(fd, (char *)buf + done, chunk, (off_t)(off + done));
        if (r < 0) {
            if (errno == EINTR)
                continue;
            return k3_err_sys(e, K3_EIO, errno, "%s: read of %" PRIu64 " bytes at offset %" PRIu64,
                              path, n, off + done);
        }
        if (r == 0)
            return truncated(e, fd, path, n, off, done);
        done += (uint64_t)r;
    }
    if (f == FAULT_SHORT)
        return truncated(e, fd, path, n, off, done);
    if (f == FAULT_FLIP)
        ((unsigned char *)buf)[fault.offset - off] ^= 1;
    return 0;
}

int k3_io_pread(int fd, void *buf, uint64_t n, uint64_t off, const char *path, k3_err *e)
{
    if (off > INT64_MAX || n > INT64_MAX - off)
        return k3_err_set(e, K3_EARG, "%s: read range at offset %" PRIu64 " overflows", path, off);
    return read_loop(fd, buf, n, off, path, e);
}

int k3_io_pwrite(int fd, const void *buf, uint64_t n, uint64_t off, const char *path, k3_err *e)
{
    uint64_t done = 0;
    while (done < n) {
        size_t chunk = n - done > (1u << 30) ? (1u << 30) : (size_t)(n - done);
        ssize_t r = pwrite(fd, (const char *)buf + done, chunk, (off_t)(off + done));
        if (r < 0) {
            if (errno == EINTR)
                continue;
            return k3_err_sys(e, K3_EIO, errno, "%s: write of %" PRIu64 " bytes at offset %" PRIu64,
                              path, n, off + done);
        }
        if (r == 0)
            return k3_err_sys(e, K3_ENOSPC, ENOSPC, "%s: write at offset %" PRIu64, path, off + done);
        done += (uint64_t)r;
    }
    return 0;
}

int k3_io_pread_direct(int fd, void *dst, uint64_t n, uint64_t off,
                       void *bounce, uint64_t bounce_cap, const char *path, k3_err *e)
{
    const uint64_t A = K3_IO_DIRECT_ALIGN;
    if (n == 0)
        return 0;
    if (((uintptr_t)dst % A) == 0 && off % A == 0 && n % A == 0)
        return k3_io_pread(fd, dst, n, off, path, e);
    uint64_t lo = off / A * A;
    uint64_t hi = (off + n + A - 1) / A * A;
    if (!bounce || (uintptr_t)bounce % A || hi - lo > bounce_cap)
        return k3_err_set(e, K3_EINTERNAL, "%s: O_DIRECT bounce buffer too small for %" PRIu64 " bytes",
                          path, hi - lo);
    /* The widened range may run past EOF: accept a short read that still
     * covers the requested bytes. */
    uint64_t done = 0;
    int f = fault_for(path, n, off);
    if (f == FAULT_EIO)
        return k3_err_sys(e, K3_EIO, EIO, "%s: read of %" PRIu64 " bytes at offset %" PRIu64, path, n, off);
    while (lo + done < off + n) {
        ssize_t r = pread(fd, (char *)bounce + done, (size_t)(hi - lo - done), (off_t)(lo + done));
        if (r < 0) {
            if (errno == EINTR)
                continue;
            return k3_err_sys(e, K3_EIO, errno, "%s: read of %" PRIu64 " bytes at offset %" PRIu64,
                              path, n, off);
        }
        if (r == 0)
            return truncated(e, fd, path, n, off, lo + done > off ? lo + done - off : 0);
        done += (uint64_t)r;
        if (done % A)
            break; /* EOF inside the last block */
    }
    if (lo + done < off + n || f == FAULT_SHORT)
        return truncated(e, fd, path, n, off, lo + done > off ? lo + done - off : 0);
    memcpy(dst, (char *)bounce + (off - lo), (size_t)n);
    if (f == FAULT_FLIP)
        ((unsigned char *)dst)[fault.offset - off] ^= 1;
    return 0;
}

/* Would a planted fault fire on a read covering [off, off+n) of path? (Does
 * not consume it.) */
static int fault_covers(const char *path, uint64_t off, uint64_t n)
{
    if (!fault.loaded)
        k3_io_fault_reset();
    return fault.kind != FAULT_NONE && path && fault.remaining != 0 && strstr(path, fault.substr) &&
           fault.offset >= off && fault.offset - off < n;
}

int k3_io_next_data(int fd, uint64_t off, uint64_t end, uint64_t *data_off, uint64_t *data_end, const char *path,
                    k3_err *e)
{
    const uint64_t A = K3_IO_DIRECT_ALIGN;
    *data_off = off;
    *data_end = end;
    if (off >= end) {
        *data_off = *data_end = end;
        return 0;
    }
    if (off > INT64_MAX || end > INT64_MAX)
        return k3_err_set(e, K3_EARG, "%s: range at offset %" PRIu64 " overflows", path, off);
    off_t d = lseek(fd, (off_t)off, SEEK_DATA);
    if (d < 0) {
        if (errno == ENXIO) {
            d = (off_t)end; /* a hole up to EOF */
        } else if (errno == EINVAL || errno == EOPNOTSUPP) {
            return 0; /* the filesystem cannot tell: all data */
        } else {
            return k3_err_sys(e, K3_EIO, errno, "%s: SEEK_DATA at offset %" PRIu64, path, off);
        }
    }
    uint64_t lo = (uint64_t)d < end ? (uint64_t)d / A * A : end;
    lo = lo < off ? off : lo;
    uint64_t hi = end;
    if (lo < end) {
        off_t h = lseek(fd, d, SEEK_HOLE);
        if (h < 0)
            return k3_err_sys(e, K3_EIO, errno, "%s: SEEK_HOLE at offset %" PRIu64, path, (uint64_t)d);
        hi = ((uint64_t)h + A - 1) / A * A;
        hi = hi > end ? end : hi;
    }
    /* a fault planted in the hole must still fire: the hole is read */
    if (lo > off && fault_covers(path, off, lo - off)) {
        *data_off = off;
        *data_end = lo < end ? hi : end;
        return 0;
    }
    *data_off = lo;
    *data_end = hi;
    return 0;
}

int k3_io_direct_align_fits(uint32_t mem_align, uint32_t offset_align)
{
    return mem_align && offset_align && (mem_align & (mem_align - 1)) == 0 &&
           (offset_align & (offset_align - 1)) == 0 && K3_IO_DIRECT_ALIGN % mem_align == 0 &&
           K3_IO_DIRECT_ALIGN % offset_align == 0;
}

/* One O_DIRECT read of K3_IO_DIRECT_ALIGN bytes at an offset and an address
 * that are K3_IO_DIRECT_ALIGN- but not 2 * K3_IO_DIRECT_ALIGN-aligned: EINVAL
 * means the file wants more. Not through the fault hook (not a data read). */
static int direct_probe_read(int fd)
{
    const uint64_t A = K3_IO_DIRECT_ALIGN;
    uint8_t *buf = k3_io_alloc_aligned(3 * A, 2 * A);
    if (!buf)
        return 0;
    struct stat st;
    off_t off = fstat(fd, &st) == 0 && (uint64_t)st.st_size >= 2 * A ? (off_t)A : 0;
    ssize_t r;
    do
        r = pread(fd, buf + A, (size_t)A, off);
    while (r < 0 && errno == EINTR);
    int fits = r >= 0 || errno != EINVAL;
    k3_io_free_aligned(buf);
    return fits;
}

int k3_io_direct_fits(int fd, int probe)
{
    struct statx sx;
    memset(&sx, 0, sizeof sx);
    if (statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &sx) == 0 && (sx.stx_mask & STATX_DIOALIGN) &&
        (sx.stx_dio_mem_align || sx.stx_dio_offset_align))
        return k3_io_direct_align_fits(sx.stx_dio_mem_align, sx.stx_dio_offset_align);
    /* 0 and 0 means no direct I/O on this file, but it also comes from
     * emulators that pass the mask and not the fields (qemu-user 7.2): the
     * probe read (or, without probe, the page-size rule) decides then */
    /* The kernel does not say (before Linux 6.1). Its direct I/O alignment is
     * then at most the block size, never above the page size. */
    if (k3_io_page_size() <= K3_IO_DIRECT_ALIGN)
        return 1;
    return probe ? direct_probe_read(fd) : 0;
}

int k3_io_open_read(const char *path, int direct, int *is_direct, k3_err *e)
{
    int fd = -1;
    if (is_direct)
        *is_direct = 0;
    if (direct) {
        fd = open(path, O_RDONLY | O_CLOEXEC | O_DIRECT);
        if (fd >= 0 && !k3_io_direct_fits(fd, 1)) {
            close(fd);          /* wants a coarser alignment than k3's: buffered */
            fd = -1;
        }
        if (fd >= 0 && is_direct)
            *is_direct = 1;
    }
    if (fd < 0)
        fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return k3_err_sys(e, errno == ENOENT ? K3_ENOENT : K3_EIO, errno, "%s: cannot open", path);
    return fd;
}

int k3_io_file_size(int fd, uint64_t *size, const char *path, k3_err *e)
{
    struct stat st;
    if (fstat(fd, &st) != 0)
        return k3_err_sys(e, K3_EIO, errno, "%s: cannot stat", path);
    if (!S_ISREG(st.st_mode))
        return k3_err_set(e, K3_EFORMAT, "%s: not a regular file", path);
    *size = (uint64_t)st.st_size;
    return 0;
}

int k3_io_read_file(const char *path, uint64_t max_bytes, char **buf, uint64_t *len, k3_err *e)
{
    *buf = NULL;
    if (len)
        *len = 0;
    int fd = k3_io_open_read(path, 0, NULL, e);
    if (fd < 0)
        return fd;
    uint64_t size;
    int rc = k3_io_file_size(fd, &size, path, e);
    if (rc == 0 && size > max_bytes)
        rc = k3_err_set(e, K3_ELIMIT, "%s: %" PRIu64 " bytes is larger than the %" PRIu64 "-byte limit",
                        path, size, max_bytes);
    char *p = NULL;
    if (rc == 0) {
        p = malloc((size_t)size + 1);
        if (!p)
            rc = k3_err_set(e, K3_ENOMEM, "%s: out of memory for %" PRIu64 " bytes", path, size);
    }
    if (rc == 0)
        rc = k3_io_pread(fd, p, size, 0, path, e);
    close(fd);
    if (rc) {
        free(p);
        return rc;
    }
    p[size] = '\0';
    *buf = p;
    if (len)
        *len = size;
    return 0;
}

int k3_io_read_fd(int fd, uint64_t max_bytes, char **buf, uint64_t *len, const char *name, k3_err *e)
{
    *buf = NULL;
    if (len)
        *len = 0;
    uint64_t cap = 4096, n = 0;
    char *p = malloc(cap);
    if (!p)
        return k3_err_set(e, K3_ENOMEM, "%s: out of memory", name);
    for (;;) {
        if (n + 1 >= cap) {
            if (cap > max_bytes) {
                free(p);
                return k3_err_set(e, K3_ELIMIT, "%s: more than the %" PRIu64 "-byte limit", name, max_bytes);
            }
            char *q = realloc(p, cap * 2);
            if (!q) {
                free(p);
                return k3_err_set(e, K3_ENOMEM, "%s: out of memory for %" PRIu64 " bytes", name, cap * 2);
            }
            p = q;
            cap *= 2;
        }
        ssize_t r = read(fd, p + n, (size_t)(cap - 1 - n));
        if (r < 0) {
            if (errno == EINTR)
                continue;
            int en = errno;
            free(p);
            return k3_err_sys(e, K3_EIO, en, "%s: read at byte %" PRIu64, name, n);
        }
        if (r == 0)
            break;
        n += (uint64_t)r;
    }
    if (n > max_bytes) {
        free(p);
        return k3_err_set(e, K3_ELIMIT, "%s: more than the %" PRIu64 "-byte limit", name, max_bytes);
    }
    p[n] = '\0';
    *buf = p;
    if (len)
        *len = n;
    return 0;
}

/* ---- memory --------------------------------------------------------------- */

void *k3_io_alloc_aligned(uint64_t n, uint64_t align)
{
    void *p = NULL;
    if (n == 0)
        n = align;
    if (n > SIZE_MAX || posix_memalign(&p, (size_t)align, (size_t)n) != 0)
        return NULL;
    return p;
}

void k3_io_free_aligned(void *p)
{
    free(p);
}

uint64_t k3_io_page_size(void)
{
    long pg = sysconf(_SC_PAGESIZE);
    return pg > 0 ? (uint64_t)pg : 4096;
}

uint64_t k3_io_huge_page_size(void)
{
    static uint64_t cached;
    uint64_t h = __atomic_load_n(&cached, __ATOMIC_RELAXED);
    if (h)
        return h;
    h = K3_IO_HUGE_ALIGN;
    FILE *f = fopen("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size", "r");
    if (f) {
        unsigned long long v = 0;
        /* a power of two of at least a page, else the 2 MiB default */
        if (fscanf(f, "%llu", &v) == 1 && v >= k3_io_page_size() && (v & (v - 1)) == 0 && v <= (1ull << 30))
            h = v;
        fclose(f);
    }
    __atomic_store_n(&cached, h, __ATOMIC_RELAXED);
    return h;
}

/* The length is rounded to K3_IO_HUGE_ALIGN (2 MiB) only, whatever the huge
 * page size: on 16 and 64 KiB-page kernels huge pages are 32 and 512 MiB,
 * and rounding a 16 MiB arena to those would map and touch far more than
 * asked. The start is aligned to the huge page size, so every whole huge
 * page inside the arena can be one. */
void *k3_io_huge_alloc(uint64_t n)
{
    const uint64_t G = K3_IO_HUGE_ALIGN, H = k3_io_huge_page_size() > G ? k3_io_huge_page_size() : G;
    const uint64_t pg = k3_io_page_size();
    if (n == 0 || n > SIZE_MAX - H - G)
        return NULL;
    uint64_t len = (n + G - 1) / G * G;
    len = (len + pg - 1) / pg * pg;
    /* over-map by one huge page, then trim to an aligned start */
    char *raw = mmap(NULL, (size_t)(len + H), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED)
        return NULL;
    uintptr_t start = ((uintptr_t)raw + H - 1) / H * H;
    size_t head = start - (uintptr_t)raw;
    if (head)
        munmap(raw, head);
    size_t tail = (size_t)(H - head);
    if (tail)
        munmap((char *)start + len, tail);
    char *p = (char *)start;
#ifdef MADV_HUGEPAGE
    madvise(p, (size_t)len, MADV_HUGEPAGE);
#endif
    for (uint64_t i = 0; i < len; i += pg)
        p[i] = 0;
    return p;
}

void k3_io_huge_free(void *p, uint64_t n)
{
    const uint64_t G = K3_IO_HUGE_ALIGN, pg = k3_io_page_size();
    if (!p)
        return;
    uint64_t len = (n + G - 1) / G * G;
    munmap(p, (size_t)((len + pg - 1) / pg * pg));
}

/* ---- atomic publish ------------------------------------------------------- */

int k3_io_path_join(char *out, size_t cap, const char *dir, const char *name, k3_err *e)
{
    int n = snprintf(out, cap, "%s/%s", dir, name);
    if (n < 0 || (size_t)n >= cap)
        return k3_err_set(e, K3_ELIMIT, "%s/%s: path too long", dir, name);
    return 0;
}

int k3_io_fsync_dir(const char *path, k3_err *e)
{
    char buf[PATH_MAX];
    struct stat st;
    const char *dir = path;
    if (stat(path, &st) != 0 || !S_ISDIR(st.st_mode)) {
        snprintf(buf, sizeof buf, "%s", path);
        dir = dirname(buf);
    }
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0)
        return k3_err_sys(e, K3_EIO, errno, "%s: cannot open directory", dir);
    int rc = 0;
    if (fsync(fd) != 0 && errno != EINVAL)
        rc = k3_err_sys(e, K3_EIO, errno, "%s: fsync of directory", dir);
    close(fd);
    return rc;
}

int k3_io_tmp_create(const char *dst, int overwrite_tmp, char *tmp_path, size_t tmp_cap, k3_err *e)
{
    int n = snprintf(tmp_path, tmp_cap, "%s.tmp", dst);
    if (n < 0 || (size_t)n >= tmp_cap)
        return k3_err_set(e, K3_ELIMIT, "%s: path too long", dst);
    int flags = O_WRONLY | O_CREAT | O_CLOEXEC | (overwrite_tmp ? O_TRUNC : O_EXCL);
    int fd = open(tmp_path, flags, 0644);
    if (fd < 0)
        return k3_err_sys(e, errno == EEXIST ? K3_EEXIST : K3_EIO, errno, "%s: cannot create", tmp_path);
    return fd;
}

int k3_io_publish(int fd, const char *tmp_path, const char *dst, k3_err *e)
{
    int rc = 0;
    if (fsync(fd) != 0)
        rc = k3_err_sys(e, K3_EIO, errno, "%s: fsync", tmp_path);
    if (close(fd) != 0 && rc == 0)
        rc = k3_err_sys(e, K3_EIO, errno, "%s: close", tmp_path);
    if (rc == 0 && rename(tmp_path, dst) != 0)
        rc = k3_err_sys(e, K3_EIO, errno, "%s: cannot rename to %s", tmp_path, dst);
    if (rc == 0)
        rc = k3_io_fsync_dir(dst, e);
    return rc;
}

int k3_io_write_file_atomic(const char *dst, const void *buf, uint64_t n, k3_err *e)
{
    struct stat st;
    if (stat(dst, &st) == 0 && !S_ISREG(st.st_mode) && !S_ISDIR(st.st_mode)) {
        /* a device or a pipe (/dev/stdout): written in place, never renamed over */
        int fd = open(dst, O_WRONLY | O_CLOEXEC);
        if (fd < 0)
            return k3_err_sys(e, K3_EIO, errno, "%s: cannot open for writing", dst);
        uint64_t done = 0;
        int rc = 0;
        while (rc == 0 && done < n) {
            size_t chunk = n - done > (1u << 30) ? (1u << 30) : (size_t)(n - done);
            ssize_t r = write(fd, (const char *)buf + done, chunk);
            if (r < 0 && errno == EINTR)
                continue;
            if (r <= 0)
                rc = k3_err_sys(e, K3_EIO, r < 0 ? errno : ENOSPC, "%s: write at byte %" PRIu64, dst, done);
            else
                done += (uint64_t)r;
        }
        if (close(fd) != 0 && rc == 0)
            rc = k3_err_sys(e, K3_EIO, errno, "%s: close", dst);
        return rc;
    }
    char tmp[PATH_MAX];
    int fd = k3_io_tmp_create(dst, 1, tmp, sizeof tmp, e);
    if (fd < 0)
        return fd;
    int rc = k3_io_pwrite(fd, buf, n, 0, tmp, e);
    if (rc) {
        close(fd);
        unlink(tmp);
        return rc;
    }
    rc = k3_io_publish(fd, tmp, dst, e);
    if (rc)
        unlink(tmp);
    return rc;
}

double k3_now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}
