/*
 * The C library functions a native module's code may call, routed to the
 * interpreter's own through mp_fun_table (a native module links no libc).
 * GCC emits calls to memcpy and memset by itself (struct copies, zeroing
 * loops), so these must exist even if no source names them.
 *
 * GCC also turns some loops into library calls (a length-of-string loop into
 * strlen), so strlen is here too, as a plain loop.
 *
 * Compiled with -ffreestanding -fno-builtin -fno-tree-loop-distribute-patterns:
 * otherwise GCC may recognise the bodies as memcpy/memset/strlen and compile
 * them into calls to themselves.
 */
#include "mp_natmod.h"

void *memset(void *s, int c, size_t n);
void *memmove(void *dest, const void *src, size_t n);
void *memcpy(void *dest, const void *src, size_t n);
size_t strlen(const char *s);

void *memset(void *s, int c, size_t n)
{
    return MP_FUN(MP_FUN_MEMSET, void *(*)(void *, int, size_t))(s, c, n);
}

void *memmove(void *dest, const void *src, size_t n)
{
    return MP_FUN(MP_FUN_MEMMOVE, void *(*)(void *, const void *, size_t))(dest, src, n);
}

/* memmove is a valid memcpy (overlap allowed is a superset of overlap forbidden). */
void *memcpy(void *dest, const void *src, size_t n)
{
    return MP_FUN(MP_FUN_MEMMOVE, void *(*)(void *, const void *, size_t))(dest, src, n);
}

size_t strlen(const char *s)
{
    size_t n = 0;
    while (s[n])
        n++;
    return n;
}
