/* Helpers shared by the C test drivers (not part of the engine). */
#ifndef COLIBRI_TEST_COMMON_H
#define COLIBRI_TEST_COMMON_H

#include <stdio.h>
#include <stdlib.h>

/* Reads a whole file into a fresh malloc'd buffer (malloc alignment is
 * enough for the engine's 4-byte image alignment). NULL on failure. */
static inline void *read_file(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    size_t cap = 1 << 16, n = 0;
    unsigned char *buf = malloc(cap);
    while (buf) {
        n += fread(buf + n, 1, cap - n, f);
        if (n < cap)
            break;
        unsigned char *bigger = realloc(buf, cap *= 2);
        if (!bigger)
            free(buf);
        buf = bigger;
    }
    if (buf && ferror(f)) {
        free(buf);
        buf = NULL;
    }
    fclose(f);
    *len = n;
    return buf;
}

#endif
