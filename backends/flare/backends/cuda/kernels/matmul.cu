// matmul.cu: batched matmul with broadcast batch axes, and the MoE expert matmul.
//
// Three shapes of kernel, chosen by lowering.py:
//  - flare_mm_<tile>_<layout>[_h]: shared-memory tiled GEMM. A block computes a
//    BM x BN tile of the output for one batch (blockIdx.z), stepping over K in BK
//    slices staged in shared memory; each of its 256 threads accumulates TM x TN
//    outputs in registers. Layouts are compile-time: `nt` (a and b both contiguous
//    along K: x @ w.T, every linear layer), `nn` (b contiguous along N), `st` (any
//    strides: the fallback). On contiguous f32 operands whose rows are 16-byte
//    aligned the tiles are loaded as float4 (launch flag). `_h`: b is f16 (weights).
//    Tiles (s: 32x32x16 2x2, m: 64x64x16 4x4, l: 128x128x8 8x8) are the variants a
//    tuning profile chooses between (SplitProgram.tuning["matmul"]).
//  - flare_mv_*: matrix-vector products for few rows (decode) and the MoE expert
//    matmul: one block per output row, K staged through shared memory in chunks,
//    each warp computing MV_ROWS outputs with float4 loads of contiguous weight
//    rows and a warp-shuffle reduction (cf. ggml's mmvq).
//  - flare_matmul: one thread per output over any strides and dtypes (last resort).
#include "common.cuh"
#include "gemm.cuh"

// ---- tiled GEMM -------------------------------------------------------------------

enum { L_NT = 0, L_NN = 1, L_ST = 2 };

// t0 = a [B0,B1,M,K], t1 = b [B0,B1,K,N] (transpose_b is a stride swap done on the
// host; batch strides are 0 where broadcast), t2 = out [B0,B1,M,N];
// i[0] bit 0: a rows may be read as float4, bit 1: b likewise; i[4], i[5], t4, t5: the
// fused epilogue (flare_epilogue). grid = (ceil(N/BN), ceil(M/BM), B0*B1), block = 256.
template <int BM, int BN, int BK, int TM, int TN, int LAYOUT, bool BHALF>
FLARE_DEVICE void flare_mm_tiled(const KArgs& A) {
    static_assert((BM / TM) * (BN / TN) == MM_THREADS, "a tile is 256 threads");
    __shared__ float As[BK][BM + 4];  // a tile transposed: a thread's TM rows sit side by side
    __shared__ float Bs[BK][BN + 4];
    const TensorDesc& a = A.t[0];
    const TensorDesc& b = A.t[1];
    const TensorDesc& o = A.t[2];
    const i64 M = a.shape[2], K = a.shape[3], N = b.shape[3];
    const i64 z = blockIdx.z, b1 = z % o.shape[1], b0 = z / o.shape[1];
    const i64 pa = a.offset + b0 * a.stride[0] + b1 * a.stride[1];
    const i64 pb = b.offset + b0 * b.stride[0] + b1 * b.stride[1];
    const i64 po = o.offset + b0 * o.stride[0] + b1 * o.stride[1];
    const i64 sam = a.stride[2], sak = a.stride[3], sbk = b.stride[2], sbn = b.stride[3];
    const i64 m0 = (i64)blockIdx.y * BM, n0 = (i64)blockIdx.x * BN;
    const int tid = (int)threadIdx.x;
    const int tx = tid % (BN / TN), ty = tid / (BN / TN);
    const bool vec_a = LAYOUT != L_ST && (A.i[0] & 1);
    const bool vec_b = LAYOUT != L_ST && !BHALF && (A.i[0] & 2);
    const float* bp = (const float*)b.ptr;
    const unsigned short* bh = (const unsigned short*)b.ptr;

    float acc[TM][TN] = {};
    for (i64 k0 = 0; k0 < K; k0 += BK) {
        // a tile: BM rows x BK along K
        if (LAYOUT != L_ST) {
            flare_tile_kcontig<BM, BK, BM + 4, false>(As, (const void*)a.ptr, pa, sam, m0, M, k0, K, vec_a, tid);
        } else {
            for (int v = tid; v < BM * BK; v += MM_THREADS) {  // neighbouring threads take neighbouring m
                const int r = v % BM, kk = v / BM;
                const i64 gm = m0 + r, gk = k0 + kk;
                As[kk][r] = (gm < M && gk < K) ? flare_load(a, pa + gm * sam + gk * sak) : 0.0f;
            }
        }
        // b tile: BK along K x BN columns
        if (LAYOUT == L_NT) {  // b[k, n] at n * sbn + k: contiguous along k, loaded like a
            flare_tile_kcontig<BN, BK, BN + 4, BHALF>(Bs, (const void*)b.ptr, pb, sbn, n0, N, k0, K, vec_b, tid);
        } else if (LAYOUT == L_NN) {  // b[k, n] at k * sbk + n: contiguous along n
            if (vec_b) {
                for (int v = tid; v < BK * BN / 4; v += MM_THREADS) {
                    const int kk = v / (BN / 4), c = (v % (BN / 4)) * 4;
                    const i64 gn = n0 + c, gk = k0 + kk;
                    float4 q = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                    if (gn < N && gk < K) q = *(const float4*)(bp + pb + gk * sbk + gn);
                    Bs[kk][c] = q.x; Bs[kk][c + 1] = q.y; Bs[kk][c + 2] = q.z; Bs[kk][c + 3] = q.w;
                }
            } else {
                for (int v = tid; v < BK * BN; v += MM_THREADS) {
                    const int kk = v / BN, c = v % BN;
                    const i64 gn = n0 + c, gk = k0 + kk;
                    float x = 0.0f;
                    if (gn < N && gk < K) x = BHALF ? flare_h2f(bh[pb + gk * sbk + gn]) : bp[pb + gk * sbk + gn];
                    Bs[kk][c] = x;
                }
            }
        } else {
            for (int v = tid; v < BK * BN; v += MM_THREADS) {
                const int kk = v / BN, c = v % BN;
                const i64 gn = n0 + c, gk = k0 + kk;
                Bs[kk][c] = (gn < N && gk < K) ? flare_load(b, pb + gk * sbk + gn * sbn) : 0.0f;
            }
        }
        __syncthreads();
        flare_tile_accumulate<BM, BN, BK, TM, TN>(As, Bs, acc, tx, ty);
        __syncthreads();  // the tiles are overwritten next step
    }
    for (int i = 0; i < TM; ++i) {
        const i64 gm = m0 + ty * TM + i;
        if (gm >= M) continue;
        for (int j = 0; j < TN; ++j) {
            const i64 gn = n0 + tx + j * (BN / TN);  // neighbouring threads store neighbouring n
            if (gn < N) flare_store(o, po + gm * o.stride[2] + gn * o.stride[3], flare_epilogue(A, acc[i][j], b0, b1, gm, gn));
        }
    }
}

#define FLARE_MM(tile, BM, BN, BK, TM, TN)                                                             \
    FLARE_KERNEL(flare_mm_##tile##_nt) { flare_mm_tiled<BM, BN, BK, TM, TN, L_NT, false>(A); }        \
    FLARE_KERNEL(flare_mm_##tile##_nn) { flare_mm_tiled<BM, BN, BK, TM, TN, L_NN, false>(A); }        \
    FLARE_KERNEL(flare_mm_##tile##_st) { flare_mm_tiled<BM, BN, BK, TM, TN, L_ST, false>(A); }        \
    FLARE_KERNEL(flare_mm_##tile##_nt_h) { flare_mm_tiled<BM, BN, BK, TM, TN, L_NT, true>(A); }       \
    FLARE_KERNEL(flare_mm_##tile##_nn_h) { flare_mm_tiled<BM, BN, BK, TM, TN, L_NN, true>(A); }

// (kernel names are listed for compiler.KernelSource.kernels() by FLARE_KERNELS lines)
// FLARE_KERNELS: flare_mm_s_nt flare_mm_s_nn flare_mm_s_st flare_mm_s_nt_h flare_mm_s_nn_h
FLARE_MM(s, 32, 32, 16, 2, 2)
// FLARE_KERNELS: flare_mm_m_nt flare_mm_m_nn flare_mm_m_st flare_mm_m_nt_h flare_mm_m_nn_h
FLARE_MM(m, 64, 64, 16, 4, 4)
// FLARE_KERNELS: flare_mm_l_nt flare_mm_l_nn flare_mm_l_st flare_mm_l_nt_h flare_mm_l_nn_h
FLARE_MM(l, 128, 128, 8, 8, 8)

// ---- matrix-vector: few rows, and the MoE expert matmul --------------------------------

#define MV_THREADS 256
#define MV_ROWS 2        // outputs n per warp
#define MV_MAX_M 4       // rows of x per block (lowering.MV_MAX_ROWS): each weight load serves all
#define MV_CHUNK 1024    // K staged through shared memory per step

// out[p, m, n] = sum_k x[p, m, k] * w[n, k], w's rows contiguous along k. One block per p
// (n = blocks' p count) and MV_ROWS * 8 outputs n; the block's M <= MV_MAX_M rows of x are
// staged through shared memory together, so every weight element read (float4 when
// possible) is used M times, and each warp keeps MV_ROWS x M sums (cf. ggml's mmvq).
// IDS: p = (t, j), M = 1; x = t1 [1,T,k,K] (stride 0 on k when shared), w = t0[ids[t,j]]
// (t0 [1,E,N,K]); ids = t2 [1,1,T,k]; out = t3 [1,T,k,N].
// Plain: x = t0 [B0,B1,M,K], w = t1 read as [B0,B1,N,K] (its [K,N] view with
// stride[2] == 1), out = t2 [B0,B1,M,N]; p = the batch.
// i[0] bit 1: w rows may be read as float4 (f32, K % 4 == 0, aligned).
template <bool IDS, bool WHALF>
FLARE_DEVICE void flare_mv(const KArgs& A) {
    __shared__ float xs[MV_MAX_M][MV_CHUNK];
    const TensorDesc& w = IDS ? A.t[0] : A.t[1];
    const TensorDesc& x = IDS ? A.t[1] : A.t[0];
    const TensorDesc& o = IDS ? A.t[3] : A.t[2];
    const i64 K = x.shape[3], N = o.shape[3];
    const i64 p = (i64)blockIdx.z * gridDim.y + blockIdx.y;  // beyond 65535 continues in z
    if (p >= A.n) return;  // whole block
    i64 px, pw, po, swn, sxm = 0, som = 0, b0 = 0, b1 = 0;
    int M = 1;
    if (IDS) {
        const TensorDesc& ids = A.t[2];
        const i64 kk = o.shape[2], t = p / kk, j = p % kk;
        i64 e = flare_load_int(ids, ids.offset + t * ids.stride[2] + j * ids.stride[3]);
        if (e < 0) e += w.shape[1];
        px = x.offset + t * x.stride[1] + j * x.stride[2];
        pw = w.offset + e * w.stride[1];
        po = o.offset + t * o.stride[1] + j * o.stride[2];
        swn = w.stride[2];
    } else {
        b1 = p % o.shape[1];
        b0 = p / o.shape[1];
        M = (int)o.shape[2];
        px = x.offset + b0 * x.stride[0] + b1 * x.stride[1];
        pw = w.offset + b0 * w.stride[0] + b1 * w.stride[1];
        po = o.offset + b0 * o.stride[0] + b1 * o.stride[1];
        sxm = x.stride[2];
        som = o.stride[2];
        swn = w.stride[3];  // [K,N] view of a [N,K] row-major weight: n steps by stride[3]
    }
    const int tid = (int)threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const i64 nbase = (i64)blockIdx.x * (MV_THREADS / 32) * MV_ROWS + (i64)warp * MV_ROWS;
    const bool vec = !WHALF && (A.i[0] & 2);
    const float* wp = (const float*)w.ptr;
    const unsigned short* wh = (const unsigned short*)w.ptr;
    float acc[MV_ROWS][MV_MAX_M] = {};
    for (i64 k0 = 0; k0 < K; k0 += MV_CHUNK) {
        const int len = (int)(K - k0 < MV_CHUNK ? K - k0 : MV_CHUNK);
        __syncthreads();  // the previous chunk is no longer read
        for (int q = tid; q < M * len; q += MV_THREADS)
            xs[q / len][q % len] = flare_load(x, px + (q / len) * sxm + (k0 + q % len) * x.stride[3]);
        __syncthreads();
        for (int r = 0; r < MV_ROWS; ++r) {
            const i64 n = nbase + r;
            if (n >= N) break;
            const i64 row = pw + n * swn + k0;
            if (vec) {  // len % 4 == 0 here (K % 4 == 0 and MV_CHUNK % 4 == 0)
                for (int q = lane * 4; q < len; q += 128) {
                    const float4 v = *(const float4*)(wp + row + q);
                    for (int mi = 0; mi < MV_MAX_M; ++mi) {
                        if (mi >= M) break;
                        acc[r][mi] += v.x * xs[mi][q] + v.y * xs[mi][q + 1] + v.z * xs[mi][q + 2] + v.w * xs[mi][q + 3];
                    }
                }
            } else {
                for (int q = lane; q < len; q += 32) {
                    const float v = WHALF ? flare_h2f(wh[row + q]) : wp[row + q];
                    for (int mi = 0; mi < MV_MAX_M; ++mi) {
                        if (mi >= M) break;
                        acc[r][mi] += v * xs[mi][q];
                    }
                }
            }
        }
    }
    for (int r = 0; r < MV_ROWS; ++r) {
        const i64 n = nbase + r;
        for (int mi = 0; mi < MV_MAX_M; ++mi) {
            if (mi >= M) break;  // uniform across the warp: every lane takes part in the sum
            const float v = flare_warp_sum(acc[r][mi]);
            if (lane == 0 && n < N)
                flare_store(o, po + mi * som + n * o.stride[3], IDS ? v : flare_epilogue(A, v, b0, b1, mi, n));
        }
    }
}

FLARE_KERNEL(flare_mv_mm) { flare_mv<false, false>(A); }
FLARE_KERNEL(flare_mv_mm_h) { flare_mv<false, true>(A); }
FLARE_KERNEL(flare_mv_id) { flare_mv<true, false>(A); }
FLARE_KERNEL(flare_mv_id_h) { flare_mv<true, true>(A); }

// ---- the generic fallback ---------------------------------------------------------------

// t0 = a, t1 = b, t2 = out as for the tiled kernels, any dtypes and strides.
// One thread per output; neighbouring threads take neighbouring n.
FLARE_KERNEL(flare_matmul) {
    i64 e = flare_thread_index();
    if (e >= A.n) return;
    const TensorDesc& a = A.t[0];
    const TensorDesc& b = A.t[1];
    i64 c[4];
    flare_unravel(A.t[2].shape, e, c);
    const i64 K = a.shape[3];
    i64 pa = a.offset + c[0] * a.stride[0] + c[1] * a.stride[1] + c[2] * a.stride[2];
    i64 pb = b.offset + c[0] * b.stride[0] + c[1] * b.stride[1] + c[3] * b.stride[3];
    float acc = 0.0f;
    for (i64 k = 0; k < K; ++k) acc += flare_load(a, pa + k * a.stride[3]) * flare_load(b, pb + k * b.stride[2]);
    flare_store(A.t[2], A.t[2].offset + e, flare_epilogue(A, acc, c[0], c[1], c[2], c[3]));
}

// t0 = w [1,E,N,K] (f32 or f16), t1 = x [1,T,k,K] (stride 0 on k when x is [T,K]),
// t2 = ids [1,1,T,k], t3 = out [1,T,k,N]:  out[t,j] = w[ids[t,j]] @ x[t,j]
// (one thread per output: the fallback when K is not contiguous in w)
FLARE_KERNEL(flare_mul_mat_id) {
    i64 e = flare_thread_index();
    if (e >= A.n) return;
    const TensorDesc& w = A.t[0];
    const TensorDesc& x = A.t[1];
    const TensorDesc& ids = A.t[2];
    const i64 N = A.t[3].shape[3], k = A.t[3].shape[2], K = w.shape[3];
    i64 n = e % N, j = (e / N) % k, t = e / (N * k);
    i64 expert = flare_load_int(ids, ids.offset + t * ids.stride[2] + j * ids.stride[3]);
    if (expert < 0) expert += w.shape[1];
    i64 pw = w.offset + expert * w.stride[1] + n * w.stride[2];
    i64 px = x.offset + t * x.stride[1] + j * x.stride[2];
    float acc = 0.0f;
    for (i64 q = 0; q < K; ++q) acc += flare_load(w, pw + q * w.stride[3]) * flare_load(x, px + q * x.stride[3]);
    flare_store(A.t[3], A.t[3].offset + e, acc);
}
