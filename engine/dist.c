/*
 * dist.c - the parts of k3_dist.h that do not depend on the message layer:
 * the process's ranks, the row blocks and the status agreement.
 */
#include <stdio.h>
#include <string.h>

#include "k3_dist.h"

static k3_dist *g_dist;

k3_dist *k3_dist_get(void) { return g_dist; }
void k3_dist_set(k3_dist *d) { g_dist = d; }

static uint64_t split_at(uint64_t rows, uint32_t q, uint32_t size)
{
    if (q >= size)
        return rows;
    uint64_t r = (uint64_t)((unsigned __int128)rows * q / size) / 16 * 16;
    return r < rows ? r : rows;
}

void k3_dist_rows(uint64_t rows, uint32_t q, uint32_t size, uint64_t *lo, uint64_t *hi)
{
    *lo = split_at(rows, q, size);
    *hi = split_at(rows, q + 1, size);
}

static void status_fill(k3_dist_status *s, int code, uint32_t value)
{
    memset(s, 0, sizeof *s);
    s->code = code < 0 ? code : 0;
    s->value = value;
}

/* The lowest failing rank's error, else 0. A failure is rare: only then do
 * the ranks send their messages. */
static int status_check(k3_dist *d, const k3_dist_status *const *st, const k3_err *mine, k3_err *e)
{
    uint32_t q = 0;
    while (q < d->size && st[q]->code == 0)
        q++;
    if (q == d->size)
        return 0;
    static char msgs[K3_DIST_MAX_RANKS][K3_ERR_MSG_MAX];
    char own[K3_ERR_MSG_MAX];
    snprintf(own, sizeof own, "%s", mine && mine->code < 0 && mine->msg[0] ? mine->msg : "");
    uint64_t n[K3_DIST_MAX_RANKS];
    for (uint32_t r = 0; r < d->size; r++)
        n[r] = K3_ERR_MSG_MAX;
    d->st.collectives++;
    int rc = d->ops->gather(d, own, K3_ERR_MSG_MAX, msgs, n, e);
    if (rc < 0)
        return rc;
    if (q == d->rank)
        return st[q]->code;   /* e holds this rank's own message */
    msgs[q][K3_ERR_MSG_MAX - 1] = 0;
    return k3_err_set(e, st[q]->code, "rank %u: %s", q, msgs[q][0] ? msgs[q] : k3_err_name(st[q]->code));
}

int k3_dist_agree(k3_dist *d, int code, const k3_err *mine, uint32_t value, const char *what, k3_err *e)
{
    k3_dist_status me, all[K3_DIST_MAX_RANKS];
    const k3_dist_status *st[K3_DIST_MAX_RANKS];
    status_fill(&me, code, value);
    uint64_t n[K3_DIST_MAX_RANKS];
    for (uint32_t q = 0; q < d->size; q++)
        n[q] = sizeof me;
    d->st.collectives++;
    int rc = d->ops->gather(d, &me, sizeof me, all, n, e);
    if (rc < 0)
        return rc;
    for (uint32_t q = 0; q < d->size; q++)
        st[q] = &all[q];
    if ((rc = status_check(d, st, mine, e)) < 0)
        return rc;
    for (uint32_t q = 1; q < d->size; q++)
        if (all[q].value != all[0].value)
            return k3_err_set(e, K3_EARG, "rank %u: %s is %u, rank 0's is %u: every rank must run the same model "
                              "with the same options", q, what ? what : "a setting", all[q].value, all[0].value);
    return 0;
}

int k3_dist_gather(k3_dist *d, int code, const k3_err *mine, void *send, const uint64_t *n, void *recv,
                   const void **parts, k3_err *e)
{
    const uint64_t S = sizeof(k3_dist_status);
    status_fill(send, code, 0);
    uint64_t cnt[K3_DIST_MAX_RANKS];
    for (uint32_t q = 0; q < d->size; q++)
        cnt[q] = S + (n[q] + 7) / 8 * 8;   /* every status 8-aligned in recv */
    memset((uint8_t *)send + S + n[d->rank], 0, cnt[d->rank] - S - n[d->rank]);
    d->st.collectives++;
    d->st.bytes_out += n[d->rank];
    int rc = d->ops->gather(d, send, cnt[d->rank], recv, cnt, e);
    if (rc < 0)
        return rc;
    const k3_dist_status *st[K3_DIST_MAX_RANKS];
    uint64_t off = 0;
    for (uint32_t q = 0; q < d->size; q++) {
        st[q] = (const k3_dist_status *)((const uint8_t *)recv + off);
        parts[q] = (const uint8_t *)recv + off + S;
        off += cnt[q];
        if (q != d->rank)
            d->st.bytes_in += n[q];
    }
    return status_check(d, st, mine, e);
}
