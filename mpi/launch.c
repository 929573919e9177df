/*
 * launch.c - the MPI build of a tool (k3-run-mpi, k3-serve-mpi): the
 * message layer of k3_dist.h over MPI, and the main that starts it.
 *
 * Started by mpirun (or srun, or any launcher of MPI jobs) as N processes:
 * rank 0 runs the tool's own main with the command line as given; every
 * other rank follows it (k3_follow) and prints nothing but its own fatal
 * errors. With N = 1 the tool runs as its plain build does.
 *
 * Every collective is non-blocking and polled, so that one that does not
 * complete within the timeout (K3_DIST_TIMEOUT seconds, default 600; a
 * rank stopped, or lost without the launcher noticing) ends the job with
 * one line and exit status 4 instead of hanging. A follower waiting for
 * rank 0's next order waits without a limit: rank 0 may be waiting for a
 * user. A rank that dies is seen by the launcher, which ends the others.
 */
#include <errno.h>
#include <limits.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "k3_dist.h"
#include "k3_err.h"
#include "k3_io.h"

#include "tool_main.h"

static const char *tool = "k3";

/* Wait for r, polling: within d->timeout_s unless forever. */
static int wait_req(k3_dist *d, MPI_Request *r, int forever, const char *what)
{
    const double t0 = k3_now_s();
    long ns = 1000;
    for (;;) {
        int done = 0;
        if (MPI_Test(r, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS)
            break;
        if (done)
            return 0;
        if (!forever && k3_now_s() - t0 > d->timeout_s) {
            fprintf(stderr, "%s: error: rank %u: no answer from the other ranks within %.0f s (%s); ending the job "
                    "(K3_DIST_TIMEOUT sets the limit)\n", tool, d->rank, d->timeout_s, what);
            d->ops->abort(d, K3_EXIT_IO);
        }
        struct timespec ts = {0, ns};
        nanosleep(&ts, NULL);
        if (ns < 200000)
            ns *= 2;
    }
    fprintf(stderr, "%s: error: rank %u: the message layer failed (%s)\n", tool, d->rank, what);
    d->ops->abort(d, K3_EXIT_IO);
    return K3_EIO;
}

static int mpi_gather(k3_dist *d, const void *mine, uint64_t n_mine, void *all, const uint64_t *n, k3_err *e)
{
    int cnt[K3_DIST_MAX_RANKS], disp[K3_DIST_MAX_RANKS];
    uint64_t off = 0;
    for (uint32_t q = 0; q < d->size; q++) {
        if (n[q] > INT_MAX || off > INT_MAX)
            return k3_err_set(e, K3_ELIMIT, "a gather of %llu bytes from rank %u: over the 2 GiB a message holds",
                              (unsigned long long)n[q], q);
        cnt[q] = (int)n[q];
        disp[q] = (int)off;
        off += n[q];
    }
    MPI_Request r;
    if (MPI_Iallgatherv(mine, (int)n_mine, MPI_BYTE, all, cnt, disp, MPI_BYTE, MPI_COMM_WORLD, &r) != MPI_SUCCESS)
        return k3_err_set(e, K3_EIO, "rank %u: MPI_Iallgatherv failed", d->rank);
    return wait_req(d, &r, 0, "gathering a result");
}

static int mpi_bcast(k3_dist *d, void *buf, uint64_t n, int forever, k3_err *e)
{
    for (uint64_t off = 0; off < n;) {
        const uint64_t k = n - off < (1u << 30) ? n - off : (1u << 30);
        MPI_Request r;
        if (MPI_Ibcast((uint8_t *)buf + off, (int)k, MPI_BYTE, 0, MPI_COMM_WORLD, &r) != MPI_SUCCESS)
            return k3_err_set(e, K3_EIO, "rank %u: MPI_Ibcast failed", d->rank);
        int rc = wait_req(d, &r, forever, "waiting for rank 0");
        if (rc < 0)
            return rc;
        off += k;
    }
    return 0;
}

static void mpi_abort(k3_dist *d, int status)
{
    (void)d;
    fflush(NULL);
    MPI_Abort(MPI_COMM_WORLD, status);
    _exit(status);
}

static const k3_dist_ops mpi_ops = {mpi_gather, mpi_bcast, mpi_abort};
static k3_dist g_d;

static void print_stats(void)
{
    if (!getenv("K3_DIST_STATS"))
        return;
    const k3_dist_stats *s = &g_d.st;
    fprintf(stderr, "%s: rank %u: %llu collectives (%llu trunk rounds, %llu expert exchanges), %llu orders, "
            "%llu bytes out, %llu in\n", tool, g_d.rank, (unsigned long long)s->collectives,
            (unsigned long long)s->trunk_gathers, (unsigned long long)s->expert_gathers,
            (unsigned long long)s->commands, (unsigned long long)s->bytes_out, (unsigned long long)s->bytes_in);
}

/* Rank 0 leaving, by return or exit(): the followers stop, then MPI ends. */
static void finish(void)
{
    k3_err e;
    k3_follow_stop(&g_d, &e);
    print_stats();
    MPI_Finalize();
}

int main(int argc, char **argv)
{
    const char *slash = strrchr(argv[0], '/');
    tool = slash ? slash + 1 : argv[0];
    /* The tools run OpenMP's threads passive, set before libgomp loads by
     * executing themselves again (runtime/main.c); that must happen before
     * MPI starts, and holds for the followers too. */
    if (!getenv("OMP_WAIT_POLICY") && setenv("OMP_WAIT_POLICY", "passive", 1) == 0)
        execv("/proc/self/exe", argv);
    int provided, rank, size;
    if (MPI_Init_thread(&argc, &argv, MPI_THREAD_SERIALIZED, &provided) != MPI_SUCCESS) {
        fprintf(stderr, "%s: error: MPI_Init failed\n", tool);
        return K3_EXIT_IO;
    }
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    if (size > (int)K3_DIST_MAX_RANKS) {
        if (rank == 0)
            fprintf(stderr, "%s: error: %d ranks: at most %u\n", tool, size, K3_DIST_MAX_RANKS);
        MPI_Finalize();
        return K3_EXIT_USAGE;
    }
    g_d.ops = &mpi_ops;
    g_d.rank = (uint32_t)rank;
    g_d.size = (uint32_t)size;
    g_d.timeout_s = 600;
    const char *t = getenv("K3_DIST_TIMEOUT");
    if (t && *t) {
        char *end;
        errno = 0;
        double v = strtod(t, &end);
        if (errno || *end || !(v > 0) || v > 1e9) {
            if (rank == 0)
                fprintf(stderr, "%s: error: K3_DIST_TIMEOUT=%s: expected seconds above 0\n", tool, t);
            MPI_Finalize();
            return K3_EXIT_USAGE;
        }
        g_d.timeout_s = v;
    }
    if (size == 1) {
        int rc = k3_tool_main(argc, argv);
        MPI_Finalize();
        return rc;
    }
    k3_dist_set(&g_d);
    if (rank == 0) {
        atexit(finish);
        return k3_tool_main(argc, argv);
    }
    k3_err e;
    k3_err_clear(&e);
    int rc = k3_follow(&g_d, &e);
    if (rc < 0)
        fprintf(stderr, "%s: error: rank %d: %s\n", tool, rank, e.msg);
    print_stats();
    MPI_Finalize();
    return rc < 0 ? k3_err_exit_status(rc) : 0;
}
