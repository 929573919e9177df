/*
 * bench_tok.c - tokenizer encode and decode speed on one core.
 *
 *   bin/bench-bench_tok DIR CORPUS [RUNS]
 *
 * DIR holds tiktoken.model + tokenizer_config.json (e.g. the o200k_base
 * vocabulary written by tests/tok/make_vocab.js), CORPUS any file (e.g. from
 * tests/tok/gen_corpus.js). Prints the median and min-max of RUNS timed
 * encodes after one warm-up, in MB/s (10^6 bytes of input per second), next to
 * a memchr pass over the same buffer as the machine's reference for a
 * byte-by-byte scan, and the same for decode. Speeds are given against wall
 * time and against this thread's CPU time: on a shared, oversubscribed
 * machine the CPU-time figure is the one that means something.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "k3_io.h"
#include "k3_tok.h"

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static double cpu_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static int fail(const k3_err *e)
{
    fprintf(stderr, "bench_tok: error: %s\n", e->msg);
    return k3_err_exit_status(e->code);
}

int main(int argc, char **argv)
{
    if (argc < 3 || argc > 4) {
        fprintf(stderr, "usage: %s DIR CORPUS [RUNS]\n", argv[0]);
        return 2;
    }
    long runs = 5;
    if (argc == 4) {
        char *end;
        runs = strtol(argv[3], &end, 10);
        if (*end || runs < 1 || runs > 1000) {
            fprintf(stderr, "bench_tok: error: RUNS must be 1..1000\n");
            return 2;
        }
    }
    k3_err e = {0};
    k3_tok *tok;
    double t0 = now();
    if (k3_tok_open(&tok, argv[1], &e))
        return fail(&e);
    double t_open = now() - t0;
    char *text;
    uint64_t n;
    if (k3_io_read_file(argv[2], 1ull << 32, &text, &n, &e))
        return fail(&e);
    double *enc = calloc((size_t)runs, sizeof *enc), *dec = calloc((size_t)runs, sizeof *dec);
    double *scan = calloc((size_t)runs, sizeof *scan), *enc_cpu = calloc((size_t)runs, sizeof *enc_cpu);
    uint64_t nids = 0, lines = 0;
    for (long r = -1; r < runs; r++) {
        uint32_t *ids;
        char *back;
        uint64_t blen;
        double c0 = cpu_now();
        t0 = now();
        if (k3_tok_encode(tok, text, n, 0, &ids, &nids, &e))
            return fail(&e);
        double t1 = now(), c1 = cpu_now();
        if (k3_tok_decode(tok, ids, nids, &back, &blen, &e))
            return fail(&e);
        double t2 = now();
        if (blen != n || memcmp(back, text, n) != 0) {
            fprintf(stderr, "bench_tok: error: decode(encode(corpus)) differs from the corpus\n");
            return 9;
        }
        lines = 0;
        double t3 = now();
        for (const char *p = text; (p = memchr(p, '\n', (size_t)(text + n - p))) != NULL; p++)
            lines++;
        double t4 = now();
        free(back);
        free(ids);
        if (r >= 0) {
            enc[r] = (double)n / (t1 - t0) / 1e6;
            enc_cpu[r] = (double)n / (c1 - c0) / 1e6;
            dec[r] = (double)n / (t2 - t1) / 1e6;
            scan[r] = (double)n / (t4 - t3) / 1e6;
        }
    }
    qsort(enc, (size_t)runs, sizeof *enc, cmp_double);
    qsort(dec, (size_t)runs, sizeof *dec, cmp_double);
    qsort(enc_cpu, (size_t)runs, sizeof *enc_cpu, cmp_double);
    qsort(scan, (size_t)runs, sizeof *scan, cmp_double);
    printf("corpus %" PRIu64 " bytes -> %" PRIu64 " ids (%.2f bytes/id); vocabulary of %u opened in %.3f s\n", n,
           nids, (double)n / (double)nids, k3_tok_vocab_size(tok), t_open);
    printf("encode  %8.1f MB/s median (min %.1f, max %.1f) over %ld runs, 1 thread\n", enc[runs / 2], enc[0],
           enc[runs - 1], runs);
    printf("encode  %8.1f MB/s of thread CPU time, median (min %.1f, max %.1f)\n", enc_cpu[runs / 2],
           enc_cpu[0], enc_cpu[runs - 1]);
    printf("decode  %8.1f MB/s median (min %.1f, max %.1f)\n", dec[runs / 2], dec[0], dec[runs - 1]);
    printf("memchr  %8.1f MB/s median (reference scan, %" PRIu64 " lines); encode is %.4f of it\n",
           scan[runs / 2], lines, enc[runs / 2] / scan[runs / 2]);
    free(enc);
    free(dec);
    free(scan);
    free(enc_cpu);
    free(text);
    k3_tok_close(tok);
    return 0;
}
