/*
 * main.c - k3-synth: write a synthetic checkpoint in the upstream format
 * (docs/MODEL.md §2, §7) from a seed. Options are parsed strictly (full consumption,
 * range checks); errors are one line "k3-synth: error: ..." and a documented
 * exit status; the result summary goes to stdout, progress to stderr.
 */
#include "synth.h"

#include "k3_cli.h"
#include "k3_json.h"
#include "k3_out.h"
#include "k3_kern.h"

#include <cjson/cJSON.h>

#include <errno.h>
#include <inttypes.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>



static volatile sig_atomic_t interrupted;

static void on_signal(int sig)
{
    (void)sig;
    interrupted = 1;
}

static void usage(FILE *f)
{
    fprintf(f,
            "usage: k3-synth DST --preset tiny|k3-width|k3 [options]\n"
            "\n"
            "Write a synthetic checkpoint in the upstream safetensors format (config.json,\n"
            "model.safetensors.index.json, shards, tiktoken.model, tokenizer_config.json)\n"
            "from a seed. Same options and seed give byte-identical files.\n"
            "\n"
            "  --preset NAME        tiny: every mechanism at toy size (KB-MB);\n"
            "                       k3-width: real K3 matrix sizes, few layers (default 2);\n"
            "                       k3: the full real shape (93 layers, ~1.56 TB)\n"
            "  --layers N           number of layers (preset default otherwise)\n"
            "  --vocab N            vocabulary size (embedding rows; padded past the tokenizer)\n"
            "  --experts mxfp4|bf16 routed experts as MXFP4 (default, like upstream) or BF16\n"
            "  --vectors real|bf16|f32|mixed  dtype of norms and biases (tiny: mixed)\n"
            "  --trunk-dtype bf16|real|f32|f16|mixed  dtype of every non-expert tensor:\n"
            "                  bf16 matrices; real: also routers and conv taps in F32 and\n"
            "                  AttnRes projections as F32 [1][E], as some exporters ship\n"
            "                  them; f32 or f16: everything; mixed: BF16/F16/F32 chosen per\n"
            "                  tensor by a hash of its name (default bf16; tiny: mixed)\n"
            "  --vision        also write a small vision tower (outside language_model.)\n"
            "  --alog heads|padded  A_log as [H] (default) or padded to [D]\n"
            "  --seed N             generator seed (default 1)\n"
            "  --shard-size SIZE    maximum shard file size, e.g. 512K, 5G (preset default)\n"
            "  --sparse             only routers, norms, biases and embeddings carry data;\n"
            "                       everything else is left as holes\n"
            "  --sparse-live        --sparse, and the output head and MXFP4 scale bytes\n"
            "                       carry data too: zero experts compute at real speed,\n"
            "                       and the text depends on the last id alone\n"
            "  --no-index           do not write model.safetensors.index.json\n"
            "  --no-tokenizer       do not write tiktoken.model / tokenizer_config.json\n"
            "  --config-form flat|nested   config.json layout (tiny: flat, others: nested)\n"
            "  --threads N          generator threads (default: all)\n"
            "  --no-direct          buffered writes instead of O_DIRECT\n"
            "  --quiet              no progress, no summary\n"
            "  --force              replace an existing k3-synth checkpoint at DST (nothing\n"
            "                       else: see README, Destinations)\n"
            "  --json               print the summary as JSON\n"
            "  --version, --help\n"
            "\n"
            "Exit: 0 ok, 2 usage, 4 I/O error, 6 limit/memory, 7 DST exists, 8 disk full,\n"
            "9 internal error, 130 interrupted.\n");
}

static int die(int status, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int die(int status, const char *fmt, ...)
{
    va_list ap;
    fputs("k3-synth: error: ", stderr);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    k3_out_failed();
    return status;
}

/* "123", "512K", "5G" (binary units). */
static int parse_size(const char *s, uint64_t *out)
{
    if (!s || !*s || *s == '-' || *s == '+')
        return -1;
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || end == s)
        return -1;
    unsigned shift = 0;
    if (*end) {
        switch (*end) {
        case 'K': case 'k': shift = 10; break;
        case 'M': case 'm': shift = 20; break;
        case 'G': case 'g': shift = 30; break;
        case 'T': case 't': shift = 40; break;
        default: return -1;
        }
        if (end[1] && strcmp(end + 1, "B") && strcmp(end + 1, "iB"))
            return -1;
    }
    if (v > (UINT64_MAX >> shift))
        return -1;
    *out = (uint64_t)v << shift;
    return 0;
}

int main(int argc, char **argv)
{
    k3_out_init("k3-synth");
    const char *dst = NULL, *preset = NULL, *experts = "mxfp4", *form = NULL, *vectors = NULL, *alog = "heads", *trunk = NULL;
    uint64_t layers = 0, vocab = 0, seed = 1, shard = 0, threads = 0, chunk = 0;
    int vision = 0;
    int sparse = 0, no_index = 0, no_tok = 0, quiet = 0, force = 0, json = 0, no_direct = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
#define NEED_VALUE()                                                                     \
    do {                                                                                 \
        if (!v)                                                                          \
            return die(K3_EXIT_USAGE, "%s needs a value", a);                            \
        i++;                                                                             \
    } while (0)
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return 0;
        } else if (!strcmp(a, "--version")) {
            k3_cli_print_version("k3-synth");
            return 0;
        } else if (!strcmp(a, "--preset")) {
            NEED_VALUE();
            preset = v;
        } else if (!strcmp(a, "--layers")) {
            NEED_VALUE();
            if (k3_cli_parse_u64(v, 1, K3_SYNTH_MAX_LAYERS, &layers))
                return die(K3_EXIT_USAGE, "--layers: '%s' is not a number in 1..%u", v, K3_SYNTH_MAX_LAYERS);
        } else if (!strcmp(a, "--vocab")) {
            NEED_VALUE();
            if (k3_cli_parse_u64(v, 1, 1u << 24, &vocab))
                return die(K3_EXIT_USAGE, "--vocab: '%s' is not a number in 1..%u", v, 1u << 24);
        } else if (!strcmp(a, "--seed")) {
            NEED_VALUE();
            if (k3_cli_parse_u64(v, 0, UINT64_MAX, &seed))
                return die(K3_EXIT_USAGE, "--seed: '%s' is not an unsigned 64-bit number", v);
        } else if (!strcmp(a, "--shard-size")) {
            NEED_VALUE();
            if (parse_size(v, &shard) || shard < 4096)
                return die(K3_EXIT_USAGE, "--shard-size: '%s' is not a size of at least 4096 bytes (e.g. 512K, 5G)", v);
        } else if (!strcmp(a, "--threads")) {
            NEED_VALUE();
            if (k3_cli_parse_u64(v, 1, 256, &threads))
                return die(K3_EXIT_USAGE, "--threads: '%s' is not a number in 1..256", v);
        } else if (!strcmp(a, "--chunk")) {
            NEED_VALUE();
            if (parse_size(v, &chunk) || chunk < 4096 || chunk > (1ull << 30))
                return die(K3_EXIT_USAGE, "--chunk: '%s' is not a size in 4K..1G", v);
        } else if (!strcmp(a, "--experts")) {
            NEED_VALUE();
            experts = v;
        } else if (!strcmp(a, "--vectors")) {
            NEED_VALUE();
            vectors = v;
        } else if (!strcmp(a, "--trunk-dtype")) {
            NEED_VALUE();
            trunk = v;
        } else if (!strcmp(a, "--vision")) {
            vision = 1;
        } else if (!strcmp(a, "--alog")) {
            NEED_VALUE();
            alog = v;
        } else if (!strcmp(a, "--config-form")) {
            NEED_VALUE();
            form = v;
        } else if (!strcmp(a, "--sparse")) {
            sparse = K3_SYNTH_SPARSE;
        } else if (!strcmp(a, "--sparse-live")) {
            sparse = K3_SYNTH_SPARSE_LIVE;
        } else if (!strcmp(a, "--no-index")) {
            no_index = 1;
        } else if (!strcmp(a, "--no-tokenizer")) {
            no_tok = 1;
        } else if (!strcmp(a, "--no-direct")) {
            no_direct = 1;
        } else if (!strcmp(a, "--quiet") || !strcmp(a, "-q")) {
            quiet = 1;
        } else if (!strcmp(a, "--force")) {
            force = 1;
        } else if (!strcmp(a, "--json")) {
            json = 1;
        } else if (a[0] == '-' && a[1]) {
            return die(K3_EXIT_USAGE, "unknown option '%s' (see --help)", a);
        } else if (!dst) {
            dst = a;
        } else {
            return die(K3_EXIT_USAGE, "more than one destination ('%s' and '%s')", dst, a);
        }
#undef NEED_VALUE
    }
    if (!dst)
        return die(K3_EXIT_USAGE, "no destination directory given (see --help)");
    if (!preset)
        return die(K3_EXIT_USAGE, "no --preset given (tiny, k3-width or k3)");

    k3_synth_opts o;
    memset(&o, 0, sizeof o);
    k3_err e = {0};
    o.seed = seed;
    if (k3_synth_preset(&o, preset, (uint32_t)layers, (uint32_t)vocab, &e))
        return die(K3_EXIT_USAGE, "%s", e.msg);
    if (!strcmp(experts, "mxfp4"))
        o.experts_bf16 = 0;
    else if (!strcmp(experts, "bf16"))
        o.experts_bf16 = 1;
    else
        return die(K3_EXIT_USAGE, "--experts: '%s' is not mxfp4 or bf16", experts);
    if (vectors) {
        static const char *names[] = {"real", "bf16", "f32", "mixed"};
        int k;
        for (k = 0; k < 4 && strcmp(vectors, names[k]); k++)
            ;
        if (k == 4)
            return die(K3_EXIT_USAGE, "--vectors: '%s' is not real, bf16, f32 or mixed", vectors);
        o.vec_dtype = k;
    }
    if (trunk) {
        static const char *names[] = {"bf16", "real", "f32", "f16", "mixed"};
        int k;
        for (k = 0; k < 5 && strcmp(trunk, names[k]); k++)
            ;
        if (k == 5)
            return die(K3_EXIT_USAGE, "--trunk-dtype: '%s' is not bf16, real, f32, f16 or mixed", trunk);
        o.trunk_dtype = k;
    }
    o.vision = vision;
    if (!strcmp(alog, "padded"))
        o.alog_padded = 1;
    else if (strcmp(alog, "heads"))
        return die(K3_EXIT_USAGE, "--alog: '%s' is not heads or padded", alog);
    if (form) {
        if (!strcmp(form, "nested"))
            o.nested = 1;
        else if (!strcmp(form, "flat"))
            o.nested = 0;
        else
            return die(K3_EXIT_USAGE, "--config-form: '%s' is not flat or nested", form);
    }
    if (shard)
        o.shard_size = shard;
    o.sparse = sparse;
    o.write_index = !no_index;
    o.write_tokenizer = !no_tok;
    o.force = force;
    o.quiet = quiet;
    o.direct = !no_direct;
    o.threads = (int)threads;
    o.chunk_bytes = chunk;
    size_t dl = strlen(dst);
    char *d = strdup(dst);
    if (!d)
        return die(K3_EXIT_LIMIT, "out of memory");
    while (dl > 1 && d[dl - 1] == '/')
        d[--dl] = '\0';

    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);

    k3_synth_result r;
    int rc = k3_synth_write(&o, d, &interrupted, &r, &e);
    if (rc) {
        free(d);
        return die(k3_err_exit_status(rc), "%s", e.msg);
    }
    if (json) {
        cJSON *j = cJSON_CreateObject();
        char *u = k3_json_utf8_dup(d);   /* valid UTF-8 whatever the path (k3_json.h) */
        cJSON_AddStringToObject(j, "dst", u ? u : "");
        free(u);
        cJSON_AddStringToObject(j, "preset", o.m.preset);
        cJSON_AddNumberToObject(j, "seed", (double)seed);
        cJSON_AddNumberToObject(j, "tensors", (double)r.tensors);
        cJSON_AddNumberToObject(j, "shards", (double)r.shards);
        cJSON_AddNumberToObject(j, "logical_bytes", (double)r.logical_bytes);
        cJSON_AddNumberToObject(j, "written_bytes", (double)r.written_bytes);
        cJSON_AddNumberToObject(j, "ranks", (double)r.ranks);
        cJSON_AddNumberToObject(j, "vocab", (double)r.vocab);
        cJSON_AddNumberToObject(j, "seconds", r.seconds);
        char *txt = cJSON_PrintUnformatted(j);
        if (txt)
            printf("%s\n", txt);
        free(txt);
        cJSON_Delete(j);
    }
    else if (!quiet)
        printf("%s: %" PRIu64 " tensors in %" PRIu64 " shards, %" PRIu64 " bytes (%" PRIu64
               " written), vocab %" PRIu64 " (%" PRIu64 " ranks), %.1f s\n",
               d, r.tensors, r.shards, r.logical_bytes, r.written_bytes, r.vocab, r.ranks, r.seconds);
    free(d);
    return 0;
}
