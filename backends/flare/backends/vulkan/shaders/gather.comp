#version 450
// gather: out[..., j] = x[..., idx[..., j]]  (np.take_along_axis on the last axis; negative
// indices count from the end; out-of-range ones are clamped).
#define NT 3u
layout(local_size_x = 256) in;
layout(std430, set = 0, binding = 1) buffer BufX { uint x[]; };
layout(std430, set = 0, binding = 2) buffer BufI { uint ids[]; };
layout(std430, set = 0, binding = 3) buffer BufO { uint o[]; };
#include "common.glsl"

void main() {
    Tensor tx = tensor_desc(0u);
    Tensor ti = tensor_desc(1u);
    Tensor to = tensor_desc(2u);
    uint e = invocation_linear();
    if (e >= numel(to)) return;
    uvec4 c = coords_of(e, ti);
    int N = int(tx.ne[3]);
    int i = LOADI(ids, DT1, offset_at(ti, c));
    if (i < 0) i += N;
    c.w = uint(clamp(i, 0, N - 1));
    STOREF(o, DT2, to.off + e, LOADF(x, DT0, offset_at(tx, c)))
}
