/*
 * st_json.c - the bounded JSON cursor of st_json.h.
 *
 * Invariants: the cursor never reads at or past end; a string is decoded with
 * the write position never ahead of the read position (so in-place decoding
 * is safe); skipping nests at most K3_JC_MAX_DEPTH levels with a fixed stack.
 */
#include "st_json.h"

#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

int k3_jc_fail(k3_jc *j, const uint8_t *pos, int code, const char *fmt, ...)
{
    char what[640];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    if (!pos)
        pos = j->p;
    uint64_t off = j->base + (uint64_t)(pos - j->start);
    if (j->tensor)
        return k3_err_set(j->e, code, "%s: byte %" PRIu64 ": tensor \"%.200s\": %s", j->file, off, j->tensor, what);
    return k3_err_set(j->e, code, "%s: byte %" PRIu64 ": %s", j->file, off, what);
}

void k3_jc_ws(k3_jc *j)
{
    while (j->p < j->end && (*j->p == ' ' || *j->p == '\t' || *j->p == '\n' || *j->p == '\r'))
        j->p++;
}

const char *k3_jc_kind(const k3_jc *j)
{
    if (j->p >= j->end)
        return "end of text";
    switch (*j->p) {
    case '"': return "a string";
    case '{': return "an object";
    case '[': return "an array";
    case 't': case 'f': return "a boolean";
    case 'n': return "null";
    case '-': case '0': case '1': case '2': case '3': case '4':
    case '5': case '6': case '7': case '8': case '9': return "a number";
    default: return *j->p >= 0x80 ? "a non-ASCII byte" : "invalid JSON";
    }
}

int k3_jc_expect(k3_jc *j, char c, const char *what)
{
    k3_jc_ws(j);
    if (j->p >= j->end)
        return k3_jc_fail(j, NULL, K3_EFORMAT, "invalid JSON: text ends where '%c' was expected %s", c, what);
    if (*j->p != (uint8_t)c)
        return k3_jc_fail(j, NULL, K3_EFORMAT, "invalid JSON: expected '%c' %s, found %s", c, what, k3_jc_kind(j));
    j->p++;
    return 0;
}

static int hexval(uint8_t c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

/* Four hex digits at p (p+4 <= end checked by caller). */
static int hex4(const uint8_t *p)
{
    int v = 0;
    for (int i = 0; i < 4; i++) {
        int h = hexval(p[i]);
        if (h < 0)
            return -1;
        v = v * 16 + h;
    }
    return v;
}

/* Length of a valid UTF-8 sequence at p (< end), 0 if invalid (overlong,
 * surrogate, > U+10FFFF, truncated, bad continuation). */
static int utf8_len(const uint8_t *p, const uint8_t *end)
{
    uint8_t c = p[0];
    int n;
    uint32_t cp;
    if (c < 0x80)
        return 1;
    if (c >= 0xC2 && c <= 0xDF) {
        n = 2;
        cp = c & 0x1F;
    } else if (c >= 0xE0 && c <= 0xEF) {
        n = 3;
        cp = c & 0x0F;
    } else if (c >= 0xF0 && c <= 0xF4) {
        n = 4;
        cp = c & 0x07;
    } else {
        return 0;
    }
    if (end - p < n)
        return 0;
    for (int i = 1; i < n; i++) {
        if ((p[i] & 0xC0) != 0x80)
            return 0;
        cp = cp << 6 | (p[i] & 0x3F);
    }
    if ((n == 3 && cp < 0x800) || (n == 4 && cp < 0x10000) || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))
        return 0;
    return n;
}

int k3_jc_utf8_valid(const uint8_t *text, size_t n, size_t *bad)
{
    const uint8_t *p = text, *end = text + n;
    while (p < end) {
        if (*p < 0x80) {
            p++;
            continue;
        }
        int k = utf8_len(p, end);
        if (!k) {
            *bad = (size_t)(p - text);
            return 0;
        }
        p += k;
    }
    return 1;
}

static size_t put_utf8(uint8_t *o, uint32_t cp)
{
    if (cp < 0x80) {
        o[0] = (uint8_t)cp;
        return 1;
    }
    if (cp < 0x800) {
        o[0] = (uint8_t)(0xC0 | cp >> 6);
        o[1] = (uint8_t)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        o[0] = (uint8_t)(0xE0 | cp >> 12);
        o[1] = (uint8_t)(0x80 | (cp >> 6 & 0x3F));
        o[2] = (uint8_t)(0x80 | (cp & 0x3F));
        return 3;
    }
    o[0] = (uint8_t)(0xF0 | cp >> 18);
    o[1] = (uint8_t)(0x80 | (cp >> 12 & 0x3F));
    o[2] = (uint8_t)(0x80 | (cp >> 6 & 0x3F));
    o[3] = (uint8_t)(0x80 | (cp & 0x3F));
    return 4;
}

#define ONES 0x0101010101010101ull
#define HIGHS 0x8080808080808080ull

/* Nonzero if one of the 8 bytes of x (any order) is a quote, a backslash, a
 * control byte (< 0x20) or non-ASCII (>= 0x80): the bytes that end a plain
 * run of a JSON string. Exact (no false negatives, and no false positives
 * for the "any" question). */
static inline uint64_t special8(uint64_t x)
{
    uint64_t q = x ^ (ONES * '"'), b = x ^ (ONES * '\\');
    uint64_t zero_q = (q - ONES) & ~q;
    uint64_t zero_b = (b - ONES) & ~b;
    uint64_t below = (x - ONES * 0x20) & ~x;
    return (zero_q | zero_b | below | x) & HIGHS;
}

int k3_jc_string(k3_jc *j, char *out, size_t cap, size_t *len, const char *what)
{
    k3_jc_ws(j);
    if (j->p >= j->end || *j->p != '"')
        return k3_jc_fail(j, NULL, K3_EFORMAT, "%s must be a string, found %s", what, k3_jc_kind(j));
    const uint8_t *open = j->p;
    const uint8_t *p = j->p + 1;
    uint8_t *o = (uint8_t *)out;
    size_t n = 0;
    for (;;) {
        /* the common case: a run of plain printable ASCII, copied at once;
         * found eight bytes at a time */
        const uint8_t *run = p;
        while (j->end - p >= 8) {
            uint64_t x;
            memcpy(&x, p, 8);
            if (special8(x))
                break;
            p += 8;
        }
        while (p < j->end && *p >= 0x20 && *p < 0x80 && *p != '"' && *p != '\\')
            p++;
        if (p > run) {
            size_t k = (size_t)(p - run);
            if (out) {
                if (n + k >= cap)
                    return k3_jc_fail(j, open, K3_ELIMIT, "%s is longer than %zu bytes", what, cap - 1);
                memmove(o + n, run, k);
            }
            n += k;
        }
        if (p >= j->end)
            return k3_jc_fail(j, open, K3_EFORMAT, "invalid JSON: unterminated string (%s)", what);
        uint8_t c = *p;
        uint8_t tmp[4];
        size_t k;
        if (c == '"') {
            p++;
            break;
        }
        if (c < 0x20)
            return k3_jc_fail(j, p, K3_EFORMAT, "invalid JSON: control byte 0x%02x inside a string (%s)", c, what);
        if (c == '\\') {
            if (p + 1 >= j->end)
                return k3_jc_fail(j, p, K3_EFORMAT, "invalid JSON: unterminated escape (%s)", what);
            uint8_t x = p[1];
            const uint8_t *esc = p;
            p += 2;
            switch (x) {
            case '"': tmp[0] = '"'; k = 1; break;
            case '\\': tmp[0] = '\\'; k = 1; break;
            case '/': tmp[0] = '/'; k = 1; break;
            case 'b': tmp[0] = '\b'; k = 1; break;
            case 'f': tmp[0] = '\f'; k = 1; break;
            case 'n': tmp[0] = '\n'; k = 1; break;
            case 'r': tmp[0] = '\r'; k = 1; break;
            case 't': tmp[0] = '\t'; k = 1; break;
            case 'u': {
                int u = j->end - p >= 4 ? hex4(p) : -1;
                if (u < 0)
                    return k3_jc_fail(j, esc, K3_EFORMAT, "invalid JSON: bad \\u escape (%s)", what);
                p += 4;
                uint32_t cp = (uint32_t)u;
                if (cp >= 0xDC00 && cp <= 0xDFFF)
                    return k3_jc_fail(j, esc, K3_EFORMAT, "not valid UTF-8: lone low surrogate \\u%04x (%s)", cp, what);
                if (cp >= 0xD800 && cp <= 0xDBFF) {
                    int lo = j->end - p >= 6 && p[0] == '\\' && p[1] == 'u' ? hex4(p + 2) : -1;
                    if (lo < 0xDC00 || lo > 0xDFFF)
                        return k3_jc_fail(j, esc, K3_EFORMAT, "not valid UTF-8: unpaired surrogate \\u%04x (%s)", cp, what);
                    p += 6;
                    cp = 0x10000 + ((cp - 0xD800) << 10) + ((uint32_t)lo - 0xDC00);
                }
                if (cp == 0 && out)
                    return k3_jc_fail(j, esc, K3_EFORMAT, "%s contains a NUL character", what);
                k = put_utf8(tmp, cp);
                break;
            }
            default:
                return k3_jc_fail(j, esc, K3_EFORMAT, "invalid JSON: bad escape '\\%c' (%s)", x >= 0x20 && x < 0x7f ? x : '?', what);
            }
        } else {
            int u = utf8_len(p, j->end);
            if (u == 0)
                return k3_jc_fail(j, p, K3_EFORMAT, "not valid UTF-8: byte 0x%02x in a string (%s)", c, what);
            memcpy(tmp, p, (size_t)u);
            k = (size_t)u;
            p += u;
        }
        if (out) {
            if (n + k >= cap)
                return k3_jc_fail(j, open, K3_ELIMIT, "%s is longer than %zu bytes", what, cap - 1);
            memcpy(o + n, tmp, k);
        }
        n += k;
    }
    if (out)
        o[n] = '\0';
    if (len)
        *len = n;
    j->p = p;
    return 0;
}

int k3_jc_uint(k3_jc *j, uint64_t *v, const char *what)
{
    k3_jc_ws(j);
    const uint8_t *s = j->p;
    if (s < j->end && *s == '-')
        return k3_jc_fail(j, s, K3_EFORMAT, "%s is negative", what);
    if (s >= j->end || *s < '0' || *s > '9')
        return k3_jc_fail(j, s, K3_EFORMAT, "%s must be an integer, found %s", what, k3_jc_kind(j));
    const uint8_t *p = s;
    while (p < j->end && *p >= '0' && *p <= '9')
        p++;
    /* 2^53 has 16 digits: a longer number (leading zeros are refused below)
     * is too big, a shorter one fits u64 without checks */
    int big = p - s > 16;
    uint64_t x = 0;
    if (!big)
        for (const uint8_t *d = s; d < p; d++)
            x = x * 10 + (uint64_t)(*d - '0');
    if (x > K3_JC_MAX_INT)
        big = 1;
    if (p - s > 1 && *s == '0')
        return k3_jc_fail(j, s, K3_EFORMAT, "invalid JSON: %s has a leading zero", what);
    if (p < j->end && (*p == '.' || *p == 'e' || *p == 'E'))
        return k3_jc_fail(j, s, K3_EFORMAT, "%s is not an integer", what);
    if (big)
        return k3_jc_fail(j, s, K3_EFORMAT, "%s is larger than 2^53", what);
    j->p = p;
    *v = x;
    return 0;
}

/* Skip a number (any JSON number) at the cursor. */
static int skip_number(k3_jc *j)
{
    const uint8_t *p = j->p, *s = j->p;
    if (p < j->end && *p == '-')
        p++;
    const uint8_t *d = p;
    while (p < j->end && *p >= '0' && *p <= '9')
        p++;
    if (p == d || (p - d > 1 && *d == '0'))
        return k3_jc_fail(j, s, K3_EFORMAT, "invalid JSON: bad number");
    if (p < j->end && *p == '.') {
        d = ++p;
        while (p < j->end && *p >= '0' && *p <= '9')
            p++;
        if (p == d)
            return k3_jc_fail(j, s, K3_EFORMAT, "invalid JSON: bad number");
    }
    if (p < j->end && (*p == 'e' || *p == 'E')) {
        p++;
        if (p < j->end && (*p == '+' || *p == '-'))
            p++;
        d = p;
        while (p < j->end && *p >= '0' && *p <= '9')
            p++;
        if (p == d)
            return k3_jc_fail(j, s, K3_EFORMAT, "invalid JSON: bad number");
    }
    j->p = p;
    return 0;
}

static int skip_word(k3_jc *j, const char *w)
{
    size_t n = strlen(w);
    if ((size_t)(j->end - j->p) < n || memcmp(j->p, w, n))
        return k3_jc_fail(j, NULL, K3_EFORMAT, "invalid JSON: unexpected %s", k3_jc_kind(j));
    j->p += n;
    return 0;
}

int k3_jc_skip(k3_jc *j)
{
    /* stack[i] is '}' or ']' for each open container; first[i] says whether
     * the container has no element yet */
    char stack[K3_JC_MAX_DEPTH];
    int depth = 0, rc;
    for (;;) {
        /* a value */
        k3_jc_ws(j);
        if (j->p >= j->end)
            return k3_jc_fail(j, NULL, K3_EFORMAT, "invalid JSON: text ends inside a value");
        uint8_t c = *j->p;
        if (c == '{' || c == '[') {
            if (depth == K3_JC_MAX_DEPTH)
                return k3_jc_fail(j, NULL, K3_ELIMIT, "JSON nested deeper than %d levels", K3_JC_MAX_DEPTH);
            stack[depth++] = c == '{' ? '}' : ']';
            j->p++;
            k3_jc_ws(j);
            if (j->p < j->end && *j->p == (uint8_t)stack[depth - 1]) {
                j->p++;
                depth--;
                goto after_value;
            }
            if (c == '{') {
                if ((rc = k3_jc_string(j, NULL, 0, NULL, "object key")) || (rc = k3_jc_expect(j, ':', "after a key")))
                    return rc;
            }
            continue;
        }
        if (c == '"')
            rc = k3_jc_string(j, NULL, 0, NULL, "string");
        else if (c == 't')
            rc = skip_word(j, "true");
        else if (c == 'f')
            rc = skip_word(j, "false");
        else if (c == 'n')
            rc = skip_word(j, "null");
        else if (c == '-' || (c >= '0' && c <= '9'))
            rc = skip_number(j);
        else
            rc = k3_jc_fail(j, NULL, K3_EFORMAT, "invalid JSON: unexpected %s", k3_jc_kind(j));
        if (rc)
            return rc;
    after_value:
        for (;;) {
            if (depth == 0)
                return 0;
            k3_jc_ws(j);
            if (j->p >= j->end)
                return k3_jc_fail(j, NULL, K3_EFORMAT, "invalid JSON: text ends inside a container");
            if (*j->p == (uint8_t)stack[depth - 1]) {
                j->p++;
                depth--;
                continue;
            }
            if (*j->p != ',')
                return k3_jc_fail(j, NULL, K3_EFORMAT, "invalid JSON: expected ',' or '%c', found %s",
                                  stack[depth - 1], k3_jc_kind(j));
            j->p++;
            if (stack[depth - 1] == '}') {
                if ((rc = k3_jc_string(j, NULL, 0, NULL, "object key")) || (rc = k3_jc_expect(j, ':', "after a key")))
                    return rc;
            }
            break;
        }
    }
}
