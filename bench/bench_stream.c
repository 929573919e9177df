/*
 * bench_stream.c - the O_DIRECT read bandwidth of a packed model's own
 * files, the I/O limit bench_stream.sh sets k3-run --ram against: the trunk
 * read as the ring reads it (the units of the layers and the head - not the
 * embedding, which is read row by row - in 2 MiB chunks, as k3-run reads
 * them, and in 16 MiB chunks, over THREADS parallel preads into a 2 MiB-aligned
 * huge-page buffer; the faster of the two is the limit) and expert records read as the cache reads them (random
 * records, whole stride, THREADS parallel preads into huge-page slots).
 * Page cache cannot help: every read is O_DIRECT (a file that refuses
 * O_DIRECT is reported and read buffered).
 *
 *   bin/bench-bench_stream PACKED_DIR [--mb N] [--threads N] [--json]
 *   bin/bench-bench_stream PACKED_DIR --mix SHARE [--chunk-kb N] [--block MB] [--rounds N]
 *                          [--busy N] [--mb N] [--threads N]
 *   bin/bench-bench_stream --plan CONFIG_JSON [--ctx N] [--chunk N] [--threads N]
 *                          [--baseline BYTES] [--ram SIZE|floor|double|resident]
 *
 *   bin/bench-bench_stream --replay TRACE SLOTS...
 *
 * The third form replays an expert trace written by k3-run --trace against
 * caches of SLOTS records under LRU (what k3-run does), LFU (ties to the
 * least recent) and Belady's MIN (the offline optimum: an upper bound no
 * online policy reaches), and prints the hit rates.
 *
 * The --mix form reads trunk chunks and expert records in one stream, SHARE
 * of its bytes trunk (at the floor on k3-width about 0.92), against the same
 * reads kind by kind: whether the device serves the run's mix as fast as the
 * separate passes the I/O bound is made of (see mix_main); --busy N keeps N
 * threads spinning on arithmetic meanwhile, as a run's products keep the
 * cores busy while its reads go on.
 *
 * The second form prints the memory plan k3-run --ram would make for a
 * model of that config laid out by k3-convert (k3_stream_cfg_groups), with
 * a runtime baseline of BYTES (default 16 MiB: a k3-run process with the K3
 * tokenizer loaded measures about that) - the floor of the real K3 shape
 * without converting 1.56 TB.
 *
 * Prints GB/s (1e9 bytes) for both, each the median of 3 passes of about N MB
 * (default 2048) after one warm-up pass.
 */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "k3_io.h"
#include "k3_pk.h"
#include "k3_stream.h"

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

typedef struct job {
    const k3_pk *pk;
    uint32_t layer0, nlayers, nexp, n, tid, nth;
    uint8_t *buf;
    uint64_t seed;
    int rc;
} job;

static uint64_t rnd(uint64_t *s)
{
    *s += 0x9e3779b97f4a7c15ull;
    uint64_t z = *s;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static void *rec_main(void *arg)
{
    job *j = arg;
    for (uint32_t i = j->tid; i < j->n; i += j->nth) {
        uint32_t l = j->layer0 + (uint32_t)(rnd(&j->seed) % j->nlayers);
        uint32_t x = (uint32_t)(rnd(&j->seed) % j->nexp);
        k3_err e = {0};
        if (k3_pk_read_record(j->pk, l, x, j->buf, 0, &e) < 0) {
            fprintf(stderr, "bench_stream: %s\n", e.msg);
            j->rc = -1;
            return NULL;
        }
    }
    return NULL;
}

typedef struct tjob {
    const k3_pk *pk;
    const k3_pk_unit *u;
    uint8_t *buf;
    uint64_t ch;   /* chunk size */
    uint32_t tid, nth;
    int rc;
} tjob;

static void *unit_main(void *arg)
{
    tjob *j = arg;
    const uint64_t CH = j->ch;
    for (uint64_t o = (uint64_t)j->tid * CH; o < j->u->nbytes; o += (uint64_t)j->nth * CH) {
        uint64_t n = j->u->nbytes - o < CH ? j->u->nbytes - o : CH;
        k3_err e = {0};
        if (k3_pk_read(j->pk, j->u->file, j->buf + o, n, j->u->offset + o, NULL, 0, &e) < 0) {
            fprintf(stderr, "bench_stream: %s\n", e.msg);
            j->rc = -1;
            return NULL;
        }
    }
    return NULL;
}

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

typedef struct req {
    uint32_t key;
    uint32_t next;   /* index of the next request of the same key (UINT32_MAX: none) */
} req;

/* Layers come round in a fixed cycle: the record whose layer comes back last
 * (counting from the layer being served) is evicted first; LRU among equals.
 * What k3-run does (ws_stream.c find_victim). */
static uint32_t cyc_dist(uint32_t key_layer, uint32_t cur_layer, uint32_t lmin, uint32_t nl)
{
    return (key_layer + nl - cur_layer - 1) % nl + 0 * lmin;   /* 0: next layer ... nl-1: this layer */
}

/* Hit count of one policy: 0 LRU, 1 LFU, 2 MIN, 3 cyclic. O(n * slots), fine for traces. */
static uint64_t simulate(const req *r, uint32_t n, uint32_t slots, int policy)
{
    uint32_t lmin = UINT32_MAX, lmax = 0;
    for (uint32_t i = 0; i < n; i++) {
        uint32_t l = r[i].key >> 16;
        lmin = l < lmin ? l : lmin;
        lmax = l > lmax ? l : lmax;
    }
    const uint32_t nl = n ? lmax + 1 : 1;
    uint32_t *key = calloc(slots, sizeof *key);
    uint64_t *last = calloc(slots, sizeof *last), *freq = calloc(slots, sizeof *freq), *nxt = calloc(slots, sizeof *nxt);
    uint32_t used = 0;
    uint64_t hits = 0;
    for (uint32_t i = 0; i < n; i++) {
        uint32_t s = UINT32_MAX;
        for (uint32_t k = 0; k < used; k++)
            if (key[k] == r[i].key)
                s = k;
        if (s != UINT32_MAX) {
            hits++;
        } else if (used < slots) {
            s = used++;
            key[s] = r[i].key;
            freq[s] = 0;
        } else {
            s = 0;
            for (uint32_t k = 1; k < used; k++) {
                uint32_t cur = r[i].key >> 16;
                uint32_t dk = cyc_dist(key[k] >> 16, cur, lmin, nl), ds = cyc_dist(key[s] >> 16, cur, lmin, nl);
                int better = policy == 0 ? last[k] < last[s]
                           : policy == 1 ? (freq[k] < freq[s] || (freq[k] == freq[s] && last[k] < last[s]))
                           : policy == 2 ? nxt[k] > nxt[s]
                                         : (dk > ds || (dk == ds && last[k] < last[s]));
                if (better)
                    s = k;
            }
            key[s] = r[i].key;
            freq[s] = 0;
        }
        last[s] = i;
        freq[s]++;
        nxt[s] = r[i].next == UINT32_MAX ? UINT64_MAX : r[i].next;
    }
    free(key);
    free(last);
    free(freq);
    free(nxt);
    return hits;
}

static int replay_main(int argc, char **argv)
{
    FILE *f = fopen(argv[2], "r");
    if (!f) {
        fprintf(stderr, "bench_stream: cannot open %s: %s\n", argv[2], strerror(errno));
        return 4;
    }
    uint32_t cap = 1024, n = 0;
    req *r = malloc(cap * sizeof *r);
    char line[256];
    while (r && fgets(line, sizeof line, f)) {
        unsigned long long fw;
        unsigned l, x;
        char hm;
        if (line[0] == '#' || sscanf(line, "%llu %u %u %c", &fw, &l, &x, &hm) != 4)
            continue;
        if (n == cap) {
            req *t = realloc(r, (cap *= 2) * sizeof *r);
            if (!t)
                break;
            r = t;
        }
        r[n].key = l * 65536u + x;
        r[n].next = UINT32_MAX;
        n++;
    }
    fclose(f);
    if (!r)
        return 6;
    for (uint32_t i = n; i-- > 0;)   /* next use of each request's key */
        for (uint32_t j = i + 1; j < n; j++)
            if (r[j].key == r[i].key) {
                r[i].next = j;
                break;
            }
    uint32_t distinct = 0;
    for (uint32_t i = 0; i < n; i++) {
        int seen = 0;
        for (uint32_t j = 0; j < i && !seen; j++)
            seen = r[j].key == r[i].key;
        distinct += !seen;
    }
    printf("trace %s: %u requests, %u distinct records (compulsory misses)\n", argv[2], n, distinct);
    for (int i = 3; i < argc; i++) {
        uint32_t slots = (uint32_t)strtoul(argv[i], NULL, 10);
        if (!slots)
            continue;
        printf("  %5u slots: LRU %5.1f%%  LFU %5.1f%%  cyclic %5.1f%%  MIN (offline bound) %5.1f%%\n", slots,
               100.0 * simulate(r, n, slots, 0) / (n ? n : 1), 100.0 * simulate(r, n, slots, 1) / (n ? n : 1),
               100.0 * simulate(r, n, slots, 3) / (n ? n : 1), 100.0 * simulate(r, n, slots, 2) / (n ? n : 1));
    }
    free(r);
    return 0;
}

static int plan_main(int argc, char **argv)
{
    k3_stream_opts o;
    k3_stream_opts_init(&o);
    o.baseline = 16ull << 20;
    o.piece_bytes = 0;
    o.nthreads = 2;
    for (int i = 3; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--ctx"))
            o.max_ctx = (uint32_t)strtoul(argv[i + 1], NULL, 10);
        else if (!strcmp(argv[i], "--chunk"))
            o.max_chunk = (uint32_t)strtoul(argv[i + 1], NULL, 10);
        else if (!strcmp(argv[i], "--threads"))
            o.nthreads = (uint32_t)strtoul(argv[i + 1], NULL, 10);
        else if (!strcmp(argv[i], "--piece")) {
            if (strcmp(argv[i + 1], "0") && k3_stream_parse_budget(argv[i + 1], &o.piece_bytes, NULL) < 0)
                return 2;
        } else if (!strcmp(argv[i], "--baseline"))
            o.baseline = strtoull(argv[i + 1], NULL, 10);
        else if (!strcmp(argv[i], "--ram")) {
            if (k3_stream_parse_budget(argv[i + 1], &o.budget, NULL) < 0)
                return 2;
        } else {
            fprintf(stderr, "bench_stream: unknown option %s\n", argv[i]);
            return 2;
        }
    }
    k3_cfg c;
    k3_err e = {0};
    if (k3_cfg_load(&c, argv[2], &e) < 0) {
        fprintf(stderr, "bench_stream: %s\n", e.msg);
        return 3;
    }
    uint64_t gb[K3_CFG_MAX_LAYERS + 1], row, stride;
    k3_stream_cfg_groups(&c, gb, &row, &stride);
    uint32_t nmoe = c.num_hidden_layers > c.first_k_dense_replace ? c.num_hidden_layers - c.first_k_dense_replace : 0;
    uint64_t cb[K3_CFG_MAX_LAYERS + 1], pmax = 0;
    k3_stream_cfg_cores(&c, o.piece_bytes, gb, cb, &pmax);
    k3_stream_shape sh = {c.num_hidden_layers + 1, gb, row, stride, nmoe, c.num_experts, c.num_experts_per_token,
                          cb, pmax};
    k3_stream_plan p;
    int rc = k3_stream_plan_make(&sh, &c, &o, &p, &e);
    if (rc < 0) {
        fprintf(stderr, "bench_stream: %s\n", e.msg);
        return 6;
    }
    uint64_t big = 0;
    for (uint32_t g = 0; g <= c.num_hidden_layers; g++)
        if (gb[g] > big)
            big = gb[g];
    printf("plan from %s (ctx %u, chunk %u, %u threads, baseline %llu bytes, pieces %llu bytes); largest trunk "
           "group %llu bytes, expert record %llu bytes\n", argv[2], o.max_ctx, o.max_chunk, o.nthreads,
           (unsigned long long)o.baseline, (unsigned long long)o.piece_bytes, (unsigned long long)big,
           (unsigned long long)stride);
    k3_stream_plan_print(&p, stdout, "");
    return 0;
}


/* --mix: the floor's reads as the run issues them. A stream of trunk chunks
 * (16 MiB, the units of the layers and the head in order, the cursor going on
 * across passes so that every byte of the trunk comes round, as in a run) and
 * whole expert records (random layer and expert), SHARE of its bytes trunk,
 * served by THREADS threads taking the next read in the stream's order.
 * Four orders of the same kinds of reads, interleaved pass by pass:
 *   trunk    - trunk chunks only;
 *   records  - records only;
 *   mixed    - one stream, each read the kind that is behind its share (what
 *              the run's I/O threads see at the floor);
 *   blocks   - the same bytes in blocks of BLOCK MB of one kind at a time.
 * "separate" is the rate the mixed bytes would have at the trunk and records
 * passes' own rates, one kind after the other: the I/O bound bench_stream.sh
 * uses. */
typedef struct mread {
    uint32_t file, layer, expert;   /* layer == UINT32_MAX: a trunk chunk */
    uint64_t off, n;
} mread;

typedef struct mjob {
    const k3_pk *pk;
    const mread *r;
    uint32_t n, *next;
    uint8_t *buf;
    int rc;
} mjob;

static void *mix_main_thread(void *arg)
{
    mjob *j = arg;
    for (;;) {
        uint32_t i = __atomic_fetch_add(j->next, 1, __ATOMIC_RELAXED);
        if (i >= j->n)
            return NULL;
        const mread *r = &j->r[i];
        k3_err e = {0};
        int rc = r->layer == UINT32_MAX ? k3_pk_read(j->pk, r->file, j->buf, r->n, r->off, NULL, 0, &e)
                                        : k3_pk_read_record(j->pk, r->layer, r->expert, j->buf, 0, &e);
        if (rc < 0) {
            fprintf(stderr, "bench_stream: %s\n", e.msg);
            j->rc = -1;
            return NULL;
        }
    }
}

/* Run reads r[0..n) over nth threads; GB/s, or -1 on a read error. */
static double mix_run(const k3_pk *pk, const mread *r, uint32_t n, uint32_t nth, uint8_t *bufs, uint64_t bcap)
{
    mjob j[64];
    pthread_t th[64];
    uint32_t next = 0;
    uint64_t bytes = 0;
    for (uint32_t i = 0; i < n; i++)
        bytes += r[i].n;
    double t0 = now_s();
    for (uint32_t t = 0; t < nth; t++) {
        j[t] = (mjob){pk, r, n, &next, bufs + t * bcap, 0};
        pthread_create(&th[t], NULL, mix_main_thread, &j[t]);
    }
    int bad = 0;
    for (uint32_t t = 0; t < nth; t++) {
        pthread_join(th[t], NULL);
        bad |= j[t].rc;
    }
    return bad ? -1 : (double)bytes / (now_s() - t0) / 1e9;
}

/* --busy: threads that keep the cores busy with arithmetic alone (no memory
 * traffic) while the reads run, as a run's products do at the floor. */
static volatile int spin_stop;

static void *spin_main(void *arg)
{
    volatile double x = 1.0;
    (void)arg;
    while (!spin_stop)
        for (int i = 0; i < 100000; i++)
            x = x * 1.0000001 + 1e-9;
    return NULL;
}

typedef struct mcursor {
    const k3_pk *pk;
    uint32_t unit;
    uint64_t off;
    uint64_t seed;
} mcursor;

static mread mix_next(mcursor *c, int trunk, uint64_t chunk)
{
    const k3_pk *pk = c->pk;
    if (trunk) {
        const k3_pk_unit *u = k3_pk_unit_at(pk, c->unit);
        while (u->layer == K3_PK_LAYER_EMBED || c->off >= u->nbytes) {
            c->unit = (c->unit + 1) % k3_pk_unit_count(pk);
            c->off = 0;
            u = k3_pk_unit_at(pk, c->unit);
        }
        uint64_t n = u->nbytes - c->off < chunk ? u->nbytes - c->off : chunk;
        mread r = {u->file, UINT32_MAX, 0, u->offset + c->off, n};
        c->off += n;
        return r;
    }
    const k3_cfg *cf = k3_pk_cfg(pk);
    uint32_t l0 = cf->first_k_dense_replace, nl = cf->num_hidden_layers - l0;
    mread r = {0, l0 + (uint32_t)(rnd(&c->seed) % nl), (uint32_t)(rnd(&c->seed) % cf->num_experts), 0,
               k3_pk_experts(pk)->stride};
    return r;
}

/* The reads of one pass of about mb MB, trunk share `share`, in `order`:
 * 0 trunk only, 1 records only, 2 mixed, 3 blocks of block bytes. */
static uint32_t mix_list(mcursor *c, mread *r, uint32_t cap, uint64_t mb, double share, int order, uint64_t block,
                         uint64_t CH)
{
    const uint64_t total = mb * 1000000ull;
    uint64_t tb = 0, xb = 0;
    uint32_t n = 0;
    int cur = 1;
    uint64_t in_block = 0;
    while (tb + xb < total && n < cap) {
        int trunk;
        if (order == 0 || order == 1)
            trunk = order == 0;
        else if (order == 2)
            trunk = (double)tb <= share * (double)(tb + xb);
        else {
            /* a block of records is the trunk block scaled to the share */
            if (in_block >= (cur ? block : (uint64_t)((double)block * (1 - share) / (share > 0 ? share : 1)))) {
                cur = !cur;
                in_block = 0;
            }
            trunk = cur;
            if ((trunk && share <= 0) || (!trunk && share >= 1))
                trunk = !trunk;
        }
        r[n] = mix_next(c, trunk, CH);
        *(trunk ? &tb : &xb) += r[n].n;
        in_block += r[n].n;
        n++;
    }
    return n;
}

static int mix_main(const k3_pk *pk, uint64_t mb, uint32_t nth, double share, uint64_t block_mb, int rounds,
                    uint64_t tchunk, uint32_t busy)
{
    pthread_t spin[64];
    for (uint32_t i = 0; i < busy; i++)
        pthread_create(&spin[i], NULL, spin_main, NULL);
    const k3_pk_expert_layout *lay = k3_pk_experts(pk);
    if (!lay) {
        fprintf(stderr, "bench_stream: --mix needs a model with expert records\n");
        return 2;
    }
    uint64_t bcap = lay->stride > (16ull << 20) ? lay->stride : (16ull << 20);
    bcap = (bcap + (2ull << 20) - 1) & ~((2ull << 20) - 1);
    uint8_t *bufs = k3_io_huge_alloc(bcap * nth);
    uint32_t cap = (uint32_t)(mb * 1000000ull / (tchunk < lay->stride ? tchunk : lay->stride)) + 16;
    mread *r = malloc(sizeof *r * cap);
    if (!bufs || !r) {
        fprintf(stderr, "bench_stream: out of memory\n");
        return 4;
    }
    mcursor c = {pk, 0, 0, 99};
    double rate[4][16];
    uint64_t tbytes[4][16], xbytes[4][16];
    static const char *name[4] = {"trunk", "records", "mixed", "blocks"};
    if (rounds > 16)
        rounds = 16;
    for (int p = -1; p < rounds; p++)        /* pass -1: a warm-up, not counted */
        for (int o = 0; o < 4; o++) {
            uint32_t n = mix_list(&c, r, cap, mb, share, o, block_mb * 1000000ull, tchunk);
            uint64_t tb = 0, xb = 0;
            for (uint32_t i = 0; i < n; i++)
                *(r[i].layer == UINT32_MAX ? &tb : &xb) += r[i].n;
            double g = mix_run(pk, r, n, nth, bufs, bcap);
            if (g < 0)
                return 4;
            if (p >= 0) {
                rate[o][p] = g;
                tbytes[o][p] = tb;
                xbytes[o][p] = xb;
            }
        }
    double med[4];
    for (int o = 0; o < 4; o++) {
        double s[16];
        memcpy(s, rate[o], sizeof(double) * (size_t)rounds);
        qsort(s, (size_t)rounds, sizeof(double), cmp_d);
        med[o] = s[rounds / 2];
    }
    /* the separate bound for the mixed pass's bytes, per round, then its median */
    double sep[16];
    for (int p = 0; p < rounds; p++) {
        double t = (double)tbytes[2][p] / (rate[0][p] * 1e9) + (double)xbytes[2][p] / (rate[1][p] * 1e9);
        sep[p] = (double)(tbytes[2][p] + xbytes[2][p]) / t / 1e9;
    }
    double ss[16];
    memcpy(ss, sep, sizeof(double) * (size_t)rounds);
    qsort(ss, (size_t)rounds, sizeof(double), cmp_d);
    printf("O_DIRECT mix of trunk %llu KiB chunks and expert records (%.0f%% trunk), %u threads, %llu MB a pass, "
           "medians of %d interleaved rounds%s:\n", (unsigned long long)(tchunk >> 10), 100 * share, nth,
           (unsigned long long)mb, rounds, busy ? ", the cores kept busy by spinning threads" : "");
    for (int o = 0; o < 4; o++) {
        printf("  %-8s %6.3f GB/s  [", name[o], med[o]);
        for (int p = 0; p < rounds; p++)
            printf("%s%.2f", p ? " " : "", rate[o][p]);
        printf("]\n");
    }
    printf("  separate %6.3f GB/s  (the mixed bytes at the trunk and records rates of each round)\n", ss[rounds / 2]);
    printf("  mixed / separate %.2f, blocks of %llu MB / separate %.2f\n", med[2] / ss[rounds / 2],
           (unsigned long long)block_mb, med[3] / ss[rounds / 2]);
    spin_stop = 1;
    for (uint32_t i = 0; i < busy; i++)
        pthread_join(spin[i], NULL);
    free(r);
    k3_io_huge_free(bufs, bcap * nth);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc >= 3 && !strcmp(argv[1], "--plan"))
        return plan_main(argc, argv);
    if (argc >= 4 && !strcmp(argv[1], "--replay"))
        return replay_main(argc, argv);
    if (argc < 2) {
        fprintf(stderr, "usage: bench-bench_stream PACKED_DIR [--mb N] [--threads N] [--json]\n");
        return 2;
    }
    uint64_t mb = 2048;
    uint32_t nth = 4;
    int json = 0, rounds = 3;
    double share = -1;
    uint64_t block_mb = 512, tchunk_kb = 16384;
    uint32_t busy = 0;
    for (int i = 2; i < argc; i++) {
        if (!strcmp(argv[i], "--mb") && i + 1 < argc)
            mb = strtoull(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--threads") && i + 1 < argc)
            nth = (uint32_t)strtoul(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--json"))
            json = 1;
        else if (!strcmp(argv[i], "--mix") && i + 1 < argc)
            share = strtod(argv[++i], NULL);
        else if (!strcmp(argv[i], "--block") && i + 1 < argc)
            block_mb = strtoull(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--chunk-kb") && i + 1 < argc)
            tchunk_kb = strtoull(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--busy") && i + 1 < argc)
            busy = (uint32_t)strtoul(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--rounds") && i + 1 < argc)
            rounds = atoi(argv[++i]);
        else {
            fprintf(stderr, "bench_stream: unknown option %s\n", argv[i]);
            return 2;
        }
    }
    if (mb == 0 || nth == 0 || nth > 64) {
        fprintf(stderr, "bench_stream: bad --mb or --threads\n");
        return 2;
    }
    k3_pk *pk = NULL;
    k3_err e = {0};
    if (k3_pk_open(&pk, argv[1], K3_PK_DIRECT, &e) < 0) {
        fprintf(stderr, "bench_stream: %s\n", e.msg);
        return 4;
    }
    int direct = 1;
    for (uint32_t i = 0; i < k3_pk_file_count(pk); i++)
        if (k3_pk_file_at(pk, i)->kind <= K3_PK_FILE_EXPERTS && !k3_pk_file_is_direct(pk, i))
            direct = 0;
    if (share >= 0) {
        if (share > 1 || rounds < 1 || block_mb == 0 || tchunk_kb == 0 || tchunk_kb % 4 || busy > 64) {
            fprintf(stderr, "bench_stream: --mix takes a share in [0, 1], --rounds and --block at least 1\n");
            return 2;
        }
        int rc = mix_main(pk, mb, nth, share, block_mb, rounds, tchunk_kb << 10, busy);
        k3_pk_close(pk);
        return rc;
    }
    /* trunk: as the ring reads it - every unit in 16 MiB chunks spread over
     * the threads, into one huge-page buffer */
    uint64_t umax = 0;
    for (uint32_t u = 0; u < k3_pk_unit_count(pk); u++)
        if (k3_pk_unit_at(pk, u)->nbytes > umax && k3_pk_unit_at(pk, u)->layer != K3_PK_LAYER_EMBED)
            umax = k3_pk_unit_at(pk, u)->nbytes;
    uint8_t *ubuf = k3_io_huge_alloc(umax);
    static const uint64_t chunks[2] = {2ull << 20, 16ull << 20};
    double trc[2][4];
    for (int ci = 0; ci < 2; ci++) {
        for (int pass = 0; pass < 4; pass++) {
            uint64_t bytes = 0;
            double t0 = now_s();
            for (uint32_t u = 0; bytes < mb * 1000000ull; u = (u + 1) % k3_pk_unit_count(pk)) {
                const k3_pk_unit *un = k3_pk_unit_at(pk, u);
                if (un->layer == K3_PK_LAYER_EMBED)   /* read row by row, never streamed whole */
                    continue;
                tjob tj[64];
                pthread_t th[64];
                for (uint32_t t = 0; t < nth; t++) {
                    tj[t] = (tjob){pk, un, ubuf, chunks[ci], t, nth, 0};
                    pthread_create(&th[t], NULL, unit_main, &tj[t]);
                }
                int bad = 0;
                for (uint32_t t = 0; t < nth; t++) {
                    pthread_join(th[t], NULL);
                    bad |= tj[t].rc;
                }
                if (bad)
                    return 4;
                bytes += un->nbytes;
            }
            trc[ci][pass] = (double)bytes / (now_s() - t0) / 1e9;
        }
    }
    k3_io_huge_free(ubuf, umax);
    qsort(trc[0] + 1, 3, sizeof(double), cmp_d);
    qsort(trc[1] + 1, 3, sizeof(double), cmp_d);
    const double *tr = trc[0][2] >= trc[1][2] ? trc[0] : trc[1];   /* the faster chunk size: the limit */
    double xr[4] = {0, 0, 0, 0};
    const k3_pk_expert_layout *lay = k3_pk_experts(pk);
    if (lay) {
        const k3_cfg *c = k3_pk_cfg(pk);
        uint32_t n = (uint32_t)(mb * 1000000ull / lay->stride);
        if (n < nth)
            n = nth;
        uint8_t *xbuf = k3_io_huge_alloc(lay->stride * nth);
        for (int pass = 0; pass < 4; pass++) {
            job j[64];
            pthread_t th[64];
            double t0 = now_s();
            for (uint32_t t = 0; t < nth; t++) {
                j[t] = (job){pk, c->first_k_dense_replace, c->num_hidden_layers - c->first_k_dense_replace,
                             c->num_experts, n, t, nth, xbuf + t * lay->stride, 1234567ull * (pass + 1) + t, 0};
                pthread_create(&th[t], NULL, rec_main, &j[t]);
            }
            int bad = 0;
            for (uint32_t t = 0; t < nth; t++) {
                pthread_join(th[t], NULL);
                bad |= j[t].rc;
            }
            if (bad)
                return 4;
            xr[pass] = (double)n * lay->stride / (now_s() - t0) / 1e9;
        }
        k3_io_huge_free(xbuf, lay->stride * nth);
        qsort(xr + 1, 3, sizeof(double), cmp_d);
    }
    if (json)
        printf("{\"direct\":%s,\"trunk_gbps\":%.3f,\"trunk_gbps_2m\":%.3f,\"trunk_gbps_16m\":%.3f,"
               "\"experts_gbps\":%.3f,\"threads\":%u,\"mb\":%llu}\n",
               direct ? "true" : "false", tr[2], trc[0][2], trc[1][2], xr[2], nth, (unsigned long long)mb);
    else
        printf("O_DIRECT read (%s): trunk units x%u threads %.3f GB/s [%.3f-%.3f] (2 MiB chunks %.3f, 16 MiB %.3f), expert records x%u threads %.3f GB/s "
               "[%.3f-%.3f] (median of 3 passes of %llu MB)\n",
               direct ? "direct" : "BUFFERED: filesystem refused O_DIRECT", nth, tr[2], tr[1], tr[3], trc[0][2], trc[1][2], nth, xr[2], xr[1],
               xr[3], (unsigned long long)mb);
    k3_pk_close(pk);
    return 0;
}
