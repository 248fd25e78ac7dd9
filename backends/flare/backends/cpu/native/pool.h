/* A persistent thread pool for the native CPU executor (pool.c).
 *
 * Why: the C kernels split their work across cores (matmul by output columns or rows,
 * norms and softmax by rows, elementwise by ranges). Creating threads per call costs
 * tens of microseconds, more than many of the kernels themselves, so the workers are
 * created once with the pool and wait between calls: they spin a short while (a next
 * command list usually follows within microseconds) and then sleep on a futex, so an
 * idle pool burns no CPU (the scheme of ggml's threadpool).
 *
 * Model: a *region* runs one function on every thread of the pool at once, the caller
 * being thread 0: fn(ctx, ith, nth). Inside a region, `flare_pool_barrier` waits for
 * all nth threads, so one region can walk a whole command list with a barrier between
 * dependent commands instead of a fork/join per command.
 *
 * Sharing: a pool runs one region at a time. `flare_pool_region` returns 0 without
 * running anything when another thread's region is in progress (the caller then runs
 * its work alone); `flare_pool_for` falls back the same way by itself. So one pool may
 * be shared by any number of threads, and a caller never waits for another's work.
 * A pool of one thread has no workers and takes no locks. In a process forked from the one that
 * made the pool (which has none of its workers) every call runs on the calling thread alone.
 * Workers block all signals, so signals reach the application's own threads.
 *
 * Splits are by output ranges only (`flare_split`), so every output element is computed
 * by the same code in the same order whatever the thread count: results do not change
 * with `threads`.
 */
#ifndef FLARE_POOL_H
#define FLARE_POOL_H

#include <stdint.h>

typedef struct flare_pool flare_pool;

/* Work over the index range [begin, end): rows, columns, panels... of one kernel. */
typedef void (*flare_task)(void *ctx, int64_t begin, int64_t end);
/* A region body, run by every thread: ith in [0, nth). */
typedef void (*flare_region_fn)(void *ctx, int ith, int nth);

/* A pool of `threads` threads in all (the caller counts as one, so threads - 1 workers
 * are started). NULL when threads < 1 or the workers cannot be created. */
flare_pool *flare_pool_new(int threads);
/* Stop and join the workers, free the pool. Not while a region runs. NULL is fine. */
void flare_pool_free(flare_pool *pool);
/* Threads of the pool, the caller included (1 for NULL). */
int flare_pool_threads(const flare_pool *pool);

/* Regions run on the pool's threads so far (a caller that found it busy ran alone: not counted). */
int64_t flare_pool_regions(const flare_pool *pool);

/* Run fn(ctx, ith, nth) on every thread (the caller is ith 0) and return when all are
 * done: 1. Returns 0 at once, having run nothing, when the pool is busy with another
 * caller's region (or pool is NULL or has one thread). */
int flare_pool_region(flare_pool *pool, flare_region_fn fn, void *ctx);
/* Inside a region: wait until all nth threads have arrived. */
void flare_pool_barrier(flare_pool *pool);
/* The same barrier, but a thread that has to wait sleeps at once instead of spinning first: for
 * the threads idle while thread 0 runs a long step alone (their spinning would take its core). */
void flare_pool_barrier_sleep(flare_pool *pool);

/* task(ctx, b, e) over [0, n) in contiguous chunks of at least `grain` indices (chunk
 * boundaries are multiples of grain), one chunk per thread, on the pool; on the calling
 * thread alone when n is small, the pool busy or NULL. Not inside a region. */
void flare_pool_for(flare_pool *pool, int64_t n, int64_t grain, flare_task task, void *ctx);

/* Thread ith's share [*begin, *end) of [0, n) split into nth contiguous parts whose
 * boundaries are multiples of grain (the last part takes the remainder; parts may be empty). */
void flare_split(int64_t n, int64_t grain, int ith, int nth, int64_t *begin, int64_t *end);

#endif
