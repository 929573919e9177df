/*
 * mem.c - the memory available to this process (see k3_mem.h): the
 * K3_MEM_AVAILABLE override, MemAvailable and the cgroup limit.
 */
#include "k3_mem.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "k3_cli.h"

/* One decimal number from a file ("max" or unreadable: 0). */
static int read_u64(const char *path, uint64_t *v)
{
    FILE *f = fopen(path, "r");
    if (!f)
        return -1;
    char buf[64] = {0};
    int ok = fgets(buf, sizeof buf, f) != NULL;
    fclose(f);
    if (!ok)
        return -1;
    buf[strcspn(buf, "\n")] = '\0';
    return k3_cli_parse_u64(buf, 0, UINT64_MAX, v);
}

/* The cgroup this process is in ("0::/path" of /proc/self/cgroup, v2). */
static int cgroup_left(uint64_t *left, const char **source)
{
    FILE *f = fopen("/proc/self/cgroup", "r");
    char line[4096], rel[4096] = "";
    if (f) {
        while (fgets(line, sizeof line, f))
            if (!strncmp(line, "0::", 3)) {
                snprintf(rel, sizeof rel, "%s", line + 3);
                rel[strcspn(rel, "\n")] = '\0';
            }
        fclose(f);
    }
    char p[8300];
    uint64_t max, cur;
    /* v2: the process's own cgroup, then the root of the mount (containers) */
    const char *dirs[2] = {rel, ""};
    for (int i = 0; i < 2; i++) {
        snprintf(p, sizeof p, "/sys/fs/cgroup%s/memory.max", dirs[i]);
        if (read_u64(p, &max) == 0) {
            snprintf(p, sizeof p, "/sys/fs/cgroup%s/memory.current", dirs[i]);
            if (read_u64(p, &cur) != 0)
                cur = 0;
            *left = max > cur ? max - cur : 0;
            *source = "cgroup memory.max";
            return 0;
        }
    }
    if (read_u64("/sys/fs/cgroup/memory/memory.limit_in_bytes", &max) == 0 && max < (1ull << 62)) {
        if (read_u64("/sys/fs/cgroup/memory/memory.usage_in_bytes", &cur) != 0)
            cur = 0;
        *left = max > cur ? max - cur : 0;
        *source = "cgroup memory.limit_in_bytes";
        return 0;
    }
    return -1;
}

int k3_mem_available(uint64_t *bytes, const char **source)
{
    const char *v = getenv("K3_MEM_AVAILABLE");
    if (v && *v && k3_cli_parse_u64(v, 0, UINT64_MAX, bytes) == 0) {
        *source = "K3_MEM_AVAILABLE";
        return 0;
    }
    int have = 0;
    FILE *f = fopen("/proc/meminfo", "r");
    if (f) {
        char line[256];
        unsigned long long kb;
        while (fgets(line, sizeof line, f))
            if (sscanf(line, "MemAvailable: %llu kB", &kb) == 1) {
                *bytes = (uint64_t)kb * 1024;
                *source = "MemAvailable";
                have = 1;
            }
        fclose(f);
    }
    uint64_t left;
    const char *cs;
    if (cgroup_left(&left, &cs) == 0 && (!have || left < *bytes)) {
        *bytes = left;
        *source = cs;
        have = 1;
    }
    return have ? 0 : -1;
}
