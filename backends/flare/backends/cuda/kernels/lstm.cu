// lstm.cu: T steps of an LSTM recurrence in one launch, one block per batch row b.
//   z_t = x[t, b, :] + W_hh h_{t-1}              (x: the input projection, [T, B, 4H])
//   i, f, o = sigmoid(z_i, z_f, z_o); g = tanh(z_g)  (gate blocks of W_hh rows: i, f, g, o)
//   c_t = f c_{t-1} + i g;  h_t = o tanh(c_t);   out[t, b, :] = (h_t, c_t)
//
// Each warp owns hidden units u = warp, warp + nwarps, ... for the whole sequence. For one
// unit it computes the four gate rows u, H+u, 2H+u, 3H+u of W_hh h_{t-1} together: its
// lanes split k (neighbouring lanes read neighbouring W_hh elements: coalesced; h_{t-1[k]}
// read once from shared memory for all four rows), lane q < 4 starts gate q's sum with
// x[t, b, qH+u]. The four sums are combined with 10 shuffles instead of 4 x 5: lanes
// trade halves at distance 16 (each keeps two gates), then at 8 (each keeps one gate), then
// butterfly over the 8 lanes holding the same gate, so lane 8q holds gate q's
// pre-activation; every lane applies its gate's activation, lanes fetch the four from
// lanes 0/8/16/24, and lane 0 updates the cell. So the gates never round-trip through
// shared memory and the cell update needs no barrier of its own.
//
// h is double-buffered in shared memory (step t reads h[t&1], writes h[(t+1)&1]), so one
// __syncthreads per step suffices: it orders every write of h_t before step t+1 reads it,
// and every read of h_{t-1} before step t+1 overwrites that buffer. c stays in shared
// memory too (only the warp owning a unit touches its c). Shared memory: 3 * LSTM_MAX_H
// floats = 24 KiB, under the 48 KiB of static shared memory a block may have; larger H is
// declined (lowering.supported, LSTM_MAX_HIDDEN). W_hh is re-read each step (from L2 on a
// GPU); no tensor but the output is written.
//
// Sums: lane-strided over k then shuffle-combined, f32; tanhf and 1/(1+expf(-x)) as the
// elementwise kernels (exact limits for large |x|: expf overflow gives 0 or 1, no NaN).
#include "common.cuh"

#define LSTM_MAX_H 2048  // keep in step with lowering.LSTM_MAX_HIDDEN

// t0 = x [1, T, B, 4H] (any strides), t1 = w_hh [1, 1, 4H, H] (any strides), t2 = h0,
// t3 = c0 [1, 1, B, H] (any strides), t4 = out [1, T, B, 2H] contiguous; n = B. Blocks:
// one per batch row (row = blockIdx.y * gridDim.x + blockIdx.x), blockDim.x a multiple of
// 32.
FLARE_KERNEL(flare_lstm) {
    __shared__ float hs[2][LSTM_MAX_H];
    __shared__ float cs[LSTM_MAX_H];
    const i64 b = (i64)blockIdx.y * gridDim.x + blockIdx.x;
    if (b >= A.n) return;  // whole block: no barrier is skipped by part of it
    const TensorDesc& x = A.t[0];
    const TensorDesc& w = A.t[1];
    const TensorDesc& h0 = A.t[2];
    const TensorDesc& c0 = A.t[3];
    const TensorDesc& o = A.t[4];
    const i64 T = x.shape[1], B = x.shape[2], H = w.shape[3];
    const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    const unsigned nwarps = blockDim.x >> 5;
    for (i64 u = threadIdx.x; u < H; u += blockDim.x) {
        hs[0][u] = flare_load(h0, h0.offset + b * h0.stride[2] + u * h0.stride[3]);
        cs[u] = flare_load(c0, c0.offset + b * c0.stride[2] + u * c0.stride[3]);
    }
    __syncthreads();
    const float* wp = (const float*)w.ptr;  // f32 only (the op's contract): no dtype switch in the k loop
    const i64 wr = w.stride[2], wk = w.stride[3];
    const bool hi16 = (lane & 16u) != 0, hi8 = (lane & 8u) != 0;
    const unsigned gate = lane >> 3;  // the gate this lane holds after the exchange
    for (i64 t = 0; t < T; ++t) {
        const float* hp = hs[t & 1];
        float* hn = hs[(t + 1) & 1];
        const i64 px = x.offset + t * x.stride[1] + b * x.stride[2];
        const i64 po = o.offset + (t * B + b) * 2 * H;
        for (i64 u = warp; u < H; u += nwarps) {
            float a[4];
            for (int q = 0; q < 4; ++q)
                a[q] = lane == (unsigned)q ? flare_load(x, px + (q * H + u) * x.stride[3]) : 0.0f;
            const i64 pw = w.offset + u * wr;
            for (i64 k = lane; k < H; k += 32) {
                const float hk = hp[k];
                for (int q = 0; q < 4; ++q) a[q] += wp[pw + q * H * wr + k * wk] * hk;
            }
            // lanes with bit 4 keep gates 2, 3, the others 0, 1; each sends the pair it drops
            const float r0 = __shfl_xor_sync(0xffffffffu, hi16 ? a[0] : a[2], 16);
            const float r1 = __shfl_xor_sync(0xffffffffu, hi16 ? a[1] : a[3], 16);
            const float k0 = (hi16 ? a[2] : a[0]) + r0, k1 = (hi16 ? a[3] : a[1]) + r1;
            // then bit 3 picks one of the two: lane l holds gate l >> 3, summed over 4 lanes
            float v = (hi8 ? k1 : k0) + __shfl_xor_sync(0xffffffffu, hi8 ? k0 : k1, 8);
            v += __shfl_xor_sync(0xffffffffu, v, 4);
            v += __shfl_xor_sync(0xffffffffu, v, 2);
            v += __shfl_xor_sync(0xffffffffu, v, 1);
            const float act = gate == 2u ? tanhf(v) : flare_sigmoid(v);
            const float ig = __shfl_sync(0xffffffffu, act, 0);
            const float fg = __shfl_sync(0xffffffffu, act, 8);
            const float gg = __shfl_sync(0xffffffffu, act, 16);
            const float og = __shfl_sync(0xffffffffu, act, 24);
            if (lane == 0) {
                const float c = fg * cs[u] + ig * gg;
                const float h = og * tanhf(c);
                cs[u] = c;
                hn[u] = h;
                flare_store(o, po + u, h);
                flare_store(o, po + H + u, c);
            }
        }
        __syncthreads();  // h_t complete (and h_{t-1} no longer read) before the next step
    }
}
