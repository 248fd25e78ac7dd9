// reduce.cu: sum / mean / max / argmax over one axis.
//
// One block per output element (blockIdx.x, continuing in blockIdx.y), its
// threads striding over the reduced axis; partial results meet through warp
// shuffles and shared memory.
#include "common.cuh"

// op codes: keep in step with flare/backends/cuda/lowering.py (REDUCE_CODES)
enum { R_SUM = 0, R_MEAN, R_MAX, R_ARGMAX };

FLARE_DEVICE bool flare_argmax_beats(float av, i64 ai, float bv, i64 bi) {
    return flare_ranks_before(av, ai, bv, bi, true);
}

// t0 = x with the reduced axis collapsed to size 1 (its shape is the output's
// shape with keepdims), t1 = out (contiguous); i[0] = op, i[1] = length of the
// reduced axis, i[2] = its stride in x; n = output elements.
FLARE_KERNEL(flare_reduce) {
    __shared__ float scratch[32];
    __shared__ float best_v[32];
    __shared__ i64 best_i[32];
    const i64 e = (i64)blockIdx.y * gridDim.x + blockIdx.x;
    if (e >= A.n) return;  // whole block
    const TensorDesc& x = A.t[0];
    const i64 L = A.i[1], s = A.i[2];
    const i64 p = flare_linear(x, e);
    const int op = (int)A.i[0];
    const i64 step = blockDim.x;
    if (op == R_ARGMAX) {
        float bv = 0.0f;
        i64 bi = -1;
        for (i64 j = threadIdx.x; j < L; j += step) {
            const float v = flare_load(x, p + j * s);
            if (flare_argmax_beats(v, j, bv, bi)) { bv = v; bi = j; }
        }
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            const i64 oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (flare_argmax_beats(ov, oi, bv, bi)) { bv = ov; bi = oi; }
        }
        const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
        if (lane == 0) { best_v[warp] = bv; best_i[warp] = bi; }
        __syncthreads();
        if (threadIdx.x == 0) {
            for (unsigned w = 1; w < (blockDim.x + 31u) / 32u; ++w)
                if (flare_argmax_beats(best_v[w], best_i[w], bv, bi)) { bv = best_v[w]; bi = best_i[w]; }
            flare_store_int(A.t[1], A.t[1].offset + e, bi < 0 ? 0 : bi);
        }
        return;
    }
    float acc = op == R_MAX ? FLARE_NEG_INF : 0.0f;
    for (i64 j = threadIdx.x; j < L; j += step) {
        const float v = flare_load(x, p + j * s);
        acc = op == R_MAX ? flare_nanmax(acc, v) : acc + v;
    }
    acc = op == R_MAX ? flare_block_max(acc, scratch) : flare_block_sum(acc, scratch);
    if (op == R_MEAN) acc /= (float)L;
    if (threadIdx.x == 0) flare_store(A.t[1], A.t[1].offset + e, acc);
}
