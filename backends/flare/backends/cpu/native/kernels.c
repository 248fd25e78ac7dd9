/* Flare's native CPU executor: a split is a list of commands replayed by one call.
 *
 * Every command carries raw pointers into the arena (or weights), a 4-D output
 * shape and 4-D element strides for the output and each source, already
 * broadcast and coalesced by the Python side (backends/flare/backends/cpu/native/commands.py).
 * Kernels are plain loops the compiler vectorizes; matmuls go to the BLAS whose
 * sgemm/sgemv pointers flare_set_blas() installed.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <stdatomic.h>

#include "pool.h"

#include "quant.h"
#include "staging.h"
#include <time.h>

/* Hot loops are compiled for several vector widths and picked at load time (GCC's
 * target_clones + ifunc), so one portable build still uses AVX2/AVX-512 where present. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__)
#define HOT __attribute__((target_clones("default", "avx2", "avx512f")))
#else
#define HOT
#endif

typedef struct {
    int32_t kind;
    int32_t flags;
    void *out;
    void *src[4];
    int64_t ne[4];
    int64_t os[4];
    int64_t ss[4][4];
    int64_t ip[8];
    double fp[4];
    void *scratch;
} flare_cmd;

enum {
    K_COPY4 = 0, K_COPY2, K_COPY8,
    K_ADD, K_SUB, K_MUL, K_DIV,
    K_SCALE, K_RELU, K_SIGMOID, K_SILU, K_GELU, K_TANH, K_EXP, K_SQRT, K_NEG, K_SQR,
    K_MATMUL, K_LAYER_NORM, K_RMS_NORM, K_SOFTMAX, K_GET_ROWS, K_ROPE, K_CONV1D, K_PAD,
    K_SUM, K_MEAN, K_MAX, K_ARGMAX, K_TOP_K, K_GATHER, K_MUL_MAT_ID, K_SET_ROWS,
    K_CAST_F32_I32, K_CAST_I32_F32, K_CAST_F16_F32,
    /* fused */
    K_LINEAR, K_NORM_AFFINE,
    K_LSTM,
    /* block-quantized weights (quant.c) */
    K_QMATMUL, K_DEQUANTIZE, K_GET_ROWS_Q, K_MUL_MAT_ID_Q,
    K_LEAKY_RELU,  /* fused: x > 0 ? x : fp0 * x (flare.core.ops.fused) */
    K_STAGE_EXPERTS,  /* expert staging's step (staging.c) as a command: k_stage_experts */
    K_ERF,
    K_COUNT
};

enum { ERR_NONE = 0, ERR_INDEX = 1, ERR_KIND = 2, ERR_NOBLAS = 3 };
/* K_STAGE_EXPERTS fails with ERR_STAGE + staging.c's code (the stager names the error) */
#define ERR_STAGE 16

/* CBLAS, row-major only. Two integer widths: the OpenBLAS NumPy ships is ILP64. */
typedef void (*sgemm64_t)(int, int, int, int64_t, int64_t, int64_t, float, const float *, int64_t,
                          const float *, int64_t, float, float *, int64_t);
typedef void (*sgemv64_t)(int, int, int64_t, int64_t, float, const float *, int64_t, const float *, int64_t,
                          float, float *, int64_t);
typedef void (*sgemm32_t)(int, int, int, int, int, int, float, const float *, int,
                          const float *, int, float, float *, int);
typedef void (*sgemv32_t)(int, int, int, int, float, const float *, int, const float *, int,
                          float, float *, int);
static void *g_sgemm = 0, *g_sgemv = 0;
static int g_ilp64 = 1;

void flare_set_blas(void *sgemm, void *sgemv, int ilp64) { g_sgemm = sgemm; g_sgemv = sgemv; g_ilp64 = ilp64; }

enum { ROW = 101, NT = 111, TR = 112 };

static void gemm(int ta, int tb, int64_t m, int64_t n, int64_t k, const float *a, int64_t lda,
                 const float *b, int64_t ldb, float beta, float *c, int64_t ldc) {
    if (g_ilp64) ((sgemm64_t)g_sgemm)(ROW, ta, tb, m, n, k, 1.0f, a, lda, b, ldb, beta, c, ldc);
    else ((sgemm32_t)g_sgemm)(ROW, ta, tb, (int)m, (int)n, (int)k, 1.0f, a, (int)lda, b, (int)ldb, beta, c, (int)ldc);
}

/* y[0..m) = A[m, n] x (A row-major with leading dim lda, or its transpose) */
static void gemv(int ta, int64_t m, int64_t n, const float *a, int64_t lda, const float *x, int64_t incx,
                 float beta, float *y, int64_t incy) {
    if (g_ilp64) ((sgemv64_t)g_sgemv)(ROW, ta, m, n, 1.0f, a, lda, x, incx, beta, y, incy);
    else ((sgemv32_t)g_sgemv)(ROW, ta, (int)m, (int)n, 1.0f, a, (int)lda, x, (int)incx, beta, y, (int)incy);
}

/* ---- elementwise ------------------------------------------------------------ */
/* exp without a libm call, so loops over it vectorize: 2^n * p(r) with x = n ln2 + r, |r| <= ln2/2,
 * p a degree-6 Taylor polynomial (relative error < 2e-7 plus the rounding of the reduction);
 * below -87.3 it is 0 and above 88.7 inf (where f32 exp underflows / overflows anyway). */
static inline __attribute__((always_inline)) float vexp(float x0) {
    const float x = x0 < -87.3f ? -87.3f : (x0 > 88.7f ? 88.7f : x0);
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  /* round to nearest */
    const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    union { int32_t i; float f; } scale = { .i = ((int32_t)n + 127) << 23 };
    const float y = p * scale.f;
    return x0 < -87.3f ? 0.0f : (x0 > 88.7f ? INFINITY : y);
}
/* erf by Abramowitz & Stegun 7.1.26 (|error| < 1.5e-7), vectorizable */
static inline __attribute__((always_inline)) float verf(float x) {
    const float a = __builtin_fabsf(x);
    const float t = 1.0f / (1.0f + 0.3275911f * a);
    const float poly = t * (0.254829592f + t * (-0.284496736f + t * (1.421413741f + t * (-1.453152027f + t * 1.061405429f))));
    const float y = 1.0f - poly * vexp(-a * a);
    return x < 0.0f ? -y : y;
}
/* erf to a few ulp (max relative error 4.2e-7 over all floats, measured against math.erf):
 * Eigen's x P(x^2) / Q(x^2) on [-4, 4] (+-1 beyond, as in f32). The Erf op's kernel, where
 * verf's absolute error (~1e-7 from a difference near 1) would be large relative to erf(x) near
 * 0; gelu keeps verf (its products were measured with it). */
static inline __attribute__((always_inline)) float verf_rational(float x0) {
    const float x = x0 > 4.0f ? 4.0f : (x0 < -4.0f ? -4.0f : x0), x2 = x * x;
    float p = -2.72614225801306e-10f;
    p = p * x2 + 2.77068142495902e-08f;
    p = p * x2 - 2.10102402082508e-06f;
    p = p * x2 - 5.69250639462346e-05f;
    p = p * x2 - 7.34990630326855e-04f;
    p = p * x2 - 2.95459980854025e-03f;
    p = p * x2 - 1.60960333262415e-02f;
    float q = -1.45660718464996e-05f;
    q = q * x2 - 2.13374055278905e-04f;
    q = q * x2 - 1.68282697438203e-03f;
    q = q * x2 - 7.37332916720468e-03f;
    q = q * x2 - 1.42647390514189e-02f;
    return x * p / q;
}
static inline __attribute__((always_inline)) float gelu_f(float x) { return 0.5f * x * (1.0f + verf(x * 0.7071067811865476f)); }
static inline __attribute__((always_inline)) float sigmoid_f(float x) { return 1.0f / (1.0f + vexp(-x)); }
/* tanh as x P(x^2) / Q(x^2) on [-7.9, 7.9] (Eigen's float rational, a few ulp everywhere),
 * +-1 beyond. A rational keeps the *relative* error small near 0, where 1 - 2 / (exp(2|x|) + 1)
 * had an absolute error of ~1e-7 (so tanh(1e-4) was off by 0.1%: ONNX's Mish test caught it). */
static inline __attribute__((always_inline)) float vtanh(float x) {
    const float c = x > 7.90531110763549805f ? 7.90531110763549805f : (x < -7.90531110763549805f ? -7.90531110763549805f : x);
    const float x2 = c * c;
    float p = -2.76076847742355e-16f;
    p = p * x2 + 2.00018790482477e-13f;
    p = p * x2 - 8.60467152213735e-11f;
    p = p * x2 + 5.12229709037114e-08f;
    p = p * x2 + 1.48572235717979e-05f;
    p = p * x2 + 6.37261928875436e-04f;
    p = p * x2 + 4.89352455891786e-03f;
    float q = 1.19825839466702e-06f;
    q = q * x2 + 1.18534705686654e-04f;
    q = q * x2 + 2.26843463243900e-03f;
    q = q * x2 + 4.89352518554385e-03f;
    const float y = c * p / q;
    return __builtin_fabsf(x) < 0.0004f ? x : y;
}

/* The outer index space i0, i1, i2 of a command, flattened, walked over [ob, oe): a thread runs
 * its range of rows (a serial run: [0, outer(c))). The indices are carried, not divided per row. */
#define OUTER3(c) for (int64_t q_ = ob, i0 = ob ? ob / ((c)->ne[1] * (c)->ne[2]) : 0, \
    i1 = ob ? (ob / (c)->ne[2]) % (c)->ne[1] : 0, i2 = ob ? ob % (c)->ne[2] : 0; q_ < oe; \
    ++q_, (++i2 == (c)->ne[2] ? (i2 = 0, (++i1 == (c)->ne[1] ? (i1 = 0, ++i0) : 0)) : 0))
static inline int64_t outer(const flare_cmd *c) { return c->ne[0] * c->ne[1] * c->ne[2]; }
#define OFF(st, c) (i0 * (st)[0] + i1 * (st)[1] + i2 * (st)[2])

/* Whole short rows of contiguous a and out against one b value per row (a bias [C, 1] added over
 * [B, C, L] with a small L: silero-vad's conv outputs, L 1-4): the rows of one (i0, i1) block are
 * walked by pointer steps, not the per-row index arithmetic of OUTER3 (which cost ~5 ns a row,
 * more than the 4 adds). */
static inline int short_rows_by_scalar(const flare_cmd *c, int64_t jb, int64_t je) {
    const int64_t n3 = c->ne[3];
    return jb == 0 && je == n3 && n3 <= 16 && c->os[3] == 1 && c->ss[0][3] == 1 && c->ss[1][3] == 0 &&
           c->os[2] == n3 && c->ss[0][2] == n3;
}
#define SHORT_ROWS(c, ob, oe, EXPR) do { \
    const int64_t n2 = (c)->ne[2], n3 = (c)->ne[3], bs2 = (c)->ss[1][2]; \
    for (int64_t q = (ob); q < (oe);) { \
        const int64_t i0 = q / ((c)->ne[1] * n2), i1 = (q / n2) % (c)->ne[1], i2 = q % n2; \
        const int64_t rows = (oe) - q < n2 - i2 ? (oe) - q : n2 - i2; \
        float *o = (float *)(c)->out + i0 * (c)->os[0] + i1 * (c)->os[1] + i2 * n3; \
        const float *a = (const float *)(c)->src[0] + i0 * (c)->ss[0][0] + i1 * (c)->ss[0][1] + i2 * n3; \
        const float *b = (const float *)(c)->src[1] + OFF((c)->ss[1], c); \
        for (int64_t r = 0; r < rows; ++r, o += n3, a += n3, b += bs2) { \
            const float y = b[0]; \
            for (int64_t j = 0; j < n3; ++j) { float x = a[j]; o[j] = EXPR; } \
        } \
        q += rows; \
    } \
} while (0)

#define BINARY(NAME, EXPR) \
HOT static void NAME(const flare_cmd *c, int64_t ob, int64_t oe, int64_t jb, int64_t je) { \
    const int64_t os = c->os[3], as = c->ss[0][3], bs = c->ss[1][3]; \
    if (short_rows_by_scalar(c, jb, je)) { SHORT_ROWS(c, ob, oe, EXPR); return; } \
    OUTER3(c) { \
        float *o = (float *)c->out + OFF(c->os, c); \
        const float *a = (const float *)c->src[0] + OFF(c->ss[0], c); \
        const float *b = (const float *)c->src[1] + OFF(c->ss[1], c); \
        if (os == 1 && as == 1 && bs == 1) { for (int64_t j = jb; j < je; ++j) { float x = a[j], y = b[j]; o[j] = EXPR; } } \
        else if (os == 1 && as == 1 && bs == 0) { const float y = b[0]; for (int64_t j = jb; j < je; ++j) { float x = a[j]; o[j] = EXPR; } } \
        else { for (int64_t j = jb; j < je; ++j) { float x = a[j * as], y = b[j * bs]; o[j * os] = EXPR; } } \
    } \
}
BINARY(k_add, x + y)
BINARY(k_sub, x - y)
BINARY(k_mul, x * y)
BINARY(k_div, x / y)

#define UNARY(NAME, EXPR) \
HOT static void NAME(const flare_cmd *c, int64_t ob, int64_t oe, int64_t jb, int64_t je) { \
    const int64_t os = c->os[3], as = c->ss[0][3]; \
    const float p0 = (float)c->fp[0], p1 = (float)c->fp[1]; (void)p0; (void)p1; \
    OUTER3(c) { \
        float *o = (float *)c->out + OFF(c->os, c); \
        const float *a = (const float *)c->src[0] + OFF(c->ss[0], c); \
        if (os == 1 && as == 1) { for (int64_t j = jb; j < je; ++j) { float x = a[j]; o[j] = EXPR; } } \
        else { for (int64_t j = jb; j < je; ++j) { float x = a[j * as]; o[j * os] = EXPR; } } \
    } \
}
UNARY(k_scale, x * p0 + p1)
UNARY(k_relu, x > 0.0f ? x : 0.0f)
UNARY(k_leaky_relu, x > 0.0f ? x : x * p0)
UNARY(k_sigmoid, sigmoid_f(x))
UNARY(k_silu, x / (1.0f + vexp(-x)))
UNARY(k_gelu, gelu_f(x))
UNARY(k_erf, verf_rational(x))
UNARY(k_tanh, vtanh(x))
UNARY(k_exp, vexp(x))
UNARY(k_sqrt, sqrtf(x))
UNARY(k_neg, -x)
UNARY(k_sqr, x * x)

#define COPY(NAME, T, SRC_T, CONV) \
static void NAME(const flare_cmd *c, int64_t ob, int64_t oe, int64_t jb, int64_t je) { \
    const int64_t os = c->os[3], as = c->ss[0][3]; \
    OUTER3(c) { \
        T *o = (T *)c->out + OFF(c->os, c); \
        const SRC_T *a = (const SRC_T *)c->src[0] + OFF(c->ss[0], c); \
        if (os == 1 && as == 1) { for (int64_t j = jb; j < je; ++j) o[j] = CONV(a[j]); } \
        else { for (int64_t j = jb; j < je; ++j) o[j * os] = CONV(a[j * as]); } \
    } \
}
#define ID(v) (v)
#define TRUNC_I32(v) ((int32_t)(v))
#define TO_F32(v) ((float)(v))
COPY(k_copy4, uint32_t, uint32_t, ID)
COPY(k_copy2, uint16_t, uint16_t, ID)
COPY(k_copy8, uint64_t, uint64_t, ID)
COPY(k_cast_f32_i32, int32_t, float, TRUNC_I32)
COPY(k_cast_i32_f32, float, int32_t, TO_F32)
COPY(k_cast_f16_f32, float, _Float16, TO_F32)

/* ---- matmul ------------------------------------------------------------------
 * out [ne0, ne1, M, N] contiguous rows; a strides ss[0] (batch0, batch1, m, k);
 * b strides ss[1] as the logical [batch0, batch1, k, n]. ip: M, N, K, ta, lda, tb, ldb, route
 * (which of the kernels below; commands.py picks it from the shapes and layouts). */
/* Small products skip BLAS's dispatch: out = a @ b with b rows of unit stride (sbn == 1)
 * or b columns of unit stride (sbk == 1, a weight stored [N, K]). */
HOT static void small_gemm(int64_t M, int64_t N, int64_t K, const float *a, int64_t sam, int64_t sak,
                           const float *b, int64_t sbk, int64_t sbn, float *o, int64_t ldo) {
    if (sbn == 1) {
        for (int64_t m = 0; m < M; ++m) {
            float *orow = o + m * ldo;
            for (int64_t n = 0; n < N; ++n) orow[n] = 0.0f;
            for (int64_t k = 0; k < K; ++k) {
                const float av = a[m * sam + k * sak];
                const float *brow = b + k * sbk;
                for (int64_t n = 0; n < N; ++n) orow[n] += av * brow[n];
            }
        }
    } else {
        for (int64_t m = 0; m < M; ++m)
            for (int64_t n = 0; n < N; ++n) {
                const float *arow = a + m * sam, *bcol = b + n * sbn;
                float acc = 0.0f;
                if (sak == 1) {
#pragma omp simd reduction(+:acc)
                    for (int64_t k = 0; k < K; ++k) acc += arow[k] * bcol[k];
                } else {
                    for (int64_t k = 0; k < K; ++k) acc += arow[k * sak] * bcol[k];
                }
                o[m * ldo + n] = acc;
            }
    }
}

/* a [M, K] (unit k stride, rows lda apart) times w stored [N, K] (rows ldw apart), transposed:
 * each block of 4 weight rows is read from memory once and met by 4 rows of a at a time, so a
 * batch-1 layer streams its weight once instead of BLAS's pack-then-multiply (which reads it twice
 * and writes a copy). Measured faster than OpenBLAS up to 16 rows (bench in the commit message). */
HOT static void wdot(int64_t M, int64_t N, int64_t K, const float *a, int64_t lda, const float *w, int64_t ldw,
                     float *o, int64_t ldo) {
    int64_t n = 0;
    for (; n + 4 <= N; n += 4) {
        const float *w0 = w + n * ldw, *w1 = w0 + ldw, *w2 = w1 + ldw, *w3 = w2 + ldw;
        int64_t m = 0;
        for (; m + 4 <= M; m += 4) {
            const float *a0 = a + m * lda, *a1 = a0 + lda, *a2 = a1 + lda, *a3 = a2 + lda;
            float s00 = 0, s01 = 0, s02 = 0, s03 = 0, s10 = 0, s11 = 0, s12 = 0, s13 = 0;
            float s20 = 0, s21 = 0, s22 = 0, s23 = 0, s30 = 0, s31 = 0, s32 = 0, s33 = 0;
#pragma omp simd reduction(+:s00,s01,s02,s03,s10,s11,s12,s13,s20,s21,s22,s23,s30,s31,s32,s33)
            for (int64_t k = 0; k < K; ++k) {
                const float x0 = a0[k], x1 = a1[k], x2 = a2[k], x3 = a3[k], y0 = w0[k], y1 = w1[k], y2 = w2[k], y3 = w3[k];
                s00 += x0 * y0; s01 += x0 * y1; s02 += x0 * y2; s03 += x0 * y3;
                s10 += x1 * y0; s11 += x1 * y1; s12 += x1 * y2; s13 += x1 * y3;
                s20 += x2 * y0; s21 += x2 * y1; s22 += x2 * y2; s23 += x2 * y3;
                s30 += x3 * y0; s31 += x3 * y1; s32 += x3 * y2; s33 += x3 * y3;
            }
            float *o0 = o + m * ldo + n, *o1 = o0 + ldo, *o2 = o1 + ldo, *o3 = o2 + ldo;
            o0[0] = s00; o0[1] = s01; o0[2] = s02; o0[3] = s03;
            o1[0] = s10; o1[1] = s11; o1[2] = s12; o1[3] = s13;
            o2[0] = s20; o2[1] = s21; o2[2] = s22; o2[3] = s23;
            o3[0] = s30; o3[1] = s31; o3[2] = s32; o3[3] = s33;
        }
        for (; m < M; ++m) {
            const float *ar = a + m * lda;
            float s0 = 0, s1 = 0, s2 = 0, s3 = 0;
#pragma omp simd reduction(+:s0,s1,s2,s3)
            for (int64_t k = 0; k < K; ++k) { const float x = ar[k]; s0 += x * w0[k]; s1 += x * w1[k]; s2 += x * w2[k]; s3 += x * w3[k]; }
            float *orow = o + m * ldo + n;
            orow[0] = s0; orow[1] = s1; orow[2] = s2; orow[3] = s3;
        }
    }
    for (; n < N; ++n)
        for (int64_t m = 0; m < M; ++m) {
            const float *ar = a + m * lda, *wr = w + n * ldw;
            float acc = 0;
#pragma omp simd reduction(+:acc)
            for (int64_t k = 0; k < K; ++k) acc += ar[k] * wr[k];
            o[m * ldo + n] = acc;
        }
}

/* ---- batch-invariant float products ----------------------------------------------------
 * A row's result must not depend on how many rows share its step (decode of one sequence, a
 * batch of them, prefill chunks, speculative verify steps: flare serve's answers must equal their
 * sequential runs). So every float matmul that is not pre-packed computes each output element by
 * one fixed formula of its a-row and b-column, whatever M, N, the blocking or the thread split:
 *  - idot (b read along k with unit stride, e.g. keys [R, D] at attention scores): 8 lanes,
 *    lane l accumulating k = l, l+8, ... by fmaf in increasing k, then the fixed tree
 *    ((l0+l4)+(l2+l6))+((l1+l5)+(l3+l7)).
 *  - ichain (anything else, e.g. values [R, D] at attention's context): one fmaf chain in
 *    increasing k.
 * fmaf is exactly rounded, so a lane's arithmetic is the same whether GCC vectorizes it (AVX2,
 * AVX-512) or not (the default clone calls libm's fmaf): the same bits on every x86 CPU. The
 * kernels are compiled per ISA with FMA enabled (not via target_clones, whose "avx2" clone lacks
 * FMA) and picked at first use. */
#define ILANES 8
#define INV_INL static inline __attribute__((always_inline))

INV_INL float ilanes_sum(const float *s) {
    return ((s[0] + s[4]) + (s[2] + s[6])) + ((s[1] + s[5]) + (s[3] + s[7]));
}

/* out[m, n] = dot(a row m, w row n) over K, a [M, K] and w [N, K] both with unit k stride;
 * 2 rows x 4 weight rows per block share their loads (16 lane-vectors of accumulators). */
INV_INL void idot_body(int64_t M, int64_t N, int64_t K, const float *a, int64_t lda, const float *w,
                       int64_t ldw, float *o, int64_t ldo) {
    const int64_t K8 = K / ILANES * ILANES;
    int64_t n = 0;
    for (; n < N; n += 4) {
        const int64_t nc = N - n < 4 ? N - n : 4;
        const float *wr[4];
        for (int j = 0; j < 4; ++j) wr[j] = w + (n + (j < nc ? j : 0)) * ldw;
        for (int64_t m = 0; m < M; m += 2) {
            const int64_t mc = M - m < 2 ? M - m : 2;
            const float *ar[2] = { a + m * lda, a + (m + (mc > 1 ? 1 : 0)) * lda };
            float s[2][4][ILANES];
            for (int r = 0; r < 2; ++r)
                for (int j = 0; j < 4; ++j)
                    for (int l = 0; l < ILANES; ++l) s[r][j][l] = 0.0f;
            for (int64_t k = 0; k < K8; k += ILANES)
                for (int r = 0; r < 2; ++r)
                    for (int j = 0; j < 4; ++j)
                        for (int l = 0; l < ILANES; ++l)
                            s[r][j][l] = __builtin_fmaf(ar[r][k + l], wr[j][k + l], s[r][j][l]);
            for (int64_t k = K8; k < K; ++k)   /* the tail: lane k - K8, still increasing k (the SIMD */
                for (int r = 0; r < 2; ++r)    /* versions pad it with zeros: fma(0, 0, s) = s) */
                    for (int j = 0; j < 4; ++j)
                        s[r][j][k - K8] = __builtin_fmaf(ar[r][k], wr[j][k], s[r][j][k - K8]);
            for (int r = 0; r < mc; ++r)
                for (int j = 0; j < nc; ++j) o[(m + r) * ldo + n + j] = ilanes_sum(s[r][j]);
        }
    }
}

/* ichain's columns left over by the vector blocks (or every column of a strided b): one exactly
 * rounded FMA chain over k per output, the same order as the blocks' lanes. */
INV_INL void ichain_scalar(int64_t M, int64_t N, int64_t K, const float *a, int64_t sam, int64_t sak, const float *b,
                           int64_t sbk, int64_t sbn, float *o, int64_t ldo) {
    for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < N; ++n) {
            float acc = 0.0f;
            for (int64_t k = 0; k < K; ++k) acc = __builtin_fmaf(a[m * sam + k * sak], b[k * sbk + n * sbn], acc);
            o[m * ldo + n] = acc;
        }
}

/* out[m, n] = one fmaf chain over k of a[m, k] b[k, n] (any strides; b's n stride 1 vectorizes
 * over 16 columns, 4 rows at a time). */
INV_INL void ichain_body(int64_t M, int64_t N, int64_t K, const float *a, int64_t sam, int64_t sak,
                         const float *b, int64_t sbk, int64_t sbn, float *o, int64_t ldo) {
    if (sbn == 1) {
        int64_t n = 0;
        for (; n + 16 <= N; n += 16) {
            int64_t m = 0;
            for (; m + 4 <= M; m += 4) {
                float acc[4][16];
                for (int r = 0; r < 4; ++r) for (int j = 0; j < 16; ++j) acc[r][j] = 0.0f;
                for (int64_t k = 0; k < K; ++k) {
                    const float *br = b + k * sbk + n;
                    for (int r = 0; r < 4; ++r) {
                        const float x = a[(m + r) * sam + k * sak];
                        for (int j = 0; j < 16; ++j) acc[r][j] = __builtin_fmaf(x, br[j], acc[r][j]);
                    }
                }
                for (int r = 0; r < 4; ++r) for (int j = 0; j < 16; ++j) o[(m + r) * ldo + n + j] = acc[r][j];
            }
            for (; m < M; ++m) {
                float acc[16];
                for (int j = 0; j < 16; ++j) acc[j] = 0.0f;
                for (int64_t k = 0; k < K; ++k) {
                    const float x = a[m * sam + k * sak], *br = b + k * sbk + n;
                    for (int j = 0; j < 16; ++j) acc[j] = __builtin_fmaf(x, br[j], acc[j]);
                }
                for (int j = 0; j < 16; ++j) o[m * ldo + n + j] = acc[j];
            }
        }
        if (n == N) return;
        b += n; o += n; N -= n;
    }
    ichain_scalar(M, N, K, a, sam, sak, b, sbk, sbn, o, ldo);
}

typedef void (*idot_t)(int64_t, int64_t, int64_t, const float *, int64_t, const float *, int64_t, float *, int64_t);
typedef void (*ichain_t)(int64_t, int64_t, int64_t, const float *, int64_t, int64_t, const float *, int64_t, int64_t,
                         float *, int64_t);
static void idot_plain(int64_t M, int64_t N, int64_t K, const float *a, int64_t lda, const float *w, int64_t ldw,
                        float *o, int64_t ldo) { idot_body(M, N, K, a, lda, w, ldw, o, ldo); }
static void ichain_plain(int64_t M, int64_t N, int64_t K, const float *a, int64_t sam, int64_t sak, const float *b,
                         int64_t sbk, int64_t sbn, float *o, int64_t ldo) {
    ichain_body(M, N, K, a, sam, sak, b, sbk, sbn, o, ldo);
}
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__)
#include <immintrin.h>
#endif
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__)
#define INV_SIMD 1
#define INV_AVX2 __attribute__((target("avx2,fma")))

/* ilanes_sum of one 8-lane vector: [l0+l4, l1+l5, l2+l6, l3+l7], then (t0+t2) and (t1+t3), then their sum */
INV_INL INV_AVX2 float ilanes_sum256(__m256 v) {
    const __m128 t = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 u = _mm_add_ps(t, _mm_movehl_ps(t, t));
    return _mm_cvtss_f32(_mm_add_ss(u, _mm_shuffle_ps(u, u, 1)));
}

/* the tail of k (K % 8 values) zero-padded into a vector: fma(0, 0, s) leaves s as it is (s is
 * never -0: a sum that starts at +0 reaches zero only as +0), as the plain version's tail does */
INV_INL INV_AVX2 __m256 itail(const float *p, int64_t rem) {
    float t[ILANES] = {0};
    for (int64_t l = 0; l < rem; ++l) t[l] = p[l];
    return _mm256_loadu_ps(t);
}

/* MR rows x NR weight rows, every k: s[r][j] lanes as in idot_body */
#define IDOT_TILE(MR, NR)                                                                              \
    do {                                                                                               \
        __m256 s[MR][NR];                                                                              \
        for (int r = 0; r < MR; ++r) for (int j = 0; j < NR; ++j) s[r][j] = _mm256_setzero_ps();      \
        for (int64_t k = 0; k < K8; k += ILANES) {                                                     \
            __m256 x[MR];                                                                              \
            for (int r = 0; r < MR; ++r) x[r] = _mm256_loadu_ps(ar[r] + k);                            \
            for (int j = 0; j < NR; ++j) {                                                             \
                const __m256 y = _mm256_loadu_ps(wr[j] + k);                                           \
                for (int r = 0; r < MR; ++r) s[r][j] = _mm256_fmadd_ps(x[r], y, s[r][j]);              \
            }                                                                                          \
        }                                                                                              \
        if (K8 < K) {                                                                                  \
            for (int j = 0; j < NR; ++j) {                                                             \
                const __m256 y = itail(wr[j] + K8, K - K8);                                            \
                for (int r = 0; r < MR; ++r) s[r][j] = _mm256_fmadd_ps(itail(ar[r] + K8, K - K8), y, s[r][j]); \
            }                                                                                          \
        }                                                                                              \
        for (int r = 0; r < mc; ++r)                                                                   \
            for (int j = 0; j < nc; ++j) o[(m + r) * ldo + n + j] = ilanes_sum256(s[r][j]);           \
    } while (0)

/* ilanes_sum256 of eight vectors at once, the same additions in the same order (so the same
 * bits): lanes l and l+4 of each (s[j] | s[j+4] in one register), then (l0+l4)+(l2+l6) and
 * (l1+l5)+(l3+l7), then their sum (hadd); out[j] is s[j]'s. One output at a time cost a
 * reduction of ~5 dependent operations per output, more than its multiply-adds when K is a
 * head's 32 (attention scores at decode: 1025 keys x 8 heads, 36 us a layer on one core). */
INV_INL INV_AVX2 __m256 ilanes_sum256x8(const __m256 *s) {
    __m256 t[4];
    for (int j = 0; j < 4; ++j)
        t[j] = _mm256_add_ps(_mm256_permute2f128_ps(s[j], s[j + 4], 0x20), _mm256_permute2f128_ps(s[j], s[j + 4], 0x31));
    const __m256 q01 = _mm256_add_ps(_mm256_shuffle_ps(t[0], t[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                     _mm256_shuffle_ps(t[0], t[1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m256 q23 = _mm256_add_ps(_mm256_shuffle_ps(t[2], t[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                     _mm256_shuffle_ps(t[2], t[3], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm256_hadd_ps(q01, q23);
}

/* idot at M = 1: one row against 8 weight rows at a time, 8 outputs reduced together. The 8 rows
 * are read side by side (8 streams a row apart), which the hardware prefetchers follow poorly: a
 * 512 x 256 expert from memory ran at ~5-7 GB/s on one core of the 2-core EPYC where a linear
 * read of it ran at ~12-16. Where the rows are back to back, each k step asks for 4 lines of the
 * next 8 rows in address order (into L1; into L2, or a row's line at a time, was slower):
 * 9-15 GB/s, alternated runs on the loaded machine. */
INV_AVX2 static void idot_row_avx2(int64_t N, int64_t K, const float *a, const float *w, int64_t ldw, float *o) {
    const int64_t K8 = K / ILANES * ILANES;
    const int dense = ldw == K && K % 16 == 0;  /* rows back to back (an expert, a weight): one stream */
    for (int64_t n = 0; n < N; n += 8) {
        const int64_t nc = N - n < 8 ? N - n : 8;
        const float *wr[8];
        for (int j = 0; j < 8; ++j) wr[j] = w + (n + (j < nc ? j : 0)) * ldw;
        __m256 s[8];
        for (int j = 0; j < 8; ++j) s[j] = _mm256_setzero_ps();
        for (int64_t k = 0; k < K8; k += ILANES) {
            const __m256 x = _mm256_loadu_ps(a + k);
            if (dense && n + 8 < N) {  /* the next 8 rows' K/2 lines, 4 per k step, in address order */
                const char *next = (const char *)(w + (n + 8) * ldw) + k * 32;
                for (int l = 0; l < 4; ++l) _mm_prefetch(next + 64 * l, _MM_HINT_T0);
            }
            for (int j = 0; j < 8; ++j) s[j] = _mm256_fmadd_ps(x, _mm256_loadu_ps(wr[j] + k), s[j]);
        }
        if (K8 < K) {
            const __m256 x = itail(a + K8, K - K8);
            for (int j = 0; j < 8; ++j) s[j] = _mm256_fmadd_ps(x, itail(wr[j] + K8, K - K8), s[j]);
        }
        const __m256 r = ilanes_sum256x8(s);
        if (nc == 8) _mm256_storeu_ps(o + n, r);
        else {
            float t[8];
            _mm256_storeu_ps(t, r);
            for (int64_t j = 0; j < nc; ++j) o[n + j] = t[j];
        }
    }
}

INV_AVX2 static void idot_avx2(int64_t M, int64_t N, int64_t K, const float *a, int64_t lda, const float *w,
                               int64_t ldw, float *o, int64_t ldo) {
    const int64_t K8 = K / ILANES * ILANES;
    if (M == 1) {   /* decode */
        idot_row_avx2(N, K, a, w, ldw, o);
        return;
    }
    for (int64_t n = 0; n < N; n += 4) {
        const int64_t nc = N - n < 4 ? N - n : 4;
        const float *wr[4];
        for (int j = 0; j < 4; ++j) wr[j] = w + (n + (j < nc ? j : 0)) * ldw;
        for (int64_t m = 0; m < M; m += 3) {
            const int64_t mc = M - m < 3 ? M - m : 3;
            const float *ar[3];
            for (int r = 0; r < 3; ++r) ar[r] = a + (m + (r < mc ? r : 0)) * lda;
            IDOT_TILE(3, 4);
        }
    }
}

/* one row, NV 8-column vectors from column n: NV FMA chains; a k whose a value is 0 is skipped
 * (fma(0, y, s) = s for finite y, and s is never -0: see itail) */
#define ICHAIN_ROW(NV)                                                                                 \
    do {                                                                                               \
        __m256 c[NV];                                                                                  \
        for (int v = 0; v < NV; ++v) c[v] = _mm256_setzero_ps();                                       \
        for (int64_t k = 0; k < K; ++k) {                                                              \
            const float xv = ar[k * sak];                                                              \
            if (xv == 0.0f) continue;                                                                  \
            const __m256 x = _mm256_set1_ps(xv);                                                       \
            const float *br = b + k * sbk + n;                                                         \
            for (int v = 0; v < NV; ++v) c[v] = _mm256_fmadd_ps(x, _mm256_loadu_ps(br + 8 * v), c[v]); \
        }                                                                                              \
        for (int v = 0; v < NV; ++v) _mm256_storeu_ps(o + m * ldo + n + 8 * v, c[v]);                 \
    } while (0)

/* ichain_body in AVX2: 4 rows x 16 columns (8 chains; a k where all four a values are 0 is
 * skipped), the rows after the last full 4 one at a time, 64 or 16 columns per pass. Skipping
 * zeros (attention's masked keys: most of the KV rows at a decode step) is exact for finite b. */
INV_AVX2 static void ichain_avx2(int64_t M, int64_t N, int64_t K, const float *a, int64_t sam, int64_t sak,
                                 const float *b, int64_t sbk, int64_t sbn, float *o, int64_t ldo) {
    if (sbn == 1) {
        const int64_t N16 = N / 16 * 16;
        int64_t m = 0;
        for (; m + 4 <= M; m += 4)
            for (int64_t n = 0; n < N16; n += 16) {
                const float *ar[4] = { a + m * sam, a + (m + 1) * sam, a + (m + 2) * sam, a + (m + 3) * sam };
                __m256 c0[4], c1[4];
                for (int r = 0; r < 4; ++r) { c0[r] = _mm256_setzero_ps(); c1[r] = _mm256_setzero_ps(); }
                for (int64_t k = 0; k < K; ++k) {
                    const float x0 = ar[0][k * sak], x1 = ar[1][k * sak], x2 = ar[2][k * sak], x3 = ar[3][k * sak];
                    if (x0 == 0.0f && x1 == 0.0f && x2 == 0.0f && x3 == 0.0f) continue;
                    const float xs[4] = { x0, x1, x2, x3 };
                    const float *br = b + k * sbk + n;
                    const __m256 y0 = _mm256_loadu_ps(br), y1 = _mm256_loadu_ps(br + 8);
                    for (int r = 0; r < 4; ++r) {
                        const __m256 x = _mm256_set1_ps(xs[r]);
                        c0[r] = _mm256_fmadd_ps(x, y0, c0[r]);
                        c1[r] = _mm256_fmadd_ps(x, y1, c1[r]);
                    }
                }
                for (int r = 0; r < 4; ++r) {
                    _mm256_storeu_ps(o + (m + r) * ldo + n, c0[r]);
                    _mm256_storeu_ps(o + (m + r) * ldo + n + 8, c1[r]);
                }
            }
        for (; m < M; ++m) {
            const float *ar = a + m * sam;
            int64_t n = 0;
            for (; n + 64 <= N16; n += 64) ICHAIN_ROW(8);
            for (; n < N16; n += 16) ICHAIN_ROW(2);
        }
        if (N16 == N) return;
        b += N16; o += N16; N -= N16;
    }
    ichain_scalar(M, N, K, a, sam, sak, b, sbk, sbn, o, ldo);
}
#endif
static idot_t g_idot = 0;
static ichain_t g_ichain = 0;

/* which invariant kernels run: 0 plain C, 1 AVX2+FMA (also on AVX-512 CPUs: 8 lanes is the
 * formula, and the same bits either way: see above). `want` < 0 keeps the best the CPU has. */
int32_t flare_invariant_isa(int32_t want) {
    g_idot = idot_plain; g_ichain = ichain_plain;
#ifdef INV_SIMD
    __builtin_cpu_init();
    if (want != 0 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
        g_idot = idot_avx2; g_ichain = ichain_avx2; return 1;
    }
#endif
    return 0;
}

/* ---- packed weights ------------------------------------------------------------
 * A constant weight stored [N, K] is packed once at compile time (commands.py, `pack_weight`)
 * into panels of 16 output columns, each [K][16] contiguous, zero-padded to a multiple of 16
 * columns: the layout onnxruntime's MLAS pre-packs initializers into. A register-blocked
 * microkernel then reads one 16-column panel row per k with aligned-width loads and broadcasts
 * a's element: AVX-512 keeps 8 rows x 32 columns (16 zmm accumulators), AVX2 6 rows x 16 columns
 * (12 ymm). Panels outer, row blocks inner, so a panel (<= 192 KiB at K = 1536) stays in L2 while
 * every row block meets it and the weight is streamed from memory once. K runs in blocks of
 * about KC_MAX (a row block's slice of a stays in L1) and rows in chunks whose a fits L2
 * (pgemm_chunked): measured (bench/cpu_packed_gemm.py) 1.1-1.7x OpenBLAS at MiniLM's shapes
 * from 8 to 448 rows. */
#define PANEL 16
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__)
#include <immintrin.h>
#define PACKED_SIMD 1
#define AVX512 __attribute__((target("avx512f,avx2,fma")))
#define AVX2F __attribute__((target("avx2,fma")))
#define INL static inline __attribute__((always_inline))

/* Up to this many rows run as one tile (28 accumulators + 2 panel vectors + the broadcast: 31 of
 * the 32 zmm registers), so at MiniLM batch 1 (7-24 tokens) each panel is read from memory once
 * under a full tile's FMAs. A tile of 8 rows is memory-bound on the panel stream (MiniLM's 42 MiB
 * of packed weights at ~16 GB/s), and the rows after it re-read the panel from cache; 15-28 rows
 * run as 14 + the rest (the first tile streams, so it is the big one), more in tiles of 8.
 * Measured on MiniLM's 36 weights (see the README): 11 rows 3.0-3.3 ms against 3.5-3.9, 17-20
 * rows 3-7% less, 24 even. Each output element is the same FMA chain either way. */
#define MR_ONE_PASS 14

INL AVX512 void ptile512(const int MR, int64_t K, const float *a, int64_t lda, const float *p0, const float *p1,
                          float *o, int64_t ldo, int64_t ncols, int acc) {
    __m512 c0[MR_ONE_PASS], c1[MR_ONE_PASS];
    const __mmask16 m0 = ncols >= PANEL ? 0xFFFF : (__mmask16)((1u << ncols) - 1u);
    const __mmask16 m1 = ncols >= 2 * PANEL ? 0xFFFF : ncols <= PANEL ? 0 : (__mmask16)((1u << (ncols - PANEL)) - 1u);
    if (acc) {
#pragma GCC unroll 14
        for (int r = 0; r < MR; ++r) {
            c0[r] = _mm512_maskz_loadu_ps(m0, o + r * ldo);
            c1[r] = _mm512_maskz_loadu_ps(m1, o + r * ldo + PANEL);
        }
    } else {
#pragma GCC unroll 14
        for (int r = 0; r < MR; ++r) { c0[r] = _mm512_setzero_ps(); c1[r] = _mm512_setzero_ps(); }
    }
    for (int64_t k = 0; k < K; ++k) {
        const __m512 w0 = _mm512_loadu_ps(p0 + k * PANEL), w1 = _mm512_loadu_ps(p1 + k * PANEL);
#pragma GCC unroll 14
        for (int r = 0; r < MR; ++r) {
            const __m512 x = _mm512_set1_ps(a[r * lda + k]);
            c0[r] = _mm512_fmadd_ps(x, w0, c0[r]);
            c1[r] = _mm512_fmadd_ps(x, w1, c1[r]);
        }
    }
    if (ncols >= 2 * PANEL) {
#pragma GCC unroll 14
        for (int r = 0; r < MR; ++r) { _mm512_storeu_ps(o + r * ldo, c0[r]); _mm512_storeu_ps(o + r * ldo + PANEL, c1[r]); }
    } else {
#pragma GCC unroll 14
        for (int r = 0; r < MR; ++r) {
            _mm512_mask_storeu_ps(o + r * ldo, m0, c0[r]);
            _mm512_mask_storeu_ps(o + r * ldo + PANEL, m1, c1[r]);
        }
    }
}

/* K in blocks of about KC_MAX: a row block's slice of a (8 x KC floats) stays in L1 while the
 * panel slices stream past it; later blocks add to the partial sums already in o. 384 measured
 * best of 256/384/512 (256 splits K = 384 and re-reads a 1 MiB output chunk; 512 spills L1). */
#define KC_MAX 384
#define KBLOCKS(K, kc) const int64_t nkb_ = ((K) + KC_MAX - 1) / KC_MAX, kc = ((K) + nkb_ - 1) / nkb_

AVX512 static void pgemm_avx512(int64_t M, int64_t N, int64_t K, const float *a, int64_t lda, const float *pw,
                                float *o, int64_t ldo) {
    const int64_t panels = (N + PANEL - 1) / PANEL;
    KBLOCKS(K, kc);
    for (int64_t kb = 0; kb < K; kb += kc) {
        const int64_t kn = K - kb < kc ? K - kb : kc;
        const int acc = kb > 0;
        for (int64_t p = 0; p < panels; p += 2) {
            const float *p0 = pw + p * K * PANEL + kb * PANEL, *p1 = p + 1 < panels ? p0 + K * PANEL : p0;
            const int64_t nc = N - p * PANEL < 2 * PANEL ? N - p * PANEL : 2 * PANEL;
            float *oc = o + p * PANEL;
            int64_t m = 0;
            if (M > 2 * MR_ONE_PASS)
                for (; m + 8 <= M; m += 8) ptile512(8, kn, a + m * lda + kb, lda, p0, p1, oc + m * ldo, ldo, nc, acc);
            else if (M > MR_ONE_PASS) {  /* the first tile streams the panel: make it the big one */
                ptile512(MR_ONE_PASS, kn, a + kb, lda, p0, p1, oc, ldo, nc, acc);
                m = MR_ONE_PASS;
            }
            const float *am = a + m * lda + kb;
            float *om = oc + m * ldo;
            switch (M - m) {
            case 14: ptile512(14, kn, am, lda, p0, p1, om, ldo, nc, acc); break;
            case 13: ptile512(13, kn, am, lda, p0, p1, om, ldo, nc, acc); break;
            case 12: ptile512(12, kn, am, lda, p0, p1, om, ldo, nc, acc); break;
            case 11: ptile512(11, kn, am, lda, p0, p1, om, ldo, nc, acc); break;
            case 10: ptile512(10, kn, am, lda, p0, p1, om, ldo, nc, acc); break;
            case 9: ptile512(9, kn, am, lda, p0, p1, om, ldo, nc, acc); break;
            case 8: ptile512(8, kn, am, lda, p0, p1, om, ldo, nc, acc); break;
            case 7: ptile512(7, kn, am, lda, p0, p1, om, ldo, nc, acc); break;
            case 6: ptile512(6, kn, am, lda, p0, p1, om, ldo, nc, acc); break;
            case 5: ptile512(5, kn, am, lda, p0, p1, om, ldo, nc, acc); break;
            case 4: ptile512(4, kn, am, lda, p0, p1, om, ldo, nc, acc); break;
            case 3: ptile512(3, kn, am, lda, p0, p1, om, ldo, nc, acc); break;
            case 2: ptile512(2, kn, am, lda, p0, p1, om, ldo, nc, acc); break;
            case 1: ptile512(1, kn, am, lda, p0, p1, om, ldo, nc, acc); break;
            default: break;
            }
        }
    }
}

INL AVX2F void ptile256(const int MR, int64_t K, const float *a, int64_t lda, const float *p0,
                         float *o, int64_t ldo, int64_t ncols, int acc) {
    __m256 c0[6], c1[6];
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r) {
        if (!acc) { c0[r] = _mm256_setzero_ps(); c1[r] = _mm256_setzero_ps(); }
        else if (ncols >= PANEL) { c0[r] = _mm256_loadu_ps(o + r * ldo); c1[r] = _mm256_loadu_ps(o + r * ldo + 8); }
        else {
            float t[PANEL] = {0};
            for (int64_t j = 0; j < ncols; ++j) t[j] = o[r * ldo + j];
            c0[r] = _mm256_loadu_ps(t); c1[r] = _mm256_loadu_ps(t + 8);
        }
    }
    for (int64_t k = 0; k < K; ++k) {
        const __m256 w0 = _mm256_loadu_ps(p0 + k * PANEL), w1 = _mm256_loadu_ps(p0 + k * PANEL + 8);
#pragma GCC unroll 6
        for (int r = 0; r < MR; ++r) {
            const __m256 x = _mm256_broadcast_ss(a + r * lda + k);
            c0[r] = _mm256_fmadd_ps(x, w0, c0[r]);
            c1[r] = _mm256_fmadd_ps(x, w1, c1[r]);
        }
    }
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r) {
        if (ncols >= PANEL) { _mm256_storeu_ps(o + r * ldo, c0[r]); _mm256_storeu_ps(o + r * ldo + 8, c1[r]); }
        else {
            float t[PANEL];
            _mm256_storeu_ps(t, c0[r]); _mm256_storeu_ps(t + 8, c1[r]);
            for (int64_t j = 0; j < ncols; ++j) o[r * ldo + j] = t[j];
        }
    }
}

AVX2F static void pgemm_avx2(int64_t M, int64_t N, int64_t K, const float *a, int64_t lda, const float *pw,
                             float *o, int64_t ldo) {
    const int64_t panels = (N + PANEL - 1) / PANEL;
    KBLOCKS(K, kc);
    for (int64_t kb = 0; kb < K; kb += kc) {
        const int64_t kn = K - kb < kc ? K - kb : kc;
        const int acc = kb > 0;
        for (int64_t p = 0; p < panels; ++p) {
            const float *p0 = pw + p * K * PANEL + kb * PANEL;
            const int64_t nc = N - p * PANEL < PANEL ? N - p * PANEL : PANEL;
            float *oc = o + p * PANEL;
            int64_t m = 0;
            for (; m + 6 <= M; m += 6) ptile256(6, kn, a + m * lda + kb, lda, p0, oc + m * ldo, ldo, nc, acc);
            const float *am = a + m * lda + kb;
            float *om = oc + m * ldo;
            switch (M - m) {
            case 5: ptile256(5, kn, am, lda, p0, om, ldo, nc, acc); break;
            case 4: ptile256(4, kn, am, lda, p0, om, ldo, nc, acc); break;
            case 3: ptile256(3, kn, am, lda, p0, om, ldo, nc, acc); break;
            case 2: ptile256(2, kn, am, lda, p0, om, ldo, nc, acc); break;
            case 1: ptile256(1, kn, am, lda, p0, om, ldo, nc, acc); break;
            default: break;
            }
        }
    }
}
#endif

/* portable fallback over the same layout (machines without AVX2) */
static void pgemm_plain(int64_t M, int64_t N, int64_t K, const float *a, int64_t lda, const float *pw,
                        float *o, int64_t ldo) {
    for (int64_t p = 0; p * PANEL < N; ++p) {
        const float *pp = pw + p * K * PANEL;
        const int64_t nc = N - p * PANEL < PANEL ? N - p * PANEL : PANEL;
        for (int64_t m = 0; m < M; ++m) {
            float acc[PANEL] = {0};
            for (int64_t k = 0; k < K; ++k) {
                const float x = a[m * lda + k];
                for (int j = 0; j < PANEL; ++j) acc[j] += x * pp[k * PANEL + j];
            }
            for (int64_t j = 0; j < nc; ++j) o[m * ldo + p * PANEL + j] = acc[j];
        }
    }
}

typedef void (*pgemm_t)(int64_t, int64_t, int64_t, const float *, int64_t, const float *, float *, int64_t);
static pgemm_t g_pgemm = 0;

/* Rows per chunk: a chunk's rows of a (at most PGEMM_A_BYTES) stay in L2 while every panel passes;
 * the weight streams once per chunk (once in all up to that many rows: MiniLM batch 1). */
#define PGEMM_A_BYTES (256 * 1024)
static void pgemm_chunked(pgemm_t f, int64_t M, int64_t N, int64_t K, const float *a, int64_t lda, const float *pw,
                          float *o, int64_t ldo) {
    int64_t mc = PGEMM_A_BYTES / (K * (int64_t)sizeof(float)) / 24 * 24;
    if (mc < 24) mc = 24;
    for (int64_t m = 0; m < M; m += mc) f(M - m < mc ? M - m : mc, N, K, a + m * lda, lda, pw, o + m * ldo, ldo);
}

int32_t flare_packed_isa(int32_t want);

static void pgemm(int64_t M, int64_t N, int64_t K, const float *a, int64_t lda, const float *pw, float *o, int64_t ldo) {
    if (!g_pgemm) flare_packed_isa(-1);
    pgemm_chunked(g_pgemm, M, N, K, a, lda, pw, o, ldo);
}

/* which microkernel pgemm runs: 0 plain C, 1 AVX2, 2 AVX-512. `want` < 0 keeps the best the CPU
 * has; else the best at or below `want` (tests run every variant the machine supports). */
int32_t flare_packed_isa(int32_t want) {
    g_pgemm = pgemm_plain;
#ifdef PACKED_SIMD
    __builtin_cpu_init();
    if ((want < 0 || want >= 2) && __builtin_cpu_supports("avx512f")) { g_pgemm = pgemm_avx512; return 2; }
    if ((want < 0 || want >= 1) && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
        g_pgemm = pgemm_avx2; return 1;
    }
#endif
    return 0;
}

/* ---- fused --------------------------------------------------------------------------
 * linear: out = act(a @ b + bias) + residual: K_MATMUL's operands and params, then an epilogue
 * over each output row. src[2] bias (a row of N, stride ss[2][3]; NULL: none), src[3] residual
 * (strides ss[3], broadcast to out; NULL: none). flags & 3: 0 none, 1 gelu, 2 relu, 3 sigmoid. */
HOT static void epilogue_rows(float *o, int64_t rows, int64_t n, int64_t ldo, const float *bias, int64_t bs,
                          const float *res, int64_t res_row, int64_t res_col, int act) {
    for (int64_t r = 0; r < rows; ++r) {
        float *orow = o + r * ldo;
        if (bias) for (int64_t j = 0; j < n; ++j) orow[j] += bias[j * bs];
        if (act == 1) for (int64_t j = 0; j < n; ++j) orow[j] = gelu_f(orow[j]);
        else if (act == 2) for (int64_t j = 0; j < n; ++j) orow[j] = orow[j] > 0.0f ? orow[j] : 0.0f;
        else if (act == 3) for (int64_t j = 0; j < n; ++j) orow[j] = sigmoid_f(orow[j]);
        if (res) { const float *rr = res + r * res_row; for (int64_t j = 0; j < n; ++j) orow[j] += rr[j * res_col]; }
    }
}

/* Routes (ip[7], chosen by commands.py): */
enum { R_GEMM = 0, R_GEMV_T = 1, R_GEMV_N = 2, R_WDOT = 3, R_SWAP = 4, R_SMALL = 5, R_PACKED = 6, R_IDOT = 7, R_ICHAIN = 8 };

/* One batch's product over output rows [m0, m1) and columns [n0, n1): what a thread runs of a
 * split matmul (every route takes a column range; GEMM and SMALL also a row range). Each output
 * element is computed by the same code in the same order whatever the range, so a split result
 * equals the serial one bit for bit (BLAS is single-threaded under the pool: blas.py). */
static void mm_block(const flare_cmd *c, const float *a, const float *b, float *o, int64_t m0, int64_t m1,
                     int64_t n0, int64_t n1) {
    const int64_t M = c->ip[0], K = c->ip[2], ldo = c->os[2], nn = n1 - n0, mm = m1 - m0;
    if (nn <= 0 || mm <= 0) return;
    switch ((int)c->ip[7]) {
    case R_GEMV_T: gemv(NT, nn, K, b + n0 * c->ip[6], c->ip[6], a, c->ss[0][3], 0.0f, o + n0, 1); break;
    case R_GEMV_N: gemv(TR, K, nn, b + n0, c->ip[6], a, c->ss[0][3], 0.0f, o + n0, 1); break;
    case R_WDOT: wdot(M, nn, K, a, c->ip[4], b + n0 * c->ip[6], c->ip[6], o + n0, ldo); break;
    case R_PACKED:  /* n0: a multiple of PANEL; rows [m0, m1) (A_TILES) */
        pgemm(mm, nn, K, a + m0 * c->ip[4], c->ip[4], b + n0 * K, o + m0 * ldo + n0, ldo);
        break;
    case R_IDOT:
        if (!g_idot) flare_invariant_isa(-1);
        g_idot(mm, nn, K, a + m0 * c->ss[0][2], c->ss[0][2], b + n0 * c->ss[1][3], c->ss[1][3], o + m0 * ldo + n0, ldo);
        break;
    case R_ICHAIN:
        if (!g_ichain) flare_invariant_isa(-1);
        g_ichain(mm, nn, K, a + m0 * c->ss[0][2], c->ss[0][2], c->ss[0][3], b + n0 * c->ss[1][3], c->ss[1][2],
                 c->ss[1][3], o + m0 * ldo + n0, ldo);
        break;
    case R_SMALL: {
        const int64_t sbn = c->ss[1][3] == 1 ? 1 : c->ss[1][3];
        small_gemm(mm, nn, K, a + m0 * c->ss[0][2], c->ss[0][2], c->ss[0][3], b + n0 * sbn, c->ss[1][2], sbn,
                   o + m0 * ldo + n0, ldo);
        break;
    }
    case R_SWAP: {
        /* 16-64 rows times a weight stored [N, K]: OpenBLAS computes (W a^T)^T 1.2-3x faster
         * than a W^T at these shapes (16x384x384 .. 64x1536x384); transpose back. The scratch
         * holds W a^T [N, M]: a column range writes its own rows of it. */
        float *t = (float *)c->scratch;
        gemm(NT, TR, nn, M, K, b + n0 * c->ip[6], c->ip[6], a, c->ip[4], 0.0f, t + n0 * M, M);
        for (int64_t m = 0; m < M; ++m)
            for (int64_t n = n0; n < n1; ++n) o[m * ldo + n] = t[n * M + m];
        break;
    }
    default:
        gemm((int)c->ip[3], (int)c->ip[5], mm, nn, K, a + m0 * c->ss[0][2], c->ip[4], b + n0 * c->ss[1][3], c->ip[6],
             0.0f, o + m0 * ldo + n0, ldo);
    }
}

static int mm_needs_blas(const flare_cmd *c) {
    const int route = (int)c->ip[7];
    return route != R_SMALL && route != R_WDOT && route != R_PACKED && route != R_IDOT && route != R_ICHAIN;
}

/* Batches [q0, q1) (flattened i0, i1), rows [m0, m1), columns [n0, n1); linear adds its epilogue
 * (bias, activation, residual) over the same block. */
static void mm_range(const flare_cmd *c, int64_t q0, int64_t q1, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
    for (int64_t q = q0; q < q1; ++q) {
        const int64_t i0 = q / c->ne[1], i1 = q % c->ne[1];
        const float *a = (const float *)c->src[0] + i0 * c->ss[0][0] + i1 * c->ss[0][1];
        const float *b = (const float *)c->src[1] + i0 * c->ss[1][0] + i1 * c->ss[1][1];
        float *o = (float *)c->out + i0 * c->os[0] + i1 * c->os[1];
        mm_block(c, a, b, o, m0, m1, n0, n1);
        if (c->kind == K_LINEAR && m1 > m0 && n1 > n0) {
            const float *bias = c->src[2] ? (const float *)c->src[2] + n0 * c->ss[2][3] : 0;
            const float *res = c->src[3] ? (const float *)c->src[3] + i0 * c->ss[3][0] + i1 * c->ss[3][1]
                                               + m0 * c->ss[3][2] + n0 * c->ss[3][3] : 0;
            epilogue_rows(o + m0 * c->os[2] + n0, m1 - m0, n1 - n0, c->os[2], bias, c->ss[2][3], res, c->ss[3][2],
                          c->ss[3][3], c->flags & 3);
        }
    }
}

/* matmul and linear, serial */
static int k_matmul(const flare_cmd *c) {
    if (mm_needs_blas(c) && !g_sgemm) return ERR_NOBLAS;
    mm_range(c, 0, c->ne[0] * c->ne[1], 0, c->ip[0], 0, c->ip[1]);
    return 0;
}

/* ---- rows: norms, softmax ------------------------------------------------------ */
/* One row: mean (when centering) and mean square in double, then one scaling pass. */
HOT static void norm_row(float *o, int64_t os, const float *a, int64_t as, int64_t n, int center, double eps) {
    double mean = 0.0, ss = 0.0;
    if (as == 1) {
        if (center) {
#pragma omp simd reduction(+:mean)
            for (int64_t j = 0; j < n; ++j) mean += a[j];
            mean /= (double)n;
        }
        const float mu = (float)mean;
#pragma omp simd reduction(+:ss)
        for (int64_t j = 0; j < n; ++j) { const double d = (double)(a[j] - mu); ss += d * d; }
    } else {
        if (center) { for (int64_t j = 0; j < n; ++j) mean += a[j * as]; mean /= (double)n; }
        const float mu = (float)mean;
        for (int64_t j = 0; j < n; ++j) { const double d = (double)(a[j * as] - mu); ss += d * d; }
    }
    const float inv = (float)(1.0 / sqrt(ss / (double)n + eps)), mu = (float)mean;
    if (as == 1 && os == 1) for (int64_t j = 0; j < n; ++j) o[j] = (a[j] - mu) * inv;
    else for (int64_t j = 0; j < n; ++j) o[j * os] = (a[j * as] - mu) * inv;
}

static void k_norm(const flare_cmd *c, int center, int64_t ob, int64_t oe) {
    OUTER3(c) norm_row((float *)c->out + OFF(c->os, c), c->os[3], (const float *)c->src[0] + OFF(c->ss[0], c),
                       c->ss[0][3], c->ne[3], center, c->fp[0]);
}

/* softmax(x * scale + mask) over one row; m may be NULL */
HOT static void softmax_row(float *o, int64_t os, const float *a, int64_t as, const float *m, int64_t ms,
                            int64_t n, float scale) {
    float mx = -INFINITY;
    if (os == 1 && as == 1 && (!m || ms == 1) && n < 16) {
        /* short rows (MiniLM's attention at batch 1: 12 heads x 8-24 tokens of 8-24 keys): the
         * AVX-512 clone's 16 lanes never fill and the loops ran as scalar remainders (7 us for
         * 96 rows of 8); 8 lanes do them as one vector */
        if (m) for (int64_t j = 0; j < n; ++j) o[j] = a[j] * scale + m[j];
        else for (int64_t j = 0; j < n; ++j) o[j] = a[j] * scale;
#pragma omp simd simdlen(8) reduction(max:mx)
        for (int64_t j = 0; j < n; ++j) mx = o[j] > mx ? o[j] : mx;
        float sum = 0.0f;
#pragma omp simd simdlen(8) reduction(+:sum)
        for (int64_t j = 0; j < n; ++j) { const float e = vexp(o[j] - mx); o[j] = e; sum += e; }
        const float inv = 1.0f / sum;
        for (int64_t j = 0; j < n; ++j) o[j] *= inv;
        return;
    }
    if (os == 1 && as == 1 && (!m || ms == 1)) {
        if (m) for (int64_t j = 0; j < n; ++j) o[j] = a[j] * scale + m[j];
        else for (int64_t j = 0; j < n; ++j) o[j] = a[j] * scale;
#pragma omp simd reduction(max:mx)
        for (int64_t j = 0; j < n; ++j) mx = o[j] > mx ? o[j] : mx;
        float sum = 0.0f;
#pragma omp simd reduction(+:sum)
        for (int64_t j = 0; j < n; ++j) { const float e = vexp(o[j] - mx); o[j] = e; sum += e; }
        const float inv = 1.0f / sum;
        for (int64_t j = 0; j < n; ++j) o[j] *= inv;
        return;
    }
    for (int64_t j = 0; j < n; ++j) {
        float v = a[j * as] * scale;
        if (m) v += m[j * ms];
        o[j * os] = v;
        mx = v > mx ? v : mx;
    }
    double sum = 0.0;
    for (int64_t j = 0; j < n; ++j) { const float e = vexp(o[j * os] - mx); o[j * os] = e; sum += e; }
    const float inv = (float)(1.0 / sum);
    for (int64_t j = 0; j < n; ++j) o[j * os] *= inv;
}

static void k_softmax(const flare_cmd *c, int64_t ob, int64_t oe) {
    OUTER3(c) softmax_row((float *)c->out + OFF(c->os, c), c->os[3], (const float *)c->src[0] + OFF(c->ss[0], c),
                          c->ss[0][3], c->src[1] ? (const float *)c->src[1] + OFF(c->ss[1], c) : 0, c->ss[1][3],
                          c->ne[3], (float)c->fp[0]);
}

/* ---- indexing ------------------------------------------------------------------- */
/* out [i0, i1, i2, D]; idx (i32, or i64 when ip[1]) strides ss[1][0..2]; table rows ss[0][2], cols ss[0][3];
 * ip[0] = rows of the table; ip[2] = table is f16 */
static int k_get_rows(const flare_cmd *c, int64_t ob, int64_t oe) {
    const int64_t d = c->ne[3], os = c->os[3], rs = c->ss[0][2], cs = c->ss[0][3];
    OUTER3(c) {
        const int64_t off = OFF(c->ss[1], c);
        const int64_t r = c->ip[1] ? ((const int64_t *)c->src[1])[off] : ((const int32_t *)c->src[1])[off];
        if (r < -c->ip[0] || r >= c->ip[0]) return ERR_INDEX;
        const int64_t row = r < 0 ? r + c->ip[0] : r;
        float *o = (float *)c->out + OFF(c->os, c);
        if (c->ip[2]) { const _Float16 *t = (const _Float16 *)c->src[0] + row * rs; for (int64_t j = 0; j < d; ++j) o[j * os] = (float)t[j * cs]; }
        else { const float *t = (const float *)c->src[0] + row * rs; for (int64_t j = 0; j < d; ++j) o[j * os] = t[j * cs]; }
    }
    return 0;
}

/* x [N, H, D] in ne[1..3] (ne[0] == 1), pos i32 [N] (stride ss[1][1]); fp0 base, ip0 neox */
static void k_rope(const flare_cmd *c, int64_t tb, int64_t te) {
    const int64_t H = c->ne[2], D = c->ne[3], half = D / 2;
    const int neox = (int)c->ip[0];
    for (int64_t t = tb; t < te; ++t) {
        const double p = (double)((const int32_t *)c->src[1])[t * c->ss[1][1]];
        for (int64_t i = 0; i < half; ++i) {
            const double ang = p * pow(c->fp[0], -2.0 * (double)i / (double)D);
            const float cs = (float)cos(ang), sn = (float)sin(ang);
            const int64_t ia = neox ? i : 2 * i, ib = neox ? i + half : 2 * i + 1;
            for (int64_t h = 0; h < H; ++h) {
                const float *x = (const float *)c->src[0] + t * c->ss[0][1] + h * c->ss[0][2];
                float *o = (float *)c->out + t * c->os[1] + h * c->os[2];
                const float a = x[ia * c->ss[0][3]], b = x[ib * c->ss[0][3]];
                o[ia * c->os[3]] = a * cs - b * sn;
                o[ib * c->os[3]] = a * sn + b * cs;
            }
        }
    }
}

/* out [i0, i1, i2, k] = x[i0, i1, i2, idx[...]] over the last axis; ip0 = n of x */
static int k_gather(const flare_cmd *c, int64_t ob, int64_t oe) {
    const int64_t k = c->ne[3];
    OUTER3(c) {
        const float *x = (const float *)c->src[0] + OFF(c->ss[0], c);
        const int32_t *id = (const int32_t *)c->src[1] + OFF(c->ss[1], c);
        float *o = (float *)c->out + OFF(c->os, c);
        for (int64_t j = 0; j < k; ++j) {
            int64_t r = id[j * c->ss[1][3]];
            if (r < -c->ip[0] || r >= c->ip[0]) return ERR_INDEX;
            if (r < 0) r += c->ip[0];
            o[j * c->os[3]] = x[r * c->ss[0][3]];
        }
    }
    return 0;
}

/* dst rows (f32, contiguous [R, D] at out) <- src [T, D]; idx i32 [T]; ip0 = R */
static int k_set_rows(const flare_cmd *c) {
    const int64_t T = c->ne[2], D = c->ne[3], R = c->ip[0];
    for (int64_t t = 0; t < T; ++t) {
        int64_t r = ((const int32_t *)c->src[1])[t * c->ss[1][2]];
        if (r < -R || r >= R) return ERR_INDEX;
        if (r < 0) r += R;
        float *o = (float *)c->out + r * D;
        const float *s = (const float *)c->src[2] + t * c->ss[2][2];
        for (int64_t j = 0; j < D; ++j) o[j] = s[j * c->ss[2][3]];
    }
    return 0;
}

/* ---- reductions over the last (moved) axis: out [i0, i1, i2] ------------------------ */
static void k_reduce(const flare_cmd *c, int kind, int64_t ob, int64_t oe) {
    const int64_t n = c->ip[0], as = c->ss[0][3];
    OUTER3(c) {
        const float *a = (const float *)c->src[0] + OFF(c->ss[0], c);
        void *o = (char *)c->out + 4 * OFF(c->os, c);
        if (kind == K_MAX) { float m = a[0]; for (int64_t j = 1; j < n; ++j) m = a[j * as] > m ? a[j * as] : m; *(float *)o = m; }
        else if (kind == K_ARGMAX) {
            float m = a[0]; int32_t best = 0;
            for (int64_t j = 1; j < n; ++j) if (a[j * as] > m) { m = a[j * as]; best = (int32_t)j; }
            *(int32_t *)o = best;
        } else {
            double s = 0.0; for (int64_t j = 0; j < n; ++j) s += a[j * as];
            *(float *)o = (float)(kind == K_MEAN ? s / (double)n : s);
        }
    }
}

/* indices of the k largest along the last axis, largest first, ties by lower index; ip0 = n */
static void k_top_k(const flare_cmd *c, int64_t ob, int64_t oe) {
    const int64_t k = c->ne[3], n = c->ip[0], as = c->ss[0][3];
    OUTER3(c) {
        const float *a = (const float *)c->src[0] + OFF(c->ss[0], c);
        int32_t *o = (int32_t *)c->out + OFF(c->os, c);
        for (int64_t j = 0; j < k; ++j) {
            int64_t best = -1;
            for (int64_t i = 0; i < n; ++i) {
                int taken = 0;
                for (int64_t q = 0; q < j; ++q) if (o[q * c->os[3]] == i) { taken = 1; break; }
                if (taken) continue;
                if (best < 0 || a[i * as] > a[best * as]) best = i;
            }
            o[j * c->os[3]] = (int32_t)best;
        }
    }
}

#include "conv1d.h"  /* conv1d_units, conv1d_phase */

static int k_conv1d(const flare_cmd *c) {
    for (int ph = 0; ph < 3; ++ph) {
        int64_t grain;
        const int e = conv1d_phase(c, ph, 0, conv1d_units(c, ph, &grain));
        if (e) return e;
    }
    return 0;
}

/* ---- pad: out [ne] f32; ip[0..3] pads before each axis, ip[4..7] the source shape;
 * flags & 1: reflect, else the constant fp0. Rows [ob, oe) of the outer axes (a split unit each):
 * a row is a source row (or, padded with a constant, all fp0) whose inner axis is copied in one
 * run with its edges filled. Why by rows: the per-element form (four axes' index arithmetic per
 * output) took ~1 ms of silero-vad's 512-window offline pass (~7% of it) for a 1.3 MB copy. */
static void k_pad(const flare_cmd *c, int64_t ob, int64_t oe) {
    const int reflect = c->flags & 1;
    const float val = (float)c->fp[0];
    const float *src = (const float *)c->src[0];
    const int64_t n3 = c->ip[7], lo3 = c->ip[3], ne3 = c->ne[3], xs = c->ss[0][3], os = c->os[3];
    OUTER3(c) {
        float *o = (float *)c->out + OFF(c->os, c);
        const int64_t idx[3] = {i0, i1, i2};
        int64_t off = 0; int inside = 1;
        for (int d = 0; d < 3; ++d) {
            int64_t p = idx[d] - c->ip[d];
            const int64_t n = c->ip[4 + d];
            if (p < 0 || p >= n) {
                if (!reflect) { inside = 0; break; }
                if (p < 0) p = -p;
                if (p >= n) p = 2 * (n - 1) - p;
            }
            off += p * c->ss[0][d];
        }
        if (!inside) { for (int64_t j = 0; j < ne3; ++j) o[j * os] = val; continue; }
        const float *x = src + off;
        /* the source's run [lo3, lo3 + n3) of the output row, clipped to it (pads may be negative) */
        int64_t a = lo3 < 0 ? 0 : lo3 > ne3 ? ne3 : lo3, b = lo3 + n3 > ne3 ? ne3 : lo3 + n3;
        if (b < a) b = a;
        for (int64_t j = 0; j < a; ++j) {
            int64_t p = j - lo3;
            if (!reflect) { o[j * os] = val; continue; }
            if (p < 0) p = -p;
            if (p >= n3) p = 2 * (n3 - 1) - p;
            o[j * os] = x[p * xs];
        }
        if (os == 1 && xs == 1) memcpy(o + a, x + (a - lo3), (size_t)(b - a) * sizeof(float));
        else for (int64_t j = a; j < b; ++j) o[j * os] = x[(j - lo3) * xs];
        for (int64_t j = b; j < ne3; ++j) {
            int64_t p = j - lo3;
            if (!reflect) { o[j * os] = val; continue; }
            if (p >= n3) p = 2 * (n3 - 1) - p;
            if (p < 0) p = -p;
            o[j * os] = x[p * xs];
        }
    }
}

/* ---- mul_mat_id: out [T, kk, N] contiguous; w [E, N, K] (ss[0][1..3], k stride 1);
 * x rows (ss[1][1] per token, ss[1][2] per slot, 0 when shared; unit k stride); ids i32 [T, kk]
 * (ss[2][1..2]). ip: E, N, K, f16 weights. ne = {1, T, kk, N}. Tokens sharing an expert are
 * gathered into one GEMM (a GEMV for one token). Scratch: xs [T*kk, K], ys [T*kk, N], order
 * [T*kk] (the (t, j) slots grouped by expert, in order), off [E + 2] (where each expert's slots
 * start; off[E + 1]: how many experts are used, -1 for a bad id), used [E] (those experts).
 * Thread 0 groups, then the used experts are shared out between the threads: each writes its
 * own experts' rows of xs, ys and out, so a decode step's experts run side by side. */
static int mul_mat_id_phase(const flare_cmd *c, int phase, int64_t u0, int64_t u1) {
    if (!g_sgemm) return ERR_NOBLAS;
    const int64_t T = c->ne[1], kk = c->ne[2], E = c->ip[0], N = c->ip[1], K = c->ip[2], TK = T * kk;
    const int32_t *ids = (const int32_t *)c->src[2];
    const float *x = (const float *)c->src[1];
    float *out = (float *)c->out;
    float *xs = (float *)c->scratch, *ys = xs + TK * K;
    int32_t *order = (int32_t *)(ys + TK * N), *off = order + TK, *used = off + E + 2;
    if (phase == 0) {  /* group the slots by expert (one chunk) */
        int32_t bad = 0, nused = 0;
        for (int64_t e = 0; e <= E; ++e) off[e] = 0;
        for (int64_t t = 0; t < T && !bad; ++t) for (int64_t j = 0; j < kk; ++j) {
            const int32_t e = ids[t * c->ss[2][1] + j * c->ss[2][2]];
            if (e < 0 || e >= E) { bad = 1; break; }
            off[e + 1]++;
        }
        if (!bad) {
            for (int64_t e = 0; e < E; ++e) {
                if (off[e + 1]) used[nused++] = (int32_t)e;
                off[e + 1] += off[e];
            }
            for (int32_t u = 0; u < nused; ++u) {  /* each expert's slots in (t, j) order */
                const int32_t e = used[u];
                int64_t r = off[e];
                for (int64_t t = 0; t < T; ++t) for (int64_t j = 0; j < kk; ++j)
                    if (ids[t * c->ss[2][1] + j * c->ss[2][2]] == e) order[r++] = (int32_t)(t * kk + j);
            }
        }
        off[E + 1] = bad ? -1 : nused;
        return bad ? ERR_INDEX : 0;
    }
    for (int64_t u = u0; u < u1; ++u) {  /* phase 1: used experts [u0, u1) */
        const int64_t e = used[u], first = off[e], cnt = off[e + 1] - off[e];
        const int32_t *rows = order + first;
        const float *w = (const float *)c->src[0] + e * c->ss[0][1];
        if (cnt == 1) {  /* a matvec: idot, as a decode step's (mul_mat_id_slots): the same bits, and prefetched */
            const int64_t t = rows[0] / kk, j = rows[0] % kk;
            if (!g_idot) flare_invariant_isa(-1);
            g_idot(1, N, K, x + t * c->ss[1][1] + j * c->ss[1][2], K, w, c->ss[0][2], out + rows[0] * N, N);
            continue;
        }
        float *xe = xs + first * K, *ye = ys + first * N;
        for (int64_t r = 0; r < cnt; ++r) {
            const int64_t t = rows[r] / kk, j = rows[r] % kk;
            memcpy(xe + r * K, x + t * c->ss[1][1] + j * c->ss[1][2], (size_t)K * sizeof(float));
        }
        gemm(NT, TR, cnt, N, K, xe, K, w, c->ss[0][2], 0.0f, ye, N);
        for (int64_t r = 0; r < cnt; ++r) memcpy(out + rows[r] * N, ye + r * N, (size_t)N * sizeof(float));
    }
    return 0;
}

/* experts phase 0 found in use (-1: a bad id) */
static int64_t mul_mat_id_used(const flare_cmd *c) {
    const int64_t TK = c->ne[1] * c->ne[2], N = c->ip[1], K = c->ip[2], E = c->ip[0];
    const int32_t *off = (const int32_t *)((float *)c->scratch + TK * (K + N)) + TK;
    return off[E + 1];
}

/* One token (a decode step): its kk slots' experts are distinct (top-k), so there is nothing to
 * group (the grouping step was a hand-over of its own between the threads, 12 per moe-lm small
 * decode step). Units are (slot, block of MMID_ROWS expert rows), so 2 threads share 2 slots'
 * matvecs in chunks of ~128 KiB of weights rather than one whole expert each (a thread that joins
 * late still finds work). idot: each output one fixed formula, so any split gives the same bits. */
#define MMID_ROWS 64
static int64_t mul_mat_id_slot_units(const flare_cmd *c) { return c->ne[2] * ((c->ip[1] + MMID_ROWS - 1) / MMID_ROWS); }

static int mul_mat_id_slots(const flare_cmd *c, int64_t u0, int64_t u1) {
    const int64_t E = c->ip[0], N = c->ip[1], K = c->ip[2], blocks = (N + MMID_ROWS - 1) / MMID_ROWS;
    const int32_t *ids = (const int32_t *)c->src[2];
    const float *x = (const float *)c->src[1];
    if (!g_idot) flare_invariant_isa(-1);
    for (int64_t u = u0; u < u1; ++u) {
        const int64_t j = u / blocks, n0 = u % blocks * MMID_ROWS, nn = N - n0 < MMID_ROWS ? N - n0 : MMID_ROWS;
        const int32_t e = ids[j * c->ss[2][2]];
        if (e < 0 || e >= E) return ERR_INDEX;
        g_idot(1, nn, K, x + j * c->ss[1][2], K, (const float *)c->src[0] + e * c->ss[0][1] + n0 * c->ss[0][2],
               c->ss[0][2], (float *)c->out + j * N + n0, N);
    }
    return 0;
}

static int k_mul_mat_id(const flare_cmd *c) {
    if (c->ne[1] == 1) return mul_mat_id_slots(c, 0, mul_mat_id_slot_units(c));
    const int e = mul_mat_id_phase(c, 0, 0, 0);
    return e ? e : mul_mat_id_phase(c, 1, 0, mul_mat_id_used(c));
}

/* norm then affine: out = norm(x) * gamma + beta (src[1] gamma, src[2] beta: rows of n, unit stride;
 * beta may be NULL). flags & 1: layer norm (centered), else RMS norm. */
static void k_norm_affine(const flare_cmd *c, int64_t ob, int64_t oe) {
    k_norm(c, c->flags & 1, ob, oe);
    const int64_t n = c->ne[3], os = c->os[3];
    const float *g = (const float *)c->src[1], *b = (const float *)c->src[2];
    const int64_t gs = c->ss[1][3], bs = c->ss[2][3];
    OUTER3(c) {
        float *o = (float *)c->out + OFF(c->os, c);
        if (b) for (int64_t j = 0; j < n; ++j) o[j * os] = o[j * os] * g[j * gs] + b[j * bs];
        else for (int64_t j = 0; j < n; ++j) o[j * os] = o[j * os] * g[j * gs];
    }
}

/* ---- lstm: T steps of the recurrence in one command ----------------------------------------
 * x [T, B, 4H] f32 (strides ss[0][1..3]); w [4H, H] contiguous; h0, c0 [B, H] (strides ss[1], ss[2]
 * [2..3]); out [T, B, 2H] contiguous: h_t then c_t. ne = {1, T, B, 2H}; ip[0] = H; ip[1] = 1: w is
 * the packed copy of a constant W_hh (pgemm per step), else w [4H, H] rows (wdot per step).
 * scratch: see below. Gate order i, f, g, o (flare.core.ops.nn). Each step is
 * one product for all batch rows and the cell update per row. */
/* the cell update of one batch row: z holds W_hh h (gate blocks i, f, g, o), x the input
 * projection (unit stride here: the loop vectorizes); h_t goes to ot[u], c_t to cb[u] and ot[H + u] */
HOT static void lstm_cell(int64_t H, int64_t u0, int64_t u1, const float *restrict z, const float *restrict x,
                          float *restrict cb, float *restrict ot) {
#pragma omp simd
    for (int64_t u = u0; u < u1; ++u) {
        const float cn = sigmoid_f(z[H + u] + x[H + u]) * cb[u] + sigmoid_f(z[u] + x[u]) * vtanh(z[2 * H + u] + x[2 * H + u]);
        const float hn = sigmoid_f(z[3 * H + u] + x[3 * H + u]) * vtanh(cn);
        cb[u] = cn; ot[u] = hn; ot[H + u] = cn;
    }
}

/* Phase 0 copies h0, c0 into the scratch; then ONE phase per step t (1 + t), over hidden units:
 * a chunk of units [u0, u1) computes the four gate columns of those units, z[g*H + u] = (W_hh h)
 * for g = i, f, g, o, then their cell update for every batch row. A unit's cell needs only its own
 * four gate columns, so no other chunk's result, and the step reads h_{t-1} from the output row
 * t - 1 (h0 from the scratch at t = 0) while it writes row t: one hand-over per step where the
 * product and the cell as two phases took two (silero-vad offline: 512 steps of ~2.8 us at one
 * thread, each hand-over ~0.3-1 us at two). Units split in blocks of 16 when H is a multiple of
 * 16, else a step is one chunk: a gate's columns then start on a packed panel (or a wdot block of
 * 4), so a column is computed by the same code as in one product over all 4H columns (the serial
 * run), and the cell loop runs whole vectors (a scalar tail may contract its multiply-adds
 * differently): the bits do not depend on the thread count. Threaded only
 * with x of unit stride (plan()): the strided case copies x rows through one shared scratch row. */
static int64_t lstm_grain(const flare_cmd *c) {
    const int64_t H = c->ip[0];
    return H % 16 == 0 ? 16 : H;
}
static int64_t lstm_units(const flare_cmd *c, int64_t phase, int64_t *grain) {
    if (phase == 0) { *grain = 1; return 1; }
    *grain = lstm_grain(c);
    return c->ip[0];
}

/* gate columns [n0, n0 + n) of z = W_hh h for the B rows of h (row stride ldh) */
static void lstm_gates(const flare_cmd *c, const float *h, int64_t ldh, float *z, int64_t n0, int64_t n) {
    const int64_t B = c->ne[2], H = c->ip[0];
    const float *w = (const float *)c->src[1];
    if (c->ip[1]) pgemm(B, n, H, h, ldh, w + n0 * H, z + n0, 4 * H);  /* w: packed panels (packing.py) */
    else wdot(B, n, H, h, ldh, w + n0 * H, H, z + n0, 4 * H);
}

static void lstm_phase(const flare_cmd *c, int64_t phase, int64_t r0, int64_t r1) {
    const int64_t B = c->ne[2], H = c->ip[0];
    const float *x = (const float *)c->src[0];
    const float *h0 = (const float *)c->src[2], *c0 = (const float *)c->src[3];
    /* scratch: h0 [B, H], c [B, H], z [B, 4H], and a contiguous copy of one x row [4H] */
    float *h = (float *)c->scratch, *cs = h + B * H, *z = cs + B * H, *xrow = z + B * 4 * H, *out = (float *)c->out;
    if (phase == 0) {
        for (int64_t b = 0; b < B; ++b)
            for (int64_t u = 0; u < H; ++u) {
                h[b * H + u] = h0[b * c->ss[1][2] + u * c->ss[1][3]];
                cs[b * H + u] = c0[b * c->ss[2][2] + u * c->ss[2][3]];
            }
        return;
    }
    const int64_t t = phase - 1, xs = c->ss[0][3];
    if (r1 <= r0) return;
    const float *hp = t == 0 ? h : out + (t - 1) * B * 2 * H;   /* h_{t-1}, rows H or 2H apart */
    const int64_t ldh = t == 0 ? H : 2 * H;
    if (r0 == 0 && r1 == H) lstm_gates(c, hp, ldh, z, 0, 4 * H);  /* the whole step: one product */
    else
        for (int64_t g = 0; g < 4; ++g) lstm_gates(c, hp, ldh, z, g * H + r0, r1 - r0);
    for (int64_t b = 0; b < B; ++b) {
        const float *xt = x + t * c->ss[0][1] + b * c->ss[0][2];
        if (xs != 1) {  /* serial only */
            for (int64_t j = 0; j < 4 * H; ++j) xrow[j] = xt[j * xs];
            xt = xrow;
        }
        lstm_cell(H, r0, r1, z + b * 4 * H, xt, cs + b * H, out + (t * B + b) * 2 * H);
    }
}

static void k_lstm(const flare_cmd *c) {
    for (int64_t ph = 0; ph < 1 + c->ne[1]; ++ph) {
        int64_t grain;
        lstm_phase(c, ph, 0, lstm_units(c, ph, &grain));
    }
}

/* ---- block-quantized weights (quant.h) ----------------------------------------------------
 * ip[0] is the weight's ggml type, ip[1] K (weights per row), ip[2] bytes per weight row,
 * ip[3] bytes per quantized activation row (qmatmul: ip[4], mul_mat_id_q: ip[5] = float activations:
 * each weight row dequantized, then float multiply-adds, for the few rows of a decode step). The
 * integer products run in two phases: the activation
 * rows are quantized into the scratch (phase 0, split by rows), then the weight rows meet them
 * (phase 1, split by weight rows). Every output element is one dot product computed whole by
 * one chunk, so results do not depend on the thread count. */

/* qmatmul: out [i0, i1, M, N] = a [i0, i1, M, K] (strides ss[0], unit k stride) @ w^T, w [N, K/block]
 * rows of blocks shared by every batch. scratch: the ne0*ne1*M activation rows. Phase 0 units:
 * activation rows; phase 1 units: weight rows (output columns). */
static int qmatmul_phase(const flare_cmd *c, int ph, int64_t b, int64_t e) {
    const int32_t type = (int32_t)c->ip[0];
    const int64_t B1 = c->ne[1], M = c->ne[2], K = c->ip[1], wrb = c->ip[2], xrb = c->ip[3];
    char *xq = (char *)c->scratch;
    if (c->ip[4]) {   /* float activations (ip[4]): nothing to quantize; phase 1 only */
        if (ph == 0) return 0;
        float wrow[K];
        for (int64_t i0 = 0; i0 < c->ne[0]; ++i0) for (int64_t i1 = 0; i1 < B1; ++i1)
            flare_qmatmul_rows_f32(type, c->src[1], wrb, K, (const float *)c->src[0] + i0 * c->ss[0][0] + i1 * c->ss[0][1],
                                   c->ss[0][2], M, wrow, (float *)c->out + i0 * c->os[0] + i1 * c->os[1], c->os[2], b, e);
        return 0;
    }
    if (ph == 0) {
        for (int64_t r = b; r < e; ++r) {
            const int64_t i0 = r / (B1 * M), i1 = r / M % B1, m = r % M;
            flare_qact_quantize_row(type, (const float *)c->src[0] + i0 * c->ss[0][0] + i1 * c->ss[0][1]
                                    + m * c->ss[0][2], xq + r * xrb, K);
        }
        return 0;
    }
    for (int64_t i0 = 0; i0 < c->ne[0]; ++i0) for (int64_t i1 = 0; i1 < B1; ++i1)
        flare_qmatmul_rows(type, c->src[1], wrb, K, xq + (i0 * B1 + i1) * M * xrb, xrb, M,
                           (float *)c->out + i0 * c->os[0] + i1 * c->os[1], c->os[2], b, e);
    return 0;
}

static int k_qmatmul(const flare_cmd *c) {
    qmatmul_phase(c, 0, 0, c->ne[0] * c->ne[1] * c->ne[2]);
    return qmatmul_phase(c, 1, 0, c->ne[3]);
}

/* dequantize: out [rows, K] contiguous = the rows of blocks src[0] (rows ip[2] bytes apart) */
static void k_dequantize(const flare_cmd *c, int64_t ob, int64_t oe) {
    const int64_t K = c->ip[1], wrb = c->ip[2];
    for (int64_t r = ob; r < oe; ++r)
        flare_dequantize_row((int32_t)c->ip[0], (const char *)c->src[0] + r * wrb, (float *)c->out + r * K, K);
}

/* get_rows_q: out [i0, i1, i2, K] contiguous; idx as k_get_rows (ip[5] = i64 indices); ip[4] = table rows */
static int k_get_rows_q(const flare_cmd *c, int64_t ob, int64_t oe) {
    const int64_t K = c->ip[1], wrb = c->ip[2], R = c->ip[4];
    OUTER3(c) {
        const int64_t off = OFF(c->ss[1], c);
        const int64_t r = c->ip[5] ? ((const int64_t *)c->src[1])[off] : ((const int32_t *)c->src[1])[off];
        if (r < -R || r >= R) return ERR_INDEX;
        flare_dequantize_row((int32_t)c->ip[0], (const char *)c->src[0] + (r < 0 ? r + R : r) * wrb,
                             (float *)c->out + OFF(c->os, c), K);
    }
    return 0;
}

/* mul_mat_id_q: out [T, kk, N] contiguous; w [E, N, K/block] (expert e at e * ip[6] bytes);
 * x rows (element strides ss[1][1] per token, ss[1][2] per slot, 0 when shared; unit k stride);
 * ids i32 [T, kk] (ss[2][1..2]); ip[4] = E. scratch: T * kk activation rows. Phase 0 (units:
 * the T * kk slots) checks each slot's expert and quantizes its row; phase 1 (units: expert
 * rows) runs every slot over its share of rows: decode has few tokens and many rows. */
static int mul_mat_id_q_phase(const flare_cmd *c, int ph, int64_t b, int64_t e) {
    const int32_t type = (int32_t)c->ip[0];
    const int64_t kk = c->ne[2], N = c->ne[3], K = c->ip[1], wrb = c->ip[2], xrb = c->ip[3], E = c->ip[4];
    const int fp = (int)c->ip[5];   /* float activations */
    const int32_t *ids = (const int32_t *)c->src[2];
    char *xq = (char *)c->scratch;
    if (ph == 0) {
        for (int64_t q = b; q < e; ++q) {
            const int32_t x = ids[q / kk * c->ss[2][1] + q % kk * c->ss[2][2]];
            if (x < 0 || x >= E) return ERR_INDEX;
            if (!fp)
                flare_qact_quantize_row(type, (const float *)c->src[1] + q / kk * c->ss[1][1] + q % kk * c->ss[1][2],
                                        xq + q * xrb, K);
        }
        return 0;
    }
    float wrow[fp ? K : 1];
    for (int64_t q = 0; q < c->ne[1] * kk; ++q) {
        const int32_t x = ids[q / kk * c->ss[2][1] + q % kk * c->ss[2][2]];
        const char *w = (const char *)c->src[0] + x * c->ip[6];
        if (fp)
            flare_qmatmul_rows_f32(type, w, wrb, K, (const float *)c->src[1] + q / kk * c->ss[1][1] + q % kk * c->ss[1][2],
                                   K, 1, wrow, (float *)c->out + q * N, N, b, e);
        else
            flare_qmatmul_rows(type, w, wrb, K, xq + q * xrb, xrb, 1, (float *)c->out + q * N, N, b, e);
    }
    return 0;
}

static int k_mul_mat_id_q(const flare_cmd *c) {
    const int err = mul_mat_id_q_phase(c, 0, 0, c->ne[1] * c->ne[2]);
    return err ? err : mul_mat_id_q_phase(c, 1, 0, c->ne[3]);
}

/* ---- the loop ------------------------------------------------------------------------ */
/* Elementwise and row kernels over outer rows [ob, oe) and, for elementwise, columns [jb, je). */
static int run_slice(const flare_cmd *c, int64_t ob, int64_t oe, int64_t jb, int64_t je) {
    switch (c->kind) {
    case K_COPY4: k_copy4(c, ob, oe, jb, je); return 0;
    case K_COPY2: k_copy2(c, ob, oe, jb, je); return 0;
    case K_COPY8: k_copy8(c, ob, oe, jb, je); return 0;
    case K_ADD: k_add(c, ob, oe, jb, je); return 0;
    case K_SUB: k_sub(c, ob, oe, jb, je); return 0;
    case K_MUL: k_mul(c, ob, oe, jb, je); return 0;
    case K_DIV: k_div(c, ob, oe, jb, je); return 0;
    case K_SCALE: k_scale(c, ob, oe, jb, je); return 0;
    case K_RELU: k_relu(c, ob, oe, jb, je); return 0;
    case K_LEAKY_RELU: k_leaky_relu(c, ob, oe, jb, je); return 0;
    case K_SIGMOID: k_sigmoid(c, ob, oe, jb, je); return 0;
    case K_SILU: k_silu(c, ob, oe, jb, je); return 0;
    case K_GELU: k_gelu(c, ob, oe, jb, je); return 0;
    case K_ERF: k_erf(c, ob, oe, jb, je); return 0;
    case K_TANH: k_tanh(c, ob, oe, jb, je); return 0;
    case K_EXP: k_exp(c, ob, oe, jb, je); return 0;
    case K_SQRT: k_sqrt(c, ob, oe, jb, je); return 0;
    case K_NEG: k_neg(c, ob, oe, jb, je); return 0;
    case K_SQR: k_sqr(c, ob, oe, jb, je); return 0;
    case K_CAST_F32_I32: k_cast_f32_i32(c, ob, oe, jb, je); return 0;
    case K_CAST_I32_F32: k_cast_i32_f32(c, ob, oe, jb, je); return 0;
    case K_CAST_F16_F32: k_cast_f16_f32(c, ob, oe, jb, je); return 0;
    case K_LAYER_NORM: k_norm(c, 1, ob, oe); return 0;
    case K_RMS_NORM: k_norm(c, 0, ob, oe); return 0;
    case K_SOFTMAX: k_softmax(c, ob, oe); return 0;
    case K_NORM_AFFINE: k_norm_affine(c, ob, oe); return 0;
    case K_GET_ROWS: return k_get_rows(c, ob, oe);
    case K_GATHER: return k_gather(c, ob, oe);
    case K_SUM: case K_MEAN: case K_MAX: case K_ARGMAX: k_reduce(c, c->kind, ob, oe); return 0;
    case K_TOP_K: k_top_k(c, ob, oe); return 0;
    case K_PAD: k_pad(c, ob, oe); return 0;
    case K_DEQUANTIZE: k_dequantize(c, ob, oe); return 0;
    case K_GET_ROWS_Q: return k_get_rows_q(c, ob, oe);
    default: return ERR_KIND;
    }
}

static int is_elementwise(int kind) {
    return (kind >= K_COPY4 && kind <= K_SQR) || (kind >= K_CAST_F32_I32 && kind <= K_CAST_F16_F32) ||
           kind == K_LEAKY_RELU || kind == K_ERF;
}

/* The `stage_experts` host node of a MoE model, run inside the walk (no host split: the walk
 * never leaves C). out: slots int32 [n_tok * k]; src[0]: expert ids int32 [n_tok * k]; src[1]:
 * KV rows int32 [n_tok] or NULL (a row == ip[2], the scratch row, is a padding token, which stages
 * nothing); src[2]: the layer's block (int64 [16], `WalkBlock` in native/staging.py): pointers
 * to the stager's arrays (table, expert_in, uses, last, counters, mark, record, info), the cache and
 * source row pointers and row bytes, its counters `acc` (int64 [8]: calls, needed, missing,
 * evicted, runs, copy ns, step ns, calls with a copy), then n_experts, slots, age_every,
 * n_tensors. ip[0] n_tok, ip[1] k. A failing step changes no state (staging.c checks first). */
static int k_stage_experts(const flare_cmd *c) {
    const int64_t *b = (const int64_t *)c->src[2];
    const int64_t n_tok = c->ip[0], k = c->ip[1];
    const int32_t *ids = (const int32_t *)c->src[0], *rows = (const int32_t *)c->src[1];
    int64_t *acc = (int64_t *)(intptr_t)b[11];
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    uint8_t small[256], *valid = 0, *heap = 0;
    if (rows) {  /* as the host callback: a valid mask only where a padding row is present */
        int64_t pad = 0;
        for (int64_t t = 0; t < n_tok; t++) pad |= rows[t] == c->ip[2];
        if (pad) {
            valid = n_tok <= (int64_t)sizeof small ? small : (heap = (uint8_t *)malloc((size_t)n_tok));
            if (!valid) return ERR_STAGE + 3;
            for (int64_t t = 0; t < n_tok; t++) valid[t] = rows[t] != c->ip[2];
        }
    }
    const int32_t st = flare_stage_experts(
        ids, n_tok, k, valid, (int32_t *)c->out, (int32_t *)(intptr_t)b[0], (int32_t *)(intptr_t)b[1],
        (double *)(intptr_t)b[2], (double *)(intptr_t)b[3], (int64_t *)(intptr_t)b[4], (int32_t)b[12],
        (int32_t)b[13], (int32_t)b[14], (int32_t)b[15], (uint8_t *const *)(intptr_t)b[8],
        (const uint8_t *const *)(intptr_t)b[9], (const int64_t *)(intptr_t)b[10], (uint8_t *)(intptr_t)b[5],
        (int32_t *)(intptr_t)b[6], (int64_t *)(intptr_t)b[7]);
    free(heap);
    if (st) return ERR_STAGE + st;
    const int64_t *info = (const int64_t *)(intptr_t)b[7];
    clock_gettime(CLOCK_MONOTONIC, &t1);
    acc[0] += 1; acc[1] += info[0]; acc[2] += info[1]; acc[3] += info[2]; acc[4] += info[3]; acc[5] += info[4];
    acc[6] += (int64_t)(t1.tv_sec - t0.tv_sec) * 1000000000 + (t1.tv_nsec - t0.tv_nsec);
    acc[7] += info[1] > 0;
    return 0;
}

static int run_one(const flare_cmd *c) {
    switch (c->kind) {
    case K_MATMUL: case K_LINEAR: return k_matmul(c);
    case K_ROPE: k_rope(c, 0, c->ne[1]); return 0;
    case K_CONV1D: return k_conv1d(c);
    case K_MUL_MAT_ID: return k_mul_mat_id(c);
    case K_SET_ROWS: return k_set_rows(c);
    case K_LSTM: k_lstm(c); return 0;
    case K_QMATMUL: return k_qmatmul(c);
    case K_MUL_MAT_ID_Q: return k_mul_mat_id_q(c);
    case K_STAGE_EXPERTS: return k_stage_experts(c);
    default:
        if (c->kind < 0 || c->kind >= K_COUNT) return ERR_KIND;
        return run_slice(c, 0, outer(c), 0, c->ne[3]);
    }
}

/* Run n commands in order. Returns 0, or (index of the failing command + 1); *err gets the code. */
int64_t flare_run(const flare_cmd *cmds, int64_t n, int32_t *err) {
    for (int64_t i = 0; i < n; ++i) {
        const int e = run_one(cmds + i);
        if (e) { *err = e; return i + 1; }
    }
    return 0;
}

/* ---- threads --------------------------------------------------------------------------
 * How a command splits across the threads of a pool (plan), and the walk that runs a command
 * list on them. The list is a sequence of *steps*: one per command, or one per phase of the
 * kernels that work in phases (conv1d, mul_mat_id, the LSTM's steps). A step is cut into chunks
 * (one for a command not worth splitting; up to 4 per thread otherwise, at fixed boundaries),
 * and every thread that takes part claims chunks of the current step from a shared counter;
 * whoever finishes a step's last chunk opens the next one. No thread ever waits for a thread,
 * only for chunks being run: a worker the OS delays or never schedules costs nothing, and the
 * caller alone can finish the list. Work below the thresholds is one chunk, where handing it
 * over (~1 us) would cost more than it saves. */
enum { SERIAL = 0, SERIAL_LONG = 1, SPLIT = 2 };
enum { A_OUTER, A_INNER, A_BATCH, A_MROWS, A_NCOLS, A_ROPE, A_WHOLE, A_TILES };
typedef struct { int mode, axis; int64_t units, grain, work; int nth; } plan_t;  /* work: ~multiply-adds */

#define MIN_SPLIT_CHEAP 65536     /* copies, add, mul, scale...: elements (~1 cycle each) */
#define MIN_SPLIT_ELEMS 16384     /* exp, gelu, tanh... and row kernels: elements */
#define MIN_SPLIT_FLOPS 131072    /* matmul-like: multiply-adds (~10 us on one core) */
#define LONG_SERIAL 262144        /* a serial step this big lets the waiting threads sleep at once */
#define MIN_SPLIT_STREAM 32768    /* a product of at most MATVEC_ROWS rows: b elements (128 KiB of f32) */
#define MATVEC_ROWS 4             /* ... such a product is bound by reading b (a weight, keys), not by its
                                   * multiply-adds: moe-lm small's 256 x 256 decode projections (64K
                                   * multiply-adds, 11 us on one core, 17 a step) ran serial at 2 threads */
#define MIN_POOL_WORK 2097152     /* a list whose split work is less runs on the caller alone: waking
                                   * the workers and waiting for them to leave costs more (~0.1 ms) */

/* A packed product with many rows and few column grains (MiniLM batch 32: 448 token rows, N = 384:
 * 12 panel pairs) splits by tiles of rows x panel pairs, not by panel pairs alone: a step ends
 * when its last chunk does, and with 12 chunks of ~0.1-0.4 ms over 2 threads the idle tail of each
 * of the 18 such steps was ~7% of a batch's time at 2 threads. Tiles are numbered column-major
 * (consecutive tiles share a panel pair, which stays in cache) and a row block is a multiple of 8
 * rows, so every output is still the same FMA chain: the same bits at any thread count. */
#define TILE_ROWS_MIN 64
/* ~16 tiles a thread (it was 8): a step's tail is a tile, and a thread slowed by another process
 * (the shared machine) or a late wake-up leaves at most a tile to the other; MiniLM batch 32's
 * N = 384 products: 3 row blocks of 152 rows x 12 panel pairs, each tile still ~0.1-0.5 ms, so
 * claiming one costs nothing measurable. */
#define TILES_PER_THREAD 16
static int64_t packed_row_blocks(int64_t M, int64_t N, int nth) {
    const int64_t cols = (N + 2 * PANEL - 1) / (2 * PANEL);
    if (nth < 2 || cols >= TILES_PER_THREAD * nth || M < 2 * TILE_ROWS_MIN) return 1;
    int64_t rb = (TILES_PER_THREAD * nth + cols - 1) / cols;     /* enough tiles for ~16 chunks a thread */
    const int64_t most = M / TILE_ROWS_MIN;
    return rb < most ? rb : most;
}
static int64_t packed_tile_rows(int64_t M, int64_t rb) { return ((M + rb - 1) / rb + 7) / 8 * 8; }
static int64_t packed_tiles(int64_t M, int64_t N, int nth) {
    const int64_t rb = packed_row_blocks(M, N, nth), mb = packed_tile_rows(M, rb);
    return (N + 2 * PANEL - 1) / (2 * PANEL) * ((M + mb - 1) / mb);
}

static plan_t plan(const flare_cmd *c, int nth) {
    plan_t p = { SERIAL, A_OUTER, 0, 1, 0, nth };
    const int64_t rows = outer(c);
    if (is_elementwise(c->kind)) {
        const int costly = (c->kind >= K_SIGMOID && c->kind <= K_SQRT) || c->kind == K_ERF;
        if (rows * c->ne[3] < (costly ? MIN_SPLIT_ELEMS : MIN_SPLIT_CHEAP)) return p;
        p.mode = SPLIT;
        p.work = rows * c->ne[3] * (costly ? 8 : 1);
        if (rows >= 2 * nth || (rows > 1 && rows * 16 >= c->ne[3])) { p.units = rows; return p; }
        if (rows == 1) { p.axis = A_INNER; p.units = c->ne[3]; p.grain = 64; return p; }
        p.units = rows;
        return p;
    }
    switch (c->kind) {
    case K_LAYER_NORM: case K_RMS_NORM: case K_SOFTMAX: case K_NORM_AFFINE: case K_GET_ROWS: case K_GATHER:
    case K_SUM: case K_MEAN: case K_MAX: case K_ARGMAX: case K_TOP_K: case K_DEQUANTIZE: case K_GET_ROWS_Q: {
        const int64_t per_row = (c->kind >= K_SUM && c->kind <= K_TOP_K) ? c->ip[0] * (c->kind == K_TOP_K ? c->ne[3] : 1)
                                                                       : c->ne[3];
        /* a decode step's attention softmax (8 heads x 1025 keys, ~5 us) sits between two split
         * products, a step of its own either way: splitting it costs no extra hand-over */
        const int64_t least = c->kind == K_SOFTMAX ? MIN_SPLIT_ELEMS / 2 : MIN_SPLIT_ELEMS;
        if (rows >= 2 && rows * per_row >= least) { p.mode = SPLIT; p.units = rows; p.work = 8 * rows * per_row; }
        return p;
    }
    case K_PAD:  /* by output rows, a copy (~1 cycle an element) */
        if (rows >= 2 && rows * c->ne[3] >= MIN_SPLIT_CHEAP) { p.mode = SPLIT; p.units = rows; p.work = rows * c->ne[3]; }
        return p;
    case K_ROPE:
        if (c->ne[1] >= 2 && c->ne[1] * c->ne[2] * c->ne[3] >= MIN_SPLIT_ELEMS / 4) {
            p.mode = SPLIT; p.axis = A_ROPE; p.units = c->ne[1]; p.work = 16 * c->ne[1] * c->ne[2] * c->ne[3];
        }
        return p;
    case K_MATMUL: case K_LINEAR: {
        const int64_t nb = c->ne[0] * c->ne[1], M = c->ip[0], N = c->ip[1], K = c->ip[2];
        const int route = (int)c->ip[7];
        const int64_t flops = nb * M * N * K;
        if (flops < MIN_SPLIT_FLOPS && !(M <= MATVEC_ROWS && nb * N * K >= MIN_SPLIT_STREAM)) return p;
        p.mode = SPLIT;
        p.work = flops;
        if (nb >= nth && route != R_SWAP) { p.axis = A_BATCH; p.units = nb; return p; }
        p.axis = A_NCOLS; p.units = N;
        switch (route) {
        case R_PACKED:
            p.grain = 2 * PANEL;
            if (packed_row_blocks(M, N, nth) > 1) { p.axis = A_TILES; p.units = packed_tiles(M, N, nth); p.grain = 1; }
            break;
        case R_WDOT: p.grain = 4; break;
        case R_GEMM: case R_SMALL: case R_IDOT: case R_ICHAIN:
            if (M >= 16 * nth || N < 16 * nth) { p.axis = A_MROWS; p.units = M; p.grain = route == R_GEMM ? 16 : 1; }
            else p.grain = 16;
            break;
        default: p.grain = 16;
        }
        return p;
    }
    case K_CONV1D: {
        const int64_t work = c->ne[1] * c->ne[3] * c->ne[2] * c->ip[3] * c->ip[4];
        if (work >= MIN_SPLIT_FLOPS && (g_sgemm || c->ne[1] * c->ne[3] <= 16)) { p.mode = SPLIT; p.axis = A_WHOLE; p.work = work; }
        else p.mode = work >= LONG_SERIAL ? SERIAL_LONG : SERIAL;
        return p;
    }
    case K_LSTM: {
        const int64_t work = c->ne[2] * 4 * c->ip[0] * c->ip[0];
        if (c->ss[0][3] == 1 && work >= MIN_SPLIT_FLOPS) { p.mode = SPLIT; p.axis = A_WHOLE; p.work = work * c->ne[1]; }
        else p.mode = SERIAL_LONG;
        return p;
    }
    case K_QMATMUL: case K_MUL_MAT_ID_Q: {  /* multiply-adds: activation rows (or slots) * N * K */
        const int64_t work = c->ne[0] * c->ne[1] * c->ne[2] * c->ne[3] * c->ip[1];
        if (work >= MIN_SPLIT_FLOPS) { p.mode = SPLIT; p.axis = A_WHOLE; p.work = work; }
        else p.mode = work >= LONG_SERIAL ? SERIAL_LONG : SERIAL;
        return p;
    }
    case K_MUL_MAT_ID: {
        const int64_t work = c->ne[1] * c->ne[2] * c->ip[1] * c->ip[2];
        if (work >= MIN_SPLIT_FLOPS && g_sgemm) { p.mode = SPLIT; p.axis = A_WHOLE; p.work = work; }
        else p.mode = work >= LONG_SERIAL ? SERIAL_LONG : SERIAL;
        return p;
    }
    default:
        return p;
    }
}

/* units [b, e) of a split command (one that is not phased) */
static int run_range(const flare_cmd *c, const plan_t *p, int64_t b, int64_t e) {
    switch (p->axis) {
    case A_OUTER: return run_slice(c, b, e, 0, c->ne[3]);
    case A_INNER: return run_slice(c, 0, outer(c), b, e);
    case A_ROPE: k_rope(c, b, e); return 0;
    default: break;
    }
    if (mm_needs_blas(c) && !g_sgemm) return ERR_NOBLAS;
    const int64_t nb = c->ne[0] * c->ne[1], M = c->ip[0], N = c->ip[1];
    if (p->axis == A_TILES) {  /* tile u: panel pair u / blocks, row block u % blocks (packed_tiles) */
        const int64_t mb = packed_tile_rows(M, packed_row_blocks(M, N, p->nth)), blocks = (M + mb - 1) / mb;
        for (int64_t u = b; u < e; ++u) {
            const int64_t n0 = u / blocks * 2 * PANEL, m0 = u % blocks * mb;
            mm_range(c, 0, nb, m0, m0 + mb < M ? m0 + mb : M, n0, n0 + 2 * PANEL < N ? n0 + 2 * PANEL : N);
        }
    } else if (p->axis == A_BATCH) mm_range(c, b, e, 0, M, 0, N);
    else if (p->axis == A_MROWS) mm_range(c, 0, nb, b, e, 0, N);
    else mm_range(c, 0, nb, 0, M, b, e);
    return 0;
}

/* Phases of a command: conv1d 3, mul_mat_id 2, lstm 1 + 1 per time step when split; else 1. */
static int64_t phases(const flare_cmd *c, const plan_t *p) {
    if (p->mode != SPLIT || p->axis != A_WHOLE) return 1;
    if (c->kind == K_LSTM) return 1 + c->ne[1];
    if (c->kind == K_MUL_MAT_ID && c->ne[1] == 1) return 1;  /* one token: slots, no grouping */
    return c->kind == K_CONV1D ? 3 : 2;
}

/* The units a phase splits and their grain (0 units: the phase is one chunk). */
static int64_t phase_units(const flare_cmd *c, const plan_t *p, int64_t ph, int64_t *grain) {
    *grain = p->grain;
    if (p->mode != SPLIT) return 0;
    if (p->axis != A_WHOLE) return p->units;
    if (c->kind == K_LSTM) return ph == 0 ? 0 : lstm_units(c, ph, grain);
    if (c->kind == K_CONV1D) return conv1d_units(c, (int)ph, grain);
    if (c->kind == K_QMATMUL || c->kind == K_MUL_MAT_ID_Q) {  /* activation rows (slots), then weight rows */
        *grain = ph == 0 ? 1 : 4;
        return ph == 0 ? c->ne[0] * c->ne[1] * c->ne[2] : c->ne[3];
    }
    *grain = 1;  /* mul_mat_id: phase 0 groups (one chunk), phase 1 shares out the used experts */
    if (c->ne[1] == 1) return mul_mat_id_slot_units(c);  /* one token: (slot, row block)s */
    return ph == 0 ? 0 : mul_mat_id_used(c) > 0 ? mul_mat_id_used(c) : 0;
}

static int64_t phase_chunks(int64_t units, int64_t grain, int nth) {
    if (units <= 0) return 1;
    const int64_t grains = (units + grain - 1) / grain;
    return grains < 4 * nth ? grains : 4 * nth;
}

/* Chunk k of `chunks` of a step: its unit range, cut at multiples of the grain. */
static int run_chunk(const flare_cmd *c, const plan_t *p, int64_t ph, int64_t k, int64_t chunks, int64_t units,
                     int64_t grain) {
    if (units <= 0) {  /* one chunk: the whole command, or a phase that is not split */
        if (p->mode != SPLIT) return run_one(c);
        if (c->kind == K_LSTM) { lstm_phase(c, ph, 0, 0); return 0; }
        if (c->kind == K_MUL_MAT_ID) return ph == 0 ? mul_mat_id_phase(c, 0, 0, 0) : 0;
        return 0;
    }
    const int64_t grains = (units + grain - 1) / grain;
    int64_t b = k * grains / chunks * grain, e = (k + 1) * grains / chunks * grain;
    if (e > units) e = units;
    if (b >= e) return 0;
    if (p->axis != A_WHOLE) return run_range(c, p, b, e);
    if (c->kind == K_LSTM) { lstm_phase(c, ph, b, e); return 0; }
    if (c->kind == K_CONV1D) return conv1d_phase(c, (int)ph, b, e);
    if (c->kind == K_QMATMUL) return qmatmul_phase(c, (int)ph, b, e);
    if (c->kind == K_MUL_MAT_ID_Q) return mul_mat_id_q_phase(c, (int)ph, b, e);
    if (c->ne[1] == 1) return mul_mat_id_slots(c, b, e);
    return mul_mat_id_phase(c, 1, b, e);
}

/* `step` (what waiting threads spin on) has a cache line of its own: the thread running a step
 * updates `claim` and `done`, and a waiter's reads of a shared line would pull it away from the
 * runner at every update (two transfers per atomic on the runner's side instead of one per step). */
typedef struct {
    const flare_cmd *cmds;
    int64_t n;
    int nth;
    _Atomic int64_t failed;   /* lowest failing command + 1, 0 while none */
    _Atomic int32_t err;
    _Alignas(64) atomic_int step;   /* steps finished (the current step's index); what threads wait on */
    atomic_int sleepers;      /* threads asleep on step */
    _Alignas(64) _Atomic int64_t claim;  /* the current step: (step << 32) | (chunks << 16) | next chunk */
    _Atomic int64_t done;     /* chunks of the current step finished */
} walk_t;

#define CLAIM(step, chunks) (((int64_t)(step) << 32) | ((int64_t)(chunks) << 16))

static void record_failure(walk_t *w, int64_t i, int e) {
    int64_t cur = atomic_load(&w->failed);
    while ((cur == 0 || cur > i + 1) && !atomic_compare_exchange_weak(&w->failed, &cur, i + 1)) {}
    if (atomic_load(&w->failed) == i + 1) atomic_store(&w->err, e);
}

/* A chunk of step s, or -1 when s is not the open step or its chunks are all taken. The
 * chunk count travels in the same word, so it is always the one of step s. */
static int64_t claim_chunk(walk_t *w, int64_t s, int64_t *chunks) {
    int64_t v = atomic_load(&w->claim);
    for (;;) {
        if ((v >> 32) != s || (v & 0xFFFF) >= ((v >> 16) & 0xFFFF)) return -1;
        if (atomic_compare_exchange_weak(&w->claim, &v, v + 1)) {
            *chunks = (v >> 16) & 0xFFFF;
            return v & 0xFFFF;
        }
    }
}

/* Matmul / linear steps: chunks of about this many multiply-adds (~5 us), between 4 and 16 per
 * thread, of equal size where the grains allow. Each step ends where its last chunk does, so the
 * idle tail is about one chunk: at 4 per thread, MiniLM's N = 384 linears (12 column grains) were
 * cut 1,2,1,2,... grains and, claimed in turn by 2 threads, took 7 grain-times where 6 would do
 * (its N = 1152 ones 4,5,4,5,...: 20 for 18); with a chunk per grain they split 6 + 6. Boundaries
 * are still multiples of the grain: the same results on any thread count. */
#define MATMUL_CHUNK_WORK 65536
/* ... and a step with more than 16 chunks a thread of 256K multiply-adds takes up to 32 a thread
 * (MiniLM batch 32's N = 1536 products: 48 chunks of one panel pair, ~0.3 ms each, where 24 of two
 * left a tail of up to 0.6 ms per step to a thread the OS delayed); a batch-1 step keeps its count. */
#define BIG_CHUNK_WORK 262144

static int64_t matmul_chunks(int64_t units, int64_t grain, int64_t work, int nth) {
    if (units <= 0) return 1;
    const int64_t grains = (units + grain - 1) / grain;
    int64_t want = work / MATMUL_CHUNK_WORK;
    if (want < 4 * nth) want = 4 * nth;
    if (want > 16 * nth) want = 16 * nth;
    const int64_t big = work / BIG_CHUNK_WORK;  /* big steps: up to 32 chunks a thread of >= ~15 us */
    if (big > want) want = big < 32 * nth ? big : 32 * nth;
    if (want > 0x7FFF) want = 0x7FFF;  /* the chunk count's 16 bits in walk_t.claim */
    if (grains <= want) return grains;
    const int64_t per = (grains + want - 1) / want;  /* equal chunks (48 grains: 24 of 2, not 32 of 1-2) */
    return (grains + per - 1) / per;
}

/* The chunk count of step (i, ph): computed by whoever opens it (it may read what the step
 * before wrote: mul_mat_id's grouping). */
static int64_t step_chunks(walk_t *w, int64_t i, int64_t ph) {
    if (atomic_load(&w->failed)) return 1;  /* the rest is skipped: one chunk each */
    const flare_cmd *c = w->cmds + i;
    const plan_t p = plan(c, w->nth);
    int64_t grain = 1;
    const int64_t units = phase_units(c, &p, ph, &grain);
    if ((c->kind == K_MATMUL || c->kind == K_LINEAR) && p.mode == SPLIT)
        return matmul_chunks(units, grain, p.work, w->nth);
    return phase_chunks(units, grain, w->nth);
}

/* Where the step of unsplit commands that starts at command i ends: consecutive commands that
 * do not split are one step, run in order by one thread. A step costs a hand-over between the
 * threads (a few cache-line transfers, ~0.3-1 us on the 2-core EPYC); a decode step of moe-lm is
 * ~60 commands of which ~8 split, so one step per command cost more than the split saved. */
static int64_t serial_end(const walk_t *w, int64_t i, int *long_run) {
    int64_t j = i;
    *long_run = 0;
    for (; j < w->n; ++j) {
        const plan_t p = plan(w->cmds + j, w->nth);
        if (p.mode == SPLIT) break;
        if (p.mode == SERIAL_LONG) *long_run = 1;
    }
    return j;
}

/* Open step s + 1, which starts at command ni, phase ph. */
static void open_step(walk_t *w, int64_t s, int64_t ni, int64_t ph) {
    atomic_store(&w->done, 0);
    if (ni < w->n) atomic_store(&w->claim, CLAIM(s + 1, step_chunks(w, ni, ph)));
    flare_publish_step(&w->step, (int)(s + 1), &w->sleepers);
}

static void walk(void *arg, int ith, int nth) {
    (void)ith; (void)nth;
    walk_t *w = arg;
    int64_t s = 0;
    for (int64_t i = 0; i < w->n; ++i) {
        const flare_cmd *c = w->cmds + i;
        const plan_t p = plan(c, w->nth);
        if (p.mode != SPLIT) {  /* commands [i, end): one step, one chunk */
            int long_run;
            const int64_t end = serial_end(w, i, &long_run);
            if (atomic_load(&w->step) <= s) {
                flare_await_step(&w->step, (int)s, &w->sleepers, 1);
                int64_t chunks;
                if (claim_chunk(w, s, &chunks) >= 0) {
                    for (int64_t j = i; j < end && !atomic_load(&w->failed); ++j) {
                        const int e = run_one(w->cmds + j);
                        if (e) record_failure(w, j, e);
                    }
                    open_step(w, s, end, 0);
                }
                flare_await_step(&w->step, (int)(s + 1), &w->sleepers, !long_run);
            }
            ++s;
            i = end - 1;
            continue;
        }
        const int64_t nph = phases(c, &p);
        for (int64_t ph = 0; ph < nph; ++ph, ++s) {
            if (atomic_load(&w->step) > s) continue;                 /* finished without us */
            flare_await_step(&w->step, (int)s, &w->sleepers, 1);     /* the step before */
            int64_t k, chunks;
            while ((k = claim_chunk(w, s, &chunks)) >= 0) {
                if (!atomic_load(&w->failed)) {
                    int64_t grain = 1;
                    const int64_t units = chunks > 1 || p.mode == SPLIT ? phase_units(c, &p, ph, &grain) : 0;
                    const int e = run_chunk(c, &p, ph, k, chunks, units, grain);
                    if (e) record_failure(w, i, e);
                }
                if (atomic_fetch_add(&w->done, 1) + 1 == chunks)     /* the step's last chunk: open the next */
                    open_step(w, s, ph + 1 < nph ? i : i + 1, ph + 1 < nph ? ph + 1 : 0);
            }
            /* chunks still running elsewhere: a long one-thread step is waited for asleep */
            flare_await_step(&w->step, (int)(s + 1), &w->sleepers, p.mode != SERIAL_LONG);
        }
    }
}

/* How many of the n commands run split across nth threads (describe(): `split_commands`);
 * 0 when their work together is too little for the pool (the list then runs on the caller). */
int64_t flare_split_count(const flare_cmd *cmds, int64_t n, int32_t nth) {
    int64_t k = 0, work = 0;
    for (int64_t i = 0; i < n; ++i) {
        const plan_t p = plan(cmds + i, nth);
        if (nth > 1 && p.mode == SPLIT) { ++k; work += p.work; }
    }
    return work >= MIN_POOL_WORK ? k : 0;
}

/* As flare_run, on the threads of `pool` (NULL, one thread, or a pool busy with another caller's
 * list: on the calling thread alone, with the same results). */
int64_t flare_run_pool(flare_pool *pool, const flare_cmd *cmds, int64_t n, int32_t *err) {
    const int nth = flare_pool_threads(pool);
    if (nth > 1 && n > 0) {
        int64_t work = 0;
        for (int64_t i = 0; i < n && work < MIN_POOL_WORK; ++i) {
            const plan_t p = plan(cmds + i, nth);
            if (p.mode == SPLIT) work += p.work;
        }
        if (work >= MIN_POOL_WORK) {
            walk_t w = { .cmds = cmds, .n = n, .nth = nth };
            atomic_store(&w.claim, CLAIM(0, step_chunks(&w, 0, 0)));
            if (flare_pool_run(pool, walk, &w)) {
                const int64_t failed = atomic_load(&w.failed);
                if (failed) *err = atomic_load(&w.err);
                return failed;
            }
        }
    }
    return flare_run(cmds, n, err);
}

int32_t flare_kind_count(void) { return K_COUNT; }

/* How command c runs on nth threads (bench/native_profile.py): 0 one chunk, 1 one chunk that lets
 * waiting threads sleep, 2 split; *work gets its planned work (~multiply-adds). */
int32_t flare_cmd_mode(const flare_cmd *c, int32_t nth, int64_t *work) {
    const plan_t p = plan(c, nth);
    *work = p.work;
    return p.mode;
}
