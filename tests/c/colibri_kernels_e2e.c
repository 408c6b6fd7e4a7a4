/*
 * colibri_kernels_e2e [--time REPS [--only ref|opt]] EXPECTED_NAME IMAGE...
 *
 * For each IMAGE (a model image file): reads IMAGE.in, the raw little-endian
 * f32 input [batch, input_size] (batch = its length / input_size), runs one
 * forward of the whole batch with the reference kernels
 * (COLIBRI_KERNELS_REFERENCE) and one with the build's optimised kernels, and
 * writes the outputs to IMAGE.ref.out and IMAGE.opt.out. The caller
 * (tests/kernels/test_kernels_aarch64.py) compares them with the host's reference output.
 * Prints "kernels: <name>" of the optimised set; EXPECTED_NAME ("-": any)
 * must match it. Exit 0 when every image ran.
 *
 * --time REPS: also runs each kernel set's forward REPS more times and prints
 * the median wall-clock µs per call of each. Under qemu-aarch64 these are
 * emulated times (TCG), not a performance figure of any CPU. --only repeats
 * one set's forward only (for counting its instructions with a QEMU plugin:
 * the difference between REPS and 0 repetitions, divided by REPS).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "colibri.h"
#include "colibri_common.h"

static int write_file(const char *path, const void *data, size_t len)
{
    FILE *f = fopen(path, "wb");
    if (!f)
        return -1;
    const size_t put = fwrite(data, 1, len, f);
    return fclose(f) == 0 && put == len ? 0 : -1;
}

static double now_us(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e6 + (double)t.tv_nsec * 1e-3;
}

static int cmp_double(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static int run_one(const char *expected, const char *path, int reps, const char *only)
{
    int rc = 1;
    char name[4096];
    size_t len = 0, in_len = 0;
    void *image = read_file(path, &len), *arena = NULL;
    float *in = NULL, *out = NULL;
    snprintf(name, sizeof name, "%s.in", path);
    in = read_file(name, &in_len);
    colibri_model_info info;
    colibri_ctx *ctx = NULL;
    colibri_status st;
    if (!image || !in) {
        fprintf(stderr, "%s: cannot read the image or its .in file\n", path);
        goto done;
    }
    if ((st = colibri_get_info(image, len, &info)) != COLIBRI_OK) {
        fprintf(stderr, "%s: %s\n", path, colibri_strerror(st));
        goto done;
    }
    const size_t batch = in_len / sizeof(float) / info.input_size;
    if (batch == 0 || batch * info.input_size * sizeof(float) != in_len) {
        fprintf(stderr, "%s: input of %zu bytes is not [batch, %zu] f32\n", path, in_len, (size_t)info.input_size);
        goto done;
    }
    const size_t n_out = batch * info.output_size;
    arena = malloc(info.arena_size);
    out = malloc(n_out * sizeof *out);
    if (!arena || !out) {
        fprintf(stderr, "out of memory\n");
        goto done;
    }
    if ((st = colibri_init(&ctx, arena, info.arena_size, image, len)) != COLIBRI_OK) {
        fprintf(stderr, "%s: colibri_init: %s\n", path, colibri_strerror(st));
        goto done;
    }
    const char *opt_name = colibri_kernels_name(ctx);
    if (strcmp(expected, "-") != 0 && strcmp(expected, opt_name) != 0) {
        fprintf(stderr, "FAIL: expected kernels '%s', got '%s'\n", expected, opt_name);
        goto done;
    }
    static const char *const suffix[2] = {"ref", "opt"};
    static const colibri_kernel_set sets[2] = {COLIBRI_KERNELS_REFERENCE, COLIBRI_KERNELS_OPTIMISED};
    double median[2] = {0.0, 0.0};
    for (int s = 0; s < 2; s++) {
        if ((st = colibri_set_kernels(ctx, sets[s])) != COLIBRI_OK ||
            (st = colibri_forward(ctx, batch, in, batch * info.input_size, out, n_out)) != COLIBRI_OK) {
            fprintf(stderr, "%s: %s kernels: %s\n", path, suffix[s], colibri_strerror(st));
            goto done;
        }
        double t[101];
        const int timed = only && strcmp(only, suffix[s]) != 0 ? 0 : reps;
        for (int r = 0; r < timed; r++) {
            const double t0 = now_us();
            (void)colibri_forward(ctx, batch, in, batch * info.input_size, out, n_out);
            t[r % 101] = now_us() - t0;
        }
        if (timed > 0) {
            const int kept = timed < 101 ? timed : 101;
            qsort(t, (size_t)kept, sizeof *t, cmp_double);
            median[s] = t[kept / 2];
        }
        snprintf(name, sizeof name, "%s.%s.out", path, suffix[s]);
        if (write_file(name, out, n_out * sizeof *out) != 0) {
            fprintf(stderr, "%s: cannot write\n", name);
            goto done;
        }
    }
    printf("%s: batch %zu, kernels %s\n", path, batch, opt_name);
    if (reps > 0)
        printf("%s: emulated µs per forward (not a performance figure): reference %.1f, %s %.1f\n", path,
               median[0], opt_name, median[1]);
    rc = 0;
done:
    if (ctx)
        colibri_free(ctx);
    free(image);
    free(in);
    free(arena);
    free(out);
    return rc;
}

int main(int argc, char **argv)
{
    int reps = 0, first = 1;
    const char *only = NULL;
    if (argc > 2 && strcmp(argv[1], "--time") == 0) {
        reps = atoi(argv[2]);
        first = 3;
        if (argc > 4 && strcmp(argv[3], "--only") == 0) {
            only = argv[4];
            first = 5;
        }
    }
    if (argc < first + 2) {
        fprintf(stderr, "usage: colibri_kernels_e2e [--time REPS [--only ref|opt]] EXPECTED_NAME IMAGE...\n");
        return 1;
    }
    int rc = 0;
    for (int i = first + 1; i < argc; i++)
        rc |= run_one(argv[first], argv[i], reps, only);
    return rc;
}
