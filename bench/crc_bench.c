/*
 * The engine's CRC-32 (colibri_crc32, src/colibri_image.c) against zlib's crc32 on the same bytes:
 * MB/s, median of 7 runs over a 64 MiB buffer, and the three results compared.
 *
 *   make bench-crc     (builds this twice: -DCOLIBRI_CRC_SLICING=0, the microcontroller's nibble loop,
 *                       and =1, the Linux build's slicing-by-8)
 */
#define _POSIX_C_SOURCE 200809L
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <zlib.h>

#include "colibri_internal.h"

#ifndef COLIBRI_CRC_SLICING
#error "build with -DCOLIBRI_CRC_SLICING=0 or 1 (make bench-crc)"
#endif

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int cmp(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

int main(void)
{
    enum { RUNS = 7 };
    const size_t n = (size_t)64 << 20;
    uint8_t *buf = malloc(n);
    if (!buf)
        return 1;
    uint64_t s = 0x9E3779B97F4A7C15u;
    for (size_t i = 0; i < n; i++) {
        s ^= s << 13, s ^= s >> 7, s ^= s << 17;
        buf[i] = (uint8_t)s;
    }
    double engine[RUNS], zl[RUNS];
    uint32_t a = 0, b = 0;
    for (int r = 0; r < RUNS; r++) {
        double t0 = now();
        a = colibri_crc32(buf, n);
        double t1 = now();
        b = (uint32_t)crc32(0L, buf, (uInt)n);
        double t2 = now();
        engine[r] = t1 - t0;
        zl[r] = t2 - t1;
    }
    qsort(engine, RUNS, sizeof *engine, cmp);
    qsort(zl, RUNS, sizeof *zl, cmp);
    /* Unaligned starts and odd tails go through the same function: check a few against zlib. */
    int agree = a == b;
    for (size_t off = 0; off < 9; off++)
        for (size_t len = 0; len < 40; len++)
            agree &= colibri_crc32(buf + off, len) == (uint32_t)crc32(0L, buf + off, (uInt)len);
    printf("colibri_crc32 (%s): %8.0f MB/s   zlib crc32: %8.0f MB/s   (64 MiB, median of %d)   %s\n",
           COLIBRI_CRC_SLICING ? "slicing-by-8, Linux build" : "nibble, microcontroller build",
           (double)n / engine[RUNS / 2] / 1e6, (double)n / zl[RUNS / 2] / 1e6, RUNS,
           agree ? "results agree with zlib" : "MISMATCH with zlib");
    free(buf);
    return agree ? 0 : 1;
}
