#version 450
// Tiled matmul: out[b0,b1,m,n] = sum_k a[b0,b1,m,k] * b[b0,b1,k,n], in f32.
//
// A workgroup of WG invocations computes a BM x BN output tile. K advances BK at a time:
// the A and B tiles are staged in shared memory, k-major (As[k][m], Bs[k][n], padded by
// one float against bank conflicts), then each invocation accumulates a TM x TN register
// tile from them. Invocation (tr, tc) owns rows tr + i*(BM/TM) and columns tc + j*(BN/TN):
// neighbouring invocations read neighbouring shared words and store neighbouring outputs.
// Padding beyond M, N, K is zero, so every k step runs the full BK (the extra terms add
// exact zeros; sums stay in k order).
//
// Specialization constants: the dtypes (common.glsl), the tile (WG, BM, BN, BK, TM, TN,
// chosen on the host as a tuning variant) and MODE bits for the layout:
//   1  A_VEC: a is contiguous along k with 4-aligned row starts -> 4-element loads
//   2  B_VEC: b is contiguous along k (a transposed weight)      -> 4-element loads
//   8  IDS: mul_mat_id. The z grid is the expert e; a is w [1, E, N, K] (rows n are M here),
//             the columns are the (token, slot) pairs routed to e (ids [1, 1, T, k], binding 4,
//             clamped into range), found by one scan per workgroup in pair order; b is x
//             [1, T, k, K] and out [1, T, k, N]. Workgroups past the expert's pair count exit.
//   4  CONV:  b is the implicit im2col of conv1d's input x [1, B, Cin, Lin] (params:
//             kernel size, stride, padding, dilation); a is the weight [1, 1, Cout, Cin*KS];
//             n runs over (batch, output position) and out is [1, B, Cout, Lout].
// Anything else is a plain strided load, so batched, broadcast (stride 0) and transposed
// operands all work; batches are the z grid.
// EPI (constant 11, not with IDS or CONV): the fused `linear` node's epilogue (common.glsl),
// bias in binding 4 and residual in binding 5, applied in registers before the store.
#define NT 5u
layout(local_size_x_id = 5) in;
layout(std430, set = 0, binding = 1) readonly buffer BufA { uint a[]; };
layout(std430, set = 0, binding = 1) readonly buffer BufA2 { uvec2 a2[]; };
layout(std430, set = 0, binding = 1) readonly buffer BufA4 { uvec4 a4[]; };
layout(std430, set = 0, binding = 2) readonly buffer BufB { uint b[]; };
layout(std430, set = 0, binding = 2) readonly buffer BufB2 { uvec2 b2[]; };
layout(std430, set = 0, binding = 2) readonly buffer BufB4 { uvec4 b4[]; };
layout(std430, set = 0, binding = 3) buffer BufO { uint o[]; };
layout(std430, set = 0, binding = 4) readonly buffer BufI { uint ids[]; };  // IDS: ids; EPI bias: bias (else a)
layout(std430, set = 0, binding = 5) buffer BufR { uint res[]; };  // EPI residual (else a; may alias the output)
#include "common.glsl"

layout(constant_id = 5) const uint WG = 64;
layout(constant_id = 6) const uint BM = 32;
layout(constant_id = 7) const uint BN = 32;
layout(constant_id = 8) const uint BK = 16;
layout(constant_id = 9) const uint TM = 4;
layout(constant_id = 10) const uint TN = 4;
layout(constant_id = 11) const uint EPI = 0;

const bool A_VEC = (MODE & 1u) != 0u;
const bool B_VEC = (MODE & 2u) != 0u;
const bool CONV = (MODE & 4u) != 0u;
const bool IDS = (MODE & 8u) != 0u;
const uint SA = BM + 1u;  // shared row pitches
const uint SB = BN + 1u;

shared float As[BK * SA];
shared float Bs[BK * SB];
shared uint pair_id[IDS ? BN : 1u];  // IDS: the (token, slot) pairs of this tile's columns
shared uint pair_count;

// per-dispatch values, set once by main()
Tensor ta, tb, to, ti, tres;
uint M, K;
uint N;
uint lid;
uint z;
uint b0, b1;
int abase;
int bbase;
uint m0, n0;
uint KS;
int cstride, cpad, cdil;
uint Lout;
int Lin;
const uint CPT = (BN + WG - 1u) / WG;  // conv columns per invocation (WG < BN)
const uint KST = (WG + BN - 1u) / BN;  // conv k step per invocation (WG >= BN)
bool cok[CPT];
int cxb[CPT];
int cp0[CPT];
uint ck, cq, cci;

void setup() {
    ta = tensor_desc(0u);  // [B0, B1, M, K]
    tb = tensor_desc(1u);  // [B0, B1, K, N], or x [1, B, Cin, Lin] (CONV)
    to = tensor_desc(2u);  // [B0, B1, M, N], or [1, B, Cout, Lout] (CONV)
    ti = tensor_desc(3u);  // ids [1, 1, T, k] (IDS), or the bias on the output's coordinates (EPI)
    tres = tensor_desc(4u);  // the residual on the output's coordinates (EPI)
    M = ta.ne[2];
    K = ta.ne[3];
    N = CONV ? to.ne[1] * to.ne[3] : to.ne[3];
    lid = gl_LocalInvocationID.x;
    z = gl_WorkGroupID.z;
    b0 = (CONV || IDS) ? 0u : z / to.ne[1];
    b1 = CONV ? 0u : IDS ? z : z % to.ne[1];
    abase = int(ta.off) + int(b0) * ta.nb[0] + int(b1) * ta.nb[1];
    bbase = int(tb.off) + int(b0) * tb.nb[0] + int(b1) * tb.nb[1];
    m0 = gl_WorkGroupID.y * BM;
    n0 = gl_WorkGroupID.x * BN;
    // conv parameters (unused otherwise)
    KS = CONV ? param_u(0u) : 1u;
    cstride = CONV ? param_i(1u) : 1;
    cpad = CONV ? param_i(2u) : 0;
    cdil = CONV ? param_i(3u) : 1;
    Lout = to.ne[3];
    Lin = int(tb.ne[3]);

    // incremental im2col state of this invocation's columns (CONV, WG a multiple or divisor of BN)
    for (uint j = 0u; j < CPT; j++) {
        uint cn = n0 + lid % BN + j * WG;
        cok[j] = CONV && cn < N;
        cxb[j] = int(tb.off) + (cok[j] ? int(cn / Lout) * tb.nb[1] : 0);
        cp0[j] = cok[j] ? int(cn % Lout) * cstride - cpad : 0;
    }
    ck = lid / BN;
    cq = ck % KS;
    cci = ck / KS;
}

// element offset of column n (tile column c) of b at k = 0
int col_base(uint c, uint n) {
    if (IDS) { uint p = pair_id[c]; return int(tb.off) + int(p / to.ne[2]) * tb.nb[1] + int(p % to.ne[2]) * tb.nb[2]; }
    return bbase + int(n) * tb.nb[3];
}

// the K loop and the stores for the invocation at (tr, tc) of the RT x CT grid
void tile(const uint tr, const uint tc) {
    const uint CT = BN / TN, RT = BM / TM;
    if (IDS) {  // the pairs routed to expert z, in pair order; this tile's share in pair_id
        if (lid == 0u) {
            uint kk = to.ne[2], cnt = 0u;
            int E = int(ta.ne[1]);
            for (uint p = 0u; p < to.ne[1] * kk; p++) {
                if (uint(clamp(LOADI(ids, DT3, offset_at(ti, uvec4(0u, 0u, p / kk, p % kk))), 0, E - 1)) == z) {
                    if (cnt >= n0 && cnt < n0 + BN) pair_id[cnt - n0] = p;
                    cnt++;
                }
            }
            pair_count = cnt;
        }
        barrier();
        N = pair_count;
        if (n0 >= N) return;  // uniform: the whole workgroup leaves
    }
    float acc[TM * TN];
    [[unroll]] for (uint i = 0u; i < TM * TN; i++) acc[i] = 0.0;

    for (uint k0 = 0u; k0 < K; k0 += BK) {
        // ---- stage A: BM rows x BK k
        if (A_VEC) {
            const uint KV = BK / 4u;
            for (uint idx = lid; idx < BM * KV; idx += WG) {
                uint r = idx / KV, kv = idx % KV;
                uint m = m0 + r, k = k0 + 4u * kv;
                vec4 v = vec4(0.0);
                if (m < M && k < K) {
                    uint e = uint(abase + int(m) * ta.nb[2] + int(k));
                    if (DT0 == DT_F16) { uvec2 w = a2[e >> 2]; v = vec4(unpackHalf2x16(w.x), unpackHalf2x16(w.y)); }
                    else v = uintBitsToFloat(a4[e >> 2]);
                }
                uint s = 4u * kv * SA + r;
                As[s] = v.x; As[s + SA] = v.y; As[s + 2u * SA] = v.z; As[s + 3u * SA] = v.w;
            }
        } else {
            for (uint idx = lid; idx < BM * BK; idx += WG) {
                uint r = idx / BK, kk = idx % BK;
                uint m = m0 + r, k = k0 + kk;
                As[kk * SA + r] = (m < M && k < K) ? LOADF(a, DT0, uint(abase + int(m) * ta.nb[2] + int(k) * ta.nb[3])) : 0.0;
            }
        }
        // ---- stage B: BK k x BN columns
        if (B_VEC) {
            const uint KV = BK / 4u;
            for (uint idx = lid; idx < BN * KV; idx += WG) {
                uint c = idx / KV, kv = idx % KV;
                uint n = n0 + c, k = k0 + 4u * kv;
                vec4 v = vec4(0.0);
                if (n < N && k < K) {
                    uint e = uint(col_base(c, n) + int(k));
                    if (DT1 == DT_F16) { uvec2 w = b2[e >> 2]; v = vec4(unpackHalf2x16(w.x), unpackHalf2x16(w.y)); }
                    else v = uintBitsToFloat(b4[e >> 2]);
                }
                uint s = 4u * kv * SB + c;
                Bs[s] = v.x; Bs[s + SB] = v.y; Bs[s + 2u * SB] = v.z; Bs[s + 3u * SB] = v.w;
            }
        } else if (CONV && (WG % BN == 0u || BN % WG == 0u)) {
            // each invocation keeps CPT columns n (batch and position decoded once, in setup)
            // and walks k = (channel, tap) incrementally: no integer division per element
            for (uint kk = lid / BN; kk < BK; kk += KST) {
                bool kin = ck < K;
                [[unroll]] for (uint j = 0u; j < CPT; j++) {
                    float v = 0.0;
                    if (cok[j] && kin) {
                        int pos = cp0[j] + int(cq) * cdil;
                        if (pos >= 0 && pos < Lin) v = LOADF(b, DT1, uint(cxb[j] + int(cci) * tb.nb[2] + pos * tb.nb[3]));
                    }
                    Bs[kk * SB + lid % BN + j * WG] = v;
                }
                ck += KST; cq += KST;
                while (cq >= KS) { cq -= KS; cci++; }
            }
        } else if (CONV) {
            for (uint idx = lid; idx < BN * BK; idx += WG) {
                uint kk = idx / BN, c = idx % BN;  // neighbours along n: neighbouring x positions
                uint n = n0 + c, k = k0 + kk;
                float v = 0.0;
                if (n < N && k < K) {
                    uint ci = k / KS, q = k % KS, bb = n / Lout, l = n % Lout;
                    int pos = int(l) * cstride + int(q) * cdil - cpad;
                    if (pos >= 0 && pos < Lin) v = LOADF(b, DT1, offset_at(tb, uvec4(0u, bb, ci, uint(pos))));
                }
                Bs[kk * SB + c] = v;
            }
        } else {
            for (uint idx = lid; idx < BN * BK; idx += WG) {
                uint kk = idx / BN, c = idx % BN;
                uint n = n0 + c, k = k0 + kk;
                Bs[kk * SB + c] = (n < N && k < K) ? LOADF(b, DT1, uint(col_base(c, n) + int(k) * (IDS ? tb.nb[3] : tb.nb[2]))) : 0.0;
            }
        }
        barrier();
        // ---- TM x TN register tile
        [[unroll]] for (uint kk = 0u; kk < BK; kk++) {
            float av[TM], bv[TN];
            [[unroll]] for (uint i = 0u; i < TM; i++) av[i] = As[kk * SA + tr + i * RT];
            [[unroll]] for (uint j = 0u; j < TN; j++) bv[j] = Bs[kk * SB + tc + j * CT];
            [[unroll]] for (uint i = 0u; i < TM; i++) {
                [[unroll]] for (uint j = 0u; j < TN; j++) acc[i * TN + j] = fma(av[i], bv[j], acc[i * TN + j]);
            }
        }
        barrier();
    }

    [[unroll]] for (uint i = 0u; i < TM; i++) {
        uint m = m0 + tr + i * RT;
        if (m >= M) continue;
        [[unroll]] for (uint j = 0u; j < TN; j++) {
            uint n = n0 + tc + j * CT;
            if (n >= N) continue;
            uint oe;
            if (CONV) oe = offset_at(to, uvec4(0u, n / Lout, m, n % Lout));
            else if (IDS) { uint p = pair_id[n - n0]; oe = offset_at(to, uvec4(0u, p / to.ne[2], p % to.ne[2], m)); }
            else oe = offset_at(to, uvec4(b0, b1, m, n));
            float v = acc[i * TN + j];
            if (EPI != 0u) EPILOGUE(EPI, v, ids, ti, res, tres, uvec4(b0, b1, m, n))
            STOREF(o, DT2, oe, v)
        }
    }
}

void main() {
    setup();
    tile(gl_LocalInvocationID.x / (BN / TN), gl_LocalInvocationID.x % (BN / TN));
}
