/*
 * exec_bench IMAGE SECONDS WORKERS BATCH...
 *
 * Parallel experts (colibri_forward_ex over posix/colibri_pool) against
 * single-threaded colibri_forward, on one image, for each BATCH. The two are
 * timed in alternating rounds of about 20 ms each (so a change in the machine's
 * load hits both alike) for about SECONDS per batch; every output of the
 * parallel pass is checked bit for bit against the single-threaded one. One
 * line of JSON per batch: {"batch", "workers", "us_1", "us_n": median
 * microseconds per call single-threaded and with WORKERS workers, "best_1",
 * "best_n": the fastest round's, "cpus_n": CPUs the process got in the
 * parallel rounds (its CPU time over wall time: near 1 means no second core
 * was free), "rounds"}.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "colibri.h"
#include "colibri_pool.h"
#include "../tests/c/colibri_common.h"

#define MAX_ROUNDS 4096

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static double cpu(void)
{
    struct timespec t;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static int cmp(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median(double *v, size_t n)
{
    qsort(v, n, sizeof *v, cmp);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

int main(int argc, char **argv)
{
    if (argc < 5) {
        fprintf(stderr, "usage: exec_bench IMAGE SECONDS WORKERS BATCH...\n");
        return 2;
    }
    size_t len;
    void *image = read_file(argv[1], &len);
    const double seconds = atof(argv[2]);
    const size_t workers = (size_t)atoi(argv[3]);
    colibri_model_info info;
    size_t need;
    colibri_pool *pool;
    colibri_ctx *ctx;
    if (!image || colibri_get_info(image, len, &info) != COLIBRI_OK ||
        colibri_model_size_ex(image, len, workers, &need) != COLIBRI_OK ||
        colibri_pool_create(&pool, workers) != COLIBRI_OK) {
        fprintf(stderr, "exec_bench: cannot load %s or make a pool of %zu\n", argv[1], workers);
        return 1;
    }
    void *arena = aligned_alloc(8, (need + 7) & ~(size_t)7);
    if (!arena || colibri_init(&ctx, arena, need, image, len) != COLIBRI_OK)
        return 1;
    colibri_exec exec = COLIBRI_EXEC_INIT;
    colibri_pool_attach(pool, &exec);

    for (int a = 4; a < argc; a++) {
        const size_t batch = (size_t)atoi(argv[a]);
        const size_t ni = batch * info.input_size, no = batch * info.output_size;
        float *in = malloc(ni * sizeof *in), *o1 = malloc(no * sizeof *o1), *on = malloc(no * sizeof *on);
        for (size_t i = 0; i < ni; i++)
            in[i] = (float)((i * 2654435761u) % 2001u) / 1000.0f - 1.0f;
        if (colibri_forward(ctx, batch, in, ni, o1, no) != COLIBRI_OK ||
            colibri_forward_ex(ctx, &exec, batch, in, ni, on, no) != COLIBRI_OK || memcmp(o1, on, no * sizeof *on)) {
            fprintf(stderr, "exec_bench: batch %zu: parallel output differs or fails\n", batch);
            return 1;
        }
        /* Calls per round: about 20 ms of single-threaded work. */
        double t0 = now();
        size_t calls = 0;
        while (now() - t0 < 0.02)
            colibri_forward(ctx, batch, in, ni, o1, no), calls++;
        static double t1s[MAX_ROUNDS], tns[MAX_ROUNDS];
        size_t rounds = 0;
        double wall_n = 0, cpu_n = 0; /* the parallel rounds: wall time, and this process's CPU time */
        const double end = now() + seconds;
        while (rounds < MAX_ROUNDS && (rounds < 6 || now() < end)) {
            t0 = now();
            for (size_t c = 0; c < calls; c++)
                colibri_forward(ctx, batch, in, ni, o1, no);
            const double t1 = now(), c1 = cpu();
            for (size_t c = 0; c < calls; c++)
                colibri_forward_ex(ctx, &exec, batch, in, ni, on, no);
            const double t2 = now();
            cpu_n += cpu() - c1;
            wall_n += t2 - t1;
            t1s[rounds] = (t1 - t0) / (double)calls * 1e6;
            tns[rounds++] = (t2 - t1) / (double)calls * 1e6;
        }
        if (memcmp(o1, on, no * sizeof *on)) {
            fprintf(stderr, "exec_bench: batch %zu: parallel output differs\n", batch);
            return 1;
        }
        const double m1 = median(t1s, rounds), mn = median(tns, rounds); /* sorts: [0] is the best round */
        printf("{\"batch\": %zu, \"workers\": %zu, \"us_1\": %.2f, \"us_n\": %.2f, \"best_1\": %.2f, "
               "\"best_n\": %.2f, \"cpus_n\": %.2f, \"rounds\": %zu, \"kernels\": \"%s\"}\n",
               batch, workers, m1, mn, t1s[0], tns[0], cpu_n / wall_n, rounds, colibri_kernels_name(ctx));
        fflush(stdout);
        free(in);
        free(o1);
        free(on);
    }
    colibri_free(ctx);
    colibri_pool_destroy(pool);
    free(arena);
    free(image);
    return 0;
}
