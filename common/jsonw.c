/*
 * jsonw.c - UTF-8-valid JSON strings (see k3_json.h).
 */
#include "k3_json.h"

#include <stdlib.h>
#include <string.h>

int k3_utf8_len(const unsigned char *s, uint64_t n)
{
    unsigned c = s[0];
    if (c < 0x80)
        return 1;
    int len = c >= 0xC2 && c <= 0xDF ? 2 : c >= 0xE0 && c <= 0xEF ? 3 : c >= 0xF0 && c <= 0xF4 ? 4 : 0;
    if (!len || (uint64_t)len > n)
        return 0;
    unsigned lo = 0x80, hi = 0xBF;
    if (c == 0xE0) lo = 0xA0;
    if (c == 0xED) hi = 0x9F;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;
    if (s[1] < lo || s[1] > hi)
        return 0;
    for (int i = 2; i < len; i++)
        if (s[i] < 0x80 || s[i] > 0xBF)
            return 0;
    return len;
}

int k3_utf8_valid(const char *s, uint64_t n)
{
    const unsigned char *u = (const unsigned char *)s;
    for (uint64_t i = 0; i < n;) {
        int l = k3_utf8_len(u + i, n - i);
        if (!l)
            return 0;
        i += (uint64_t)l;
    }
    return 1;
}

void k3_json_fput_str(FILE *f, const char *text, uint64_t n)
{
    const unsigned char *s = (const unsigned char *)text;
    fputc('"', f);
    for (uint64_t i = 0; i < n;) {
        unsigned c = s[i];
        int len = k3_utf8_len(s + i, n - i);
        if (len == 0) {
            fputs("\\ufffd", f);
            i++;
        } else if (c == '"' || c == '\\') {
            fprintf(f, "\\%c", c);
            i++;
        } else if (c == '\n') {
            fputs("\\n", f);
            i++;
        } else if (c == '\t') {
            fputs("\\t", f);
            i++;
        } else if (c < 0x20 || c == 0x7f) {
            fprintf(f, "\\u%04x", c);
            i++;
        } else {
            fwrite(s + i, 1, (size_t)len, f);
            i += (uint64_t)len;
        }
    }
    fputc('"', f);
}

char *k3_json_utf8_dup(const char *str)
{
    const unsigned char *s = (const unsigned char *)str;
    uint64_t n = strlen(str);
    char *o = malloc(3 * n + 1);   /* U+FFFD is 3 bytes */
    if (!o)
        return NULL;
    uint64_t k = 0;
    for (uint64_t i = 0; i < n;) {
        int len = k3_utf8_len(s + i, n - i);
        if (len == 0) {
            memcpy(o + k, "\xEF\xBF\xBD", 3);
            k += 3;
            i++;
        } else {
            memcpy(o + k, s + i, (size_t)len);
            k += (uint64_t)len;
            i += (uint64_t)len;
        }
    }
    o[k] = '\0';
    return o;
}
