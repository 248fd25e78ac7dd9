#version 450
// top_k: indices of the k largest values of each row, sorted by value descending, ties
// broken by lower index. Each element's rank is counted directly (rank = number of elements
// that come before it in that order), so the result is deterministic. One workgroup per row.
#define NT 2u
#define WG 64u
layout(local_size_x = 64) in;
layout(std430, set = 0, binding = 1) buffer BufX { uint x[]; };
layout(std430, set = 0, binding = 2) buffer BufO { uint o[]; };
#include "common.glsl"

void main() {
    Tensor tx = tensor_desc(0u);
    Tensor to = tensor_desc(1u);
    uint rows = tx.ne[0] * tx.ne[1] * tx.ne[2];
    uint row = group_linear();
    if (row >= rows) return;
    uint N = tx.ne[3];
    uint k = param_u(0u);
    uvec4 c = uvec4(row / (tx.ne[1] * tx.ne[2]), (row / tx.ne[2]) % tx.ne[1], row % tx.ne[2], 0u);
    uint base = offset_at(tx, c);
    for (uint j = gl_LocalInvocationID.x; j < N; j += WG) {
        float vj = LOADF(x, DT0, uint(int(base) + int(j) * tx.nb[3]));
        uint rank = 0u;
        for (uint i = 0u; i < N && rank < k; i++) {
            float vi = LOADF(x, DT0, uint(int(base) + int(i) * tx.nb[3]));
            if (vi > vj || (vi == vj && i < j)) rank++;
        }
        if (rank < k) { STOREI(o, DT1, to.off + row * k + rank, int(j)) }
    }
}
