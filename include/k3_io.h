/*
 * k3_io.h - file I/O that never loses or invents data.
 *
 * - Full pread/pwrite loops: a short read at EOF is an error naming the file,
 *   the offset and how many bytes were expected; EINTR is retried.
 * - Aligned buffers for O_DIRECT, and huge-page arenas (2 MiB aligned,
 *   MADV_HUGEPAGE, faulted in once) because O_DIRECT into such memory reads
 *   2.5-3x faster and fresh pages are slow to touch.
 * - Atomic publish: write "<dst>.tmp", fsync, rename, fsync the directory.
 * - A fault-injection hook for tests: every read made through k3_io_pread
 *   consults K3_FAULT (see k3_io_fault_reset), so that EIO, short reads and
 *   flipped bytes can be planted in any tool without changing it.
 *
 * Sizes and offsets are uint64_t. Paths are only used for messages here.
 */
#ifndef K3_IO_H
#define K3_IO_H

#include <stddef.h>
#include <stdint.h>

#include "k3_err.h"

/* The alignment of every O_DIRECT transfer (address, file offset, length).
 * It is the I/O block, not the page size: Linux asks direct I/O to be
 * aligned to the file's direct-I/O alignment (the logical block size, at most
 * the filesystem block), 512 or 4096 bytes on nearly every system, whatever
 * the page size (4, 16 or 64 KiB). A file that wants more (a filesystem with
 * 64 KiB blocks on a 64 KiB-page kernel) is read and written buffered, see
 * k3_io_direct_fits. */
#define K3_IO_DIRECT_ALIGN 4096u
/* Huge-page arenas are rounded to this and aligned to the huge page size
 * (k3_io_huge_page_size: 2 MiB with 4 KiB pages, 32 MiB with 16 KiB, 512 MiB
 * with 64 KiB pages). */
#define K3_IO_HUGE_ALIGN   (2u << 20)

/* Read exactly n bytes at off into buf. A read past EOF is K3_EIO with
 * "PATH: truncated: wanted N bytes at offset O, file ends at ..." */
int k3_io_pread(int fd, void *buf, uint64_t n, uint64_t off, const char *path, k3_err *e);

/* Write exactly n bytes at off. ENOSPC becomes K3_ENOSPC. */
int k3_io_pwrite(int fd, const void *buf, uint64_t n, uint64_t off, const char *path, k3_err *e);

/* Read [off, off+n) from an fd opened with O_DIRECT: the range is widened to
 * K3_IO_DIRECT_ALIGN boundaries into bounce (capacity bounce_cap, aligned) and
 * the requested bytes are copied to dst. If dst itself is aligned and off/n
 * are aligned the read goes straight into dst and bounce may be NULL. */
int k3_io_pread_direct(int fd, void *dst, uint64_t n, uint64_t off,
                       void *bounce, uint64_t bounce_cap, const char *path, k3_err *e);

/* Open for reading, O_DIRECT if direct and the filesystem allows it with
 * K3_IO_DIRECT_ALIGN alignment (k3_io_direct_fits, probing). *is_direct (may
 * be NULL) tells which. Returns fd >= 0, or a negative K3_E* code. */
int k3_io_open_read(const char *path, int direct, int *is_direct, k3_err *e);

/* The first run of data in [off, end) of an open file: *data_off is where it
 * starts (end if the rest is a hole) and *data_end where it stops (a hole or
 * end). Both are widened to K3_IO_DIRECT_ALIGN boundaries (clipped to
 * [off, end)), so [off, *data_off) and [*data_end, next data) read as zeros
 * by definition (holes) and need not be read. Where the filesystem cannot
 * tell holes (no SEEK_DATA), everything is data. A K3_FAULT planted in a hole
 * turns that hole into data, so injected faults still fire. Meant for files
 * nobody is writing (a concurrent writer can fill a hole after the answer). */
int k3_io_next_data(int fd, uint64_t off, uint64_t end, uint64_t *data_off, uint64_t *data_end, const char *path,
                    k3_err *e);

/* Whether O_DIRECT transfers aligned to K3_IO_DIRECT_ALIGN work on fd (1) or
 * not (0): the kernel's statx direct-I/O alignment where it reports one
 * (Linux 6.1+); else yes on kernels with pages of at most K3_IO_DIRECT_ALIGN
 * (the alignment never exceeds the page size there); else, with probe, one
 * real O_DIRECT read of fd tells (no without probe, e.g. for a file being
 * written). Callers that get 0 use buffered I/O. */
int k3_io_direct_fits(int fd, int probe);
/* The rule itself: direct-I/O memory and offset alignments (0 = no direct
 * I/O) that K3_IO_DIRECT_ALIGN satisfies. */
int k3_io_direct_align_fits(uint32_t mem_align, uint32_t offset_align);

/* The page size of the running kernel, and its (transparent) huge page size
 * (2 MiB when the kernel does not say). */
uint64_t k3_io_page_size(void);
uint64_t k3_io_huge_page_size(void);

/* Size of an open file. */
int k3_io_file_size(int fd, uint64_t *size, const char *path, k3_err *e);

/* Read a whole small file (config, index, tokenizer) into a NUL-terminated
 * heap buffer. Files larger than max_bytes are K3_ELIMIT. Caller frees *buf. */
int k3_io_read_file(const char *path, uint64_t max_bytes, char **buf, uint64_t *len, k3_err *e);

/* Read everything an open descriptor gives until EOF (a pipe, stdin: "name"
 * in messages) into a NUL-terminated heap buffer, at most max_bytes
 * (K3_ELIMIT beyond). Caller frees *buf. */
int k3_io_read_fd(int fd, uint64_t max_bytes, char **buf, uint64_t *len, const char *name, k3_err *e);

/* Aligned heap memory (posix_memalign). Free with k3_io_free_aligned; NULL ok. */
void *k3_io_alloc_aligned(uint64_t n, uint64_t align);
void k3_io_free_aligned(void *p);

/* A huge-page-backed arena: mmap'd, n rounded up to K3_IO_HUGE_ALIGN, the
 * start aligned to the huge page size, MADV_HUGEPAGE, every page written once
 * so later O_DIRECT reads and compute find it mapped. Returns NULL on failure.
 * Free with k3_io_huge_free(p, n). */
void *k3_io_huge_alloc(uint64_t n);
void k3_io_huge_free(void *p, uint64_t n);

/* Seconds on the monotonic clock (timings and reports). */
double k3_now_s(void);

/* Atomic publish of a file: k3_io_tmp_create opens "<dst>.tmp" (O_EXCL unless
 * the stale temporary is ours to replace: overwrite_tmp). k3_io_publish fsyncs
 * fd, closes it, renames tmp to dst and fsyncs dst's directory. */
int k3_io_tmp_create(const char *dst, int overwrite_tmp, char *tmp_path, size_t tmp_cap, k3_err *e);
int k3_io_publish(int fd, const char *tmp_path, const char *dst, k3_err *e);
/* Write a whole buffer to dst atomically (tmp, fsync, rename, fsync dir).
 * A dst that exists and is not a regular file (/dev/stdout, a pipe, a
 * device) is written in place, every write checked, never renamed over. */
int k3_io_write_file_atomic(const char *dst, const void *buf, uint64_t n, k3_err *e);
/* fsync the directory holding path (or the directory path itself). */
int k3_io_fsync_dir(const char *dir, k3_err *e);

/* What a model directory is. */
enum {
    K3_DIR_UNKNOWN = 0,         /* a directory with none of the files below */
    K3_DIR_PACKED = 1,          /* manifest.json */
    K3_DIR_PACKED_PARTIAL = 2,  /* packed files or a journal, no manifest.json: unfinished */
    K3_DIR_UPSTREAM = 3,        /* config.json or *.safetensors */
};
/* Classify dir: K3_DIR_* (>= 0), or a negative code with an exact message:
 * K3_ENOENT "no such directory", K3_EARG "a file, not a model directory",
 * K3_EIO "permission denied: ..." (also for a manifest.json or config.json
 * that cannot be looked at). */
int k3_io_dir_kind(const char *dir, k3_err *e);
/* k3_io_dir_kind, then refuse any other kind than want (K3_DIR_PACKED or
 * K3_DIR_UPSTREAM) with a message naming the tool to use instead: an
 * upstream checkpoint given for a packed model says "k3-convert DIR DST"
 * (K3_EARG), a packed model given for a checkpoint "k3-pack DIR DST"
 * (K3_EARG), an unfinished packing "--resume" (K3_ENOENT), an empty
 * directory "not a model" (K3_ENOENT). tool names the caller. Returns the
 * kind or a negative code. */
int k3_io_dir_expect(const char *dir, int want, const char *tool, k3_err *e);

/* Join dir and name into out (capacity cap). K3_ELIMIT if it does not fit. */
int k3_io_path_join(char *out, size_t cap, const char *dir, const char *name, k3_err *e);

/*
 * Fault injection (tests only; costs one branch when unset).
 * K3_FAULT="KIND:SUBSTR:OFFSET[:COUNT[:SKIP]]" - the first COUNT (default:
 * all) reads, after the first SKIP (default 0) left alone, through
 * k3_io_pread/k3_io_pread_direct of a file whose path contains SUBSTR and
 * whose range covers byte OFFSET (SKIP reaches a later pass of a stream):
 *   eio   fail with EIO         short  return one byte less than asked
 *   flip  flip bit 0 of the byte at OFFSET in what was read
 * k3_io_fault_reset() re-reads the variable (the tools read it once at start).
 */
void k3_io_fault_reset(void);

#endif
