// conv.cu: 1-D convolution (zero padding, no bias).
#include "common.cuh"

// t0 = x [1,B,Cin,L], t1 = w [1,Cout,Cin,K], t2 = out [1,B,Cout,Lout];
// i[0] = stride, i[1] = padding, i[2] = dilation; n = out.size
FLARE_KERNEL(flare_conv1d) {
    i64 e = flare_thread_index();
    if (e >= A.n) return;
    const TensorDesc& x = A.t[0];
    const TensorDesc& w = A.t[1];
    const i64 Lout = A.t[2].shape[3], Cout = A.t[2].shape[2];
    const i64 Cin = x.shape[2], L = x.shape[3], K = w.shape[3];
    const i64 l = e % Lout, co = (e / Lout) % Cout, b = e / (Lout * Cout);
    const i64 start = l * A.i[0] - A.i[1];
    float acc = 0.0f;
    for (i64 ci = 0; ci < Cin; ++ci) {
        const i64 px = x.offset + b * x.stride[1] + ci * x.stride[2];
        const i64 pw = w.offset + co * w.stride[1] + ci * w.stride[2];
        for (i64 q = 0; q < K; ++q) {
            const i64 pos = start + q * A.i[2];
            if (pos < 0 || pos >= L) continue;
            acc += flare_load(x, px + pos * x.stride[3]) * flare_load(w, pw + q * w.stride[3]);
        }
    }
    flare_store(A.t[2], A.t[2].offset + e, acc);
}
