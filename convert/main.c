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
            "       k3-convert --part SPEC [--headers DIR] [options] SRC PART\n"
            "       k3-convert --merge [--force] [--rehash] DST PART...\n"
            "       k3-convert --export-headers SRC DIR\n"
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
            "  --rehash      with --resume, also re-hash the kept files; with --merge,\n"
            "                re-hash every part's files before moving them\n"
            "  --part SPEC   convert only some shards into the part directory PART, for\n"
            "                --merge (one job per machine; see README, Conversion across\n"
            "                machines). SPEC: present (the shards in SRC), J/N (job J of N,\n"
            "                1-based: a contiguous run of the shards in name order) or shard\n"
            "                file names separated by commas. Shards not in SRC are read from\n"
            "                their headers (NAME.safetensors.k3hdr in SRC or --headers DIR)\n"
            "  --headers DIR with --part: where the stand-ins of the shards not in SRC are\n"
            "  --merge       DST PART...: put finished parts of one conversion together in\n"
            "                DST by renaming their files (no data copied; parts must be on\n"
            "                DST's filesystem); every shard in exactly one part; the result\n"
            "                is byte-identical to one k3-convert of the whole checkpoint;\n"
            "                an interrupted merge continues when run again\n"
            "  --export-headers SRC DIR\n"
            "                write DIR/NAME.safetensors.k3hdr, the header of each shard in\n"
            "                SRC (under 1 MB each at K3 size), for the machines that do not hold it\n"
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
            "Exit status: 0 done, 2 usage (also: --merge of parts that overlap, are of\n"
            "different conversions or on another filesystem than DST), 3 bad input format,\n"
            "4 I/O error (also: a shard --part needs is not here, --merge misses a shard\n"
            "or an unfinished part), 5 a part's file is not what its journal says,\n"
            "6 over a limit, 7 DST exists, is not k3-convert's to replace or is in use,\n"
            "8 disk full, 9 internal error, 130 interrupted (run again with --resume; a\n"
            "merge: run the same --merge again).\n",
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
    int json = 0, merge = 0, export_headers = 0;
    const char *pos[argc > 2 ? argc : 2]; /* --merge takes any number of parts */
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
        } else if (!strcmp(a, "--part") || !strcmp(a, "--headers")) {
            if (i + 1 >= argc || !argv[i + 1][0]) {
                fprintf(stderr, "k3-convert: error: %s needs %s (see --help)\n", a,
                        a[2] == 'p' ? "SPEC: present, J/N or shard names" : "a directory");
                return K3_EXIT_USAGE;
            }
            if (a[2] == 'p')
                o.part = argv[++i];
            else
                o.headers = argv[++i];
        } else if (!strcmp(a, "--merge")) {
            merge = 1;
        } else if (!strcmp(a, "--export-headers")) {
            export_headers = 1;
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
        } else if (npos < 2 || merge) {
            pos[npos++] = a;
        } else {
            fprintf(stderr, "k3-convert: error: too many arguments (see --help)\n");
            return K3_EXIT_USAGE;
        }
    }
    if (merge + export_headers + !!o.part > 1) {
        fprintf(stderr, "k3-convert: error: --part, --merge and --export-headers exclude each other\n");
        return K3_EXIT_USAGE;
    }
    if (o.headers && !o.part) {
        fprintf(stderr, "k3-convert: error: --headers only goes with --part\n");
        return K3_EXIT_USAGE;
    }
    if (merge && (o.resume || o.dense || o.trunk_bf16 || o.threads)) {
        fprintf(stderr, "k3-convert: error: --merge takes only --force, --rehash, --json and the progress options "
                        "(the parts' options made their files)\n");
        return K3_EXIT_USAGE;
    }
    if (merge ? npos < 2 : npos != 2) {
        fprintf(stderr, "k3-convert: error: need %s (see --help)\n",
                merge ? "DST and at least one PART" : export_headers ? "SRC and DIR" : "SRC and DST");
        return K3_EXIT_USAGE;
    }
    if (o.rehash && !o.resume && !merge) {
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
    int rc = export_headers ? k3_conv_headers(pos[0], pos[1], &e)
             : merge        ? k3_conv_merge(pos[0], pos + 1, npos - 1, &o, &s, &e)
                            : k3_conv_run(pos[0], pos[1], &o, &s, &e);
    if (rc) {
        return k3_out_error(rc, "%s", e.msg[0] ? e.msg : k3_err_name(rc));
    }
    if (json && export_headers) {
        printf("{\"src\": ");
        k3_json_fput_str(stdout, pos[0], strlen(pos[0]));
        printf(", \"headers\": ");
        k3_json_fput_str(stdout, pos[1], strlen(pos[1]));
        printf("}\n");
    } else if (json && merge) {
        printf("{\"dst\": ");
        k3_json_fput_str(stdout, pos[0], strlen(pos[0]));
        printf(", \"parts\": %d, \"groups\": %u}\n", npos - 1, s.groups);
    } else if (json) {
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
