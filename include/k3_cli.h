/*
 * k3_cli.h - command-line number parsing shared by the tools: whole-string
 * decimal, digits only (no sign, no space), range-checked. No atoi. And the
 * one version line every tool prints.
 */
#ifndef K3_CLI_H
#define K3_CLI_H

#include <stdint.h>

/* Parse s as a decimal integer in [lo, hi] into *out. Returns 0, or -1 (and
 * leaves *out alone) for anything else: empty, a sign, a space, a trailing
 * character, overflow or out of range. */
int k3_cli_parse_u64(const char *s, uint64_t lo, uint64_t hi, uint64_t *out);

/* A list of token ids as k3-run --ids takes it: "1,2,3" - one or more
 * decimal ids, each at most 2^32-1, separated by single commas, nothing else,
 * at most max of them. 0 and a heap array (caller frees) in *ids, or -1. */
#define K3_CLI_MAX_IDS (1u << 24)
int k3_cli_parse_ids(const char *s, uint32_t max, uint32_t **ids, uint32_t *n);

/* The release every tool reports. */
#define K3_VERSION "0.1.0"

/* Print "<tool> <K3_VERSION> (kernels: <path>, crc32: <path>)" and a newline
 * to stdout: what --version of every tool says, naming the kernel and CRC
 * paths chosen for this CPU (or forced by K3_ISA / K3_CRC). */
void k3_cli_print_version(const char *tool);

#endif
