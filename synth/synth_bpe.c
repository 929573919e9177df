/*
 * synth_bpe.c - a small, real byte-level BPE vocabulary for synthetic
 * checkpoints, learned deterministically from a built-in text.
 *
 * Ranks 0..255 are the single bytes (rank = byte value). Then, repeatedly, the
 * most frequent adjacent pair inside pre-tokenized words becomes a new token
 * whose rank is the next integer (ties: the pair with the lowest (left, right)
 * ranks). A pair whose concatenation already is a token is merged without a
 * new rank, so no byte string appears twice. Every token above 255 is the
 * concatenation of two tokens of lower rank, which is what tiktoken's encoder
 * needs. Learning stops at max_ranks or when no pair occurs twice.
 */
#include "synth.h"

#include <stdlib.h>
#include <string.h>

static const char sample_text[] =
    "The quick brown fox jumps over the lazy dog. A model is only as good as the data it was\n"
    "trained on, and a test is only as good as the bugs it can catch. When the weights are\n"
    "random, the output is random too, but it must still depend on every weight: change one\n"
    "nibble and the logits move. That is what we mean when we say the model is alive.\n"
    "\n"
    "Streaming the weights from disk means reading each layer once per token. The experts are\n"
    "stored as four-bit numbers with a shared scale for every group of thirty-two values; the\n"
    "rest of the model is stored in bfloat16. On a machine with 2 cores and 24 GB of memory,\n"
    "reading 1,560,936,091,448 bytes takes a while, so the order of the reads matters.\n"
    "\n"
    "Once upon a time there was a little town by the sea. Every morning the fishermen went out\n"
    "in their boats, and every evening they came back with the day's catch. The children ran\n"
    "down to the harbour to meet them, and the old women sat on the benches and talked about\n"
    "the weather. \"It will rain tomorrow,\" said one. \"It won't,\" said another. They were both\n"
    "wrong: it snowed. Nobody in the town had seen snow for forty years, and nobody knew what\n"
    "to do with it, so they built a snowman in the square and gave him a fisherman's hat.\n"
    "\n"
    "int main(int argc, char **argv)\n"
    "{\n"
    "    for (int i = 0; i < argc; i++)\n"
    "        printf(\"%d: %s\\n\", i, argv[i]);\n"
    "    return 0;\n"
    "}\n"
    "\n"
    "def tokenize(text):\n"
    "    words = text.split()\n"
    "    return [word.lower() for word in words if word]\n"
    "\n"
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 42 64 100 128 256 512 1024 2048 4096 65536 3.14159\n"
    "Dates like 2024-05-17 and times like 13:25 appear in logs; so do paths like /usr/bin/env.\n"
    "Question: what is the capital of France? Answer: Paris. Question: how many legs does a\n"
    "spider have? Answer: eight. Question: which is heavier, a kilogram of feathers or a\n"
    "kilogram of iron? Answer: they weigh the same.\n"
    "\n"
    "Les modèles de langue apprennent à prédire le mot suivant. Über den Wolken muss die\n"
    "Freiheit wohl grenzenlos sein. El niño comió una manzana. Привет, как дела? "
    "日本語のテキストも少し。中文文本也有一点。 Emoji too: 🙂 🚀.\n"
    "\n"
    "A mixture of experts sends each token to a few experts chosen by a router. The router\n"
    "scores every expert, adds a correction bias to choose the top ones, and weighs their\n"
    "outputs by the scores without the bias. Attention over earlier blocks replaces the plain\n"
    "residual connection: each layer looks back at the outputs of the blocks before it and\n"
    "mixes them with learned weights. Linear attention keeps a state per head and decays it\n"
    "with a gate; full attention keeps a cache of latent vectors for every position.\n"
    "\n"
    "The committee met on Tuesday to discuss the budget for the new library. The chair opened\n"
    "the meeting by thanking everyone for coming, then asked the treasurer to present the\n"
    "accounts. After a long discussion about the cost of the roof, the committee agreed to\n"
    "raise the money by selling books, holding a concert and asking the council for a grant.\n"
    "The meeting closed at nine o'clock, and everyone went home tired but hopeful.\n"
    "\n"
    "She said: \"I don't know, I'm not sure, I'll think about it, we've seen this before, "
    "they're late, you'd better hurry.\" He replied that it's fine and that they'll manage.\n"
    "HTTP/1.1 200 OK\\r\\nContent-Type: application/json\\r\\n{\"id\": 7, \"ok\": true}\n";

/* Pre-tokenize roughly like the real pattern: letters (and any non-ASCII
 * byte) with an optional leading space, up to three digits, punctuation
 * runs with an optional leading space, whitespace runs. */
static int is_letter(unsigned char c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c >= 0x80 || c == '\'';
}
static int is_digit(unsigned char c) { return c >= '0' && c <= '9'; }
static int is_space(unsigned char c) { return c == ' ' || c == '\n' || c == '\t' || c == '\r'; }

static size_t next_word(const unsigned char *s, size_t i, size_t n)
{
    size_t j = i;
    if (s[j] == ' ' && j + 1 < n && !is_space(s[j + 1]))
        j++;
    if (is_letter(s[j])) {
        while (j < n && is_letter(s[j]))
            j++;
    } else if (is_digit(s[j])) {
        size_t k = 0;
        while (j < n && is_digit(s[j]) && k < 3)
            j++, k++;
    } else if (is_space(s[j])) {
        while (j < n && is_space(s[j]))
            j++;
    } else {
        while (j < n && !is_space(s[j]) && !is_letter(s[j]) && !is_digit(s[j]))
            j++;
    }
    return j > i ? j : i + 1;
}

typedef struct word {
    uint32_t *sym;
    uint32_t len;
    uint32_t freq;
    const unsigned char *text;
    uint32_t text_len;
} word;

typedef struct pair_count {
    uint64_t key;    /* a << 32 | b, 0 = empty (pair (0,0) is stored as key+1) */
    uint64_t count;
} pair_count;

#define PAIR_SLOTS (1u << 16)

static uint64_t pair_hash(uint64_t k)
{
    return k3_synth_mix(k) & (PAIR_SLOTS - 1);
}

int k3_synth_bpe_learn(uint32_t max_ranks, unsigned char ***tokens_out, uint32_t **lens_out, uint32_t *count_out,
                       k3_err *e)
{
    const unsigned char *s = (const unsigned char *)sample_text;
    size_t n = sizeof sample_text - 1;
    if (max_ranks < 256)
        max_ranks = 256;
    int rc = 0;
    uint32_t nw = 0, capw = 1024;
    word *w = calloc(capw, sizeof *w);
    unsigned char **tok = calloc(max_ranks, sizeof *tok);
    uint32_t *tlen = calloc(max_ranks, sizeof *tlen);
    pair_count *pc = malloc(PAIR_SLOTS * sizeof *pc);
    if (!w || !tok || !tlen || !pc) {
        rc = k3_err_set(e, K3_ENOMEM, "out of memory learning the vocabulary");
        goto out;
    }
    for (uint32_t b = 0; b < 256; b++) {
        tok[b] = malloc(1);
        if (!tok[b]) {
            rc = k3_err_set(e, K3_ENOMEM, "out of memory learning the vocabulary");
            goto out;
        }
        tok[b][0] = (unsigned char)b;
        tlen[b] = 1;
    }
    uint32_t ntok = 256;
    /* unique words with their frequencies */
    for (size_t i = 0; i < n;) {
        size_t j = next_word(s, i, n);
        uint32_t len = (uint32_t)(j - i), k;
        for (k = 0; k < nw; k++)
            if (w[k].text_len == len && !memcmp(w[k].text, s + i, len))
                break;
        if (k < nw) {
            w[k].freq++;
        } else {
            if (nw == capw) {
                word *nwp = realloc(w, 2 * capw * sizeof *w);
                if (!nwp) {
                    rc = k3_err_set(e, K3_ENOMEM, "out of memory learning the vocabulary");
                    goto out;
                }
                w = nwp;
                capw *= 2;
            }
            w[nw] = (word){malloc(len * sizeof(uint32_t)), len, 1, s + i, len};
            if (!w[nw].sym) {
                rc = k3_err_set(e, K3_ENOMEM, "out of memory learning the vocabulary");
                goto out;
            }
            for (uint32_t c = 0; c < len; c++)
                w[nw].sym[c] = s[i + c];
            nw++;
        }
        i = j;
    }
    for (uint32_t iter = 0; ntok < max_ranks && iter < 4 * max_ranks; iter++) {
        memset(pc, 0, PAIR_SLOTS * sizeof *pc);
        for (uint32_t k = 0; k < nw; k++)
            for (uint32_t c = 0; c + 1 < w[k].len; c++) {
                uint64_t key = ((uint64_t)w[k].sym[c] << 32 | w[k].sym[c + 1]) + 1;
                uint64_t h = pair_hash(key);
                while (pc[h].key && pc[h].key != key)
                    h = (h + 1) & (PAIR_SLOTS - 1);
                pc[h].key = key;
                pc[h].count += w[k].freq;
            }
        uint64_t best = 0, best_count = 0;
        for (uint32_t h = 0; h < PAIR_SLOTS; h++)
            if (pc[h].key && (pc[h].count > best_count || (pc[h].count == best_count && pc[h].key < best))) {
                best = pc[h].key;
                best_count = pc[h].count;
            }
        if (best_count < 2)
            break;
        uint32_t a = (uint32_t)((best - 1) >> 32), b = (uint32_t)(best - 1);
        uint32_t clen = tlen[a] + tlen[b];
        unsigned char *cat = malloc(clen);
        if (!cat) {
            rc = k3_err_set(e, K3_ENOMEM, "out of memory learning the vocabulary");
            goto out;
        }
        memcpy(cat, tok[a], tlen[a]);
        memcpy(cat + tlen[a], tok[b], tlen[b]);
        uint32_t id;
        for (id = 0; id < ntok; id++)
            if (tlen[id] == clen && !memcmp(tok[id], cat, clen))
                break;
        if (id == ntok) {
            tok[ntok] = cat;
            tlen[ntok] = clen;
            ntok++;
        } else {
            free(cat);
        }
        for (uint32_t k = 0; k < nw; k++) {
            uint32_t o = 0;
            for (uint32_t c = 0; c < w[k].len; c++) {
                if (c + 1 < w[k].len && w[k].sym[c] == a && w[k].sym[c + 1] == b) {
                    w[k].sym[o++] = id;
                    c++;
                } else {
                    w[k].sym[o++] = w[k].sym[c];
                }
            }
            w[k].len = o;
        }
    }
    *tokens_out = tok;
    *lens_out = tlen;
    *count_out = ntok;
    tok = NULL;
    tlen = NULL;
out:
    if (w)
        for (uint32_t k = 0; k < nw; k++)
            free(w[k].sym);
    free(w);
    free(pc);
    if (tok)
        k3_synth_bpe_free(tok, tlen, max_ranks);
    else
        free(tlen);
    return rc;
}

void k3_synth_bpe_free(unsigned char **tokens, uint32_t *lens, uint32_t count)
{
    if (tokens)
        for (uint32_t i = 0; i < count; i++)
            free(tokens[i]);
    free(tokens);
    free(lens);
}

void k3_synth_special_name(uint32_t k, char *buf, size_t cap)
{
    /* the K3 ids of [BOS], [EOS] and <|end_of_msg|> are ranks + 0, 1, 2; then the
     * other control tokens of the chat format */
    static const char *named[] = {"[BOS]", "[EOS]", "<|end_of_msg|>", "<|open|>", "<|close|>", "<|sep|>"};
    if (k < sizeof named / sizeof *named)
        snprintf(buf, cap, "%s", named[k]);
    else
        snprintf(buf, cap, "<|reserved_token_%u|>", k);
}
