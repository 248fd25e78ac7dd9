// conv.cu: 1-D convolution (zero padding, no bias).
#include "common.cuh"
#include "gemm.cuh"

// One thread per output (the `naive` variant). t0 = x [1,B,Cin,L], t1 = w [1,Cout,Cin,K],
// t2 = out [1,B,Cout,Lout]; i[0] = stride, i[1] = padding, i[2] = dilation; n = out.size
FLARE_KERNEL(flare_conv1d) {
    i64 e = flare_thread_index();
    if (e >= A.n) return;
    const TensorDesc& x = A.t[0];
    const TensorDesc& w = A.t[1];
    const i64 Lout = A.t[2].shape[3], Cout = A.t[2].shape[2];
    const i64 Cin = x.shape[2], L = x.shape[3], K = w.shape[3];
    const i64 l = e % Lout, co = (e / Lout) % Cout, b = e / (Lout * Cout);
    const i64 start = l * A.i[0] - A.i[1];
    float acc = 0.0f;
    for (i64 ci = 0; ci < Cin; ++ci) {
        const i64 px = x.offset + b * x.stride[1] + ci * x.stride[2];
        const i64 pw = w.offset + co * w.stride[1] + ci * w.stride[2];
        for (i64 q = 0; q < K; ++q) {
            const i64 pos = start + q * A.i[2];
            if (pos < 0 || pos >= L) continue;
            acc += flare_load(x, px + pos * x.stride[3]) * flare_load(w, pw + q * w.stride[3]);
        }
    }
    flare_store(A.t[2], A.t[2].offset + e, acc);
}

// ---- conv1d as one tiled GEMM ----------------------------------------------------------
// out[b, co, l] = sum over k = (ci, q) of w[co, ci, q] * x[b, ci, l*stride - pad + q*dil]:
// M = Cout, K = Cin*Kw, and the columns n = (b, l) of all batches at once (silero-vad's
// frontend has Lout = 4 per chunk and many chunks: one GEMM, not one per chunk). The
// x tile is gathered (zero outside the padded input); w rows are K-contiguous when w is
// contiguous (float4 loads when Cin*Kw % 4 == 0, launch flag i[3] bit 0).
// t0 = x [1,B,Cin,L], t1 = w [1,Cout,Cin,Kw], t2 = out [1,B,Cout,Lout] (contiguous);
// i[0] = stride, i[1] = padding, i[2] = dilation, i[3] bit 0: w as float4, bit 1: w
// contiguous f32. grid = (ceil(B*Lout/BN), ceil(Cout/BM)).
template <int BM, int BN, int BK, int TM, int TN>
FLARE_DEVICE void flare_conv_tiled(const KArgs& A) {
    __shared__ float As[BK][BM + 4];
    __shared__ float Bs[BK][BN + 4];
    const TensorDesc& x = A.t[0];
    const TensorDesc& w = A.t[1];
    const TensorDesc& o = A.t[2];
    const i64 Cin = x.shape[2], L = x.shape[3], Kw = w.shape[3];
    const i64 M = w.shape[1], K = Cin * Kw, Lout = o.shape[3], N = o.shape[1] * Lout;
    const i64 stride = A.i[0], pad = A.i[1], dil = A.i[2];
    const i64 m0 = (i64)blockIdx.y * BM, n0 = (i64)blockIdx.x * BN;
    const int tid = (int)threadIdx.x, tx = tid % (BN / TN), ty = tid / (BN / TN);
    const bool w_rows = (A.i[3] & 2) != 0;
    float acc[TM][TN] = {};
    for (i64 k0 = 0; k0 < K; k0 += BK) {
        if (w_rows) {
            flare_tile_kcontig<BM, BK, BM + 4, false>(As, (const void*)w.ptr, w.offset, K, m0, M, k0, K,
                                                      (A.i[3] & 1) != 0, tid);
        } else {
            for (int v = tid; v < BM * BK; v += MM_THREADS) {
                const int r = v / BK, kk = v % BK;
                const i64 gm = m0 + r, gk = k0 + kk;
                As[kk][r] = (gm < M && gk < K)
                    ? flare_load(w, w.offset + gm * w.stride[1] + (gk / Kw) * w.stride[2] + (gk % Kw) * w.stride[3])
                    : 0.0f;
            }
        }
        for (int v = tid; v < BK * BN; v += MM_THREADS) {  // neighbouring threads: neighbouring (b, l)
            const int kk = v / BN, c = v % BN;
            const i64 gn = n0 + c, gk = k0 + kk;
            float val = 0.0f;
            if (gn < N && gk < K) {
                const i64 b = gn / Lout, l = gn % Lout, ci = gk / Kw, q = gk % Kw;
                const i64 pos = l * stride - pad + q * dil;
                if (pos >= 0 && pos < L)
                    val = flare_load(x, x.offset + b * x.stride[1] + ci * x.stride[2] + pos * x.stride[3]);
            }
            Bs[kk][c] = val;
        }
        __syncthreads();
        flare_tile_accumulate<BM, BN, BK, TM, TN>(As, Bs, acc, tx, ty);
        __syncthreads();
    }
    for (int i = 0; i < TM; ++i) {
        const i64 gm = m0 + ty * TM + i;
        if (gm >= M) continue;
        for (int j = 0; j < TN; ++j) {
            const i64 gn = n0 + tx + j * (BN / TN);
            if (gn < N) flare_store(o, o.offset + ((gn / Lout) * M + gm) * Lout + gn % Lout, acc[i][j]);
        }
    }
}

FLARE_KERNEL(flare_conv_s) { flare_conv_tiled<32, 32, 16, 2, 2>(A); }
FLARE_KERNEL(flare_conv_m) { flare_conv_tiled<64, 64, 16, 4, 4>(A); }
FLARE_KERNEL(flare_conv_l) { flare_conv_tiled<128, 128, 8, 8, 8>(A); }
