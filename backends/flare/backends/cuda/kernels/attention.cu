// attention.cu: the fused `attention` op for small heads: softmax(q k^T * scale + mask) v.
//
// One block per query row (batch, head, position): the row's query is staged in shared
// memory, each thread scores its keys (dot over D) into a shared row of scores, the block
// finds max and sum (warp shuffles + shared memory), and each thread then produces output
// features as the probability-weighted sum of value rows. The scores never leave shared
// memory: no [Lq, Lk] tensor, no three launches. Limits (lowering.supported): Lk <= 4096
// keys, D <= 256.
#include "common.cuh"

#define ATT_MAX_KEYS 4096
#define ATT_MAX_D 256

// t0 = q [B0,B1,Lq,D], t1 = k [B0,B1,Lk,D], t2 = v [B0,B1,Lk,Dv] (batch strides 0 where
// broadcast), t3 = mask (the scores' layout [B0,B1,Lq,Lk], stride 0 where broadcast;
// read when i[0] != 0), t4 = out [B0,B1,Lq,Dv]; f[0] = scale; n = B0*B1*Lq rows.
FLARE_KERNEL(flare_attention) {
    __shared__ float p[ATT_MAX_KEYS];
    __shared__ float qs[ATT_MAX_D];
    __shared__ float scratch[32];
    const i64 r = (i64)blockIdx.y * gridDim.x + blockIdx.x;
    if (r >= A.n) return;  // whole block
    const TensorDesc& q = A.t[0];
    const TensorDesc& k = A.t[1];
    const TensorDesc& v = A.t[2];
    const TensorDesc& m = A.t[3];
    const TensorDesc& o = A.t[4];
    const i64 Lq = q.shape[2], D = q.shape[3], Lk = k.shape[2], Dv = v.shape[3];
    const i64 lq = r % Lq, bb = r / Lq, b1 = bb % o.shape[1], b0 = bb / o.shape[1];
    const i64 step = blockDim.x;
    const i64 pq = q.offset + b0 * q.stride[0] + b1 * q.stride[1] + lq * q.stride[2];
    const i64 pk = k.offset + b0 * k.stride[0] + b1 * k.stride[1];
    const i64 pv = v.offset + b0 * v.stride[0] + b1 * v.stride[1];
    const i64 pm = m.offset + b0 * m.stride[0] + b1 * m.stride[1] + lq * m.stride[2];
    for (i64 d = threadIdx.x; d < D; d += step) qs[d] = flare_load(q, pq + d * q.stride[3]);
    __syncthreads();
    const float scale = A.f[0];
    float mx = FLARE_NEG_INF;
    for (i64 j = threadIdx.x; j < Lk; j += step) {
        float s = 0.0f;
        for (i64 d = 0; d < D; ++d) s += qs[d] * flare_load(k, pk + j * k.stride[2] + d * k.stride[3]);
        s = s * scale + (A.i[0] ? flare_load(m, pm + j * m.stride[3]) : 0.0f);
        p[j] = s;
        mx = fmaxf(mx, s);
    }
    mx = flare_block_max(mx, scratch);
    float sum = 0.0f;
    for (i64 j = threadIdx.x; j < Lk; j += step) {
        const float e = expf(p[j] - mx);
        p[j] = e;
        sum += e;
    }
    const float inv = 1.0f / flare_block_sum(sum, scratch);
    __syncthreads();  // every probability is written before any thread reads the whole row
    const i64 po = o.offset + b0 * o.stride[0] + b1 * o.stride[1] + lq * o.stride[2];
    for (i64 d = threadIdx.x; d < Dv; d += step) {
        float acc = 0.0f;
        for (i64 j = 0; j < Lk; ++j) acc += p[j] * flare_load(v, pv + j * v.stride[2] + d * v.stride[3]);
        flare_store(o, po + d * o.stride[3], acc * inv);
    }
}
