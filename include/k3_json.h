/*
 * k3_json.h - JSON text that is always valid UTF-8, whatever the bytes.
 *
 * Paths, prompts and generated text are byte strings; JSON text must be
 * UTF-8. The rule, everywhere k3 writes JSON (every --json, manifest.json,
 * journals): well-formed UTF-8 is copied, '"', '\\' and control characters
 * are escaped, and each byte that is not part of a well-formed UTF-8
 * sequence (Unicode Table 3-7) becomes U+FFFD. A path that is not UTF-8 is
 * therefore recorded recognisably but not exactly; k3 never reads a path
 * back from JSON, so nothing depends on the exact bytes.
 */
#ifndef K3_JSON_H
#define K3_JSON_H

#include <stdint.h>
#include <stdio.h>

/* Length of the well-formed UTF-8 sequence at s (n bytes left), 0 if the
 * bytes there are not one. */
int k3_utf8_len(const unsigned char *s, uint64_t n);

/* 1 if s[0..n) is well-formed UTF-8. */
int k3_utf8_valid(const char *s, uint64_t n);

/* Write s[0..n) to f as a quoted JSON string (the rule above). */
void k3_json_fput_str(FILE *f, const char *s, uint64_t n);

/* A heap copy of the NUL-terminated s with each ill-formed byte replaced by
 * U+FFFD (for cJSON, which escapes the rest). NULL if out of memory; the
 * caller frees. */
char *k3_json_utf8_dup(const char *s);

#endif
