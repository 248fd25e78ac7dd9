// norm.cu: row-wise ops over the last axis (layer_norm, rms_norm, softmax).
//
// One block per row (blockIdx.x; rows of more than 65535 blocks continue in
// blockIdx.y), its threads striding over the row, partial results combined with
// warp shuffles and 32 floats of shared memory (flare_block_reduce). A row of up
// to ROW_CACHE elements is read from global memory once and kept in shared
// memory for the later passes (as ggml's soft_max_f32 does); longer rows are
// re-read. In place is safe: each element is read and written by the same thread,
// its read before its write.
#include "common.cuh"

#define ROW_CACHE 4096

FLARE_DEVICE i64 flare_row_id() { return (i64)blockIdx.y * gridDim.x + blockIdx.x; }

// t0 = x [4D, rows over the first three axes], t1 = out; i[0] = 0 layer_norm,
// 1 rms_norm; f[0] = eps; n = rows. Fused `norm_affine`: i[1] bit 0: times gamma (t2, a
// row of D), bit 1: plus beta (t3).
FLARE_KERNEL(flare_norm) {
    __shared__ float scratch[32];
    const i64 r = flare_row_id();
    if (r >= A.n) return;  // whole block: no barrier is skipped by part of it
    const TensorDesc& x = A.t[0];
    const i64 D = x.shape[3], s = x.stride[3];
    i64 c[4];
    flare_unravel(x.shape, r * D, c);
    const i64 px = flare_at(x, c);
    const i64 po = A.t[1].offset + r * D;
    const i64 step = blockDim.x;
    __shared__ float row[ROW_CACHE];
    const bool cached = D <= ROW_CACHE;  // each thread caches (and later reads) only its own elements
#define FLARE_NORM_IN(j) (cached ? row[j] : flare_load(x, px + (j) * s))
    float mean = 0.0f;
    if (A.i[0] == 0) {  // two passes (mean, then squared deviations): no cancellation
        float sum = 0.0f;
        for (i64 j = threadIdx.x; j < D; j += step) {
            const float v = flare_load(x, px + j * s);
            if (cached) row[j] = v;
            sum += v;
        }
        mean = flare_block_sum(sum, scratch) / (float)D;
    } else if (cached) {
        for (i64 j = threadIdx.x; j < D; j += step) row[j] = flare_load(x, px + j * s);
    }
    float ss = 0.0f;
    for (i64 j = threadIdx.x; j < D; j += step) {
        const float d = FLARE_NORM_IN(j) - mean;
        ss += d * d;
    }
    const float inv = 1.0f / sqrtf(flare_block_sum(ss, scratch) / (float)D + A.f[0]);
    const int affine = (int)A.i[1];
    for (i64 j = threadIdx.x; j < D; j += step) {
        float v = (FLARE_NORM_IN(j) - mean) * inv;
        if (affine & 1) v *= flare_load(A.t[2], A.t[2].offset + j * A.t[2].stride[3]);
        if (affine & 2) v += flare_load(A.t[3], A.t[3].offset + j * A.t[3].stride[3]);
        flare_store(A.t[1], po + j, v);
    }
#undef FLARE_NORM_IN
}

// t0 = x, t1 = mask (x's shape, stride 0 where broadcast; ignored when i[0] == 0),
// t2 = out; f[0] = scale; n = rows.  softmax(x*scale + mask) over the last axis.
FLARE_KERNEL(flare_softmax) {
    __shared__ float scratch[32];
    const i64 r = flare_row_id();
    if (r >= A.n) return;
    const TensorDesc& x = A.t[0];
    const TensorDesc& m = A.t[1];
    const bool has_mask = A.i[0] != 0;
    const float scale = A.f[0];
    const i64 D = x.shape[3];
    i64 c[4];
    flare_unravel(x.shape, r * D, c);
    const i64 px = flare_at(x, c);
    const i64 pm = has_mask ? flare_at(m, c) : 0;
    const i64 po = A.t[2].offset + r * D;
    const i64 step = blockDim.x;
    __shared__ float row[ROW_CACHE];
    const bool cached = D <= ROW_CACHE;
#define FLARE_SOFTMAX_IN(j) \
    (flare_load(x, px + (j) * x.stride[3]) * scale + (has_mask ? flare_load(m, pm + (j) * m.stride[3]) : 0.0f))
    float mx = FLARE_NEG_INF;
    for (i64 j = threadIdx.x; j < D; j += step) {
        const float v = FLARE_SOFTMAX_IN(j);
        if (cached) row[j] = v;
        mx = fmaxf(mx, v);
    }
    mx = flare_block_max(mx, scratch);
    float sum = 0.0f;
    for (i64 j = threadIdx.x; j < D; j += step) {
        const float e = expf((cached ? row[j] : FLARE_SOFTMAX_IN(j)) - mx);
        if (cached) row[j] = e;
        sum += e;
    }
    const float inv = 1.0f / flare_block_sum(sum, scratch);
    for (i64 j = threadIdx.x; j < D; j += step)
        flare_store(A.t[2], po + j, (cached ? row[j] : expf(FLARE_SOFTMAX_IN(j) - mx)) * inv);
#undef FLARE_SOFTMAX_IN
}
