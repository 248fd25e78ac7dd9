#version 450
// Row-wise ops over the last axis, one workgroup per row:
//   MODE 0 layer_norm (param0 eps), 1 rms_norm (param0 eps), 2 softmax (param0 scale, param1 has_mask)
// Reductions are a shared-memory tree in f32; every pass reads the row again, and the last
// pass reads x[j] before writing out[j] in the same invocation, so running in place is safe.
#define NT 3u
#define WG 128u
layout(local_size_x = 128) in;
layout(std430, set = 0, binding = 1) buffer BufX { uint x[]; };
layout(std430, set = 0, binding = 2) buffer BufM { uint mk[]; };
layout(std430, set = 0, binding = 3) buffer BufO { uint o[]; };
#include "common.glsl"

shared float red[WG];

float wg_sum(float v) {
    uint lid = gl_LocalInvocationID.x;
    red[lid] = v;
    barrier();
    [[unroll]] for (uint s = WG / 2u; s > 0u; s >>= 1) {
        if (lid < s) red[lid] += red[lid + s];
        barrier();
    }
    float r = red[0];
    barrier();
    return r;
}

float wg_max(float v) {
    uint lid = gl_LocalInvocationID.x;
    red[lid] = v;
    barrier();
    [[unroll]] for (uint s = WG / 2u; s > 0u; s >>= 1) {
        if (lid < s) red[lid] = max(red[lid], red[lid + s]);
        barrier();
    }
    float r = red[0];
    barrier();
    return r;
}

void main() {
    Tensor tx = tensor_desc(0u);
    Tensor tm = tensor_desc(1u);
    Tensor to = tensor_desc(2u);
    uint rows = tx.ne[0] * tx.ne[1] * tx.ne[2];
    uint row = group_linear();
    if (row >= rows) return;  // uniform across the workgroup
    uint D = tx.ne[3];
    uvec4 c = uvec4(row / (tx.ne[1] * tx.ne[2]), (row / tx.ne[2]) % tx.ne[1], row % tx.ne[2], 0u);
    uint lid = gl_LocalInvocationID.x;
    uint obase = to.off + row * D;
    if (MODE == 2u) {
        float scale = param_f(0u);
        bool has_mask = param_u(1u) != 0u;
        float mx = -1.0 / 0.0;
        for (uint j = lid; j < D; j += WG) {
            c.w = j;
            float v = LOADF(x, DT0, offset_at(tx, c)) * scale + (has_mask ? LOADF(mk, DT1, offset_at(tm, c)) : 0.0);
            mx = max(mx, v);
        }
        mx = wg_max(mx);
        float s = 0.0;
        for (uint j = lid; j < D; j += WG) {
            c.w = j;
            float v = LOADF(x, DT0, offset_at(tx, c)) * scale + (has_mask ? LOADF(mk, DT1, offset_at(tm, c)) : 0.0);
            s += exp(v - mx);
        }
        s = wg_sum(s);
        for (uint j = lid; j < D; j += WG) {
            c.w = j;
            float v = LOADF(x, DT0, offset_at(tx, c)) * scale + (has_mask ? LOADF(mk, DT1, offset_at(tm, c)) : 0.0);
            STOREF(o, DT2, obase + j, exp(v - mx) / s)
        }
        return;
    }
    float eps = param_f(0u);
    float mean = 0.0;
    if (MODE == 0u) {
        float s = 0.0;
        for (uint j = lid; j < D; j += WG) { c.w = j; s += LOADF(x, DT0, offset_at(tx, c)); }
        mean = wg_sum(s) / float(D);
    }
    float q = 0.0;
    for (uint j = lid; j < D; j += WG) { c.w = j; float d = LOADF(x, DT0, offset_at(tx, c)) - mean; q += d * d; }
    float inv = 1.0 / sqrt(wg_sum(q) / float(D) + eps);
    for (uint j = lid; j < D; j += WG) {
        c.w = j;
        float v = LOADF(x, DT0, offset_at(tx, c));
        STOREF(o, DT2, obase + j, (v - mean) * inv)
    }
}
