#version 450
// get_rows: out[i..., :] = table[idx[i...], :]  (table f32/f16 [R, D], idx i32/i64 any shape).
// Negative indices count from the end as in NumPy; out-of-range ones are clamped (never an OOB read).
#define NT 3u
layout(local_size_x = 256) in;
layout(std430, set = 0, binding = 1) buffer BufT { uint tbl[]; };
layout(std430, set = 0, binding = 2) buffer BufI { uint ids[]; };
layout(std430, set = 0, binding = 3) buffer BufO { uint o[]; };
#include "common.glsl"

void main() {
    Tensor tt = tensor_desc(0u);  // [1, 1, R, D]
    Tensor ti = tensor_desc(1u);
    Tensor to = tensor_desc(2u);
    uint e = invocation_linear();
    if (e >= numel(to)) return;
    uint D = tt.ne[3];
    int R = int(tt.ne[2]);
    int row = LOADI(ids, DT1, offset_of(ti, e / D));
    if (row < 0) row += R;
    row = clamp(row, 0, R - 1);
    float v = LOADF(tbl, DT0, offset_at(tt, uvec4(0u, 0u, uint(row), e % D)));
    STOREF(o, DT2, to.off + e, v)
}
