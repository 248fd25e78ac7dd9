/* Block-quantized matrix products and dequantization for the native CPU executor.
 * See quant.h for the why; the layouts are ggml's (ggml-common.h), byte for byte. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "quant.h"

/* Dequantization must equal ggml's bit for bit: no fused multiply-add contraction here. */
#pragma GCC push_options
#pragma GCC optimize("O3", "fp-contract=off", "tree-vectorize")

#define QK 32
#define QK_K 256

typedef struct { uint16_t d; uint8_t qs[QK / 2]; } blk_q4_0;
typedef struct { uint16_t d, m; uint8_t qs[QK / 2]; } blk_q4_1;
typedef struct { uint16_t d; int8_t qs[QK]; } blk_q8_0;
typedef struct { uint16_t d, dmin; uint8_t scales[12]; uint8_t qs[QK_K / 2]; } blk_q4_k;
typedef struct { uint8_t ql[QK_K / 2]; uint8_t qh[QK_K / 4]; int8_t scales[QK_K / 16]; uint16_t d; } blk_q6_k;
_Static_assert(sizeof(blk_q4_0) == 18 && sizeof(blk_q4_1) == 20 && sizeof(blk_q8_0) == 34, "ggml block sizes");
_Static_assert(sizeof(blk_q4_k) == 144 && sizeof(blk_q6_k) == 210, "ggml k-quant block sizes");

/* activation blocks (quant.h) */
typedef struct { float d, dsum; int16_t qs[QK]; } act32;   /* 16-bit: see quant.h; dsum = d * sum(qs) */
typedef struct { float d; int32_t sum16[QK_K / 16]; int8_t qs[QK_K]; } act256;

/* IEEE half -> float, exactly (normals, subnormals, infinities, NaNs) */
static inline float h2f(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    union { uint32_t u; float f; } v;
    if (exp == 0) {
        v.f = (float)man * 5.9604644775390625e-8f;   /* man * 2^-24: exact */
        v.u |= sign;
        return v.f;
    }
    v.u = sign | (exp == 31 ? 0x7f800000u | (man << 13) : ((exp + 112u) << 23) | (man << 13));
    return v.f;
}

/* q4_k's eight 6-bit scales and mins (ggml's get_scale_min_k4) */
static inline void k4_scale_min(const uint8_t *q, uint8_t *sc, uint8_t *mn) {
    for (int j = 0; j < 4; ++j) {
        sc[j] = q[j] & 63;
        mn[j] = q[j + 4] & 63;
        sc[j + 4] = (q[j + 8] & 0x0F) | ((q[j] >> 6) << 4);
        mn[j + 4] = (q[j + 8] >> 4) | ((q[j + 4] >> 6) << 4);
    }
}

/* ---- dequantization ------------------------------------------------------------------- */
void flare_dequantize_row(int32_t type, const void *w, float *y, int64_t k) {
    switch (type) {
    case FLARE_Q4_0: {
        const blk_q4_0 *b = (const blk_q4_0 *)w;
        for (int64_t i = 0; i < k / QK; ++i) {
            const float d = h2f(b[i].d);
            for (int j = 0; j < QK / 2; ++j) {
                y[i * QK + j] = d * (float)((int)(b[i].qs[j] & 0x0F) - 8);
                y[i * QK + j + QK / 2] = d * (float)((int)(b[i].qs[j] >> 4) - 8);
            }
        }
        return;
    }
    case FLARE_Q4_1: {
        const blk_q4_1 *b = (const blk_q4_1 *)w;
        for (int64_t i = 0; i < k / QK; ++i) {
            const float d = h2f(b[i].d), m = h2f(b[i].m);
            for (int j = 0; j < QK / 2; ++j) {
                y[i * QK + j] = d * (float)(b[i].qs[j] & 0x0F) + m;
                y[i * QK + j + QK / 2] = d * (float)(b[i].qs[j] >> 4) + m;
            }
        }
        return;
    }
    case FLARE_Q8_0: {
        const blk_q8_0 *b = (const blk_q8_0 *)w;
        for (int64_t i = 0; i < k / QK; ++i) {
            const float d = h2f(b[i].d);
            for (int j = 0; j < QK; ++j) y[i * QK + j] = (float)b[i].qs[j] * d;
        }
        return;
    }
    case FLARE_Q4_K: {
        const blk_q4_k *b = (const blk_q4_k *)w;
        for (int64_t i = 0; i < k / QK_K; ++i) {
            uint8_t sc[8], mn[8];
            k4_scale_min(b[i].scales, sc, mn);
            const float d = h2f(b[i].d), dmin = h2f(b[i].dmin);
            float *o = y + i * QK_K;
            for (int j = 0; j < 4; ++j) {
                const float d1 = d * (float)sc[2 * j], m1 = dmin * (float)mn[2 * j];
                const float d2 = d * (float)sc[2 * j + 1], m2 = dmin * (float)mn[2 * j + 1];
                const uint8_t *q = b[i].qs + 32 * j;
                for (int l = 0; l < 32; ++l) {
                    o[64 * j + l] = d1 * (float)(q[l] & 0x0F) - m1;
                    o[64 * j + 32 + l] = d2 * (float)(q[l] >> 4) - m2;
                }
            }
        }
        return;
    }
    case FLARE_Q6_K: {
        const blk_q6_k *b = (const blk_q6_k *)w;
        for (int64_t i = 0; i < k / QK_K; ++i) {
            const float d = h2f(b[i].d);
            float *o = y + i * QK_K;
            for (int h = 0; h < 2; ++h) {
                const uint8_t *ql = b[i].ql + 64 * h, *qh = b[i].qh + 32 * h;
                for (int l = 0; l < 32; ++l) {
                    const int q[4] = {
                        (int)((ql[l] & 0x0F) | ((qh[l] & 3) << 4)) - 32,
                        (int)((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) - 32,
                        (int)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32,
                        (int)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32,
                    };
                    for (int g = 0; g < 4; ++g) {
                        const int e = 128 * h + 32 * g + l;
                        o[e] = (d * (float)b[i].scales[e / 16]) * (float)q[g];
                    }
                }
            }
        }
        return;
    }
    default:
        memset(y, 0, (size_t)k * sizeof(float));
    }
}

#pragma GCC pop_options

/* ---- activations ---------------------------------------------------------------------- */
static inline int is_k(int32_t type) { return type == FLARE_Q4_K || type == FLARE_Q6_K; }

int64_t flare_qact_row_bytes(int32_t type, int64_t k) {
    return is_k(type) ? (k / QK_K) * (int64_t)sizeof(act256) : (k / QK) * (int64_t)sizeof(act32);
}

/* round to nearest, ties away from zero (as ggml's roundf) */
static inline int8_t q8(float v) { return (int8_t)(v < 0.0f ? -(int)(-v + 0.5f) : (int)(v + 0.5f)); }
static inline int16_t q16(float v) { return (int16_t)(v < 0.0f ? -(int)(-v + 0.5f) : (int)(v + 0.5f)); }

/* the block's scale (amax / qmax) and its inverse, 0 for an all-zero block */
static float block_scale(const float *x, int n, float qmax, float *inv) {
    float amax = 0.0f;
    for (int i = 0; i < n; ++i) { const float a = fabsf(x[i]); amax = a > amax ? a : amax; }   /* inlined, unlike fmaxf */
    const float d = amax / qmax;
    *inv = d > 0.0f ? 1.0f / d : 0.0f;
    return d;
}

void flare_qact_quantize_row(int32_t type, const float *x, void *xq, int64_t k) {
    if (!is_k(type)) {
        act32 *a = (act32 *)xq;
        for (int64_t i = 0; i < k / QK; ++i) {
            float inv;
            a[i].d = block_scale(x + i * QK, QK, 32767.0f, &inv);
            int32_t s = 0;
            for (int j = 0; j < QK; ++j) { a[i].qs[j] = q16(x[i * QK + j] * inv); s += a[i].qs[j]; }
            a[i].dsum = a[i].d * (float)s;   /* q4_1's min term, one multiply-add per block */
        }
        return;
    }
    act256 *a = (act256 *)xq;
    for (int64_t i = 0; i < k / QK_K; ++i) {
        float inv;
        a[i].d = block_scale(x + i * QK_K, QK_K, 127.0f, &inv);
        for (int g = 0; g < QK_K / 16; ++g) {
            int32_t s = 0;
            for (int j = 0; j < 16; ++j) { const int8_t q = q8(x[i * QK_K + 16 * g + j] * inv); a[i].qs[16 * g + j] = q; s += q; }
            a[i].sum16[g] = s;
        }
    }
}

/* ---- dot products: portable C ------------------------------------------------------------ */
typedef float (*vec_dot_t)(const void *w, const void *x, int64_t k);

static float dot_q4_0_c(const void *vw, const void *vx, int64_t k) {
    const blk_q4_0 *w = (const blk_q4_0 *)vw; const act32 *x = (const act32 *)vx;
    float acc = 0.0f;
    for (int64_t i = 0; i < k / QK; ++i) {
        int32_t s = 0;
        for (int j = 0; j < QK / 2; ++j)
            s += ((w[i].qs[j] & 0x0F) - 8) * x[i].qs[j] + ((w[i].qs[j] >> 4) - 8) * x[i].qs[j + QK / 2];
        acc += h2f(w[i].d) * x[i].d * (float)s;
    }
    return acc;
}

static float dot_q4_1_c(const void *vw, const void *vx, int64_t k) {
    const blk_q4_1 *w = (const blk_q4_1 *)vw; const act32 *x = (const act32 *)vx;
    float acc = 0.0f;
    for (int64_t i = 0; i < k / QK; ++i) {
        int32_t s = 0;
        for (int j = 0; j < QK / 2; ++j) s += (w[i].qs[j] & 0x0F) * x[i].qs[j] + (w[i].qs[j] >> 4) * x[i].qs[j + QK / 2];
        acc += h2f(w[i].d) * x[i].d * (float)s + h2f(w[i].m) * x[i].dsum;
    }
    return acc;
}

static float dot_q8_0_c(const void *vw, const void *vx, int64_t k) {
    const blk_q8_0 *w = (const blk_q8_0 *)vw; const act32 *x = (const act32 *)vx;
    float acc = 0.0f;
    for (int64_t i = 0; i < k / QK; ++i) {
        int32_t s = 0;
        for (int j = 0; j < QK; ++j) s += w[i].qs[j] * x[i].qs[j];
        acc += h2f(w[i].d) * x[i].d * (float)s;
    }
    return acc;
}

static float dot_q4_k_c(const void *vw, const void *vx, int64_t k) {
    const blk_q4_k *w = (const blk_q4_k *)vw; const act256 *x = (const act256 *)vx;
    float acc = 0.0f;
    for (int64_t i = 0; i < k / QK_K; ++i) {
        uint8_t sc[8], mn[8];
        k4_scale_min(w[i].scales, sc, mn);
        int32_t s = 0, smin = 0;
        for (int j = 0; j < 4; ++j) {
            const uint8_t *q = w[i].qs + 32 * j;
            const int8_t *a = x[i].qs + 64 * j;
            int32_t lo = 0, hi = 0;
            for (int l = 0; l < 32; ++l) { lo += (q[l] & 0x0F) * a[l]; hi += (q[l] >> 4) * a[32 + l]; }
            s += sc[2 * j] * lo + sc[2 * j + 1] * hi;
            smin += mn[2 * j] * (x[i].sum16[4 * j] + x[i].sum16[4 * j + 1])
                  + mn[2 * j + 1] * (x[i].sum16[4 * j + 2] + x[i].sum16[4 * j + 3]);
        }
        acc += x[i].d * (h2f(w[i].d) * (float)s - h2f(w[i].dmin) * (float)smin);
    }
    return acc;
}

static float dot_q6_k_c(const void *vw, const void *vx, int64_t k) {
    const blk_q6_k *w = (const blk_q6_k *)vw; const act256 *x = (const act256 *)vx;
    float acc = 0.0f;
    for (int64_t i = 0; i < k / QK_K; ++i) {
        int32_t grp[16] = {0};
        for (int h = 0; h < 2; ++h) {
            const uint8_t *ql = w[i].ql + 64 * h, *qh = w[i].qh + 32 * h;
            for (int l = 0; l < 32; ++l) {
                const int q[4] = {
                    (ql[l] & 0x0F) | ((qh[l] & 3) << 4), (ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4),
                    (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4), (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4),
                };
                for (int g = 0; g < 4; ++g) {
                    const int e = 128 * h + 32 * g + l;
                    grp[e / 16] += q[g] * x[i].qs[e];
                }
            }
        }
        int32_t s = 0;
        for (int g = 0; g < 16; ++g) s += w[i].scales[g] * (grp[g] - 32 * x[i].sum16[g]);
        acc += x[i].d * h2f(w[i].d) * (float)s;
    }
    return acc;
}

/* ---- dot products: AVX2 and AVX-512 VNNI (the same code, two byte-dot instructions) ---- */
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define QUANT_SIMD 1

#define QSFX avx2
#define QTARGET "avx2,fma,f16c"
#define DOT_U8S8(acc, u, s) _mm256_add_epi32((acc), _mm256_madd_epi16(_mm256_maddubs_epi16((u), (s)), _mm256_set1_epi16(1)))
#define DOT_S16(acc, a, b) _mm256_add_epi32((acc), _mm256_madd_epi16((a), (b)))
#include "quant_simd.h"
#undef QSFX
#undef QTARGET
#undef DOT_U8S8
#undef DOT_S16

#define QSFX vnni
#define QTARGET "avx2,fma,f16c,avx512f,avx512vl,avx512vnni"
#define DOT_U8S8(acc, u, s) _mm256_dpbusd_epi32((acc), (u), (s))
#define DOT_S16(acc, a, b) _mm256_dpwssd_epi32((acc), (a), (b))
#include "quant_simd.h"
#undef QSFX
#undef QTARGET
#undef DOT_U8S8
#undef DOT_S16
#endif

/* ---- dispatch ------------------------------------------------------------------------------ */
enum { ISA_AUTO = 0, ISA_C = 1, ISA_AVX2 = 2, ISA_VNNI = 3 };
static int32_t g_isa = -1;

static int32_t best_isa(void) {
#ifdef QUANT_SIMD
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx2")
        && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
        return ISA_VNNI;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
        return ISA_AVX2;
#endif
    return ISA_C;
}

int32_t flare_quant_isa(int32_t want) {
    const int32_t best = best_isa();
    g_isa = (want >= ISA_C && want <= best) ? want : best;
    return g_isa;
}

/* four activation rows (xrb bytes apart) against one weight row: out[0..3] */
typedef void (*vec_dot4_t)(const void *w, const char *x, int64_t xrb, int64_t k, float *out);

static vec_dot4_t vec_dot4_for(int32_t type) {
    if (g_isa < 0) flare_quant_isa(ISA_AUTO);
#ifdef QUANT_SIMD
    if (g_isa == ISA_VNNI) {
        switch (type) {
        case FLARE_Q4_0: return dot4_q4_0_vnni; case FLARE_Q4_1: return dot4_q4_1_vnni; case FLARE_Q8_0: return dot4_q8_0_vnni;
        }
    }
    if (g_isa == ISA_AVX2) {
        switch (type) {
        case FLARE_Q4_0: return dot4_q4_0_avx2; case FLARE_Q4_1: return dot4_q4_1_avx2; case FLARE_Q8_0: return dot4_q8_0_avx2;
        }
    }
#endif
    (void)type;
    return 0;
}

static vec_dot_t vec_dot_for(int32_t type) {
    if (g_isa < 0) flare_quant_isa(ISA_AUTO);
#ifdef QUANT_SIMD
    if (g_isa == ISA_VNNI) {
        switch (type) {
        case FLARE_Q4_0: return dot_q4_0_vnni; case FLARE_Q4_1: return dot_q4_1_vnni; case FLARE_Q8_0: return dot_q8_0_vnni;
        case FLARE_Q4_K: return dot_q4_k_vnni; case FLARE_Q6_K: return dot_q6_k_vnni;
        }
    }
    if (g_isa == ISA_AVX2) {
        switch (type) {
        case FLARE_Q4_0: return dot_q4_0_avx2; case FLARE_Q4_1: return dot_q4_1_avx2; case FLARE_Q8_0: return dot_q8_0_avx2;
        case FLARE_Q4_K: return dot_q4_k_avx2; case FLARE_Q6_K: return dot_q6_k_avx2;
        }
    }
#endif
    switch (type) {
    case FLARE_Q4_0: return dot_q4_0_c; case FLARE_Q4_1: return dot_q4_1_c; case FLARE_Q8_0: return dot_q8_0_c;
    case FLARE_Q4_K: return dot_q4_k_c; case FLARE_Q6_K: return dot_q6_k_c;
    }
    return 0;
}

/* Float activations: each weight row is dequantized (bit for bit as above) into a buffer of
 * `k` floats and meets every activation row in float multiply-adds. No activation rounding,
 * so no QUANT_DOT error; for a few rows (decode) the weights stream from memory either way
 * and this costs about what the integer path does. Auto-vectorized for AVX2/AVX-512 at load. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__)
__attribute__((target_clones("default", "avx2", "avx512f")))
#endif
static float fdot(const float *a, const float *b, int64_t k) {
    float acc[16] = {0};
    int64_t i = 0;
    for (; i + 16 <= k; i += 16)
        for (int j = 0; j < 16; ++j) acc[j] += a[i + j] * b[i + j];
    float s = 0.0f;
    for (; i < k; ++i) s += a[i] * b[i];
    for (int j = 0; j < 16; ++j) s += acc[j];
    return s;
}

void flare_qmatmul_rows_f32(int32_t type, const void *w, int64_t w_row_bytes, int64_t k,
                            const float *x, int64_t ldx, int64_t m, float *wrow,
                            float *out, int64_t ldo, int64_t r0, int64_t r1) {
    const char *wb = (const char *)w;
    for (int64_t r = r0; r < r1; ++r) {
        flare_dequantize_row(type, wb + r * w_row_bytes, wrow, k);
        for (int64_t j = 0; j < m; ++j) out[j * ldo + r] = fdot(wrow, x + j * ldx, k);
    }
}

void flare_qmatmul_rows(int32_t type, const void *w, int64_t w_row_bytes, int64_t k,
                        const void *xq, int64_t xq_row_bytes, int64_t m,
                        float *out, int64_t ldo, int64_t r0, int64_t r1) {
    const vec_dot_t dot = vec_dot_for(type);
    const vec_dot4_t dot4 = vec_dot4_for(type);
    const char *wb = (const char *)w, *xb = (const char *)xq;
    /* activation rows in tiles that stay in L1 while the weight rows pass over them */
    const int64_t tile = xq_row_bytes * 16 <= 24576 ? 16 : 4;
    for (int64_t j0 = 0; j0 < m; j0 += tile) {
        const int64_t j1 = j0 + tile < m ? j0 + tile : m;
        for (int64_t r = r0; r < r1; ++r) {
            int64_t j = j0;
            if (dot4)   /* the same bits as dot, one weight-block unpacking per four rows */
                for (; j + 4 <= j1; j += 4) {
                    float o[4];
                    dot4(wb + r * w_row_bytes, xb + j * xq_row_bytes, xq_row_bytes, k, o);
                    for (int t = 0; t < 4; ++t) out[(j + t) * ldo + r] = o[t];
                }
            for (; j < j1; ++j)
                out[j * ldo + r] = dot ? dot(wb + r * w_row_bytes, xb + j * xq_row_bytes, k) : 0.0f;
        }
    }
}
