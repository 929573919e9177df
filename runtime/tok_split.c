/*
 * tok_split.c - pre-tokenization: the pattern of docs/MODEL.md §5, matched by
 * hand with the semantics of a backtracking regex engine (alternatives tried
 * in order, the first that matches at a position wins; greedy quantifiers
 * give back characters only as far as the rest of their alternative needs):
 *
 *   1 [\p{Han}]+
 *   2 [^\r\n\p{L}\p{N}]?C1*C2+(?i:'s|'t|'re|'ve|'m|'ll|'d)?
 *   3 [^\r\n\p{L}\p{N}]?C1+C2*(?i:'s|'t|'re|'ve|'m|'ll|'d)?
 *   4 \p{N}{1,3}
 *   5  ?[^\s\p{L}\p{N}]+[\r\n]*
 *   6 \s*[\r\n]+
 *   7 \s+(?!\S)
 *   8 \s+
 *
 * with C1 = [\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}] minus Han and C2 =
 * [\p{Ll}\p{Lm}\p{Lo}\p{M}] minus Han. Every character starts some
 * alternative and none matches empty, so the pieces tile the text. A byte
 * that is not well-formed UTF-8 is one character with no class (as U+FFFD).
 */
#include <string.h>

#include "k3_unicode_tables.h"
#include "tok_int.h"

static inline unsigned utf8_next(const uint8_t *s, uint64_t n, uint64_t i, uint32_t *cp)
{
    uint8_t b = s[i];
    if (b < 0x80) {
        *cp = b;
        return 1;
    }
    unsigned need;
    uint32_t c;
    uint8_t lo = 0x80, hi = 0xBF; /* allowed range of the second byte */
    if (b >= 0xC2 && b <= 0xDF) {
        need = 2;
        c = b & 0x1Fu;
    } else if (b >= 0xE0 && b <= 0xEF) {
        need = 3;
        c = b & 0x0Fu;
        if (b == 0xE0)
            lo = 0xA0; /* no overlongs */
        if (b == 0xED)
            hi = 0x9F; /* no surrogates */
    } else if (b >= 0xF0 && b <= 0xF4) {
        need = 4;
        c = b & 0x07u;
        if (b == 0xF0)
            lo = 0x90;
        if (b == 0xF4)
            hi = 0x8F; /* nothing above U+10FFFF */
    } else {
        *cp = K3_TOK_CP_INVALID;
        return 1;
    }
    if (n - i < need || s[i + 1] < lo || s[i + 1] > hi) {
        *cp = K3_TOK_CP_INVALID;
        return 1;
    }
    c = (c << 6) | (s[i + 1] & 0x3Fu);
    for (unsigned k = 2; k < need; k++) {
        if ((s[i + k] & 0xC0) != 0x80) {
            *cp = K3_TOK_CP_INVALID;
            return 1;
        }
        c = (c << 6) | (s[i + k] & 0x3Fu);
    }
    *cp = c;
    return need;
}

unsigned k3_tok_utf8_next(const uint8_t *s, uint64_t n, uint64_t i, uint32_t *cp)
{
    return utf8_next(s, n, i, cp);
}

unsigned k3_tok_utf8_incomplete_tail(const uint8_t *s, uint64_t n)
{
    for (uint64_t back = 1; back <= 3 && back <= n; back++) {
        uint8_t b = s[n - back];
        if ((b & 0xC0) == 0x80)
            continue; /* a continuation byte: its lead is further back */
        unsigned need = b >= 0xC2 && b <= 0xDF ? 2 : b >= 0xE0 && b <= 0xEF ? 3
                      : b >= 0xF0 && b <= 0xF4 ? 4 : 0;
        if (need == 0 || back >= need)
            return 0; /* not a lead byte, or its sequence is already complete */
        if (back >= 2) {
            uint8_t lo = b == 0xE0 ? 0xA0 : b == 0xF0 ? 0x90 : 0x80;
            uint8_t hi = b == 0xED ? 0x9F : b == 0xF4 ? 0x8F : 0xBF;
            if (s[n - back + 1] < lo || s[n - back + 1] > hi)
                return 0; /* can never complete: emit verbatim now */
        }
        return (unsigned)back;
    }
    return 0;
}

static inline unsigned uclass(uint32_t cp)
{
    if (cp >= 0x110000u)
        return 0;
    return k3_uc_stage2[(uint32_t)k3_uc_stage1[cp >> 8] * 256u + (cp & 0xFFu)];
}

unsigned k3_tok_class(uint32_t cp)
{
    return uclass(cp);
}

struct ch {
    uint32_t cp;
    unsigned cls;
    unsigned len; /* 0 at the end of the text */
};

static inline void at(const uint8_t *s, uint64_t n, uint64_t i, struct ch *c)
{
    if (i >= n) {
        c->cp = K3_TOK_CP_INVALID;
        c->cls = 0;
        c->len = 0;
        return;
    }
    if (s[i] < 0x80) { /* ASCII: block 0 of the table, no decoding */
        c->cp = s[i];
        c->cls = k3_uc_stage2[(uint32_t)k3_uc_stage1[0] * 256u + s[i]];
        c->len = 1;
        return;
    }
    c->len = utf8_next(s, n, i, &c->cp);
    c->cls = uclass(c->cp);
}

#define IS_L(c)  ((c)->cls & (K3_UC_LU | K3_UC_LL | K3_UC_LMO))
#define IS_N(c)  ((c)->cls & K3_UC_N)
#define IS_WS(c) ((c)->cls & K3_UC_WS)
#define IS_C1(c) (((c)->cls & (K3_UC_LU | K3_UC_LMO | K3_UC_M)) && !((c)->cls & K3_UC_HAN))
#define IS_C2(c) (((c)->cls & (K3_UC_LL | K3_UC_LMO | K3_UC_M)) && !((c)->cls & K3_UC_HAN))
/* [^\r\n\p{L}\p{N}] */
#define IS_PRE(c) ((c)->len && (c)->cp != '\r' && (c)->cp != '\n' && !IS_L(c) && !IS_N(c))
/* [^\s\p{L}\p{N}] */
#define IS_PUNCT(c) ((c)->len && !IS_WS(c) && !IS_L(c) && !IS_N(c))
#define IS_CRLF(c) ((c)->cp == '\r' || (c)->cp == '\n')

/* Simple case folding onto the contraction letters: ASCII, plus the few
 * non-ASCII code points the Unicode tables fold onto them (U+017F -> s). */
static char fold(const struct ch *c)
{
    if (!c->len)
        return 0;
    if (c->cp < 0x80) {
        char a = (char)c->cp;
        return a >= 'A' && a <= 'Z' ? (char)(a - 'A' + 'a') : a;
    }
    for (unsigned k = 0; k < K3_UC_NFOLD; k++)
        if (k3_uc_fold[k].cp == c->cp)
            return k3_uc_fold[k].ascii;
    return 0;
}

/* (?i:'s|'t|'re|'ve|'m|'ll|'d)? at q: the end of what it matches. */
static uint64_t contraction(const uint8_t *s, uint64_t n, uint64_t q)
{
    struct ch c, d;
    at(s, n, q, &c);
    if (c.cp != '\'')
        return q;
    at(s, n, q + 1, &c);
    char f = fold(&c);
    uint64_t after = q + 1 + c.len;
    if (f == 's' || f == 't' || f == 'm' || f == 'd')
        return after;
    if (f == 'r' || f == 'v' || f == 'l') {
        at(s, n, after, &d);
        char g = fold(&d);
        if ((f == 'l' && g == 'l') || (f != 'l' && g == 'e'))
            return after + d.len;
    }
    return q;
}

/* Alternatives 2 (alt2 = 1) and 3 (alt2 = 0): the end of the match, or pos. */
static uint64_t letters(const uint8_t *s, uint64_t n, uint64_t pos, int alt2)
{
    struct ch c0, c;
    at(s, n, pos, &c0);
    for (int take = 1; take >= 0; take--) {
        uint64_t q = pos;
        if (take) {
            if (!IS_PRE(&c0))
                continue;
            q += c0.len;
        }
        if (alt2) {
            /* C1* gives back until C2+ can start: the last start position
             * (largest C1 count) whose character is in C2 */
            uint64_t start = UINT64_MAX;
            for (;;) {
                at(s, n, q, &c);
                if (!IS_C1(&c))
                    break;
                if (IS_C2(&c))
                    start = q;
                q += c.len;
            }
            if (IS_C2(&c))
                start = q;
            if (start == UINT64_MAX)
                continue;
            q = start;
            for (;;) {
                at(s, n, q, &c);
                if (!IS_C2(&c))
                    break;
                q += c.len;
            }
            return contraction(s, n, q);
        }
        at(s, n, q, &c);
        if (!IS_C1(&c))
            continue;
        while (IS_C1(&c)) {
            q += c.len;
            at(s, n, q, &c);
        }
        while (IS_C2(&c)) {
            q += c.len;
            at(s, n, q, &c);
        }
        return contraction(s, n, q);
    }
    return pos;
}

uint64_t k3_tok_split_next(const char *text, uint64_t n, uint64_t pos)
{
    const uint8_t *s = (const uint8_t *)text;
    struct ch c0, c;
    uint64_t q, r;
    at(s, n, pos, &c0);
    if (!c0.len)
        return pos + 1; /* misuse (pos >= n): still make progress */

    if (c0.cls & K3_UC_HAN) { /* 1 */
        q = pos;
        for (;;) {
            at(s, n, q, &c);
            if (!(c.cls & K3_UC_HAN))
                return q;
            q += c.len;
        }
    }
    if ((r = letters(s, n, pos, 1)) != pos) /* 2 */
        return r;
    if ((r = letters(s, n, pos, 0)) != pos) /* 3 */
        return r;
    if (IS_N(&c0)) { /* 4 */
        q = pos;
        for (int k = 0; k < 3; k++) {
            at(s, n, q, &c);
            if (!IS_N(&c))
                break;
            q += c.len;
        }
        return q;
    }
    q = pos; /* 5 */
    if (c0.cp == ' ') {
        at(s, n, pos + 1, &c);
        if (IS_PUNCT(&c))
            q = pos + 1;
    }
    at(s, n, q, &c);
    if (IS_PUNCT(&c)) {
        while (IS_PUNCT(&c)) {
            q += c.len;
            at(s, n, q, &c);
        }
        while (IS_CRLF(&c)) {
            q += c.len;
            at(s, n, q, &c);
        }
        return q;
    }
    if (IS_WS(&c0)) {
        /* one pass over the whitespace run serves 6, 7 and 8 */
        uint64_t last_crlf_end = 0, last_start = pos, nchars = 0;
        q = pos;
        for (;;) {
            at(s, n, q, &c);
            if (!IS_WS(&c))
                break;
            last_start = q;
            nchars++;
            q += c.len;
            if (IS_CRLF(&c))
                last_crlf_end = q;
        }
        if (last_crlf_end) /* 6: \s* gives back to the last [\r\n] */
            return last_crlf_end;
        if (q == n) /* 7: (?!\S) holds at the end of the text */
            return q;
        if (nchars >= 2) /* 7: give back one space, which is not \S */
            return last_start;
        return q; /* 8 */
    }
    return pos + c0.len; /* unreachable: every character is covered above */
}
