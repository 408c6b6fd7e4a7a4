/*
 * colibri_pool.c: the pthread pool behind colibri_pool.h.
 *
 * One loop at a time (call_mu). A loop publishes fn, arg and n_tasks under
 * mu, bumps the generation and wakes the threads. Tasks are claimed from
 * `claim`, the generation in its high 32 bits and the next task index in the
 * low ones, by compare-and-swap: a thread that wakes late, after its loop
 * ended, finds another generation there and claims nothing, so it never runs
 * a stale fn. The caller works as worker 0 and then waits only for the tasks
 * (`done` reaching n_tasks), never for threads that found no work: on a busy
 * machine a loop costs at most what the caller's own thread takes. The thread
 * finishing the last task signals under mu, which also orders every task's
 * writes before parallel_for returns.
 */
#define _POSIX_C_SOURCE 200809L
#include "colibri_pool.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>

typedef struct pool_thread {
    colibri_pool *pool;
    size_t worker;
    pthread_t thread;
} pool_thread;

struct colibri_pool {
    pthread_mutex_t call_mu;     /* one parallel_for at a time */
    pthread_mutex_t mu;          /* guards generation, stop, fn, arg, n_tasks */
    pthread_cond_t work_cv;      /* a new generation, or stop */
    pthread_cond_t done_cv;      /* done reached n_tasks */
    uint32_t generation;
    int stop;
    colibri_task_fn fn;
    void *arg;
    size_t n_tasks;
    atomic_uint_fast64_t claim;  /* generation << 32 | next task */
    atomic_size_t done;          /* tasks of the current generation finished */
    size_t workers, started;
    pool_thread thread[];        /* [workers - 1] */
};

/* Runs tasks of generation gen while there are any left; for the threads,
 * signals the caller when it finished the last one. */
static void run_tasks(colibri_pool *p, uint32_t gen, colibri_task_fn fn, void *arg, size_t n, size_t worker)
{
    uint_fast64_t v = atomic_load_explicit(&p->claim, memory_order_relaxed);
    for (;;) {
        if ((uint32_t)(v >> 32) != gen || (v & 0xFFFFFFFFu) >= n)
            return;
        if (!atomic_compare_exchange_weak_explicit(&p->claim, &v, v + 1, memory_order_relaxed,
                                                   memory_order_relaxed))
            continue;
        fn(arg, (size_t)(v & 0xFFFFFFFFu), worker);
        if (atomic_fetch_add_explicit(&p->done, 1, memory_order_acq_rel) + 1 == n && worker != 0) {
            pthread_mutex_lock(&p->mu);
            pthread_cond_signal(&p->done_cv);
            pthread_mutex_unlock(&p->mu);
        }
        v = atomic_load_explicit(&p->claim, memory_order_relaxed);
    }
}

static void *thread_main(void *arg)
{
    pool_thread *self = arg;
    colibri_pool *p = self->pool;
    uint32_t seen = 0;
    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (!p->stop && p->generation == seen)
            pthread_cond_wait(&p->work_cv, &p->mu);
        if (p->stop)
            break;
        seen = p->generation;
        colibri_task_fn fn = p->fn;
        void *fa = p->arg;
        const size_t n = p->n_tasks;
        pthread_mutex_unlock(&p->mu);
        run_tasks(p, seen, fn, fa, n, self->worker);
        pthread_mutex_lock(&p->mu);
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

static void stop_threads(colibri_pool *p)
{
    pthread_mutex_lock(&p->mu);
    p->stop = 1;
    pthread_cond_broadcast(&p->work_cv);
    pthread_mutex_unlock(&p->mu);
    for (size_t i = 0; i < p->started; i++)
        pthread_join(p->thread[i].thread, NULL);
}

colibri_status colibri_pool_create(colibri_pool **out, size_t workers)
{
    if (!out)
        return COLIBRI_E_NULL_ARG;
    *out = NULL;
    if (workers < 1 || workers > COLIBRI_POOL_MAX_WORKERS)
        return COLIBRI_E_BAD_EXEC;
    colibri_pool *p = calloc(1, sizeof *p + (workers - 1) * sizeof(pool_thread));
    if (!p)
        return COLIBRI_E_UNSUPPORTED;
    p->workers = workers;
    atomic_init(&p->claim, 0);
    atomic_init(&p->done, 0);
    int ok = pthread_mutex_init(&p->call_mu, NULL) == 0;
    ok = ok && pthread_mutex_init(&p->mu, NULL) == 0;
    ok = ok && pthread_cond_init(&p->work_cv, NULL) == 0;
    ok = ok && pthread_cond_init(&p->done_cv, NULL) == 0;
    for (size_t i = 0; ok && i + 1 < workers; i++) {
        p->thread[i].pool = p;
        p->thread[i].worker = i + 1;
        ok = pthread_create(&p->thread[i].thread, NULL, thread_main, &p->thread[i]) == 0;
        if (ok)
            p->started++;
    }
    if (!ok) {
        colibri_pool_destroy(p);
        return COLIBRI_E_UNSUPPORTED;
    }
    *out = p;
    return COLIBRI_OK;
}

void colibri_pool_destroy(colibri_pool *p)
{
    if (!p)
        return;
    stop_threads(p);
    pthread_cond_destroy(&p->done_cv);
    pthread_cond_destroy(&p->work_cv);
    pthread_mutex_destroy(&p->mu);
    pthread_mutex_destroy(&p->call_mu);
    free(p);
}

size_t colibri_pool_workers(const colibri_pool *p)
{
    return p ? p->workers : 0;
}

colibri_status colibri_pool_parallel_for(void *user, colibri_task_fn fn, void *arg, size_t n_tasks)
{
    colibri_pool *p = user;
    if (!p || !fn)
        return COLIBRI_E_NULL_ARG;
    if (n_tasks == 0)
        return COLIBRI_OK;
    if (n_tasks > 0xFFFFFFFFu)
        return COLIBRI_E_UNSUPPORTED;
    pthread_mutex_lock(&p->call_mu);
    if (p->workers == 1 || n_tasks == 1) {
        for (size_t t = 0; t < n_tasks; t++)
            fn(arg, t, 0);
        pthread_mutex_unlock(&p->call_mu);
        return COLIBRI_OK;
    }
    pthread_mutex_lock(&p->mu);
    const uint32_t gen = ++p->generation;
    p->fn = fn;
    p->arg = arg;
    p->n_tasks = n_tasks;
    atomic_store_explicit(&p->done, 0, memory_order_relaxed);
    atomic_store_explicit(&p->claim, (uint_fast64_t)gen << 32, memory_order_release);
    pthread_cond_broadcast(&p->work_cv);
    pthread_mutex_unlock(&p->mu);

    run_tasks(p, gen, fn, arg, n_tasks, 0);

    if (atomic_load_explicit(&p->done, memory_order_acquire) != n_tasks) {
        pthread_mutex_lock(&p->mu);
        while (atomic_load_explicit(&p->done, memory_order_acquire) != n_tasks)
            pthread_cond_wait(&p->done_cv, &p->mu);
        pthread_mutex_unlock(&p->mu);
    }
    pthread_mutex_unlock(&p->call_mu);
    return COLIBRI_OK;
}

void colibri_pool_attach(colibri_pool *p, colibri_exec *exec)
{
    if (!exec)
        return;
    exec->parallel_for = p ? colibri_pool_parallel_for : NULL;
    exec->parallel_for_user = p;
    exec->workers = (uint32_t)colibri_pool_workers(p);
}
