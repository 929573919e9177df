/*
 * synth_index.c - bench-synth_index DIR [RUNS]: time how long the safetensors
 * reader takes to index a checkpoint (k3_st_open: every shard header parsed,
 * one name table), print tensors, shards, median/min/max seconds and the peak
 * RSS. Used by bench/synth.sh on what k3-synth writes.
 */
#include "k3_st.h"

#include <stdio.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <time.h>

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: bench-synth_index DIR [RUNS]\n");
        return 2;
    }
    int runs = argc > 2 ? atoi(argv[2]) : 3;
    if (runs < 1 || runs > 50)
        runs = 3;
    double t[50];
    unsigned long long tensors = 0;
    unsigned shards = 0;
    for (int r = 0; r < runs; r++) {
        k3_st *st = NULL;
        k3_err e = {0};
        double a = now_s();
        if (k3_st_open(&st, argv[1], 0, &e)) {
            fprintf(stderr, "bench-synth_index: error: %s\n", e.msg);
            return 1;
        }
        t[r] = now_s() - a;
        tensors = k3_st_tensor_count(st);
        shards = k3_st_shard_count(st);
        k3_st_close(st);
    }
    qsort(t, (size_t)runs, sizeof *t, cmp_d);
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    printf("index: %llu tensors, %u shards, median %.3f s (min %.3f, max %.3f, %d runs), peak RSS %.1f MB\n",
           tensors, shards, t[runs / 2], t[0], t[runs - 1], runs, ru.ru_maxrss / 1024.0);
    return 0;
}
