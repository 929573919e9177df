/*
 * k3-verify - prove that an upstream checkpoint or a packed model directory
 * is complete and intact (checks in vfy_upstream.c and vfy_packed.c). Every
 * problem is one line "PATH/FILE: what" on stdout; the last line says OK or
 * how many problems were found. Read-only: nothing is written into PATH.
 */
#include <errno.h>
#include <inttypes.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "k3_cli.h"
#include "k3_err.h"
#include "k3_io.h"
#include "k3_json.h"
#include "k3_out.h"
#include "k3_progress.h"

#include <cjson/cJSON.h>
#include "vfy.h"

static void usage(FILE *f)
{
    fprintf(f,
            "usage: k3-verify [options] PATH\n"
            "\n"
            "Check the directory PATH: a packed model (it has manifest.json, or packed\n"
            "data files) or an upstream checkpoint (*.safetensors, config.json).\n"
            "\n"
            "Packed: manifest (its own SHA-256, schema, offsets inside files, alignment,\n"
            "no overlaps), missing/extra/truncated files, experts.idx, provenance; full\n"
            "mode hashes every file (SHA-256 against the manifest) and checks the CRC32\n"
            "of every trunk unit and expert record.\n"
            "Upstream: every shard header (tensors inside their shard), index against\n"
            "shards, the config's expected tensors (names, shapes, dtypes), --sums\n"
            "entries present; full mode hashes every shard (against --sums if given).\n"
            "\n"
            "  --quick       packed: sizes, manifest, every file up to 64 MiB hashed whole, a\n"
            "                sample of the trunk units and expert records of larger files\n"
            "                (CRC); upstream: headers and index only, no tensor data read\n"
            "  --sums FILE   sha256sum-style list of the upstream files (\"HEX  NAME\");\n"
            "                for a packed model, checked against its provenance\n"
            "  --sample N    --quick: records whose CRC is checked (default 32)\n"
            "  --threads N   hashing threads (default: number of CPUs)\n"
            "  --quiet       only problems, no summary line, no progress\n"
            "  --progress    progress on stderr even when it is not a terminal\n"
            "  --json        one JSON object on stdout: the problems and the summary\n"
            "  --info        print what PATH holds (kind, config, sizes, provenance, the\n"
            "                k3-pack budget, trunk dtypes) without checking it\n"
            "  --version     the version and the kernel and CRC paths in use\n"
            "  -h, --help    this help\n"
            "\n"
            "Exit status: 0 all good, 1 problems found (each listed on stdout), 2 usage,\n"
            "3 bad --sums file or manifest (--info), 4 PATH missing or unreadable,\n"
            "6 out of memory, 8 disk full (stdout).\n");
}

int main(int argc, char **argv)
{
    k3_out_init("k3-verify");
    k3_vfy v = {.full = 1, .out = stdout, .sample = 32};
    const char *path = NULL, *sums = NULL;
    uint64_t n;
    int quiet = 0, json = 0, info = 0, progress = 0;
    v.quick_max = K3_VFY_QUICK_HASH_MAX;
    const char *qm = getenv("K3_QUICK_HASH_MAX");
    if (qm && k3_cli_parse_u64(qm, 0, UINT64_MAX, &n) == 0)
        v.quick_max = n;
    v.threads = omp_get_num_procs();
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage(stdout);
            return 0;
        } else if (!strcmp(a, "--version")) {
            k3_cli_print_version("k3-verify");
            return 0;
        } else if (!strcmp(a, "--quick")) {
            v.full = 0;
        } else if (!strcmp(a, "--full")) {
            v.full = 1;
        } else if (!strcmp(a, "--quiet")) {
            quiet = 1;
        } else if (!strcmp(a, "--json")) {
            json = 1;
        } else if (!strcmp(a, "--info")) {
            info = 1;
        } else if (!strcmp(a, "--progress")) {
            progress = 1;
        } else if (!strcmp(a, "--sums")) {
            if (i + 1 >= argc) {
                fprintf(stderr, "k3-verify: error: --sums needs a file\n");
                return K3_EXIT_USAGE;
            }
            sums = argv[++i];
        } else if (!strcmp(a, "--threads") || !strcmp(a, "--sample")) {
            if (i + 1 >= argc || k3_cli_parse_u64(argv[i + 1], a[2] == 't' ? 1 : 0, a[2] == 't' ? 1024 : 1000000, &n)) {
                fprintf(stderr, "k3-verify: error: %s needs a number (%s)\n", a,
                        a[2] == 't' ? "1..1024" : "0..1000000");
                return K3_EXIT_USAGE;
            }
            i++;
            if (a[2] == 't')
                v.threads = (int)n;
            else
                v.sample = (uint32_t)n;
        } else if (a[0] == '-' && a[1]) {
            fprintf(stderr, "k3-verify: error: unknown option %s (see --help)\n", a);
            return K3_EXIT_USAGE;
        } else if (!path) {
            path = a;
        } else {
            fprintf(stderr, "k3-verify: error: only one PATH (see --help)\n");
            return K3_EXIT_USAGE;
        }
    }
    if (!path) {
        fprintf(stderr, "k3-verify: error: need a PATH (see --help)\n");
        return K3_EXIT_USAGE;
    }
    k3_err de = {0};
    int kind = k3_io_dir_kind(path, &de);   /* missing, a file, no permission: said exactly */
    if (kind < 0)
        return k3_out_error(kind == K3_EARG ? K3_EIO : kind, "%s", de.msg);
    k3_io_fault_reset();
    pthread_mutex_init(&v.mu, NULL);
    v.dir = path;
    k3_err e = {0};
    if (sums && k3_vfy_sums_load(&v, sums, &e)) {
        fprintf(stderr, "k3-verify: error: %s\n", e.msg);
        return k3_err_exit_status(e.code);
    }
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    /* packed data files without a manifest (an unfinished conversion) are
     * checked as a packed model: the missing manifest is the problem */
    int packed = kind == K3_DIR_PACKED || kind == K3_DIR_PACKED_PARTIAL;
    if (info) {
        int irc = k3_vfy_info(path, packed, json, stdout, &e);
        k3_vfy_sums_free(&v);
        return irc ? k3_out_error(irc, "%s", e.msg) : 0;
    }
    cJSON *jp = json ? cJSON_CreateArray() : NULL;
    v.jproblems = jp;
    if (!quiet && v.full)
        v.progress = k3_progress_create("k3-verify", 0, stderr, progress ? K3_PROGRESS_FORCE : K3_PROGRESS_AUTO);
    int rc = packed ? k3_vfy_packed(&v, &e) : k3_vfy_upstream(&v, &e);
    k3_progress_finish(v.progress);
    k3_progress_free(v.progress);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    k3_vfy_sums_free(&v);
    if (rc) {
        cJSON_Delete(jp);
        return k3_out_error(rc, "%s", e.msg);
    }
    double secs = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) / 1e9;
    if (json) {
        cJSON *o = cJSON_CreateObject();
        char *u = k3_json_utf8_dup(path);
        cJSON_AddStringToObject(o, "path", u ? u : "");
        free(u);
        cJSON_AddStringToObject(o, "kind", packed ? "packed" : "upstream");
        cJSON_AddStringToObject(o, "check", v.full ? "full" : "quick");
        cJSON_AddBoolToObject(o, "ok", v.problems == 0);
        cJSON_AddItemToObject(o, "problems", jp);
        cJSON_AddNumberToObject(o, "files", (double)v.files);
        cJSON_AddNumberToObject(o, "bytes_hashed", (double)v.bytes_hashed);
        cJSON_AddNumberToObject(o, "crcs_checked", (double)v.crcs_checked);
        cJSON_AddNumberToObject(o, "seconds", secs);
        if (packed && v.have_model) {   /* what the text report's notes say */
            cJSON *tr = cJSON_AddObjectToObject(o, "trunk");
            cJSON_AddNumberToObject(tr, "tensors", v.trunk_n[0] + v.trunk_n[1] + v.trunk_n[2]);
            cJSON_AddNumberToObject(tr, "bf16", v.trunk_n[0]);
            cJSON_AddNumberToObject(tr, "f16", v.trunk_n[1]);
            cJSON_AddNumberToObject(tr, "f32", v.trunk_n[2]);
            cJSON_AddBoolToObject(tr, "lossy", v.trunk_rounded > 0);
            cJSON_AddNumberToObject(tr, "rounded_tensors", v.trunk_rounded);
            cJSON *lo = cJSON_AddObjectToObject(o, "left_out");
            cJSON_AddNumberToObject(lo, "outside_language_model", (double)v.left_outside_n);
            cJSON_AddNumberToObject(lo, "outside_language_model_bytes", (double)v.left_outside_bytes);
            cJSON_AddNumberToObject(lo, "unused", (double)v.left_unused_n);
            cJSON_AddNumberToObject(lo, "unused_bytes", (double)v.left_unused_bytes);
        }
        char *t = cJSON_PrintUnformatted(o);
        cJSON_Delete(o);
        if (!t)
            return k3_out_error(K3_ENOMEM, "out of memory");
        printf("%s\n", t);
        free(t);
    } else if (!quiet) {
        if (v.problems)
            printf("k3-verify: %s: %" PRIu64 " problem(s) found (%s %s check)\n", path, v.problems,
                   packed ? "packed" : "upstream", v.full ? "full" : "quick");
        else
            printf("k3-verify: %s: OK (%s model, %s check: %" PRIu64 " files, %" PRIu64 " bytes hashed, %" PRIu64
                   " CRCs, %.2f s, %.0f MB/s)\n",
                   path, packed ? "packed" : "upstream", v.full ? "full" : "quick", v.files, v.bytes_hashed,
                   v.crcs_checked, secs, secs > 0 ? (double)v.bytes_hashed / secs / 1e6 : 0.0);
        char pre[4200];
        snprintf(pre, sizeof pre, "k3-verify: %s: ", path);
        k3_vfy_packed_notes(&v, stdout, pre);
    }
    return v.problems ? K3_EXIT_PROBLEMS : K3_EXIT_OK;
}
