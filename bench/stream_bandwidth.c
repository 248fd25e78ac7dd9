/* Read bandwidth at 1 and 2 threads, STREAM-like, for issue 24's "is 1.7x reachable" question.
 *
 * Why: a moe-lm decode step streams its experts' weights once; where they come from memory the
 * step is bound by bandwidth, and 2 threads can only be as much faster as the memory lets two
 * cores read. This reads (sums, AVX2 where built with -mavx2) a buffer of a given size, split in
 * two halves for 2 threads, many passes, and prints GB/s per thread count, best and median of
 * the passes. Sizes: 8 MiB (fits the 32 MiB L3), 48 MiB (moe-lm mid's experts), 400 MiB
 * (moe-lm small's). Threads are pinned to CPUs 0 and 1 and started once; each pass is a barrier,
 * the read, a barrier, so the figure includes one hand-over per pass (negligible at these sizes).
 *
 *   cc -O2 -mavx2 -mfma -pthread bench/stream_bandwidth.c -o /tmp/stream_bw && /tmp/stream_bw
 */
#define _GNU_SOURCE
#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }

typedef struct { const float *p; size_t n; double sum; } job_t;

static float read_sum(const float *p, size_t n) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (size_t i = 0; i + 32 <= n; i += 32) {
        a0 = _mm256_add_ps(a0, _mm256_load_ps(p + i));
        a1 = _mm256_add_ps(a1, _mm256_load_ps(p + i + 8));
        a2 = _mm256_add_ps(a2, _mm256_load_ps(p + i + 16));
        a3 = _mm256_add_ps(a3, _mm256_load_ps(p + i + 24));
    }
    __m256 s = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
    float out[8]; _mm256_storeu_ps(out, s);
    return out[0] + out[1] + out[2] + out[3] + out[4] + out[5] + out[6] + out[7];
}

static pthread_barrier_t start_b, end_b;
static job_t jobs[2];
static int passes;

static void pin(int cpu) { cpu_set_t s; CPU_ZERO(&s); CPU_SET(cpu, &s); pthread_setaffinity_np(pthread_self(), sizeof s, &s); }

static void *worker(void *arg) {
    pin(1);
    for (int k = 0; k < passes; ++k) {
        pthread_barrier_wait(&start_b);
        jobs[1].sum += read_sum(jobs[1].p, jobs[1].n);
        pthread_barrier_wait(&end_b);
    }
    return arg;
}

static int cmp(const void *a, const void *b) { double x = *(const double *)a, y = *(const double *)b; return (x > y) - (x < y); }

static void measure(const float *buf, size_t n, int nth, int np, double *best, double *median) {
    double *t = malloc(sizeof(double) * np);
    passes = np;
    pthread_t w;
    if (nth == 2) {
        pthread_barrier_init(&start_b, NULL, 2); pthread_barrier_init(&end_b, NULL, 2);
        jobs[0] = (job_t){buf, n / 2, 0}; jobs[1] = (job_t){buf + n / 2, n / 2, 0};
        pthread_create(&w, NULL, worker, NULL);
    } else {
        jobs[0] = (job_t){buf, n, 0};
    }
    pin(0);
    for (int k = 0; k < np; ++k) {
        if (nth == 2) pthread_barrier_wait(&start_b);
        double s = now();
        jobs[0].sum += read_sum(jobs[0].p, jobs[0].n);
        if (nth == 2) pthread_barrier_wait(&end_b);
        t[k] = now() - s;
    }
    if (nth == 2) { pthread_join(w, NULL); pthread_barrier_destroy(&start_b); pthread_barrier_destroy(&end_b); }
    qsort(t, np, sizeof *t, cmp);
    *best = n * 4.0 / t[0] / 1e9;
    *median = n * 4.0 / t[np / 2] / 1e9;
    free(t);
}

int main(int argc, char **argv) {
    size_t sizes_mib[] = {8, 48, 400};
    int rounds = argc > 1 ? atoi(argv[1]) : 3;
    for (size_t s = 0; s < 3; ++s) {
        size_t n = sizes_mib[s] << 18;   /* floats */
        float *buf = aligned_alloc(64, n * 4);
        for (size_t i = 0; i < n; ++i) buf[i] = (float)(i & 7);
        int np = sizes_mib[s] >= 400 ? 10 : 60;
        printf("%4zu MiB:", sizes_mib[s]);
        for (int r = 0; r < rounds; ++r) {    /* alternated 1, 2, 2, 1, ... */
            int order[2] = {r % 2 ? 2 : 1, r % 2 ? 1 : 2};
            double b[3], m[3];
            for (int o = 0; o < 2; ++o) measure(buf, n, order[o], np, &b[order[o]], &m[order[o]]);
            printf("  [1t %5.1f/%5.1f  2t %5.1f/%5.1f GB/s best/median  2t/1t %.2f]", b[1], m[1], b[2], m[2], m[2] / m[1]);
        }
        printf("  (checksum %g)\n", jobs[0].sum);
        free(buf);
    }
    return 0;
}
