/*
 * main.c - the test driver. Runs every registered test (or those whose name
 * contains one of the arguments) in a child process, with a per-test timeout,
 * two at a time by default (K3_TEST_JOBS). Ends with "N passed, N failed"
 * (", N skipped" after it when a test called k3t_skip) and exits 1 if anything
 * failed. K3_TEST_TIMEOUT_SCALE=N multiplies every timeout (emulated runs).
 */
#include "k3_test.h"
#include "k3_kern.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdarg.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define MAX_TESTS 4096

struct test {
    const char *name;
    const char *file;
    k3t_fn fn;
    int timeout_s;
};

static struct test tests[MAX_TESTS];
static int ntests;
static char root[1024];
static char bindir[2048];
static char suite_tmp[1024];
static char test_tmp[2048];
static const char *current;

void k3t_register(const char *name, const char *file, k3t_fn fn, int timeout_s)
{
    if (ntests == MAX_TESTS) {
        fprintf(stderr, "k3-test: too many tests\n");
        exit(2);
    }
    tests[ntests++] = (struct test){name, file, fn, timeout_s};
}

void k3t_fail(const char *file, int line, const char *fmt, ...)
{
    va_list ap;
    fprintf(stderr, "  %s:%d: %s: ", file, line, current ? current : "?");
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    fflush(stderr);
    _exit(1);
}

#define SKIP_STATUS 77   /* exit status of a skipped test's process */

static void skip_file(char *out, size_t cap, const char *name)
{
    snprintf(out, cap, "%s/.skip.%s", suite_tmp, name);
}

void k3t_skip(const char *fmt, ...)
{
    char path[sizeof suite_tmp + 300];
    skip_file(path, sizeof path, current ? current : "?");
    FILE *f = fopen(path, "w");
    if (f) {
        va_list ap;
        va_start(ap, fmt);
        vfprintf(f, fmt, ap);
        va_end(ap);
        fclose(f);
    }
    if (test_tmp[0]) {
        char *cmd;
        if (asprintf(&cmd, "rm -rf '%s'", test_tmp) >= 0) {
            if (system(cmd) != 0)
                fprintf(stderr, "k3-test: could not remove %s\n", test_tmp);
            free(cmd);
        }
    }
    fflush(NULL);
    _exit(SKIP_STATUS);
}

const char *k3t_emulated(void)
{
    return k3_kern_emulated();
}

const char *k3t_root(void) { return root; }
const char *k3t_bindir(void) { return bindir; }

const char *k3t_tmpdir(void)
{
    if (!test_tmp[0]) {
        snprintf(test_tmp, sizeof test_tmp, "%s/%s", suite_tmp, current);
        if (mkdir(test_tmp, 0755) != 0 && errno != EEXIST)
            k3t_fail(__FILE__, __LINE__, "mkdir %s: %s", test_tmp, strerror(errno));
    }
    return test_tmp;
}

static char *slurp(int fd)
{
    size_t cap = 4096, len = 0;
    char *buf = malloc(cap);
    if (!buf)
        return NULL;
    lseek(fd, 0, SEEK_SET);
    for (;;) {
        if (len + 1 == cap) {
            char *n = realloc(buf, cap *= 2);
            if (!n) {
                free(buf);
                return NULL;
            }
            buf = n;
        }
        ssize_t r = read(fd, buf + len, cap - len - 1);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            break;
        len += (size_t)r;
    }
    buf[len] = '\0';
    return buf;
}

int k3t_run(const char *cmd, char **out, char **err)
{
    char ofile[sizeof test_tmp + 32], efile[sizeof test_tmp + 32];
    const char *dir = test_tmp[0] ? test_tmp : suite_tmp;
    snprintf(ofile, sizeof ofile, "%s/.stdout.XXXXXX", dir);
    snprintf(efile, sizeof efile, "%s/.stderr.XXXXXX", dir);
    int ofd = mkstemp(ofile), efd = mkstemp(efile);
    if (ofd < 0 || efd < 0)
        return -1;
    unlink(ofile);
    unlink(efile);
    fflush(NULL);
    pid_t pid = fork();
    if (pid < 0)
        return -1;
    if (pid == 0) {
        int nul = open("/dev/null", O_RDONLY);
        dup2(nul, 0);
        dup2(ofd, 1);
        dup2(efd, 2);
        execl("/bin/sh", "sh", "-c", cmd, (char *)NULL);
        _exit(127);
    }
    int st;
    while (waitpid(pid, &st, 0) < 0 && errno == EINTR)
        ;
    if (out)
        *out = slurp(ofd);
    if (err)
        *err = slurp(efd);
    close(ofd);
    close(efd);
    if (WIFEXITED(st))
        return WEXITSTATUS(st);
    if (WIFSIGNALED(st))
        return 128 + WTERMSIG(st);
    return -1;
}

int k3t_runf(char **out, char **err, const char *fmt, ...)
{
    char *cmd;
    va_list ap;
    va_start(ap, fmt);
    int n = vasprintf(&cmd, fmt, ap);
    va_end(ap);
    if (n < 0)
        return -1;
    int rc = k3t_run(cmd, out, err);
    free(cmd);
    return rc;
}

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int selected(int argc, char **argv, const char *name)
{
    if (argc < 2)
        return 1;
    for (int i = 1; i < argc; i++)
        if (strstr(name, argv[i]))
            return 1;
    return 0;
}

/* K3_TEST_SKIP_FILE: lines "PATTERN<TAB>REASON" ('#' comments); a selected
 * test whose name contains a PATTERN is reported as skipped with its REASON
 * and not run (the aarch64 suite under qemu skips what means nothing there,
 * or costs too much, saying why). The first pattern a name contains decides;
 * "!PATTERN<TAB>WHY" runs the tests it names although a later pattern would
 * skip them. A pattern that names no test is an error: a renamed test cannot
 * silently start running, or stop being listed. */
#define SKIP_MAX 128
static struct skip_rule {
    char pat[128];
    char why[384];
    int keep;                 /* "!PATTERN": run these */
    int used;
} skips[SKIP_MAX];
static int nskips;

static int load_skips(const char *path)
{
    FILE *f = fopen(path, "r");
    if (!f) {
        fprintf(stderr, "k3-test: %s: %s\n", path, strerror(errno));
        return -1;
    }
    char line[1024];
    int ln = 0;
    while (fgets(line, sizeof line, f)) {
        ln++;
        line[strcspn(line, "\n")] = '\0';
        if (!line[0] || line[0] == '#')
            continue;
        char *tab = strchr(line, '\t');
        if (!tab || tab == line || !tab[1] || nskips == SKIP_MAX || (size_t)(tab - line) >= sizeof skips[0].pat) {
            fprintf(stderr, "k3-test: %s:%d: not \"PATTERN<TAB>REASON\" (or too many lines)\n", path, ln);
            fclose(f);
            return -1;
        }
        *tab = '\0';
        skips[nskips].keep = line[0] == '!';
        snprintf(skips[nskips].pat, sizeof skips[0].pat, "%s", line + skips[nskips].keep);
        snprintf(skips[nskips].why, sizeof skips[0].why, "%s", tab + 1);
        nskips++;
    }
    fclose(f);
    return 0;
}

static const char *skip_reason(const char *name)
{
    for (int i = 0; i < nskips; i++)
        if (strstr(name, skips[i].pat)) {
            skips[i].used = 1;
            return skips[i].keep ? NULL : skips[i].why;
        }
    return NULL;
}

static void rm_rf(const char *path)
{
    char *cmd;
    if (asprintf(&cmd, "rm -rf '%s'", path) >= 0) {
        if (system(cmd) != 0)
            fprintf(stderr, "k3-test: could not remove %s\n", path);
        free(cmd);
    }
}

struct running {
    pid_t pid;
    int idx;
    double start;
};

static int cmp_test(const void *a, const void *b)
{
    const struct test *x = a, *y = b;
    int c = strcmp(x->file, y->file);
    return c ? c : strcmp(x->name, y->name);
}

int main(int argc, char **argv)
{
    if (!getcwd(root, sizeof root))
        return 2;
    const char *b = getenv("K3_BIN");
    if (b && strlen(b) >= sizeof bindir - sizeof root - 2) {
        fprintf(stderr, "k3-test: K3_BIN is too long\n");
        return 2;
    }
    snprintf(bindir, sizeof bindir, "%s", b && *b ? b : "bin");
    if (bindir[0] != '/') {
        char tmp[sizeof bindir + sizeof root + 1];
        snprintf(tmp, sizeof tmp, "%s/%s", root, bindir);
        if (strlen(tmp) >= sizeof bindir) {
            fprintf(stderr, "k3-test: binary path too long\n");
            return 2;
        }
        memcpy(bindir, tmp, strlen(tmp) + 1);
    }
    const char *path = getenv("PATH");
    char *newpath;
    if (asprintf(&newpath, "%s:%s", bindir, path ? path : "/usr/bin:/bin") < 0)
        return 2;
    setenv("PATH", newpath, 1);
    free(newpath);
    const char *tb = getenv("TMPDIR");
    if (tb && strlen(tb) > 512)
        tb = "/tmp";
    snprintf(suite_tmp, sizeof suite_tmp, "%s/k3-test.XXXXXX", tb && *tb ? tb : "/tmp");
    if (!mkdtemp(suite_tmp)) {
        perror("k3-test: mkdtemp");
        return 2;
    }
    qsort(tests, (size_t)ntests, sizeof tests[0], cmp_test);

    int jobs = 2;
    const char *j = getenv("K3_TEST_JOBS");
    if (j && *j) {
        char *end;
        long v = strtol(j, &end, 10);
        if (*end || v < 1 || v > 16) {
            fprintf(stderr, "k3-test: K3_TEST_JOBS must be 1..16\n");
            return 2;
        }
        jobs = (int)v;
    }

    int scale = 1;
    const char *sc = getenv("K3_TEST_TIMEOUT_SCALE");
    if (sc && *sc) {
        char *end;
        long v = strtol(sc, &end, 10);
        if (*end || v < 1 || v > 100) {
            fprintf(stderr, "k3-test: K3_TEST_TIMEOUT_SCALE must be 1..100\n");
            return 2;
        }
        scale = (int)v;
    }

    const char *sf = getenv("K3_TEST_SKIP_FILE");
    if (sf && *sf && load_skips(sf) < 0)
        return 2;
    for (int i = 0; i < ntests; i++)   /* mark the patterns that name a test */
        skip_reason(tests[i].name);
    for (int i = 0; i < nskips; i++)
        if (!skips[i].used) {
            fprintf(stderr, "k3-test: %s: pattern \"%s\" names no test\n", sf, skips[i].pat);
            return 2;
        }

    int passed = 0, failed = 0, skipped = 0;
    struct running run[16];
    int nrun = 0, next = 0;
    double t0 = now();
    for (;;) {
        while (nrun < jobs && next < ntests) {
            int i = next++;
            if (!selected(argc, argv, tests[i].name))
                continue;
            const char *why = skip_reason(tests[i].name);
            if (why) {
                skipped++;
                printf("skip %-56s %6.2fs (%s)\n", tests[i].name, 0.0, why);
                continue;
            }
            fflush(NULL);
            pid_t pid = fork();
            if (pid == 0) {
                current = tests[i].name;
                setpgid(0, 0);
                alarm((unsigned)(tests[i].timeout_s * scale));
                tests[i].fn();
                if (test_tmp[0])
                    rm_rf(test_tmp);
                _exit(0);
            }
            run[nrun++] = (struct running){pid, i, now()};
        }
        if (nrun == 0)
            break;
        int st;
        pid_t pid = wait(&st);
        if (pid < 0)
            break;
        for (int r = 0; r < nrun; r++) {
            if (run[r].pid != pid)
                continue;
            struct test *t = &tests[run[r].idx];
            double dt = now() - run[r].start;
            if (WIFEXITED(st) && WEXITSTATUS(st) == SKIP_STATUS) {
                char spath[sizeof suite_tmp + 300], why[512] = "no reason given";
                skip_file(spath, sizeof spath, t->name);
                FILE *f = fopen(spath, "r");
                if (f) {
                    size_t n = fread(why, 1, sizeof why - 1, f);
                    why[n] = '\0';
                    fclose(f);
                    unlink(spath);
                }
                skipped++;
                printf("skip %-56s %6.2fs (%s)\n", t->name, dt, why);
            } else if (WIFEXITED(st) && WEXITSTATUS(st) == 0) {
                passed++;
                printf("ok   %-56s %6.2fs\n", t->name, dt);
            } else {
                failed++;
                if (WIFSIGNALED(st))
                    printf("FAIL %-56s %6.2fs (%s)\n", t->name, dt,
                           WTERMSIG(st) == SIGALRM ? "timeout" : strsignal(WTERMSIG(st)));
                else
                    printf("FAIL %-56s %6.2fs\n", t->name, dt);
                kill(-pid, SIGKILL); /* anything the test left running */
            }
            fflush(stdout);
            run[r] = run[--nrun];
            break;
        }
    }
    if (failed == 0)
        rm_rf(suite_tmp);
    else
        printf("(kept %s for inspection)\n", suite_tmp);
    printf("total %.1fs\n", now() - t0);
    if (skipped)
        printf("%d passed, %d failed, %d skipped\n", passed, failed, skipped);
    else
        printf("%d passed, %d failed\n", passed, failed);
    return failed ? 1 : 0;
}
