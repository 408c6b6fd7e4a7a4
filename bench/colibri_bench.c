/*
 * colibri_bench IMAGE BATCH POOL.f32 ROWS OUT.f32 SECONDS [reference]
 *
 * Times colibri_forward with no Python in the loop (bench/bench.py's "colibri-c").
 * POOL.f32 holds ROWS raw f32 input rows; they are run BATCH rows per call, cycled.
 * The first pass's outputs go to OUT.f32 (bench.py checks them against PyTorch);
 * then whole passes are timed for about SECONDS (at least 5) and stdout gets
 * {"us": median microseconds per call, "arena_bytes", "image_bytes", "rss_kib": peak RSS,
 *  "kernels": the kernels run}. "reference" runs the reference kernels instead of the
 * build's optimised ones (colibri_set_kernels).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "colibri.h"
#include "../tests/c/colibri_common.h"

#define MAX_PASSES 5000

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* This process's own peak RSS (VmHWM, KiB): getrusage's maxrss carries the parent's across fork. */
static long peak_rss_kib(void)
{
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    long kib = -1;
    while (f && fgets(line, sizeof line, f))
        if (sscanf(line, "VmHWM: %ld", &kib) == 1)
            break;
    if (f)
        fclose(f);
    return kib;
}

static int cmp_double(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static int die(const char *what, colibri_status st)
{
    fprintf(stderr, "colibri_bench: %s: %s (%d)\n", what, colibri_strerror(st), (int)st);
    return 1;
}

static colibri_status pass(colibri_ctx *ctx, const colibri_model_info *info, size_t batch, size_t rows,
                           const float *in, float *out)
{
    for (size_t r = 0; r < rows; r += batch) {
        colibri_status st = colibri_forward(ctx, batch, in + r * info->input_size, batch * info->input_size,
                                            out + r * info->output_size, batch * info->output_size);
        if (st != COLIBRI_OK)
            return st;
    }
    return COLIBRI_OK;
}

int main(int argc, char **argv)
{
    if (argc != 7 && !(argc == 8 && strcmp(argv[7], "reference") == 0)) {
        fprintf(stderr, "usage: colibri_bench IMAGE BATCH POOL.f32 ROWS OUT.f32 SECONDS [reference]\n");
        return 1;
    }
    const size_t batch = strtoul(argv[2], NULL, 10), rows = strtoul(argv[4], NULL, 10);
    const double budget = atof(argv[6]);
    size_t len, pool_len;
    void *image = read_file(argv[1], &len);
    float *in = read_file(argv[3], &pool_len);
    if (!image || !in) {
        fprintf(stderr, "colibri_bench: cannot read %s or %s\n", argv[1], argv[3]);
        return 1;
    }
    colibri_model_info info;
    colibri_status st = colibri_get_info(image, len, &info);
    if (st != COLIBRI_OK)
        return die(argv[1], st);
    if (batch == 0 || rows % batch || pool_len != rows * info.input_size * sizeof *in) {
        fprintf(stderr, "colibri_bench: %zu rows of %u floats in batches of %zu do not match %s\n", rows,
                (unsigned)info.input_size, batch, argv[3]);
        return 1;
    }
    void *arena = malloc(info.arena_size);
    float *out = malloc(rows * info.output_size * sizeof *out);
    colibri_ctx *ctx;
    if (!arena || !out)
        return 1;
    if ((st = colibri_init(&ctx, arena, info.arena_size, image, len)) != COLIBRI_OK)
        return die("colibri_init", st);
    if (argc == 8 && (st = colibri_set_kernels(ctx, COLIBRI_KERNELS_REFERENCE)) != COLIBRI_OK)
        return die("colibri_set_kernels", st);
    if ((st = pass(ctx, &info, batch, rows, in, out)) != COLIBRI_OK)
        return die("colibri_forward", st);
    FILE *f = fopen(argv[5], "wb");
    if (!f || fwrite(out, sizeof *out, rows * info.output_size, f) != rows * info.output_size || fclose(f))
        return 1;

    static double per_call[MAX_PASSES];
    size_t n = 0;
    const double end = now() + budget;
    while (n < 5 || (n < MAX_PASSES && now() < end)) {
        const double t0 = now();
        pass(ctx, &info, batch, rows, in, out);
        per_call[n++] = (now() - t0) / (double)(rows / batch);
    }
    qsort(per_call, n, sizeof *per_call, cmp_double);
    const double median = n % 2 ? per_call[n / 2] : (per_call[n / 2 - 1] + per_call[n / 2]) / 2;
    printf("{\"us\": %.3f, \"arena_bytes\": %zu, \"image_bytes\": %zu, \"rss_kib\": %ld, \"kernels\": \"%s\"}\n",
           median * 1e6, info.arena_size, len, peak_rss_kib(), colibri_kernels_name(ctx));
    colibri_free(ctx);
    free(arena);
    free(out);
    free(in);
    free(image);
    return 0;
}
