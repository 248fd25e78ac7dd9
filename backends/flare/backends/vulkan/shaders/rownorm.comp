#version 450
// Row-wise ops over the last axis, one workgroup per row:
//   MODE 0 layer_norm (param0 eps), 1 rms_norm (param0 eps), 2 softmax (param0 scale, param1 has_mask)
//   + 4: norm_affine, times gamma (binding 2, laid out on x's shape); + 8: plus beta (binding 4)
// Each invocation handles a strided share of the row; sums and maxima are workgroup
// reductions (wg_reduce.glsl: subgroup ops, then shared memory across subgroups), in f32.
// Every pass reads the row again, and the last pass reads x[j] before writing out[j] in
// the same invocation (all reductions finish first), so running in place is safe.
#define NT 4u
layout(local_size_x_id = 5) in;
layout(std430, set = 0, binding = 1) buffer BufX { uint x[]; };
layout(std430, set = 0, binding = 2) buffer BufM { uint mk[]; };
layout(std430, set = 0, binding = 3) buffer BufO { uint o[]; };
layout(std430, set = 0, binding = 4) buffer BufB { uint bt[]; };  // beta (MODE & 8), else x
#include "common.glsl"
#include "wg_reduce.glsl"

void main() {
    Tensor tx = tensor_desc(0u);
    Tensor tm = tensor_desc(1u);
    Tensor to = tensor_desc(2u);
    Tensor tb = tensor_desc(3u);
    const uint KIND = MODE & 3u;
    const bool GAMMA = (MODE & 4u) != 0u, BETA = (MODE & 8u) != 0u;
    uint rows = tx.ne[0] * tx.ne[1] * tx.ne[2];
    uint row = group_linear();
    if (row >= rows) return;  // uniform across the workgroup
    uint D = tx.ne[3];
    uvec4 c = uvec4(row / (tx.ne[1] * tx.ne[2]), (row / tx.ne[2]) % tx.ne[1], row % tx.ne[2], 0u);
    int xb = int(offset_at(tx, c)), xs = tx.nb[3];
    uint lid = gl_LocalInvocationID.x;
    uint obase = to.off + row * D;
    if (KIND == 2u) {
        float scale = param_f(0u);
        bool has_mask = param_u(1u) != 0u;
        int mb = int(offset_at(tm, c)), ms = tm.nb[3];
        float mx = -1.0 / 0.0;
        for (uint j = lid; j < D; j += WG) {
            float v = LOADF(x, DT0, uint(xb + int(j) * xs)) * scale + (has_mask ? LOADF(mk, DT1, uint(mb + int(j) * ms)) : 0.0);
            mx = max(mx, v);
        }
        mx = wg_max(mx);
        float s = 0.0;
        for (uint j = lid; j < D; j += WG) {
            float v = LOADF(x, DT0, uint(xb + int(j) * xs)) * scale + (has_mask ? LOADF(mk, DT1, uint(mb + int(j) * ms)) : 0.0);
            s += exp(v - mx);
        }
        float inv = 1.0 / wg_sum(s);
        for (uint j = lid; j < D; j += WG) {
            float v = LOADF(x, DT0, uint(xb + int(j) * xs)) * scale + (has_mask ? LOADF(mk, DT1, uint(mb + int(j) * ms)) : 0.0);
            STOREF(o, DT2, obase + j, exp(v - mx) * inv)
        }
        return;
    }
    float eps = param_f(0u);
    float mean = 0.0;
    if (KIND == 0u) {
        float s = 0.0;
        for (uint j = lid; j < D; j += WG) s += LOADF(x, DT0, uint(xb + int(j) * xs));
        mean = wg_sum(s) / float(D);
    }
    float q = 0.0;
    for (uint j = lid; j < D; j += WG) { float d = LOADF(x, DT0, uint(xb + int(j) * xs)) - mean; q += d * d; }
    float inv = 1.0 / sqrt(wg_sum(q) / float(D) + eps);
    int gb = int(offset_at(tm, c)), gs = tm.nb[3];
    int bb = int(offset_at(tb, c)), bs = tb.nb[3];
    for (uint j = lid; j < D; j += WG) {
        float v = (LOADF(x, DT0, uint(xb + int(j) * xs)) - mean) * inv;
        if (GAMMA) v *= LOADF(mk, DT1, uint(gb + int(j) * gs));
        if (BETA) v += uintBitsToFloat(bt[uint(bb + int(j) * bs)]);
        STOREF(o, DT2, obase + j, v)
    }
}
