#version 450
// Reductions over one axis, which the host moved last with strides: x is [R0, R1, R2, N]
// and out[r] (contiguous, r over R0*R1*R2) = reduce(x[r, :]). One workgroup per output.
//   MODE 0 sum, 1 mean, 2 max (NaN propagates), 3 argmax (i32; first index on ties; first NaN wins)
#define NT 2u
#define WG 128u
layout(local_size_x = 128) in;
layout(std430, set = 0, binding = 1) buffer BufX { uint x[]; };
layout(std430, set = 0, binding = 2) buffer BufO { uint o[]; };
#include "common.glsl"

shared float rv[WG];
shared uint ri[WG];

bool better(float v2, uint i2, float v1, uint i1) {
    if (isnan(v1)) return isnan(v2) && i2 < i1;
    if (isnan(v2)) return true;
    return v2 > v1 || (v2 == v1 && i2 < i1);
}

void main() {
    Tensor tx = tensor_desc(0u);
    Tensor to = tensor_desc(1u);
    uint rows = tx.ne[0] * tx.ne[1] * tx.ne[2];
    uint row = group_linear();
    if (row >= rows) return;
    uint N = tx.ne[3];
    uvec4 c = uvec4(row / (tx.ne[1] * tx.ne[2]), (row / tx.ne[2]) % tx.ne[1], row % tx.ne[2], 0u);
    uint lid = gl_LocalInvocationID.x;
    float acc = MODE >= 2u ? -1.0 / 0.0 : 0.0;
    uint idx = 0xFFFFFFFFu;
    for (uint j = lid; j < N; j += WG) {
        c.w = j;
        float v = LOADF(x, DT0, offset_at(tx, c));
        if (MODE <= 1u) acc += v;
        else if (MODE == 2u) acc = (isnan(acc) || isnan(v)) ? (0.0 / 0.0) : max(acc, v);
        else if (idx == 0xFFFFFFFFu || better(v, j, acc, idx)) { acc = v; idx = j; }
    }
    rv[lid] = acc;
    ri[lid] = idx;
    barrier();
    [[unroll]] for (uint s = WG / 2u; s > 0u; s >>= 1) {
        if (lid < s) {
            float a = rv[lid], b = rv[lid + s];
            if (MODE <= 1u) rv[lid] = a + b;
            else if (MODE == 2u) rv[lid] = (isnan(a) || isnan(b)) ? (0.0 / 0.0) : max(a, b);
            else if (ri[lid + s] != 0xFFFFFFFFu && (ri[lid] == 0xFFFFFFFFu || better(b, ri[lid + s], a, ri[lid]))) {
                rv[lid] = b; ri[lid] = ri[lid + s];
            }
        }
        barrier();
    }
    if (lid == 0u) {
        uint oe = to.off + row;
        if (MODE == 3u) { STOREI(o, DT1, oe, int(ri[0])) }
        else if (MODE == 1u) { STOREF(o, DT1, oe, rv[0] / float(N)) }
        else { STOREF(o, DT1, oe, rv[0]) }
    }
}
