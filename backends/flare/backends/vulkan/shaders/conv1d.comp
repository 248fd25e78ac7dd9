#version 450
// conv1d: out[b, o, l] = sum_c sum_k x[b, c, l*stride + k*dilation - padding] * w[o, c, k]
// (zero padding; f32 accumulation in c-then-k order). One output element per invocation.
#define NT 3u
layout(local_size_x = 256) in;
layout(std430, set = 0, binding = 1) buffer BufX { uint x[]; };
layout(std430, set = 0, binding = 2) buffer BufW { uint w[]; };
layout(std430, set = 0, binding = 3) buffer BufO { uint o[]; };
#include "common.glsl"

void main() {
    Tensor tx = tensor_desc(0u);  // [1, B, Cin, L]
    Tensor tw = tensor_desc(1u);  // [1, Cout, Cin, K]
    Tensor to = tensor_desc(2u);  // [1, B, Cout, Lout]
    uint e = invocation_linear();
    if (e >= numel(to)) return;
    int stride = param_i(0u), padding = param_i(1u), dilation = param_i(2u);
    uint Lout = to.ne[3], Cout = to.ne[2];
    uint l = e % Lout, oc = (e / Lout) % Cout, b = e / (Lout * Cout);
    uint Cin = tx.ne[2], K = tw.ne[3];
    int L = int(tx.ne[3]);
    float acc = 0.0;
    for (uint c = 0u; c < Cin; c++) {
        for (uint k = 0u; k < K; k++) {
            int pos = int(l) * stride + int(k) * dilation - padding;
            if (pos >= 0 && pos < L) {
                acc += LOADF(x, DT0, offset_at(tx, uvec4(0u, b, c, uint(pos)))) *
                       LOADF(w, DT1, offset_at(tw, uvec4(0u, oc, c, k)));
            }
        }
    }
    STOREF(o, DT2, to.off + e, acc)
}
