// norm.cu: row-wise ops over the last axis (layer_norm, rms_norm, softmax).
// One thread per row; in place is safe because a thread reads each element of
// its row before writing that element.
#include "common.cuh"

// t0 = x [4D, rows over the first three axes], t1 = out; i[0] = 0 layer_norm,
// 1 rms_norm; f[0] = eps; n = rows
FLARE_KERNEL(flare_norm) {
    i64 r = flare_thread_index();
    if (r >= A.n) return;
    const TensorDesc& x = A.t[0];
    const i64 D = x.shape[3], s = x.stride[3];
    i64 c[4];
    flare_unravel(x.shape, r * D, c);
    const i64 px = flare_at(x, c);
    const i64 po = A.t[1].offset + r * D;
    if (A.i[0] == 0) {
        float mean = 0.0f;
        for (i64 j = 0; j < D; ++j) mean += flare_load(x, px + j * s);
        mean /= (float)D;
        float var = 0.0f;
        for (i64 j = 0; j < D; ++j) {
            float d = flare_load(x, px + j * s) - mean;
            var += d * d;
        }
        var /= (float)D;
        const float inv = 1.0f / sqrtf(var + A.f[0]);
        for (i64 j = 0; j < D; ++j) flare_store(A.t[1], po + j, (flare_load(x, px + j * s) - mean) * inv);
    } else {
        float ss = 0.0f;
        for (i64 j = 0; j < D; ++j) {
            float v = flare_load(x, px + j * s);
            ss += v * v;
        }
        const float inv = 1.0f / sqrtf(ss / (float)D + A.f[0]);
        for (i64 j = 0; j < D; ++j) flare_store(A.t[1], po + j, flare_load(x, px + j * s) * inv);
    }
}

// t0 = x, t1 = mask (x's shape, stride 0 where broadcast; ignored when i[0] == 0),
// t2 = out; f[0] = scale; n = rows.  softmax(x*scale + mask) over the last axis.
FLARE_KERNEL(flare_softmax) {
    i64 r = flare_thread_index();
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
#define FLARE_SOFTMAX_IN(j) \
    (flare_load(x, px + (j) * x.stride[3]) * scale + (has_mask ? flare_load(m, pm + (j) * m.stride[3]) : 0.0f))
    float mx = FLARE_NEG_INF;
    for (i64 j = 0; j < D; ++j) mx = fmaxf(mx, FLARE_SOFTMAX_IN(j));
    float sum = 0.0f;
    for (i64 j = 0; j < D; ++j) sum += expf(FLARE_SOFTMAX_IN(j) - mx);
    const float inv = 1.0f / sum;
    for (i64 j = 0; j < D; ++j) flare_store(A.t[2], po + j, expf(FLARE_SOFTMAX_IN(j) - mx) * inv);
#undef FLARE_SOFTMAX_IN
}
