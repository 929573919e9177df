/*
 * main.c - k3-run: token ids or text in, tokens or text out.
 *
 *   k3-run MODEL_DIR (--prompt TEXT | --prompt-file PATH | --ids 1,2,3) [options]
 *   k3-run --tokenize (--prompt TEXT | --prompt-file PATH) [--tok DIR | MODEL_DIR]
 *   k3-run --detokenize --ids 1,2,3 [--tok DIR | MODEL_DIR]
 *
 * Output: generated text streamed to stdout as it is produced, byte for byte
 * (plus a final newline only when stdout is a terminal); without a
 * tokenizer the generated ids, comma-separated, then a newline; with --json
 * one JSON object at the end instead. Special-token text in a text prompt
 * becomes the special ids. Diagnostics on stderr; a failure is one line
 * "k3-run: error: ..." and the exit status of README.md.
 */
#include <errno.h>
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "chat_loop.h"
#include "state_file.h"
#include "k3_cli.h"
#include "k3_crc.h"
#include "k3_engine.h"
#include "k3_err.h"
#include "k3_gen.h"
#include "k3_io.h"
#include "k3_json.h"
#include "k3_kern.h"
#include "k3_out.h"
#include "k3_plan.h"
#include "k3_progress.h"
#include "k3_spec.h"
#include "k3_stream.h"
#include "k3_tok.h"
#include "probe.h"
#include "run_trunk.h"

#define MAX_PROMPT_BYTES (64ull << 20)
#define MAX_IDS K3_CLI_MAX_IDS

static void usage(FILE *f)
{
    fprintf(f,
            "usage: k3-run MODEL_DIR [options]\n"
            "\n"
            "Run Kimi K3 (or a checkpoint of the same shape) on a prompt. MODEL_DIR is a packed\n"
            "model (manifest.json) or an upstream safetensors checkpoint (config.json).\n"
            "\n"
            "input (one of):\n"
            "  --prompt TEXT          the prompt as text (needs the tokenizer files)\n"
            "  --prompt-file PATH     the prompt's bytes, verbatim (PATH - : standard input)\n"
            "  --ids 1,2,3            the prompt as token ids (no tokenizer needed)\n"
            "generation:\n"
            "  --gen N                generate at most N tokens (default 64); stops early on an\n"
            "                         end-of-sequence id of the tokenizer config\n"
            "  --temperature T        0 (default) = greedy; otherwise sample\n"
            "  --top-k K              keep the K most likely ids (0 = all, default)\n"
            "  --top-p P              keep the smallest set with probability >= P (default 1)\n"
            "  --seed S               sampler seed (default 0): same seed, same tokens\n"
            "  --chunk N              prompt tokens per forward step (default 64; with --ram\n"
            "                         SIZE the longest of 256, 128, 64 the budget holds)\n"
            "  --spec ngram[:K]       speculative decoding: guess up to K ids (default 8) by\n"
            "                         n-gram lookup in the prompt and output, check them in one\n"
            "                         pass; the output is identical to decoding without it\n"
            "  --threads N            worker threads (default: all cores)\n"
            "memory (packed models):\n"
            "  --ram SIZE             stream the weights within SIZE bytes of RAM (K/M/G/T\n"
            "                         suffixes) or a preset: floor, double, resident; prints the\n"
            "                         memory plan, refuses a budget below the floor (exit 6)\n"
            "                         and reports reads, I/O wait, hit rate and peak RSS;\n"
            "                         default: the budget a k3-pack layout records, else\n"
            "                         everything resident\n"
            "  --plan                 with --ram: print the memory plan and exit\n"
            "  --probe                with --plan: measure this machine's reads (on the model's\n"
            "                         files) and products, route the prompt's ids with the\n"
            "                         model's routers, and predict this prompt's and decode\n"
            "                         s/token at the floor, this budget and larger ones\n"
            "  --trace FILE           with --ram: write every expert request to FILE\n"
            "  --ram-piece SIZE       with --ram: stream the weight matrices larger than SIZE\n"
            "                         in row pieces of at most SIZE (default 16M; 0: whole\n"
            "                         layers only)\n"
            "  --no-trunk-crc         with --ram: do not CRC-check streamed trunk units (expert\n"
            "                         records and pinned units are always checked)\n"
            "  --no-expert-guess      with --ram: read a layer's experts only once it has\n"
            "                         routed (no reading ahead on the router's guess)\n"
            "output:\n"
            "  --json                 one JSON object: prompt_ids, generated_ids, text, timings\n"
            "  --quiet                no prompt progress on stderr\n"
            "  --progress             prompt progress on stderr even when it is not a terminal\n"
            "  --logits FILE          float32 LE logits of the last prompt position [V]\n"
            "  --logits-all FILE      float32 LE logits of every prompt position [T][V]\n"
            "  --logits-gen FILE      float32 LE logits each generated id was drawn from [N][V]\n"
            "state (runtime/CHAT.md):\n"
            "  --state-save FILE      after the prompt, save the sequence (all but the prompt's\n"
            "                         last id) with its ids and the model's fingerprint\n"
            "  --state-load FILE      continue a saved sequence whose ids begin the prompt: only\n"
            "                         the rest is computed (another model's state: exit 3)\n"
            "  --force                --state-save may replace an existing FILE\n"
            "conversation:\n"
            "  --chat                 talk to the model in the K3 chat format (see\n"
            "                         k3-run --chat --help)\n"
            "tokenizer only (no weights needed):\n"
            "  --tokenize             print the ids of the prompt text and exit\n"
            "  --detokenize           print the text of --ids and exit\n"
            "  --tok DIR              directory with tiktoken.model + tokenizer_config.json\n"
            "                         (default: MODEL_DIR)\n"
            "  --version, --help      (--version MODEL_DIR also prints the model's trunk\n"
            "                         dtypes and whether k3-convert rounded any: lossy)\n"
            "\n"
            "Sampling: temperature, then top-k, then top-p over the sorted distribution, then one\n"
            "uniform draw through the inverse CDF; the draw of the j-th generated token depends\n"
            "only on (seed, j) (counter-based splitmix64).\n"
            "\n"
            "Exit: 0 ok, 2 usage, 3 bad format, 4 I/O error, 5 corrupt, 6 limit/memory (a plan\n"
            "over the memory available: K3_MEM_AVAILABLE=BYTES overrides it), 8 disk full,\n"
            "9 internal error, 130 interrupted.\n");
}

static int die(int code, const char *msg)
{
    return k3_out_error(code, "%s", msg);
}

static int dief(int code, const char *fmt, const char *arg)
{
    char buf[2048];
    snprintf(buf, sizeof buf, fmt, arg);
    return die(code, buf);
}

static int parse_f(const char *s, double lo, double hi, double *out)
{
    if (!s || !*s || *s == ' ')
        return -1;
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || *end || !(v >= lo && v <= hi))
        return -1;
    *out = v;
    return 0;
}

static int write_floats(const char *path, const float *x, uint64_t n, k3_err *e)
{
    /* float32 little-endian: this code targets little-endian hosts (x86-64, arm64) */
    return k3_io_write_file_atomic(path, x, n * sizeof(float), e);
}

typedef struct stream_ctx {
    k3_tok_stream *ts;
    k3_engine *sen;      /* a streamed engine (--ram), snapshotted at the first token */
    k3_stream_run *run;
    int json;
    int first;
    const uint32_t *eos; /* end-of-sequence ids: kept in the ids, not written as text */
    uint32_t n_eos;
    char *text;          /* accumulated output text (for --json) */
    uint64_t len, cap;
    k3_err *e;
} stream_ctx;

static int append(stream_ctx *c, const char *b, uint64_t n)
{
    if (c->len + n + 1 > c->cap) {
        uint64_t cap = c->cap ? c->cap : 256;
        while (cap < c->len + n + 1)
            cap *= 2;
        char *t = realloc(c->text, cap);
        if (!t)
            return k3_err_set(c->e, K3_ENOMEM, "out of memory for the output text");
        c->text = t;
        c->cap = cap;
    }
    memcpy(c->text + c->len, b, n);
    c->len += n;
    c->text[c->len] = 0;
    return 0;
}

static int on_token(void *ud, uint32_t id)
{
    stream_ctx *c = ud;
    if (c->sen && !c->run->have_first) {
        k3_engine_stream_stats(c->sen, &c->run->at_first);
        c->run->have_first = 1;
    }
    if (!c->ts) {
        if (!c->json) {
            printf("%s%u", c->first ? "" : ",", id);
            if (k3_out_check(stdout, "stdout", c->e) < 0)
                return c->e->code; /* the output is gone: stop generating */
        }
        c->first = 0;
        return 0;
    }
    for (uint32_t k = 0; k < c->n_eos; k++)
        if (c->eos[k] == id)
            return 0;
    const char *b;
    uint64_t n;
    int rc = k3_tok_stream_push(c->ts, id, &b, &n, c->e);
    if (rc < 0)
        return rc;
    if (c->json)
        return append(c, b, n);
    if (n) {
        fwrite(b, 1, n, stdout);
        if (k3_out_check(stdout, "stdout", c->e) < 0)
            return c->e->code;
    }
    return 0;
}

static void print_ids(const uint32_t *ids, uint32_t n)
{
    putchar('[');
    for (uint32_t i = 0; i < n; i++)
        printf(i ? ",%u" : "%u", ids[i]);
    putchar(']');
}

/* Speculative decoding, per generated id after the first (the first comes
 * from the prompt pass): ids per decode pass, guesses kept, seconds per id. */
static void spec_report(const k3_spec_stats *sp, const k3_gen_stats *st, uint32_t n_gen, FILE *f)
{
    uint32_t n = n_gen ? n_gen - 1 : 0;
    fprintf(f, "k3-run: spec: %u ids in %u passes (%.2f per pass), %llu of %llu guesses kept (%.1f %%), "
               "%.4f s per id, %u state copies %.4f s\n",
            n, sp->passes, sp->passes ? (double)n / sp->passes : 0.0, (unsigned long long)sp->accepted,
            (unsigned long long)sp->drafted, sp->drafted ? 100.0 * (double)sp->accepted / (double)sp->drafted : 0.0,
            n ? st->decode_s / n : 0.0, sp->copies, sp->copy_s);
}

static void spec_json(const k3_spec_stats *sp, const k3_gen_stats *st, uint32_t n_gen, uint32_t k_max)
{
    uint32_t n = n_gen ? n_gen - 1 : 0;
    printf(",\"spec\":{\"drafter\":\"ngram\",\"k_max\":%u,\"passes\":%u,\"spec_passes\":%u,\"ids\":%u,"
           "\"ids_per_pass\":%.4f,\"drafted\":%llu,\"accepted\":%llu,\"acceptance\":%.4f,"
           "\"s_per_id\":%.6f,\"chunk_ids\":%llu,\"copies\":%u,\"copy_s\":%.6f,\"copy_bytes\":%llu}",
           k_max, sp->passes, sp->spec_passes, n, sp->passes ? (double)n / sp->passes : 0.0,
           (unsigned long long)sp->drafted, (unsigned long long)sp->accepted,
           sp->drafted ? (double)sp->accepted / (double)sp->drafted : 0.0, n ? st->decode_s / n : 0.0,
           (unsigned long long)sp->chunk_ids, sp->copies, sp->copy_s, (unsigned long long)sp->copy_bytes);
}

/* libgomp's default wait policy keeps a thread spinning for a while after
 * every parallel region. k3-run ends a region and then often waits for a read
 * (a streamed piece, an expert) while the I/O threads need the CPU for their
 * CRCs, and on a shared machine other processes need it too: measured on the
 * k3-width checkpoint (2 cores shared, load average 4-5; runtime/STREAM.md),
 * decode at the floor took 4.3 s/token spinning and 3.5 s passive, and 1.3
 * vs 0.66 s at 16 GiB. The
 * policy is read once when libgomp loads, before main, so k3-run sets
 * OMP_WAIT_POLICY=passive and executes itself again unless the caller chose
 * a policy (any value is kept). If the exec fails the run goes on as is. */
static void passive_omp(char **argv)
{
    if (getenv("OMP_WAIT_POLICY") || setenv("OMP_WAIT_POLICY", "passive", 1) != 0)
        return;
    execv("/proc/self/exe", argv);
}

int main(int argc, char **argv)
{
    k3_out_init("k3-run");
    passive_omp(argv);
    if (k3_chat_wanted(argc, argv))
        return k3_chat_main(argc, argv);   /* runtime/chat_loop.c */
    const char *model_dir = NULL, *prompt = NULL, *prompt_file = NULL, *ids_arg = NULL, *tok_dir = NULL;
    const char *logits_path = NULL, *logits_all_path = NULL, *logits_gen_path = NULL, *spec_arg = NULL;
    uint64_t gen = 64, chunk = 64, threads = 0, top_k = 0, seed = 0;
    int chunk_given = 0;
    double temperature = 0.0, top_p = 1.0;
    int json = 0, tokenize = 0, detokenize = 0, progress_mode = K3_PROGRESS_AUTO;
    const char *state_save = NULL, *state_load = NULL;
    int force = 0;
    const char *ram_arg = NULL, *trace_path = NULL;
    uint64_t ram = 0;
    int plan_only = 0, probe = 0, trunk_crc = 1, expert_guess = 1, version = 0;
    uint64_t piece = K3_STREAM_PIECE_DEFAULT;
    k3_io_fault_reset();

    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
#define NEEDV()                                                             \
    do {                                                                    \
        if (!v)                                                             \
            return dief(K3_EARG, "option %s needs a value (see --help)", a); \
        i++;                                                                \
    } while (0)
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return 0;
        } else if (!strcmp(a, "--version")) {
            version = 1;
        } else if (!strcmp(a, "--prompt")) {
            NEEDV();
            prompt = v;
        } else if (!strcmp(a, "--prompt-file")) {
            NEEDV();
            prompt_file = v;
        } else if (!strcmp(a, "--ids")) {
            NEEDV();
            ids_arg = v;
        } else if (!strcmp(a, "--tok")) {
            NEEDV();
            tok_dir = v;
        } else if (!strcmp(a, "--logits")) {
            NEEDV();
            logits_path = v;
        } else if (!strcmp(a, "--logits-all")) {
            NEEDV();
            logits_all_path = v;
        } else if (!strcmp(a, "--logits-gen")) {
            NEEDV();
            logits_gen_path = v;
        } else if (!strcmp(a, "--spec")) {
            NEEDV();
            spec_arg = v;
        } else if (!strcmp(a, "--gen")) {
            NEEDV();
            if (k3_cli_parse_u64(v, 0, 1u << 24, &gen))
                return dief(K3_EARG, "--gen: '%s' is not a count from 0 to 16777216", v);
        } else if (!strcmp(a, "--chunk")) {
            chunk_given = 1;
            NEEDV();
            if (k3_cli_parse_u64(v, 1, 1u << 16, &chunk))
                return dief(K3_EARG, "--chunk: '%s' is not a count from 1 to 65536", v);
        } else if (!strcmp(a, "--threads")) {
            NEEDV();
            if (k3_cli_parse_u64(v, 1, 1024, &threads))
                return dief(K3_EARG, "--threads: '%s' is not a count from 1 to 1024", v);
        } else if (!strcmp(a, "--top-k")) {
            NEEDV();
            if (k3_cli_parse_u64(v, 0, UINT32_MAX, &top_k))
                return dief(K3_EARG, "--top-k: '%s' is not a count", v);
        } else if (!strcmp(a, "--seed")) {
            NEEDV();
            if (k3_cli_parse_u64(v, 0, UINT64_MAX, &seed))
                return dief(K3_EARG, "--seed: '%s' is not an unsigned 64-bit number", v);
        } else if (!strcmp(a, "--temperature")) {
            NEEDV();
            if (parse_f(v, 0.0, 1e6, &temperature))
                return dief(K3_EARG, "--temperature: '%s' is not a number from 0 to 1e6", v);
        } else if (!strcmp(a, "--top-p")) {
            NEEDV();
            if (parse_f(v, 0.0, 1.0, &top_p) || top_p <= 0.0)
                return dief(K3_EARG, "--top-p: '%s' is not a number in (0, 1]", v);
        } else if (!strcmp(a, "--ram")) {
            NEEDV();
            ram_arg = v;
            if (k3_stream_parse_budget(v, &ram, NULL) < 0)
                return dief(K3_EARG, "--ram: '%s' is not a size (bytes, K/M/G/T) or a preset (floor, double, "
                                     "resident)", v);
        } else if (!strcmp(a, "--trace")) {
            NEEDV();
            trace_path = v;
        } else if (!strcmp(a, "--ram-piece")) {
            NEEDV();
            if (!strcmp(v, "0"))
                piece = 0;
            else if (k3_stream_parse_budget(v, &piece, NULL) < 0 || piece <= K3_STREAM_DOUBLE ||
                     piece == K3_STREAM_RESIDENT)
                return dief(K3_EARG, "--ram-piece: '%s' is not a size (bytes, K/M/G) or 0", v);
        } else if (!strcmp(a, "--no-trunk-crc")) {
            trunk_crc = 0;
        } else if (!strcmp(a, "--no-expert-guess")) {
            expert_guess = 0;
        } else if (!strcmp(a, "--plan")) {
            plan_only = 1;
        } else if (!strcmp(a, "--probe")) {
            probe = 1;
        } else if (!strcmp(a, "--json")) {
            json = 1;
        } else if (!strcmp(a, "--quiet")) {
            progress_mode = K3_PROGRESS_QUIET;
        } else if (!strcmp(a, "--progress")) {
            progress_mode = K3_PROGRESS_FORCE;
        } else if (!strcmp(a, "--state-save")) {
            NEEDV();
            state_save = v;
        } else if (!strcmp(a, "--state-load")) {
            NEEDV();
            state_load = v;
        } else if (!strcmp(a, "--force")) {
            force = 1;
        } else if (!strcmp(a, "--tokenize")) {
            tokenize = 1;
        } else if (!strcmp(a, "--detokenize")) {
            detokenize = 1;
        } else if (a[0] == '-' && a[1]) {
            return dief(K3_EARG, "unknown option %s (see --help)", a);
        } else if (!model_dir) {
            model_dir = a;
        } else {
            return dief(K3_EARG, "unexpected argument '%s': one MODEL_DIR only", a);
        }
#undef NEEDV
    }
    if (version) {   /* with a model: also its trunk dtypes, and whether any was rounded */
        k3_cli_print_version("k3-run");
        if (model_dir) {
            k3_err ve = {0};
            k3_run_trunk tr;
            char line[256];
            int vrc = k3_run_trunk_read(model_dir, &tr, &ve);
            if (vrc < 0)
                return die(vrc, ve.msg);
            k3_run_trunk_text(&tr, line, sizeof line);
            printf("model %s: %s\n", model_dir, line);
        }
        return 0;
    }
    if (threads)
        omp_set_num_threads((int)threads);
    int n_inputs = !!prompt + !!prompt_file + !!ids_arg;
    if (n_inputs > 1)
        return die(K3_EARG, "give only one of --prompt, --prompt-file, --ids");
    if (tokenize && detokenize)
        return die(K3_EARG, "--tokenize and --detokenize exclude each other");
    if ((state_save || state_load) && (logits_all_path || tokenize || detokenize))
        return die(K3_EARG, "--state-save and --state-load go with a run of the model, without --logits-all");
    if (probe && !plan_only)
        return die(K3_EARG, "--probe goes with --plan");
    if ((plan_only || trace_path) && !ram_arg)
        return die(K3_EARG, "--plan and --trace need --ram");

    k3_err e = {0};
    int rc = 0;
    k3_drafter *drafter = NULL;
    uint32_t spec_k = 0;
    if (spec_arg && k3_spec_parse(spec_arg, &drafter, &spec_k, &e) < 0)
        return die(e.code, e.msg);
    char *text = NULL;
    uint64_t text_len = 0;
    if (prompt) {
        text = strdup(prompt);
        if (!text)
            return die(K3_ENOMEM, "out of memory");
        text_len = strlen(prompt);
    } else if (prompt_file) {
        rc = strcmp(prompt_file, "-") ? k3_io_read_file(prompt_file, MAX_PROMPT_BYTES, &text, &text_len, &e)
                                      : k3_io_read_fd(0, MAX_PROMPT_BYTES, &text, &text_len, "stdin", &e);
        if (rc < 0)
            return die(rc, e.msg);
    }
    uint32_t *ids = NULL, n_ids = 0;
    if (ids_arg && k3_cli_parse_ids(ids_arg, MAX_IDS, &ids, &n_ids)) {
        free(text);
        return dief(K3_EARG, "--ids: '%s' is not a comma-separated list of token ids", ids_arg);
    }

    /* ---- tokenizer-only modes ---- */
    const char *tdir = tok_dir ? tok_dir : model_dir;
    if (tokenize || detokenize) {
        k3_tok *tok = NULL;
        if (!tdir) {
            free(text);
            free(ids);
            return die(K3_EARG, "--tokenize/--detokenize need --tok DIR or MODEL_DIR");
        }
        if ((tokenize && !text) || (detokenize && !ids)) {
            free(text);
            free(ids);
            return die(K3_EARG, tokenize ? "--tokenize needs --prompt or --prompt-file"
                                         : "--detokenize needs --ids");
        }
        rc = k3_engine_tok_open(&tok, tdir, &e);
        if (rc == 0 && tokenize) {
            uint32_t *out;
            uint64_t n;
            rc = k3_tok_encode(tok, text, text_len, 1, &out, &n, &e);
            if (rc == 0) {
                for (uint64_t i = 0; i < n; i++)
                    printf("%s%u", i ? "," : "", out[i]);
                printf("\n");
                free(out);
            }
        } else if (rc == 0) {
            char *out;
            uint64_t n;
            rc = k3_tok_decode(tok, ids, n_ids, &out, &n, &e);
            if (rc == 0) {
                fwrite(out, 1, n, stdout);
                free(out);
            }
        }
        if (rc == 0)
            rc = k3_out_check(stdout, "stdout", &e);
        k3_tok_close(tok);
        free(text);
        free(ids);
        return rc < 0 ? die(rc, e.msg) : 0;
    }

    if (!model_dir) {
        free(text);
        free(ids);
        return die(K3_EARG, "no MODEL_DIR given (see --help)");
    }
    if (n_inputs == 0) {
        free(text);
        free(ids);
        return die(K3_EARG, "no prompt: give --prompt, --prompt-file or --ids");
    }

    double t_load0 = k3_now_s();
    k3_engine *en = NULL;
    k3_seq *s = NULL;
    k3_sampler *smp = NULL;
    k3_tok_stream *ts = NULL;
    float *logits = NULL, *first = NULL, *all = NULL, *glog = NULL;
    k3_spec_stats sps;
    memset(&sps, 0, sizeof sps);
    uint32_t *gen_ids = NULL, n_gen = 0;
    stream_ctx sc = {0};
    k3_stream_run run;
    memset(&run, 0, sizeof run);
    k3_engine_info info;

    /* A model laid out by k3-pack streams by default within the budget it was
     * packed for; --ram SIZE or a preset (resident included) overrides it. */
    k3_engine_opts eo;
    k3_engine_opts_init(&eo);
    eo.ram = ram_arg;
    eo.max_chunk = (uint32_t)chunk;
    eo.chunk_auto = !chunk_given;
    eo.piece_bytes = piece;
    eo.trunk_crc = trunk_crc;
    eo.expert_guess = expert_guess;
    eo.trace_path = trace_path;
    eo.tok_dir = tok_dir;
    rc = k3_engine_open(&en, model_dir, &eo, &e);
    if (rc < 0)
        goto out;
    const k3_tok *tok = k3_engine_tok(en);
    if (text) {
        if (!tok) {
            rc = k3_err_set(&e, K3_ENOENT, "%s: a text prompt needs the tokenizer files (tiktoken.model); "
                                           "use --ids or --tok DIR", model_dir);
            goto out;
        }
        uint64_t n;
        rc = k3_tok_encode(tok, text, text_len, 1, &ids, &n, &e);
        if (rc < 0)
            goto out;
        if (n == 0 || n > MAX_IDS) {
            rc = k3_err_set(&e, K3_EARG, "the prompt encodes to %llu tokens (need 1 to %u)", (unsigned long long)n,
                            MAX_IDS);
            goto out;
        }
        n_ids = (uint32_t)n;
    }
    const uint32_t V = k3_engine_cfg(en)->vocab_size;
    k3_engine_get_info(en, &info);
    if (info.streams) {   /* the plan first: printed before anything big is read */
        /* --spec: a second sequence for the rollback and 2K+1 rows of logits */
        uint64_t extra = 2 + (logits_all_path ? (uint64_t)n_ids : 0) + (logits_gen_path ? gen : 0) +
                         (drafter ? 2ull * spec_k + 1 : 0);
        k3_engine_size sz = {n_ids + (uint32_t)gen, drafter ? 2 : 1, extra * 4ull * V};
        const k3_stream_plan *plan;
        rc = k3_engine_plan(en, &sz, &plan, &e);
        k3_engine_get_info(en, &info);
        if (info.fell_to_floor)   /* packed for another session shape (context, threads) */
            fprintf(stderr, "k3-run: the layout's budget of %llu bytes is below this run's floor: "
                            "streaming at the floor\n", (unsigned long long)info.layout_budget);
        if (rc < 0)
            goto out;
        run.plan = *plan;
        k3_stream_plan_print(plan, stderr, "k3-run: ");
        chunk = info.max_chunk;
        fprintf(stderr, "k3-run:   chunk          %9u ids per pass%s\n", info.max_chunk,
                chunk_given ? " (--chunk)" : eo.chunk_auto && info.max_chunk > 64 ? " (the longest the budget holds)" : "");
        k3_engine_mem mem;
        if ((rc = k3_engine_mem_get(en, &mem, &e)) < 0)
            goto out;
        fprintf(stderr,
                "k3-run:   per sequence   %9.3f MiB  (%llu bytes: state %llu + latents %llu + scores %llu, "
                "%u tokens)\n",
                mem.seq_bytes / 1048576.0, (unsigned long long)mem.seq_bytes, (unsigned long long)mem.seq_state,
                (unsigned long long)mem.seq_kv, (unsigned long long)mem.seq_scores, mem.max_ctx);
        fprintf(stderr, "k3-run:   sequences      %u planned; the budget admits at most %u of %u tokens each\n",
                mem.planned_seqs, mem.max_seqs, mem.max_ctx);
        if (plan_only && probe)
            rc = k3_probe_print(model_dir, &eo, &sz, plan, ram_arg, info.max_chunk, ids, n_ids, stderr, "k3-run: ", &e);
        if (plan_only)
            goto out;
        if (!info.direct)
            fprintf(stderr, "k3-run: warning: the filesystem refuses O_DIRECT for %s: buffered reads "
                            "(the page cache may hold model bytes outside the budget)\n", model_dir);
    }
    rc = k3_engine_load(en, &e);
    if (rc < 0)
        goto out;
    for (uint32_t i = 0; i < n_ids; i++)
        if (ids[i] >= V) {
            rc = k3_err_set(&e, K3_EARG, "token id %u (position %u) is out of range: vocabulary %u", ids[i], i, V);
            goto out;
        }
    rc = k3_seq_create(&s, en, n_ids + (uint32_t)gen, &e);
    if (rc < 0)
        goto out;
    rc = k3_sampler_create(&smp, V, (float)temperature, (uint32_t)top_k, (float)top_p, seed, &e);
    if (rc < 0)
        goto out;
    logits = malloc((uint64_t)V * sizeof(float));
    first = malloc((uint64_t)V * sizeof(float));
    gen_ids = malloc((gen ? gen : 1) * sizeof(uint32_t));
    if (logits_all_path)
        all = malloc((uint64_t)n_ids * V * sizeof(float));
    if (logits_gen_path)
        glog = malloc((gen ? gen : 1) * (uint64_t)V * sizeof(float));
    if (!logits || !first || !gen_ids || (logits_all_path && !all) || (logits_gen_path && !glog)) {
        rc = k3_err_set(&e, K3_ENOMEM, "out of memory for logits");
        goto out;
    }
    if (tok) {
        rc = k3_tok_stream_create(&ts, tok, &e);
        if (rc < 0)
            goto out;
    }
    if (info.streams) {
        sc.sen = en;
        sc.run = &run;
    }
    double t_load = k3_now_s() - t_load0;
    sc.ts = ts;
    sc.json = json;
    sc.first = 1;
    sc.e = &e;
    const uint32_t *eos = NULL;
    uint32_t n_eos = 0;
    if (tok)
        k3_tok_eos_ids(tok, &eos, &n_eos);
    sc.eos = eos;
    sc.n_eos = n_eos;
    /* a saved state whose ids begin the prompt: only the rest is computed */
    uint32_t reuse = 0;
    if (state_load && (rc = k3_state_use_load(state_load, model_dir, s, ids, n_ids, &reuse, &e)) < 0)
        goto out;
    if (state_save && (rc = k3_state_use_save(state_save, force, model_dir, en, s, ids, n_ids, &reuse, &e)) < 0)
        goto out;
    k3_progress *prog = k3_progress_create("k3-run: prompt", n_ids - reuse, stderr, progress_mode);
    k3_progress_set_unit(prog, "tokens");
    k3_gen_opts go = {(uint32_t)gen, eos, n_eos, logits, first, all, on_token, &sc, prog, glog};
    k3_gen_stats st;
    if (gen == 0) {
        /* prompt only: still compute the logits asked for */
        k3_step_seq one = {s, ids + reuse, n_ids - reuse, all ? K3_LOGITS_ALL : K3_LOGITS_LAST, all ? all : first};
        rc = k3_engine_step(en, &one, 1, &e);
        if (rc == 0 && all)
            memcpy(first, all + (uint64_t)(n_ids - 1) * V, (uint64_t)V * sizeof(float));
        memset(&st, 0, sizeof st);
    } else if (drafter) {
        rc = k3_spec_gen_seq(en, s, smp, drafter, spec_k, ids + reuse, n_ids - reuse, &go, gen_ids, &n_gen, &st,
                             &sps, &e);
    } else {
        rc = k3_gen_seq(en, s, smp, ids + reuse, n_ids - reuse, &go, gen_ids, &n_gen, &st, &e);
    }
    k3_progress_free(prog);
    if (rc == 0 && info.streams)
        rc = k3_engine_stream_finish(en, &e);   /* the --trace file, checked and published */
    if (rc < 0)
        goto out;
    if (info.streams) {
        k3_engine_stream_stats(en, &run.end);
        run.n_prompt = n_ids - reuse;
        run.n_gen = n_gen;
        run.prompt_s = gen ? st.prompt_s : k3_now_s() - t_load0 - t_load;
        run.decode_s = st.decode_s;
        run.peak_rss = k3_stream_rss_peak();
        run.direct = info.direct;
        k3_stream_report_print(&run, stderr, "k3-run: ");
    }
    if (drafter)
        spec_report(&sps, &st, n_gen, stderr);
    if (ts) {
        const char *b;
        uint64_t n;
        k3_tok_stream_flush(ts, &b, &n);
        if (json)
            rc = append(&sc, b, n);
        else
            fwrite(b, 1, n, stdout);
        if (rc < 0)
            goto out;
    }
    /* ids end with a newline; text is written verbatim (a newline is added
     * only for a terminal, so that redirected output is exactly the text) */
    if (!json && (!ts || isatty(STDOUT_FILENO)))
        printf("\n");
    fflush(stdout);
    if (logits_path && (rc = write_floats(logits_path, first, V, &e)) < 0)
        goto out;
    if (logits_all_path && (rc = write_floats(logits_all_path, all, (uint64_t)n_ids * V, &e)) < 0)
        goto out;
    if (logits_gen_path && (rc = write_floats(logits_gen_path, glog, (uint64_t)n_gen * V, &e)) < 0)
        goto out;
    if (json) {
        printf("{\"prompt_ids\":");
        print_ids(ids, n_ids);
        printf(",\"generated_ids\":");
        print_ids(gen_ids, n_gen);
        printf(",\"text\":");
        if (ts)
            k3_json_fput_str(stdout, sc.text ? sc.text : "", sc.len);
        else
            printf("null");
        printf(",\"stop\":\"%s\"", st.stopped_by_eos ? "eos" : "length");
        printf(",\"reused_tokens\":%u,\"computed_tokens\":%u", reuse, n_ids - reuse);
        printf(",\"timings\":{\"load_s\":%.6f,\"prompt_s\":%.6f,\"prompt_tokens_per_s\":%.3f,"
               "\"decode_s\":%.6f,\"decode_tokens_per_s\":%.3f}",
               t_load, st.prompt_s, st.prompt_s > 0 ? (n_ids - reuse) / st.prompt_s : 0.0, st.decode_s,
               st.decode_s > 0 && n_gen > 1 ? (n_gen - 1) / st.decode_s : 0.0);
        printf(",\"kernels\":\"%s\",\"crc32\":\"%s\",\"threads\":%d,\"chunk\":%llu", k3_kern_name(), k3_crc_name(),
               omp_get_max_threads(), (unsigned long long)chunk);
        {
            k3_run_trunk tr;
            char tj[160];
            if ((rc = k3_run_trunk_read(model_dir, &tr, &e)) < 0)
                goto out;
            k3_run_trunk_json(&tr, tj, sizeof tj);
            printf(",\"trunk\":%s", tj);
        }
        if (drafter)
            spec_json(&sps, &st, n_gen, spec_k);
        if (info.streams) {
            char *sj = k3_stream_report_json(&run);
            if (!sj) {
                rc = k3_err_set(&e, K3_ENOMEM, "out of memory");
                goto out;
            }
            printf(",\"stream\":%s", sj);
            free(sj);
        }
        printf("}\n");
    }
    rc = k3_out_check(stdout, "stdout", &e);
out:
    free(sc.text);
    k3_tok_stream_free(ts);
    free(logits);
    free(first);
    free(all);
    free(glog);
    free(gen_ids);
    k3_drafter_free(drafter);
    k3_sampler_free(smp);
    k3_seq_free(s);
    k3_engine_close(en);
    free(text);
    free(ids);
    return rc < 0 ? die(rc, e.msg) : 0;
}
