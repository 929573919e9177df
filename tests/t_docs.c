/*
 * t_docs.c - the repository explains itself: no tracked file points at a
 * document or a machine path outside it.
 *
 * The files are those git tracks (git ls-files) when the tree is a git work
 * tree, otherwise every file under the root except build outputs and
 * node_modules. The searched strings are assembled from pieces so that this
 * file does not match itself.
 */
#include "k3_test.h"

#include <stdlib.h>
#include <string.h>

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
