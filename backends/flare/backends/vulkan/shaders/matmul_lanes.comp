#version 450
// Matmul for CPU drivers (the "cpu" kernel profile): out[b0,b1,m,n] = sum_k a[m,k] b[k,n].
//
// lavapipe runs a workgroup as SIMD vectors of lanes and, in the Mesa this project meets
// (22.x), executes every shared-memory or buffer load once per lane (about 20 ns per vector
// of 8 lanes, measured), while arithmetic is one instruction per vector. So the kernel that
// wins there is the one with the fewest load instructions per FMA, not the one with the best
// shared-memory reuse: each invocation computes a TM x TN block straight from the buffers,
// four k at a time as vec4 loads (one load instruction for four values), with no shared
// memory and no barriers. Per four k: TM + TN vec4 loads for 4 TM TN FMAs (16 x 16: 32
// loads for 1024 FMAs; the shared-memory tile of matmul.comp issues 128 scalar loads for
// them). Neighbouring lanes take neighbouring column blocks; a workgroup is WG lanes along n.
// On a GPU this would be a poor kernel (no reuse through shared memory, uncoalesced loads):
// the "gpu" profile keeps matmul.comp.
//
// MODE bits (the layouts the host proved):
//   1  A_VEC:  a contiguous along k, 4-aligned rows           -> vec4 loads of a
//   2  B_VEC:  b contiguous along k (a transposed weight)      -> vec4 loads of b along k
//   4  CONV:   b is conv1d's implicit im2col (params: kernel size, stride, padding, dilation);
//              a is the weight [1, 1, Cout, Cin*KS], n runs over (batch, position), out is
//              [1, B, Cout, Lout]
//   8  CONV_VEC: CONV where four consecutive k of a column are four consecutive x samples of
//              one channel, 4-aligned (stride, padding and channel starts multiples of 4,
//              dilation 1, KS a multiple of 4): vec4 loads of x
//   16 B_NVEC: b contiguous along n, 4-aligned (a plain [K, N] weight) -> vec4 loads along n
//   32 K_QUADS: K is a multiple of 4, so the K % 4 tail loop is not compiled (it is a second
//              copy of the TM x TN FMA block: about a third of this kernel's LLVM time on lavapipe)
// EPI (constant 8): the fused `linear` node's epilogue (common.glsl), bias in binding 4,
// residual in binding 5; EPI_RUNTIME: the code is parameter 4 instead (after conv's four), so
// one variant serves a split's several epilogues (sharing.py: one LLVM compile, not one each). Sums: per column, four k at a time (a 4-term dot, then added), in k
// order across the quads; f32.
#define NT 5u
layout(local_size_x_id = 5) in;
layout(std430, set = 0, binding = 1) readonly buffer BufA { uint a[]; };
layout(std430, set = 0, binding = 1) readonly buffer BufA4 { uvec4 a4[]; };
layout(std430, set = 0, binding = 2) readonly buffer BufB { uint b[]; };
layout(std430, set = 0, binding = 2) readonly buffer BufB4 { uvec4 b4[]; };
layout(std430, set = 0, binding = 3) buffer BufO { uint o[]; };
layout(std430, set = 0, binding = 4) readonly buffer BufI { uint bias[]; };  // EPI bias (else a)
layout(std430, set = 0, binding = 5) buffer BufR { uint res[]; };  // EPI residual (else a)
#include "common.glsl"

layout(constant_id = 5) const uint WG = 8;
layout(constant_id = 6) const uint TM = 16;
layout(constant_id = 7) const uint TN = 16;
layout(constant_id = 8) const uint EPI = 0;
#define EPI_RUNTIME 255u

const bool A_VEC = (MODE & 1u) != 0u;
const bool B_VEC = (MODE & 2u) != 0u;
const bool CONV = (MODE & 4u) != 0u;
const bool CONV_VEC = (MODE & 8u) != 0u;
const bool B_NVEC = (MODE & 16u) != 0u;
const bool K_QUADS = (MODE & 32u) != 0u;

Tensor ta, tb, to, tbias, tres;
uint M, N, K;
int abase, bbase;
uint KS, Lout;
int cstride, cpad, cdil, Lin;

// a[m, k..k+3] (zero past M; k + 3 < K)
vec4 load_a4(uint m, uint k) {
    if (m >= M) return vec4(0.0);
    int e = abase + int(m) * ta.nb[2] + int(k) * ta.nb[3];
    if (A_VEC && DT0 == DT_F32) return uintBitsToFloat(a4[uint(e) >> 2]);
    int s = ta.nb[3];
    return vec4(LOADF(a, DT0, uint(e)), LOADF(a, DT0, uint(e + s)), LOADF(a, DT0, uint(e + 2 * s)), LOADF(a, DT0, uint(e + 3 * s)));
}

float load_a(uint m, uint k) {
    return m < M ? LOADF(a, DT0, uint(abase + int(m) * ta.nb[2] + int(k) * ta.nb[3])) : 0.0;
}

// conv1d's im2col: column n = (batch, position); k = (channel, tap)
float load_x(uint n, uint k) {
    uint ci = k / KS, q = k % KS;
    int pos = int(n % Lout) * cstride + int(q) * cdil - cpad;
    if (pos < 0 || pos >= Lin) return 0.0;
    return LOADF(b, DT1, uint(int(tb.off) + int(n / Lout) * tb.nb[1] + int(ci) * tb.nb[2] + pos * tb.nb[3]));
}

// b[k..k+3, n] (zero past N; k + 3 < K)
vec4 load_b4(uint n, uint k) {
    if (n >= N) return vec4(0.0);
    if (CONV_VEC) {
        uint ci = k / KS, q = k % KS;
        int pos = int(n % Lout) * cstride + int(q) - cpad;
        int e = int(tb.off) + int(n / Lout) * tb.nb[1] + int(ci) * tb.nb[2] + pos;
        if (pos >= 0 && pos + 3 < Lin) return uintBitsToFloat(b4[uint(e) >> 2]);
        return vec4(load_x(n, k), load_x(n, k + 1u), load_x(n, k + 2u), load_x(n, k + 3u));
    }
    if (CONV) return vec4(load_x(n, k), load_x(n, k + 1u), load_x(n, k + 2u), load_x(n, k + 3u));
    int e = bbase + int(n) * tb.nb[3] + int(k) * tb.nb[2];
    if (B_VEC && DT1 == DT_F32) return uintBitsToFloat(b4[uint(e) >> 2]);
    int s = tb.nb[2];
    return vec4(LOADF(b, DT1, uint(e)), LOADF(b, DT1, uint(e + s)), LOADF(b, DT1, uint(e + 2 * s)), LOADF(b, DT1, uint(e + 3 * s)));
}

float load_b(uint n, uint k) {
    if (n >= N) return 0.0;
    if (CONV) return load_x(n, k);
    return LOADF(b, DT1, uint(bbase + int(n) * tb.nb[3] + int(k) * tb.nb[2]));
}

void main() {
    ta = tensor_desc(0u);    // [B0, B1, M, K]
    tb = tensor_desc(1u);    // [B0, B1, K, N], or x [1, B, Cin, Lin] (CONV)
    to = tensor_desc(2u);    // [B0, B1, M, N], or [1, B, Cout, Lout] (CONV)
    tbias = tensor_desc(3u);
    tres = tensor_desc(4u);
    M = ta.ne[2];
    K = ta.ne[3];
    N = CONV ? to.ne[1] * to.ne[3] : to.ne[3];
    uint z = gl_WorkGroupID.z;
    uint b0 = CONV ? 0u : z / to.ne[1], b1 = CONV ? 0u : z % to.ne[1];
    abase = int(ta.off) + int(b0) * ta.nb[0] + int(b1) * ta.nb[1];
    bbase = int(tb.off) + int(b0) * tb.nb[0] + int(b1) * tb.nb[1];
    KS = CONV ? param_u(0u) : 1u;
    cstride = CONV ? param_i(1u) : 1;
    cpad = CONV ? param_i(2u) : 0;
    cdil = CONV ? param_i(3u) : 1;
    Lout = to.ne[3];
    Lin = int(tb.ne[3]);
    const uint epi = EPI == EPI_RUNTIME ? param_u(4u) : EPI;  // folded to EPI unless runtime

    const uint n0 = (gl_WorkGroupID.x * WG + gl_LocalInvocationID.x) * TN;
    const uint m0 = gl_WorkGroupID.y * TM;
    if (n0 >= N) return;  // no barriers in this kernel: a lane may leave early

    float acc[TM * TN];
    [[unroll]] for (uint i = 0u; i < TM * TN; i++) acc[i] = 0.0;
    const uint K4 = K & ~3u;
    for (uint k = 0u; k < K4; k += 4u) {
        vec4 av[TM];
        [[unroll]] for (uint i = 0u; i < TM; i++) av[i] = load_a4(m0 + i, k);
        if (B_NVEC) {
            // four rows k..k+3 of b, TN columns each as TN/4 vec4 loads along n
            [[unroll]] for (uint kk = 0u; kk < 4u; kk++) {
                vec4 bq[TN / 4u];
                [[unroll]] for (uint j4 = 0u; j4 < TN / 4u; j4++) {
                    uint n = n0 + 4u * j4;
                    int e = bbase + int(k + kk) * tb.nb[2] + int(n);
                    bq[j4] = n + 3u < N ? uintBitsToFloat(b4[uint(e) >> 2])
                                        : vec4(load_b(n, k + kk), load_b(n + 1u, k + kk), load_b(n + 2u, k + kk), load_b(n + 3u, k + kk));
                }
                [[unroll]] for (uint i = 0u; i < TM; i++) {
                    float ai = av[i][kk];
                    [[unroll]] for (uint j = 0u; j < TN; j++) acc[i * TN + j] = fma(ai, bq[j / 4u][j % 4u], acc[i * TN + j]);
                }
            }
        } else {
            [[unroll]] for (uint j = 0u; j < TN; j++) {
                vec4 bv = load_b4(n0 + j, k);
                [[unroll]] for (uint i = 0u; i < TM; i++) acc[i * TN + j] += dot(av[i], bv);
            }
        }
    }
    if (!K_QUADS) for (uint k = K4; k < K; k++) {  // K % 4 tail
        float at[TM];
        [[unroll]] for (uint i = 0u; i < TM; i++) at[i] = load_a(m0 + i, k);
        [[unroll]] for (uint j = 0u; j < TN; j++) {
            float bj = load_b(n0 + j, k);
            [[unroll]] for (uint i = 0u; i < TM; i++) acc[i * TN + j] = fma(at[i], bj, acc[i * TN + j]);
        }
    }

    // Store row by row from row 0 of the block, shifting the rows up after each: a loop
    // the compiler keeps rolled, so the store and the epilogue are emitted for TN outputs,
    // not TM x TN (on lavapipe that is most of this kernel's compile time; see prime.py).
    [[dont_unroll]] for (uint i = 0u; i < TM; i++) {
        uint m = m0 + i;
        if (m >= M) break;
        [[unroll]] for (uint j = 0u; j < TN; j++) {
            uint n = n0 + j;
            if (n < N) {
                float v = acc[j];
                uint oe;
                if (CONV) oe = offset_at(to, uvec4(0u, n / Lout, m, n % Lout));
                else oe = offset_at(to, uvec4(b0, b1, m, n));
                if (epi != 0u) EPILOGUE(epi, v, bias, tbias, res, tres, uvec4(b0, b1, m, n))
                STOREF(o, DT2, oe, v)
            }
        }
        [[unroll]] for (uint r = 0u; r + 1u < TM; r++) {
            [[unroll]] for (uint j = 0u; j < TN; j++) acc[r * TN + j] = acc[(r + 1u) * TN + j];
        }
    }
}
