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

// t0 = x (4D, rows over the first three axes), t1 = out i32 [.., k]; i[0] = k;
// n = rows.  Indices of the k largest, by value descending, ties by lower index:
// each step takes the best element ordered strictly after the previous pick, so
// no scratch memory is needed (O(k*N) per row; k is small).
FLARE_KERNEL(flare_top_k) {
    i64 r = flare_thread_index();
    if (r >= A.n) return;
    const TensorDesc& x = A.t[0];
    const i64 N = x.shape[3], k = A.i[0];
    i64 c[4];
    flare_unravel(x.shape, r * N, c);
    const i64 px = flare_at(x, c);
    float pv = 0.0f;
    i64 pi = -1;
    for (i64 q = 0; q < k; ++q) {
        i64 bi = -1;
        float bv = 0.0f;
        for (i64 j = 0; j < N; ++j) {
            float v = flare_load(x, px + j * x.stride[3]);
            // after the previous pick (pv, pi) in the order (value desc, index asc)?
            if (pi >= 0 && !(v < pv || (v == pv && j > pi))) continue;
            if (bi < 0 || v > bv) { bv = v; bi = j; }
        }
        flare_store_int(A.t[1], A.t[1].offset + r * k + q, bi < 0 ? 0 : bi);
        pv = bv;
        pi = bi;
    }
}
