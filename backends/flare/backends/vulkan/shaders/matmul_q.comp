#version 450
// Tiled matmul with block-quantized weights (the "gpu" kernel profile, prefill):
// out[b0,b1,m,n] = sum_k a[b0,b1,m,k] * dequant(w)[b0,b1,n,k], w [.., N, nb] blocks of QT.
//
// A workgroup of WG = (BM/TM)*(BN/TN) invocations (constants 5..8, 10, 11) computes a BM x BN tile. K advances BK at
// a time (BK a multiple of 4 dividing QSUB, so a k-step never crosses a scale): the a tile
// is staged into shared memory as it is, the w tile is *dequantized* into shared memory
// (each invocation unpacks quads of four weights of one column: one scale read and one or
// two 32-bit reads per quad), both k-major and padded by one word; after a barrier each
// invocation accumulates its TM x TN register block from shared memory (neighbours read
// neighbouring words). The weights cross device memory once per tile of rows, packed.
// MODE bit 1 A_VEC: a contiguous along k, 4-aligned rows -> vec4 loads of a.
// EPI (constant 12): the fused `linear` epilogue, bias in binding 4, residual in binding 5.
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

layout(constant_id = 5) const uint WG = 256;
layout(constant_id = 6) const uint BM = 64;
layout(constant_id = 7) const uint BN = 64;
layout(constant_id = 8) const uint BK = 16;
layout(constant_id = 10) const uint TM = 4;
layout(constant_id = 11) const uint TN = 4;
layout(constant_id = 12) const uint EPI = 0;  // (constant 9 is quant.glsl's QT)

const bool A_VEC = (MODE & 1u) != 0u;

shared float As[BK * (BM + 1u)];
shared float Bs[BK * (BN + 1u)];

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
    const uint lid = gl_LocalInvocationID.x;
    const uint tm0 = gl_WorkGroupID.y * BM, tn0 = gl_WorkGroupID.x * BN;
    abase = int(ta.off) + int(b0) * ta.nb[0] + int(b1) * ta.nb[1];
    const int wbase = int(b0) * tw.nb[0] + int(b1) * tw.nb[1];  // blocks
    const uint CN = BN / TN;             // invocations along n
    const uint im = (lid / CN) * TM, jn = (lid % CN) * TN;
    float acc[TM * TN];
    [[unroll]] for (uint t = 0u; t < TM * TN; t++) acc[t] = 0.0;
    const uint QUADS = BK / 4u;          // quads per row of a tile
    for (uint k0 = 0u; k0 < K; k0 += BK) {
        for (uint q = lid; q < BM * QUADS; q += WG) {      // stage a: [BK][BM + 1]
            uint r = q / QUADS, kk = (q % QUADS) * 4u;
            vec4 v = load_a4(min(tm0 + r, M - 1u), k0 + kk);
            [[unroll]] for (uint c = 0u; c < 4u; c++) As[(kk + c) * (BM + 1u) + r] = v[c];
        }
        uint blk = k0 / QK, p0 = k0 % QK;
        for (uint q = lid; q < BN * QUADS; q += WG) {      // dequantize w: [BK][BN + 1]
            uint cn = q / QUADS, kk = (q % QUADS) * 4u;
            uint bb = tw.off + (uint(wbase + int(min(tn0 + cn, N - 1u)) * tw.nb[2]) + blk * uint(tw.nb[3])) * QB;
            uint p = p0 + kk;
            vec4 v = q_weights4(q_ints(bb, p), q_scale(bb, p / QSUB));
            [[unroll]] for (uint c = 0u; c < 4u; c++) Bs[(kk + c) * (BN + 1u) + cn] = v[c];
        }
        barrier();
        for (uint kk = 0u; kk < BK; kk++) {
            float ar[TM], br[TN];
            [[unroll]] for (uint i = 0u; i < TM; i++) ar[i] = As[kk * (BM + 1u) + im + i];
            [[unroll]] for (uint j = 0u; j < TN; j++) br[j] = Bs[kk * (BN + 1u) + jn + j];
            [[unroll]] for (uint i = 0u; i < TM; i++) {
                [[unroll]] for (uint j = 0u; j < TN; j++) acc[i * TN + j] = fma(ar[i], br[j], acc[i * TN + j]);
            }
        }
        barrier();
    }
    [[unroll]] for (uint i = 0u; i < TM; i++) {
        uint m = tm0 + im + i;
        [[unroll]] for (uint j = 0u; j < TN; j++) {
            uint n = tn0 + jn + j;
            if (m < M && n < N) {
                uvec4 c = uvec4(b0, b1, m, n);
                float v = acc[i * TN + j];
                if (EPI != 0u) EPILOGUE(EPI, v, bias, tbias, res, tres, c)
                STOREF(o, DT3, offset_at(to, c), v)
            }
        }
    }
}
