/* One expert-staging step in C, for expert caches in host memory (staging.py wraps it).
 *
 * Why: on the moe-lm `mid` bench a staging call's bookkeeping in Python (the set of selected
 * ids, the misses, the eviction order, the slot table, the counters, a writer call per tensor)
 * came to ~0.5 ms a request (54 calls, three quarters of them with misses), beside copies of
 * ~20 us an expert; in C the bookkeeping is a few hundred nanoseconds and the copies are
 * memcpy calls with no Python between them. This does the same step on arrays that `flare.core.expert_staging.ExpertStager`
 * owns (the layer's slot table, which expert each slot holds, use counts and recency ticks),
 * so the policy's state stays with the stager and `resident()`/`StagingStats` stay right.
 *
 * The policy is ExpertStager's, decision for decision (a test replays the same routing through
 * both): the distinct ids of the valid tokens, ascending; the missing ones get free slots first
 * (ascending), then the slots of the least often used experts the step does not need, ties by
 * least recent tick, then by expert id; missing experts in ascending order go to the chosen
 * slots in ascending order, consecutive pairs merged into one run (one memcpy per tensor);
 * placed experts get the tick `calls + 0.5`; then calls += 1, use counts are halved when
 * calls % age_every == 0, and every needed expert gets a use and the tick `calls`; last, the
 * slot of every (token, choice), padding rows included, from the slot table.
 *
 * Threads: no state of its own; the caller owns every array and calls it for one layer at a
 * time (a prepared graph's executes take turns).
 */
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "staging.h"

#define FLARE_STAGE_OK 0
#define FLARE_STAGE_TOO_MANY 1     /* info[0]: the distinct experts the step needs */
#define FLARE_STAGE_BAD_ID 2       /* info[0]: the id out of range */
#define FLARE_STAGE_NO_VICTIM 3    /* no slot to evict (guarded by TOO_MANY; a last line) */

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Is (uses[a], last[a], a) < (uses[b], last[b], b)? */
static int older(const double *uses, const double *last, int32_t a, int32_t b) {
    if (uses[a] != uses[b]) return uses[a] < uses[b];
    if (last[a] != last[b]) return last[a] < last[b];
    return a < b;
}

/* ids: [n_tok, k]; valid: [n_tok] (1: a real token) or NULL for all; out: [n_tok, k] slots.
 * State (the caller's, one layer): table [n_experts] expert -> slot (valid where resident),
 * expert_in [slots] (-1: empty), uses/last [n_experts], state[0] calls, state[1] empty slots.
 * dst[t]/src[t]/row_bytes[t]: cache and source rows of tensor t (row i at base + i * row_bytes).
 * mark: [n_experts] zeros (left zero). record: [6 * slots] int32, written: needed, missing,
 * evicted (slots each), runs (3 * slots: first expert, first slot, count).
 * info: [5] written: needed, missing, evicted, runs, nanoseconds in the copies. */
int32_t flare_stage_experts(const int32_t *ids, int64_t n_tok, int64_t k, const uint8_t *valid, int32_t *out,
                            int32_t *table, int32_t *expert_in, double *uses, double *last, int64_t *state,
                            int32_t n_experts, int32_t slots, int32_t age_every, int32_t n_tensors,
                            uint8_t *const *dst, const uint8_t *const *src, const int64_t *row_bytes,
                            uint8_t *mark, int32_t *record, int64_t *info) {
    const int64_t n = n_tok * k;
    int32_t *rec_needed = record, *rec_missing = record + slots, *rec_evicted = record + 2 * slots;
    int32_t *rec_runs = record + 3 * slots;
    for (int i = 0; i < 5; i++) info[i] = 0;
    for (int64_t i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= n_experts) {
            info[0] = ids[i];
            return FLARE_STAGE_BAD_ID;
        }
    }
    for (int64_t t = 0; t < n_tok; t++) {
        if (valid && !valid[t]) continue;
        for (int64_t j = 0; j < k; j++) mark[ids[t * k + j]] = 1;
    }
    int32_t n_needed = 0, n_missing = 0;
    for (int32_t e = 0; e < n_experts; e++) {
        if (!mark[e]) continue;
        int32_t s = table[e];
        int resident = s >= 0 && s < slots && expert_in[s] == e;
        if (n_needed < slots) rec_needed[n_needed] = e;
        n_needed++;
        if (!resident) {
            if (n_missing < slots) rec_missing[n_missing] = e;
            n_missing++;
        }
    }
    int32_t status = FLARE_STAGE_OK;
    int32_t n_evicted = 0, n_runs = 0;
    if (n_missing > 0) {
        if (n_needed > slots) {
            info[0] = n_needed;
            status = FLARE_STAGE_TOO_MANY;
            goto done;
        }
        /* victims: free slots first (ascending), then least (uses, last, id) not needed */
        int32_t victims[n_missing];
        int32_t got = 0;
        if (state[1] > 0) {
            for (int32_t s = 0; s < slots && got < n_missing; s++)
                if (expert_in[s] < 0) victims[got++] = s;
        }
        while (got < n_missing) {
            int32_t best = -1;
            for (int32_t s = 0; s < slots; s++) {
                int32_t e = expert_in[s];
                if (e < 0 || mark[e]) continue;          /* empty, a needed one, or chosen already */
                if (best < 0 || older(uses, last, e, expert_in[best])) best = s;
            }
            if (best < 0) break;
            mark[expert_in[best]] = 2;                   /* chosen: skipped by the next pass */
            victims[got++] = best;
        }
        if (got < n_missing) {
            status = FLARE_STAGE_NO_VICTIM;
            goto done;
        }
        for (int32_t i = 0; i < got; i++) {              /* take: evict, in the order chosen */
            int32_t e = expert_in[victims[i]];
            if (e >= 0) {
                rec_evicted[n_evicted++] = e;
                mark[e] = 0;
                expert_in[victims[i]] = -1;
                state[1]++;
            }
        }
        for (int32_t i = 1; i < got; i++) {              /* slots ascending (insertion sort: few) */
            int32_t v = victims[i], j = i - 1;
            while (j >= 0 && victims[j] > v) { victims[j + 1] = victims[j]; j--; }
            victims[j + 1] = v;
        }
        const double tick = (double)state[0] + 0.5;
        for (int32_t i = 0; i < got; i++) {              /* place, merging consecutive pairs */
            int32_t e = rec_missing[i], s = victims[i];
            expert_in[s] = e;
            table[e] = s;
            last[e] = tick;
            state[1]--;
            if (n_runs && e == rec_runs[3 * (n_runs - 1)] + rec_runs[3 * (n_runs - 1) + 2]
                    && s == rec_runs[3 * (n_runs - 1) + 1] + rec_runs[3 * (n_runs - 1) + 2]) {
                rec_runs[3 * (n_runs - 1) + 2]++;
            } else {
                rec_runs[3 * n_runs] = e; rec_runs[3 * n_runs + 1] = s; rec_runs[3 * n_runs + 2] = 1;
                n_runs++;
            }
        }
        int64_t t0 = now_ns();
        for (int32_t r = 0; r < n_runs; r++) {
            int64_t first = rec_runs[3 * r], slot = rec_runs[3 * r + 1], count = rec_runs[3 * r + 2];
            for (int32_t t = 0; t < n_tensors; t++)
                memcpy(dst[t] + slot * row_bytes[t], src[t] + first * row_bytes[t], (size_t)(count * row_bytes[t]));
        }
        info[4] = now_ns() - t0;
    }
    {   /* use: count the step's selections, halving every age_every calls */
        int64_t calls = ++state[0];
        if (age_every > 0 && calls % age_every == 0)
            for (int32_t e = 0; e < n_experts; e++) uses[e] *= 0.5;
        for (int32_t i = 0; i < n_needed; i++) {
            int32_t e = rec_needed[i];
            uses[e] += 1.0;
            last[e] = (double)calls;
        }
    }
    for (int64_t i = 0; i < n; i++) out[i] = table[ids[i]];
    info[0] = n_needed; info[1] = n_missing; info[2] = n_evicted; info[3] = n_runs;
done:
    for (int32_t e = 0; e < n_experts; e++) mark[e] = 0;
    return status;
}
