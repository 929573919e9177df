/*
 * t_dest.c - destinations are owned, not assumed (include/k3_dest.h), for
 * k3-convert, k3-pack and k3-synth alike.
 *
 * The matrix: in a sandbox holding the source, a user's directory (with a
 * file named like one of ours and one that is not), a user's regular file
 * and symbolic links, every tool is pointed at SRC itself, DST inside SRC,
 * SRC inside DST (the sandbox), SRC by a path through "..", the user's
 * directory, the regular file, a symbolic link to SRC and one to the user's
 * directory, each with and without --force. Each must be refused with one
 * line "k3-TOOL: error: ..." and exit 2 (overlaps the source) or 7 (not the
 * tool's to replace), and the whole sandbox - every name, type, link target
 * and byte - must be exactly as before: nothing removed, changed or added.
 *
 * Then what must still work: --force over the tool's own output, a
 * concurrent run refused at once while DST is locked ("DST is in use by
 * process N"), and --resume of a locked DST refused the same way.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "k3_test.h"

static void join(char *out, const char *dir, const char *name)
{
    if (snprintf(out, 4096, "%s/%s", dir, name) >= 4096)
        k3t_fail(__FILE__, __LINE__, "path too long: %s/%s", dir, name);
}

/* Every entry under dir: path, type, link target, and the SHA-256 of every
 * regular file, sorted. */
static char *tree_sum(const char *dir)
{
    char *out = NULL;
    CHECK_EQ_INT(k3t_runf(&out, NULL,
                          "cd '%s' && { find . -printf '%%p %%y %%l %%s\\n'; find . -type f -exec sha256sum {} +; } | "
                          "LC_ALL=C sort",
                          dir),
                 0);
    return out;
}

static void write_file(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    CHECK(f != NULL);
    fputs(text, f);
    CHECK_EQ_INT(fclose(f), 0);
}

/* The sandbox: SRC (made by setup), user/ with tiktoken.model and
 * notes.txt, file.txt, link-src -> SRC, link-user -> user. */
static void sandbox(const char *root, const char *src_name)
{
    char p[4096], q[4096];
    join(p, root, "user");
    CHECK_EQ_INT(mkdir(p, 0755), 0);
    join(q, p, "notes.txt");
    write_file(q, "the user's notes\n");
    join(q, p, "tiktoken.model");
    write_file(q, "the user's own tokenizer, not ours\n");
    join(p, root, "file.txt");
    write_file(p, "a user's regular file\n");
    join(p, root, "link-src");
    CHECK_EQ_INT(symlink(src_name, p), 0);
    join(p, root, "link-user");
    CHECK_EQ_INT(symlink("user", p), 0);
}

/* Run `tool ARGS DST` (with and without --force) for every DST of the
 * matrix; each must be refused and leave root exactly as it was. */
static void matrix(const char *root, const char *tool, const char *args, const char *src)
{
    char dsts[9][4096];
    int n = 0;
    if (src) {
        snprintf(dsts[n++], 4096, "%s", src);                       /* SRC == DST */
        snprintf(dsts[n++], 4096, "%s/sub", src);                   /* DST inside SRC */
        snprintf(dsts[n++], 4096, "%s/user/../%s", root, strrchr(src, '/') + 1); /* SRC through .. */
        snprintf(dsts[n++], 4096, "%s", root);                      /* SRC inside DST */
        snprintf(dsts[n++], 4096, "%s/link-src", root);             /* a symbolic link to SRC */
    }
    snprintf(dsts[n++], 4096, "%s/user", root);                     /* a user's directory */
    snprintf(dsts[n++], 4096, "%s/file.txt", root);                 /* a regular file */
    snprintf(dsts[n++], 4096, "%s/link-user", root);                /* a symbolic link to it */
    snprintf(dsts[n++], 4096, "%s/user/", root);                    /* with a trailing slash */
    char *before = tree_sum(root);
    for (int i = 0; i < n; i++)
        for (int force = 0; force < 2; force++) {
            char *out = NULL, *err = NULL;
            int st = k3t_runf(&out, &err, "%s %s %s %s %s", tool, args, force ? "--force" : "", src ? src : "",
                              dsts[i]);
            int lines = 0;
            for (const char *c = err; c && *c; c++)
                lines += *c == '\n';
            char want[64];
            snprintf(want, sizeof want, "%s: error: ", tool);
            if ((st != 2 && st != 7) || lines != 1 || !err || strncmp(err, want, strlen(want)))
                fprintf(stderr, "  %s%s into %s: status %d, stderr:\n%s\n", tool, force ? " --force" : "", dsts[i], st,
                        err ? err : "");
            CHECK(st == 2 || st == 7);
            CHECK_EQ_INT(lines, 1);
            CHECK(err && !strncmp(err, want, strlen(want)));
            char *after = tree_sum(root);
            if (strcmp(before, after))
                fprintf(stderr, "  %s%s into %s changed the sandbox:\nbefore:\n%s\nafter:\n%s\n", tool,
                        force ? " --force" : "", dsts[i], before, after);
            CHECK_STR_EQ(before, after);
            free(after);
            free(out);
            free(err);
        }
    free(before);
}

K3_TEST(dest_matrix_convert_never_touches_what_it_did_not_write)
{
    const char *t = k3t_tmpdir();
    char src[4096];
    join(src, t, "up");
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-synth %s --preset tiny --quiet", src), 0);
    sandbox(t, "up");
    matrix(t, "k3-convert", "--quiet", src);
    /* --resume is no way around it either */
    char dst[4096];
    join(dst, t, "user");
    char *before = tree_sum(t);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-convert --quiet --resume %s %s", src, dst), 7);
    char *after = tree_sum(t);
    CHECK_STR_EQ(before, after);
    free(before);
    free(after);
}

K3_TEST(dest_matrix_pack_never_touches_what_it_did_not_write)
{
    const char *t = k3t_tmpdir();
    char up[4096], src[4096];
    join(up, t, "up");
    join(src, t, "pk");
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-synth %s --preset tiny --quiet", up), 0);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-convert --quiet %s %s", up, src), 0);
    sandbox(t, "pk");
    matrix(t, "k3-pack", "--quiet --ram floor", src);
    /* an upstream checkpoint is not a packed model either */
    char *before = tree_sum(t);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-pack --quiet --force --ram floor %s %s", src, up), 7);
    char *after = tree_sum(t);
    CHECK_STR_EQ(before, after);
    free(before);
    free(after);
}

K3_TEST(dest_matrix_synth_never_touches_what_it_did_not_write)
{
    const char *t = k3t_tmpdir();
    char ck[4096];
    join(ck, t, "ck");
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-synth %s --preset tiny --quiet", ck), 0);
    sandbox(t, "ck");
    matrix(t, "k3-synth", "--preset tiny --quiet", NULL);
    /* a packed model, and a checkpoint whose shards k3-synth did not
     * write (header metadata without "writer": "k3-synth"), are not its */
    char pk[4096], other[4096];
    join(pk, t, "pk");
    join(other, t, "other");
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-convert --quiet %s %s", ck, pk), 0);
    CHECK_EQ_INT(k3t_runf(NULL, NULL,
                          "mkdir %s && cp %s/config.json %s/ && cp %s/model-00001-of-*.safetensors %s/ && "
                          "sed -i 's/\"writer\":\"k3-synth\"/\"writer\":\"k3-other\"/' %s/*.safetensors",
                          other, ck, other, ck, other, other),
                 0);
    char *before = tree_sum(t);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-synth --preset tiny --quiet --force %s", pk), 7);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-synth --preset tiny --quiet --force %s", other), 7);
    char *after = tree_sum(t);
    CHECK_STR_EQ(before, after);
    free(before);
    free(after);
}

/* --force over the tool's own output still replaces it, and leaves the
 * directory next to it alone. */
K3_TEST(dest_force_replaces_the_tools_own_output)
{
    const char *t = k3t_tmpdir();
    char up[4096], pk[4096], pf[4096], keep[4096];
    join(up, t, "up");
    join(pk, t, "pk");
    join(pf, t, "pf");
    join(keep, t, "keep.txt");
    write_file(keep, "keep\n");
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-synth %s --preset tiny --quiet", up), 0);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-synth %s --preset tiny --quiet --force --seed 3", up), 0);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-convert --quiet %s %s", up, pk), 0);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-convert --quiet --force %s %s", up, pk), 0);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-pack --quiet --ram floor %s %s", pk, pf), 0);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-pack --quiet --force --ram floor %s %s", pk, pf), 0);
    /* pack over a conversion, convert over a pack: both packed models */
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-convert --quiet --force %s %s", up, pf), 0);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-verify --quiet %s", pf), 0);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-verify --quiet %s", pk), 0);
    char *out = NULL;
    CHECK_EQ_INT(k3t_runf(&out, NULL, "ls -a %s", t), 0);
    /* no lock file, temporary or old copy is left */
    CHECK_STR_EQ(out, ".\n..\nkeep.txt\npf\npk\nup\n");
    free(out);
}

/* A DST locked by another process: refused at once, exit 7, naming the
 * process; nothing written. The holder here is flock(1) running a shell
 * that writes its process id into the lock file, as the tools do. */
K3_TEST(dest_locked_destination_is_refused_naming_the_process)
{
    const char *t = k3t_tmpdir();
    char up[4096], pk[4096], pf[4096], ck[4096];
    join(up, t, "up");
    join(pk, t, "pk");
    join(pf, t, "pf");
    join(ck, t, "ck");
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-synth %s --preset tiny --quiet", up), 0);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-convert --quiet %s %s", up, pk), 0);
    const char *cmds[3][2] = {{"k3-convert --quiet", up}, {"k3-pack --quiet --ram floor", pk},
                              {"k3-synth --quiet --preset tiny", ""}};
    const char *dsts[3] = {pf, pf, ck};
    for (int i = 0; i < 3; i++) {
        char *out = NULL, *err = NULL;
        int st = k3t_runf(&out, &err,
                          "flock %s.k3-lock sh -c 'echo $$ > %s.k3-lock; echo $$; %s %s %s; echo $?'", dsts[i],
                          dsts[i], cmds[i][0], cmds[i][1], dsts[i]);
        CHECK_EQ_INT(st, 0);
        long pid = 0;
        int tool_st = -1;
        CHECK(out && sscanf(out, "%ld\n%d", &pid, &tool_st) == 2);
        CHECK_EQ_INT(tool_st, 7);
        char want[128];
        snprintf(want, sizeof want, "is in use by process %ld", pid);
        CHECK_STR_CONTAINS(err, want);
        CHECK(access(dsts[i], F_OK) != 0);
        free(out);
        free(err);
        /* once the holder is gone, the stale lock file is taken over, and
         * removed at the end */
        CHECK_EQ_INT(k3t_runf(NULL, NULL, "%s %s %s", cmds[i][0], cmds[i][1], dsts[i]), 0);
        char lk[4200];
        snprintf(lk, sizeof lk, "%s.k3-lock", dsts[i]);
        CHECK(access(lk, F_OK) != 0);
        CHECK_EQ_INT(k3t_runf(NULL, NULL, "rm -rf %s", dsts[i]), 0);
    }
}

/* --resume of a DST that another run holds: refused the same way; once it
 * is free, the resume completes. */
K3_TEST(dest_resume_of_a_locked_destination_is_refused)
{
    const char *t = k3t_tmpdir();
    char up[4096], pk[4096], c[4096];
    join(up, t, "up");
    join(pk, t, "pk");
    join(c, t, "c");
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-synth %s --preset tiny --quiet", up), 0);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-convert --quiet %s %s", up, pk), 0);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "K3_CONVERT_CRASH=journaled:0 k3-convert --quiet %s %s", up, c), 137);
    char *err = NULL;
    CHECK_EQ_INT(k3t_runf(NULL, &err, "flock %s.k3-lock k3-convert --quiet --resume %s %s", c, up, c), 7);
    CHECK_STR_CONTAINS(err, "is in use by");
    free(err);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-convert --quiet --resume %s %s", up, c), 0);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "diff -r %s %s", c, pk), 0);
}
