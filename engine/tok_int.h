/*
 * tok_int.h - what the tokenizer's files share (engine/tok.c and tok_*.c) and what the
 * tests reach below the public API: UTF-8 decoding by Unicode Table 3-7, the
 * character classes, and the two rank-merge implementations.
 */
#ifndef K3_TOK_INT_H
#define K3_TOK_INT_H

#include <stdint.h>

#include "k3_tok.h"

/* Code point standing for a byte that is not part of well-formed UTF-8. */
#define K3_TOK_CP_INVALID 0xFFFFFFFFu

/* Decode the character at s[i] (i < n): returns its length (1..4) and sets *cp,
 * or returns 1 with *cp = K3_TOK_CP_INVALID for an ill-formed byte. */
unsigned k3_tok_utf8_next(const uint8_t *s, uint64_t n, uint64_t i, uint32_t *cp);

/* Class bits (K3_UC_* of k3_unicode_tables.h) of a code point; 0 for
 * K3_TOK_CP_INVALID, like U+FFFD. */
unsigned k3_tok_class(uint32_t cp);

/* Number of bytes at the end of s[0..n) that are a proper (incomplete) prefix
 * of a well-formed UTF-8 sequence: 0..3. */
unsigned k3_tok_utf8_incomplete_tail(const uint8_t *s, uint64_t n);

/* The rank of a byte string, or UINT32_MAX. */
uint32_t k3_tok_rank_of(const k3_tok *tok, const uint8_t *s, uint64_t len);

/* Merge one piece by rank and append its ids to out (room for len ids).
 * Returns the number of ids. The quadratic version is tiktoken's algorithm;
 * the heap version gives the same ids in O(len log len) for long pieces.
 * scratch must hold K3_TOK_SCRATCH(len) uint32_t. */
#define K3_TOK_SCRATCH(len) (8 * ((uint64_t)(len) + 1))
uint64_t k3_tok_bpe_quadratic(const k3_tok *tok, const uint8_t *p, uint64_t len,
                              uint32_t *out, uint32_t *scratch);
uint64_t k3_tok_bpe_heap(const k3_tok *tok, const uint8_t *p, uint64_t len, uint32_t *out,
                         uint32_t *scratch);

#endif
