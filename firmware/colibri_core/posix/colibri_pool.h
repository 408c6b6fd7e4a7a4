/*
 * colibri_pool: a small pthread pool implementing colibri_exec's
 * parallel_for (POSIX layer, outside the core; part of libcolibri on Linux).
 *
 *   colibri_pool *pool;
 *   colibri_pool_create(&pool, 2);                 // the caller + 1 thread
 *   size_t need;
 *   colibri_model_size_ex(image, len, colibri_pool_workers(pool), &need);
 *   ... colibri_init(&ctx, arena, need, image, len);
 *   colibri_exec exec = COLIBRI_EXEC_INIT;
 *   colibri_pool_attach(pool, &exec);              // parallel_for, its user, workers
 *   colibri_forward_ex(ctx, &exec, batch, in, n_in, out, n_out);
 *   colibri_pool_destroy(pool);
 *
 * The thread calling parallel_for is worker 0 and works too; workers - 1
 * threads watch for the next call for up to 200 us after each (pausing, then
 * yielding their core), then sleep on a condition variable. Tasks are handed
 * out in shrinking runs from a shared counter, and the caller waits only for
 * tasks that were claimed, never for a thread that is late. Calls from several threads on one
 * pool are serialised (one loop at a time), so contexts in different threads
 * may share a pool; a task must not call parallel_for on its own pool.
 */
#ifndef COLIBRI_POOL_H
#define COLIBRI_POOL_H

#include <stddef.h>

#include "colibri.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct colibri_pool colibri_pool;

/* A pool of `workers` workers (1 .. COLIBRI_POOL_MAX_WORKERS): starts
 * workers - 1 threads. COLIBRI_E_NULL_ARG, COLIBRI_E_BAD_EXEC for a worker
 * count out of range, COLIBRI_E_UNSUPPORTED if memory or a thread could not
 * be had (nothing is left running then). */
#define COLIBRI_POOL_MAX_WORKERS 256u
COLIBRI_API colibri_status colibri_pool_create(colibri_pool **pool, size_t workers);

/* Stops and joins the threads and frees the pool; NULL is a no-op. */
COLIBRI_API void colibri_pool_destroy(colibri_pool *pool);

/* The pool's workers (the caller's thread included); 0 for NULL. */
COLIBRI_API size_t colibri_pool_workers(const colibri_pool *pool);

/* colibri_parallel_for_fn over the pool passed as user. */
COLIBRI_API colibri_status colibri_pool_parallel_for(void *pool, colibri_task_fn fn, void *arg, size_t n_tasks);

/* Sets exec's parallel_for, parallel_for_user and workers to this pool. */
COLIBRI_API void colibri_pool_attach(colibri_pool *pool, colibri_exec *exec);

#ifdef __cplusplus
}
#endif

#endif /* COLIBRI_POOL_H */
