#version 450
// mul_mat_id: out[t, j, n] = sum_k w[ids[t, j], n, k] * x[t(, j), k]  (MoE expert matmul;
// w may be f16; x [T, K] is seen as [T, k, K] with a stride-0 j axis). One output per invocation;
// expert ids out of range are clamped (never an OOB read).
#define NT 4u
layout(local_size_x = 256) in;
layout(std430, set = 0, binding = 1) buffer BufW { uint w[]; };
layout(std430, set = 0, binding = 2) buffer BufX { uint x[]; };
layout(std430, set = 0, binding = 3) buffer BufI { uint ids[]; };
layout(std430, set = 0, binding = 4) buffer BufO { uint o[]; };
#include "common.glsl"

void main() {
    Tensor tw = tensor_desc(0u);  // [1, E, N, K]
    Tensor tx = tensor_desc(1u);  // [1, T, k, K]
    Tensor ti = tensor_desc(2u);  // [1, 1, T, k]
    Tensor to = tensor_desc(3u);  // [1, T, k, N]
    uint e = invocation_linear();
    if (e >= numel(to)) return;
    uint N = to.ne[3], kk = to.ne[2];
    uint n = e % N, j = (e / N) % kk, t = e / (N * kk);
    int E = int(tw.ne[1]);
    int ex = clamp(LOADI(ids, DT2, offset_at(ti, uvec4(0u, 0u, t, j))), 0, E - 1);
    uint K = tw.ne[3];
    int wb = int(tw.off) + ex * tw.nb[1] + int(n) * tw.nb[2];
    int xb = int(tx.off) + int(t) * tx.nb[1] + int(j) * tx.nb[2];
    float acc = 0.0;
    for (uint q = 0u; q < K; q++) {
        acc += LOADF(w, DT0, uint(wb + int(q) * tw.nb[3])) * LOADF(x, DT1, uint(xb + int(q) * tx.nb[3]));
    }
    STOREF(o, DT3, to.off + e, acc)
}
