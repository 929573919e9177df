/*
 * alloc_guard.c - the allocation counter of alloc_guard.h.
 *
 * Normal builds: the test executable defines malloc and its relatives, so
 * every allocation of the process (libc, libgomp, k3) comes here first and is
 * passed on to glibc's own entry points (__libc_malloc, ...). ASan builds
 * replace the allocator already: there the sanitizer's malloc hook counts.
 * Counting is one relaxed atomic add while armed, nothing otherwise.
 */
#include <errno.h>
#include <malloc.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdlib.h>

#include "alloc_guard.h"

static atomic_int armed;
static atomic_ullong count, bytes;

static void note_n(size_t n)
{
    if (atomic_load_explicit(&armed, memory_order_relaxed)) {
        atomic_fetch_add_explicit(&count, 1, memory_order_relaxed);
        atomic_fetch_add_explicit(&bytes, n, memory_order_relaxed);
    }
}

void k3t_alloc_arm(void)
{
    atomic_store(&count, 0);
    atomic_store(&bytes, 0);
    atomic_store(&armed, 1);
}

uint64_t k3t_alloc_disarm(void)
{
    atomic_store(&armed, 0);
    return atomic_load(&count);
}

uint64_t k3t_alloc_bytes(void) { return atomic_load(&bytes); }

#if defined(__SANITIZE_ADDRESS__)
#define K3T_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define K3T_ASAN 1
#endif
#endif

#ifdef K3T_ASAN
/* the sanitizer runtime's hook (declared here: not every compiler installs
 * its <sanitizer/allocator_interface.h>) */
int __sanitizer_install_malloc_and_free_hooks(void (*m)(const volatile void *, size_t),
                                              void (*f)(const volatile void *));

static void on_malloc(const volatile void *p, size_t n)
{
    (void)p;
    note_n(n);
}

static void on_free(const volatile void *p) { (void)p; }

__attribute__((constructor)) static void install(void) { __sanitizer_install_malloc_and_free_hooks(on_malloc, on_free); }
#else
void *__libc_malloc(size_t n);
void *__libc_calloc(size_t k, size_t n);
void *__libc_realloc(void *p, size_t n);
void *__libc_memalign(size_t align, size_t n);
void *__libc_valloc(size_t n);
void *__libc_pvalloc(size_t n);

void *malloc(size_t n)
{
    note_n(n);
    return __libc_malloc(n);
}

void *calloc(size_t k, size_t n)
{
    note_n(k * n);
    return __libc_calloc(k, n);
}

void *realloc(void *p, size_t n)
{
    note_n(n);
    return __libc_realloc(p, n);
}

void *aligned_alloc(size_t align, size_t n)
{
    note_n(n);
    return __libc_memalign(align, n);
}

void *memalign(size_t align, size_t n)
{
    note_n(n);
    return __libc_memalign(align, n);
}

void *valloc(size_t n)
{
    note_n(n);
    return __libc_valloc(n);
}

void *pvalloc(size_t n)
{
    note_n(n);
    return __libc_pvalloc(n);
}

int posix_memalign(void **out, size_t align, size_t n)
{
    note_n(n);
    if (align < sizeof(void *) || (align & (align - 1)))
        return EINVAL;
    void *p = __libc_memalign(align, n);
    if (!p)
        return ENOMEM;
    *out = p;
    return 0;
}
#endif
