/*
 * k3_chat.h - the K3 chat format ("XTML"): a conversation rendered to token
 * ids, the model's turn parsed back into reasoning and answer, and
 * conversations stored as JSON lines. The format is described in
 * runtime/CHAT.md; in short:
 *
 *   element(tag, attrs, body) = <|open|> tag attrs <|sep|> body <|close|> tag <|sep|>
 *   message(role, body)       = element("message", ' role="ROLE"', body) <|end_of_msg|>
 *
 * Control tokens (<|open|>, <|close|>, <|sep|>, <|end_of_msg|>, [EOS]) appear
 * only where the renderer puts them. Every other piece - the text between two
 * control tokens, e.g. `message role="user"` or a message's text - is encoded
 * as one unit with special-token matching off, so a user typing "<|open|>"
 * gets ordinary text tokens.
 *
 * Roles: an optional system message first, then user and assistant strictly
 * alternating, starting with user. With thinking on, a system message with
 * attributes ` role="system" type="thinking-effort"` naming the effort (low,
 * high or max; medium is refused as the upstream encoder refuses it) opens
 * the conversation, and an assistant body is element("think", "", reasoning)
 * then element("response", "", text); with thinking off only the response.
 *
 * History file (JSON lines, one message per line, LF-terminated, UTF-8):
 *   {"role":"user","content":"..."}
 *   {"role":"assistant","content":"...","reasoning_content":"..."}
 * Strict: exactly these keys (reasoning_content optional, string or null,
 * assistant only), no duplicates, valid UTF-8, no NUL, a line at most
 * K3_CHAT_LINE_MAX bytes, at most K3_CHAT_MAX_MSGS lines, the role order
 * above. Written atomically (DST.tmp, fsync, rename, fsync of the directory).
 */
#ifndef K3_CHAT_H
#define K3_CHAT_H

#include <stdint.h>

#include "k3_err.h"
#include "k3_tok.h"

#define K3_CHAT_LINE_MAX  (16u << 20)   /* bytes per history line, newline excluded */
#define K3_CHAT_MAX_MSGS  (1u << 20)    /* messages per conversation */
#define K3_CHAT_FILE_MAX  (256ull << 20) /* bytes per history file */

typedef enum k3_chat_role { K3_CHAT_SYSTEM = 0, K3_CHAT_USER = 1, K3_CHAT_ASSISTANT = 2 } k3_chat_role;
typedef enum k3_chat_effort { K3_CHAT_LOW = 0, K3_CHAT_HIGH = 1, K3_CHAT_MAX = 2 } k3_chat_effort;

typedef struct k3_chat_opts {
    int thinking;              /* 1: the thinking channel (default), 0: off */
    k3_chat_effort effort;     /* with thinking: default K3_CHAT_MAX */
} k3_chat_opts;

/* The control token ids of a tokenizer. */
typedef struct k3_chat_ctl {
    uint32_t open, close, sep, end_of_msg, eos;
} k3_chat_ctl;

/* One message. Strings are heap copies owned by the conversation (NUL
 * terminated, length given; reasoning NULL when there is none). */
typedef struct k3_chat_msg {
    k3_chat_role role;
    char *content;
    uint64_t content_len;
    char *reasoning;
    uint64_t reasoning_len;
} k3_chat_msg;

typedef struct k3_chat {
    k3_chat_msg *msgs;
    uint32_t n, cap;
} k3_chat;

/* "low", "high", "max" -> *out; "medium" and anything else: K3_EARG with a
 * message saying why. */
int k3_chat_effort_parse(const char *s, k3_chat_effort *out, k3_err *e);
const char *k3_chat_effort_name(k3_chat_effort effort);
const char *k3_chat_role_name(k3_chat_role role);

/* Find the five control tokens among tok's specials; a missing one is
 * K3_EFORMAT naming it. */
int k3_chat_ctl_find(const k3_tok *tok, k3_chat_ctl *ctl, k3_err *e);

/* Append a message (copies the bytes). The role must be the one the order
 * allows next (K3_EARG otherwise, saying which role was expected);
 * reasoning only for an assistant (may be NULL). */
int k3_chat_add(k3_chat *c, k3_chat_role role, const char *content, uint64_t content_len,
                const char *reasoning, uint64_t reasoning_len, k3_err *e);
/* The role the order allows next given the last one (n messages). */
k3_chat_role k3_chat_next_role(const k3_chat *c);
void k3_chat_clear(k3_chat *c);   /* no messages; keeps nothing */
void k3_chat_free(k3_chat *c);    /* accepts a zeroed or freed k3_chat */

/* Render messages to ids. With gen_prompt the last message must be a user
 * message and the generation prompt follows it. *ids is a heap array the
 * caller frees. Role order errors are K3_EARG. */
int k3_chat_render(const k3_tok *tok, const k3_chat_opts *o, const k3_chat *c, int gen_prompt, uint32_t **ids,
                   uint64_t *n_ids, k3_err *e);

/*
 * The model's turn, fed one generated id at a time (the ids after the
 * generation prompt). Each id is classified: its bytes are reasoning, answer,
 * or markup (control tokens and tag names), or it ends the turn. A control
 * token where the format has none (inside the reasoning or the answer), a
 * wrong tag name, or anything after the end id is K3_EFORMAT with a message
 * naming the token and where it was; the parser then refuses more ids.
 */
enum { K3_CHAT_EV_REASONING = 1, K3_CHAT_EV_ANSWER = 2, K3_CHAT_EV_MARKUP = 3, K3_CHAT_EV_END = 4 };

typedef struct k3_chat_turn k3_chat_turn;

int k3_chat_turn_create(k3_chat_turn **out, const k3_tok *tok, const k3_chat_opts *o, k3_err *e);
void k3_chat_turn_free(k3_chat_turn *t);   /* accepts NULL */
void k3_chat_turn_reset(k3_chat_turn *t);  /* for a new turn */
/* Classify one id: returns a K3_CHAT_EV_* (> 0) or a negative error. */
int k3_chat_turn_push(k3_chat_turn *t, uint32_t id, k3_err *e);
/* 1 once the end id was pushed. */
int k3_chat_turn_done(const k3_chat_turn *t);
/* The reasoning and answer bytes so far (borrowed, NUL terminated, valid until
 * the next push or reset). */
const char *k3_chat_turn_reasoning(const k3_chat_turn *t, uint64_t *len);
const char *k3_chat_turn_answer(const k3_chat_turn *t, uint64_t *len);

/* A whole turn: the ids must be exactly one well-formed turn, ending with an
 * end id. *reasoning and *answer are heap strings (reasoning "" with thinking
 * off). A turn that stops before its end is K3_EFORMAT ("the turn ends in the
 * answer ..."). */
int k3_chat_parse(const k3_tok *tok, const k3_chat_opts *o, const uint32_t *ids, uint64_t n, char **reasoning,
                  uint64_t *reasoning_len, char **answer, uint64_t *answer_len, k3_err *e);

/* Replace every byte that is not part of well-formed UTF-8 in s (in place
 * would grow it, so: a new heap string) by U+FFFD. */
int k3_chat_utf8_clean(const char *s, uint64_t len, char **out, uint64_t *out_len, k3_err *e);
/* 1 if s is well-formed UTF-8 without NUL. */
int k3_chat_utf8_valid(const char *s, uint64_t len);

/* Read a history file into c (which must be empty). Errors name the file
 * and line. */
int k3_chat_history_read(k3_chat *c, const char *path, k3_err *e);
/* Write c to path atomically (overwrites path: the caller decides whether it
 * may). */
int k3_chat_history_write(const k3_chat *c, const char *path, k3_err *e);

#endif
