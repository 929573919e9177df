/*
 * fz_ids.c - k3-run's --ids argument ("1,2,3"), parsed by k3_cli_parse_ids
 * (common/cli.c). Input: the argument's bytes up to the first NUL (argv
 * strings cannot hold one).
 * Oracle: an independent reading of the grammar the help text documents -
 * one or more decimal ids, each at most 2^32-1, separated by single commas,
 * nothing else, at most MAX_IDS of them - must agree with k3_cli_parse_ids on
 * accept/reject and on every value.
 */
#include "k3_fuzz.h"

#include <stdlib.h>
#include <string.h>

#include "k3_cli.h"

#define MAX_IDS K3_CLI_MAX_IDS

/* The grammar, written out: returns the number of ids, or -1. */
static int64_t reference_parse(const char *s, uint32_t *out, uint64_t cap)
{
    uint64_t n = 0;
    const char *p = s;
    for (;;) {
        if (*p < '0' || *p > '9')
            return -1;
        uint64_t v = 0;
        while (*p >= '0' && *p <= '9') {
            v = v * 10 + (uint64_t)(*p++ - '0');
            if (v > UINT32_MAX)
                return -1;
        }
        if (n == MAX_IDS)
            return -1;
        if (n < cap)
            out[n] = (uint32_t)v;
        n++;
        if (*p == '\0')
            return (int64_t)n;
        if (*p != ',')
            return -1;
        p++;
    }
}

K3_FUZZ_TARGET(ids)
{
    char *s = malloc(size + 1);
    uint32_t *want = malloc((size / 2 + 1) * sizeof *want);
    if (!s || !want)
        k3_fuzz_fail("out of memory in the harness");
    memcpy(s, data, size);
    s[size] = '\0';
    int64_t n_want = reference_parse(s, want, size / 2 + 1);
    uint32_t *ids = NULL, n = 0;
    int rc = k3_cli_parse_ids(s, MAX_IDS, &ids, &n);
    if ((rc == 0) != (n_want >= 0))
        k3_fuzz_fail("parse_ids %s \"%.80s\", the grammar %s it", rc == 0 ? "accepts" : "rejects", s,
                     n_want >= 0 ? "accepts" : "rejects");
    if (rc == 0) {
        if ((int64_t)n != n_want)
            k3_fuzz_fail("parse_ids read %u ids, the grammar %lld", n, (long long)n_want);
        for (uint32_t i = 0; i < n; i++)
            if (ids[i] != want[i])
                k3_fuzz_fail("id %u: parse_ids %u, the grammar %u", i, ids[i], want[i]);
        free(ids);
    }
    free(s);
    free(want);
    return 0;
}
