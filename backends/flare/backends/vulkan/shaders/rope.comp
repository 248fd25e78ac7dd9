#version 450
// rope on x [N, H, D] with positions pos [N]: each invocation rotates one pair
// (i, i + D/2) for neox (param1 = 1), (2i, 2i + 1) otherwise, by theta = pos * base^(-2i/D).
// It reads both elements before writing both, so running in place is safe.
#define NT 3u
layout(local_size_x = 256) in;
layout(std430, set = 0, binding = 1) buffer BufX { uint x[]; };
layout(std430, set = 0, binding = 2) buffer BufP { uint ps[]; };
layout(std430, set = 0, binding = 3) buffer BufO { uint o[]; };
#include "common.glsl"

void main() {
    Tensor tx = tensor_desc(0u);  // [1, N, H, D]
    Tensor tp = tensor_desc(1u);  // [N]
    Tensor to = tensor_desc(2u);
    uint N = tx.ne[1], H = tx.ne[2], D = tx.ne[3];
    uint half_d = D / 2u;
    uint p = invocation_linear();
    if (p >= N * H * half_d) return;
    uint i = p % half_d;
    uint h = (p / half_d) % H;
    uint n = p / (half_d * H);
    float base = param_f(0u);
    bool neox = param_u(1u) != 0u;
    float pos = float(LOADI(ps, DT1, offset_of(tp, n)));
    float theta = pos * exp2(-2.0 * float(i) / float(D) * log2(base));
    float cs = cos(theta), sn = sin(theta);
    uint ia = neox ? i : 2u * i;
    uint ib = neox ? i + half_d : 2u * i + 1u;
    float xa = LOADF(x, DT0, offset_at(tx, uvec4(0u, n, h, ia)));
    float xb = LOADF(x, DT0, offset_at(tx, uvec4(0u, n, h, ib)));
    uint ob = to.off + (n * H + h) * D;
    STOREF(o, DT2, ob + ia, xa * cs - xb * sn)
    STOREF(o, DT2, ob + ib, xa * sn + xb * cs)
}
