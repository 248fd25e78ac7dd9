// rope.cu: rotary position embedding.
#include "common.cuh"

// t0 = x [1,N,H,D], t1 = pos [1,1,1,N] (i32/i64), t2 = out [1,N,H,D];
// i[0] = 1 neox (rotate halves) / 0 adjacent pairs; f[0] = base; n = N*H*D/2.
// The angle pos * base^(-2i/D) is computed in double: positions reach the
// thousands, where a float angle is already off by ~1e-4 rad.
FLARE_KERNEL(flare_rope) {
    i64 e = flare_thread_index();
    if (e >= A.n) return;
    const TensorDesc& x = A.t[0];
    const i64 H = x.shape[2], D = x.shape[3], half = D / 2;
    const i64 i = e % half, h = (e / half) % H, n = e / (half * H);
    const double pos = (double)flare_load_int(A.t[1], A.t[1].offset + n * A.t[1].stride[3]);
    const double theta = pos * pow((double)A.f[0], -2.0 * (double)i / (double)D);
    const float cs = (float)cos(theta), sn = (float)sin(theta);
    i64 j0, j1;
    if (A.i[0]) { j0 = i; j1 = i + half; } else { j0 = 2 * i; j1 = 2 * i + 1; }
    const i64 px = x.offset + n * x.stride[1] + h * x.stride[2];
    const float a = flare_load(x, px + j0 * x.stride[3]);
    const float b = flare_load(x, px + j1 * x.stride[3]);
    const i64 po = A.t[2].offset + (n * H + h) * D;
    flare_store(A.t[2], po + j0, a * cs - b * sn);
    flare_store(A.t[2], po + j1, b * cs + a * sn);
}
