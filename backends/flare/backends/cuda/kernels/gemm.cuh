// gemm.cuh: the pieces of Flare's shared-memory tiled GEMM (matmul.cu, conv.cu).
//
// A block of MM_THREADS threads computes a BM x BN output tile. Per K step it stages
// As[BK][BM + 4] and Bs[BK][BN + 4] in shared memory (both "k-major": a thread's TM rows
// and its TN columns are read as broadcasts / consecutive addresses, the +4 pad keeps
// float4 alignment of rows), then each thread accumulates TM x TN outputs in registers.
// Thread (tx, ty) owns rows ty*TM + i and columns tx + j*(BN/TN): neighbouring threads
// own neighbouring columns, so their shared reads and their output stores are contiguous.
#pragma once
#include "common.cuh"

#define MM_THREADS 256

// Loads R rows x BK (along K) of a K-contiguous operand into S[k][row] (transposed, so a
// thread's TM rows sit side by side), zero outside M/N x K. `vec`: K % 4 == 0 and rows
// 16-byte aligned, so each (row, 4 k) is one float4 load. HALF: f16 storage.
template <int R, int BK, int LD, bool HALF>
FLARE_DEVICE void flare_tile_kcontig(float (*S)[LD], const void* ptr, i64 base, i64 rstride, i64 r0, i64 rows,
                                     i64 k0, i64 K, bool vec, int tid) {
    if (!HALF && vec) {
        const float* p = (const float*)ptr;
        for (int v = tid; v < R * BK / 4; v += MM_THREADS) {
            const int r = v / (BK / 4), kq = (v % (BK / 4)) * 4;
            const i64 gr = r0 + r, gk = k0 + kq;
            float4 q = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (gr < rows && gk < K) q = *(const float4*)(p + base + gr * rstride + gk);
            S[kq][r] = q.x; S[kq + 1][r] = q.y; S[kq + 2][r] = q.z; S[kq + 3][r] = q.w;
        }
        return;
    }
    for (int v = tid; v < R * BK; v += MM_THREADS) {  // neighbouring threads take neighbouring k
        const int r = v / BK, kk = v % BK;
        const i64 gr = r0 + r, gk = k0 + kk;
        float x = 0.0f;
        if (gr < rows && gk < K) {
            const i64 off = base + gr * rstride + gk;
            x = HALF ? flare_h2f(((const unsigned short*)ptr)[off]) : ((const float*)ptr)[off];
        }
        S[kk][r] = x;
    }
}

// acc[i][j] += sum over the staged BK slice of As[k][row i] * Bs[k][column j]
template <int BM, int BN, int BK, int TM, int TN>
FLARE_DEVICE void flare_tile_accumulate(const float (*As)[BM + 4], const float (*Bs)[BN + 4], float (*acc)[TN],
                                        int tx, int ty) {
    for (int kk = 0; kk < BK; ++kk) {
        float ra[TM], rb[TN];
        for (int i = 0; i < TM; ++i) ra[i] = As[kk][ty * TM + i];
        for (int j = 0; j < TN; ++j) rb[j] = Bs[kk][tx + j * (BN / TN)];
        for (int i = 0; i < TM; ++i)
            for (int j = 0; j < TN; ++j) acc[i][j] += ra[i] * rb[j];
    }
}
