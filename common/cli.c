/*
 * cli.c - command-line number parsing shared by the tools (see k3_cli.h).
 */
#include "k3_cli.h"

#include <errno.h>
#include <stdlib.h>

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
