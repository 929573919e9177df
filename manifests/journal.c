/*
 * journal.c - the resume journal shared by k3-convert and k3-pack
 * (k3_journal.h). Entries are sealed with k3_man_seal and written with
 * k3_io_write_file_atomic; nothing here knows what a tool puts in them.
 */
#include "k3_journal.h"

#include <dirent.h>
#include <errno.h>
#include <openssl/evp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "k3_io.h"
#include "k3_man.h"

#define ENTRY_MAX (1u << 30)

int k3_journal_init(k3_journal *j, const char *parent, const char *name, const char *plan_name, k3_err *e)
{
    memset(j, 0, sizeof *j);
    j->plan_name = plan_name;
    return k3_io_path_join(j->dir, sizeof j->dir, parent, name, e);
}

int k3_journal_exists(const k3_journal *j)
{
    struct stat st;
    return lstat(j->dir, &st) == 0 && S_ISDIR(st.st_mode);
}

int k3_journal_path(const k3_journal *j, const char *entry, char *out, size_t cap, k3_err *e)
{
    return k3_io_path_join(out, cap, j->dir, entry, e);
}

int k3_journal_put(const k3_journal *j, const char *entry, const cJSON *body, k3_err *e)
{
    char path[4400];
    int rc = k3_journal_path(j, entry, path, sizeof path, e);
    if (rc)
        return rc;
    char *js = cJSON_PrintUnformatted(body);
    size_t tl = 0;
    char *txt = js ? k3_man_seal(js, strlen(js), &tl) : NULL;
    free(js);
    if (!txt)
        return k3_err_set(e, K3_ENOMEM, "%s: out of memory", path);
    rc = k3_io_write_file_atomic(path, txt, tl, e);
    free(txt);
    return rc;
}

cJSON *k3_journal_get(const k3_journal *j, const char *entry, const char **why)
{
    const char *dummy;
    if (!why)
        why = &dummy;
    char path[4400];
    k3_err ignore = {0};
    *why = "no journal entry";
    if (k3_journal_path(j, entry, path, sizeof path, &ignore) || access(path, F_OK) != 0)
        return NULL;
    char *txt = NULL;
    uint64_t len = 0;
    *why = "unreadable journal entry";
    if (k3_io_read_file(path, ENTRY_MAX, &txt, &len, &ignore))
        return NULL;
    *why = "journal entry does not match its own SHA-256";
    size_t bl = 0;
    const char *body = k3_man_unseal(txt, len, &bl);
    cJSON *root = body ? cJSON_ParseWithLength(body, bl) : NULL;
    free(txt);
    return root;
}

int k3_journal_put_blob(const k3_journal *j, const char *entry, const void *buf, uint64_t len, k3_err *e)
{
    char path[4400];
    int rc = k3_journal_path(j, entry, path, sizeof path, e);
    return rc ? rc : k3_io_write_file_atomic(path, buf, len, e);
}

int k3_journal_get_blob(const k3_journal *j, const char *entry, uint64_t len, const uint8_t sha[32], void *out)
{
    char path[4400], *b = NULL;
    uint64_t got = 0;
    k3_err ignore = {0};
    uint8_t h[32];
    unsigned int hl = 0;
    int ok = k3_journal_path(j, entry, path, sizeof path, &ignore) == 0 &&
             k3_io_read_file(path, len + 1, &b, &got, &ignore) == 0 && got == len &&
             EVP_Digest(b, (size_t)len, h, &hl, EVP_sha256(), NULL) == 1 && !memcmp(h, sha, 32);
    if (ok)
        memcpy(out, b, (size_t)len);
    free(b);
    return ok ? 0 : -1;
}

int k3_journal_begin(const k3_journal *j, const char *fingerprint_hex, k3_err *e)
{
    if (mkdir(j->dir, 0755) != 0 && errno != EEXIST)
        return k3_err_sys(e, K3_EIO, errno, "%s: cannot create", j->dir);
    cJSON *o = cJSON_CreateObject();
    if (!o || !cJSON_AddStringToObject(o, "fingerprint", fingerprint_hex)) {
        cJSON_Delete(o);
        return k3_err_set(e, K3_ENOMEM, "%s: out of memory", j->dir);
    }
    int rc = k3_journal_put(j, j->plan_name, o, e);
    cJSON_Delete(o);
    return rc;
}

int k3_journal_plan_cmp(const k3_journal *j, const char *fingerprint_hex, k3_err *e)
{
    char path[4400], *txt = NULL;
    uint64_t len = 0;
    int rc = k3_journal_path(j, j->plan_name, path, sizeof path, e);
    if (rc)
        return rc;
    if (access(path, F_OK) != 0)
        return 2;
    if ((rc = k3_io_read_file(path, ENTRY_MAX, &txt, &len, e)))
        return rc;
    size_t bl = 0;
    const char *body = k3_man_unseal(txt, len, &bl);
    cJSON *o = body ? cJSON_ParseWithLength(body, bl) : NULL;
    free(txt);
    if (!o)
        return 1;
    const cJSON *fp = cJSON_GetObjectItemCaseSensitive(o, "fingerprint");
    int same = cJSON_IsString(fp) && !strcmp(fp->valuestring, fingerprint_hex);
    cJSON_Delete(o);
    return same ? 0 : 1;
}

int k3_journal_drop(const k3_journal *j, const char *entry, k3_err *e)
{
    char path[4400];
    int rc = k3_journal_path(j, entry, path, sizeof path, e);
    if (rc)
        return rc;
    if (unlink(path) != 0 && errno != ENOENT)
        return k3_err_sys(e, K3_EIO, errno, "%s: cannot remove", path);
    return 0;
}

int k3_journal_remove(const k3_journal *j, k3_err *e)
{
    DIR *d = opendir(j->dir);
    if (!d)
        return errno == ENOENT ? 0 : k3_err_sys(e, K3_EIO, errno, "%s: cannot open", j->dir);
    int rc = k3_journal_drop(j, j->plan_name, e);
    struct dirent *de;
    char path[4400];
    while (!rc && (de = readdir(d))) {
        if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, ".."))
            continue;
        struct stat st;
        if ((rc = k3_io_path_join(path, sizeof path, j->dir, de->d_name, e)))
            break;
        if (lstat(path, &st) != 0)
            rc = k3_err_sys(e, K3_EIO, errno, "%s: cannot stat", path);
        else if (!S_ISREG(st.st_mode))
            rc = k3_err_set(e, K3_EEXIST, "%s: not a journal entry; not removing it", path);
        else if (unlink(path) != 0)
            rc = k3_err_sys(e, K3_EIO, errno, "%s: cannot remove", path);
    }
    closedir(d);
    if (rc)
        return rc;
    if (rmdir(j->dir) != 0)
        return k3_err_sys(e, K3_EIO, errno, "%s: cannot remove", j->dir);
    char parent[4096];
    snprintf(parent, sizeof parent, "%s", j->dir);
    char *s = strrchr(parent, '/');
    if (s && s != parent)
        *s = 0;
    else
        snprintf(parent, sizeof parent, "%s", s ? "/" : ".");
    return k3_io_fsync_dir(parent, e);
}
