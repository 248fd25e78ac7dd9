// index.cu: lookups and scatters by index (get_rows, set_rows, gather, top_k).
// Negative indices count from the end, as in NumPy.
#include "common.cuh"

// t0 = table [1,1,R,D] (f32/f16), t1 = idx (4D), t2 = out (idx.shape + (D,));
// n = idx.size * D
FLARE_KERNEL(flare_get_rows) {
    i64 e = flare_thread_index();
    if (e >= A.n) return;
    const TensorDesc& table = A.t[0];
    const i64 D = table.shape[3];
    i64 row = flare_load_int(A.t[1], flare_linear(A.t[1], e / D));
    if (row < 0) row += table.shape[2];
    float v = flare_load(table, table.offset + row * table.stride[2] + (e % D) * table.stride[3]);
    flare_store(A.t[2], A.t[2].offset + e, v);
}

// t0 = dst [1,1,R,D] (the state written in place), t1 = idx [1,1,1,M],
// t2 = src [1,1,M,D]; n = M * D:  dst[idx[m], :] = src[m, :]
FLARE_KERNEL(flare_set_rows) {
    i64 e = flare_thread_index();
    if (e >= A.n) return;
    const TensorDesc& dst = A.t[0];
    const TensorDesc& src = A.t[2];
    const i64 D = src.shape[3];
    const i64 m = e / D, d = e % D;
    i64 row = flare_load_int(A.t[1], A.t[1].offset + m * A.t[1].stride[3]);
    if (row < 0) row += dst.shape[2];
    flare_copy_elem(src, src.offset + m * src.stride[2] + d * src.stride[3],
                    dst, dst.offset + row * dst.stride[2] + d * dst.stride[3]);
}

// t0 = x (4D, same leading axes as idx), t1 = idx (4D), t2 = out (idx's shape);
// n = idx.size:  out = take_along_axis(x, idx, -1)
FLARE_KERNEL(flare_gather) {
    i64 e = flare_thread_index();
    if (e >= A.n) return;
    const TensorDesc& x = A.t[0];
    i64 c[4];
    flare_unravel(A.t[1].shape, e, c);
    i64 j = flare_load_int(A.t[1], flare_at(A.t[1], c));
    if (j < 0) j += x.shape[3];
    c[3] = j;
    flare_store(A.t[2], A.t[2].offset + e, flare_load(x, flare_at(x, c)));
}

// top_k order: NaN after every number (NumPy's stable argsort of -x)
FLARE_DEVICE bool flare_topk_before(float av, int ai, float bv, int bi) {
    return flare_ranks_before(av, ai, bv, bi, false);
}

#define TOPK_P 2048  // the most (value, index) pairs a block sorts at once in shared memory

// t0 = x (4D, rows over the first three axes), t1 = out i32 [.., k]; i[0] = k,
// i[1] = P (a power of two, at most TOPK_P, >= N or > k); n = rows.
// One block per row: P pairs in shared memory, bitonic-sorted (O(P log^2 P) work
// spread over the block). Rows longer than P go through in pieces: the best k so
// far stay in the first k slots and the next P - k elements fill the rest.
FLARE_KERNEL(flare_top_k) {
    __shared__ float kv[TOPK_P];
    __shared__ int ki[TOPK_P];
    const i64 r = (i64)blockIdx.y * gridDim.x + blockIdx.x;
    if (r >= A.n) return;  // whole block
    const TensorDesc& x = A.t[0];
    const i64 N = x.shape[3], k = A.i[0];
    const int P = (int)A.i[1];
    i64 c[4];
    flare_unravel(x.shape, r * N, c);
    const i64 px = flare_at(x, c);
    const int tid = (int)threadIdx.x, step = (int)blockDim.x;
    int have = 0;
    i64 next = 0;
    while (true) {
        for (int q = have + tid; q < P; q += step) {
            const i64 j = next + (q - have);
            kv[q] = j < N ? flare_load(x, px + j * x.stride[3]) : 0.0f;
            ki[q] = j < N ? (int)j : -1;
        }
        next += P - have;
        __syncthreads();
        for (int size = 2; size <= P; size <<= 1) {
            for (int stride = size >> 1; stride > 0; stride >>= 1) {
                for (int q = tid; q < P; q += step) {
                    const int o = q ^ stride;
                    if (o <= q) continue;
                    const bool first = (q & size) == 0;  // this run is sorted best-first
                    const bool swap = first ? flare_topk_before(kv[o], ki[o], kv[q], ki[q])
                                            : flare_topk_before(kv[q], ki[q], kv[o], ki[o]);
                    if (swap) {
                        const float tv = kv[q]; kv[q] = kv[o]; kv[o] = tv;
                        const int ti = ki[q]; ki[q] = ki[o]; ki[o] = ti;
                    }
                }
                __syncthreads();
            }
        }
        have = (int)k;
        if (next >= N) break;
    }
    for (int q = tid; q < (int)k; q += step) flare_store_int(A.t[1], A.t[1].offset + r * k + q, ki[q]);
}

// The same for rows longer than TOPK_P with k > TOPK_P / 2 (nothing Flare's models
// ask for): one thread per row, k passes, each taking the best element ordered
// after the previous pick (O(k*N) per row, no scratch memory).
FLARE_KERNEL(flare_top_k_serial) {
    i64 r = flare_thread_index();
    if (r >= A.n) return;
    const TensorDesc& x = A.t[0];
    const i64 N = x.shape[3], k = A.i[0];
    i64 c[4];
    flare_unravel(x.shape, r * N, c);
    const i64 px = flare_at(x, c);
    float pv = 0.0f;
    int pi = -1;
    for (i64 q = 0; q < k; ++q) {
        int bi = -1;
        float bv = 0.0f;
        for (i64 j = 0; j < N; ++j) {
            const float v = flare_load(x, px + j * x.stride[3]);
            if (pi >= 0 && !flare_topk_before(pv, pi, v, (int)j)) continue;  // not after the last pick
            if (flare_topk_before(v, (int)j, bv, bi)) { bv = v; bi = (int)j; }
        }
        flare_store_int(A.t[1], A.t[1].offset + r * k + q, bi < 0 ? 0 : bi);
        pv = bv;
        pi = bi;
    }
}
