// matmul_q.cu: products with block-quantized weights (matmul/linear with `transpose_b`, and
// mul_mat_id's experts): out = x @ dequant(w).T. Every kernel is instantiated per type (QT,
// quant.cuh), so the block layout is known at compile time.
//  - flare_mvq8_<type> / flare_mvq8_id_<type> (the default for decode-sized products, at most
//    MVQ_MAX_M rows of x, and for the MoE expert product): ggml's mmvq. While x is staged
//    through shared memory (1024 values at a time) a warp per 32 values rounds them to 8 bits
//    (d = max|x| / 127, q = roundf(x / d), and the sum of the q); then each lane takes one
//    sub-block of a weight row (32 weights: a whole legacy block, an eighth of a super-block)
//    and multiplies the weights' integer quants with the q by __dp4a, four at a time, applying
//    the block's scales, zero point and min once per 32 (or 16, q6_k). The rounding of x is
//    the only error beyond float summation (at most max|x| / 254 per value; the conformance
//    suite's QUANT_DOT).
//  - flare_mvq_<type> / flare_mvq_id_<type> (the `naive` tuning): the same shape with float
//    products: the 32 weights are dequantized in registers, bit-exact, and multiplied with x
//    in float (x staged at 33 floats per 32 so the 32 lanes hit 32 banks).
//    Both: one block of 256 threads per batch (or per (token, slot)), a warp per MVQ_ROWS
//    outputs n, lanes splitting K by sub-blocks (neighbouring lanes read neighbouring
//    blocks), a warp-shuffle sum per output.
//  - flare_mmq_<tile>_<type>: prefill-sized products. A block of 256 threads computes a
//    BM x BN output tile stepping through K one sub-block (32) at a time: the x tile is
//    staged as in matmul.cu, the weight tile (BN rows x 32) is dequantized straight into
//    shared memory by all 256 threads (32 * BN / 256 weights each: a column of the tile per
//    thread, so neighbouring threads store to neighbouring banks), then gemm.cuh's
//    register-tiled product runs in float (within float summation error of the reference).
//
// Registers: the loops that index the accumulators are `#pragma unroll`ed (their `break` /
// `continue` guards otherwise kept the accumulators in local memory: ptxas showed 32..256
// byte stack frames). sm_90 (ptxas -v, NVRTC 13.5): no stack frame, no spills in any kernel;
// registers mvq8 31..48, mvq 56..72, mmq s 100..106, m 134..138, l 133..137; static shared
// memory 5..17 KiB (mv), 9 / 17 / 33 KiB (mmq s / m / l).
#include "common.cuh"
#include "gemm.cuh"
#include "quant.cuh"

#define MVQ_THREADS 256
#define MVQ_ROWS 2         // outputs n per warp
#define MVQ_MAX_M 4        // rows of x per block (lowering.MV_MAX_ROWS)
#define MVQ_SUBS 32        // sub-blocks of 32 weights staged per step (1024 weights)
#define MVQ_LD 33          // floats between staged sub-blocks (bank-conflict-free reads)
#define MVQ_LDQ 9          // words between staged 8-bit sub-blocks (8 words + 1: no bank conflicts)

// Plain (IDS false): x = t0 [B0,B1,M,K] (M <= MVQ_MAX_M), w = t1 [B0,B1,N,NB] blocks,
// out = t2 [B0,B1,M,N]; p = the batch; i[4], i[5], t4, t5: the fused epilogue.
// IDS: w = t0 [1,E,N,NB], x = t1 [1,T,k,K] (stride 0 on k when shared), ids = t2 [1,1,T,k],
// out = t3 [1,T,k,N]; p = (t, j), M = 1.
// grid = (ceil(N / (8 * MVQ_ROWS)), min(P, 65535), ceil(P / 65535)), block = 256; n = P.
template <int QT, bool IDS, bool Q8>
FLARE_DEVICE void flare_mvq(const KArgs& A) {
    typedef QBlock<QT> Q;
    __shared__ float xs[Q8 ? 1 : MVQ_MAX_M][Q8 ? 1 : MVQ_SUBS * MVQ_LD];
    __shared__ int xq[Q8 ? MVQ_MAX_M : 1][Q8 ? MVQ_SUBS * MVQ_LDQ : 1];  // Q8: int8 x, 4 per word
    __shared__ float xd[MVQ_MAX_M][MVQ_SUBS];                          // Q8: scale per sub-block
    __shared__ int xsum[MVQ_MAX_M][MVQ_SUBS];                          // Q8: sum of its q8
    const TensorDesc& w = IDS ? A.t[0] : A.t[1];
    const TensorDesc& x = IDS ? A.t[1] : A.t[0];
    const TensorDesc& o = IDS ? A.t[3] : A.t[2];
    const i64 K = x.shape[3], N = o.shape[3];
    const i64 p = (i64)blockIdx.z * gridDim.y + blockIdx.y;
    if (p >= A.n) return;  // whole block
    i64 px, pw, po, sxm = 0, som = 0, b0 = 0, b1 = 0;
    int M = 1;
    if (IDS) {
        const TensorDesc& ids = A.t[2];
        const i64 kk = o.shape[2], t = p / kk, j = p % kk;
        i64 e = flare_load_int(ids, ids.offset + t * ids.stride[2] + j * ids.stride[3]);
        if (e < 0) e += w.shape[1];
        px = x.offset + t * x.stride[1] + j * x.stride[2];
        pw = w.offset + e * w.stride[1];
        po = o.offset + t * o.stride[1] + j * o.stride[2];
    } else {
        b1 = p % o.shape[1];
        b0 = p / o.shape[1];
        M = (int)o.shape[2];
        px = x.offset + b0 * x.stride[0] + b1 * x.stride[1];
        pw = w.offset + b0 * w.stride[0] + b1 * w.stride[1];
        po = o.offset + b0 * o.stride[0] + b1 * o.stride[1];
        sxm = x.stride[2];
        som = o.stride[2];
    }
    const i64 swn = w.stride[2], swb = w.stride[3];
    const int tid = (int)threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const i64 nbase = (i64)blockIdx.x * (MVQ_THREADS / 32) * MVQ_ROWS + (i64)warp * MVQ_ROWS;
    const unsigned char* wp = (const unsigned char*)w.ptr;
    const int subs_per_block = Q::SIZE / 32;
    float acc[MVQ_ROWS][MVQ_MAX_M] = {};
    float wv[32];
    for (i64 k0 = 0; k0 < K; k0 += MVQ_SUBS * 32) {
        const int len = (int)(K - k0 < MVQ_SUBS * 32 ? K - k0 : MVQ_SUBS * 32);  // a multiple of 32
        __syncthreads();  // the previous chunk is no longer read
        if (Q8) {  // a warp per sub-block of 32: d = max|x| / 127, q = round(x / d) (ggml's q8_1)
            const int nsub = len >> 5;
            for (int u = warp; u < M * nsub; u += MVQ_THREADS / 32) {  // uniform per warp
                const int mi = u / nsub, sb = u % nsub;
                const float v = flare_load(x, px + mi * sxm + (k0 + sb * 32 + lane) * x.stride[3]);
                const float d = flare_warp_max(fabsf(v)) / 127.0f;
                const int q = d > 0.0f ? (int)roundf(v / d) : 0;  // (NaN: 0 here, d8 = NaN below)
                const int sum = (int)flare_warp_sum((float)q);   // exact: |sum| <= 32 * 127
                ((signed char*)&xq[mi][sb * MVQ_LDQ])[lane] = (signed char)q;
                if (lane == 0) {
                    xd[mi][sb] = d;
                    xsum[mi][sb] = sum;
                }
            }
        } else {
            for (int q = tid; q < M * len; q += MVQ_THREADS) {
                const int mi = q / len, c = q % len;
                xs[mi][(c >> 5) * MVQ_LD + (c & 31)] = flare_load(x, px + mi * sxm + (k0 + c) * x.stride[3]);
            }
        }
        __syncthreads();
        const i64 g = k0 / 32 + lane;  // this lane's sub-block (global index along the row)
        if (lane < (len >> 5)) {
            const i64 blk = g / subs_per_block;
            const int sub = (int)(g % subs_per_block);
            const float* xl[MVQ_MAX_M];
            for (int mi = 0; mi < MVQ_MAX_M; ++mi) xl[mi] = &xs[mi][lane * MVQ_LD];
            #pragma unroll
            for (int r = 0; r < MVQ_ROWS; ++r) {
                const i64 n = nbase + r;
                if (n >= N) break;
                const unsigned char* wb = wp + (pw + n * swn + blk * swb) * Q::BYTES;
                if (Q8) {
                    #pragma unroll
                    for (int mi = 0; mi < MVQ_MAX_M; ++mi) {
                        if (mi >= M) break;
                        acc[r][mi] += flare_dot_q8<QT>(wb, sub, &xq[mi][lane * MVQ_LDQ], xd[mi][lane], xsum[mi][lane]);
                    }
                    continue;
                }
                flare_dq32<QT>(wb, sub, wv);
                #pragma unroll
                for (int mi = 0; mi < MVQ_MAX_M; ++mi) {
                    if (mi >= M) break;
                    float s = 0.0f;
                    for (int l = 0; l < 32; ++l) s += wv[l] * xl[mi][l];
                    acc[r][mi] += s;
                }
            }
        }
    }
    #pragma unroll
    for (int r = 0; r < MVQ_ROWS; ++r) {
        const i64 n = nbase + r;
        #pragma unroll
        for (int mi = 0; mi < MVQ_MAX_M; ++mi) {
            if (mi >= M) break;  // uniform across the warp: every lane takes part in the sum
            const float v = flare_warp_sum(acc[r][mi]);
            if (lane == 0 && n < N)
                flare_store(o, po + mi * som + n * o.stride[3], IDS ? v : flare_epilogue(A, v, b0, b1, mi, n));
        }
    }
}

// x = t0 [B0,B1,M,K], w = t1 [B0,B1,N,NB] blocks, out = t2 [B0,B1,M,N]; i[0] bit 0: x rows
// may be read as float4 (K-contiguous, 16-byte aligned), bit 2: x is K-contiguous; i[4], i[5],
// t4, t5: the fused epilogue. grid = (ceil(N/BN), ceil(M/BM), B0*B1), block = 256.
template <int BM, int BN, int TM, int TN, int QT>
FLARE_DEVICE void flare_mmq_tiled(const KArgs& A) {
    typedef QBlock<QT> Q;
    static_assert((BM / TM) * (BN / TN) == MM_THREADS, "a tile is 256 threads");
    enum { NW = 32 * BN / MM_THREADS };  // weights of the tile each thread unpacks per step
    static_assert(NW == 4 || NW == 8 || NW == 16, "the weight tile is split evenly over the threads");
    __shared__ float As[32][BM + 4];
    __shared__ float Bs[32][BN + 4];
    const TensorDesc& a = A.t[0];
    const TensorDesc& b = A.t[1];
    const TensorDesc& o = A.t[2];
    const i64 M = a.shape[2], K = a.shape[3], N = b.shape[2];
    const i64 z = blockIdx.z, b1 = z % o.shape[1], b0 = z / o.shape[1];
    const i64 pa = a.offset + b0 * a.stride[0] + b1 * a.stride[1];
    const i64 pb = b.offset + b0 * b.stride[0] + b1 * b.stride[1];
    const i64 po = o.offset + b0 * o.stride[0] + b1 * o.stride[1];
    const i64 sam = a.stride[2], sak = a.stride[3], sbn = b.stride[2], sbb = b.stride[3];
    const i64 m0 = (i64)blockIdx.y * BM, n0 = (i64)blockIdx.x * BN;
    const int tid = (int)threadIdx.x;
    const int tx = tid % (BN / TN), ty = tid / (BN / TN);
    const bool a_kcontig = (A.i[0] & 4) != 0;
    const unsigned char* bp = (const unsigned char*)b.ptr;
    const int subs_per_block = Q::SIZE / 32;
    float acc[TM][TN] = {};
    float wv[NW];
    for (i64 k0 = 0; k0 < K; k0 += 32) {
        if (a_kcontig) {
            flare_tile_kcontig<BM, 32, BM + 4, false>(As, (const void*)a.ptr, pa, sam, m0, M, k0, K, (A.i[0] & 1) != 0,
                                                      tid);
        } else {
            for (int v = tid; v < BM * 32; v += MM_THREADS) {
                const int r = v % BM, kk = v / BM;
                const i64 gm = m0 + r;
                As[kk][r] = gm < M ? flare_load(a, pa + gm * sam + (k0 + kk) * sak) : 0.0f;
            }
        }
        {  // the weight tile: thread tid unpacks NW weights of row tid % BN into column tid % BN
            const int r = tid % BN, j0 = (tid / BN) * NW;
            const i64 gn = n0 + r, g = k0 / 32;
            if (gn < N) {
                flare_dqn<QT, NW>(bp + (pb + gn * sbn + (g / subs_per_block) * sbb) * Q::BYTES,
                                  (int)(g % subs_per_block), j0, wv);
                for (int i = 0; i < NW; ++i) Bs[j0 + i][r] = wv[i];
            } else {
                for (int i = 0; i < NW; ++i) Bs[j0 + i][r] = 0.0f;
            }
        }
        __syncthreads();
        flare_tile_accumulate<BM, BN, 32, TM, TN>(As, Bs, acc, tx, ty);
        __syncthreads();  // the tiles are overwritten next step
    }
    #pragma unroll
    for (int i = 0; i < TM; ++i) {
        const i64 gm = m0 + ty * TM + i;
        if (gm >= M) continue;
        #pragma unroll
        for (int j = 0; j < TN; ++j) {
            const i64 gn = n0 + tx + j * (BN / TN);
            if (gn < N) flare_store(o, po + gm * o.stride[2] + gn * o.stride[3], flare_epilogue(A, acc[i][j], b0, b1, gm, gn));
        }
    }
}

#define FLARE_MMQ_TYPE(ty, QT)                                                                    \
    FLARE_KERNEL(flare_mvq_##ty) { flare_mvq<QT, false, false>(A); }                             \
    FLARE_KERNEL(flare_mvq_id_##ty) { flare_mvq<QT, true, false>(A); }                           \
    FLARE_KERNEL(flare_mvq8_##ty) { flare_mvq<QT, false, true>(A); }                             \
    FLARE_KERNEL(flare_mvq8_id_##ty) { flare_mvq<QT, true, true>(A); }                           \
    FLARE_KERNEL(flare_mmq_s_##ty) { flare_mmq_tiled<32, 32, 2, 2, QT>(A); }                      \
    FLARE_KERNEL(flare_mmq_m_##ty) { flare_mmq_tiled<64, 64, 4, 4, QT>(A); }                      \
    FLARE_KERNEL(flare_mmq_l_##ty) { flare_mmq_tiled<128, 128, 8, 8, QT>(A); }

// (kernel names are listed for compiler.KernelSource.kernels() by FLARE_KERNELS lines)
// FLARE_KERNELS: flare_mvq_q4_0 flare_mvq_id_q4_0 flare_mvq8_q4_0 flare_mvq8_id_q4_0 flare_mmq_s_q4_0 flare_mmq_m_q4_0 flare_mmq_l_q4_0
FLARE_MMQ_TYPE(q4_0, DT_Q4_0)
// FLARE_KERNELS: flare_mvq_q4_1 flare_mvq_id_q4_1 flare_mvq8_q4_1 flare_mvq8_id_q4_1 flare_mmq_s_q4_1 flare_mmq_m_q4_1 flare_mmq_l_q4_1
FLARE_MMQ_TYPE(q4_1, DT_Q4_1)
// FLARE_KERNELS: flare_mvq_q8_0 flare_mvq_id_q8_0 flare_mvq8_q8_0 flare_mvq8_id_q8_0 flare_mmq_s_q8_0 flare_mmq_m_q8_0 flare_mmq_l_q8_0
FLARE_MMQ_TYPE(q8_0, DT_Q8_0)
// FLARE_KERNELS: flare_mvq_q4_k flare_mvq_id_q4_k flare_mvq8_q4_k flare_mvq8_id_q4_k flare_mmq_s_q4_k flare_mmq_m_q4_k flare_mmq_l_q4_k
FLARE_MMQ_TYPE(q4_k, DT_Q4_K)
// FLARE_KERNELS: flare_mvq_q6_k flare_mvq_id_q6_k flare_mvq8_q6_k flare_mvq8_id_q6_k flare_mmq_s_q6_k flare_mmq_m_q6_k flare_mmq_l_q6_k
FLARE_MMQ_TYPE(q6_k, DT_Q6_K)
