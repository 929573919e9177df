/*
 * tok_check.h - the tokenizer's promises, checked by fz_tok.c and
 * fz_tok_text.c on every text they encode (private to fuzz/).
 */
#ifndef K3_FUZZ_TOK_CHECK_H
#define K3_FUZZ_TOK_CHECK_H

#include <stddef.h>
#include <stdint.h>

#include "k3_tok.h"

/* Encode text with and without specials; check that every id is in the
 * vocabulary, that decode(encode(text)) == text, that the streaming decoder
 * gives the same bytes, and that the pre-tokenizer's pieces advance and tile
 * the text. Aborts on a breach. */
void k3_fuzz_tok_check_text(const k3_tok *tok, const uint8_t *text, size_t len);

#endif
