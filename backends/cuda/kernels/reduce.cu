// reduce.cu: sum / mean / max / argmax over one axis.
#include "common.cuh"

// op codes: keep in step with flare/backends/cuda/lowering.py (REDUCE_CODES)
enum { R_SUM = 0, R_MEAN, R_MAX, R_ARGMAX };

// t0 = x with the reduced axis collapsed to size 1 (its shape is the output's
// shape with keepdims), t1 = out (contiguous); i[0] = op, i[1] = length of the
// reduced axis, i[2] = its stride in x; n = output elements.
FLARE_KERNEL(flare_reduce) {
    i64 e = flare_thread_index();
    if (e >= A.n) return;
    const TensorDesc& x = A.t[0];
    const i64 L = A.i[1], s = A.i[2];
    const i64 p = flare_linear(x, e);
    const int op = (int)A.i[0];
    if (op == R_ARGMAX) {
        i64 best = 0;
        float bv = flare_load(x, p);
        if (!isnan(bv)) {
            for (i64 j = 1; j < L; ++j) {
                float v = flare_load(x, p + j * s);
                if (isnan(v)) { best = j; break; }  // NumPy: the first NaN wins
                if (v > bv) { bv = v; best = j; }
            }
        }
        flare_store_int(A.t[1], A.t[1].offset + e, best);
        return;
    }
    float acc = op == R_MAX ? FLARE_NEG_INF : 0.0f;
    for (i64 j = 0; j < L; ++j) {
        float v = flare_load(x, p + j * s);
        if (op == R_MAX) acc = (v > acc || isnan(v)) ? v : acc;
        else acc += v;
    }
    if (op == R_MEAN) acc /= (float)L;
    flare_store(A.t[1], A.t[1].offset + e, acc);
}
