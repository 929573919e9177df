/*
 * cli.c - command-line number parsing and the version line shared by the
 * tools (see k3_cli.h).
 */
#include "k3_cli.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>

#include "k3_crc.h"
#include "k3_kern.h"

int k3_cli_parse_u64(const char *s, uint64_t lo, uint64_t hi, uint64_t *out)
{
    if (!s || *s < '0' || *s > '9')
        return -1;
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || *end || v < lo || v > hi)
        return -1;
    *out = v;
    return 0;
}

void k3_cli_print_version(const char *tool)
{
    printf("%s %s (kernels: %s, crc32: %s)\n", tool, K3_VERSION, k3_kern_name(), k3_crc_name());
}

int k3_cli_parse_ids(const char *s, uint32_t max, uint32_t **ids, uint32_t *n)
{
    uint32_t cap = 16, k = 0;
    uint32_t *a = malloc(cap * sizeof *a);
    if (!a)
        return -1;
    const char *p = s;
    while (*p) {
        char *end;
        if (*p < '0' || *p > '9') {
            free(a);
            return -1;
        }
        errno = 0;
        unsigned long v = strtoul(p, &end, 10);
        if (errno || v > UINT32_MAX || (*end && *end != ',') || k == max) {
            free(a);
            return -1;
        }
        if (k == cap) {
            uint32_t *b = realloc(a, (cap *= 2) * sizeof *a);
            if (!b) {
                free(a);
                return -1;
            }
            a = b;
        }
        a[k++] = (uint32_t)v;
        p = *end ? end + 1 : end;
        if (*end == ',' && !*p) {
            free(a);
            return -1;
        }
    }
    if (k == 0) {
        free(a);
        return -1;
    }
    *ids = a;
    *n = k;
    return 0;
}
