#version 450
// Matrix-vector products for few rows: out[b0,b1,i,j] = sum_k x[b0,b1,i,k] * y[b0,b1,j,k].
// Used when one side of a matmul has few rows (an LSTM step, a decode token, the head's
// single output column with the operands swapped) and for mul_mat_id, where every row
// has its own expert matrix. A tiled kernel would waste most of its tile there.
//
// One workgroup computes NR outputs j of one row i: its WG invocations split K (neighbours
// read neighbouring k, so loads of y coalesce), each keeps NR partial sums, and the sums
// are reduced with subgroupAdd and then across subgroups through shared memory in subgroup
// order (deterministic). Specialization: WG (local size) and NR are the tuning; MODE bits:
//   1  X_VEC: x contiguous along k, 4-aligned rows -> 4-element loads
//   2  Y_VEC: y contiguous along k, 4-aligned rows -> 4-element loads
//   4  IDS: mul_mat_id. y is w [1, E, N, K]; x is [1, T, k, K]; ids [1, 1, T, k] (binding 3)
//      picks row i = (t, slot)'s expert (clamped into range, never an OOB read); out is
//      [1, T, k, N] (binding 4).
// Without IDS, binding 3 is not read (the host binds x there).
// EPI (constant 7, not with IDS): the fused `linear` node's epilogue (common.glsl), bias in
// binding 3 and residual in binding 5, both laid out on the output's coordinates.
#define NT 5u
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_arithmetic : require
layout(local_size_x_id = 5) in;
layout(std430, set = 0, binding = 1) readonly buffer BufX { uint x[]; };
layout(std430, set = 0, binding = 1) readonly buffer BufX2 { uvec2 x2[]; };
layout(std430, set = 0, binding = 1) readonly buffer BufX4 { uvec4 x4[]; };
layout(std430, set = 0, binding = 2) readonly buffer BufY { uint y[]; };
layout(std430, set = 0, binding = 2) readonly buffer BufY2 { uvec2 y2[]; };
layout(std430, set = 0, binding = 2) readonly buffer BufY4 { uvec4 y4[]; };
layout(std430, set = 0, binding = 3) buffer BufI { uint ids[]; };
layout(std430, set = 0, binding = 4) buffer BufO { uint o[]; };
layout(std430, set = 0, binding = 5) buffer BufR { uint res[]; };  // EPI residual (else x)
#include "common.glsl"

layout(constant_id = 5) const uint WG = 32;
layout(constant_id = 6) const uint NR = 4;
layout(constant_id = 7) const uint EPI = 0;

const bool X_VEC = (MODE & 1u) != 0u;
const bool Y_VEC = (MODE & 2u) != 0u;
const bool IDS = (MODE & 4u) != 0u;

shared float red[NR * WG];

vec4 load4_x(uint e) {
    if (DT0 == DT_F16) { uvec2 w = x2[e >> 2]; return vec4(unpackHalf2x16(w.x), unpackHalf2x16(w.y)); }
    return uintBitsToFloat(x4[e >> 2]);
}

vec4 load4_y(uint e) {
    if (DT1 == DT_F16) { uvec2 w = y2[e >> 2]; return vec4(unpackHalf2x16(w.x), unpackHalf2x16(w.y)); }
    return uintBitsToFloat(y4[e >> 2]);
}

void main() {
    Tensor tx = tensor_desc(0u);
    Tensor ty = tensor_desc(1u);
    Tensor ti = tensor_desc(2u);
    Tensor to = tensor_desc(3u);
    Tensor tr = tensor_desc(4u);
    const uint lid = gl_LocalInvocationID.x;
    const uint K = tx.ne[3];
    const uint i = gl_WorkGroupID.y;
    const uint j0 = gl_WorkGroupID.x * NR;
    int xbase, ybase;
    uint J;
    uvec4 oc;  // output coordinate of (i, j0)
    if (IDS) {
        uint kk = to.ne[2];
        uint t = i / kk, slot = i % kk;
        int E = int(ty.ne[1]);
        int ex = clamp(LOADI(ids, DT2, offset_at(ti, uvec4(0u, 0u, t, slot))), 0, E - 1);
        xbase = int(tx.off) + int(t) * tx.nb[1] + int(slot) * tx.nb[2];
        ybase = int(ty.off) + ex * ty.nb[1];
        J = to.ne[3];
        oc = uvec4(0u, t, slot, j0);
    } else {
        uint z = gl_WorkGroupID.z;
        uint b0 = z / to.ne[1], b1 = z % to.ne[1];
        xbase = int(tx.off) + int(b0) * tx.nb[0] + int(b1) * tx.nb[1] + int(i) * tx.nb[2];
        ybase = int(ty.off) + int(b0) * ty.nb[0] + int(b1) * ty.nb[1];
        J = to.ne[3];
        oc = uvec4(b0, b1, i, j0);
    }
    const uint nr = min(NR, J - j0);
    float acc[NR];
    [[unroll]] for (uint r = 0u; r < NR; r++) acc[r] = 0.0;
    if (Y_VEC) {
        for (uint k = 4u * lid; k < K; k += 4u * WG) {
            vec4 xv = X_VEC ? load4_x(uint(xbase + int(k))) : vec4(
                LOADF(x, DT0, uint(xbase + int(k) * tx.nb[3])), LOADF(x, DT0, uint(xbase + int(k + 1u) * tx.nb[3])),
                LOADF(x, DT0, uint(xbase + int(k + 2u) * tx.nb[3])), LOADF(x, DT0, uint(xbase + int(k + 3u) * tx.nb[3])));
            [[unroll]] for (uint r = 0u; r < NR; r++) {
                if (r < nr) acc[r] += dot(xv, load4_y(uint(ybase + int(j0 + r) * ty.nb[2] + int(k))));
            }
        }
    } else {
        for (uint k = lid; k < K; k += WG) {
            float xv = LOADF(x, DT0, uint(xbase + int(k) * tx.nb[3]));
            [[unroll]] for (uint r = 0u; r < NR; r++) {
                if (r < nr) acc[r] = fma(xv, LOADF(y, DT1, uint(ybase + int(j0 + r) * ty.nb[2] + int(k) * ty.nb[3])), acc[r]);
            }
        }
    }
    [[unroll]] for (uint r = 0u; r < NR; r++) acc[r] = subgroupAdd(acc[r]);
    if (gl_NumSubgroups == 1u) {  // uniform: one subgroup needs no shared memory or barrier
        if (lid == 0u) {
            for (uint r = 0u; r < nr; r++) {
                oc.w = j0 + r;
                float v = acc[r];
                if (EPI != 0u) EPILOGUE(EPI, v, ids, ti, res, tr, oc)
                STOREF(o, DT3, offset_at(to, oc), v)
            }
        }
        return;
    }
    if (subgroupElect()) {
        [[unroll]] for (uint r = 0u; r < NR; r++) red[r * WG + gl_SubgroupID] = acc[r];
    }
    barrier();
    if (lid < nr) {
        float s = 0.0;
        for (uint g = 0u; g < gl_NumSubgroups; g++) s += red[lid * WG + g];
        oc.w = j0 + lid;
        if (EPI != 0u) EPILOGUE(EPI, s, ids, ti, res, tr, oc)
        STOREF(o, DT3, offset_at(to, oc), s)
    }
}
