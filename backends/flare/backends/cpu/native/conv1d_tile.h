/* ---- conv1d.h's tiled kernel, written once for each vector ISA --------------------------------
 * Included by conv1d.h once per ISA, after it defines: CT_SUFFIX (the functions' suffix: 512,
 * 256), CT_ATTR (their target attribute), CT_VEC (the float vector), CT_LANES (floats in it),
 * CT_NVMAX (vectors of output columns per tile), CT_MASK and CT_LANE_MASK(lo, hi) (a lane mask:
 * lanes t with lo <= t < hi), CT_LOAD / CT_MLOAD (masked lanes neither read nor faulted),
 * CT_STORE / CT_MSTORE, CT_SET1, CT_ZERO and CT_FMA. Makes ctile_tile<S>, ctile_masks<S> and
 * ctile_block<S> (a ctile_block_t), and undefines those macros. */
#define CT_CAT_(a, b) a##b
#define CT_CAT(a, b) CT_CAT_(a, b)
#define CT_FN(name) CT_CAT(name, CT_SUFFIX)
#define CT_COLS (CT_LANES * CT_NVMAX)

/* o[r, j] (r < MR, j < ncols <= CT_LANES*NV; row stride ldo) for output columns l0 + j, over input
 * channels [0, Ci) of xp0 (x's batch row at position l0 - pad, channel stride xcs) and w (rows
 * co.., stride ck; ci's taps at ci*K); start: bias (or 0) where `first`, else what o holds (a
 * later channel chunk, or the fused residual ctile_block put there). edge: x read through m[k][v],
 * the lanes of tap k inside x (ctile_masks). */
INL CT_ATTR void CT_FN(ctile_tile)(const int MR, const int NV, const int edge, int first, int64_t Ci, int64_t K,
                                   int64_t dil, const float *xp0, int64_t xcs, const CT_MASK (*m)[CT_NVMAX],
                                   const float *w, int64_t ck, const float *bias, float *o, int64_t ldo,
                                   int64_t ncols) {
    CT_VEC acc[CT_MR][CT_NVMAX];
    const int full = ncols >= CT_LANES * NV;
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) {
        const CT_VEC bv = first && bias ? CT_SET1(bias[r]) : CT_ZERO();
#pragma GCC unroll 6
        for (int v = 0; v < NV; ++v)
            acc[r][v] = first ? bv : full ? CT_LOAD(o + r * ldo + CT_LANES * v)
                                          : CT_MLOAD(CT_LANE_MASK(0, ncols - CT_LANES * v), o + r * ldo + CT_LANES * v);
    }
    for (int64_t ci = 0; ci < Ci; ++ci) {
        const float *xr = xp0 + ci * xcs, *wr = w + ci * K;
        for (int64_t k = 0; k < K; ++k) {
            const float *xp = xr + k * dil;
            CT_VEC xv[CT_NVMAX];
#pragma GCC unroll 6
            for (int v = 0; v < NV; ++v)
                xv[v] = edge ? CT_MLOAD(m[k][v], xp + CT_LANES * v) : CT_LOAD(xp + CT_LANES * v);
#pragma GCC unroll 4
            for (int r = 0; r < MR; ++r) {
                const CT_VEC wv = CT_SET1(wr[r * ck + k]);
#pragma GCC unroll 6
                for (int v = 0; v < NV; ++v) acc[r][v] = CT_FMA(wv, xv[v], acc[r][v]);
            }
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 6
        for (int v = 0; v < NV; ++v) {
            if (full) CT_STORE(o + r * ldo + CT_LANES * v, acc[r][v]);
            else CT_MSTORE(CT_LANE_MASK(0, ncols - CT_LANES * v), o + r * ldo + CT_LANES * v, acc[r][v]);
        }
}

/* m[k][v]: lanes of vector v whose column j (< ncols) reads x at p0 + k*dil + j inside [0, L) */
CT_ATTR static void CT_FN(ctile_masks)(CT_MASK (*m)[CT_NVMAX], int64_t K, int64_t dil, int64_t p0, int64_t L,
                                       int64_t ncols) {
    for (int64_t k = 0; k < K; ++k) {
        const int64_t off = p0 + k * dil, lo = -off, hi = L - off < ncols ? L - off : ncols;
        for (int v = 0; v < CT_NVMAX; ++v) m[k][v] = CT_LANE_MASK(lo - CT_LANES * v, hi - CT_LANES * v);
    }
}

#define CT_NV_AT_MOST(n) ((n) < CT_NVMAX ? (n) : CT_NVMAX)   /* a case beyond this ISA's tile never runs */
#define CT_TILE_NV(MR, NV) do { \
        if (edge) CT_FN(ctile_tile)(MR, CT_NV_AT_MOST(NV), 1, first, nci, K, dil, xp0 + ci0 * xcs, xcs, \
                                    (const CT_MASK (*)[CT_NVMAX])m, w + co * ck + ci0 * K, ck, bias ? bias + co : 0, \
                                    ob + co * Lo, Lo, ncols); \
        else CT_FN(ctile_tile)(MR, CT_NV_AT_MOST(NV), 0, first, nci, K, dil, xp0 + ci0 * xcs, xcs, 0, \
                               w + co * ck + ci0 * K, ck, bias ? bias + co : 0, ob + co * Lo, Lo, ncols); \
    } while (0)
#define CT_TILE(MR) do { \
        switch (nv) { \
        case 6: CT_TILE_NV(MR, 6); break; case 5: CT_TILE_NV(MR, 5); break; case 4: CT_TILE_NV(MR, 4); break; \
        case 3: CT_TILE_NV(MR, 3); break; case 2: CT_TILE_NV(MR, 2); break; default: CT_TILE_NV(MR, 1); break; \
        } \
    } while (0)

/* Taps up to CT_KMAX (the masks' table); longer kernels take im2col + GEMM. Input channels in
 * chunks whose x window (chunk x (CT_COLS + reach) floats) stays about CT_WINDOW floats (16 KiB,
 * in L1 while every channel tile of the unit passes over it); each later chunk adds to the sums
 * already in o, in the same (ci, k) order. */

/* output columns [la, lb) x channels [c0, c1) of batch row b */
CT_ATTR static void CT_FN(ctile_block)(const flare_cmd *c, int64_t b, int64_t la, int64_t lb, int64_t c0,
                                       int64_t c1) {
    const int64_t Lo = c->ne[3], pad = c->ip[1], dil = c->ip[2], Ci = c->ip[3], K = c->ip[4], L = c->ip[5];
    const int64_t ck = Ci * K, xcs = c->ss[0][2], reach = (K - 1) * dil;
    const float *w = (const float *)c->src[1], *bias = (const float *)c->src[2];
    const float *xb = (const float *)c->src[0] + b * c->ss[0][1];
    float *o = (float *)c->out + b * c->ne[2] * Lo;
    const float *skip = conv1d_skip(c) ? conv1d_skip(c) + b * c->ne[2] * Lo : 0;
    int64_t chunk = CT_WINDOW / (CT_COLS + reach);
    chunk = chunk < 8 ? 8 : chunk;
    if (Ci - chunk < chunk / 2) chunk = Ci;   /* no small last chunk */
    CT_MASK m[CT_KMAX][CT_NVMAX];
    if (skip)   /* the fused residual (+ bias) into the block first, row by row: read in the tiles,
                 * 4 rows x a few vectors at a time across rows 4*Lo floats apart, it cost more than
                 * the separate add it replaced (Piper: +19 ms over 22 convolutions, against ~9) */
        conv1d_start(o, skip, bias, c0, c1, Lo, la, lb);
    for (int64_t l0 = la; l0 < lb; l0 += CT_COLS) {
        const int64_t ncols = lb - l0 < CT_COLS ? lb - l0 : CT_COLS, p0 = l0 - pad;
        const int64_t nv = (ncols + CT_LANES - 1) / CT_LANES;
        const int edge = p0 < 0 || p0 + CT_LANES * nv + reach > L;   /* a full-width load past x's end */
        if (edge) CT_FN(ctile_masks)(m, K, dil, p0, L, ncols);
        const float *xp0 = xb + p0;   /* may point before x: edge tiles read it only through masks */
        float *ob = o + l0;
        for (int64_t ci0 = 0; ci0 < Ci; ci0 += chunk) {
            const int64_t nci = Ci - ci0 < chunk ? Ci - ci0 : chunk;
            const int first = ci0 == 0 && !skip;   /* a fused residual: o already holds the start */
            int64_t co = c0;
            for (; co + CT_MR <= c1; co += CT_MR) CT_TILE(4);
            switch (c1 - co) {
            case 3: CT_TILE(3); break;
            case 2: CT_TILE(2); break;
            case 1: CT_TILE(1); break;
            default: break;
            }
        }
    }
}

#undef CT_TILE
#undef CT_TILE_NV
#undef CT_NV_AT_MOST
#undef CT_COLS
#undef CT_FN
#undef CT_CAT
#undef CT_CAT_
#undef CT_SUFFIX
#undef CT_ATTR
#undef CT_VEC
#undef CT_LANES
#undef CT_NVMAX
#undef CT_MASK
#undef CT_LANE_MASK
#undef CT_LOAD
#undef CT_MLOAD
#undef CT_STORE
#undef CT_MSTORE
#undef CT_SET1
#undef CT_ZERO
#undef CT_FMA
#undef CT_ADD
#undef CT_SUB
