/*
 * t_stream.c - the streaming source (--ram): the same logits and tokens at
 * every budget from the floor to fully resident and with 1 or 2 threads,
 * peak RSS within the budget, a one-slot ring that never overwrites the group
 * in use, CRC and I/O failures caught at read time with file/offset/layer/
 * expert and the documented exit status, budgets below the floor refused
 * with the floor, and the planner's invariants.
 */
#include <cjson/cJSON.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <fcntl.h>
#include <zlib.h>

#include "k3_pk.h"
#include "k3_stream.h"
#include "k3_test.h"
#include "k3_ws.h"

/* tiny synth model converted to a packed directory; returns its path */
static const char *packed_tiny(void)
{
    static char dir[4096];
    char src[4096];
    snprintf(src, sizeof src, "%s/src", k3t_tmpdir());
    snprintf(dir, sizeof dir, "%s/pk", k3t_tmpdir());
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-synth %s --preset tiny --quiet", src), 0);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-convert --quiet %s %s", src, dir), 0);
    return dir;
}

/* "total ... (N bytes)" line of a printed plan */
static uint64_t plan_total(const char *err)
{
    const char *p = err ? strstr(err, "  total ") : NULL;
    CHECK(p != NULL);
    if (!p)
        return 0;
    p = strchr(p, '(');
    return p ? strtoull(p + 1, NULL, 10) : 0;
}

static double jnum(const cJSON *o, const char *a, const char *b)
{
    const cJSON *x = cJSON_GetObjectItemCaseSensitive(o, a);
    if (b)
        x = cJSON_GetObjectItemCaseSensitive(x, b);
    return cJSON_IsNumber(x) ? x->valuedouble : -1.0;
}

K3_TEST_TIMEOUT(stream_gives_identical_logits_and_tokens_at_every_budget_and_thread_count, 300)
{
    const char *pk = packed_tiny();
    const char *tmp = k3t_tmpdir();
    const char *args = "--ids 5,9,2,7,3,11,4,8,6 --gen 6 --chunk 4";
    char *ref = NULL, *out = NULL, *err = NULL;
    CHECK_EQ_INT(k3t_runf(&out, NULL, "k3-run %s %s --json --logits-all %s/ref.bin", pk, args, tmp), 0);
    cJSON *rj = cJSON_Parse(out);
    CHECK(rj != NULL);
    ref = rj ? cJSON_PrintUnformatted(cJSON_GetObjectItemCaseSensitive(rj, "generated_ids")) : NULL;
    CHECK(ref && strlen(ref) > 2);
    cJSON_Delete(rj);
    free(out);
    CHECK_EQ_INT(k3t_runf(NULL, &err, "k3-run %s %s --ram floor --plan", pk, args), 0);
    uint64_t floor = plan_total(err);
    free(err);
    CHECK_EQ_INT(k3t_runf(NULL, &err, "k3-run %s %s --ram resident --plan", pk, args), 0);
    uint64_t res = plan_total(err);
    free(err);
    CHECK(floor > 0 && res > floor);
    /* presets at both ends, three sizes between (the baseline RSS moves by
     * some 100 KB between runs: the sizes keep a margin above the floor);
     * the floor and the double-buffered floor also with the dense MLP and
     * the head streamed in row pieces of 8 KiB (so pieces start mid-matrix
     * and the head's pieces serve 4-token chunks) */
    char budgets[8][64];
    snprintf(budgets[0], 32, "floor");
    snprintf(budgets[1], 32, "double");
    snprintf(budgets[2], 32, "%llu", (unsigned long long)(floor + (res - floor) / 4 + (256 << 10)));
    snprintf(budgets[3], 32, "%llu", (unsigned long long)(floor + (res - floor) / 2 + (256 << 10)));
    snprintf(budgets[4], 32, "resident");
    snprintf(budgets[5], 48, "floor --ram-piece 8K");
    snprintf(budgets[6], 48, "double --ram-piece 5000");
    snprintf(budgets[7], 64, "%llu --ram-piece 8K", (unsigned long long)(floor + (res - floor) / 2 + (256 << 10)));
    char seen[8][64];
    int distinct = 0;
    for (int b = 0; b < 8; b++) {
        for (int t = 1; t <= 2; t++) {
            CHECK_EQ_INT(k3t_runf(&out, &err, "k3-run %s %s --threads %d --ram %s --json --logits-all %s/s.bin", pk,
                                  args, t, budgets[b], tmp),
                         0);
            char a[4096], c[4096];
            snprintf(a, sizeof a, "%s/ref.bin", tmp);
            snprintf(c, sizeof c, "%s/s.bin", tmp);
            CHECK_EQ_INT(k3t_runf(NULL, NULL, "cmp -s %s %s", a, c), 0);
            cJSON *j = cJSON_Parse(out);
            CHECK(j != NULL);
            if (j) {
                char *g = cJSON_PrintUnformatted(cJSON_GetObjectItemCaseSensitive(j, "generated_ids"));
                CHECK(g && ref && strcmp(ref, g) == 0);
                free(g);
                const cJSON *s = cJSON_GetObjectItemCaseSensitive(j, "stream");
                double peak = jnum(s, "peak_rss", NULL), budget = jnum(s, "plan", "budget");
                CHECK(peak > 0 && budget > 0 && peak <= budget);
                if (b == 5 || b == 6)
                    CHECK(jnum(s, "plan", "piece_ring") > 0);
                if (b == 0)   /* 4 ids route to more experts than the floor's slots: read past the cache */
                    CHECK(jnum(s, "prompt", "read_ahead") > 0);
                if (t == 1) {
                    snprintf(seen[b], 64, "%.0f/%.0f/%.0f/%.0f", jnum(s, "plan", "pinned_groups"),
                             jnum(s, "plan", "expert_slots"), jnum(s, "plan", "ring"), jnum(s, "plan", "piece_ring"));
                    int dup = 0;
                    for (int k = 0; k < b; k++)
                        dup |= !strcmp(seen[k], seen[b]);
                    distinct += !dup;
                }
                cJSON_Delete(j);
            }
            CHECK_STR_CONTAINS(err, "memory plan");
            CHECK_STR_CONTAINS(err, "peak RSS");
            free(out);
            free(err);
        }
    }
    CHECK(distinct >= 7);   /* the budgets really exercise different layouts */
    free(ref);
}

K3_TEST(stream_refuses_a_budget_below_the_floor_and_names_the_floor)
{
    const char *pk = packed_tiny();
    char *err = NULL;
    CHECK_EQ_INT(k3t_runf(NULL, &err, "k3-run %s --ids 1,2 --ram 1M", pk), 6);
    CHECK_STR_CONTAINS(err, "k3-run: error: RAM budget 1048576 bytes");
    CHECK_STR_CONTAINS(err, "below the floor of this model:");
    free(err);
    CHECK_EQ_INT(k3t_runf(NULL, &err, "k3-run %s --ids 1,2 --ram 12Q", pk), 2);
    free(err);
    CHECK_EQ_INT(k3t_runf(NULL, &err, "k3-run %s --ids 1,2 --plan", pk), 2);
    free(err);
}

/* The record of the first expert the run misses, from its trace. */
static void first_missed(const char *pk, const char *trace, uint32_t *layer, uint32_t *expert, char *path,
                         size_t cap, uint64_t *off)
{
    FILE *f = fopen(trace, "r");
    CHECK(f != NULL);
    char line[256];
    unsigned long long fw;
    unsigned l = 0, x = 0;
    char hm = 0;
    int found = 0;
    while (f && fgets(line, sizeof line, f))
        if (line[0] != '#' && sscanf(line, "%llu %u %u %c", &fw, &l, &x, &hm) == 4 && hm == 'M') {
            found = 1;
            break;
        }
    if (f)
        fclose(f);
    CHECK(found);
    k3_pk *p = NULL;
    CHECK_EQ_INT(k3_pk_open(&p, pk, 0, NULL), 0);
    const k3_pk_record *r = p ? k3_pk_record_find(p, l, x) : NULL;
    CHECK(r != NULL);
    if (r) {
        snprintf(path, cap, "%s", k3_pk_file_at(p, r->file)->path);
        *off = r->offset;
    }
    *layer = l;
    *expert = x;
    k3_pk_close(p);
}

K3_TEST(stream_catches_a_corrupted_expert_record_at_read_time)
{
    const char *pk = packed_tiny();
    char trace[4096], path[4096], *out = NULL, *err = NULL;
    snprintf(trace, sizeof trace, "%s/trace.txt", k3t_tmpdir());
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-run %s --ids 3,1,4,1,5 --gen 3 --ram floor --trace %s", pk, trace), 0);
    uint32_t layer = 0, expert = 0;
    uint64_t off = 0;
    first_missed(pk, trace, &layer, &expert, path, sizeof path, &off);
    /* flip one bit in the middle of that record on disk */
    int fd = open(path, O_RDWR);
    CHECK(fd >= 0);
    unsigned char byte = 0;
    CHECK_EQ_INT((int)pread(fd, &byte, 1, (off_t)(off + 100)), 1);
    byte ^= 1;
    CHECK_EQ_INT((int)pwrite(fd, &byte, 1, (off_t)(off + 100)), 1);
    close(fd);
    CHECK_EQ_INT(k3t_runf(&out, &err, "k3-run %s --ids 3,1,4,1,5 --gen 3 --ram floor", pk), 5);
    char want[256];
    snprintf(want, sizeof want, "layer %u expert %u: record at offset %llu has CRC32", layer, expert,
             (unsigned long long)off);
    CHECK_STR_CONTAINS(err, want);
    CHECK_STR_CONTAINS(err, path);
    CHECK_STR_CONTAINS(err, "k3-run: error:");
    CHECK(out == NULL || strlen(out) == 0);   /* no token from bad bytes */
    free(out);
    free(err);
}

K3_TEST(stream_stops_on_an_expert_read_error_with_exit_4)
{
    const char *pk = packed_tiny();
    char trace[4096], path[4096], *err = NULL;
    snprintf(trace, sizeof trace, "%s/trace.txt", k3t_tmpdir());
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-run %s --ids 3,1,4,1,5 --gen 3 --ram floor --trace %s", pk, trace), 0);
    uint32_t layer = 0, expert = 0;
    uint64_t off = 0;
    first_missed(pk, trace, &layer, &expert, path, sizeof path, &off);
    const char *base = strrchr(path, '/') ? strrchr(path, '/') + 1 : path;
    CHECK_EQ_INT(k3t_runf(NULL, &err, "K3_FAULT=eio:%s:%llu k3-run %s --ids 3,1,4,1,5 --gen 3 --ram floor", base,
                          (unsigned long long)(off + 64), pk),
                 4);
    char want[128];
    snprintf(want, sizeof want, "(layer %u expert %u)", layer, expert);
    CHECK_STR_CONTAINS(err, want);
    CHECK_STR_CONTAINS(err, base);
    free(err);
    /* a short read of a trunk unit: named with its layer */
    CHECK_EQ_INT(k3t_runf(NULL, &err, "K3_FAULT=short:trunk-0001:0 k3-run %s --ids 3,1 --gen 2 --ram floor", pk), 4);
    CHECK_STR_CONTAINS(err, "trunk-0001.k3t");
    CHECK_STR_CONTAINS(err, "(trunk of layer");
    free(err);
}

K3_TEST(stream_catches_a_flipped_trunk_byte_before_any_token)
{
    const char *pk = packed_tiny();
    char *out = NULL, *err = NULL;
    /* every streamed read of trunk-0001 at byte 4100 gets bit 0 flipped */
    CHECK_EQ_INT(k3t_runf(&out, &err, "K3_FAULT=flip:trunk-0001:4100 k3-run %s --ids 3,1 --gen 2 --ram floor", pk), 5);
    CHECK_STR_CONTAINS(err, "trunk-0001.k3t: unit");
    CHECK_STR_CONTAINS(err, "has CRC32");
    CHECK_STR_CONTAINS(err, "(trunk of layer");
    CHECK(out == NULL || strlen(out) == 0);
    free(out);
    free(err);
    /* the same byte flipped while pinned at start (resident budget) */
    CHECK_EQ_INT(k3t_runf(&out, &err, "K3_FAULT=flip:trunk-0001:4100 k3-run %s --ids 3,1 --gen 2 --ram resident", pk),
                 5);
    CHECK_STR_CONTAINS(err, "has CRC32");
    free(out);
    free(err);
}

/* Where lm_head's bytes are: the file's name into base (for K3_FAULT) and
 * the file offset of byte num/den of the tensor, plus add; 0 if not found. */
static int lm_head_byte(const char *pk, char *base, size_t cap, uint64_t num, uint64_t den, uint64_t add,
                        unsigned long long *off)
{
    k3_pk *p = NULL;
    CHECK_EQ_INT(k3_pk_open(&p, pk, 0, NULL), 0);
    const k3_pk_tensor *t = p ? k3_pk_tensor_find(p, "language_model.lm_head.weight") : NULL;
    CHECK(t != NULL);
    if (t) {
        const char *path = k3_pk_file_at(p, k3_pk_unit_at(p, t->pieces[0].unit)->file)->path;
        snprintf(base, cap, "%s", strrchr(path, '/') ? strrchr(path, '/') + 1 : path);
        *off = t->pieces[0].offset + t->nbytes / den * num + add;
    }
    k3_pk_close(p);
    return t != NULL;
}

K3_TEST(stream_catches_a_flipped_byte_in_a_streamed_row_piece)
{
    const char *pk = packed_tiny();
    char base[256];
    unsigned long long off;
    /* a byte in the middle of lm_head: read as a row piece, caught when the
     * head's unit CRC is folded, before the logits are returned */
    if (!lm_head_byte(pk, base, sizeof base, 1, 2, 3, &off))
        return;
    char *out = NULL, *err = NULL;
    CHECK_EQ_INT(k3t_runf(&out, &err, "K3_FAULT=flip:%s:%llu k3-run %s --ids 3,1 --gen 2 --ram floor --ram-piece 8K",
                          base, off, pk),
                 5);
    CHECK_STR_CONTAINS(err, "has CRC32");
    CHECK_STR_CONTAINS(err, "(trunk of the head)");
    CHECK(out == NULL || strlen(out) == 0);
    free(out);
    free(err);
    /* and an I/O error there */
    CHECK_EQ_INT(k3t_runf(NULL, &err, "K3_FAULT=eio:%s:%llu k3-run %s --ids 3,1 --gen 2 --ram floor --ram-piece 8K",
                          base, off, pk),
                 4);
    CHECK_STR_CONTAINS(err, "lm_head.weight rows from");
    free(err);
}

/* Every pass over a group is checked anew: a byte that reads right in the
 * first pass and wrong in every read after the second (K3_FAULT's SKIP; a
 * byte near a piece's edge is read twice a pass, by both widened pieces)
 * fails the run as well; the two readers fold a unit's pieces together. */
K3_TEST(stream_checks_every_pass_of_a_streamed_piece)
{
    const char *pk = packed_tiny();
    char base[256];
    unsigned long long off;
    if (!lm_head_byte(pk, base, sizeof base, 1, 3, 5, &off))
        return;
    char *err = NULL;
    CHECK_EQ_INT(k3t_runf(NULL, &err, "K3_FAULT=flip:%s:%llu:1000:2 k3-run %s --ids 3,1 --gen 4 --ram floor --ram-piece 8K",
                          base, off, pk),
                 5);
    CHECK_STR_CONTAINS(err, "(trunk of the head)");
    free(err);
}

/* Sum of a view's bytes, for comparing against the resident source. */
static uint32_t view_crc(const k3_view *v)
{
    if (!v->data)
        return 0;
    return (uint32_t)crc32(0, v->data, (uInt)(k3_view_numel(v) * k3_dtype_size(v->dtype)));
}

K3_TEST(stream_one_slot_ring_never_overwrites_the_group_in_use)
{
    const char *pk = packed_tiny();
    k3_ws *ref = NULL, *ws = NULL;
    k3_err e = {0};
    CHECK_EQ_INT(k3_ws_pk_open(&ref, pk, 0, &e), 0);
    CHECK_EQ_INT(k3_ws_stream_open(&ws, pk, 1, &e), 0);
    if (!ref || !ws)
        return;
    k3_stream_opts o;
    k3_stream_opts_init(&o);
    o.budget = K3_STREAM_FLOOR;
    o.max_chunk = 4;
    o.max_ctx = 16;
    o.io_chunk = 4096;      /* groups read in 4 KiB chunks over the I/O threads, CRCs folded */
    k3_stream_plan p;
    CHECK_EQ_INT(k3_ws_stream_start(ws, &o, &p, &e), 0);
    /* the floor: nothing pinned, a ring of exactly the largest group, which
     * no two groups of this model fit in together */
    CHECK_EQ_INT((int)p.n_pinned, 0);
    CHECK_EQ_U64(p.ring, p.largest_streamed);
    const uint32_t ng = ws->cfg.num_hidden_layers + 1;
    uint32_t want[K3_CFG_MAX_LAYERS + 1][K3_W_COUNT];
    for (uint32_t g = 0; g < ng; g++) {
        const k3_view *v;
        CHECK_EQ_INT(k3_ws_acquire(ref, g, &v, &e), 0);
        for (int s = 0; s < K3_W_COUNT; s++)
            want[g][s] = view_crc(&v[s]);
    }
    /* three passes; the second skips the head (a prediction miss). While a
     * group is held the reader has time to run ahead: it must wait. */
    for (int pass = 0; pass < 3; pass++)
        for (uint32_t g = 0; g < ng; g++) {
            if (pass == 1 && g + 1 == ng)
                continue;
            const k3_view *v;
            CHECK_EQ_INT(k3_ws_acquire(ws, g, &v, &e), 0);
            for (int s = 0; s < K3_W_COUNT; s++)
                CHECK_EQ_U64(view_crc(&v[s]), want[g][s]);
            usleep(20000);
            for (int s = 0; s < K3_W_COUNT; s++)
                CHECK_EQ_U64(view_crc(&v[s]), want[g][s]);
            k3_ws_release(ws, g);
        }
    k3_stream_stats st;
    k3_ws_stream_stats(ws, &st);
    CHECK(st.trunk_stream_bytes > 0);
    k3_ws_close(ws);
    k3_ws_close(ref);
}

K3_TEST(stream_reads_pieces_in_the_order_the_model_uses_them)
{
    const char *pk = packed_tiny();
    char *out = NULL;
    /* one prompt chunk (the head is used every time): with the model's order
     * right, no prefetched group or piece is ever dropped */
    CHECK_EQ_INT(k3t_runf(&out, NULL, "k3-run %s --ids 3,1,4 --gen 4 --ram floor --ram-piece 2K --json", pk), 0);
    cJSON *j = cJSON_Parse(out);
    CHECK(j != NULL);
    const cJSON *s = cJSON_GetObjectItemCaseSensitive(j, "stream");
    CHECK(jnum(s, "plan", "piece_ring") > 0);
    CHECK(jnum(s, "ring_drops", NULL) == 0);
    cJSON_Delete(j);
    free(out);
}

/* The decode's device line: a share of time with no read in flight, and a
 * mean depth while busy of at least one read and at most the four I/O
 * threads (a read counted in and never out would push it past them). */
K3_TEST(stream_report_counts_the_device_idle_time_and_depth)
{
    const char *pk = packed_tiny();
    char *out = NULL;
    CHECK_EQ_INT(k3t_runf(&out, NULL, "k3-run %s --ids 3,1,4 --gen 6 --ram floor --ram-piece 8K --json", pk), 0);
    cJSON *j = cJSON_Parse(out);
    const cJSON *s = cJSON_GetObjectItemCaseSensitive(j, "stream");
    const double idle = jnum(s, "decode", "io_idle_share"), depth = jnum(s, "decode", "io_depth");
    CHECK(idle >= 0.0 && idle <= 1.0);
    CHECK(depth >= 1.0 && depth <= 4.0);
    cJSON_Delete(j);
    free(out);
}

K3_TEST(stream_two_piece_ring_never_overwrites_the_piece_in_use)
{
    const char *pk = packed_tiny();
    k3_ws *ref = NULL, *ws = NULL;
    k3_err e = {0};
    CHECK_EQ_INT(k3_ws_pk_open(&ref, pk, 0, &e), 0);
    CHECK_EQ_INT(k3_ws_stream_open(&ws, pk, 1, &e), 0);
    if (!ref || !ws)
        return;
    k3_stream_opts o;
    k3_stream_opts_init(&o);
    o.budget = K3_STREAM_FLOOR;
    o.max_chunk = 4;
    o.max_ctx = 16;
    o.piece_bytes = 6000;   /* every matrix over 6000 bytes in pieces */
    o.io_chunk = 4096;      /* and every read split over the I/O threads, CRCs folded */
    k3_stream_plan p;
    CHECK_EQ_INT(k3_ws_stream_plan(ws, &o, &p, &e), 0);
    CHECK_EQ_INT(k3_ws_stream_start(ws, &o, &p, &e), 0);
    CHECK(p.piece_ring > 0);
    const uint32_t ng = ws->cfg.num_hidden_layers + 1;
    int pieces = 0;
    for (int pass = 0; pass < 2; pass++)
        for (uint32_t g = 0; g < ng; g++) {
            const k3_view *rv, *v;
            CHECK_EQ_INT(k3_ws_acquire(ref, g, &rv, &e), 0);
            CHECK_EQ_INT(k3_ws_acquire(ws, g, &v, &e), 0);
            for (int s = 0; s < K3_W_COUNT; s++) {
                if (v[s].data || !v[s].src)
                    continue;
                /* a streamed matrix: every piece equals the resident rows, and
                 * stays so while held (the reader fills the other slot) */
                const uint64_t rows = v[s].shape[0], rb = k3_view_numel(&v[s]) / rows * k3_dtype_size(v[s].dtype);
                for (uint64_t r = 0; r < rows;) {
                    const void *d;
                    uint64_t n = 0;
                    CHECK_EQ_INT(k3_ws_rows_acquire(ws, g, (k3_wslot)s, r, &n, &d, &e), 0);
                    CHECK(n > 0);
                    if (n == 0)
                        break;
                    const uint8_t *want = (const uint8_t *)rv[s].data + r * rb;
                    CHECK(memcmp(d, want, n * rb) == 0);
                    usleep(5000);
                    CHECK(memcmp(d, want, n * rb) == 0);
                    k3_ws_rows_release(ws, g, (k3_wslot)s);
                    r += n;
                    pieces++;
                }
            }
            k3_ws_release(ws, g);
        }
    CHECK(pieces > 4);
    CHECK_EQ_INT(k3_ws_status(ws, &e), 0);
    k3_ws_close(ws);
    k3_ws_close(ref);
}

K3_TEST(stream_plan_stays_within_every_budget_and_streams_less_with_more)
{
    k3_cfg c;
    memset(&c, 0, sizeof c);
    c.hidden_size = 64; c.num_hidden_layers = 6; c.vocab_size = 512; c.kda_num_heads = 2; c.kda_head_dim = 16;
    c.short_conv_kernel_size = 4; c.num_attention_heads = 2; c.q_lora_rank = 32; c.kv_lora_rank = 32;
    c.qk_nope_head_dim = 16; c.qk_rope_head_dim = 16; c.v_head_dim = 16; c.num_experts = 8;
    c.num_experts_per_token = 2; c.routed_expert_hidden_size = 32; c.moe_intermediate_size = 32;
    c.first_k_dense_replace = 1; c.intermediate_size = 128;
    uint64_t gb[7] = {1 << 20, 3 << 20, 2 << 20, 2 << 20, 5 << 20, 1 << 20, 4 << 20};
    k3_stream_shape sh = {7, gb, 128, 1 << 20, 5, 8, 2, NULL, 0};
    k3_stream_opts o;
    k3_stream_opts_init(&o);
    o.baseline = 8 << 20;
    k3_stream_plan p;
    k3_err e = {0};
    CHECK_EQ_INT(k3_stream_plan_make(&sh, &c, &o, &p, &e), 0);
    const uint64_t floor = p.floor, res = p.resident;
    CHECK_EQ_U64(p.total, floor);
    CHECK_EQ_U64(p.ring, 5u << 20);           /* the largest group */
    CHECK_EQ_INT((int)p.expert_slots, 2);     /* top-k */
    o.budget = floor - 1;
    CHECK_EQ_INT(k3_stream_plan_make(&sh, &c, &o, &p, &e), K3_EBUDGET);
    char want[64];
    snprintf(want, sizeof want, "floor of this model: %llu bytes", (unsigned long long)floor);
    CHECK_STR_CONTAINS(e.msg, want);
    uint64_t prev = UINT64_MAX;
    for (uint64_t b = floor; b <= res + (1 << 20); b += 1 << 19) {
        o.budget = b;
        CHECK_EQ_INT(k3_stream_plan_make(&sh, &c, &o, &p, &e), 0);
        CHECK(p.total <= b);
        CHECK(p.ring == 0 || p.ring >= p.largest_streamed);
        CHECK(p.expert_slots >= 2 && p.expert_slots <= 40);
        if (p.double_buffered)
            CHECK(p.trunk_streamed <= prev);
        if (p.double_buffered)
            prev = p.trunk_streamed;
    }
    CHECK_EQ_U64(p.trunk_streamed, 0);
    CHECK_EQ_INT((int)p.expert_slots, 40);
}

K3_TEST(stream_budget_sizes_and_presets_parse)
{
    uint64_t v = 0;
    CHECK_EQ_INT(k3_stream_parse_budget("4G", &v, NULL), 0);
    CHECK_EQ_U64(v, 4ull << 30);
    CHECK_EQ_INT(k3_stream_parse_budget("1.5GiB", &v, NULL), 0);
    CHECK_EQ_U64(v, 3ull << 29);
    CHECK_EQ_INT(k3_stream_parse_budget("640k", &v, NULL), 0);
    CHECK_EQ_U64(v, 640ull << 10);
    CHECK_EQ_INT(k3_stream_parse_budget("123456", &v, NULL), 0);
    CHECK_EQ_U64(v, 123456);
    CHECK_EQ_INT(k3_stream_parse_budget("floor", &v, NULL), 0);
    CHECK_EQ_U64(v, K3_STREAM_FLOOR);
    CHECK_EQ_INT(k3_stream_parse_budget("resident", &v, NULL), 0);
    CHECK_EQ_U64(v, K3_STREAM_RESIDENT);
    const char *bad[] = {"", "-1", "4X", "G", "1.5", "4GG", " 4G", "0"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        CHECK_EQ_INT(k3_stream_parse_budget(bad[i], &v, NULL), K3_EARG);
}
