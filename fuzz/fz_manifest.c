/*
 * fz_manifest.c - a packed model's manifest.json and experts.idx
 * (k3_man_parse, k3_man_to_json, k3_man_idx_decode, k3_pk_open).
 *
 * Input: the manifest text, optionally followed by the separator line of
 * K3_FUZZ_SEP and the bytes of experts.idx. An accepted manifest must name
 * only plain files inside the model directory, and serialise to a text that
 * parses again and serialises to the same text (the writer and the reader
 * agree). The index is decoded against the manifest when its size is the one
 * the manifest implies. Finally the pair is written to the work directory and
 * opened with k3_pk_open, which also checks the files the manifest lists.
 *
 * The manifest carries the SHA-256 of its own text ("self_sha256", computed
 * with 64 zeros in its place): a mutated manifest would almost never get past
 * that check, so the target first recomputes it when the value is 64 hex
 * digits (a fixup, as for any checksummed format). A value that is not 64 hex
 * digits is left alone, so the refusal paths are still fuzzed.
 */
#include "k3_fuzz.h"

#include <openssl/evp.h>
#include <stdlib.h>
#include <string.h>

#include "k3_man.h"
#include "k3_pk.h"

/* Make the self_sha256 value (the last one, if any) the hash of the text. */
static void fix_self_hash(uint8_t *t, size_t n)
{
    static const char key[] = "\"self_sha256\"";
    uint8_t *at = NULL;
    for (uint8_t *q = t; (q = memmem(q, (size_t)(t + n - q), key, sizeof key - 1)); q++)
        at = q;
    if (!at)
        return;
    uint8_t *v = at + sizeof key - 1, *end = t + n;
    while (v < end && (*v == ' ' || *v == '\t' || *v == '\n' || *v == '\r' || *v == ':'))
        v++;
    if (end - v < 66 || *v != '"' || v[65] != '"')
        return;
    v++;
    for (int i = 0; i < 64; i++)
        if (!((v[i] >= '0' && v[i] <= '9') || (v[i] >= 'a' && v[i] <= 'f')))
            return;
    memset(v, '0', 64);
    uint8_t sha[32];
    unsigned int len = 0;
    if (EVP_Digest(t, n, sha, &len, EVP_sha256(), NULL) != 1)
        k3_fuzz_fail("EVP_Digest failed in the harness");
    static const char hex[] = "0123456789abcdef";
    for (int i = 0; i < 32; i++) {
        v[2 * i] = (uint8_t)hex[sha[i] >> 4];
        v[2 * i + 1] = (uint8_t)hex[sha[i] & 15];
    }
}

K3_FUZZ_TARGET(manifest)
{
    const uint8_t *in_text, *idx;
    size_t text_len, idx_len;
    k3_fuzz_split(data, size, &in_text, &text_len, &idx, &idx_len);
    uint8_t *text = malloc(text_len ? text_len : 1);
    if (!text)
        k3_fuzz_fail("out of memory in the harness");
    memcpy(text, in_text, text_len);
    fix_self_hash(text, text_len);

    k3_man m;
    k3_err e = {0};
    memset(&m, 0, sizeof m);
    int rc = k3_man_parse(&m, (const char *)text, text_len, "manifest.json", &e);
    k3_fuzz_check_result(rc, &e, "k3_man_parse");
    if (rc == 0) {
        for (uint32_t i = 0; i < m.nfiles; i++) {
            const char *n = m.files[i].name;
            if (!n || !n[0] || n[0] == '.' || strchr(n, '/'))
                k3_fuzz_fail("manifest names a file outside the directory: %s", n ? n : "(null)");
        }
        char *s1 = k3_man_to_json(&m);
        if (!s1)
            k3_fuzz_fail("k3_man_to_json failed on an accepted manifest");
        k3_man m2;
        memset(&m2, 0, sizeof m2);
        rc = k3_man_parse(&m2, s1, strlen(s1), "serialised manifest", &e);
        if (rc)
            k3_fuzz_fail("a serialised manifest does not parse: %s", e.msg);
        char *s2 = k3_man_to_json(&m2);
        if (!s2 || strcmp(s1, s2))
            k3_fuzz_fail("manifest serialisation is not stable under a parse round trip");
        free(s1);
        free(s2);
        k3_man_free(&m2);

        if (m.has_experts && idx_len == k3_man_idx_size(&m.cfg)) {
            /* the size check above bounds this allocation by the input */
            uint64_t n = (uint64_t)k3_man_moe_layers(&m.cfg) * m.cfg.num_experts;
            k3_pk_record *recs = calloc(n ? n : 1, sizeof *recs);
            if (!recs)
                k3_fuzz_fail("out of memory in the harness");
            k3_err_clear(&e);
            rc = k3_man_idx_decode(&m, idx, idx_len, recs, "experts.idx", &e);
            k3_fuzz_check_result(rc, &e, "k3_man_idx_decode");
            free(recs);
        }
    }
    k3_man_free(&m);

    k3_fuzz_write("manifest.json", text, text_len, NULL, 0);
    if (idx_len)
        k3_fuzz_write("experts.idx", idx, idx_len, NULL, 0);
    else
        k3_fuzz_unlink("experts.idx");
    k3_pk *pk = NULL;
    k3_err_clear(&e);
    rc = k3_pk_open(&pk, k3_fuzz_workdir(), 0, &e);
    k3_fuzz_check_result(rc, &e, "k3_pk_open");
    k3_pk_close(pk);
    free(text);
    return 0;
}
