#version 450
// top_k: indices of the k largest values of each row, by value descending, ties by lower
// index, NaN after every number (the reference's stable argsort of -x). One workgroup per
// row runs k selection rounds: round r picks the best element that comes after round r-1's
// pick in that order, so nothing is marked or stored and the result is deterministic.
// Work O(k * N) per row (each invocation scans N / WG elements per round), not the O(N^2)
// of counting ranks; the rounds are workgroup reductions (wg_reduce.glsl).
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
    if (row >= rows) return;
    uint N = tx.ne[3];
    uint k = param_u(0u);
    int base = int(offset_at(tx, uvec4(row / (tx.ne[1] * tx.ne[2]), (row / tx.ne[2]) % tx.ne[1], row % tx.ne[2], 0u)));
    int step = tx.nb[3];
    uint lid = gl_LocalInvocationID.x;
    // keys: larger = earlier; NaN -> 0 (after every number, and after empty lanes only by index)
    uvec2 prev = uvec2(0xFFFFFFFFu, 0u);  // before everything: any key < 0xFFFFFFFF qualifies
    bool first = true;
    for (uint r = 0u; r < k; r++) {
        uint key = 0u, idx = 0xFFFFFFFFu;
        for (uint j = lid; j < N; j += WG) {
            uint kj = order_key(LOADF(x, DT0, uint(base + int(j) * step)), 0u);
            bool after = first || kj < prev.x || (kj == prev.x && j > prev.y);
            if (after && (idx == 0xFFFFFFFFu || kj > key)) { key = kj; idx = j; }
        }
        prev = wg_best(key, idx);
        first = false;
        if (lid == 0u) { STOREI(o, DT1, to.off + row * k + r, int(prev.y)) }
    }
}
