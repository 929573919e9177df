/*
 * t_io.c - the I/O layer: full reads, truncation messages, fault injection,
 * atomic publish.
 */
#include "k3_io.h"
#include "k3_test.h"

#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static void write_bytes(const char *path, uint64_t n)
{
    k3_err e = {0};
    unsigned char *b = malloc(n);
    for (uint64_t i = 0; i < n; i++)
        b[i] = (unsigned char)(i * 7);
    CHECK_EQ_INT(k3_io_write_file_atomic(path, b, n, &e), 0);
    free(b);
}

K3_TEST(io_read_past_eof_names_file_and_offset)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/f.bin", k3t_tmpdir());
    write_bytes(path, 100);
    k3_err e = {0};
    int fd = k3_io_open_read(path, 0, NULL, &e);
    CHECK(fd >= 0);
    unsigned char buf[200];
    CHECK_EQ_INT(k3_io_pread(fd, buf, 50, 80, path, &e), K3_EIO);
    CHECK_STR_CONTAINS(e.msg, "f.bin: truncated");
    CHECK_STR_CONTAINS(e.msg, "offset 80");
    CHECK_STR_CONTAINS(e.msg, "ends at byte 100");
    close(fd);
}

K3_TEST(io_direct_read_widens_unaligned_ranges)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/f.bin", k3t_tmpdir());
    write_bytes(path, 3 * 4096 + 100);
    k3_err e = {0};
    int direct = 0;
    int fd = k3_io_open_read(path, 1, &direct, &e);
    CHECK(fd >= 0);
    void *bounce = k3_io_alloc_aligned(4 * 4096, 4096);
    unsigned char out[5000];
    CHECK_EQ_INT(k3_io_pread_direct(fd, out, 5000, 4000, bounce, 4 * 4096, path, &e), 0);
    for (int i = 0; i < 5000; i++)
        CHECK_EQ_INT(out[i], (unsigned char)((4000 + i) * 7));
    /* the tail block, ending at EOF */
    CHECK_EQ_INT(k3_io_pread_direct(fd, out, 150, 3 * 4096 - 50, bounce, 4 * 4096, path, &e), 0);
    CHECK_EQ_INT(out[149], (unsigned char)((3 * 4096 + 99) * 7));
    CHECK_EQ_INT(k3_io_pread_direct(fd, out, 151, 3 * 4096 - 50, bounce, 4 * 4096, path, &e), K3_EIO);
    k3_io_free_aligned(bounce);
    close(fd);
}

K3_TEST(io_fault_injection_plants_eio_short_and_flip)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/victim.bin", k3t_tmpdir());
    write_bytes(path, 1000);
    k3_err e = {0};
    int fd = k3_io_open_read(path, 0, NULL, &e);
    unsigned char buf[1000];

    setenv("K3_FAULT", "eio:victim:500", 1);
    k3_io_fault_reset();
    CHECK_EQ_INT(k3_io_pread(fd, buf, 100, 0, path, &e), 0); /* does not cover 500 */
    CHECK_EQ_INT(k3_io_pread(fd, buf, 100, 450, path, &e), K3_EIO);
    CHECK_STR_CONTAINS(e.msg, "Input/output error");

    k3_err_clear(&e);
    setenv("K3_FAULT", "short:victim:0", 1);
    k3_io_fault_reset();
    CHECK_EQ_INT(k3_io_pread(fd, buf, 10, 0, path, &e), K3_EIO);

    k3_err_clear(&e);
    setenv("K3_FAULT", "flip:victim:7:1", 1);
    k3_io_fault_reset();
    CHECK_EQ_INT(k3_io_pread(fd, buf, 10, 0, path, &e), 0);
    CHECK_EQ_INT(buf[7], (unsigned char)(7 * 7) ^ 1);
    CHECK_EQ_INT(k3_io_pread(fd, buf, 10, 0, path, &e), 0); /* count 1: used up */
    CHECK_EQ_INT(buf[7], (unsigned char)(7 * 7));
    unsetenv("K3_FAULT");
    k3_io_fault_reset();
    close(fd);
}

K3_TEST(io_atomic_write_leaves_no_temporary)
{
    char path[4096], tmp[4200];
    snprintf(path, sizeof path, "%s/out.json", k3t_tmpdir());
    k3_err e = {0};
    CHECK_EQ_INT(k3_io_write_file_atomic(path, "{}", 2, &e), 0);
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    CHECK(access(path, F_OK) == 0);
    CHECK(access(tmp, F_OK) != 0);
}

K3_TEST(io_huge_arena_is_aligned_and_mapped)
{
    uint64_t n = 5u << 20;
    unsigned char *p = k3_io_huge_alloc(n);
    CHECK(p != NULL);
    CHECK(((uintptr_t)p % K3_IO_HUGE_ALIGN) == 0);
    p[n - 1] = 1;
    k3_io_huge_free(p, n);
}

/* k3_io_next_data on a file with data and holes at odd boundaries: the runs
 * it reports, read, with zeros elsewhere, are the file; holes are reported
 * (ext4, tmpfs and xfs know them); every answer is block-aligned. A fault
 * planted in a hole makes that hole data, so it still fires. */
K3_TEST(io_next_data_reports_data_runs_and_holes_read_as_zeros)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/sparse.bin", k3t_tmpdir());
    const uint64_t size = 1000 * 1000 + 123;
    static const uint64_t data[][2] = {{5000, 3}, {200001, 70001}, {600000, 1}, {size - 10, 10}};
    int fd = open(path, O_RDWR | O_CREAT | O_TRUNC, 0644);
    CHECK(fd >= 0);
    CHECK_EQ_INT(ftruncate(fd, (off_t)size), 0);
    unsigned char *want = calloc(1, size), *got = malloc(size);
    k3_err e = {0};
    for (size_t i = 0; i < sizeof data / sizeof *data; i++) {
        for (uint64_t j = 0; j < data[i][1]; j++)
            want[data[i][0] + j] = (unsigned char)(1 + (data[i][0] + j) % 251);
        CHECK_EQ_INT(k3_io_pwrite(fd, want + data[i][0], data[i][1], data[i][0], path, &e), 0);
    }
    CHECK_EQ_INT(fsync(fd), 0);
    for (int fault = 0; fault < 2; fault++) {
        if (fault) {
            setenv("K3_FAULT", "flip:sparse.bin:400000:1", 1); /* in a hole */
            k3_io_fault_reset();
        }
        memset(got, 0xee, size);
        uint64_t pos = 0, read = 0, covered = 0;
        while (pos < size) {
            uint64_t d0, d1;
            CHECK_EQ_INT(k3_io_next_data(fd, pos, size, &d0, &d1, path, &e), 0);
            CHECK(d0 >= pos && d0 <= d1 && d1 <= size);
            CHECK(d0 % 4096 == 0 || d0 == size);
            CHECK(d1 % 4096 == 0 || d1 == size);
            memset(got + pos, 0, d0 - pos);
            if (d0 == size)
                break;
            CHECK(d1 > d0);
            CHECK_EQ_INT(k3_io_pread(fd, got + d0, d1 - d0, d0, path, &e), 0);
            covered += d0 <= 400000 && 400000 < d1;
            read += d1 - d0;
            pos = d1;
        }
        if (!fault) {
            CHECK(!memcmp(got, want, size));
            CHECK(read < size / 2); /* the holes were found, not read */
        } else {
            CHECK_EQ_INT(covered, 1);
            CHECK_EQ_INT(got[400000], 1); /* the fault fired: 0 with bit 0 flipped */
            got[400000] = 0;
            CHECK(!memcmp(got, want, size));
        }
    }
    /* the end of the range is respected and an empty range is empty */
    uint64_t d0, d1;
    CHECK_EQ_INT(k3_io_next_data(fd, 5000, 5002, &d0, &d1, path, &e), 0);
    CHECK(d0 == 5000 && d1 == 5002);
    CHECK_EQ_INT(k3_io_next_data(fd, 7, 7, &d0, &d1, path, &e), 0);
    CHECK(d0 == 7 && d1 == 7);
    free(want);
    free(got);
    close(fd);
}
