#version 450
// Matrix-vector products with block-quantized weights, dequantized in the shader (decode):
// out[b0,b1,i,j] = sum_k x[b0,b1,i,k] * dequant(w)[b0,b1,j,k], the weight w [.., N, nb] in
// blocks of QT (quant.glsl), x f32/f16 with K = nb * QK. Used when x has few rows (a decode
// token) and for mul_mat_id with quantized experts.
//
// As matvec.comp: a workgroup computes NR outputs j of one row i; its WG invocations split K,
// here in units of UNIT weights (a multiple of 4 inside one sub-block, so a unit needs one
// scale; a whole q4_0/q4_1/q8_0 block is read as one run of words, q_legacy): neighbouring
// invocations take neighbouring units, so reads of a weight row are
// contiguous across the workgroup. Per unit an invocation reads the NR rows' scales once,
// then four x values and four packed weights at a time; each row's dot with the integer
// weights is scaled once per unit (sum(x*q)*d + sum(x)*m, as ggml's dot products do), then
// subgroupAdd, then across subgroups in subgroup order through shared memory.
// MODE bits:
//   1  X_VEC: x contiguous along k, 4-aligned rows -> 4-element loads
//   4  IDS: mul_mat_id. w is [1, E, N, nb]; x [1, T, k, K]; ids [1, 1, T, k] (binding 3)
//      picks row i = (t, slot)'s expert (clamped into range); out is [1, T, k, N].
// EPI (constant 7, not with IDS): the fused `linear` epilogue (common.glsl), bias in binding 3
// and residual in binding 5, laid out on the output's coordinates.
#define NT 5u
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_arithmetic : require
layout(local_size_x_id = 5) in;
layout(std430, set = 0, binding = 1) readonly buffer BufX { uint x[]; };
layout(std430, set = 0, binding = 1) readonly buffer BufX2 { uvec2 x2[]; };
layout(std430, set = 0, binding = 1) readonly buffer BufX4 { uvec4 x4[]; };
layout(std430, set = 0, binding = 2) readonly buffer BufW { uint qw[]; };
layout(std430, set = 0, binding = 3) buffer BufI { uint ids[]; };
layout(std430, set = 0, binding = 4) buffer BufO { uint o[]; };
layout(std430, set = 0, binding = 5) buffer BufR { uint res[]; };  // EPI residual (else x)
#include "common.glsl"
#include "quant.glsl"

layout(constant_id = 5) const uint WG = 32;
layout(constant_id = 6) const uint NR = 4;
layout(constant_id = 7) const uint EPI = 0;
layout(constant_id = 8) const uint UNIT = 32;  // weights per invocation step: a multiple of 4 dividing QSUB

const bool X_VEC = (MODE & 1u) != 0u;
const bool IDS = (MODE & 4u) != 0u;
const bool LEGACY_UNIT = !Q_KQUANT && UNIT == QK;  // units are whole legacy blocks (quant.glsl q_legacy)

shared float red[NR * WG];

Tensor tx;
int xbase;

vec4 load_x4(uint k) {
    if (X_VEC) {
        uint e = uint(xbase) + k;
        if (DT0 == DT_F16) { uvec2 w = x2[e >> 2]; return vec4(unpackHalf2x16(w.x), unpackHalf2x16(w.y)); }
        return uintBitsToFloat(x4[e >> 2]);
    }
    vec4 v;
    [[unroll]] for (uint c = 0u; c < 4u; c++) v[c] = LOADF(x, DT0, uint(xbase + int(k + c) * tx.nb[3]));
    return v;
}

void main() {
    tx = tensor_desc(0u);
    Tensor tw = tensor_desc(1u);
    Tensor ti = tensor_desc(2u);
    Tensor to = tensor_desc(3u);
    Tensor tr = tensor_desc(4u);
    const uint lid = gl_LocalInvocationID.x;
    const uint K = tx.ne[3];
    const uint i = gl_WorkGroupID.y;
    const uint j0 = gl_WorkGroupID.x * NR;
    const uint J = to.ne[3];
    int wbase;   // block index of w's [b0, b1] (or the expert's) matrix
    uvec4 oc;    // output coordinate of (i, j0)
    if (IDS) {
        uint kk = to.ne[2];
        uint t = i / kk, slot = i % kk;
        int E = int(tw.ne[1]);
        int ex = clamp(LOADI(ids, DT2, offset_at(ti, uvec4(0u, 0u, t, slot))), 0, E - 1);
        xbase = int(tx.off) + int(t) * tx.nb[1] + int(slot) * tx.nb[2];
        wbase = ex * tw.nb[1];
        oc = uvec4(0u, t, slot, j0);
    } else {
        uint z = gl_WorkGroupID.z;
        uint b0 = z / to.ne[1], b1 = z % to.ne[1];
        xbase = int(tx.off) + int(b0) * tx.nb[0] + int(b1) * tx.nb[1] + int(i) * tx.nb[2];
        wbase = int(b0) * tw.nb[0] + int(b1) * tw.nb[1];
        oc = uvec4(b0, b1, i, j0);
    }
    const uint nr = min(NR, J - j0);
    float acc[NR];
    uint row[NR];  // block index of each output's weight row
    [[unroll]] for (uint r = 0u; r < NR; r++) {
        acc[r] = 0.0;
        row[r] = uint(wbase + int(min(j0 + r, J - 1u)) * tw.nb[2]);
    }
    const uint units = K / UNIT;
    if (LEGACY_UNIT) {  // a whole q4_0 / q4_1 / q8_0 block per unit: read in one run of words
        for (uint u = lid; u < units; u += WG) {
            uint k = u * QK;
            vec4 xv[8];
            float sx = 0.0;
            [[unroll]] for (uint g = 0u; g < 8u; g++) {
                xv[g] = load_x4(k + 4u * g);
                if (Q_HAS_MIN) sx += (xv[g].x + xv[g].y) + (xv[g].z + xv[g].w);
            }
            [[unroll]] for (uint r = 0u; r < NR; r++) {
                if (r < nr) {
                    vec2 sc;
                    uint q[8];
                    q_legacy(tw.off + (row[r] + u * uint(tw.nb[3])) * QB, sc, q);
                    float dq = 0.0;
                    [[unroll]] for (uint g = 0u; g < 8u; g++) dq += dot(xv[g], vec4(q_legacy_quad(q[q_legacy_word(g)], g)));
                    acc[r] += Q_HAS_MIN ? dq * sc.x + sx * sc.y : dq * sc.x;
                }
            }
        }
    } else for (uint u = lid; u < units; u += WG) {
        uint k = u * UNIT;
        uint p = k % QK;
        uint blk = k / QK;
        vec2 sc[NR];
        uint bb[NR];
        float dq[NR];
        [[unroll]] for (uint r = 0u; r < NR; r++) {
            bb[r] = tw.off + (row[r] + blk * uint(tw.nb[3])) * QB;
            sc[r] = r < nr ? q_scale(bb[r], p / QSUB) : vec2(0.0);
            dq[r] = 0.0;
        }
        float sx = 0.0;
        for (uint g = 0u; g < UNIT; g += 4u) {
            vec4 xv = load_x4(k + g);
            if (Q_HAS_MIN) sx += (xv.x + xv.y) + (xv.z + xv.w);
            [[unroll]] for (uint r = 0u; r < NR; r++) {
                if (r < nr) dq[r] += dot(xv, vec4(q_ints(bb[r], p + g)));
            }
        }
        [[unroll]] for (uint r = 0u; r < NR; r++) {
            acc[r] += Q_HAS_MIN ? dq[r] * sc[r].x + sx * sc[r].y : dq[r] * sc[r].x;
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
