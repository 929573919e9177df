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
