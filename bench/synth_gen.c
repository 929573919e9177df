/*
 * synth_gen.c - bench-synth_gen: how fast k3-synth's generator fills memory
 * (no disk), per kind of tensor at K3 width, per second of one core's CPU
 * time (so a loaded machine does not skew it); the figure to set
 * against the disk's write speed (generation must not be the bottleneck).
 * Prints GB/s per kind and a memset of the same buffer as the ceiling.
 */
#include "../synth/synth.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);   /* CPU time: robust to a loaded machine */
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

int main(void)
{
    k3_synth_opts o;
    memset(&o, 0, sizeof o);
    k3_err e = {0};
    if (k3_synth_preset(&o, "k3-width", 2, 0, &e))
        return 1;
    k3_synth_tensor *t = NULL;
    uint64_t n = 0;
    if (k3_synth_tensors(&o, &t, &n, &e))
        return 1;
    const uint64_t chunk = 16u << 20;
    unsigned char *buf = malloc(chunk);
    memset(buf, 1, chunk);
    int kinds[] = {SK_EXP_W1_P, SK_EXP_W1_S, K3_W_MOE_ROUTER, K3_W_MOE_BIAS};
    const char *names[] = {"MXFP4 packed (U8)", "MXFP4 scales (U8)", "BF16 matrix", "F32 vector"};
    for (int k = 0; k < 4; k++) {
        const k3_synth_tensor *x = NULL;
        for (uint64_t i = 0; i < n && !x; i++)
            if (t[i].kind == kinds[k])
                x = &t[i];
        uint64_t done = 0, len = x->bytes < chunk ? x->bytes : chunk;
        double a = now_s();
        while (now_s() - a < 1.0) {
            for (uint64_t off = 0; off + len <= x->bytes && off < 64 * chunk; off += len)
                k3_synth_fill(&o, x, off, len, buf), done += len;
        }
        double s = now_s() - a;
        printf("%-20s %6.2f GB/s (1 thread)\n", names[k], (double)done / s / 1e9);
    }
    double a = now_s();
    uint64_t done = 0;
    while (now_s() - a < 0.5) {
        memset(buf, (int)done, chunk);
        done += chunk;
    }
    printf("%-20s %6.2f GB/s (ceiling)\n", "memset", (double)done / (now_s() - a) / 1e9);
    free(buf);
    free(t);
    return 0;
}
