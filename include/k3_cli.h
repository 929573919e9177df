/*
 * k3_cli.h - command-line number parsing shared by the tools: whole-string
 * decimal, digits only (no sign, no space), range-checked. No atoi.
 */
#ifndef K3_CLI_H
#define K3_CLI_H

#include <stdint.h>

/* Parse s as a decimal integer in [lo, hi] into *out. Returns 0, or -1 (and
 * leaves *out alone) for anything else: empty, a sign, a space, a trailing
 * character, overflow or out of range. */
int k3_cli_parse_u64(const char *s, uint64_t lo, uint64_t hi, uint64_t *out);

#endif
