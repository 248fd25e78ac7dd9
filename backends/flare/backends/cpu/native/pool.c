/* The persistent thread pool of the native CPU executor; the API and its rules are in pool.h.
 *
 * Workers wait for a new *generation* (one per region), then check in to the region unless its
 * caller has closed it already; the caller, done with the work, closes the region and waits for
 * those checked in to leave. Every wait spins for SPIN_ROUNDS pause instructions first (tens of
 * microseconds: the next region or step usually comes sooner, and a futex round trip costs several
 * microseconds) and then sleeps on a futex, counted in `sleepers` so the waker only makes the
 * system call when someone sleeps. Wake-ups cannot be lost: a sleeper increments `sleepers`
 * before the futex re-checks the value, and the waker changes the value before it reads
 * `sleepers` (both sequentially consistent).
 */
#define _GNU_SOURCE
#include "pool.h"

#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <unistd.h>
#include <stdlib.h>
#include <limits.h>
#include <sched.h>

#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
static void wait_while_equal(atomic_int *addr, int value) {
    syscall(SYS_futex, (int *)addr, FUTEX_WAIT_PRIVATE, value, NULL, NULL, 0);
}
static void wake_all(atomic_int *addr) { syscall(SYS_futex, (int *)addr, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0); }
#else
static void wait_while_equal(atomic_int *addr, int value) { (void)addr; (void)value; sched_yield(); }
static void wake_all(atomic_int *addr) { (void)addr; }
#endif

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#elif defined(__aarch64__)
#define CPU_RELAX() __asm__ __volatile__("yield")
#else
#define CPU_RELAX() ((void)0)
#endif

#define SPIN_ROUNDS 4096
#define CLOSED (1 << 30)

/* Spin, then sleep, until *addr != value. */
static void await_change(atomic_int *addr, int value, atomic_int *sleepers, int rounds) {
    for (int i = 0; i < rounds; ++i) {
        if (atomic_load_explicit(addr, memory_order_acquire) != value) return;
        CPU_RELAX();
    }
    atomic_fetch_add(sleepers, 1);
    while (atomic_load(addr) == value) wait_while_equal(addr, value);
    atomic_fetch_sub(sleepers, 1);
}

static void bump(atomic_int *addr, atomic_int *sleepers) {
    atomic_fetch_add(addr, 1);
    if (atomic_load(sleepers) > 0) wake_all(addr);
}

struct flare_pool {
    int nth;
    pid_t pid;                  /* the creating process: a forked child has none of the workers */
    pthread_t *workers;
    atomic_flag busy;           /* a region is running (taken by its caller) */
    atomic_int generation;      /* bumped to start a region */
    atomic_int gen_sleepers;
    int stop;                   /* read by workers after a generation bump */
    flare_region_fn fn;         /* the current region (written before the bump) */
    void *ctx;
    atomic_int entry;           /* threads checked in to the current region (low bits) | CLOSED */
    atomic_int entry_sleepers;
    _Atomic int64_t regions;    /* regions run so far (for describe() and the tests) */
};

typedef struct { flare_pool *pool; int ith; } worker_arg;


static void *worker_main(void *arg) {
    flare_pool *p = ((worker_arg *)arg)->pool;
    const int ith = ((worker_arg *)arg)->ith;
    free(arg);
    int seen = 0;   /* the generation at creation: a region may start before this thread runs */
    for (;;) {
        await_change(&p->generation, seen, &p->gen_sleepers, SPIN_ROUNDS);
        seen = atomic_load(&p->generation);
        if (p->stop) return NULL;
        /* check in unless the caller already closed the region (it is then done without us:
         * touch nothing of it); fn and ctx are read after checking in, when they are the
         * current region's and stay so until we check out (the caller waits for that). A
         * worker late by a whole region may join the next one twice: its fn finds the work
         * done and returns. */
        int e = atomic_load(&p->entry);
        while (!(e & CLOSED) && !atomic_compare_exchange_weak(&p->entry, &e, e + 1)) {}
        if (e & CLOSED) continue;
        p->fn(p->ctx, ith, p->nth);
        if (atomic_fetch_sub(&p->entry, 1) == (CLOSED | 1) && atomic_load(&p->entry_sleepers) > 0)
            wake_all(&p->entry);
    }
}

flare_pool *flare_pool_new(int threads) {
    if (threads < 1) return NULL;
    flare_pool *p = calloc(1, sizeof *p);
    if (!p) return NULL;
    p->nth = threads;
    p->pid = getpid();
    atomic_flag_clear(&p->busy);
    atomic_init(&p->generation, 0);
    atomic_init(&p->gen_sleepers, 0);
    atomic_init(&p->regions, 0);
    atomic_init(&p->entry, CLOSED);
    atomic_init(&p->entry_sleepers, 0);
    if (threads == 1) return p;
    p->workers = calloc((size_t)threads - 1, sizeof(pthread_t));
    if (!p->workers) { free(p); return NULL; }
    /* workers block every signal (they inherit the mask): signals go to the application's threads */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    for (int i = 1; i < threads; ++i) {
        worker_arg *a = malloc(sizeof *a);
        if (a) { a->pool = p; a->ith = i; }
        if (!a || pthread_create(&p->workers[i - 1], NULL, worker_main, a) != 0) {
            free(a);
            pthread_sigmask(SIG_SETMASK, &old, NULL);
            p->nth = i;                 /* the workers started so far: stop and join them */
            flare_pool_free(p);
            return NULL;
        }
#ifdef __linux__
        pthread_setname_np(p->workers[i - 1], "flare-cpu");   /* top -H, /proc/PID/task/TID/comm */
#endif
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    return p;
}

void flare_pool_free(flare_pool *p) {
    if (!p) return;
    if (p->workers && p->pid == getpid()) {
        p->stop = 1;
        bump(&p->generation, &p->gen_sleepers);
        for (int i = 1; i < p->nth; ++i) pthread_join(p->workers[i - 1], NULL);
        free(p->workers);
    }
    free(p);
}

int flare_pool_threads(const flare_pool *p) { return p ? p->nth : 1; }


int flare_pool_run(flare_pool *p, flare_region_fn fn, void *ctx) {
    if (!p || p->nth <= 1 || p->pid != getpid()) return 0;
    if (atomic_flag_test_and_set_explicit(&p->busy, memory_order_acquire)) return 0;
    p->fn = fn;
    p->ctx = ctx;
    atomic_store(&p->entry, 0);         /* after fn, ctx: a worker checking in sees them */
    bump(&p->generation, &p->gen_sleepers);
    fn(ctx, 0, p->nth);
    int e = atomic_fetch_or(&p->entry, CLOSED) | CLOSED;
    while (e != CLOSED) {               /* those checked in leave (the work is done) */
        await_change(&p->entry, e, &p->entry_sleepers, SPIN_ROUNDS);
        e = atomic_load(&p->entry);
    }
    atomic_fetch_add_explicit(&p->regions, 1, memory_order_relaxed);
    atomic_flag_clear_explicit(&p->busy, memory_order_release);
    return 1;
}

void flare_await_step(atomic_int *word, int below, atomic_int *sleepers, int spin) {
    for (int v = atomic_load(word); v < below; v = atomic_load(word))
        await_change(word, v, sleepers, spin ? SPIN_ROUNDS : 0);
}

void flare_publish_step(atomic_int *word, int value, atomic_int *sleepers) {
    atomic_store(word, value);
    if (atomic_load(sleepers) > 0) wake_all(word);
}

int64_t flare_pool_regions(const flare_pool *p) {
    return p ? atomic_load_explicit(&((flare_pool *)p)->regions, memory_order_relaxed) : 0;
}

void flare_split(int64_t n, int64_t grain, int ith, int nth, int64_t *begin, int64_t *end) {
    if (grain < 1) grain = 1;
    const int64_t units = (n + grain - 1) / grain;
    const int64_t per = units / nth, extra = units % nth;
    const int64_t ub = ith * per + (ith < extra ? ith : extra);
    const int64_t ue = ub + per + (ith < extra ? 1 : 0);
    int64_t b = ub * grain, e = ue * grain;
    if (b > n) b = n;
    if (e > n) e = n;
    *begin = b;
    *end = e;
}

typedef struct { int64_t n, grain, chunks; flare_task task; void *ctx; _Atomic int64_t next; } for_ctx;

static void for_body(void *arg, int ith, int nth) {
    (void)ith; (void)nth;
    for_ctx *f = arg;
    for (int64_t k = atomic_fetch_add(&f->next, 1); k < f->chunks; k = atomic_fetch_add(&f->next, 1)) {
        const int64_t units = (f->n + f->grain - 1) / f->grain;
        const int64_t b = k * units / f->chunks * f->grain, e = (k + 1) * units / f->chunks * f->grain;
        f->task(f->ctx, b, e < f->n ? e : f->n);
    }
}

void flare_pool_for(flare_pool *p, int64_t n, int64_t grain, flare_task task, void *ctx) {
    if (n <= 0) return;
    if (grain < 1) grain = 1;
    const int64_t units = (n + grain - 1) / grain, nth = flare_pool_threads(p);
    for_ctx f = { n, grain, units < 4 * nth ? units : 4 * nth, task, ctx, 0 };
    if (units > 1 && flare_pool_run(p, for_body, &f)) return;
    task(ctx, 0, n);
}
