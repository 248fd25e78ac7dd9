/* Block-quantized weights in the native CPU executor (quant.c): ggml's layouts, integer dots.
 *
 * Why integer dot products: a quantized weight read as floats costs a dequantization per
 * weight per use; ggml instead rounds the *activations* per block (one scale per 32 or 256
 * values) and multiplies integers into 32-bit sums, applying the two scales once per block.
 *
 * Weight types are named by their ggml type id (flare.core.dtypes.QUANT_TYPES). Activations
 * use Flare's own blocks (float scales, exact integer sums), not ggml's q8_0/q8_K:
 *   32-weight types (q4_0, q4_1, q8_0): per 32 values {float d, d * sum(q); int16 q[32]}
 *     16 bits, not ggml's 8: 8-bit activations flip SmolLM2's near-tie tokens (top-1 97.7%
 *     against the float reference, 100% with 16 bits; cpu/README.md). 16 products per
 *     instruction (vpmaddwd, VNNI vpdpwssd); the kernels are bound by unpacking the weights.
 *   256-weight types (q4_k, q6_k):      per 256 values {float d; int32 sum16[16]; int8 q[256]}
 *     ggml's 8 bits (32 byte products per vpmaddubsw / vpdpbusd; QUANT_DOT covers the error).
 *
 * Every function is pure and thread-safe; work is split by weight rows (r0..r1), so each
 * output element is computed by the same code in the same order whatever the threads.
 */
#ifndef FLARE_QUANT_H
#define FLARE_QUANT_H

#include <stdint.h>

enum { FLARE_Q4_0 = 2, FLARE_Q4_1 = 3, FLARE_Q8_0 = 8, FLARE_Q4_K = 12, FLARE_Q6_K = 14 };

/* Bytes of one row of k activations quantized for weights of `type` (k a multiple of its block). */
int64_t flare_qact_row_bytes(int32_t type, int64_t k);
/* Quantize one row of k floats (stride 1) into `xq` for dot products with weights of `type`. */
void flare_qact_quantize_row(int32_t type, const float *x, void *xq, int64_t k);
/* out[j * ldo + r] = dot(weight row r, activation row j) for r in [r0, r1), j in [0, m):
 * weight rows are w_row_bytes apart, activation rows xq_row_bytes apart. */
void flare_qmatmul_rows(int32_t type, const void *w, int64_t w_row_bytes, int64_t k,
                        const void *xq, int64_t xq_row_bytes, int64_t m,
                        float *out, int64_t ldo, int64_t r0, int64_t r1);
/* The same product with float activations (x rows ldx floats apart, unit stride), no rounding of
 * x: each weight row is dequantized into `wrow` (k floats of scratch, one per thread) first. */
void flare_qmatmul_rows_f32(int32_t type, const void *w, int64_t w_row_bytes, int64_t k,
                            const float *x, int64_t ldx, int64_t m, float *wrow,
                            float *out, int64_t ldo, int64_t r0, int64_t r1);
/* One row of k weights to floats, bit for bit as ggml (and gguf.quants) dequantize. */
void flare_dequantize_row(int32_t type, const void *w, float *y, int64_t k);
/* Which dot-product code runs: want 0 = the best this CPU has, 1 = portable C, 2 = AVX2,
 * 3 = AVX-512 VNNI (a want the CPU lacks is ignored). Returns the one now in use. */
int32_t flare_quant_isa(int32_t want);

#endif
