// layout.cu: ops that move elements without arithmetic (contiguous, cast,
// copy_into, pad, concat).
#include "common.cuh"

// t0 = src (strided; its shape is the iteration shape), t1 = dst (contiguous);
// i[0] = element offset into dst (copy_into); n = src.size.
// Converts between any two dtypes (this is also `cast`).
FLARE_KERNEL(flare_copy) {
    i64 e = flare_thread_index();
    if (e >= A.n) return;
    flare_copy_elem(A.t[0], flare_linear(A.t[0], e), A.t[1], A.t[1].offset + A.i[0] + e);
}

// t0 = x (4D), t1 = out (4D); i[0..3] = pad before each axis; i[4] = 0 constant,
// 1 reflect; f[0] = constant value; n = out.size
FLARE_KERNEL(flare_pad) {
    i64 e = flare_thread_index();
    if (e >= A.n) return;
    const TensorDesc& x = A.t[0];
    i64 c[4];
    flare_unravel(A.t[1].shape, e, c);
    for (int k = 0; k < 4; ++k) {
        i64 j = c[k] - A.i[k];
        const i64 n = x.shape[k];
        if (j < 0 || j >= n) {
            if (A.i[4] == 0) {
                flare_store(A.t[1], A.t[1].offset + e, A.f[0]);
                return;
            }
            if (n == 1) {
                j = 0;
            } else {  // mirror without repeating the edge: period 2(n-1)
                const i64 period = 2 * (n - 1);
                j = j < 0 ? -j : j;
                j %= period;
                if (j >= n) j = period - j;
            }
        }
        c[k] = j;
    }
    flare_copy_elem(x, flare_at(x, c), A.t[1], A.t[1].offset + e);
}

// t0 = a, t1 = b, t2 = out (all 4D); i[0] = axis (of the padded 4D shape);
// n = out.size
FLARE_KERNEL(flare_concat) {
    i64 e = flare_thread_index();
    if (e >= A.n) return;
    const int axis = (int)A.i[0];
    i64 c[4];
    flare_unravel(A.t[2].shape, e, c);
    const i64 na = A.t[0].shape[axis];
    if (c[axis] < na) {
        flare_copy_elem(A.t[0], flare_at(A.t[0], c), A.t[2], A.t[2].offset + e);
    } else {
        c[axis] -= na;
        flare_copy_elem(A.t[1], flare_at(A.t[1], c), A.t[2], A.t[2].offset + e);
    }
}
