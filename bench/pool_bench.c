/*
 * pool_bench: what one parallel loop of posix/colibri_pool costs the caller, the hand-off alone
 * (`make bench-pool`, docs/threading.md "The pool"). A token model's decode opens some 40 loops a
 * token, each of tens of microseconds of work; this times loops of TASKS tasks that each spin for
 * WORK_NS, back to back as decode issues them, and prints the wall time a loop takes beyond its
 * work divided over the workers, the median and the best of ROUNDS batches.
 *
 *   pool_bench WORKERS TASKS WORK_NS LOOPS ROUNDS
 */
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "colibri_pool.h"

static double now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e9 + (double)t.tv_nsec;
}

typedef struct work {
    double ns;
    atomic_uint_fast64_t ran;
} work;

/* Busy work of about ns on the calling thread (a clock loop, like a kernel holding its core). */
static void task(void *arg, size_t t, size_t worker)
{
    work *w = arg;
    (void)t;
    (void)worker;
    const double end = now_ns() + w->ns;
    while (now_ns() < end)
        ;
    atomic_fetch_add_explicit(&w->ran, 1, memory_order_relaxed);
}

static int cmp(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv)
{
    if (argc != 6) {
        fprintf(stderr, "usage: pool_bench WORKERS TASKS WORK_NS LOOPS ROUNDS\n");
        return 2;
    }
    const size_t workers = strtoul(argv[1], NULL, 10), tasks = strtoul(argv[2], NULL, 10);
    const double work_ns = strtod(argv[3], NULL);
    const long loops = strtol(argv[4], NULL, 10), rounds = strtol(argv[5], NULL, 10);
    if (workers < 1 || tasks < 1 || loops < 1 || rounds < 1 || rounds > 1000) {
        fprintf(stderr, "pool_bench: WORKERS, TASKS, LOOPS and ROUNDS (<= 1000) must be positive\n");
        return 2;
    }
    colibri_pool *pool;
    if (colibri_pool_create(&pool, workers) != COLIBRI_OK) {
        fprintf(stderr, "pool_bench: no pool\n");
        return 1;
    }
    work w = {work_ns, 0};
    double over[1000];
    for (long r = -1; r < rounds; r++) {
        const double t0 = now_ns();
        for (long i = 0; i < loops; i++)
            if (colibri_pool_parallel_for(pool, task, &w, tasks) != COLIBRI_OK)
                return 1;
        const double per = (now_ns() - t0) / (double)loops;
        const double ideal = work_ns * (double)((tasks + workers - 1) / workers);
        if (r >= 0)
            over[r] = per - ideal;
    }
    if (atomic_load(&w.ran) != (uint_fast64_t)(tasks * (size_t)loops * (size_t)(rounds + 1))) {
        fprintf(stderr, "pool_bench: tasks lost\n");
        return 1;
    }
    qsort(over, (size_t)rounds, sizeof *over, cmp);
    printf("{\"workers\": %zu, \"tasks\": %zu, \"work_ns\": %.0f, \"overhead_us_median\": %.3f, "
           "\"overhead_us_best\": %.3f}\n",
           workers, tasks, work_ns, over[rounds / 2] * 1e-3, over[0] * 1e-3);
    colibri_pool_destroy(pool);
    return 0;
}
