/*
 * colibri_pool.c: the pthread pool behind colibri_pool.h.
 *
 * One loop at a time (call_mu). A loop publishes fn, arg and n_tasks under
 * mu and bumps the generation. Tasks are claimed in runs from `claim`, the
 * generation in its high 32 bits and the next task index in the low ones, by
 * compare-and-swap: a thread that arrives late, after its loop ended, finds
 * another generation there and claims nothing, so it never runs a stale fn.
 * The caller works as worker 0 and then waits only for the tasks (`done`
 * reaching n_tasks), never for threads that found no work: on a busy machine
 * a loop costs at most what the caller's own thread takes.
 *
 * A token model's decode opens some 40 loops per token, each of a few tens
 * of microseconds, back to back. Sleeping on a condition variable between
 * them costs a wake-up (a futex call, then the scheduler's latency) per loop
 * and per thread, and the sleeper misses the start of the loop. So a thread
 * that ran out of work first watches the generation for a while (spin_ns):
 * a pause between loads, sched_yield after the first part so that another
 * runnable thread on its core gets it, and only then sleeps on work_cv. The
 * caller waiting for the last task does the same on `done` before sleeping
 * on done_cv. The bound is what keeps a loaded machine usable: a thread
 * that found nothing to do gives its core back within spin_ns, and nothing
 * ever waits for a thread that has not claimed a task.
 *
 * Sleeping and waking never lose a wake-up: a thread sleeps only under mu
 * after seeing, under mu, the generation it already ran (the caller bumps it
 * under mu and broadcasts if anyone sleeps); the caller's `waiting` flag and
 * the last task's `done` increment are sequentially consistent, so either
 * the finishing thread sees the flag (and signals under mu) or the caller
 * sees the count and does not sleep.
 */
#define _POSIX_C_SOURCE 200809L
#include "colibri_pool.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

/* How long a thread out of work keeps watching for more before it sleeps,
 * and for how much of that it only pauses (afterwards it also yields). A
 * decode step's loops follow each other within microseconds; between steps
 * the caller samples a token (tens of microseconds on a 150 K vocabulary). */
#define POOL_SPIN_NS 200000L
#define POOL_PAUSE_NS 50000L

typedef struct pool_thread {
    colibri_pool *pool;
    size_t worker;
    pthread_t thread;
} pool_thread;

struct colibri_pool {
    pthread_mutex_t call_mu;     /* one parallel_for at a time */
    pthread_mutex_t mu;          /* guards fn, arg, n_tasks, sleepers; generation changes under it */
    pthread_cond_t work_cv;      /* a new generation, or stop */
    pthread_cond_t done_cv;      /* done reached n_tasks */
    atomic_uint generation;      /* read outside mu by the spinning threads */
    atomic_int stop;
    colibri_task_fn fn;
    void *arg;
    size_t n_tasks;
    size_t sleepers;             /* threads waiting on work_cv */
    atomic_int waiting;          /* the caller waits on done_cv */
    atomic_uint_fast64_t claim;  /* generation << 32 | next task */
    atomic_size_t done;          /* tasks of the current generation finished */
    size_t workers, started;
    pool_thread thread[];        /* [workers - 1] */
};

static void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield" ::: "memory");
#else
    atomic_signal_fence(memory_order_seq_cst);
#endif
}

/* mu is only ever held for a few loads and stores (cond_wait releases it),
 * but the thread that sees a new generation asks for it at the very moment
 * the caller, which just published it, still holds it: a plain lock would
 * then sleep in the kernel. So try a while first. */
static void lock_soon(pthread_mutex_t *mu)
{
    for (int i = 0; i < 256; i++) {
        if (pthread_mutex_trylock(mu) == 0)
            return;
        cpu_relax();
    }
    pthread_mutex_lock(mu);
}

static long elapsed_ns(const struct timespec *t0)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long)(t.tv_sec - t0->tv_sec) * 1000000000L + (t.tv_nsec - t0->tv_nsec);
}

/* Spins (bounded, see POOL_SPIN_NS) until ready(p, v) holds; returns whether it did. */
static int spin_until(colibri_pool *p, int (*ready)(colibri_pool *, uintptr_t), uintptr_t v)
{
    struct timespec t0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (;;) {
        for (int i = 0; i < 64; i++) {
            if (ready(p, v))
                return 1;
            cpu_relax();
        }
        const long ns = elapsed_ns(&t0);
        if (ns >= POOL_SPIN_NS)
            return ready(p, v);
        if (ns >= POOL_PAUSE_NS)
            sched_yield();
    }
}

static int new_generation(colibri_pool *p, uintptr_t seen)
{
    return atomic_load_explicit(&p->generation, memory_order_acquire) != (unsigned)seen ||
           atomic_load_explicit(&p->stop, memory_order_relaxed);
}

static int all_done(colibri_pool *p, uintptr_t n)
{
    return atomic_load_explicit(&p->done, memory_order_acquire) == (size_t)n;
}

/* Runs tasks of generation gen while there are any left; for the threads,
 * wakes the caller if it sleeps and this was the last task. A claim takes a
 * run of tasks, an ever smaller share of what is left (a 2·workers-th, at
 * least one): few claims, each a write to the shared line, while the last
 * runs stay single tasks, so a loop still ends within a task of balance. */
static void run_tasks(colibri_pool *p, uint32_t gen, colibri_task_fn fn, void *arg, size_t n, size_t worker)
{
    const size_t share = 2u * p->workers;
    uint_fast64_t v = atomic_load_explicit(&p->claim, memory_order_relaxed);
    for (;;) {
        const size_t first = (size_t)(v & 0xFFFFFFFFu);
        if ((uint32_t)(v >> 32) != gen || first >= n)
            return;
        const size_t run = (n - first) / share ? (n - first) / share : 1u;
        if (!atomic_compare_exchange_weak_explicit(&p->claim, &v, v + run, memory_order_relaxed,
                                                   memory_order_relaxed))
            continue;
        for (size_t t = first; t < first + run; t++)
            fn(arg, t, worker);
        if (atomic_fetch_add_explicit(&p->done, run, memory_order_seq_cst) + run == n && worker != 0 &&
            atomic_load_explicit(&p->waiting, memory_order_seq_cst)) {
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
    unsigned seen = 0;
    for (;;) {
        const int ready = spin_until(p, new_generation, seen);
        lock_soon(&p->mu);
        if (!ready) {
            p->sleepers++;
            while (!atomic_load_explicit(&p->stop, memory_order_relaxed) &&
                   atomic_load_explicit(&p->generation, memory_order_relaxed) == seen)
                pthread_cond_wait(&p->work_cv, &p->mu);
            p->sleepers--;
        }
        if (atomic_load_explicit(&p->stop, memory_order_relaxed)) {
            pthread_mutex_unlock(&p->mu);
            break;
        }
        seen = atomic_load_explicit(&p->generation, memory_order_relaxed);
        colibri_task_fn fn = p->fn;
        void *fa = p->arg;
        const size_t n = p->n_tasks;
        pthread_mutex_unlock(&p->mu);
        run_tasks(p, seen, fn, fa, n, self->worker);
    }
    return NULL;
}

static void stop_threads(colibri_pool *p)
{
    pthread_mutex_lock(&p->mu);
    atomic_store_explicit(&p->stop, 1, memory_order_relaxed);
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
    atomic_init(&p->generation, 0);
    atomic_init(&p->stop, 0);
    atomic_init(&p->waiting, 0);
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
    lock_soon(&p->mu);
    const uint32_t gen = atomic_load_explicit(&p->generation, memory_order_relaxed) + 1u;
    p->fn = fn;
    p->arg = arg;
    p->n_tasks = n_tasks;
    atomic_store_explicit(&p->done, 0, memory_order_relaxed);
    atomic_store_explicit(&p->claim, (uint_fast64_t)gen << 32, memory_order_release);
    atomic_store_explicit(&p->generation, gen, memory_order_release);
    if (p->sleepers)
        pthread_cond_broadcast(&p->work_cv);
    pthread_mutex_unlock(&p->mu);

    run_tasks(p, gen, fn, arg, n_tasks, 0);

    if (!spin_until(p, all_done, n_tasks)) {
        pthread_mutex_lock(&p->mu);
        atomic_store_explicit(&p->waiting, 1, memory_order_seq_cst);
        while (atomic_load_explicit(&p->done, memory_order_seq_cst) != n_tasks)
            pthread_cond_wait(&p->done_cv, &p->mu);
        atomic_store_explicit(&p->waiting, 0, memory_order_relaxed);
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
