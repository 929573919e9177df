/*
 * k3-convert - upstream safetensors checkpoint -> packed model directory
 * (manifests/FORMAT.md). The work is in conv_plan.c, conv_run.c (output files: common/outfile.c);
 * this file parses the command line, installs the interrupt handler and
 * prints the summary.
 */
#include <errno.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "conv.h"
#include "k3_cli.h"
#include "k3_err.h"
#include "k3_io.h"
#include "k3_json.h"
#include "k3_out.h"

static void usage(FILE *f)
{
    fprintf(f,
            "usage: k3-convert [options] SRC DST\n"
            "\n"
            "Convert the upstream checkpoint in directory SRC (config.json, *.safetensors,\n"
            "optional index and tokenizer files) into the packed model directory DST\n"
            "(format: manifests/FORMAT.md). Each input byte is read once and hashed while\n"
            "read (holes of sparse shards are zeros by definition: hashed, not read);\n"
            "output is hashed while written; manifest.json is written last.\n"
            "\n"
            "  --resume      continue an interrupted conversion into DST: finished shard\n"
            "                groups recorded in DST/.k3-convert-journal are kept (their\n"
            "                files' sizes are checked), the rest is redone; the result is\n"
            "                byte-identical to an uninterrupted run\n"
            "  --rehash      with --resume, also re-hash the kept files\n"
            "  --force       replace DST if it is a packed model holding nothing else\n"
            "                (removes manifest.json first; see README, Destinations)\n"
            "  --dense       write zero blocks instead of leaving holes\n"
            "  --trunk-dtype source|bf16\n"
            "                source (the default): every trunk tensor keeps its upstream\n"
            "                dtype and bytes (BF16, F16, F32), so the packed model computes\n"
            "                exactly what the checkpoint computes; bf16 rounds F16/F32 trunk\n"
            "                tensors to BF16 (smaller, lossy: recorded in the manifest)\n"
            "  --threads N   quantization threads (1..1024; default: OpenMP's choice);\n"
            "                the output does not depend on N\n"
            "  --json        print a JSON summary on stdout\n"
            "  --quiet       no progress on stderr\n"
            "  --progress    progress on stderr even when it is not a terminal\n"
            "  --version     the version and the kernel and CRC paths in use\n"
            "  -h, --help    this help\n"
            "\n"
            "Memory: peak RSS stays below 1 GiB whatever the shard size: 64 MiB of read\n"
            "buffers, at most %u expert records in assembly (17.5 MB each at K3 size),\n"
            "float expert sources staged one tensor at a time (at most 256 MiB each).\n"
            "\n"
            "Exit status: 0 done, 2 usage, 3 bad input format, 4 I/O error, 6 over a limit,\n"
            "7 DST exists, is not k3-convert's to replace or is in use, 8 disk full, 9 internal error, 130 interrupted (run again with\n"
            "--resume).\n",
            K3_CONV_MAX_OPEN_RECORDS);
}

static void on_signal(int sig)
{
    (void)sig;
    k3_conv_interrupt();
}

int main(int argc, char **argv)
{
    k3_out_init("k3-convert");
    k3_conv_opts o = {0};
    int json = 0;
    const char *pos[2];
    int npos = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage(stdout);
            return 0;
        } else if (!strcmp(a, "--version")) {
            k3_cli_print_version("k3-convert");
            return 0;
        } else if (!strcmp(a, "--resume")) {
            o.resume = 1;
        } else if (!strcmp(a, "--rehash")) {
            o.rehash = 1;
        } else if (!strcmp(a, "--force")) {
            o.force = 1;
        } else if (!strcmp(a, "--dense")) {
            o.dense = 1;
        } else if (!strcmp(a, "--trunk-dtype")) {
            if (i + 1 >= argc || (strcmp(argv[i + 1], "source") && strcmp(argv[i + 1], "bf16"))) {
                fprintf(stderr, "k3-convert: error: --trunk-dtype needs source or bf16\n");
                return K3_EXIT_USAGE;
            }
            o.trunk_bf16 = !strcmp(argv[++i], "bf16");
        } else if (!strcmp(a, "--json")) {
            json = 1;
        } else if (!strcmp(a, "--quiet")) {
            o.quiet = 1;
        } else if (!strcmp(a, "--progress")) {
            o.force_progress = 1;
        } else if (!strcmp(a, "--threads")) {
            uint64_t t;
            if (i + 1 >= argc || k3_cli_parse_u64(argv[++i], 1, 1024, &t)) {
                fprintf(stderr, "k3-convert: error: --threads needs a number from 1 to 1024\n");
                return K3_EXIT_USAGE;
            }
            o.threads = (int)t;
        } else if (a[0] == '-' && a[1]) {
            fprintf(stderr, "k3-convert: error: unknown option %s (see --help)\n", a);
            return K3_EXIT_USAGE;
        } else if (npos < 2) {
            pos[npos++] = a;
        } else {
            fprintf(stderr, "k3-convert: error: too many arguments (see --help)\n");
            return K3_EXIT_USAGE;
        }
    }
    if (npos != 2) {
        fprintf(stderr, "k3-convert: error: need SRC and DST (see --help)\n");
        return K3_EXIT_USAGE;
    }
    if (o.rehash && !o.resume) {
        fprintf(stderr, "k3-convert: error: --rehash only goes with --resume\n");
        return K3_EXIT_USAGE;
    }
    if (o.resume && o.force) {
        fprintf(stderr, "k3-convert: error: --resume and --force exclude each other\n");
        return K3_EXIT_USAGE;
    }
    o.progress = o.quiet ? NULL : stderr;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    k3_io_fault_reset();

    k3_err e = {0};
    k3_conv_stats s;
    int rc = k3_conv_run(pos[0], pos[1], &o, &s, &e);
    if (rc) {
        return k3_out_error(rc, "%s", e.msg[0] ? e.msg : k3_err_name(rc));
    }
    if (json) {
        double mb = 1e6 * (s.seconds > 0 ? s.seconds : 1e-9);
        fputs("{\"src\": ", stdout);
        k3_json_fput_str(stdout, pos[0], strlen(pos[0]));
        fputs(", \"dst\": ", stdout);
        k3_json_fput_str(stdout, pos[1], strlen(pos[1]));
        printf(", \"groups\": %u, \"groups_skipped\": %u, "
               "\"bytes_read\": %" PRIu64 ", \"src_hole_bytes\": %" PRIu64 ", \"bytes_written\": %" PRIu64 ", "
               "\"hole_bytes\": %" PRIu64 ", "
               "\"seconds\": %.3f, \"read_MBps\": %.1f, \"peak_rss_kb\": %" PRIu64 "}\n",
               s.groups, s.groups_skipped, s.bytes_read, s.src_hole_bytes, s.bytes_written, s.holes_bytes, s.seconds,
               (double)s.bytes_read / mb, s.peak_rss_kb);
    }
    return 0;
}
