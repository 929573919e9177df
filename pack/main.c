/*
 * k3-pack - re-lay out a packed model for a RAM floor (pack.h): streaming
 * unit size, pinned prefix, hot-expert order, without the upstream shards.
 * This file parses the command line, installs the interrupt handler and
 * prints the plan and the summary; the work is in pack_plan.c, pack_run.c
 * and pack_trace.c.
 */
#include <errno.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "k3_cli.h"
#include "k3_dist.h"
#include "k3_err.h"
#include "k3_io.h"
#include "k3_json.h"
#include "k3_out.h"
#include "k3_stream.h"
#include "pack.h"

static void usage(FILE *f)
{
    fprintf(f,
            "usage: k3-pack [options] --ram SIZE SRC DST\n"
            "       k3-pack --plan [options] --ram SIZE SRC\n"
            "       k3-pack --ranks N --rank R [--ram-piece SIZE] SRC DST\n"
            "\n"
            "Re-lay out the packed model SRC (k3-convert or k3-pack output) into DST for a\n"
            "RAM floor: streaming unit size (large tensors split by row ranges), the pinned\n"
            "set placed first in the trunk file (one sequential read), optionally the\n"
            "experts of each layer reordered by use. The plan is recorded in DST's\n"
            "manifest (\"plan\"); expert files that do not change are hard-linked (else\n"
            "reflinked, else copied). DST is built in DST" K3_PACK_TMP_SUFFIX " and renamed into\n"
            "place when complete.\n"
            "\n"
            "  --ram SIZE          the RAM budget k3-run will get: bytes with K/M/G/T, or\n"
            "                      laptop (8G), workstation (64G), server (512G), floor,\n"
            "                      double, resident (default: double)\n"
            "  --plan              print what would be done and the floors; write nothing\n"
            "  --unit-mb N         units of at most N MiB instead of one per layer; a\n"
            "                      tensor larger than that gets a unit of its own\n"
            "  --split-rows        with --unit-mb: split larger tensors by row ranges\n"
            "                      (k3-run without --ram runs such layouts; k3-run --ram\n"
            "                      streams row pieces itself and refuses them)\n"
            "  --ram-piece SIZE    k3-run's --ram-piece the floor is computed for (16M)\n"
            "  --pin LIST          pinned trunk groups: auto (k3-run's plan at SIZE), none,\n"
            "                      all, or a list like 0-3,7,head\n"
            "  --ranks N --rank R  write instead the slice of SRC that rank R of an N-rank\n"
            "                      k3-run-mpi or k3-serve-mpi job reads (docs/DIST.md): the\n"
            "                      other ranks' rows of the streamed matrices and their\n"
            "                      experts left as holes, at --ram-piece (the ranks must\n"
            "                      stream with it or smaller); checked by k3-verify\n"
            "  --expert-order TRACE  order each MoE layer's records by use in TRACE (from\n"
            "                      k3-run --ram SIZE --trace TRACE), hot set recorded\n"
            "  --ctx N --chunk N --threads N --baseline BYTES\n"
            "                      the k3-run session the floor is computed for (defaults\n"
            "                      4096, 64, 1, 16 MiB of process RSS)\n"
            "  --copy              copy unchanged files instead of linking them\n"
            "  --dense             write the trunk's zero blocks instead of leaving holes\n"
            "  --resume            continue an interrupted repack of DST\n"
            "  --force             replace DST if it is a packed model holding nothing else,\n"
            "                      or an interrupted repack's temporary (README, Destinations)\n"
            "  --json              print a JSON summary on stdout\n"
            "  --quiet             no progress on stderr\n"
            "  --progress          progress on stderr even when it is not a terminal\n"
            "  --version           the version and the kernel and CRC paths in use\n"
            "  -h, --help          this help\n"
            "\n"
            "Exit status: 0 done, 2 usage, 3 bad input format, 4 I/O error, 5 corrupt\n"
            "source, 6 budget below the reachable floor, 7 DST exists, is not k3-pack's to\n"
            "replace or is in use, 8 disk full,\n"
            "9 internal error, 130 interrupted (run again with --resume).\n");
}

static void on_signal(int sig)
{
    (void)sig;
    k3_pack_interrupt();
}

static int die(int code, const char *msg)
{
    return k3_out_error(code, "%s", msg);
}

int main(int argc, char **argv)
{
    k3_out_init("k3-pack");
    k3_pack_opts o;
    k3_pack_opts_init(&o);
    int json = 0, plan_only = 0, rc = 0, progress = 0;
    const char *pos[2], *pin_arg = NULL;
    int npos = 0;
    uint32_t ranks = 0;
    int64_t rank = -1;
    char msg[512];
    k3_err e = {0};
    k3_dest dest = {.lock_fd = -1};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        uint64_t n;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage(stdout);
            return 0;
        } else if (!strcmp(a, "--version")) {
            k3_cli_print_version("k3-pack");
            return 0;
        } else if (!strcmp(a, "--ram")) {
            if (!v || k3_pack_parse_budget(v, &o.budget, &e) < 0)
                return die(K3_EARG, v ? e.msg : "--ram needs a size");
            snprintf(o.budget_arg, sizeof o.budget_arg, "%s", v);
            i++;
        } else if (!strcmp(a, "--unit-mb")) {
            if (k3_cli_parse_u64(v, 0, 1u << 20, &n))
                return die(K3_EARG, "--unit-mb needs a number of MiB from 0 to 1048576");
            o.unit_bytes = n << 20;
            o.unit_explicit = 1;
            i++;
        } else if (!strcmp(a, "--unit-bytes")) {   /* for tests: units below 1 MiB */
            if (k3_cli_parse_u64(v, 4096, 1ull << 40, &n) || n % 4096)
                return die(K3_EARG, "--unit-bytes needs a multiple of 4096");
            o.unit_bytes = n;
            o.unit_explicit = 1;
            i++;
        } else if (!strcmp(a, "--split-rows")) {
            o.split_rows = 1;
        } else if (!strcmp(a, "--ram-piece")) {
            if (!v)
                return die(K3_EARG, "--ram-piece needs a size or 0");
            if (!strcmp(v, "0"))
                o.piece_bytes = 0;
            else if (k3_stream_parse_budget(v, &o.piece_bytes, &e) < 0 || o.piece_bytes <= K3_STREAM_DOUBLE ||
                     o.piece_bytes == K3_STREAM_RESIDENT)
                return die(K3_EARG, "--ram-piece needs a size (bytes, K/M/G) or 0");
            i++;
        } else if (!strcmp(a, "--pin")) {
            if (!v)
                return die(K3_EARG, "--pin needs a list");
            pin_arg = v;
            i++;
        } else if (!strcmp(a, "--expert-order")) {
            if (!v)
                return die(K3_EARG, "--expert-order needs a trace file");
            o.trace_path = v;
            i++;
        } else if (!strcmp(a, "--ctx") || !strcmp(a, "--chunk") || !strcmp(a, "--threads")) {
            if (k3_cli_parse_u64(v, 1, 1u << 24, &n))
                return die(K3_EARG, "--ctx, --chunk and --threads need a count from 1 to 16777216");
            if (!strcmp(a, "--ctx"))
                o.max_ctx = (uint32_t)n;
            else if (!strcmp(a, "--chunk"))
                o.max_chunk = (uint32_t)n;
            else
                o.nthreads = (uint32_t)n;
            i++;
        } else if (!strcmp(a, "--baseline")) {
            if (k3_cli_parse_u64(v, 1, 1ull << 50, &n))
                return die(K3_EARG, "--baseline needs a number of bytes");
            o.baseline = n;
            i++;
        } else if (!strcmp(a, "--ranks") || !strcmp(a, "--rank")) {
            if (k3_cli_parse_u64(v, 0, K3_DIST_MAX_RANKS, &n))
                return die(K3_EARG, "--ranks and --rank need a number from 0 to 256");
            if (!strcmp(a, "--ranks"))
                ranks = (uint32_t)n;
            else
                rank = (int64_t)n;
            i++;
        } else if (!strcmp(a, "--plan")) {
            plan_only = 1;
        } else if (!strcmp(a, "--dense")) {
            o.dense = 1;
        } else if (!strcmp(a, "--copy")) {
            o.copy_only = 1;
        } else if (!strcmp(a, "--resume")) {
            o.resume = 1;
        } else if (!strcmp(a, "--force")) {
            o.force = 1;
        } else if (!strcmp(a, "--progress")) {
            progress = 1;
        } else if (!strcmp(a, "--json")) {
            json = 1;
        } else if (!strcmp(a, "--quiet")) {
            o.quiet = 1;
        } else if (a[0] == '-' && a[1]) {
            snprintf(msg, sizeof msg, "unknown option %s (see --help)", a);
            return die(K3_EARG, msg);
        } else if (npos < 2) {
            pos[npos++] = a;
        } else {
            return die(K3_EARG, "too many arguments (see --help)");
        }
    }
    if (ranks || rank >= 0) {
        /* a rank's slice (pack/pack_slice.c) */
        if (ranks < 2 || rank < 0 || rank >= ranks)
            return die(K3_EARG, "--ranks N (2 to 256) and --rank R (0 to N-1) go together");
        if (npos != 2 || plan_only || o.resume || o.force || pin_arg || o.trace_path)
            return die(K3_EARG, "--ranks takes SRC and DST, with --ram-piece only (see --help)");
        struct sigaction sa;
        memset(&sa, 0, sizeof sa);
        sa.sa_handler = on_signal;
        sigaction(SIGINT, &sa, NULL);
        sigaction(SIGTERM, &sa, NULL);
        if ((rc = k3_pack_slice(pos[0], pos[1], ranks, (uint32_t)rank, o.piece_bytes, &e)) < 0)
            return k3_out_error(rc, "%s", e.msg);
        if (!o.quiet)
            fprintf(stderr, "k3-pack: %s: the slice of rank %u of %u ranks (row pieces of %" PRIu64 " bytes)\n",
                    pos[1], (uint32_t)rank, ranks, o.piece_bytes);
        return 0;
    }
    if (npos != (plan_only ? 1 : 2))
        return die(K3_EARG, plan_only ? "--plan takes SRC only (see --help)" : "need SRC and DST (see --help)");
    if (o.resume && o.force)
        return die(K3_EARG, "--resume and --force exclude each other");
    /* one-off progress lines (a trunk resumed): on a terminal, or when asked */
    o.progress = o.quiet || json || (!progress && !isatty(STDERR_FILENO)) ? NULL : stderr;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    k3_io_fault_reset();

    if (pin_arg) {
        /* the group count comes from the source's config: parse it after a first look */
        k3_pack_plan probe;
        k3_pack_opts po = o;
        po.pin_mode = K3_PACK_PIN_NONE;
        po.trace_path = NULL;
        rc = k3_pack_plan_build(&probe, pos[0], NULL, &po, &e);
        if (rc) {
            k3_pack_plan_free(&probe);
            goto fail;
        }
        uint32_t ng = probe.cfg.num_hidden_layers + 1;
        k3_pack_plan_free(&probe);
        if ((rc = k3_pack_parse_pin(pin_arg, ng, &o, &e)))
            goto fail;
    }
    /* DST checked against SRC, owned and locked before the plan (whose
     * stand-in lives next to DST) touches anything */
    if (!plan_only && (rc = k3_dest_open(&dest, &k3_pack_dest_tool, pos[0], pos[1], &e)))
        goto fail;
    k3_pack_plan p;
    rc = k3_pack_plan_build(&p, pos[0], plan_only ? NULL : dest.path, &o, &e);
    if (rc) {
        k3_pack_plan_free(&p); /* a failed build leaves what it had made */
        goto fail;
    }
    /* --plan prints it to stdout; a run prints it once it has succeeded, so
     * that an error (a budget below the floor, DST exists, ...) is one line */
    if (plan_only)
        k3_pack_plan_print(&p, json ? stderr : stdout, "k3-pack: ");
    k3_pack_stats s = {0};
    if (!plan_only && !p.sp_ok && !p.stream_refused) {
        rc = k3_err_set(&e, K3_EBUDGET,
                        "RAM budget %llu bytes is below k3-run's floor on this layout: %llu bytes (%.2f GiB)",
                        (unsigned long long)o.budget, (unsigned long long)p.sp_floor.floor,
                        p.sp_floor.floor / 1073741824.0);
        k3_pack_plan_free(&p);
        goto fail;
    }
    if (!plan_only) {
        /* the meter: bytes of DST done, advanced per trunk unit piece,
         * expert and file; on a terminal, or when asked */
        uint64_t total = 0;
        for (uint32_t i = 0; i < p.nouts; i++)
            total += p.man.files[p.outs[i].file].size;
        o.meter = k3_progress_create("k3-pack", total, stderr,
                                     o.quiet || json ? K3_PROGRESS_QUIET
                                     : progress      ? K3_PROGRESS_FORCE
                                                     : K3_PROGRESS_AUTO);
        rc = k3_pack_run(&p, &dest, &o, &s, &e);
        if (!rc)
            k3_progress_finish(o.meter);
        k3_progress_free(o.meter);
        o.meter = NULL;
        if (rc) {
            k3_pack_plan_free(&p);
            goto fail;
        }
    }
    if (json) {
        fputs("{\"src\": ", stdout);
        k3_json_fput_str(stdout, p.src, strlen(p.src));
        fputs(", \"dst\": ", stdout);
        k3_json_fput_str(stdout, plan_only ? "" : pos[1], plan_only ? 0 : strlen(pos[1]));
        printf(", \"plan_only\": %s, \"budget\": %" PRIu64 ", \"unit_bytes\": %" PRIu64
               ", \"units\": %u, \"split_tensors\": %u, \"pinned_bytes\": %" PRIu64 ", \"floor\": %" PRIu64
               ", \"floor_double\": %" PRIu64 ", \"resident\": %" PRIu64 ", \"budget_runs\": %s, \"trunk_bytes\": %" PRIu64
               ", \"bytes_written\": %" PRIu64 ", \"bytes_linked\": %" PRIu64 ", \"bytes_copied\": %" PRIu64
               ", \"files_linked\": %u, \"files_reflinked\": %u, \"files_copied\": %u, \"files_resumed\": %u"
               ", \"trunk_bytes_kept\": %" PRIu64
               ", \"seconds\": %.3f}\n",
               plan_only ? "true" : "false", p.sp.budget, p.unit_bytes,
               p.man.nunits, p.split_tensors, p.pinned_bytes, p.sp_floor.floor, p.sp_floor.floor_double,
               p.sp_floor.resident, p.sp_ok ? "true" : "false", p.trunk_bytes,
               s.bytes_written, s.bytes_linked, s.bytes_copied, s.files_linked, s.files_reflinked, s.files_copied,
               s.files_resumed, s.trunk_bytes_kept, s.seconds);
    } else if (!plan_only && !o.quiet) {
        k3_pack_plan_print(&p, stderr, "k3-pack: ");
        fprintf(stderr,
                "k3-pack: %s written in %.2f s: %" PRIu64 " bytes written, %" PRIu64 " bytes linked (%u hard links, "
                "%u reflinks), %" PRIu64 " bytes copied\n",
                pos[1], s.seconds, s.bytes_written, s.bytes_linked, s.files_linked, s.files_reflinked,
                s.bytes_copied);
    }
    k3_pack_plan_free(&p);
    k3_dest_close(&dest);
    return 0;
fail:
    k3_dest_close(&dest);
    return k3_out_error(rc, "%s", e.msg[0] ? e.msg : k3_err_name(rc));
}
