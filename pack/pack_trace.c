/*
 * pack_trace.c - read the expert trace k3-run --ram --trace FILE writes
 * (engine/ws_stream.c): a '#' comment line, then one line per expert
 * request "FORWARD LAYER EXPERT H|M" (FORWARD: passes through layer 0 so
 * far, LAYER: the absolute layer index, H/M: hit or miss of the cache at the
 * request). k3-pack only counts requests per (layer, expert); hits and
 * misses count alike, since where a record lives matters for every request
 * a smaller cache would turn into a miss.
 *
 * The file is hostile input: every field is parsed with full consumption and
 * range checks, lines are bounded, and an error names the line.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "k3_man.h"
#include "pack.h"

#define TRACE_LINE_MAX 256

static int field_u64(const char **s, uint64_t max, uint64_t *out)
{
    const char *p = *s;
    while (*p == ' ' || *p == '\t')
        p++;
    if (*p < '0' || *p > '9')
        return -1;
    uint64_t v = 0;
    while (*p >= '0' && *p <= '9') {
        uint64_t d = (uint64_t)(*p - '0');
        if (v > (max - d) / 10)
            return -1;
        v = v * 10 + d;
        p++;
    }
    *s = p;
    *out = v;
    return 0;
}

int k3_pack_trace_read(const char *path, const k3_cfg *cfg, uint64_t *counts, uint64_t *nreq, k3_err *e)
{
    const uint32_t NE = cfg->num_experts, first = cfg->first_k_dense_replace, nl = cfg->num_hidden_layers;
    const uint32_t nmoe = k3_man_moe_layers(cfg);
    memset(counts, 0, (uint64_t)nmoe * NE * sizeof *counts);
    *nreq = 0;
    FILE *f = fopen(path, "r");
    if (!f)
        return k3_err_sys(e, K3_EIO, errno, "%s: cannot open the trace", path);
    char line[TRACE_LINE_MAX + 2];
    uint64_t lineno = 0;
    int rc = 0;
    while (fgets(line, sizeof line, f)) {
        lineno++;
        size_t n = strlen(line);
        if (n && line[n - 1] == '\n')
            line[--n] = 0;
        else if (!feof(f)) {
            rc = k3_err_set(e, K3_EFORMAT, "%s: line %llu is longer than %u bytes", path,
                            (unsigned long long)lineno, TRACE_LINE_MAX);
            break;
        }
        if (n && line[n - 1] == '\r')
            line[--n] = 0;
        if (n == 0 || line[0] == '#')
            continue;
        const char *p = line;
        uint64_t fw, layer, expert;
        if (field_u64(&p, UINT64_MAX, &fw) || field_u64(&p, UINT32_MAX, &layer) ||
            field_u64(&p, UINT32_MAX, &expert)) {
            rc = k3_err_set(e, K3_EFORMAT, "%s: line %llu: expected 'FORWARD LAYER EXPERT H|M'", path,
                            (unsigned long long)lineno);
            break;
        }
        while (*p == ' ' || *p == '\t')
            p++;
        if ((*p != 'H' && *p != 'M') || p[1] != 0) {
            rc = k3_err_set(e, K3_EFORMAT, "%s: line %llu: the fourth field must be H or M", path,
                            (unsigned long long)lineno);
            break;
        }
        if (layer < first || layer >= nl || expert >= NE) {
            rc = k3_err_set(e, K3_EFORMAT,
                            "%s: line %llu: layer %llu expert %llu is not a routed expert of this model (MoE "
                            "layers %u..%u, %u experts)",
                            path, (unsigned long long)lineno, (unsigned long long)layer,
                            (unsigned long long)expert, first, nl ? nl - 1 : 0, NE);
            break;
        }
        counts[(layer - first) * NE + expert]++;
        (*nreq)++;
    }
    if (!rc && ferror(f))
        rc = k3_err_sys(e, K3_EIO, errno, "%s: read error", path);
    fclose(f);
    return rc;
}
