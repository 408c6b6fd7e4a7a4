/*
 * colibri_threads NTHREADS ITERS IMAGE...
 *
 * Proves contexts are independent: computes each image's output
 * single-threaded (batch max_batch, input[i] = sinf(0.37f * i)), then runs
 * NTHREADS threads at once, thread i on image i % n_images with its own arena
 * and context, ITERS forwards each, every output compared bit for bit with
 * the reference. Prints "threads ok" and exits 0, or reports and exits 1.
 * Built with ThreadSanitizer in the tsan variant.
 */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "colibri.h"
#include "colibri_common.h"

typedef struct model {
    const char *path;
    void *image;
    size_t len;
    colibri_model_info info;
    float *input;      /* [max_batch, input_size] */
    float *reference;  /* [max_batch, output_size] */
} model;

typedef struct job {
    const model *m;
    long iters;
    int failed;        /* written by the thread, read after join */
} job;

static size_t in_count(const model *m) { return (size_t)m->info.max_batch * m->info.input_size; }
static size_t out_count(const model *m) { return (size_t)m->info.max_batch * m->info.output_size; }

/* One context on its own arena; ITERS forwards compared with the reference. */
static void *run(void *arg)
{
    job *j = arg;
    const model *m = j->m;
    void *arena = malloc(m->info.arena_size);
    float *out = malloc(out_count(m) * sizeof *out);
    colibri_ctx *ctx;
    j->failed = 1;
    if (!arena || !out || colibri_init(&ctx, arena, m->info.arena_size, m->image, m->len) != COLIBRI_OK)
        goto done;
    for (long i = 0; i < j->iters; i++) {
        if (colibri_forward(ctx, m->info.max_batch, m->input, in_count(m), out, out_count(m)) != COLIBRI_OK ||
            memcmp(out, m->reference, out_count(m) * sizeof *out) != 0)
            goto done;
    }
    j->failed = colibri_free(ctx) != COLIBRI_OK;
done:
    free(out);
    free(arena);
    return NULL;
}

static int load(model *m, const char *path)
{
    colibri_status st;
    m->path = path;
    if (!(m->image = read_file(path, &m->len))) {
        fprintf(stderr, "colibri_threads: cannot read %s\n", path);
        return 0;
    }
    if ((st = colibri_get_info(m->image, m->len, &m->info)) != COLIBRI_OK) {
        fprintf(stderr, "colibri_threads: %s: %s\n", path, colibri_strerror(st));
        return 0;
    }
    m->input = malloc(in_count(m) * sizeof *m->input);
    m->reference = malloc(out_count(m) * sizeof *m->reference);
    void *arena = malloc(m->info.arena_size);
    colibri_ctx *ctx;
    if (!m->input || !m->reference || !arena) {
        fprintf(stderr, "colibri_threads: out of memory\n");
        return 0;
    }
    for (size_t i = 0; i < in_count(m); i++)
        m->input[i] = sinf(0.37f * (float)i);
    if ((st = colibri_init(&ctx, arena, m->info.arena_size, m->image, m->len)) != COLIBRI_OK ||
        (st = colibri_forward(ctx, m->info.max_batch, m->input, in_count(m), m->reference, out_count(m))) != COLIBRI_OK) {
        fprintf(stderr, "colibri_threads: %s: %s\n", path, colibri_strerror(st));
        return 0;
    }
    colibri_free(ctx);
    free(arena);
    return 1;
}

int main(int argc, char **argv)
{
    if (argc < 4) {
        fprintf(stderr, "usage: colibri_threads NTHREADS ITERS IMAGE...\n");
        return 1;
    }
    const int n_threads = atoi(argv[1]);
    const long iters = atol(argv[2]);
    const int n_models = argc - 3;
    if (n_threads < 1 || iters < 1) {
        fprintf(stderr, "colibri_threads: NTHREADS and ITERS must be >= 1\n");
        return 1;
    }
    model *models = calloc((size_t)n_models, sizeof *models);
    job *jobs = calloc((size_t)n_threads, sizeof *jobs);
    pthread_t *threads = calloc((size_t)n_threads, sizeof *threads);
    if (!models || !jobs || !threads)
        return 1;
    for (int i = 0; i < n_models; i++)
        if (!load(&models[i], argv[3 + i]))
            return 1;

    for (int i = 0; i < n_threads; i++) {
        jobs[i] = (job){&models[i % n_models], iters, 0};
        if (pthread_create(&threads[i], NULL, run, &jobs[i]) != 0) {
            fprintf(stderr, "colibri_threads: cannot start thread %d\n", i);
            return 1;
        }
    }
    int failed = 0;
    for (int i = 0; i < n_threads; i++) {
        pthread_join(threads[i], NULL);
        if (jobs[i].failed) {
            fprintf(stderr, "colibri_threads: thread %d (%s): output differs from the reference\n",
                    i, jobs[i].m->path);
            failed = 1;
        }
    }
    for (int i = 0; i < n_models; i++) {
        free(models[i].image);
        free(models[i].input);
        free(models[i].reference);
    }
    free(models);
    free(jobs);
    free(threads);
    if (failed)
        return 1;
    printf("threads ok\n");
    return 0;
}
