/*
 * k3_tok.h - the k3 tokenizer: byte-level BPE in the tiktoken format (docs/MODEL.md §5).
 *
 * Files (both read whole, both treated as hostile):
 *   tiktoken.model         one line per token, "base64(bytes) SP rank LF"; line i
 *                          (from 0) must have rank i: no gaps, no disorder, no
 *                          duplicate byte strings, every single byte present.
 *   tokenizer_config.json  "added_tokens_decoder": {"<id>": {"content": "..."}}
 *                          gives the special tokens; their ids come after the
 *                          ranks (>= number of ranks; gaps allowed, a gap id
 *                          decodes to an error). "eos_token" / "bos_token" may be
 *                          a string or {"content": "..."}.
 *
 * Encoding: text is split by the pre-tokenization pattern of docs/MODEL.md §5 (a hand
 * written matcher with regex leftmost-first semantics), then each piece is
 * merged by rank (the adjacent pair whose concatenation has the lowest rank,
 * leftmost on ties) exactly as tiktoken does.
 *
 * Invalid UTF-8 (k3's rule, documented in runtime/TOKENIZER.md): each byte that
 * is not part of a well-formed UTF-8 sequence (Unicode Table 3-7: no overlongs,
 * no surrogates, nothing above U+10FFFF, no truncated sequence) is one character
 * of its own that is neither letter, number nor space - the class U+FFFD has -
 * and its raw byte is kept and encoded by byte-level BPE. So the split of such
 * text is the split of the same text with every invalid byte replaced by U+FFFD,
 * ids are tiktoken's on valid UTF-8, and decode(encode(x)) == x for all bytes x.
 *
 * Limits: tiktoken.model <= 64 MiB, <= 16,777,216 ranks, token <= 2048 bytes;
 * tokenizer_config.json <= 16 MiB, <= 65,536 specials, special <= 1024 bytes,
 * all specials together <= 1 MiB.
 *
 * Thread safety: a k3_tok is read-only after open and may be shared by threads
 * that each use their own outputs; a k3_tok_stream belongs to one thread.
 */
#ifndef K3_TOK_H
#define K3_TOK_H

#include <stdint.h>

#include "k3_err.h"

typedef struct k3_tok k3_tok;
typedef struct k3_tok_stream k3_tok_stream;

#define K3_TOK_MODEL_MAX_BYTES   (64ull << 20)
#define K3_TOK_MAX_RANKS         (1u << 24)
#define K3_TOK_MAX_TOKEN_BYTES   2048u
#define K3_TOK_CONFIG_MAX_BYTES  (16ull << 20)
#define K3_TOK_MAX_SPECIALS      65536u
#define K3_TOK_MAX_SPECIAL_BYTES 1024u
#define K3_TOK_MAX_SPECIAL_TOTAL (1u << 20) /* all specials' contents together */
#define K3_TOK_MAX_EOS           4u

/* Open the tokenizer in directory dir (tiktoken.model + tokenizer_config.json).
 * On success *out is a handle to close with k3_tok_close. Errors name the file
 * and line (K3_ENOENT missing file, K3_EFORMAT bad content, K3_ELIMIT over a
 * bound above, K3_ENOMEM, K3_EIO). */
int k3_tok_open(k3_tok **out, const char *dir, k3_err *e);

/* k3_tok_open, each file's bytes compared as read (before parsing) with the
 * SHA-256 given (NULL: that file is not compared), e.g. the ones a packed
 * model's manifest records: a mismatch is K3_ECORRUPT naming the file. */
int k3_tok_open_checked(k3_tok **out, const char *dir, const uint8_t *model_sha256,
                        const uint8_t *config_sha256, k3_err *e);

/* Same with explicit paths; config_path may be NULL (no specials, no eos). */
int k3_tok_open_files(k3_tok **out, const char *model_path, const char *config_path,
                      k3_err *e);

/* Free everything. Accepts NULL. */
void k3_tok_close(k3_tok *tok);

/* Number of ids: max(number of ranks, largest special id + 1). */
uint32_t k3_tok_vocab_size(const k3_tok *tok);

/* Number of BPE ranks (ids below it are ordinary tokens). */
uint32_t k3_tok_rank_count(const k3_tok *tok);

/* Flags of k3_tok_encode. */
#define K3_TOK_ALLOW_SPECIAL 1u /* special-token contents in the text become their ids */
#define K3_TOK_KIMI_SLICES   2u /* slice the text as Kimi's Python tokenizer wrapper does
                                 * before calling tiktoken: windows of 400,000 characters,
                                 * and runs of more than 25,000 characters that are all
                                 * str.isspace() or all not are cut every 25,000; each
                                 * slice is encoded on its own (runtime/TOKENIZER.md) */

/* Encode len bytes of text (any bytes; see invalid UTF-8 above). flags is 0
 * (plain tiktoken encode_ordinary) or a combination of K3_TOK_*; passing 1
 * means K3_TOK_ALLOW_SPECIAL: occurrences of special-token contents become
 * their ids (the earliest occurrence first, the longest special at that
 * position); without it they are ordinary text. *ids is a heap array of *n
 * ids the caller frees (non-NULL even when *n == 0). Working memory: 4 bytes
 * per id plus 32 bytes per byte of the longest piece that is not itself a
 * token. */
int k3_tok_encode(const k3_tok *tok, const char *text, uint64_t len, unsigned flags,
                  uint32_t **ids, uint64_t *n, k3_err *e);

/* Decode n ids into the exact bytes they stand for. *out is a heap buffer the
 * caller frees, NUL-terminated for convenience (not counted in *len). An id
 * outside the vocabulary (or a gap among special ids) is K3_EARG. */
int k3_tok_decode(const k3_tok *tok, const uint32_t *ids, uint64_t n, char **out,
                  uint64_t *len, k3_err *e);

/* Bytes of one token (borrowed, valid until k3_tok_close), or NULL if id is
 * not a token. *len receives the length. */
const uint8_t *k3_tok_token_bytes(const k3_tok *tok, uint32_t id, uint64_t *len);

/* 1 if id is a special token, else 0. */
int k3_tok_is_special(const k3_tok *tok, uint32_t id);

/* Id of the special whose content is exactly s (len bytes), or -1. */
int64_t k3_tok_special_id(const k3_tok *tok, const char *s, uint64_t len);

/* The ids that end generation: eos_token from the config, then "<|end_of_msg|>"
 * and "<|im_end|>" when they are specials distinct from it (chat models end a
 * turn with them). Borrowed
 * array of *n (0..K3_TOK_MAX_EOS) ids. */
void k3_tok_eos_ids(const k3_tok *tok, const uint32_t **ids, uint32_t *n);

/* bos_token's id, or -1 if the config names none. */
int64_t k3_tok_bos_id(const k3_tok *tok);

/* Pre-tokenization alone (for tests and tools): the end offset of the piece
 * that starts at byte offset pos of text (pos < len). Never returns <= pos. */
uint64_t k3_tok_split_next(const char *text, uint64_t len, uint64_t pos);

/*
 * Streaming decoder: turns ids into bytes as they are generated, holding back
 * an incomplete UTF-8 sequence at the end until the bytes that complete it
 * arrive, so that each output chunk ends on a character boundary. Bytes that
 * can no longer become a valid character are emitted verbatim at once; flush
 * emits whatever is still held, verbatim. The concatenation of all outputs is
 * exactly k3_tok_decode of all ids. The stream allocates only at create.
 */

/* Create a stream for tok (which must outlive it). */
int k3_tok_stream_create(k3_tok_stream **out, const k3_tok *tok, k3_err *e);

/* Push one id. *bytes and *len receive the bytes now complete (borrowed, valid
 * until the next call on s; *len may be 0). Unknown id: K3_EARG, s unchanged. */
int k3_tok_stream_push(k3_tok_stream *s, uint32_t id, const char **bytes, uint64_t *len,
                       k3_err *e);

/* Emit the held-back bytes (0..3), verbatim, and reset s for a new text. */
void k3_tok_stream_flush(k3_tok_stream *s, const char **bytes, uint64_t *len);

/* Free. Accepts NULL. */
void k3_tok_stream_free(k3_tok_stream *s);

#endif
