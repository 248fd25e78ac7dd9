// matmul.cu: batched matmul with broadcast batch axes, and the MoE expert matmul.
#include "common.cuh"

// t0 = a [B0,B1,M,K], t1 = b [B0,B1,K,N] (transpose_b is a stride swap done on
// the host; batch strides are 0 where broadcast), t2 = out [B0,B1,M,N].
// One thread per output; neighbouring threads take neighbouring n, so loads of a
// row-major b are coalesced and a's row is shared through the cache.
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
    if (a.dtype == DT_F32 && b.dtype == DT_F32) {
        const float* ap = (const float*)a.ptr;
        const float* bp = (const float*)b.ptr;
        for (i64 k = 0; k < K; ++k) acc += ap[pa + k * a.stride[3]] * bp[pb + k * b.stride[2]];
    } else {
        for (i64 k = 0; k < K; ++k) acc += flare_load(a, pa + k * a.stride[3]) * flare_load(b, pb + k * b.stride[2]);
    }
    flare_store(A.t[2], A.t[2].offset + e, acc);
}

// t0 = w [1,E,N,K] (f32 or f16), t1 = x [1,T,k,K] (stride 0 on k when x is [T,K]),
// t2 = ids [1,1,T,k], t3 = out [1,T,k,N]:  out[t,j] = w[ids[t,j]] @ x[t,j]
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
