/*
 * conv_read.c - k3-convert's reader thread: reads each shard of a group in
 * chunks (holes of sparse shards are zeros by definition: marked, not read),
 * hashes it while read and hands the chunks to the converting thread.
 */
#include "conv_run.h"

#include <cjson/cJSON.h>
#include <dirent.h>
#include <errno.h>
#include <inttypes.h>
#include <omp.h>
#include <openssl/evp.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "k3_outfile.h"
#include "k3_crc.h"
#include "k3_dest.h"
#include "k3_io.h"
#include "k3_journal.h"
#include "k3_kern.h"
#include "k3_progress.h"


/* ---- the reader thread ------------------------------------------------------ */



static int reader_read(reader *r, int fd, int direct, uint8_t *buf, uint64_t n, uint64_t off, const char *path)
{
    if (!direct)
        return k3_io_pread(fd, buf, n, off, path, &r->err);
    uint64_t al = n / K3_IO_DIRECT_ALIGN * K3_IO_DIRECT_ALIGN;
    int rc = al ? k3_io_pread_direct(fd, buf, al, off, NULL, 0, path, &r->err) : 0;
    if (rc == 0 && n > al)
        rc = k3_io_pread_direct(fd, buf + al, n - al, off + al, r->bounce, K3_IO_DIRECT_ALIGN, path, &r->err);
    return rc;
}

/* Fill chunk c: the shard's data runs are read, its holes (zeros by
 * definition) are memset and marked in c->zmap instead. */
static int reader_fill(reader *r, int fd, int direct, chunk *c, const char *path)
{
    memset(c->zmap, 0, sizeof c->zmap);
    uint64_t pos = c->off, end = c->off + c->len;
    while (pos < end) {
        uint64_t d0, d1;
        int rc = k3_io_next_data(fd, pos, end, &d0, &d1, path, &r->err);
        if (rc)
            return rc;
        /* a hole [pos, d0): pos is block-aligned, d0 too or the chunk's end */
        r->holes += d0 - pos;
        for (uint64_t b = (pos - c->off) / ZBLOCK; b * ZBLOCK < d0 - c->off; b++) {
            /* the chunk's last block may be partial: its slot has room */
            if (!(c->zbuf[b / 64] >> (b % 64) & 1)) {
                memset(c->buf + b * ZBLOCK, 0, ZBLOCK);
                c->zbuf[b / 64] |= 1ull << (b % 64);
            }
            c->zmap[b / 64] |= 1ull << (b % 64);
        }
        if (d0 == end)
            break;
        for (uint64_t b = (d0 - c->off) / ZBLOCK; b * ZBLOCK < d1 - c->off; b++)
            c->zbuf[b / 64] &= ~(1ull << (b % 64));
        if ((rc = reader_read(r, fd, direct, c->buf + (d0 - c->off), d1 - d0, d0, path)))
            return rc;
        pos = d1;
    }
    return 0;
}

void *k3_conv_reader_main(void *arg)
{
    reader *r = arg;
    const k3_conv_plan *p = r->p;
    uint32_t slot_i = 0;
    EVP_MD_CTX *md = EVP_MD_CTX_new();
    int rc = md ? 0 : k3_err_set(&r->err, K3_ENOMEM, "out of memory");
    for (uint32_t s = r->shard_first; rc == 0 && s < r->shard_end; s++) {
        const char *path = k3_st_shard_path(p->st, s);
        int direct = 0;
        int fd = k3_io_open_read(path, 1, &direct, &r->err);
        if (fd < 0) {
            rc = fd;
            break;
        }
        uint64_t size = k3_st_shard_size(p->st, s), now;
        if ((rc = k3_io_file_size(fd, &now, path, &r->err)) == 0 && now != size)
            rc = k3_err_set(&r->err, K3_EIO, "%s: changed while converting: %" PRIu64 " bytes, was %" PRIu64, path,
                            now, size);
        if (rc == 0 && EVP_DigestInit_ex(md, EVP_sha256(), NULL) != 1)
            rc = k3_err_set(&r->err, K3_EINTERNAL, "SHA-256 init failed");
        for (uint64_t off = 0; rc == 0 && off < size; off += r->chunk) {
            pthread_mutex_lock(&r->mu);
            while (r->count == K3_CONV_NCHUNKS && !r->stop)
                pthread_cond_wait(&r->cv, &r->mu);
            int stop = r->stop;
            pthread_mutex_unlock(&r->mu);
            if (stop || k3_conv_stop_requested) {
                rc = K3_EINTR;
                k3_err_set(&r->err, K3_EINTR, "interrupted");
                break;
            }
            chunk *c = &r->slots[slot_i];
            c->buf = r->arena + (uint64_t)slot_i * r->chunk;
            c->shard = s;
            c->off = off;
            c->len = size - off < r->chunk ? size - off : r->chunk;
            if ((rc = reader_fill(r, fd, direct, c, path)))
                break;
            EVP_DigestUpdate(md, c->buf, (size_t)c->len);
            pthread_mutex_lock(&r->mu);
            r->count++;
            pthread_cond_broadcast(&r->cv);
            pthread_mutex_unlock(&r->mu);
            slot_i = (slot_i + 1) % K3_CONV_NCHUNKS;
        }
        if (rc == 0) {
            unsigned int len = 0;
            EVP_DigestFinal_ex(md, r->shard_sha[s], &len);
        }
        close(fd);
    }
    EVP_MD_CTX_free(md);
    pthread_mutex_lock(&r->mu);
    r->finished = 1;
    r->failed = rc;
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
    return NULL;
}
