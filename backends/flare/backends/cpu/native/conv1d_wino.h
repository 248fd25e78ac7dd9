/* ---- conv1d.h's Winograd path, written once for each vector ISA ------------------------------
 * Included by conv1d.h once per ISA, before conv1d_tile.h (which undefines the CT_ macros), with
 * the same CT_ macros plus CW_MR (tile rows per GEMM step) and CW_NV (vectors of output channels).
 * Makes wino_block<S> (a wino_block_t): one block of a Winograd conv1d command (flags & 8).
 *
 * A block is nb = 4*d*J outputs of one batch row: d phases (dilation d) x J tiles of 4 outputs
 * d apart. Tile (p, j) has outputs q0 + d*i (i < 4), q0 = p + 4*d*j, and reads alpha inputs
 * q0 + d*n. The work is time-major ([position][channel]), so every transform and the product
 * are vectors over channels whatever the dilation:
 *   1. xt [nq][Ci] = the block's input window, transposed from x's rows (zeros outside x);
 *   2. v [alpha][nt][Ci] = BT d per tile (BT's zeros fold at compile time);
 *   3. m [alpha][nt][Co] = v[xi] @ U[xi] per transform point (U = G w [alpha][Ci][Co], made once
 *      per weight: winograd.transform_weight), register tiles of CW_MR tiles x CW_NV vectors;
 *   4. y [nb][Co] = AT m per tile;
 *   5. out rows = y transposed (+ bias, + the fused residual).
 * Each output's sums run in one order whatever the thread or ISA (over ci in the product, the
 * constant transforms, the epilogue's two adds), so threads and ISAs give the same bits. */

#define CW_CAT_(a, b) a##b
#define CW_CAT(a, b) CW_CAT_(a, b)
#define CW_FN(name) CW_CAT(name, CT_SUFFIX)

/* v[x * vs] = sum_n BT[x][n] xt[n * step], x < alpha (one vector of channels). The points come in
 * pairs +p, -p (rows 2q+1, 2q+2: winograd.POINTS), whose BT rows agree up to the sign of some
 * columns: E (the columns that agree) and O (the others) are summed once, the rows are E + O and
 * E - O (half the multiply-adds of the pair). Which is which folds at compile time (the tables are
 * constants, the loops unrolled); a pair that is not one (K 2's last point) takes two rows. */
#define CW_IN(KK) \
    INL CT_ATTR void CW_FN(wino_in##KK)(const float *xt, int64_t step, float *v, int64_t vs) { \
        enum { A = WINO_M + KK - 1 }; \
        CT_VEC X[A]; \
        _Pragma("GCC unroll 16") for (int n = 0; n < A; ++n) X[n] = CT_LOAD(xt + n * step); \
        _Pragma("GCC unroll 16") for (int x = 0; x < A; x += A - 1) { \
            CT_VEC acc = CT_ZERO(); \
            _Pragma("GCC unroll 16") for (int n = 0; n < A; ++n) \
                if (WINO_BT##KK[x][n] != 0.0f) acc = CT_FMA(CT_SET1(WINO_BT##KK[x][n]), X[n], acc); \
            CT_STORE(v + x * vs, acc); \
        } \
        _Pragma("GCC unroll 8") for (int q = 1; q + 1 < A - 1; q += 2) { \
            int pair = 1; \
            _Pragma("GCC unroll 16") for (int n = 0; n < A; ++n) \
                pair &= WINO_BT##KK[q + 1][n] == WINO_BT##KK[q][n] || WINO_BT##KK[q + 1][n] == -WINO_BT##KK[q][n]; \
            if (pair) { \
                CT_VEC e = CT_ZERO(), o = CT_ZERO(); \
                _Pragma("GCC unroll 16") for (int n = 0; n < A; ++n) { \
                    const float cq = WINO_BT##KK[q][n]; \
                    if (cq == 0.0f) continue; \
                    if (WINO_BT##KK[q + 1][n] == cq) e = CT_FMA(CT_SET1(cq), X[n], e); \
                    else o = CT_FMA(CT_SET1(cq), X[n], o); \
                } \
                CT_STORE(v + q * vs, CT_ADD(e, o)); \
                CT_STORE(v + (q + 1) * vs, CT_SUB(e, o)); \
            } else \
                _Pragma("GCC unroll 2") for (int x = q; x < q + 2; ++x) { \
                    CT_VEC acc = CT_ZERO(); \
                    _Pragma("GCC unroll 16") for (int n = 0; n < A; ++n) \
                        if (WINO_BT##KK[x][n] != 0.0f) acc = CT_FMA(CT_SET1(WINO_BT##KK[x][n]), X[n], acc); \
                    CT_STORE(v + x * vs, acc); \
                } \
        } \
        if ((A - 2) % 2) { /* a last lone point before infinity (K 2: 0, +-1, 2) */ \
            CT_VEC acc = CT_ZERO(); \
            _Pragma("GCC unroll 16") for (int n = 0; n < A; ++n) \
                if (WINO_BT##KK[A - 2][n] != 0.0f) acc = CT_FMA(CT_SET1(WINO_BT##KK[A - 2][n]), X[n], acc); \
            CT_STORE(v + (A - 2) * vs, acc); \
        } \
    }
/* y[i * ys] = sum_x AT[i][x] m[x * ms], i < 4; a pair of points' columns (AT[i][b] = +-AT[i][a])
 * through their sum and difference, formed once: one multiply-add per output instead of two */
#define CW_OUT(KK) \
    INL CT_ATTR void CW_FN(wino_out##KK)(const float *m, int64_t ms, float *y, int64_t ys) { \
        enum { A = WINO_M + KK - 1, NP = (A - 2) / 2 }; \
        CT_VEC X[A], S[NP], D[NP]; \
        _Pragma("GCC unroll 16") for (int x = 0; x < A; ++x) X[x] = CT_LOAD(m + x * ms); \
        _Pragma("GCC unroll 8") for (int p = 0; p < NP; ++p) { \
            S[p] = CT_ADD(X[2 * p + 1], X[2 * p + 2]); \
            D[p] = CT_SUB(X[2 * p + 1], X[2 * p + 2]); \
        } \
        _Pragma("GCC unroll 4") for (int i = 0; i < WINO_M; ++i) { \
            CT_VEC acc = CT_ZERO(); \
            _Pragma("GCC unroll 16") for (int x = 0; x < A; ++x) { \
                const float c = WINO_AT##KK[i][x]; \
                const int p = (x - 1) / 2, paired = x >= 1 && x <= 2 * NP; \
                if (c == 0.0f) continue; \
                if (paired && x % 2 == 1 && WINO_AT##KK[i][x + 1] == c) acc = CT_FMA(CT_SET1(c), S[p], acc); \
                else if (paired && x % 2 == 1 && WINO_AT##KK[i][x + 1] == -c) acc = CT_FMA(CT_SET1(c), D[p], acc); \
                else if (paired && x % 2 == 0 && (WINO_AT##KK[i][x - 1] == c || WINO_AT##KK[i][x - 1] == -c)) \
                    continue;   /* taken with its pair's first column */ \
                else acc = CT_FMA(CT_SET1(c), X[x], acc); \
            } \
            CT_STORE(y + i * ys, acc); \
        } \
    }
CW_IN(2) CW_IN(3) CW_IN(5) CW_IN(7)
CW_OUT(2) CW_OUT(3) CW_OUT(5) CW_OUT(7)
#undef CW_IN
#undef CW_OUT

/* m[r][co0 + v*LANES..] (row stride Co) = sum over ci < Ci of v_[r][ci] * u[ci][co0 + ..] (row stride Co) */
INL CT_ATTR void CW_FN(wino_tile)(const int MR, const int NV, const float *v_, int64_t Ci, const float *u, int64_t Co,
                                  float *m) {
    CT_VEC acc[CW_MR][CW_NV];
#pragma GCC unroll 12
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) acc[r][v] = CT_ZERO();
    for (int64_t ci = 0; ci < Ci; ++ci) {
        CT_VEC uv[CW_NV];
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) uv[v] = CT_LOAD(u + ci * Co + CT_LANES * v);
#pragma GCC unroll 12
        for (int r = 0; r < MR; ++r) {
            const CT_VEC b = CT_SET1(v_[r * Ci + ci]);
#pragma GCC unroll 4
            for (int v = 0; v < NV; ++v) acc[r][v] = CT_FMA(b, uv[v], acc[r][v]);
        }
    }
#pragma GCC unroll 12
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) CT_STORE(m + r * Co + CT_LANES * v, acc[r][v]);
}

/* block `blk` of batch row b, in the slot's scratch s (wino_slot_floats floats) */
CT_ATTR static void CW_FN(wino_block)(const flare_cmd *c, const wino_geom *g, int64_t b, int64_t blk, float *s) {
    const int64_t Co = c->ne[2], Lo = c->ne[3], pad = c->ip[1], d = c->ip[2], Ci = c->ip[3], K = c->ip[4], L = c->ip[5];
    const int64_t A = g->a, J = g->J, nt = g->nt, nb = g->nb, nq = g->nq, la = blk * nb;
    const float *x = (const float *)c->src[0] + b * c->ss[0][1], *U = (const float *)c->src[1];
    const int64_t xcs = c->ss[0][2];
    float *xt = s, *v = xt + nq * Ci, *m = v + A * nt * Ci, *y = m + A * nt * Co;
    /* 1. the input window, time-major */
    wino_gather(x, xcs, la - pad, L, nq, Ci, xt);
    /* 2. input transforms, per tile and vector of channels */
    for (int64_t t = 0; t < nt; ++t) {
        const int64_t q0 = t / J + 4 * d * (t % J);
        for (int64_t ci = 0; ci < Ci; ci += CT_LANES) {
            const float *src = xt + q0 * Ci + ci;
            float *dst = v + t * Ci + ci;
            if (K == 2) CW_FN(wino_in2)(src, d * Ci, dst, nt * Ci);
            else if (K == 3) CW_FN(wino_in3)(src, d * Ci, dst, nt * Ci);
            else if (K == 5) CW_FN(wino_in5)(src, d * Ci, dst, nt * Ci);
            else CW_FN(wino_in7)(src, d * Ci, dst, nt * Ci);
        }
    }
    /* 3. one product per transform point; nt is a multiple of CW_MR (wino_geometry) */
    for (int64_t x_ = 0; x_ < A; ++x_) {
        const float *ux = U + x_ * Ci * Co, *vx = v + x_ * nt * Ci;
        float *mx = m + x_ * nt * Co;
        for (int64_t co = 0; co < Co; co += CW_NV * CT_LANES) {
            const int nv = (int)((Co - co) / CT_LANES < CW_NV ? (Co - co) / CT_LANES : CW_NV);
            for (int64_t t = 0; t < nt; t += CW_MR) {
                if (nv == CW_NV) CW_FN(wino_tile)(CW_MR, CW_NV, vx + t * Ci, Ci, ux + co, Co, mx + t * Co + co);
                else CW_FN(wino_tile)(CW_MR, 1, vx + t * Ci, Ci, ux + co, Co, mx + t * Co + co);
            }
        }
    }
    /* 4. output transforms into y [nb][Co] */
    for (int64_t t = 0; t < nt; ++t) {
        const int64_t q0 = t / J + 4 * d * (t % J);
        for (int64_t co = 0; co < Co; co += CT_LANES) {
            const float *src = m + t * Co + co;
            float *dst = y + q0 * Co + co;
            if (K == 2) CW_FN(wino_out2)(src, nt * Co, dst, d * Co);
            else if (K == 3) CW_FN(wino_out3)(src, nt * Co, dst, d * Co);
            else if (K == 5) CW_FN(wino_out5)(src, nt * Co, dst, d * Co);
            else CW_FN(wino_out7)(src, nt * Co, dst, d * Co);
        }
    }
    /* 5. into out's rows */
    const float *skip = conv1d_skip(c) ? conv1d_skip(c) + b * Co * Lo : 0;
    wino_scatter(y, Co, (const float *)c->src[2], skip, (float *)c->out + b * Co * Lo, Lo, la,
                 Lo - la < nb ? Lo - la : nb);
}

#undef CW_FN
#undef CW_CAT
#undef CW_CAT_
