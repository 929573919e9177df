/*
 * alloc_guard.h - count heap allocations made while armed, by any thread:
 * the test binary interposes malloc, calloc, realloc, memalign, aligned_alloc,
 * posix_memalign, valloc and pvalloc (forwarding to the C library), or under AddressSanitizer
 * uses its allocation hook. Used to prove that a decode step never
 * allocates.
 */
#ifndef K3_ALLOC_GUARD_H
#define K3_ALLOC_GUARD_H

#include <stdint.h>

void k3t_alloc_arm(void);
/* Disarm; the number of allocations since k3t_alloc_arm. */
uint64_t k3t_alloc_disarm(void);
/* The bytes those allocations asked for (calloc: count x size; realloc: the
 * new size), valid after k3t_alloc_disarm. */
uint64_t k3t_alloc_bytes(void);

#endif
