/*
 * k3_mem.h - how much memory this machine can give the process, so that a
 * plan that cannot fit is refused before anything big is allocated.
 */
#ifndef K3_MEM_H
#define K3_MEM_H

#include <stdint.h>

/*
 * The memory available to this process in bytes: the smaller of
 * MemAvailable (/proc/meminfo) and, under a cgroup limit, what is left of
 * it (cgroup v2 memory.max - memory.current, or v1 memory.limit_in_bytes -
 * memory.usage_in_bytes). K3_MEM_AVAILABLE=BYTES (decimal) overrides both
 * (tests; a machine whose numbers lie). *source names where the number came
 * from ("MemAvailable", "cgroup memory.max", "K3_MEM_AVAILABLE"). Returns 0,
 * or -1 when nothing can be read (then nothing is refused).
 */
int k3_mem_available(uint64_t *bytes, const char **source);

#endif
