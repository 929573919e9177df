/*
 * progress.c - progress lines for long jobs (see k3_progress.h).
 *
 * Invariants: k3_progress_add is lock-free (one atomic add) except for the
 * thread that wins the right to print, chosen by a compare-and-swap on the
 * time of the next line, so lines never interleave. Nothing is printed when
 * the handle is quiet, and nothing before the job has run for a second (short
 * jobs stay silent). On a terminal the line is rewritten in place with "\r";
 * otherwise a plain line is printed every K3_PROGRESS_PLAIN_NS.
 * K3_PROGRESS_EVERY_MS=N in the environment sets both the silent start and the
 * plain-line interval to N ms (a log that wants more lines; tests use 0).
 */
#include "k3_progress.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define K3_PROGRESS_TTY_NS   (200ull * 1000 * 1000)       /* redraw 5 times a second */
#define K3_PROGRESS_PLAIN_NS (5ull * 1000 * 1000 * 1000)  /* a plain line every 5 s */
#define K3_PROGRESS_QUIET_NS (1ull * 1000 * 1000 * 1000)  /* silent for the first second */

struct k3_progress {
    char label[64];
    char unit[16];              /* "" : bytes */
    uint64_t total;
    FILE *out;
    int quiet;
    int tty;
    uint64_t silent_ns, plain_ns; /* K3_PROGRESS_QUIET_NS, _PLAIN_NS unless the environment says */
    uint64_t start_ns;
    _Atomic uint64_t done;
    _Atomic uint64_t next_ns;   /* earliest time of the next line */
    _Atomic int printed;        /* a line has been shown (so finish prints one too) */
    _Atomic int busy;           /* one printer at a time */
};

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* "12.3 GB" style, decimal units like disk vendors and dd. */
static void fmt_bytes(char *buf, size_t cap, double b)
{
    static const char *unit[] = {"B", "kB", "MB", "GB", "TB", "PB"};
    int u = 0;
    while (b >= 1000.0 && u < 5) {
        b /= 1000.0;
        u++;
    }
    if (u == 0)
        snprintf(buf, cap, "%.0f %s", b, unit[u]);
    else
        snprintf(buf, cap, "%.*f %s", b < 10 ? 2 : b < 100 ? 1 : 0, b, unit[u]);
}

static void fmt_secs(char *buf, size_t cap, double s)
{
    if (s < 0 || s > 1e8)
        snprintf(buf, cap, "?");
    else if (s < 60)
        snprintf(buf, cap, "%.0fs", s);
    else if (s < 3600)
        snprintf(buf, cap, "%dm%02ds", (int)s / 60, (int)s % 60);
    else
        snprintf(buf, cap, "%dh%02dm", (int)s / 3600, ((int)s % 3600) / 60);
}

static void print_line(k3_progress *p, uint64_t done, uint64_t t, int final)
{
    char d[32], tot[32], rate[32], eta[32], el[32];
    double secs = (double)(t - p->start_ns) / 1e9;
    double r = secs > 0 ? (double)done / secs : 0;
    if (p->unit[0]) {
        snprintf(d, sizeof d, "%llu %s", (unsigned long long)done, p->unit);
        snprintf(rate, sizeof rate, "%.1f %s", r, p->unit);
    } else {
        fmt_bytes(d, sizeof d, (double)done);
        fmt_bytes(rate, sizeof rate, r);
    }
    fmt_secs(el, sizeof el, secs);
    char line[256];
    if (final) {
        snprintf(line, sizeof line, "%s: %s in %s, %s/s", p->label, d, el, rate);
    } else if (p->total) {
        if (p->unit[0])
            snprintf(tot, sizeof tot, "%llu", (unsigned long long)p->total);
        else
            fmt_bytes(tot, sizeof tot, (double)p->total);
        double left = done < p->total && r > 0 ? (double)(p->total - done) / r : 0;
        fmt_secs(eta, sizeof eta, left);
        snprintf(line, sizeof line, "%s: %s / %s (%.1f%%), %s/s, ETA %s", p->label, d, tot,
                 100.0 * (double)done / (double)p->total, rate, eta);
    } else {
        snprintf(line, sizeof line, "%s: %s, %s/s, %s elapsed", p->label, d, rate, el);
    }
    if (p->tty)
        fprintf(p->out, "\r%s\033[K%s", line, final ? "\n" : "");
    else
        fprintf(p->out, "%s\n", line);
    fflush(p->out);
}

k3_progress *k3_progress_create(const char *label, uint64_t total_bytes, FILE *out, int mode)
{
    k3_progress *p = calloc(1, sizeof *p);
    if (!p)
        return NULL;
    snprintf(p->label, sizeof p->label, "%s", label ? label : "progress");
    p->total = total_bytes;
    p->out = out;
    p->tty = out && isatty(fileno(out));
    p->quiet = mode == K3_PROGRESS_QUIET || !out || (mode != K3_PROGRESS_FORCE && !p->tty);
    p->silent_ns = K3_PROGRESS_QUIET_NS;
    p->plain_ns = K3_PROGRESS_PLAIN_NS;
    const char *every = getenv("K3_PROGRESS_EVERY_MS");
    if (every && *every) {
        char *end;
        unsigned long long ms = strtoull(every, &end, 10);
        if (!*end && ms <= 3600000ull)
            p->silent_ns = p->plain_ns = ms * 1000000ull;
    }
    p->start_ns = now_ns();
    atomic_init(&p->done, 0);
    atomic_init(&p->next_ns, p->start_ns + p->silent_ns);
    atomic_init(&p->printed, 0);
    atomic_init(&p->busy, 0);
    return p;
}

void k3_progress_add(k3_progress *p, uint64_t bytes)
{
    if (!p)
        return;
    uint64_t done = atomic_fetch_add_explicit(&p->done, bytes, memory_order_relaxed) + bytes;
    if (p->quiet)
        return;
    uint64_t next = atomic_load_explicit(&p->next_ns, memory_order_relaxed);
    uint64_t t = now_ns();
    if (t < next)
        return;
    uint64_t step = p->tty ? K3_PROGRESS_TTY_NS : p->plain_ns;
    if (!atomic_compare_exchange_strong(&p->next_ns, &next, t + step))
        return; /* another thread prints this one */
    int expected = 0;
    if (!atomic_compare_exchange_strong(&p->busy, &expected, 1))
        return;
    print_line(p, done, t, 0);
    atomic_store(&p->printed, 1);
    atomic_store(&p->busy, 0);
}

void k3_progress_finish(k3_progress *p)
{
    if (!p || p->quiet)
        return;
    uint64_t t = now_ns();
    /* A job that finished within the silent second prints nothing at all. */
    if (!atomic_load(&p->printed) && t - p->start_ns < p->silent_ns)
        return;
    print_line(p, atomic_load(&p->done), t, 1);
}

void k3_progress_set_unit(k3_progress *p, const char *unit)
{
    if (p)
        snprintf(p->unit, sizeof p->unit, "%s", unit ? unit : "");
}

void k3_progress_set_total(k3_progress *p, uint64_t total)
{
    if (p)
        p->total = total;
}

void k3_progress_free(k3_progress *p)
{
    free(p);
}
