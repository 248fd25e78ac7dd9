/* A persistent thread pool for the native CPU executor (pool.c).
 *
 * Why: the C kernels split their work across cores (matmul by output columns or rows,
 * norms and softmax by rows, elementwise by ranges). Creating threads per call costs
 * tens of microseconds, more than many of the kernels themselves, so the workers are
 * created once with the pool and wait between calls: they spin a short while (a next
 * command list usually follows within microseconds) and then sleep on a futex, so an
 * idle pool burns no CPU (the scheme of ggml's threadpool).
 *
 * Model: a *region* runs fn(ctx, ith, nth) on the caller (ith 0) and on every worker that
 * gets to it before the caller's own fn returns. There are no barriers: a worker the OS has
 * not scheduled (a loaded machine, more threads than cores) is simply not waited for. So fn
 * must finish the whole job on whichever threads take part: work is cut into chunks claimed
 * from shared counters, and a thread waits only for chunks that another thread has claimed
 * and is running (`flare_await_step` / `flare_publish_step`). The executor's command lists
 * run this way (kernels.c, walk); `flare_pool_for` is the simple case.
 *
 * Sharing: a pool runs one region at a time. `flare_pool_run` returns 0 without running
 * anything when another thread's region is in progress (the caller then runs its work alone);
 * `flare_pool_for` falls back the same way by itself. So one pool may be shared by any number
 * of threads, and a caller never waits for another's work. A pool of one thread has no
 * workers and takes no locks. In a process forked from the one that made the pool (which has
 * none of its workers) every call runs on the calling thread alone. Workers block all
 * signals, so signals reach the application's own threads.
 *
 * Splits are by output ranges only, at fixed boundaries, so every output element is computed
 * by the same code in the same order whatever the thread count and whoever runs which chunk:
 * results do not change with `threads`.
 */
#ifndef FLARE_POOL_H
#define FLARE_POOL_H

#include <stdatomic.h>
#include <stdint.h>

typedef struct flare_pool flare_pool;

/* Work over the index range [begin, end): rows, columns, panels... of one kernel. */
typedef void (*flare_task)(void *ctx, int64_t begin, int64_t end);
/* A region body: ith in [0, nth) (the caller is 0). */
typedef void (*flare_region_fn)(void *ctx, int ith, int nth);

/* A pool of `threads` threads in all (the caller counts as one, so threads - 1 workers
 * are started). NULL when threads < 1 or the workers cannot be created. */
flare_pool *flare_pool_new(int threads);
/* Stop and join the workers, free the pool. Not while a region runs. NULL is fine. */
void flare_pool_free(flare_pool *pool);
/* Threads of the pool, the caller included (1 for NULL). */
int flare_pool_threads(const flare_pool *pool);
/* Regions run on the pool so far (a caller that found it busy ran alone: not counted). */
int64_t flare_pool_regions(const flare_pool *pool);

/* Run fn(ctx, ith, nth) on the caller and on the workers that join in time (see above);
 * returns 1 once every worker that joined has left. Returns 0 at once, having run nothing,
 * when the pool is busy with another caller's region, NULL, of one thread, or forked. */
int flare_pool_run(flare_pool *pool, flare_region_fn fn, void *ctx);

/* For region bodies: wait (spin, then sleep; spin = 0: sleep at once) until *word >= below;
 * publish a new value of *word and wake its sleepers (`sleepers` counts them). */
void flare_await_step(atomic_int *word, int below, atomic_int *sleepers, int spin);
void flare_publish_step(atomic_int *word, int value, atomic_int *sleepers);

/* task(ctx, b, e) over [0, n) in chunks whose boundaries are multiples of `grain` (up to 4 per
 * thread, claimed by the threads that take part), on the pool; on the calling thread alone,
 * as one task(ctx, 0, n), when n fits one grain or the pool cannot run it (see flare_pool_run).
 * Not from inside a region. */
void flare_pool_for(flare_pool *pool, int64_t n, int64_t grain, flare_task task, void *ctx);

/* Thread ith's share [*begin, *end) of [0, n) split into nth contiguous parts whose
 * boundaries are multiples of grain (the last part takes the remainder; parts may be empty). */
void flare_split(int64_t n, int64_t grain, int ith, int nth, int64_t *begin, int64_t *end);

#endif
