/* ---- conv1d: im2col rows by blocks of output columns, one GEMM per block into the output ------
 * Included by kernels.c (it uses its gemm() and HOT); a header so the build's cache key sees it.
 * x [B, Cin, L] (element strides ss[0][1..3]); w [Cout, Cin*K] contiguous; out [B, Cout, Lout]
 * contiguous; src[2] a bias [Cout] or NULL. ne = {1, B, Cout, Lout}; ip: stride, pad, dil, Cin, K, L;
 * flags & 2 (row layout, lowering.conv_prepackable): src[1] is w packed as [Cout, Cin*K] panels (pgemm);
 * flags & 8 (the Winograd path, below): src[1] is the transformed weight U [alpha][Cin][Cout] and
 * ip[7] the scratch slots (else ip[7] is lowering.conv1d_direct's flag);
 * flags & 4 (the fused conv_add): src[3], contiguous like out, is a residual the output starts from
 * (with the bias), so out = skip + bias + conv in one pass; out never aliases a source (conv_add is
 * not in place); scratch: conv1d_scratch (lowering.py).
 *
 * Why this layout: scratch row (b, ci, k) is x's row ci shifted by k*dil - pad (stride s: every
 * s-th element), so im2col is a memcpy per row at stride 1, and out_b [Cout, Lout] =
 * w [Cout, Cin*K] @ cols_b [Cin*K, Lout] is already the output's layout: no transpose pass, and
 * no per-element gather (the row-per-output-position layout this replaced cost 2-3x the GEMM on
 * audio decoders: long signals, 32-128 channels).
 * Phases (the threaded executor runs them in order): 0 and 2 nothing (kept so the executor's
 * phase count for conv1d stays 3); 1 by blocks of output columns, each its own im2col rows
 * and product, dealt to a few slots (the split units). Without BLAS the product is a plain loop. */
/* flags bits, as lowering.py's CONV1D_*: the packed weight (row layout), the fused residual, the
 * Winograd path */
#define CONV1D_PACKED 2
#define CONV1D_RESIDUAL 4
#define CONV1D_WINO 8
/* output columns per unit: a block's im2col rows (ck x cols floats) stay about CONV1D_BLOCK floats (256 KiB),
 * in cache for its product; a small convolution is one block (each product re-packs w) */
#define CONV1D_BLOCK 65536
static int64_t conv1d_cols(int64_t ck, int64_t Lo) {
    if (ck * Lo <= 4 * CONV1D_BLOCK) return Lo > 0 ? Lo : 1;
    int64_t n = CONV1D_BLOCK / (ck > 0 ? ck : 1);
    n = n < 256 ? 256 : n > 4096 ? 4096 : n;
    return n & ~(int64_t)15;
}

/* Phase 1's units are SLOTS: slot u does blocks u, u + slots, u + 2*slots ... in its own
 * ck x n floats of the scratch, so chunks (unit ranges) on different threads never share a
 * block buffer and the scratch stays slots blocks, not the whole im2col (a plan keeps its
 * scratch: Piper's decoder would hold ~100 MB per sentence length otherwise). The Python
 * side sizes the scratch the same way (lowering.conv1d_scratch). */
#define CONV1D_SLOTS 8
static int64_t conv1d_slots(int64_t blocks) { return blocks < CONV1D_SLOTS ? blocks : CONV1D_SLOTS; }

/* Short outputs (ip[6] = 1, lowering.conv1d_rows: Lout <= 64, e.g. a streaming VAD's encoder over
 * many chunks) take the layout this file's column blocks replaced: im2col rows per output position
 * (b, l), ONE product over all B*Lout rows, then a transpose into [B, Cout, Lout]. Column blocks
 * there would be B products of a few columns each. Phases: 0 im2col rows, 1 the product by rows
 * (or, for up to 16 rows, wdot by output channels), 2 the transpose (+ bias) by (b, co) rows. */
static int conv1d_takes_tiled(const flare_cmd *c);  /* the tiled kernel (below) */
static int64_t ctile_units(const flare_cmd *c);
static int64_t wino_slots_of(const flare_cmd *c);
static int64_t conv1d_units(const flare_cmd *c, int phase, int64_t *grain) {
    const int64_t B = c->ne[1], Lo = c->ne[3], ck = c->ip[3] * c->ip[4];
    if (c->flags & CONV1D_WINO) {
        *grain = 1;
        return phase == 1 ? wino_slots_of(c) : 0;
    }
    if (c->ip[6] && !conv1d_takes_tiled(c)) {
        const int64_t rows = B * Lo;
        *grain = phase == 1 ? (rows <= 16 ? 4 : 16) : 1;
        return phase == 0 ? rows : phase == 1 ? (rows <= 16 ? c->ne[2] : rows) : B * c->ne[2];
    }
    const int64_t n = conv1d_cols(ck, Lo);
    *grain = 1;
    if (phase == 1 && conv1d_takes_tiled(c)) return ctile_units(c);
    return phase == 1 ? conv1d_slots(B * ((Lo + n - 1) / n)) : 0;
}
/* The row layout's im2col row for K = 3, dilation 1 (the usual audio encoder conv): the taps'
 * inside-x tests are made once per row, not per tap and channel (the per-tap form was ~5% of
 * silero-vad offline); a tap outside x is 0. */
HOT static void conv1d_im2col3(float *row, const float *xb, int64_t cs, int64_t xs, int64_t Ci, int64_t p0, int64_t L) {
    const int in0 = p0 >= 0 && p0 < L, in1 = p0 + 1 >= 0 && p0 + 1 < L, in2 = p0 + 2 >= 0 && p0 + 2 < L;
    const int64_t i0 = (in0 ? p0 : 0) * xs, i1 = (in1 ? p0 + 1 : 0) * xs, i2 = (in2 ? p0 + 2 : 0) * xs;
    if (in0 && in1 && in2)
        for (int64_t ci = 0; ci < Ci; ++ci) {
            const float *xc = xb + ci * cs;
            row[3 * ci] = xc[i0]; row[3 * ci + 1] = xc[i1]; row[3 * ci + 2] = xc[i2];
        }
    else
        for (int64_t ci = 0; ci < Ci; ++ci) {
            const float *xc = xb + ci * cs;
            row[3 * ci] = in0 ? xc[i0] : 0.0f; row[3 * ci + 1] = in1 ? xc[i1] : 0.0f;
            row[3 * ci + 2] = in2 ? xc[i2] : 0.0f;
        }
}
/* The row layout's phase 2: out rows (b, co) in [r0, r1) = res [B*Lo, Co] transposed per batch row
 * (+ bias[co]). By runs of one b: each l reads res row (b, l) at unit stride and writes every Lo-th
 * float, vectorized (the per-(b, co) loop read Lo floats Co apart: ~5% of silero-vad offline). */
HOT static void conv1d_rows_out(const float *res, const float *bias, const float *skip, float *o, int64_t Co,
                                int64_t Lo, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1;) {
        const int64_t b = r / Co, c0 = r % Co, c1 = Co < c0 + (r1 - r) ? Co : c0 + (r1 - r);
        float *ob = o + b * Co * Lo;
        for (int64_t l = 0; l < Lo; ++l) {
            const float *src = res + (b * Lo + l) * Co;
            if (bias) for (int64_t co = c0; co < c1; ++co) ob[co * Lo + l] = src[co] + bias[co];
            else for (int64_t co = c0; co < c1; ++co) ob[co * Lo + l] = src[co];
        }
        if (skip)   /* the fused residual (flags & 4), added by rows of unit stride */
            for (int64_t co = c0; co < c1; ++co) {
                const float *sr = skip + (b * Co + co) * Lo;
                for (int64_t l = 0; l < Lo; ++l) ob[co * Lo + l] += sr[l];
            }
        r += c1 - c0;
    }
}
/* the fused residual of a conv1d command (flags & 4), or NULL */
static inline const float *conv1d_skip(const flare_cmd *c) {
    return c->flags & CONV1D_RESIDUAL ? (const float *)c->src[3] : 0;
}
/* o's rows co in [c0, c1), columns [la, lb) (rows Lo apart) = skip's (or 0) + bias[co] (or 0): the
 * start a product adds to, so neither the bias nor the fused residual costs a pass of its own */
HOT static void conv1d_start(float *o, const float *skip, const float *bias, int64_t c0, int64_t c1, int64_t Lo,
                             int64_t la, int64_t lb) {
    for (int64_t co = c0; co < c1; ++co) {
        const float bv = bias ? bias[co] : 0.0f;
        float *orow = o + co * Lo;
        if (skip) {
            const float *sr = skip + co * Lo;
            for (int64_t l = la; l < lb; ++l) orow[l] = sr[l] + bv;
        } else
            for (int64_t l = la; l < lb; ++l) orow[l] = bv;
    }
}
static int conv1d_rows_phase(const flare_cmd *c, int phase, int64_t r0, int64_t r1) {
    const int64_t B = c->ne[1], Co = c->ne[2], Lo = c->ne[3];
    const int64_t s = c->ip[0], pad = c->ip[1], dil = c->ip[2], Ci = c->ip[3], K = c->ip[4], L = c->ip[5];
    const int64_t ck = Ci * K;
    float *cols = (float *)c->scratch, *res = cols + B * Lo * ck;   /* [B*Lo, ck], then [B*Lo, Co] */
    if (phase == 0) {
        const float *x = (const float *)c->src[0];
        for (int64_t r = r0; r < r1; ++r) {
            const int64_t b = r / Lo, l = r % Lo, p0 = l * s - pad;
            float *row = cols + r * ck;
            /* a window wholly inside x, read at unit steps: each channel's K taps are one copy
             * (silero-vad's STFT: 256 taps, where the per-tap form cost more than its product) */
            const int contiguous = dil == 1 && c->ss[0][3] == 1 && p0 >= 0 && p0 + K <= L;
            if (K == 3 && dil == 1) {
                conv1d_im2col3(row, x + b * c->ss[0][1], c->ss[0][2], c->ss[0][3], Ci, p0, L);
                continue;
            }
            for (int64_t ci = 0; ci < Ci; ++ci) {
                const float *xr = x + b * c->ss[0][1] + ci * c->ss[0][2];
                if (contiguous) {
                    if (K >= 16) memcpy(row + ci * K, xr + p0, (size_t)K * sizeof(float));
                    else for (int64_t k = 0; k < K; ++k) row[ci * K + k] = xr[p0 + k];
                    continue;
                }
                for (int64_t k = 0; k < K; ++k) {
                    const int64_t p = l * s + k * dil - pad;
                    row[ci * K + k] = (p >= 0 && p < L) ? xr[p * c->ss[0][3]] : 0.0f;
                }
            }
        }
    } else if (phase == 1) {
        const float *w = (const float *)c->src[1];
        if (c->flags & CONV1D_PACKED) pgemm(r1 - r0, Co, ck, cols + r0 * ck, ck, w, res + r0 * Co, Co);  /* w: packed panels */
        else if (B * Lo <= 16) wdot(B * Lo, r1 - r0, ck, cols, ck, w + r0 * ck, ck, res + r0, Co);  /* channels */
        else if (g_sgemm) gemm(NT, TR, r1 - r0, Co, ck, cols + r0 * ck, ck, w, ck, 0.0f, res + r0 * Co, Co);
        else
            for (int64_t r = r0; r < r1; ++r)
                for (int64_t co = 0; co < Co; ++co) {
                    float acc = 0.0f;
                    for (int64_t j = 0; j < ck; ++j) acc += cols[r * ck + j] * w[co * ck + j];
                    res[r * Co + co] = acc;
                }
    } else
        conv1d_rows_out(res, (const float *)c->src[2], conv1d_skip(c), (float *)c->out, Co, Lo, r0, r1);
    return 0;
}
/* row[l - la] = xr[(l*s + off) * xs] where 0 <= l*s + off < L, else 0, for l in [la, lb) */
static void conv1d_row(float *row, const float *xr, int64_t xs, int64_t la, int64_t lb, int64_t L, int64_t s,
                       int64_t off) {
    int64_t l0 = off >= 0 ? 0 : (-off + s - 1) / s;
    int64_t l1 = L - off <= 0 ? 0 : (L - off + s - 1) / s;
    l0 = l0 < la ? la : l0 > lb ? lb : l0;
    l1 = l1 > lb ? lb : l1 < l0 ? l0 : l1;
    memset(row, 0, (size_t)(l0 - la) * sizeof(float));
    if (s == 1 && xs == 1) memcpy(row + (l0 - la), xr + l0 + off, (size_t)(l1 - l0) * sizeof(float));
    else for (int64_t l = l0; l < l1; ++l) row[l - la] = xr[(l * s + off) * xs];
    memset(row + (l1 - la), 0, (size_t)(lb - l1) * sizeof(float));
}

/* o[Co, n] (row stride ldo) = (o if accumulate, else 0) + w[Co, ck] @ cols[ck, n] (row stride ldc), without BLAS */
HOT static void conv1d_plain(int64_t Co, int64_t n, int64_t ck, const float *w, const float *cols, int64_t ldc,
                             float *o, int64_t ldo, int accumulate) {
    for (int64_t co = 0; co < Co; ++co) {
        float *orow = o + co * ldo;
        if (!accumulate) for (int64_t l = 0; l < n; ++l) orow[l] = 0.0f;
        for (int64_t r = 0; r < ck; ++r) {
            const float wv = w[co * ck + r];
            const float *crow = cols + r * ldc;
            for (int64_t l = 0; l < n; ++l) orow[l] += wv * crow[l];
        }
    }
}

/* the column-block layout's pointwise case (ip[7] = 1, lowering.conv1d_direct): K 1, stride 1,
 * pad 0, x's rows of unit stride; the product then reads x in place */
static int conv1d_direct(const flare_cmd *c) { return c->ip[7] != 0; }

/* ---- the tiled kernel: a direct convolution (AVX-512, or AVX2 + FMA), no im2col, no GEMM call -
 * Stride 1, x's rows of unit stride, the column-block layout (ip[6] = 0): out[co, l] = bias[co] +
 * sum over (ci, k) of w[co, ci*K + k] * x[ci, l + k*dil - pad], as a register tile of CT_MR output
 * channels x a few vectors of output columns (conv1d_tile.h, once per ISA: 4 x 96 in 24 zmm
 * accumulators, 4 x 24 in 12 ymm); per (ci, k) a load of x's row shifted by k*dil per vector
 * (dilation is an offset, nothing copied) and one broadcast of w per channel.
 * Why: Piper's HiFi-GAN decoder convolves 32-64 channels over 15k-65k samples (K 3-7, dilations
 * 1-5, padded); im2col + sgemm there copied Cin*K rows per column block and called OpenBLAS on
 * 32 x 288 x 224 products whose packing cost as much as their FMAs (~22 GFLOP/s of the core's
 * ~100). Tiles whose taps reach past either end of x (the first and last few) and the last
 * partial tile read x through lane masks (masked lanes are not read, so no padded copy and no
 * scratch): there the taps run outer, each with its lane masks, the channels inner.
 * Units (phase 1): (b, a block of CT_UNIT_COLS columns, a block of CT_UNIT_CO channels), channel
 * blocks inner, so one thread's consecutive units reuse the block's x window from cache.
 * Each output is the same FMA chain in (ci, k) order whatever the units and ISA, so neither the
 * threads nor the kernel change a bit. */
#define CT_MR 4
#define CT_UNIT_COLS 384
#define CT_UNIT_CO 64
#define CT_KMAX 32
#define CT_ROWS_MIN 32
#define CT_WINDOW 4096

typedef void (*ctile_block_t)(const flare_cmd *c, int64_t b, int64_t la, int64_t lb, int64_t c0, int64_t c1);
static ctile_block_t g_ctile = 0;
static int g_ctile_chosen = 0;
int32_t flare_conv1d_isa(int32_t want);


/* ---- the Winograd path (flags & 8): F(4, K) for K = 2, 3, 5, 7, stride 1 (conv1d_wino.h) ---------
 * Chosen at compile time (native/compile.py, winograd.py) for a constant weight, 16k channels in
 * and out, the column-block layout and at least WINO_MIN_LOUT outputs; src[1] is then the weight
 * transformed once, U = G w [alpha][Ci][Co]. 4K/alpha fewer multiplies (1.6x, 2x, 2.5x, 2.8x) than the
 * tiled kernel, for transforms that are a few adds per input and output. Blocks of nb outputs of
 * one batch row (wino_geometry), dealt to slots (ip[7]: the device's threads, at most one a thread
 * at a time), each slot with its own scratch (flare_conv1d_wino_scratch, which the compile step
 * sizes the plan's scratch by): a slot per thread, not per block, since every plan keeps its
 * scratch (8 slots cost Piper ~100 MB over its cached plans). */
#define WINO_M 4
#define WINO_TB 16384   /* a block's outputs x input channels: about this many floats (64 KiB) */
#define WINO_ROWS 12    /* tiles per block: a multiple of this (every ISA's CW_MR divides it) */
/* AT [4][alpha] and BT [alpha][alpha] of F(4, K), from winograd.py's c_tables() (a test compares) */
static const float WINO_AT2[4][5] = {
    {1.0f, 1.0f, 1.0f, 1.0f, 0.0f},
    {0.0f, 1.0f, -1.0f, 2.0f, 0.0f},
    {0.0f, 1.0f, 1.0f, 4.0f, 0.0f},
    {0.0f, 1.0f, -1.0f, 8.0f, 1.0f}};
static const float WINO_BT2[5][5] = {
    {2.0f, -1.0f, -2.0f, 1.0f, 0.0f},
    {0.0f, -2.0f, -1.0f, 1.0f, 0.0f},
    {0.0f, 2.0f, -3.0f, 1.0f, 0.0f},
    {0.0f, -1.0f, 0.0f, 1.0f, 0.0f},
    {0.0f, 2.0f, -1.0f, -2.0f, 1.0f}};
static const float WINO_AT3[4][6] = {
    {1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 0.0f},
    {0.0f, 1.0f, -1.0f, 2.0f, -2.0f, 0.0f},
    {0.0f, 1.0f, 1.0f, 4.0f, 4.0f, 0.0f},
    {0.0f, 1.0f, -1.0f, 8.0f, -8.0f, 1.0f}};
static const float WINO_BT3[6][6] = {
    {4.0f, 0.0f, -5.0f, 0.0f, 1.0f, 0.0f},
    {0.0f, -4.0f, -4.0f, 1.0f, 1.0f, 0.0f},
    {0.0f, 4.0f, -4.0f, -1.0f, 1.0f, 0.0f},
    {0.0f, -2.0f, -1.0f, 2.0f, 1.0f, 0.0f},
    {0.0f, 2.0f, -1.0f, -2.0f, 1.0f, 0.0f},
    {0.0f, 4.0f, 0.0f, -5.0f, 0.0f, 1.0f}};
static const float WINO_AT5[4][8] = {
    {1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 0.0f},
    {0.0f, 1.0f, -1.0f, 2.0f, -2.0f, 0.5f, -0.5f, 0.0f},
    {0.0f, 1.0f, 1.0f, 4.0f, 4.0f, 0.25f, 0.25f, 0.0f},
    {0.0f, 1.0f, -1.0f, 8.0f, -8.0f, 0.125f, -0.125f, 1.0f}};
static const float WINO_BT5[8][8] = {
    {-1.0f, 0.0f, 5.25f, 0.0f, -5.25f, 0.0f, 1.0f, 0.0f},
    {0.0f, 1.0f, 1.0f, -4.25f, -4.25f, 1.0f, 1.0f, 0.0f},
    {0.0f, -1.0f, 1.0f, 4.25f, -4.25f, -1.0f, 1.0f, 0.0f},
    {0.0f, 0.5f, 0.25f, -2.5f, -1.25f, 2.0f, 1.0f, 0.0f},
    {0.0f, -0.5f, 0.25f, 2.5f, -1.25f, -2.0f, 1.0f, 0.0f},
    {0.0f, 2.0f, 4.0f, -2.5f, -5.0f, 0.5f, 1.0f, 0.0f},
    {0.0f, -2.0f, 4.0f, 2.5f, -5.0f, -0.5f, 1.0f, 0.0f},
    {0.0f, -1.0f, 0.0f, 5.25f, 0.0f, -5.25f, 0.0f, 1.0f}};
static const float WINO_AT7[4][10] = {
    {1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 0.0f},
    {0.0f, 1.0f, -1.0f, 2.0f, -2.0f, 0.5f, -0.5f, 1.5f, -1.5f, 0.0f},
    {0.0f, 1.0f, 1.0f, 4.0f, 4.0f, 0.25f, 0.25f, 2.25f, 2.25f, 0.0f},
    {0.0f, 1.0f, -1.0f, 8.0f, -8.0f, 0.125f, -0.125f, 3.375f, -3.375f, 1.0f}};
static const float WINO_BT7[10][10] = {
    {2.25f, 0.0f, -12.8125f, 0.0f, 17.0625f, 0.0f, -7.5f, 0.0f, 1.0f, 0.0f},
    {0.0f, -2.25f, -2.25f, 10.5625f, 10.5625f, -6.5f, -6.5f, 1.0f, 1.0f, 0.0f},
    {0.0f, 2.25f, -2.25f, -10.5625f, 10.5625f, 6.5f, -6.5f, -1.0f, 1.0f, 0.0f},
    {0.0f, -1.125f, -0.5625f, 6.125f, 3.0625f, -7.0f, -3.5f, 2.0f, 1.0f, 0.0f},
    {0.0f, 1.125f, -0.5625f, -6.125f, 3.0625f, 7.0f, -3.5f, -2.0f, 1.0f, 0.0f},
    {0.0f, -4.5f, -9.0f, 7.625f, 15.25f, -3.625f, -7.25f, 0.5f, 1.0f, 0.0f},
    {0.0f, 4.5f, -9.0f, -7.625f, 15.25f, 3.625f, -7.25f, -0.5f, 1.0f, 0.0f},
    {0.0f, -1.5f, -1.0f, 7.875f, 5.25f, -7.875f, -5.25f, 1.5f, 1.0f, 0.0f},
    {0.0f, 1.5f, -1.0f, -7.875f, 5.25f, 7.875f, -5.25f, -1.5f, 1.0f, 0.0f},
    {0.0f, 2.25f, 0.0f, -12.8125f, 0.0f, 17.0625f, 0.0f, -7.5f, 0.0f, 1.0f}};

typedef struct { int64_t a, J, nt, nb, nq, slot, blocks, slots; } wino_geom;
/* A block: d phases x J tiles (4 outputs each, d apart) = nb outputs, its time-major input window
 * nq = nb + (K-1)*d positions; J such that a block's outputs x Ci stay about WINO_TB floats. */
static wino_geom wino_geometry(int64_t B, int64_t Ci, int64_t Co, int64_t K, int64_t d, int64_t Lo, int64_t slots) {
    wino_geom g;
    int64_t tb = WINO_TB / (Ci > 0 ? Ci : 1);
    tb = tb < 64 ? 64 : tb > 256 ? 256 : tb;
    const int64_t md = WINO_M * d;
    int64_t J = (tb + md - 1) / md, gcd = d, r = WINO_ROWS;
    while (r) { const int64_t t = gcd % r; gcd = r; r = t; }
    const int64_t step = WINO_ROWS / gcd;   /* d*J a multiple of WINO_ROWS */
    J = (J + step - 1) / step * step;
    g.a = WINO_M + K - 1;
    g.J = J;
    g.nt = d * J;
    g.nb = md * J;
    g.nq = g.nb + (K - 1) * d;
    g.slot = g.nq * Ci + g.a * g.nt * (Ci + Co) + g.nb * Co;
    g.blocks = B * ((Lo + g.nb - 1) / g.nb);
    if (slots < 1) slots = 1;
    g.slots = g.blocks < slots ? g.blocks : slots;
    return g;
}
int64_t flare_conv1d_wino_scratch(int64_t B, int64_t Ci, int64_t Co, int64_t K, int64_t d, int64_t Lo, int64_t slots) {
    const wino_geom g = wino_geometry(B, Ci, Co, K, d, Lo, slots);
    return g.slots * g.slot * (int64_t)sizeof(float);
}
static inline wino_geom wino_geometry_of(const flare_cmd *c) {
    return wino_geometry(c->ne[1], c->ip[3], c->ne[2], c->ip[4], c->ip[2], c->ne[3], c->ip[7]);
}
/* the tables, for the test that compares them with winograd.py's: AT then BT of F(4, K) */
int32_t flare_conv1d_wino_tables(int32_t K, float *out) {
    const int a = WINO_M + K - 1;
    const float *at = K == 2 ? &WINO_AT2[0][0] : K == 3 ? &WINO_AT3[0][0] : K == 5 ? &WINO_AT5[0][0]
                    : K == 7 ? &WINO_AT7[0][0] : 0;
    const float *bt = K == 2 ? &WINO_BT2[0][0] : K == 3 ? &WINO_BT3[0][0] : K == 5 ? &WINO_BT5[0][0]
                    : K == 7 ? &WINO_BT7[0][0] : 0;
    if (!at) return 0;
    memcpy(out, at, (size_t)(WINO_M * a) * sizeof(float));
    memcpy(out + WINO_M * a, bt, (size_t)(a * a) * sizeof(float));
    return WINO_M * a + a * a;
}
typedef void (*wino_block_t)(const flare_cmd *c, const wino_geom *g, int64_t b, int64_t blk, float *s);
static wino_block_t g_wino = 0;

#ifdef PACKED_SIMD
/* r[k] = column k of the 8 x 8 floats at src (row stride ss) */
INL AVX2F void wino_t8(const float *src, int64_t ss, __m256 r[8]) {
    __m256 a[8], t[8], s[8];
    for (int i = 0; i < 8; ++i) a[i] = _mm256_loadu_ps(src + i * ss);
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(a[i], a[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(a[i], a[i + 1]);
    }
    for (int h = 0; h < 8; h += 4) {
        s[h] = _mm256_shuffle_ps(t[h], t[h + 2], _MM_SHUFFLE(1, 0, 1, 0));
        s[h + 1] = _mm256_shuffle_ps(t[h], t[h + 2], _MM_SHUFFLE(3, 2, 3, 2));
        s[h + 2] = _mm256_shuffle_ps(t[h + 1], t[h + 3], _MM_SHUFFLE(1, 0, 1, 0));
        s[h + 3] = _mm256_shuffle_ps(t[h + 1], t[h + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int i = 0; i < 4; ++i) {
        r[i] = _mm256_permute2f128_ps(s[i], s[i + 4], 0x20);
        r[i + 4] = _mm256_permute2f128_ps(s[i], s[i + 4], 0x31);
    }
}
/* xt[q][ci] = x[ci][pos0 + q] (row stride xcs), 0 outside [0, L), for q < nq, ci < Ci (8k). By 8 rows
 * of x at a time, each read along (8 streams: all Ci rows at once outran the prefetchers). */
AVX2F static void wino_gather(const float *x, int64_t xcs, int64_t pos0, int64_t L, int64_t nq, int64_t Ci,
                              float *xt) {
    int64_t q0 = pos0 >= 0 ? 0 : -pos0, q1 = L - pos0 < nq ? L - pos0 : nq;   /* positions inside x */
    if (q1 < q0) q1 = q0 = 0;
    const int64_t qf = q0 + (q1 - q0) / 8 * 8;   /* whole 8-position blocks in [q0, qf) */
    for (int64_t ci = 0; ci < Ci; ci += 8) {
        __m256 r[8];
        for (int64_t q = q0; q < qf; q += 8) {
            wino_t8(x + ci * xcs + pos0 + q, xcs, r);
            for (int k = 0; k < 8; ++k) _mm256_storeu_ps(xt + (q + k) * Ci + ci, r[k]);
        }
    }
    for (int64_t q = 0; q < nq; ++q) {
        if (q >= q0 && q < qf) { q = qf - 1; continue; }
        float *row = xt + q * Ci;
        if (q >= q0 && q < q1) for (int64_t ci = 0; ci < Ci; ++ci) row[ci] = x[ci * xcs + pos0 + q];
        else memset(row, 0, (size_t)Ci * sizeof(float));
    }
}
/* o[co][la + q] = y[q][co] + bias[co] (+ skip[co][la + q]), co < Co (8k), q < n; o and skip rows Lo
 * apart. By 8 output rows at a time, each written along. */
AVX2F static void wino_scatter(const float *y, int64_t Co, const float *bias, const float *skip, float *o,
                               int64_t Lo, int64_t la, int64_t n) {
    const int64_t nf = n / 8 * 8;
    for (int64_t co = 0; co < Co; co += 8) {
        __m256 bv[8];
        for (int k = 0; k < 8; ++k) bv[k] = _mm256_set1_ps(bias ? bias[co + k] : 0.0f);
        for (int64_t q = 0; q < nf; q += 8) {
            __m256 r[8];
            wino_t8(y + q * Co + co, Co, r);
            for (int k = 0; k < 8; ++k) {
                const int64_t at = (co + k) * Lo + la + q;
                __m256 v = r[k];
                if (bias) v = _mm256_add_ps(v, bv[k]);
                if (skip) v = _mm256_add_ps(v, _mm256_loadu_ps(skip + at));
                _mm256_storeu_ps(o + at, v);
            }
        }
    }
    for (int64_t q = nf; q < n; ++q)
        for (int64_t co = 0; co < Co; ++co) {
            const int64_t at = co * Lo + la + q;
            float v = y[q * Co + co];
            if (bias) v = v + bias[co];
            if (skip) v = v + skip[at];
            o[at] = v;
        }
}
#endif

#ifdef PACKED_SIMD
static inline __mmask16 ct_lanes(int64_t lo, int64_t hi) {  /* lanes t with lo <= t < hi, t in [0, 16) */
    lo = lo < 0 ? 0 : lo > 16 ? 16 : lo;
    hi = hi < 0 ? 0 : hi > 16 ? 16 : hi;
    return hi <= lo ? 0 : (__mmask16)(((1u << hi) - 1u) & ~((1u << lo) - 1u));
}

/* AVX-512: 4 x 6 zmm tiles (96 columns), x's lanes masked by k-masks */
#define CT_SUFFIX 512
#define CT_ATTR AVX512
#define CT_VEC __m512
#define CT_LANES 16
#define CT_NVMAX 6
#define CT_MASK __mmask16
#define CT_LANE_MASK(lo, hi) ct_lanes(lo, hi)
#define CT_LOAD(p) _mm512_loadu_ps(p)
#define CT_MLOAD(m, p) _mm512_maskz_loadu_ps(m, p)
#define CT_STORE(p, v) _mm512_storeu_ps(p, v)
#define CT_MSTORE(m, p, v) _mm512_mask_storeu_ps(p, m, v)
#define CT_SET1(f) _mm512_set1_ps(f)
#define CT_ZERO() _mm512_setzero_ps()
#define CT_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define CT_ADD(a, b) _mm512_add_ps(a, b)
#define CT_SUB(a, b) _mm512_sub_ps(a, b)
#define CW_MR 12
#define CW_NV 2
#include "conv1d_wino.h"
#undef CW_MR
#undef CW_NV
#include "conv1d_tile.h"

/* AVX2 + FMA: 4 x 3 ymm tiles (24 columns): 12 accumulators, three vectors of x and the broadcast
 * of w are the 16 registers AVX2 has; per (ci, k) three loads, four broadcasts, twelve FMAs.
 * Edge tiles read x through _mm256_maskload_ps (masked lanes are neither read nor faulted).
 * Why: on an AVX2-only CPU Piper's decoder convolutions took im2col + OpenBLAS, whose copies (the
 * im2col rows, then OpenBLAS's own packing of them) were a third of the product's time, and its
 * 1-channel conv_post ran at ~4 GFLOP/s as a 1-row GEMM (measured on an AVX2 EPYC: the decoder's
 * convolutions 239 -> 207 ms a sentence, conv_post 5.6 -> 1.6 ms). */
INL AVX2F __m256i ct2_lanes(int64_t lo, int64_t hi) {  /* lanes t with lo <= t < hi, t in [0, 8) */
    const __m256i t = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    lo = lo < 0 ? 0 : lo > 8 ? 8 : lo;
    hi = hi < 0 ? 0 : hi > 8 ? 8 : hi;
    return _mm256_and_si256(_mm256_cmpgt_epi32(t, _mm256_set1_epi32((int)lo - 1)),
                            _mm256_cmpgt_epi32(_mm256_set1_epi32((int)hi), t));
}
#define CT_SUFFIX 256
#define CT_ATTR AVX2F
#define CT_VEC __m256
#define CT_LANES 8
#define CT_NVMAX 3
#define CT_MASK __m256i
#define CT_LANE_MASK(lo, hi) ct2_lanes(lo, hi)
#define CT_LOAD(p) _mm256_loadu_ps(p)
#define CT_MLOAD(m, p) _mm256_maskload_ps(p, m)
#define CT_STORE(p, v) _mm256_storeu_ps(p, v)
#define CT_MSTORE(m, p, v) _mm256_maskstore_ps(p, m, v)
#define CT_SET1(f) _mm256_set1_ps(f)
#define CT_ZERO() _mm256_setzero_ps()
#define CT_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define CT_ADD(a, b) _mm256_add_ps(a, b)
#define CT_SUB(a, b) _mm256_sub_ps(a, b)
#define CW_MR 6
#define CW_NV 2
#include "conv1d_wino.h"
#undef CW_MR
#undef CW_NV
#include "conv1d_tile.h"
#endif

/* which conv1d path the column-block layout takes: 1 the tiled AVX-512 kernel (stride 1, x rows
 * of unit stride), 2 the tiled AVX2 + FMA kernel, 0 im2col + GEMM. `want` < 0 the best the CPU
 * has; 1 or 2 that kernel where the CPU has it, else the next below (tests run each there is). */
int32_t flare_conv1d_isa(int32_t want) {
    g_ctile = 0;
    g_wino = 0;
    g_ctile_chosen = 1;
#ifdef PACKED_SIMD
    __builtin_cpu_init();
    if ((want < 0 || want == 1) && __builtin_cpu_supports("avx512f")) {
        g_ctile = ctile_block512;
        g_wino = wino_block512;
        return 1;
    }
    if (want != 0 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
        g_ctile = ctile_block256;
        g_wino = wino_block256;
        return 2;
    }
#endif
    return 0;
}

/* whether conv1d commands may take the Winograd path under the current choice (flare_conv1d_isa) */
int32_t flare_conv1d_wino(void) {
    if (!g_ctile_chosen) flare_conv1d_isa(-1);
    return g_wino != 0;
}

/* Phase 1 of a Winograd command, slots [r0, r1): each slot's blocks in its part of the scratch. A
 * command compiled for the path runs it even where a test has since chosen another (the best the
 * CPU has): its src[1] is the transformed weight. */
static int wino_phase(const flare_cmd *c, int64_t r0, int64_t r1) {
    if (!g_ctile_chosen) flare_conv1d_isa(-1);
    wino_block_t f = g_wino;
#ifdef PACKED_SIMD
    if (!f) f = __builtin_cpu_supports("avx512f") ? wino_block512 : wino_block256;
#endif
    if (!f) return 1;
    const wino_geom g = wino_geometry_of(c);
    const int64_t per_row = (c->ne[3] + g.nb - 1) / g.nb;
    for (int64_t slot = r0; slot < r1; ++slot) {
        float *s = (float *)c->scratch + slot * g.slot;
        for (int64_t u = slot; u < g.blocks; u += g.slots) f(c, &g, u / per_row, u % per_row, s);
    }
    return 0;
}

static ctile_block_t ctile_block256_ptr(void) {
#ifdef PACKED_SIMD
    return ctile_block256;
#else
    return 0;
#endif
}

static int conv1d_takes_tiled(const flare_cmd *c) {
    if (!g_ctile_chosen) flare_conv1d_isa(-1);
    /* the row layout's outputs (Lout <= 64) from CT_ROWS_MIN columns on, unless its weight is packed:
     * Piper's encoder (Lout 48, 192 -> 768 channels) ran ~5x slower as one 48-row product */
    if (!g_ctile || !(!c->ip[6] || (c->ne[3] >= CT_ROWS_MIN && !(c->flags & CONV1D_PACKED))) || c->ip[0] != 1 ||
        c->ss[0][3] != 1 || c->ip[4] > CT_KMAX)
        return 0;
    /* AVX2's tiles run at ~80 GFLOP/s here, about OpenBLAS's on a product that needs no copies: a
     * pointwise convolution read in place (conv1d_direct) stays with the GEMM (Piper's flow: 5-10%
     * faster there) */
    return g_ctile != ctile_block256_ptr() || !conv1d_direct(c);
}

static int64_t ctile_units(const flare_cmd *c) {
    return c->ne[1] * ((c->ne[3] + CT_UNIT_COLS - 1) / CT_UNIT_COLS) * ((c->ne[2] + CT_UNIT_CO - 1) / CT_UNIT_CO);
}

static void ctile_phase(const flare_cmd *c, int64_t u0, int64_t u1) {
    const int64_t Co = c->ne[2], Lo = c->ne[3];
    const int64_t nco = (Co + CT_UNIT_CO - 1) / CT_UNIT_CO, ncol = (Lo + CT_UNIT_COLS - 1) / CT_UNIT_COLS;
    for (int64_t u = u0; u < u1; ++u) {
        const int64_t b = u / (ncol * nco), j = u % (ncol * nco) / nco, q = u % nco;
        const int64_t la = j * CT_UNIT_COLS, c0 = q * CT_UNIT_CO;
        const int64_t lb = la + CT_UNIT_COLS < Lo ? la + CT_UNIT_COLS : Lo, c1 = c0 + CT_UNIT_CO < Co ? c0 + CT_UNIT_CO : Co;
        g_ctile(c, b, la, lb, c0, c1);
    }
}

/* Phase 1, units [r0, r1) = slots (above): each of a slot's blocks (b, j) gets its im2col rows
 * into the slot's part of the scratch, then its product. */
static int64_t wino_slots_of(const flare_cmd *c) { return wino_geometry_of(c).slots; }

static int conv1d_phase(const flare_cmd *c, int phase, int64_t r0, int64_t r1) {
    if (c->flags & CONV1D_WINO) return phase == 1 ? wino_phase(c, r0, r1) : 0;
    const int tiled = conv1d_takes_tiled(c);
    if (c->ip[6] && !tiled) return conv1d_rows_phase(c, phase, r0, r1);
    if (phase != 1) return 0;
    if (tiled) { ctile_phase(c, r0, r1); return 0; }
    const int64_t B = c->ne[1], Co = c->ne[2], Lo = c->ne[3];
    const int64_t s = c->ip[0], pad = c->ip[1], dil = c->ip[2], Ci = c->ip[3], K = c->ip[4], L = c->ip[5];
    const int64_t ck = Ci * K, n = conv1d_cols(ck, Lo), nb = (Lo + n - 1) / n, slots = conv1d_slots(B * nb);
    const float *x = (const float *)c->src[0], *w = (const float *)c->src[1], *bias = (const float *)c->src[2];
    const float *skip = conv1d_skip(c);
    float *o = (float *)c->out;
    /* a pointwise convolution (K 1, stride 1, no padding) over rows of unit stride: x's rows ARE
     * the im2col rows, so the product reads them in place (no copy; conv1d_scratch sizes none) */
    const int direct = conv1d_direct(c);
    for (int64_t slot = r0; slot < r1; ++slot) {
        float *scratch = direct ? 0 : (float *)c->scratch + slot * ck * n;  /* [ck, m] */
        for (int64_t u = slot; u < B * nb; u += slots) {
            const int64_t b = u / nb, la = (u % nb) * n, lb = la + n < Lo ? la + n : Lo, m = lb - la;
            const float *cols = scratch;
            int64_t ldc = m;
            if (direct) {
                cols = x + b * c->ss[0][1] + la;
                ldc = c->ss[0][2];
            } else
                for (int64_t r = 0; r < ck; ++r) {
                    const int64_t ci = r / K, k = r % K;
                    conv1d_row(scratch + r * m, x + b * c->ss[0][1] + ci * c->ss[0][2], c->ss[0][3], la, lb, L, s,
                               k * dil - pad);
                }
            float *ob = o + b * Co * Lo + la;
            const int start = bias || skip;   /* the product adds to bias (+ residual) */
            if (start) conv1d_start(o + b * Co * Lo, skip ? skip + b * Co * Lo : 0, bias, 0, Co, Lo, la, lb);
            if (g_sgemm) gemm(NT, NT, Co, m, ck, w, ck, cols, ldc, start ? 1.0f : 0.0f, ob, Lo);
            else conv1d_plain(Co, m, ck, w, cols, ldc, ob, Lo, start);
        }
    }
    return 0;
}
