/* One expert-staging step in C for host-memory expert caches (staging.c says what and why). */
#ifndef FLARE_STAGING_H
#define FLARE_STAGING_H

#include <stdint.h>

int32_t flare_stage_experts(const int32_t *ids, int64_t n_tok, int64_t k, const uint8_t *valid, int32_t *out,
                            int32_t *table, int32_t *expert_in, double *uses, double *last, int64_t *state,
                            int32_t n_experts, int32_t slots, int32_t age_every, int32_t n_tensors,
                            uint8_t *const *dst, const uint8_t *const *src, const int64_t *row_bytes,
                            uint8_t *mark, int32_t *record, int64_t *info);

#endif
