#version 450
// set_rows: dst[idx[m], :] = src[m, :], writing into dst's own memory (the output binding).
// Rows whose index is out of range are skipped (never an OOB write).
#define NT 3u
layout(local_size_x = 256) in;
layout(std430, set = 0, binding = 1) buffer BufI { uint ids[]; };
layout(std430, set = 0, binding = 2) buffer BufS { uint src[]; };
layout(std430, set = 0, binding = 3) buffer BufO { uint o[]; };
#include "common.glsl"

void main() {
    Tensor ti = tensor_desc(0u);  // [M]
    Tensor ts = tensor_desc(1u);  // [1, 1, M, D]
    Tensor to = tensor_desc(2u);  // dst [1, 1, R, D]
    uint e = invocation_linear();
    uint D = ts.ne[3];
    if (e >= ts.ne[2] * D) return;
    uint m = e / D, col = e % D;
    int R = int(to.ne[2]);
    int row = LOADI(ids, DT0, offset_of(ti, m));
    if (row < 0) row += R;
    if (row < 0 || row >= R) return;
    COPY_ELEM(o, DT2, offset_at(to, uvec4(0u, 0u, uint(row), col)), src, DT1, offset_at(ts, uvec4(0u, 0u, m, col)))
}
