#version 450
// Reductions over one axis, which the host moved last with strides: x is [R0, R1, R2, N]
// and out[r] (contiguous, r over R0*R1*R2) = reduce(x[r, :]). One workgroup per row, each
// invocation reduces a strided share of the row, then wg_reduce.glsl combines them.
//   MODE 0 sum, 1 mean, 2 max (NaN propagates), 3 argmax (i32; first index on ties; first NaN wins)
// max and argmax run on order keys (wg_reduce.glsl), so NaN handling is exact and ties are
// resolved by index without a comparator tree.
#define NT 2u
layout(local_size_x_id = 5) in;
layout(std430, set = 0, binding = 1) readonly buffer BufX { uint x[]; };
layout(std430, set = 0, binding = 2) buffer BufO { uint o[]; };
#include "common.glsl"
#include "wg_reduce.glsl"

void main() {
    Tensor tx = tensor_desc(0u);
    Tensor to = tensor_desc(1u);
    uint rows = tx.ne[0] * tx.ne[1] * tx.ne[2];
    uint row = group_linear();
    if (row >= rows) return;  // uniform across the workgroup
    uint N = tx.ne[3];
    int base = int(offset_at(tx, uvec4(row / (tx.ne[1] * tx.ne[2]), (row / tx.ne[2]) % tx.ne[1], row % tx.ne[2], 0u)));
    int step = tx.nb[3];
    uint lid = gl_LocalInvocationID.x;
    uint oe = to.off + row;
    if (MODE <= 1u) {
        float acc = 0.0;
        for (uint j = lid; j < N; j += WG) acc += LOADF(x, DT0, uint(base + int(j) * step));
        acc = wg_sum(acc);
        if (lid == 0u) { STOREF(o, DT1, oe, MODE == 1u ? acc / float(N) : acc) }
        return;
    }
    // max / argmax: the best key of the row (NaN = 0xFFFFFFFF: it wins), lowest index on ties
    uint key = 0u, idx = 0xFFFFFFFFu;
    for (uint j = lid; j < N; j += WG) {
        uint kj = order_key(LOADF(x, DT0, uint(base + int(j) * step)), 0xFFFFFFFFu);
        if (idx == 0xFFFFFFFFu || kj > key) { key = kj; idx = j; }  // j rises: ties keep the first
    }
    uvec2 best = wg_best(key, idx);
    if (lid == 0u) {
        if (MODE == 3u) { STOREI(o, DT1, oe, int(best.y)) }
        else { STOREF(o, DT1, oe, best.x == 0xFFFFFFFFu ? uintBitsToFloat(0x7FC00000u) : key_value(best.x)) }
    }
}
