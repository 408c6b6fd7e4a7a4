/*
 * colibri_pool.c: the pthread pool behind colibri_pool.h.
 *
 * One loop at a time (call_mu). A loop publishes fn, arg and n_tasks under mu,
 * bumps the generation and wakes the threads; every worker, the caller
 * included, takes task indices from the atomic counter `next` until they run
 * out; the caller then waits until every thread has reported the generation
 * done, so all tasks' writes happen before parallel_for returns (the mutex
 * hand-off orders them).
 */
#define _POSIX_C_SOURCE 200809L
#include "colibri_pool.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>

typedef struct pool_thread {
    colibri_pool *pool;
    size_t worker;
    pthread_t thread;
} pool_thread;

struct colibri_pool {
    pthread_mutex_t call_mu;     /* one parallel_for at a time */
    pthread_mutex_t mu;          /* guards the fields below */
    pthread_cond_t work_cv;      /* a new generation, or stop */
    pthread_cond_t done_cv;      /* busy reached 0 */
    unsigned long generation;
    size_t busy;                 /* threads still in the current generation */
    int stop;
    colibri_task_fn fn;
    void *arg;
    size_t n_tasks;
    atomic_size_t next;          /* next task index to hand out */
    size_t workers, started;
    pool_thread thread[];        /* [workers - 1] */
};

static void run_tasks(colibri_pool *p, colibri_task_fn fn, void *arg, size_t n, size_t worker)
{
    for (;;) {
        const size_t t = atomic_fetch_add_explicit(&p->next, 1, memory_order_relaxed);
        if (t >= n)
            return;
        fn(arg, t, worker);
    }
}

static void *thread_main(void *arg)
{
    pool_thread *self = arg;
    colibri_pool *p = self->pool;
    unsigned long seen = 0;
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
        run_tasks(p, fn, fa, n, self->worker);
        pthread_mutex_lock(&p->mu);
        if (--p->busy == 0)
            pthread_cond_signal(&p->done_cv);
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
    atomic_init(&p->next, 0);
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
    pthread_mutex_lock(&p->call_mu);
    if (p->workers == 1 || n_tasks == 1) {
        for (size_t t = 0; t < n_tasks; t++)
            fn(arg, t, 0);
        pthread_mutex_unlock(&p->call_mu);
        return COLIBRI_OK;
    }
    pthread_mutex_lock(&p->mu);
    p->fn = fn;
    p->arg = arg;
    p->n_tasks = n_tasks;
    atomic_store_explicit(&p->next, 0, memory_order_relaxed);
    p->busy = p->workers - 1;
    p->generation++;
    pthread_cond_broadcast(&p->work_cv);
    pthread_mutex_unlock(&p->mu);

    run_tasks(p, fn, arg, n_tasks, 0);

    pthread_mutex_lock(&p->mu);
    while (p->busy)
        pthread_cond_wait(&p->done_cv, &p->mu);
    pthread_mutex_unlock(&p->mu);
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
