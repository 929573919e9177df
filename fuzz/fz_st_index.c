/*
 * fz_st_index.c - model.safetensors.index.json, through k3_st_open on a
 * directory.
 *
 * Input: the text of the index. The work directory also holds two fixed,
 * valid shards (written once per process):
 *   model-00001-of-00002.safetensors  a: F32 [2], b: BF16 [2,2]
 *   model-00002-of-00002.safetensors  c: U8 [4]
 * An accepted checkpoint must only contain those tensors, read back their
 * known bytes, and name no shard outside the directory (a weight_map value
 * such as "../x" or "/etc/passwd" must be refused, not opened).
 */
#include "k3_fuzz.h"

#include <stdio.h>
#include <string.h>

#include "k3_st.h"

static const char *const shard_names[2] = {"model-00001-of-00002.safetensors",
                                           "model-00002-of-00002.safetensors"};

static void write_shard(const char *name, const char *header, const uint8_t *payload, size_t n)
{
    uint8_t file[512];
    size_t hl = strlen(header);
    if (8 + hl + n > sizeof file)
        k3_fuzz_fail("fixed shard too big");
    for (int i = 0; i < 8; i++)
        file[i] = (uint8_t)((uint64_t)hl >> (8 * i));
    memcpy(file + 8, header, hl);
    memcpy(file + 8 + hl, payload, n);
    k3_fuzz_write(name, file, 8 + hl + n, NULL, 0);
}

static const uint8_t payload1[16] = {0, 0, 128, 63, 0, 0, 0, 64, 128, 63, 0, 64, 64, 64, 128, 64};
static const uint8_t payload2[4] = {1, 2, 3, 4};

static void setup(void)
{
    static int ready;
    if (ready)
        return;
    write_shard(shard_names[0],
                "{\"__metadata__\":{\"format\":\"pt\"},"
                "\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                "\"b\":{\"dtype\":\"BF16\",\"shape\":[2,2],\"data_offsets\":[8,16]}}",
                payload1, sizeof payload1);
    write_shard(shard_names[1], "{\"c\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[0,4]}}",
                payload2, sizeof payload2);
    ready = 1;
}

K3_FUZZ_TARGET(st_index)
{
    setup();
    k3_fuzz_write("model.safetensors.index.json", data, size, NULL, 0);
    k3_st *st = NULL;
    k3_err e = {0};
    int rc = k3_st_open(&st, k3_fuzz_workdir(), 0, &e);
    k3_fuzz_check_result(rc, &e, "k3_st_open");
    if (rc == 0) {
        for (uint32_t s = 0; s < k3_st_shard_count(st); s++) {
            const char *n = k3_st_shard_name(st, s);
            if (!n || (strcmp(n, shard_names[0]) && strcmp(n, shard_names[1])))
                k3_fuzz_fail("opened a shard that is not in the directory: %s", n ? n : "(null)");
        }
        uint64_t count = k3_st_tensor_count(st);
        if (count > 3)
            k3_fuzz_fail("%llu tensors from shards holding 3", (unsigned long long)count);
        for (uint64_t i = 0; i < count; i++) {
            const k3_st_tensor *t = k3_st_tensor_at(st, i);
            const uint8_t *want;
            uint64_t n;
            if (!strcmp(t->name, "a")) {
                want = payload1, n = 8;
            } else if (!strcmp(t->name, "b")) {
                want = payload1 + 8, n = 8;
            } else if (!strcmp(t->name, "c")) {
                want = payload2, n = 4;
            } else {
                k3_fuzz_fail("tensor %s is in no shard", t->name);
            }
            uint8_t got[16];
            if (t->nbytes != n || k3_st_find(st, t->name) != t)
                k3_fuzz_fail("tensor %s: wrong size or not found by name", t->name);
            rc = k3_st_read(st, t, got, &e);
            if (rc || memcmp(got, want, n))
                k3_fuzz_fail("tensor %s does not read back: %s", t->name, e.msg);
        }
    }
    k3_st_close(st);
    return 0;
}
