/* What the native pool costs per parallel region and per hand-over, at 2 threads (issue 24).
 *
 * Why: moe-lm mid's decode step is ~35-50 us of native work in ~60 commands, of which only a
 * few are big enough to split; whether a second thread can pay depends on what a region (wake
 * the worker, run, wait for it to leave) and each step hand-over inside one (the last chunk's
 * thread publishes the next step; the other sees it) cost against the work they share. This
 * times, on the real pool (native/pool.c, compiled in):
 *   region  flare_pool_for over 2 empty chunks: one region, no work;
 *   steps   one region of S steps of 2 chunks of W us of spinning each, claimed from one atomic counter as
 *           kernels.c's walk does (the last chunk of a step opens the next): cost per step;
 *   alone   the same S steps on the caller alone (no pool): their 2x more work, no hand-over;
 *           alone/pool is what a second thread gives such a region (2.0 would be perfect).
 * Medians of 20 rounds of 2000 repetitions; gaps between regions (Python's part of a step)
 * are simulated by a spin of G us, since a worker that waited past SPIN_ROUNDS sleeps and its
 * wake-up is a futex call.
 *
 * Gaps (us) may be given as arguments (default 0 20 150).
 *
 *   cc -O2 -pthread -I backends/flare/backends/cpu/native bench/pool_overhead.c \
 *      backends/flare/backends/cpu/native/pool.c -o /tmp/pool_overhead && /tmp/pool_overhead
 */
#define _GNU_SOURCE
#include "pool.h"

#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
static void spin_us(double us) { double end = now() + us * 1e-6; while (now() < end) {} }
static void empty_task(void *ctx, int64_t b, int64_t e) { (void)ctx; (void)b; (void)e; }

typedef struct { int steps, chunks; double work_us; atomic_int word; atomic_int sleepers; _Atomic int64_t next; _Atomic int64_t done; } steps_ctx;

/* walk-like: a shared counter of claimed chunks over all steps; a thread that claims a chunk of a
 * step not yet open waits for it (the step word), whoever finishes a step's last chunk opens the next. */
static void steps_body(void *arg, int ith, int nth) {
    (void)ith; (void)nth;
    steps_ctx *c = arg;
    const int64_t total = (int64_t)c->steps * c->chunks;
    for (int64_t k = atomic_fetch_add(&c->next, 1); k < total; k = atomic_fetch_add(&c->next, 1)) {
        const int step = (int)(k / c->chunks);
        flare_await_step(&c->word, step, &c->sleepers, 1);
        if (c->work_us > 0) spin_us(c->work_us);
        if (atomic_fetch_add(&c->done, 1) + 1 == (int64_t)(step + 1) * c->chunks)
            flare_publish_step(&c->word, step + 1, &c->sleepers);
    }
}

enum { REGION, STEPS, ALONE };

/* Seconds per repetition of one kind of region (the list above), each after a gap of `gap_us`. */
static double per_rep(flare_pool *pool, int kind, int reps, double gap_us, int steps, double work_us) {
    double t = 0;
    for (int i = 0; i < reps; ++i) {
        steps_ctx c = {steps, 2, work_us, 0, 0, 0, 0};
        spin_us(gap_us);
        double s = now();
        if (kind == REGION) flare_pool_for(pool, 2, 1, empty_task, NULL);
        else if (kind == ALONE || !flare_pool_run(pool, steps_body, &c)) steps_body(&c, 0, 1);
        t += now() - s;
    }
    return t / reps;
}

static int cmp(const void *a, const void *b) { double x = *(const double *)a, y = *(const double *)b; return (x > y) - (x < y); }

static double median_us(double *v, int n) { qsort(v, n, sizeof *v, cmp); return v[n / 2] * 1e6; }

int main(int argc, char **argv) {
    const int rounds = 20, reps = 2000, S = 8;
    const double W = 2.0;   /* us of work per chunk: 2 chunks a step, 4 us of work a step */
    double gaps[16] = {0, 20, 150};
    int ngaps = 3;
    if (argc > 1) for (ngaps = 0; ngaps < argc - 1 && ngaps < 16; ++ngaps) gaps[ngaps] = atof(argv[ngaps + 1]);
    flare_pool *pool = flare_pool_new(2);
    for (int g = 0; g < ngaps; ++g) {
        double region[20], steps[20], alone[20];
        for (int r = 0; r < rounds; ++r) {
            region[r] = per_rep(pool, REGION, reps, gaps[g], S, W);
            steps[r] = per_rep(pool, STEPS, reps, gaps[g], S, W);
            alone[r] = per_rep(pool, ALONE, reps, gaps[g], S, W);
        }
        double reg = median_us(region, rounds), st = median_us(steps, rounds), al = median_us(alone, rounds);
        printf("gap %3.0f us: empty region %.2f us | %d steps of 2 x %.0f us chunks: pool %.2f us, alone %.2f us "
               "(2t/1t %.2f; ideal %.2f)\n", gaps[g], reg, S, W, st, al, al / st, al / (S * W));
    }
    flare_pool_free(pool);
    return 0;
}
