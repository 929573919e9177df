/*
 * stream_plan.c - the memory plan of the streaming source: what is pinned,
 * how big the ring and the expert cache are, and the floor. Pure arithmetic
 * over a k3_stream_shape and the config; nothing is allocated here.
 *
 * Invariants of a plan: total <= budget; ring >= largest streamed group (or
 * 0 when every group is pinned); expert_slots >= top-k when the model has
 * MoE layers; every arena is counted as mapped (k3_stream_arena_bytes).
 * Choice: after the floor the budget goes first to a double-buffered ring
 * (overlapping reads with compute saves up to the compute time per token),
 * then to pinning trunk groups (trunk bytes are read every token for sure,
 * cached expert bytes only on a hit; every split "pin the p largest, then
 * greedily the rest" is tried and the one streaming fewest bytes wins), and
 * what is left goes to expert slots.
 */
#include <ctype.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#include "k3_io.h"
#include "k3_mem.h"
#include "k3_model.h"
#include "k3_schema.h"
#include "k3_stream.h"

#define MIB (1ull << 20)

void k3_stream_opts_init(k3_stream_opts *o)
{
    memset(o, 0, sizeof *o);
    o->budget = K3_STREAM_FLOOR;
    o->max_chunk = 64;
    o->max_ctx = 4096;
    o->nthreads = 1;
    o->io_threads = 4;
    o->trunk_crc = 1;
    o->expert_guess = 1;
    o->piece_bytes = K3_STREAM_PIECE_DEFAULT;
}

int k3_stream_parse_budget(const char *s, uint64_t *out, k3_err *e)
{
    if (!s || !*s)
        return k3_err_set(e, K3_EARG, "empty RAM budget");
    if (!strcmp(s, "floor") || !strcmp(s, "min")) {
        *out = K3_STREAM_FLOOR;
        return 0;
    }
    if (!strcmp(s, "double")) {
        *out = K3_STREAM_DOUBLE;
        return 0;
    }
    if (!strcmp(s, "resident") || !strcmp(s, "all")) {
        *out = K3_STREAM_RESIDENT;
        return 0;
    }
    if (!isdigit((unsigned char)s[0]))
        goto bad;
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || !(v >= 0.0))
        goto bad;
    double mul = 1.0;
    switch (toupper((unsigned char)*end)) {
    case 0: break;
    case 'K': mul = 1024.0; end++; break;
    case 'M': mul = 1024.0 * 1024.0; end++; break;
    case 'G': mul = 1024.0 * 1024.0 * 1024.0; end++; break;
    case 'T': mul = 1024.0 * 1024.0 * 1024.0 * 1024.0; end++; break;
    case 'B': break;
    default: goto bad;
    }
    if (mul > 1.0 && (*end == 'i' || *end == 'I'))
        end++;
    if (*end == 'B' || *end == 'b')
        end++;
    if (*end)
        goto bad;
    v *= mul;
    if (v < 2.0 || v > 1.8e19 || (mul == 1.0 && strchr(s, '.')))
        goto bad;
    *out = (uint64_t)v;
    return 0;
bad:
    return k3_err_set(e, K3_EARG,
                      "RAM budget '%s' is not a size (bytes, or with K/M/G/T) or a preset (floor, double, resident)",
                      s);
}

uint64_t k3_stream_arena_bytes(uint64_t n)
{
    if (n == 0)
        return 0;
    if (n >= 4 * MIB)
        return (n + 2 * MIB - 1) / (2 * MIB) * (2 * MIB);
    /* whole pages of the running kernel (4, 16 or 64 KiB), at least 4096 */
    uint64_t pg = k3_io_page_size() > 4096 ? k3_io_page_size() : 4096;
    return (n + pg - 1) / pg * pg;
}

void k3_stream_model_mem(const k3_cfg *c, uint32_t max_chunk, uint32_t max_ctx, uint32_t nthreads,
                         uint64_t *scratch, uint64_t *kv, uint64_t *state)
{
    k3_model_mem mm;   /* the model's own sizes; expert views for a whole layer (the most a source asks) */
    k3_model_mem_need(c, max_chunk, max_ctx, nthreads, &mm);
    *scratch = mm.model + mm.scores;
    *kv = mm.kv;
    *state = mm.state;
}

static uint64_t a64(uint64_t n) { return (n + 63) / 64 * 64; }

void k3_stream_cfg_groups(const k3_cfg *c, uint64_t *gb, uint64_t *embed_row, uint64_t *stride)
{
    uint32_t nrows;
    const k3_sch_row *rows = k3_schema_rows(&nrows);
    for (uint32_t L = 0; L <= c->num_hidden_layers; L++) {
        uint64_t b = 0, shape[3];
        for (uint32_t i = 0; i < nrows; i++)
            if (k3_schema_in_group(c, &rows[i], L))
                b += a64(k3_schema_shape(c, &rows[i], shape) * rows[i].est_bytes);
        gb[L] = (b + 4095) / 4096 * 4096;
    }
    const uint64_t LAT = c->routed_expert_hidden_size, I = c->moe_intermediate_size;
    *embed_row = (uint64_t)c->hidden_size * 2;
    uint64_t r = a64(I * LAT / 2) + a64(I * LAT / 32);
    r = 2 * r + a64(LAT * I / 2) + LAT * I / 32;
    *stride = c->num_hidden_layers > c->first_k_dense_replace ? (r + 4095) / 4096 * 4096 : 0;
}

/* The schema's streamable rows in its (the model's use) order, made once. */
static k3_wslot piece_order[K3_W_COUNT];
static uint32_t piece_n;
static pthread_once_t piece_once = PTHREAD_ONCE_INIT;

static void piece_init(void)
{
    uint32_t nrows;
    const k3_sch_row *rows = k3_schema_rows(&nrows);
    for (uint32_t i = 0; i < nrows; i++)
        if (rows[i].stream)
            piece_order[piece_n++] = (k3_wslot)rows[i].slot;
}

uint32_t k3_stream_piece_slots(const k3_wslot **slots)
{
    pthread_once(&piece_once, piece_init);
    *slots = piece_order;
    return piece_n;
}

void k3_stream_cfg_cores(const k3_cfg *c, uint64_t piece, const uint64_t *gb, uint64_t *cb, uint64_t *piece_max)
{
    const k3_wslot *order;
    const uint32_t norder = k3_stream_piece_slots(&order);
    *piece_max = 0;
    for (uint32_t L = 0; L <= c->num_hidden_layers; L++) {
        cb[L] = gb[L];
        for (uint32_t i = 0; i < norder && piece; i++) {
            const k3_sch_row *r = k3_schema_row((uint32_t)order[i]);
            if (!k3_schema_in_group(c, r, L))
                continue;
            uint64_t shape[3];
            k3_schema_shape(c, r, shape);
            const uint64_t rowb = shape[1] * 2, nb = shape[0] * rowb;   /* BF16, as k3_stream_cfg_groups */
            if (!nb || nb <= piece)
                continue;
            cb[L] -= nb;
            uint64_t rr = piece / rowb ? piece / rowb : 1;
            uint64_t pr = (rr * rowb + 4095) / 4096 * 4096 + 4096;
            if (pr > *piece_max)
                *piece_max = pr;
        }
        cb[L] = (cb[L] + 4095) / 4096 * 4096 + 4096 * 4;   /* segments widened at both ends */
        if (cb[L] > gb[L])
            cb[L] = gb[L];
    }
}

/* Largest slot count whose arena fits in room bytes. */
static uint32_t slots_in(uint64_t room, uint64_t stride, uint64_t cap)
{
    if (!stride)
        return 0;
    uint64_t s = room / stride;
    if (s > cap)
        s = cap;
    while (s > 0 && k3_stream_arena_bytes(s * stride) > room)
        s--;
    return (uint32_t)s;
}

typedef struct cand {
    uint8_t pinned[K3_CFG_MAX_LAYERS + 1];
    uint64_t pinned_bytes, streamed, ring, largest, pring, pmin;
    uint32_t slots;
    int dbl;
} cand;

int k3_stream_plan_make(const k3_stream_shape *sh, const k3_cfg *c, const k3_stream_opts *o, k3_stream_plan *p,
                        k3_err *e)
{
    memset(p, 0, sizeof *p);
    const uint32_t G = sh->ngroups;
    if (G == 0 || G > K3_CFG_MAX_LAYERS + 1)
        return k3_err_set(e, K3_EINTERNAL, "plan: %u trunk groups", G);
    p->ngroups = G;
    k3_stream_model_mem(c, o->max_chunk, o->max_ctx, o->nthreads, &p->scratch, &p->kv, &p->state);
    p->scratch += o->extra_bytes;
    p->io = 2 * (sh->embed_row_bytes + 3 * 4096) + (uint64_t)c->hidden_size * 4;
    p->runtime = o->baseline + K3_STREAM_ALLOWANCE;
    const uint64_t fixed = p->scratch + p->kv + p->state + p->io + p->runtime;

    uint32_t order[K3_CFG_MAX_LAYERS + 1];
    uint64_t all = 0;
    for (uint32_t g = 0; g < G; g++) {
        order[g] = g;
        all += sh->group_bytes[g];
    }
    for (uint32_t i = 1; i < G; i++)   /* sort by size, descending; stable on index */
        for (uint32_t j = i; j > 0 && sh->group_bytes[order[j]] > sh->group_bytes[order[j - 1]]; j--) {
            uint32_t t = order[j];
            order[j] = order[j - 1];
            order[j - 1] = t;
        }
    p->trunk_total = all;
    const uint64_t *cb = sh->core_bytes ? sh->core_bytes : sh->group_bytes;
    uint64_t maxg = 0;
    int any_piece = 0;
    for (uint32_t g = 0; g < G; g++) {
        if (cb[g] > maxg)
            maxg = cb[g];
        any_piece |= cb[g] < sh->group_bytes[g];
    }
    /* the piece ring always holds two pieces: pieces exist to be read while
     * the previous one is multiplied */
    const uint64_t pmax = any_piece ? 2 * sh->piece_max : 0;
    const uint64_t nrec = sh->expert_stride ? (uint64_t)sh->n_moe_layers * sh->num_experts : 0;
    const uint32_t kmin = sh->expert_stride ? sh->top_k : 0;
    const uint64_t xmin = k3_stream_arena_bytes(kmin * sh->expert_stride);
    p->floor = fixed + k3_stream_arena_bytes(maxg) + k3_stream_arena_bytes(pmax) + xmin;
    p->floor_double = fixed + k3_stream_arena_bytes(2 * maxg) + k3_stream_arena_bytes(pmax) + xmin;
    p->resident = fixed + k3_stream_arena_bytes(all) + k3_stream_arena_bytes(nrec * sh->expert_stride);

    uint64_t B = o->budget;
    if (B == K3_STREAM_FLOOR)
        B = p->floor;
    else if (B == K3_STREAM_DOUBLE)
        B = p->floor_double;
    else if (B == K3_STREAM_RESIDENT)
        B = p->resident;
    p->budget = B;
    if (B < p->floor)
        return k3_err_set(e, K3_EBUDGET,
                          "RAM budget %llu bytes (%.2f GiB) is below the floor of this model: %llu bytes (%.2f GiB) "
                          "= largest trunk group %llu + %u expert slots of %llu + model %llu + runtime %llu",
                          (unsigned long long)B, B / 1073741824.0, (unsigned long long)p->floor,
                          p->floor / 1073741824.0, (unsigned long long)maxg, kmin,
                          (unsigned long long)sh->expert_stride,
                          (unsigned long long)(p->scratch + p->kv + p->state + p->io),
                          (unsigned long long)p->runtime);

    cand best, cur;
    int have = 0;
    if (B >= p->resident && !o->no_pin) {
        memset(&best, 0, sizeof best);
        for (uint32_t g = 0; g < G; g++)
            best.pinned[g] = 1;
        best.pinned_bytes = all;
        best.slots = (uint32_t)nrec;
        best.dbl = 1;
        have = 1;
    }
    for (uint32_t np = 0; np <= (o->no_pin ? 0 : G); np++) {
        if (have && best.streamed == 0 && best.slots == nrec)
            break;
        memset(&cur, 0, sizeof cur);
        for (uint32_t i = 0; i < np; i++) {
            cur.pinned[order[i]] = 1;
            cur.pinned_bytes += sh->group_bytes[order[i]];
        }
        int pieces = 0;
        for (uint32_t i = np; i < G; i++) {
            if (cb[order[i]] > cur.largest)
                cur.largest = cb[order[i]];
            pieces |= cb[order[i]] < sh->group_bytes[order[i]];
        }
        cur.ring = cur.largest;
        cur.pmin = pieces ? pmax : 0;
        cur.pring = cur.pmin;
        uint64_t cost = fixed + k3_stream_arena_bytes(cur.pinned_bytes) + k3_stream_arena_bytes(cur.ring) +
                        k3_stream_arena_bytes(cur.pring) + xmin;
        if (cost > B)
            continue;
        uint64_t left = B - cost;
        uint64_t d2 = k3_stream_arena_bytes(2 * cur.largest) - k3_stream_arena_bytes(cur.largest);
        if (cur.largest == 0 || d2 <= left) {
            cur.dbl = 1;
            if (cur.largest) {
                cur.ring = 2 * cur.largest;
                left -= d2;
            }
        }
        for (uint32_t i = np + 1; i < G && !o->no_pin; i++) {
            uint64_t nb = cur.pinned_bytes + sh->group_bytes[order[i]];
            uint64_t d = k3_stream_arena_bytes(nb) - k3_stream_arena_bytes(cur.pinned_bytes);
            if (d <= left) {
                left -= d;
                cur.pinned[order[i]] = 1;
                cur.pinned_bytes = nb;
            }
        }
        cur.streamed = all - cur.pinned_bytes;
        if (cur.streamed == 0) {   /* nothing left to stream: the rings go back to the experts */
            left += k3_stream_arena_bytes(cur.ring) + k3_stream_arena_bytes(cur.pring);
            cur.ring = 0;
            cur.largest = 0;
            cur.pring = 0;
            cur.pmin = 0;
        }
        cur.slots = kmin ? slots_in(xmin + left, sh->expert_stride, nrec) : 0;
        if (cur.slots < kmin)
            continue;
        int better = !have || cur.dbl > best.dbl ||
                     (cur.dbl == best.dbl && (cur.streamed < best.streamed ||
                                              (cur.streamed == best.streamed && cur.slots > best.slots)));
        if (better) {
            best = cur;
            have = 1;
        }
    }
    if (!have)
        return k3_err_set(e, K3_EINTERNAL, "plan: no layout fits %llu bytes above the floor", (unsigned long long)B);
    memcpy(p->pinned, best.pinned, sizeof p->pinned);
    p->trunk_pinned = best.pinned_bytes;
    p->trunk_streamed = all - best.pinned_bytes;
    p->n_pinned = 0;
    for (uint32_t g = 0; g < G; g++)
        p->n_pinned += best.pinned[g];
    p->ring = best.ring;
    p->largest_streamed = best.largest;
    p->double_buffered = best.dbl;
    p->piece_ring = best.pring;
    p->piece_max = best.pmin;
    p->expert_slots = best.slots;
    p->expert_bytes = k3_stream_arena_bytes((uint64_t)best.slots * sh->expert_stride);
    p->mapped_pinned = k3_stream_arena_bytes(p->trunk_pinned);
    p->mapped_ring = k3_stream_arena_bytes(p->ring);
    p->total = fixed + p->mapped_pinned + p->mapped_ring + k3_stream_arena_bytes(p->piece_ring) + p->expert_bytes;
    if (p->total > B)
        return k3_err_set(e, K3_EINTERNAL, "plan: total %llu exceeds the budget %llu", (unsigned long long)p->total,
                          (unsigned long long)B);
    return 0;
}

static double gib(uint64_t n) { return (double)n / 1073741824.0; }

/* "12.345 GiB" or "12.345 MiB" */
static const char *sz(char *buf, uint64_t n)
{
    if (n >= (1ull << 30))
        snprintf(buf, 32, "%9.3f GiB", gib(n));
    else
        snprintf(buf, 32, "%9.3f MiB", (double)n / 1048576.0);
    return buf;
}

int k3_stream_plan_check_memory(const k3_stream_plan *p, k3_err *e)
{
    uint64_t avail;
    const char *src;
    if (k3_mem_available(&avail, &src) < 0)
        return 0;   /* nothing known: nothing refused */
    const double G = 1073741824.0;
    if (p->floor > avail)
        return k3_err_set(e, K3_EBUDGET,
                          "the floor of this model is %llu bytes (%.2f GiB), more than the memory available: "
                          "%llu bytes (%.2f GiB, %s)",
                          (unsigned long long)p->floor, p->floor / G, (unsigned long long)avail, avail / G, src);
    if (p->budget > avail)
        return k3_err_set(e, K3_EBUDGET,
                          "RAM budget %llu bytes (%.2f GiB) is more than the memory available: %llu bytes "
                          "(%.2f GiB, %s); give a smaller --ram",
                          (unsigned long long)p->budget, p->budget / G, (unsigned long long)avail, avail / G, src);
    return 0;
}

void k3_stream_plan_print(const k3_stream_plan *p, FILE *f, const char *pre)
{
    char a[32], b[32], c[32], d[32];
    fprintf(f, "%smemory plan for a budget of %llu bytes (%s):\n", pre, (unsigned long long)p->budget,
            sz(a, p->budget));
    fprintf(f, "%s  trunk pinned   %s  %u of %u groups\n", pre, sz(a, p->mapped_pinned), p->n_pinned, p->ngroups);
    fprintf(f, "%s  trunk streamed %s  read per token through the ring\n", pre, sz(a, p->trunk_streamed));
    fprintf(f, "%s  ring           %s  largest streamed group %s, %s\n", pre, sz(a, p->mapped_ring),
            sz(b, p->largest_streamed),
            p->ring == 0 ? "unused" : p->double_buffered ? "double-buffered" : "single slot");
    if (p->piece_ring)
        fprintf(f, "%s  piece ring     %s  two row pieces of the largest matrices, %s each\n", pre,
                sz(a, k3_stream_arena_bytes(p->piece_ring)), sz(b, p->piece_max / 2));
    fprintf(f, "%s  expert cache   %s  %u whole-record slots\n", pre, sz(a, p->expert_bytes), p->expert_slots);
    fprintf(f, "%s  kv cache       %s\n", pre, sz(a, p->kv));
    fprintf(f, "%s  state          %s\n", pre, sz(a, p->state));
    fprintf(f, "%s  scratch        %s  (+ I/O buffers %s)\n", pre, sz(a, p->scratch), sz(b, p->io));
    fprintf(f, "%s  runtime        %s  measured RSS + %llu MiB allowance\n", pre, sz(a, p->runtime),
            (unsigned long long)(K3_STREAM_ALLOWANCE >> 20));
    fprintf(f, "%s  total          %s  (%llu bytes)\n", pre, sz(a, p->total), (unsigned long long)p->total);
    fprintf(f, "%s  floor          %s  (%llu bytes; double-buffered %s; resident %s)\n", pre, sz(b, p->floor),
            (unsigned long long)p->floor, sz(c, p->floor_double), sz(d, p->resident));
}

uint64_t k3_stream_rss_now(void)
{
    FILE *f = fopen("/proc/self/statm", "r");
    unsigned long long size = 0, res = 0;
    if (f) {
        if (fscanf(f, "%llu %llu", &size, &res) != 2)
            res = 0;
        fclose(f);
    }
    return (uint64_t)res * (uint64_t)sysconf(_SC_PAGESIZE);
}

uint64_t k3_stream_rss_peak(void)
{
    struct rusage ru;
    if (getrusage(RUSAGE_SELF, &ru) != 0)
        return 0;
    return (uint64_t)ru.ru_maxrss * 1024;
}
