/*
 * k3_journal.h - the resume journal of k3-convert and k3-pack
 * (manifests/journal.c): a directory of entries beside the output, each
 * written atomically (tmp + fsync + rename + fsync of the directory).
 *
 * A JSON entry is sealed (k3_man_seal: the hex SHA-256 of the body on the
 * first line), so a value that reads back differently from what was written
 * is never taken: k3_journal_get returns NULL for it, as for a missing or
 * unreadable entry, and says why. A blob entry (raw bytes) is trusted only
 * through a SHA-256 that a sealed entry records.
 *
 * The plan entry holds the fingerprint of the job (a hex SHA-256): a
 * journal of another plan is never resumed. k3_journal_remove removes the
 * plan entry first, so a journal killed while being removed is never taken
 * for one that is whole.
 */
#ifndef K3_JOURNAL_H
#define K3_JOURNAL_H

#include <stddef.h>
#include <stdint.h>

#include <cjson/cJSON.h>

#include "k3_err.h"

typedef struct k3_journal {
    char dir[4096];         /* the journal directory */
    const char *plan_name;  /* its plan entry ("plan.json", "plan") */
} k3_journal;

/* j names the directory parent/name (nothing is created). */
int k3_journal_init(k3_journal *j, const char *parent, const char *name, const char *plan_name, k3_err *e);

/* Does the directory exist? */
int k3_journal_exists(const k3_journal *j);

/* Create the directory (an existing one is kept) and write the plan entry. */
int k3_journal_begin(const k3_journal *j, const char *fingerprint_hex, k3_err *e);

/* The plan entry against fingerprint_hex: 0 the same, 1 another plan (or
 * an entry that does not match its seal), 2 absent, a K3_E* code (<0) if it
 * cannot be read. */
int k3_journal_plan_cmp(const k3_journal *j, const char *fingerprint_hex, k3_err *e);

/* Path of an entry. */
int k3_journal_path(const k3_journal *j, const char *entry, char *out, size_t cap, k3_err *e);

/* Write a sealed JSON entry (body is not consumed). */
int k3_journal_put(const k3_journal *j, const char *entry, const cJSON *body, k3_err *e);

/* The body of a sealed entry (caller deletes it), or NULL with *why set
 * ("no journal entry", "unreadable journal entry", "journal entry does not
 * match its own SHA-256"). why may be NULL. */
cJSON *k3_journal_get(const k3_journal *j, const char *entry, const char **why);

/* Raw entries: written atomically; read back only if exactly len bytes
 * whose SHA-256 is sha (0), else -1. */
int k3_journal_put_blob(const k3_journal *j, const char *entry, const void *buf, uint64_t len, k3_err *e);
int k3_journal_get_blob(const k3_journal *j, const char *entry, uint64_t len, const uint8_t sha[32], void *out);

/* Remove one entry (absent is fine). */
int k3_journal_drop(const k3_journal *j, const char *entry, k3_err *e);

/* Remove the whole journal (the plan entry first), then fsync its parent.
 * An absent journal is not an error. Only regular files are removed; any
 * other entry fails it (K3_EEXIST) and is left alone. */
int k3_journal_remove(const k3_journal *j, k3_err *e);

#endif
