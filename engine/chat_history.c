/*
 * chat_history.c - conversations as JSON lines (k3_chat.h): a strict reader
 * (cJSON per line, bounded lines, the role order checked as messages are
 * added) and an atomic writer.
 *
 * Strings are checked before cJSON sees them: a line must be valid UTF-8 and
 * may not escape NUL (\u0000 would silently cut a C string), so what is read
 * is exactly what the JSON says.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "k3_chat.h"
#include "k3_io.h"

/* Does the JSON text contain the escape \u0000 (outside or inside strings)? */
static int escapes_nul(const char *s, uint64_t n)
{
    for (uint64_t i = 0; i + 1 < n; i++) {
        if (s[i] != '\\')
            continue;
        if (s[i + 1] == 'u' && i + 5 < n && !memcmp(s + i + 2, "0000", 4))
            return 1;
        i++;   /* skip the escaped character: "\\\\u0000" is not an escape of NUL */
    }
    return 0;
}

static int line_error(k3_err *e, int code, const char *path, uint64_t line, const char *what)
{
    return k3_err_set(e, code, "%s: line %llu: %s", path, (unsigned long long)line, what);
}

static int parse_line(k3_chat *c, const char *path, uint64_t line, const char *s, uint64_t n, k3_err *e)
{
    if (n == 0)
        return line_error(e, K3_EFORMAT, path, line, "empty line");
    if (!k3_chat_utf8_valid(s, n))
        return line_error(e, K3_EFORMAT, path, line, "not valid UTF-8 (or a NUL byte)");
    if (escapes_nul(s, n))
        return line_error(e, K3_EFORMAT, path, line, "a string escapes NUL (\\u0000)");
    const char *end = NULL;
    cJSON *o = cJSON_ParseWithLengthOpts(s, (size_t)n, &end, 0);
    if (!o || end != s + n) {
        cJSON_Delete(o);
        return line_error(e, K3_EFORMAT, path, line, "not one JSON value");
    }
    int rc = 0;
    const cJSON *role = NULL, *content = NULL, *reasoning = NULL;
    if (!cJSON_IsObject(o)) {
        rc = line_error(e, K3_EFORMAT, path, line, "not a JSON object");
        goto out;
    }
    for (const cJSON *k = o->child; k; k = k->next) {
        const cJSON **slot = !strcmp(k->string, "role")                ? &role
                             : !strcmp(k->string, "content")           ? &content
                             : !strcmp(k->string, "reasoning_content") ? &reasoning
                                                                       : NULL;
        char msg[160];
        if (!slot) {
            snprintf(msg, sizeof msg, "unknown key \"%.64s\" (role, content, reasoning_content)", k->string);
            rc = line_error(e, K3_EFORMAT, path, line, msg);
            goto out;
        }
        if (*slot) {
            snprintf(msg, sizeof msg, "key \"%s\" appears twice", k->string);
            rc = line_error(e, K3_EFORMAT, path, line, msg);
            goto out;
        }
        *slot = k;
    }
    if (!cJSON_IsString(role) || !cJSON_IsString(content)) {
        rc = line_error(e, K3_EFORMAT, path, line, "\"role\" and \"content\" must be strings");
        goto out;
    }
    k3_chat_role r;
    if (!strcmp(role->valuestring, "system"))
        r = K3_CHAT_SYSTEM;
    else if (!strcmp(role->valuestring, "user"))
        r = K3_CHAT_USER;
    else if (!strcmp(role->valuestring, "assistant"))
        r = K3_CHAT_ASSISTANT;
    else {
        rc = line_error(e, K3_EFORMAT, path, line, "\"role\" is not system, user or assistant");
        goto out;
    }
    if (reasoning && !cJSON_IsNull(reasoning) && !cJSON_IsString(reasoning)) {
        rc = line_error(e, K3_EFORMAT, path, line, "\"reasoning_content\" must be a string or null");
        goto out;
    }
    const char *rs = cJSON_IsString(reasoning) ? reasoning->valuestring : NULL;
    if (rs && r != K3_CHAT_ASSISTANT) {
        rc = line_error(e, K3_EFORMAT, path, line, "only an assistant message has \"reasoning_content\"");
        goto out;
    }
    k3_err ae = {0};
    rc = k3_chat_add(c, r, content->valuestring, strlen(content->valuestring), rs, rs ? strlen(rs) : 0, &ae);
    if (rc < 0)
        rc = line_error(e, rc == K3_EARG ? K3_EFORMAT : rc, path, line, ae.msg);
out:
    cJSON_Delete(o);
    return rc;
}

int k3_chat_history_read(k3_chat *c, const char *path, k3_err *e)
{
    char *buf;
    uint64_t len;
    int rc = k3_io_read_file(path, K3_CHAT_FILE_MAX, &buf, &len, e);
    if (rc < 0)
        return rc;
    uint64_t line = 1;
    for (uint64_t i = 0; i < len && rc == 0; line++) {
        const char *nl = memchr(buf + i, '\n', (size_t)(len - i));
        uint64_t n = nl ? (uint64_t)(nl - (buf + i)) : len - i;
        if (n > K3_CHAT_LINE_MAX)
            rc = k3_err_set(e, K3_ELIMIT, "%s: line %llu: longer than %u bytes", path, (unsigned long long)line,
                            K3_CHAT_LINE_MAX);
        else if (!nl)
            rc = line_error(e, K3_EFORMAT, path, line, "no newline at the end (the file is cut short)");
        else
            rc = parse_line(c, path, line, buf + i, n, e);
        i += n + 1;
    }
    free(buf);
    if (rc < 0)
        k3_chat_clear(c);
    return rc;
}

int k3_chat_history_write(const k3_chat *c, const char *path, k3_err *e)
{
    uint64_t cap = 1, n = 0;
    char *buf = NULL;
    int rc = 0;
    for (uint32_t i = 0; i < c->n && rc == 0; i++) {
        const k3_chat_msg *m = &c->msgs[i];
        if (!k3_chat_utf8_valid(m->content, m->content_len) ||
            (m->reasoning && !k3_chat_utf8_valid(m->reasoning, m->reasoning_len))) {
            rc = k3_err_set(e, K3_EINTERNAL, "%s: message %u is not valid UTF-8 text", path, i + 1);
            break;
        }
        cJSON *o = cJSON_CreateObject();
        if (o) {
            cJSON_AddStringToObject(o, "role", k3_chat_role_name(m->role));
            cJSON_AddStringToObject(o, "content", m->content);
            if (m->role == K3_CHAT_ASSISTANT && m->reasoning)
                cJSON_AddStringToObject(o, "reasoning_content", m->reasoning);
        }
        char *s = o ? cJSON_PrintUnformatted(o) : NULL;
        cJSON_Delete(o);
        uint64_t sl = s ? strlen(s) : 0;
        if (s && n + sl + 2 > cap) {
            while (cap < n + sl + 2)
                cap *= 2;
            char *b = realloc(buf, (size_t)cap);
            if (!b) {
                free(s);
                s = NULL;
            } else {
                buf = b;
            }
        }
        if (!s) {
            rc = k3_err_set(e, K3_ENOMEM, "%s: out of memory writing the history", path);
            break;
        }
        if (sl > K3_CHAT_LINE_MAX) {
            free(s);
            rc = k3_err_set(e, K3_ELIMIT, "%s: message %u takes %llu bytes as JSON, more than a history line may "
                                          "hold (%u)", path, i + 1, (unsigned long long)sl, K3_CHAT_LINE_MAX);
            break;
        }
        memcpy(buf + n, s, (size_t)sl);
        n += sl;
        buf[n++] = '\n';
        free(s);
    }
    if (rc == 0)
        rc = k3_io_write_file_atomic(path, buf ? buf : "", n, e);
    free(buf);
    return rc;
}
