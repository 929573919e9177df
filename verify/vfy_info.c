/*
 * vfy_info.c - k3-verify --info: what a model directory holds, without
 * checking it. Kind (packed model, upstream checkpoint), the config in a
 * few numbers, file count and bytes by kind, provenance (upstream shards a
 * packed model came from), the layout k3-pack recorded (its RAM budget and
 * floor) and the dtypes of the stored trunk tensors. Reads manifest.json or
 * config.json and the directory listing only; nothing is hashed, nothing
 * written. Text, or one JSON object (valid UTF-8, k3_json.h) with --json.
 */
#include <dirent.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <cjson/cJSON.h>

#include "k3_cfg.h"
#include "k3_io.h"
#include "k3_json.h"
#include "k3_man.h"
#include "vfy.h"

static double num(const cJSON *o, const char *k)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, k);
    return cJSON_IsNumber(v) ? v->valuedouble : -1;
}

static void add_path(cJSON *o, const char *k, const char *path)
{
    char *u = k3_json_utf8_dup(path);
    cJSON_AddStringToObject(o, k, u ? u : "");
    free(u);
}

/* The few config numbers that say which model this is. */
static cJSON *cfg_summary_json(double layers, double hidden, double vocab, double experts, double topk,
                               double dense)
{
    cJSON *c = cJSON_CreateObject();
    cJSON_AddNumberToObject(c, "num_hidden_layers", layers);
    cJSON_AddNumberToObject(c, "hidden_size", hidden);
    cJSON_AddNumberToObject(c, "vocab_size", vocab);
    cJSON_AddNumberToObject(c, "num_experts", experts);
    cJSON_AddNumberToObject(c, "num_experts_per_token", topk);
    cJSON_AddNumberToObject(c, "first_k_dense_replace", dense);
    return c;
}

static int info_packed(const char *dir, cJSON *o, k3_err *e)
{
    char mp[4400], *txt = NULL;
    uint64_t len;
    snprintf(mp, sizeof mp, "%s/manifest.json", dir);
    int rc = k3_io_read_file(mp, K3_MAN_MAX_BYTES, &txt, &len, e);
    if (rc)
        return rc;
    cJSON *m = cJSON_ParseWithLength(txt, (size_t)len);
    free(txt);
    if (!m || !cJSON_IsObject(m)) {
        cJSON_Delete(m);
        return k3_err_set(e, K3_EFORMAT, "%s: not JSON (run k3-verify without --info to see what is wrong)", mp);
    }
    cJSON_AddStringToObject(o, "kind", "packed");
    const cJSON *prod = cJSON_GetObjectItemCaseSensitive(m, "producer");
    if (cJSON_IsString(prod))
        add_path(o, "producer", prod->valuestring);
    const cJSON *c = cJSON_GetObjectItemCaseSensitive(m, "config");
    cJSON_AddItemToObject(o, "config", cfg_summary_json(num(c, "num_hidden_layers"), num(c, "hidden_size"),
                                                        num(c, "vocab_size"), num(c, "num_experts"),
                                                        num(c, "num_experts_per_token"),
                                                        num(c, "first_k_dense_replace")));
    /* files and bytes by kind */
    cJSON *by = cJSON_CreateObject();
    double nfiles = 0, total = 0;
    const cJSON *f;
    cJSON_ArrayForEach(f, cJSON_GetObjectItemCaseSensitive(m, "files"))
    {
        const cJSON *k = cJSON_GetObjectItemCaseSensitive(f, "kind");
        double sz = num(f, "size");
        if (!cJSON_IsString(k) || sz < 0)
            continue;
        nfiles++;
        total += sz;
        char *ku = k3_json_utf8_dup(k->valuestring);
        cJSON *cur = ku ? cJSON_GetObjectItemCaseSensitive(by, ku) : NULL;
        if (cur)
            cJSON_SetNumberValue(cur, cur->valuedouble + sz);
        else if (ku)
            cJSON_AddNumberToObject(by, ku, sz);
        free(ku);
    }
    cJSON_AddNumberToObject(o, "files", nfiles);
    cJSON_AddNumberToObject(o, "bytes", total);
    cJSON_AddItemToObject(o, "bytes_by_kind", by);
    /* provenance */
    cJSON *pv = cJSON_CreateObject();
    const cJSON *src = cJSON_GetObjectItemCaseSensitive(m, "source");
    double ns = 0, sb = 0;
    cJSON_ArrayForEach(f, cJSON_GetObjectItemCaseSensitive(src, "shards"))
    {
        ns++;
        sb += num(f, "size") > 0 ? num(f, "size") : 0;
    }
    cJSON_AddNumberToObject(pv, "upstream_shards", ns);
    cJSON_AddNumberToObject(pv, "upstream_bytes", sb);
    const cJSON *xf = cJSON_GetObjectItemCaseSensitive(src, "expert_format");
    if (cJSON_IsString(xf))
        add_path(pv, "expert_format", xf->valuestring);
    cJSON_AddItemToObject(o, "provenance", pv);
    /* the layout: k3-pack's budget */
    const cJSON *plan = cJSON_GetObjectItemCaseSensitive(m, "plan");
    const cJSON *tool = cJSON_GetObjectItemCaseSensitive(plan, "tool");
    cJSON *lay = cJSON_CreateObject();
    add_path(lay, "tool", cJSON_IsString(tool) ? tool->valuestring : "unknown");
    const cJSON *run = cJSON_GetObjectItemCaseSensitive(plan, "k3_run");
    if (run) {
        const cJSON *ra = cJSON_GetObjectItemCaseSensitive(plan, "ram_arg");
        if (cJSON_IsString(ra))
            add_path(lay, "ram_arg", ra->valuestring);
        cJSON_AddNumberToObject(lay, "budget", num(run, "ram"));
        cJSON_AddBoolToObject(lay, "streams", cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(run, "streams")));
        cJSON_AddNumberToObject(lay, "floor", num(run, "floor"));
        cJSON_AddNumberToObject(lay, "resident", num(run, "resident"));
    }
    cJSON_AddItemToObject(o, "layout", lay);
    /* dtypes of the stored trunk tensors */
    cJSON *dt = cJSON_CreateObject();
    cJSON_ArrayForEach(f, cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(m, "trunk"), "tensors"))
    {
        const cJSON *d = cJSON_GetObjectItemCaseSensitive(f, "dtype");
        if (!cJSON_IsString(d))
            continue;
        char *du = k3_json_utf8_dup(d->valuestring);
        cJSON *cur = du ? cJSON_GetObjectItemCaseSensitive(dt, du) : NULL;
        if (cur)
            cJSON_SetNumberValue(cur, cur->valuedouble + 1);
        else if (du)
            cJSON_AddNumberToObject(dt, du, 1);
        free(du);
    }
    cJSON_AddItemToObject(o, "trunk_dtypes", dt);
    cJSON_Delete(m);
    return 0;
}

static int info_upstream(const char *dir, cJSON *o, k3_err *e)
{
    char cp[4400];
    snprintf(cp, sizeof cp, "%s/config.json", dir);
    k3_cfg c;
    int rc = k3_cfg_load(&c, cp, e);
    if (rc)
        return rc;
    cJSON_AddStringToObject(o, "kind", "upstream");
    cJSON_AddItemToObject(o, "config", cfg_summary_json(c.num_hidden_layers, c.hidden_size, c.vocab_size,
                                                        c.num_experts, c.num_experts_per_token,
                                                        c.first_k_dense_replace));
    DIR *d = opendir(dir);
    if (!d)
        return k3_err_sys(e, K3_EIO, errno, "%s: cannot list the directory", dir);
    double nfiles = 0, total = 0, nsh = 0, shb = 0;
    struct dirent *de;
    while ((de = readdir(d))) {
        char p[4400];
        struct stat st;
        snprintf(p, sizeof p, "%s/%s", dir, de->d_name);
        if (de->d_name[0] == '.' || stat(p, &st) != 0 || !S_ISREG(st.st_mode))
            continue;
        nfiles++;
        total += (double)st.st_size;
        size_t l = strlen(de->d_name);
        if (l > 12 && !strcmp(de->d_name + l - 12, ".safetensors")) {
            nsh++;
            shb += (double)st.st_size;
        }
    }
    closedir(d);
    cJSON_AddNumberToObject(o, "files", nfiles);
    cJSON_AddNumberToObject(o, "bytes", total);
    cJSON *by = cJSON_CreateObject();
    cJSON_AddNumberToObject(by, "shards", shb);
    cJSON_AddNumberToObject(by, "other", total - shb);
    cJSON_AddItemToObject(o, "bytes_by_kind", by);
    cJSON_AddNumberToObject(o, "shards", nsh);
    return 0;
}

static void print_text(FILE *out, const cJSON *o)
{
    const char *path = cJSON_GetObjectItemCaseSensitive(o, "path")->valuestring;
    const char *kind = cJSON_GetObjectItemCaseSensitive(o, "kind")->valuestring;
    const cJSON *prod = cJSON_GetObjectItemCaseSensitive(o, "producer");
    fprintf(out, "%s: %s %s", path, kind, !strcmp(kind, "packed") ? "model" : "checkpoint");
    if (cJSON_IsString(prod))
        fprintf(out, " (made by %s)", prod->valuestring);
    fputc('\n', out);
    const cJSON *c = cJSON_GetObjectItemCaseSensitive(o, "config");
    fprintf(out, "  config: %.0f layers (%.0f dense), hidden %.0f, vocabulary %.0f, %.0f experts (top %.0f)\n",
            num(c, "num_hidden_layers"), num(c, "first_k_dense_replace"), num(c, "hidden_size"), num(c, "vocab_size"),
            num(c, "num_experts"), num(c, "num_experts_per_token"));
    fprintf(out, "  files: %.0f, %.0f bytes (%.2f GiB):", num(o, "files"), num(o, "bytes"),
            num(o, "bytes") / 1073741824.0);
    const cJSON *k;
    cJSON_ArrayForEach(k, cJSON_GetObjectItemCaseSensitive(o, "bytes_by_kind"))
        fprintf(out, " %s %.0f", k->string, k->valuedouble);
    fputc('\n', out);
    const cJSON *pv = cJSON_GetObjectItemCaseSensitive(o, "provenance");
    if (pv) {
        const cJSON *xf = cJSON_GetObjectItemCaseSensitive(pv, "expert_format");
        fprintf(out, "  provenance: %.0f upstream shards, %.0f bytes; experts %s\n", num(pv, "upstream_shards"),
                num(pv, "upstream_bytes"), cJSON_IsString(xf) ? xf->valuestring : "none");
    }
    const cJSON *lay = cJSON_GetObjectItemCaseSensitive(o, "layout");
    if (lay) {
        const char *tool = cJSON_GetObjectItemCaseSensitive(lay, "tool")->valuestring;
        if (cJSON_GetObjectItemCaseSensitive(lay, "budget"))
            fprintf(out, "  layout: %s for a RAM budget of %.0f bytes (%.2f GiB)%s; floor %.0f, resident %.0f\n", tool,
                    num(lay, "budget"), num(lay, "budget") / 1073741824.0,
                    cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(lay, "streams")) ? ", k3-run streams by default"
                                                                                   : "",
                    num(lay, "floor"), num(lay, "resident"));
        else
            fprintf(out, "  layout: %s (no RAM budget recorded: k3-run keeps it resident unless --ram)\n", tool);
    }
    const cJSON *dt = cJSON_GetObjectItemCaseSensitive(o, "trunk_dtypes");
    if (dt) {
        fprintf(out, "  trunk tensors stored as:");
        cJSON_ArrayForEach(k, dt)
            fprintf(out, " %s %.0f", k->string, k->valuedouble);
        fputc('\n', out);
    }
    if (cJSON_GetObjectItemCaseSensitive(o, "shards"))
        fprintf(out, "  shards: %.0f safetensors files\n", num(o, "shards"));
}

int k3_vfy_info(const char *dir, int packed, int json, FILE *out, k3_err *e)
{
    cJSON *o = cJSON_CreateObject();
    if (!o)
        return k3_err_set(e, K3_ENOMEM, "out of memory");
    add_path(o, "path", dir);
    int rc = packed ? info_packed(dir, o, e) : info_upstream(dir, o, e);
    if (rc == 0) {
        if (json) {
            char *t = cJSON_PrintUnformatted(o);
            if (!t)
                rc = k3_err_set(e, K3_ENOMEM, "out of memory");
            else
                fprintf(out, "%s\n", t);
            free(t);
        } else {
            print_text(out, o);
        }
    }
    cJSON_Delete(o);
    return rc;
}
