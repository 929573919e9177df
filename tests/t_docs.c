/*
 * t_docs.c - the repository explains itself: no tracked file points at a
 * document or a machine path outside it, and every tool has a manual page.
 *
 * The manual pages (man/k3-*.1): one per built tool, with the usual
 * sections, naming every option the tool's --help lists, installed by
 * make install.
 *
 * The files are those git tracks (git ls-files) when the tree is a git work
 * tree, otherwise every file under the root except build outputs and
 * node_modules. The searched strings are assembled from pieces so that this
 * file does not match itself.
 */
#include "k3_test.h"

#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* The strings no tracked file may contain. */
static const char *const outside[] = {
    "../" "shared",      /* the sibling directory of a checkout */
    "/wo" "rk/",         /* an absolute path of one machine */
    "SPEC" " \xc2\xa7",  /* "SPEC" followed by a section sign: a document not in the repository */
    "SPEC" " section",
    "SPEC" ".md",
};

K3_TEST(docs_no_tracked_file_points_outside_the_repository)
{
    char pats[512] = "";
    size_t len = 0;
    for (size_t i = 0; i < sizeof outside / sizeof outside[0]; i++) {
        int k = snprintf(pats + len, sizeof pats - len, " -e '%s'", outside[i]);
        CHECK(k > 0 && (size_t)k < sizeof pats - len);
        len += (size_t)k;
    }
    char list[1024];
    snprintf(list, sizeof list,
             "cd '%s' && { if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then git ls-files -z; "
             "else find . -path ./build -prune -o -path ./build-asan -prune -o -path ./bin -prune "
             "-o -name node_modules -prune -o -name .git -prune -o -type f -print0; fi; }",
             k3t_root());
    /* the list itself must be there, or the search below proves nothing */
    char *out = NULL, *err = NULL;
    CHECK_EQ_INT(k3t_runf(&out, NULL, "%s | tr -cd '\\0' | wc -c", list), 0);
    CHECK(out && strtoul(out, NULL, 10) > 100);
    free(out);
    out = NULL;
    /* grep's exit status mixes "no match" with errors (and xargs folds it
     * again): what counts is that nothing was printed */
    k3t_runf(&out, &err, "%s | xargs -0 grep -n -I -s -F%s -- ; true", list, pats);
    if (!out || *out)
        k3t_fail(__FILE__, __LINE__, "files point outside the repository (point them at docs/ instead):\n%s%s",
                 out ? out : "(no output)", err ? err : "");
    free(out);
    free(err);
}

/* ---- manual pages ----------------------------------------------------------- */

/* Read a whole file (heap, NUL-terminated) or NULL. */
static char *slurp(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    char *buf = NULL;
    size_t len = 0, cap = 0;
    for (;;) {
        if (len + 4096 + 1 > cap) {
            cap = cap ? cap * 2 : 65536;
            char *nb = realloc(buf, cap);
            if (!nb) {
                free(buf);
                fclose(f);
                return NULL;
            }
            buf = nb;
        }
        size_t n = fread(buf + len, 1, 4096, f);
        len += n;
        if (n < 4096)
            break;
    }
    fclose(f);
    buf[len] = '\0';
    return buf;
}

/* The roff source as plain text: "\-" is "-", font changes ("\fB", "\fR",
 * "\f(CW") and "\&" vanish, so an option reads as it is typed. */
static void roff_plain(char *s)
{
    char *w = s;
    for (const char *r = s; *r;) {
        if (r[0] == '\\' && r[1] == '-') {
            *w++ = '-';
            r += 2;
        } else if (r[0] == '\\' && r[1] == '&') {
            r += 2;
        } else if (r[0] == '\\' && r[1] == 'f' && r[2] == '(' && r[3] && r[4]) {
            r += 5;
        } else if (r[0] == '\\' && r[1] == 'f' && r[2]) {
            r += 3;
        } else {
            *w++ = *r++;
        }
    }
    *w = '\0';
}

static int opt_char(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-'; }

/* Whether text holds opt as a whole token (not a prefix of a longer option). */
static int has_option(const char *text, const char *opt)
{
    size_t n = strlen(opt);
    for (const char *p = strstr(text, opt); p; p = strstr(p + 1, opt))
        if ((p == text || !opt_char(p[-1])) && !opt_char(p[n]))
            return 1;
    return 0;
}

/* Every option the --help text lists: the "--name" and "-x" tokens of its
 * option lines (lines whose first non-blank character is '-'). Calls fn for
 * each; returns how many there were. */
static int help_options(const char *help, void (*fn)(const char *opt, void *arg), void *arg)
{
    int count = 0;
    for (const char *line = help; *line;) {
        const char *end = strchr(line, '\n');
        if (!end)
            end = line + strlen(line);
        const char *p = line;
        while (p < end && (*p == ' ' || *p == '\t'))
            p++;
        if (p < end && *p == '-') {
            for (const char *q = p; q < end; q++) {
                if (*q != '-' || (q > line && opt_char(q[-1])))
                    continue;
                const char *b = q;
                q += q + 1 < end && q[1] == '-' ? 2 : 1;
                if (q >= end || !((*q >= 'a' && *q <= 'z') || (*q >= 'A' && *q <= 'Z')))
                    continue;
                if (q - b == 1 && q + 1 < end && opt_char(q[1]))
                    continue;   /* "-word" is prose, not a short option */
                while (q < end && opt_char(*q))
                    q++;
                char opt[128];
                size_t n = (size_t)(q - b);
                while (n > 1 && b[n - 1] == '-')
                    n--;        /* a trailing dash ends a sentence, not the name */
                if (n >= sizeof opt)
                    continue;
                memcpy(opt, b, n);
                opt[n] = '\0';
                fn(opt, arg);
                count++;
            }
        }
        line = *end ? end + 1 : end;
    }
    return count;
}

typedef struct man_check {
    const char *tool;
    const char *page;    /* plain text of the page */
    const char *help;    /* the arguments that printed the help */
    int missing;
} man_check;

static void check_option(const char *opt, void *arg)
{
    man_check *c = arg;
    if (!has_option(c->page, opt)) {
        fprintf(stderr, "  man/%s.1 does not document %s (listed by %s %s)\n", c->tool, opt, c->tool, c->help);
        c->missing++;
    }
}

/* The help texts of each tool: --help, and the help of a mode that has its
 * own options (tool NULL: every tool). */
static const struct {
    const char *tool, *args;
} helps[] = {
    {NULL, "--help"},
    {"k3-run", "--chat --help"},
};

/* k3-run-mpi, k3-serve-mpi: the MPI builds of k3-run and k3-serve, the
 * same tools with the same help, documented in their pages. */
static int is_mpi_build(const char *name)
{
    size_t n = strlen(name);
    return n > 4 && !strcmp(name + n - 4, "-mpi");
}

K3_TEST(docs_man_pages_document_every_option_each_tool_lists_in_its_help)
{
    DIR *d = opendir(k3t_bindir());
    CHECK(d != NULL);
    int tools = 0, missing = 0;
    for (struct dirent *de; (de = readdir(d));) {
        if (strncmp(de->d_name, "k3-", 3) || !strcmp(de->d_name, "k3-test") || strchr(de->d_name, '.') ||
            is_mpi_build(de->d_name))
            continue;
        tools++;
        char path[4096];
        snprintf(path, sizeof path, "%s/man/%s.1", k3t_root(), de->d_name);
        char *page = slurp(path);
        if (!page) {
            fprintf(stderr, "  %s: no manual page man/%s.1\n", de->d_name, de->d_name);
            missing++;
            continue;
        }
        roff_plain(page);
        char th[300];
        snprintf(th, sizeof th, ".TH %s 1 ", de->d_name);
        for (char *p = th + 4; *p && *p != ' '; p++)
            if (*p >= 'a' && *p <= 'z')
                *p = (char)(*p - 'a' + 'A');
        CHECK_STR_CONTAINS(page, th);
        static const char *const sections[] = {".SH NAME", ".SH SYNOPSIS", ".SH DESCRIPTION", ".SH OPTIONS",
                                               ".SH EXIT STATUS", ".SH FILES", ".SH EXAMPLES", ".SH SEE ALSO"};
        for (size_t i = 0; i < sizeof sections / sizeof sections[0]; i++)
            if (!strstr(page, sections[i])) {
                fprintf(stderr, "  man/%s.1 has no \"%s\"\n", de->d_name, sections[i]);
                missing++;
            }
        man_check c = {de->d_name, page, NULL, 0};
        for (size_t h = 0; h < sizeof helps / sizeof helps[0]; h++) {
            if (helps[h].tool && strcmp(helps[h].tool, de->d_name))
                continue;
            char *help = NULL;
            int rc = k3t_runf(&help, NULL, "'%s/%s' %s", k3t_bindir(), de->d_name, helps[h].args);
            CHECK_EQ_INT(rc, 0);
            c.help = helps[h].args;
            int n = help_options(help, check_option, &c);
            if (n < 3) {
                fprintf(stderr, "  %s %s lists %d options: the parse found nothing to check\n", de->d_name,
                        helps[h].args, n);
                missing++;
            }
            free(help);
        }
        missing += c.missing;
        free(page);
    }
    closedir(d);
    CHECK(tools >= 5);
    CHECK_EQ_INT(missing, 0);
}

K3_TEST(docs_man_pages_belong_to_built_tools_and_make_install_puts_them_in_man1)
{
    /* no page for a tool that is not built */
    DIR *d;
    char path[4096];
    snprintf(path, sizeof path, "%s/man", k3t_root());
    CHECK((d = opendir(path)) != NULL);
    int pages = 0;
    for (struct dirent *de; (de = readdir(d));) {
        size_t n = strlen(de->d_name);
        if (n < 3 || strcmp(de->d_name + n - 2, ".1"))
            continue;
        pages++;
        snprintf(path, sizeof path, "%s/%.*s", k3t_bindir(), (int)(n - 2), de->d_name);
        if (access(path, X_OK) != 0)
            k3t_fail(__FILE__, __LINE__, "man/%s documents a tool that is not built (%s)", de->d_name, path);
    }
    closedir(d);
    CHECK(pages >= 5);
    /* the install target copies every page to $(PREFIX)/share/man/man1 */
    const char *tmp = k3t_tmpdir();
    char *out = NULL, *err = NULL;
    int rc = k3t_runf(&out, &err,
                      "cd '%s' && env -u MAKEFLAGS -u MFLAGS -u MAKELEVEL make -s install-man DESTDIR='%s' PREFIX=/usr "
                      "&& for f in man/*.1; do cmp \"$f\" '%s/usr/share/man/man1/'\"${f#man/}\" || exit 1; done",
                      k3t_root(), tmp, tmp);
    if (rc != 0)
        k3t_fail(__FILE__, __LINE__, "make install-man: exit %d\n%s%s", rc, out ? out : "", err ? err : "");
    free(out);
    free(err);
}

/* The skip file of the emulated suite (tests/qemu-skip.txt, K3_TEST_SKIP_FILE):
 * every pattern must name a test, a malformed line fails, and a skipped test
 * is reported with its reason instead of running. */
K3_TEST(harness_skip_file_names_only_existing_tests_and_says_why)
{
    char *out = NULL, *err = NULL, f[4200];
    const char *bin = k3t_bindir();
    CHECK_EQ_INT(k3t_runf(&out, NULL, "K3_TEST_SKIP_FILE=tests/qemu-skip.txt %s/k3-test no_test_is_named_this", bin), 0);
    free(out);
    snprintf(f, sizeof f, "%s/skip.txt", k3t_tmpdir());
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "printf 'crc_one_call_past\\tbecause\\n' > %s", f), 0);
    CHECK_EQ_INT(k3t_runf(&out, NULL, "K3_TEST_SKIP_FILE=%s %s/k3-test crc_one_call_past", f, bin), 0);
    CHECK_STR_CONTAINS(out, "skip crc_one_call_past_4_gib");
    CHECK_STR_CONTAINS(out, "(because)");
    CHECK_STR_CONTAINS(out, "0 passed, 0 failed, 1 skipped");
    free(out);
    /* a pattern no test has: refused, so a renamed test cannot slip out of the list */
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "printf 'no_such_test_anywhere\\twhy\\n' > %s", f), 0);
    CHECK_EQ_INT(k3t_runf(NULL, &err, "K3_TEST_SKIP_FILE=%s %s/k3-test crc_one_call_past", f, bin), 2);
    CHECK_STR_CONTAINS(err, "names no test");
    free(err);
    /* no reason: refused */
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "printf 'crc_one_call_past\\n' > %s", f), 0);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "K3_TEST_SKIP_FILE=%s %s/k3-test crc_one_call_past", f, bin), 2);
    /* "!" keeps what a later line would skip */
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "printf '!crc_matches\\tkeep\\ncrc_\\tskip\\n' > %s", f), 0);
    CHECK_EQ_INT(k3t_runf(&out, NULL, "K3_TEST_SKIP_FILE=%s %s/k3-test crc_matches_zlib_on_random crc_one_call", f, bin), 0);
    CHECK_STR_CONTAINS(out, "ok   crc_matches_zlib_on_random");
    CHECK_STR_CONTAINS(out, "skip crc_one_call_past_4_gib");
    free(out);
}
