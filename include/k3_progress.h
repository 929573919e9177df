/*
 * k3_progress.h - progress reporting for anything that runs longer than a
 * second. On a terminal: one updating line (done/total bytes, rate, ETA) on
 * stderr. Not a terminal: a plain line every few seconds. Quiet: nothing.
 * This is the one part of the library that prints, and only to the stream the
 * tool hands it; tools create it, library code only calls k3_progress_add.
 * Off a terminal the first second is silent and then a line comes every 5 s;
 * K3_PROGRESS_EVERY_MS=N in the environment makes both N milliseconds.
 */
#ifndef K3_PROGRESS_H
#define K3_PROGRESS_H

#include <stdint.h>
#include <stdio.h>

typedef struct k3_progress k3_progress;

/* When to print (the mode argument of k3_progress_create). */
#define K3_PROGRESS_AUTO  0   /* only when out is a terminal */
#define K3_PROGRESS_QUIET 1   /* never (--quiet) */
#define K3_PROGRESS_FORCE 2   /* also when out is not a terminal (--progress): a plain line every 5 s */

/* label: "convert", "verify", ...; total_bytes 0 if unknown. out is usually
 * stderr; NULL or K3_PROGRESS_QUIET gives a progress that prints nothing.
 * K3_PROGRESS_AUTO prints only on a terminal, so that logs and pipes get
 * nothing unless asked. */
k3_progress *k3_progress_create(const char *label, uint64_t total_bytes, FILE *out, int mode);
/* Count in units instead of bytes ("tokens"): printed as plain numbers. */
void k3_progress_set_unit(k3_progress *p, const char *unit);
/* Set or raise the total once it is known. Accepts NULL. */
void k3_progress_set_total(k3_progress *p, uint64_t total);
/* Count bytes done; thread-safe, cheap enough to call per megabyte. Accepts NULL. */
void k3_progress_add(k3_progress *p, uint64_t bytes);
/* Print the final line (total, mean rate, elapsed). Accepts NULL. */
void k3_progress_finish(k3_progress *p);
void k3_progress_free(k3_progress *p);

#endif
