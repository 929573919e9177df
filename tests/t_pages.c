/*
 * t_pages.c - nothing assumes 4 KiB pages: the O_DIRECT alignment rule (k3's
 * 4096-byte transfers against the file's direct-I/O alignment, whatever the
 * page size), the direct-I/O check on a real file, and huge-page arenas
 * aligned to the kernel's own huge page size with the length k3 plans for.
 */
#include "k3_io.h"
#include "k3_stream.h"
#include "k3_test.h"

#include <fcntl.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

K3_TEST(pages_direct_io_alignment_rule)
{
    CHECK(k3_io_direct_align_fits(512, 512));
    CHECK(k3_io_direct_align_fits(4, 512));
    CHECK(k3_io_direct_align_fits(4096, 4096));
    CHECK(!k3_io_direct_align_fits(0, 512));        /* no direct I/O on this file */
    CHECK(!k3_io_direct_align_fits(512, 0));
    CHECK(!k3_io_direct_align_fits(8192, 4096));    /* a 64 KiB-block filesystem, say */
    CHECK(!k3_io_direct_align_fits(4096, 65536));
    CHECK(!k3_io_direct_align_fits(4096, 3072));    /* not a power of two */
}

/* On this machine's temporary filesystem the check agrees with what a
 * 4096-aligned O_DIRECT read really does. */
K3_TEST(pages_direct_io_check_agrees_with_a_real_read)
{
    const char *dir = k3t_tmpdir();
    char path[1200];
    snprintf(path, sizeof path, "%s/f", dir);
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    CHECK(fd >= 0);
    static unsigned char data[3 * 4096];
    memset(data, 0x5a, sizeof data);
    CHECK(write(fd, data, sizeof data) == (ssize_t)sizeof data);
    close(fd);
    fd = open(path, O_RDONLY | O_DIRECT);
    if (fd < 0)
        k3t_skip("this filesystem refuses O_DIRECT");
    int fits = k3_io_direct_fits(fd, 1);
    unsigned char *buf = k3_io_alloc_aligned(3 * 4096, 8192);
    ssize_t r = pread(fd, buf + 4096, 4096, 4096);
    CHECK_EQ_INT(fits, r == 4096);
    if (r == 4096)
        CHECK(buf[4096] == 0x5a && buf[8191] == 0x5a);
    k3_io_free_aligned(buf);
    close(fd);
    /* and open_read says direct exactly when it fits */
    k3_err e = {0};
    int direct = -1;
    fd = k3_io_open_read(path, 1, &direct, &e);
    CHECK(fd >= 0);
    CHECK_EQ_INT(direct, fits);
    close(fd);
}

K3_TEST(pages_huge_arena_follows_the_kernel_page_sizes)
{
    uint64_t pg = k3_io_page_size(), hp = k3_io_huge_page_size();
    CHECK(pg >= 4096 && (pg & (pg - 1)) == 0);
    CHECK(pg == (uint64_t)sysconf(_SC_PAGESIZE));
    CHECK(hp >= pg && (hp & (hp - 1)) == 0);
    uint64_t align = hp > K3_IO_HUGE_ALIGN ? hp : K3_IO_HUGE_ALIGN;
    uint64_t n = 5 * (1ull << 20) + 17;
    unsigned char *p = k3_io_huge_alloc(n);
    CHECK(p != NULL);
    CHECK((uintptr_t)p % align == 0);
    /* the whole planned length is mapped and writable; the planner counts
     * exactly that length (k3_stream_arena_bytes) */
    uint64_t len = k3_stream_arena_bytes(n);
    CHECK_EQ_U64(len, 6ull << 20);
    p[0] = 1, p[len - 1] = 2;
    unsigned char vec[1];
    CHECK_EQ_INT(mincore(p + len - 1 - (len - 1) % pg, pg, vec), 0);
    k3_io_huge_free(p, n);
    /* small arenas: whole pages of the running kernel */
    CHECK_EQ_U64(k3_stream_arena_bytes(1) % pg, 0);
    CHECK(k3_stream_arena_bytes(1) >= 4096);
}
