#version 450
// Matmul with block-quantized weights for CPU drivers (the "cpu" kernel profile, prefill):
// out[b0,b1,m,n] = sum_k a[b0,b1,m,k] * dequant(w)[b0,b1,n,k], w [.., N, nb] blocks of QT.
//
// The shape of matmul_lanes.comp (why: see there and the backend README): each invocation
// computes a TM x TN block straight from the buffers, no shared memory, no barriers; WG
// invocations side by side along n. Per sub-block of QSUB weights it reads the TN columns'
// scales once; then per four k it loads TM vec4s of a and TN packed words of w (one or two
// 32-bit loads each), dequantizes the TN quads in registers and does 4 TM TN FMAs. (Reading
// a q4_0/q4_1/q8_0 block whole, as matvec_q does, would unroll eight quads here: an LLVM
// compile of about 45 s per pipeline on lavapipe, for no gain measurable on the loaded test machine.)
// MODE bit 1 A_VEC: a contiguous along k, 4-aligned rows -> vec4 loads of a.
// EPI (constant 8): the fused `linear` epilogue, bias in binding 4, residual in binding 5.
#define NT 5u
layout(local_size_x_id = 5) in;
layout(std430, set = 0, binding = 1) readonly buffer BufA { uint a[]; };
layout(std430, set = 0, binding = 1) readonly buffer BufA2 { uvec2 a2[]; };
layout(std430, set = 0, binding = 1) readonly buffer BufA4 { uvec4 a4[]; };
layout(std430, set = 0, binding = 2) readonly buffer BufW { uint qw[]; };
layout(std430, set = 0, binding = 3) buffer BufO { uint o[]; };
layout(std430, set = 0, binding = 4) readonly buffer BufI { uint bias[]; };  // EPI bias (else a)
layout(std430, set = 0, binding = 5) buffer BufR { uint res[]; };  // EPI residual (else a)
#include "common.glsl"
#include "quant.glsl"

layout(constant_id = 5) const uint WG = 8;
layout(constant_id = 6) const uint TM = 16;
layout(constant_id = 7) const uint TN = 16;
layout(constant_id = 8) const uint EPI = 0;

const bool A_VEC = (MODE & 1u) != 0u;

Tensor ta;
int abase;

vec4 load_a4(uint m, uint k) {
    int e = abase + int(m) * ta.nb[2];
    if (A_VEC) {
        uint u = uint(e) + k;
        if (DT0 == DT_F16) { uvec2 w = a2[u >> 2]; return vec4(unpackHalf2x16(w.x), unpackHalf2x16(w.y)); }
        return uintBitsToFloat(a4[u >> 2]);
    }
    vec4 v;
    [[unroll]] for (uint c = 0u; c < 4u; c++) v[c] = LOADF(a, DT0, uint(e + int(k + c) * ta.nb[3]));
    return v;
}

void main() {
    ta = tensor_desc(0u);
    Tensor tw = tensor_desc(1u);
    Tensor to = tensor_desc(2u);
    Tensor tbias = tensor_desc(3u);
    Tensor tres = tensor_desc(4u);
    const uint M = to.ne[2], N = to.ne[3], K = ta.ne[3];
    const uint z = gl_WorkGroupID.z;
    const uint b0 = z / to.ne[1], b1 = z % to.ne[1];
    const uint n0 = (gl_WorkGroupID.x * WG + gl_LocalInvocationID.x) * TN;
    const uint m0 = gl_WorkGroupID.y * TM;
    if (n0 >= N) return;
    abase = int(ta.off) + int(b0) * ta.nb[0] + int(b1) * ta.nb[1];
    const int wbase = int(b0) * tw.nb[0] + int(b1) * tw.nb[1];  // blocks
    uint row[TN];  // block index of each column's weight row (clamped: columns past N are not stored)
    [[unroll]] for (uint j = 0u; j < TN; j++) row[j] = uint(wbase + int(min(n0 + j, N - 1u)) * tw.nb[2]);
    uint mrow[TM];
    [[unroll]] for (uint i = 0u; i < TM; i++) mrow[i] = min(m0 + i, M - 1u);
    float acc[TM * TN];
    [[unroll]] for (uint t = 0u; t < TM * TN; t++) acc[t] = 0.0;
    const uint nb = K / QK;
    for (uint blk = 0u; blk < nb; blk++) {
        uint bb[TN];
        [[unroll]] for (uint j = 0u; j < TN; j++) bb[j] = tw.off + (row[j] + blk * uint(tw.nb[3])) * QB;
        for (uint s = 0u; s < QK / QSUB; s++) {
            vec2 sc[TN];
            [[unroll]] for (uint j = 0u; j < TN; j++) sc[j] = q_scale(bb[j], s);
            for (uint g = 0u; g < QSUB; g += 4u) {
                uint p = s * QSUB + g;
                uint k = blk * QK + p;
                vec4 av[TM];
                [[unroll]] for (uint i = 0u; i < TM; i++) av[i] = load_a4(mrow[i], k);
                [[unroll]] for (uint j = 0u; j < TN; j++) {
                    vec4 wv = q_weights4(q_ints(bb[j], p), sc[j]);
                    [[unroll]] for (uint i = 0u; i < TM; i++) acc[i * TN + j] += dot(av[i], wv);
                }
            }
        }
    }
    [[unroll]] for (uint i = 0u; i < TM; i++) {
        uint m = m0 + i;
        [[unroll]] for (uint j = 0u; j < TN; j++) {
            uint n = n0 + j;
            if (m < M && n < N) {
                uvec4 c = uvec4(b0, b1, m, n);
                float v = acc[i * TN + j];
                if (EPI != 0u) EPILOGUE(EPI, v, bias, tbias, res, tres, c)
                STOREF(o, DT3, offset_at(to, c), v)
            }
        }
    }
}
