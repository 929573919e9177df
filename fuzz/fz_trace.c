/*
 * fz_trace.c - the expert trace k3-run --trace writes and k3-pack
 * --expert-order reads (k3_pack_trace_read).
 *
 * Input: the trace text, read against a fixed small model (4 layers, the
 * first dense, 8 experts). An accepted trace must count every request once,
 * inside the model's MoE layers: the counts add up to the request total.
 */
#include "k3_fuzz.h"

#include <string.h>

#include "k3_cfg.h"
#include "k3_man.h"
#include "../pack/pack.h"

K3_FUZZ_TARGET(trace)
{
    static k3_cfg cfg;
    cfg.num_hidden_layers = 4;
    cfg.first_k_dense_replace = 1;
    cfg.num_experts = 8;
    const uint32_t nmoe = k3_man_moe_layers(&cfg);
    uint64_t counts[3 * 8];
    if (nmoe * cfg.num_experts != sizeof counts / sizeof counts[0])
        k3_fuzz_fail("harness: %u MoE layers", nmoe);

    char path[4096];
    k3_fuzz_write("trace.txt", data, size, path, sizeof path);
    k3_err e = {0};
    uint64_t nreq = 0;
    int rc = k3_pack_trace_read(path, &cfg, counts, &nreq, &e);
    k3_fuzz_check_result(rc, &e, "k3_pack_trace_read");
    if (rc == 0) {
        uint64_t sum = 0;
        for (size_t i = 0; i < sizeof counts / sizeof counts[0]; i++)
            sum += counts[i];
        if (sum != nreq)
            k3_fuzz_fail("trace counts add up to %llu, requests %llu", (unsigned long long)sum,
                         (unsigned long long)nreq);
    }
    k3_fuzz_unlink("trace.txt");
    return 0;
}
