/*
 * fz_tok.c - the tokenizer files: tiktoken.model and tokenizer_config.json
 * (k3_tok_open_files), then encode/decode with whatever tokenizer they give.
 *
 * Input: tiktoken.model text, then optionally K3_FUZZ_SEP and the
 * tokenizer_config.json text (absent: opened without a config), then
 * optionally K3_FUZZ_SEP and a text to encode (absent: a fixed sentence).
 * An accepted tokenizer must keep the promises of k3_tok.h on that text
 * (see tok_check.h), and its vocabulary must be within the documented bounds.
 */
#include "k3_fuzz.h"

#include <string.h>

#include "k3_tok.h"
#include "tok_check.h"

static const char sample[] = "Hello, world! The quick brown fox <|im_end|> 12345 \xe4\xb8\xad\xe6\x96\x87 "
                             "caf\xc3\xa9 \xff\xfe it's  \n\n\tend";

K3_FUZZ_TARGET(tok)
{
    const uint8_t *model, *rest, *config, *text;
    size_t model_len, rest_len, config_len, text_len;
    k3_fuzz_split(data, size, &model, &model_len, &rest, &rest_len);
    int have_config = rest != data + size;
    k3_fuzz_split(rest, rest_len, &config, &config_len, &text, &text_len);
    int have_text = text != rest + rest_len;

    char model_path[2048], config_path[2048];
    k3_fuzz_write("tiktoken.model", model, model_len, model_path, sizeof model_path);
    if (have_config)
        k3_fuzz_write("tokenizer_config.json", config, config_len, config_path, sizeof config_path);
    k3_tok *tok = NULL;
    k3_err e = {0};
    int rc = k3_tok_open_files(&tok, model_path, have_config ? config_path : NULL, &e);
    k3_fuzz_check_result(rc, &e, "k3_tok_open_files");
    if (rc == 0) {
        if (k3_tok_rank_count(tok) < 256 || k3_tok_rank_count(tok) > K3_TOK_MAX_RANKS)
            k3_fuzz_fail("accepted %u ranks", k3_tok_rank_count(tok));
        if (k3_tok_vocab_size(tok) > K3_TOK_MAX_RANKS + K3_TOK_MAX_SPECIALS)
            k3_fuzz_fail("accepted a vocabulary of %u", k3_tok_vocab_size(tok));
        const uint32_t *eos;
        uint32_t neos;
        k3_tok_eos_ids(tok, &eos, &neos);
        if (neos > K3_TOK_MAX_EOS)
            k3_fuzz_fail("%u eos ids", neos);
        for (uint32_t i = 0; i < neos; i++)
            if (eos[i] >= k3_tok_vocab_size(tok))
                k3_fuzz_fail("eos id %u outside the vocabulary", eos[i]);
        if (have_text)
            k3_fuzz_tok_check_text(tok, text, text_len);
        else
            k3_fuzz_tok_check_text(tok, (const uint8_t *)sample, sizeof sample - 1);
    }
    k3_tok_close(tok);
    return 0;
}
