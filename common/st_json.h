/*
 * st_json.h - a bounded JSON cursor for the safetensors reader (private to
 * common/st*.c).
 *
 * The safetensors header and the index are parsed against a fixed schema, so
 * they need no tree: the cursor walks the text once, checks every byte against
 * what remains, decodes strings (validating UTF-8 and escapes) and reads
 * integers exactly (no doubles: 2^53 is the bound, as in JSON interchange).
 * Generic values are only ever skipped, with an explicit depth bound, so no
 * input can recurse or allocate through it.
 *
 * Every error names the file, the absolute byte offset of the offending token
 * (base + position in the text) and, when known, the tensor.
 */
#ifndef K3_ST_JSON_H
#define K3_ST_JSON_H

#include <stddef.h>
#include <stdint.h>

#include "k3_err.h"

#define K3_JC_MAX_DEPTH 64
#define K3_JC_MAX_INT   (1ull << 53)

typedef struct k3_jc {
    const uint8_t *start;  /* the text */
    const uint8_t *p;      /* the cursor */
    const uint8_t *end;
    uint64_t base;         /* file offset of start, for messages */
    const char *file;      /* for messages */
    const char *tensor;    /* current tensor name for messages, or NULL */
    k3_err *e;
} k3_jc;

/* Record an error at the cursor position (or at pos if not NULL). */
int k3_jc_fail(k3_jc *j, const uint8_t *pos, int code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

void k3_jc_ws(k3_jc *j);
/* Skip whitespace then require byte c. what names the context for messages. */
int k3_jc_expect(k3_jc *j, char c, const char *what);
/* What kind of value starts at the cursor: "string", "object", ..., "end of header". */
const char *k3_jc_kind(const k3_jc *j);
/*
 * Decode a string at the cursor into out (capacity cap, including the NUL);
 * out may be NULL (validate only) or may alias the text at or before the
 * opening quote (decoding never writes ahead of the read position). *len gets
 * the decoded length. A longer string is K3_ELIMIT "longer than cap-1 bytes";
 * an embedded NUL (\u0000) is rejected when out != NULL.
 */
int k3_jc_string(k3_jc *j, char *out, size_t cap, size_t *len, const char *what);
/* A non-negative integer <= 2^53, no fraction or exponent. */
int k3_jc_uint(k3_jc *j, uint64_t *v, const char *what);
/* 1 if text[0..n) is valid UTF-8; else 0 and *bad is the offending offset. */
int k3_jc_utf8_valid(const uint8_t *text, size_t n, size_t *bad);
/* Skip any JSON value, at most K3_JC_MAX_DEPTH levels deep. */
int k3_jc_skip(k3_jc *j);

#endif
