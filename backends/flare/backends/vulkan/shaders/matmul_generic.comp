#version 450
// Fallback matmul (see matmul.comp for the tiled kernel), used only where the tiled kernel
// does not fit the device (shared memory or workgroup size limits).
// out[b0,b1,m,n] = sum_k a[b0,b1,m,k] * b[b0,b1,k,n]; a and b are strided descriptors
// (transpose_b and batch broadcasting are stride tricks done on the host), so the same
// kernel serves every layout. 16x16 output tiles, K in steps of 16 through shared memory;
// the sum runs in k order, in f32. EPI (constant 5): the fused `linear` node's epilogue
// (common.glsl), bias in binding 4 and residual in binding 5.
#define NT 5u
#define TILE 16u
layout(local_size_x = 16, local_size_y = 16) in;
layout(std430, set = 0, binding = 1) buffer BufA { uint a[]; };
layout(std430, set = 0, binding = 2) buffer BufB { uint b[]; };
layout(std430, set = 0, binding = 3) buffer BufO { uint o[]; };
layout(std430, set = 0, binding = 4) buffer BufBias { uint eb[]; };
layout(std430, set = 0, binding = 5) buffer BufR { uint res[]; };
#include "common.glsl"
layout(constant_id = 5) const uint EPI = 0;

shared float As[TILE][TILE];
shared float Bs[TILE][TILE];

void main() {
    Tensor ta = tensor_desc(0u);  // [B0, B1, M, K]
    Tensor tb = tensor_desc(1u);  // [B0, B1, K, N]
    Tensor to = tensor_desc(2u);  // [B0, B1, M, N]
    uint M = to.ne[2], N = to.ne[3], K = ta.ne[3];
    uint batch = gl_WorkGroupID.z;
    uint b0 = batch / to.ne[1], b1 = batch % to.ne[1];
    uint tx = gl_LocalInvocationID.x, ty = gl_LocalInvocationID.y;
    uint m = gl_WorkGroupID.y * TILE + ty;
    uint n = gl_WorkGroupID.x * TILE + tx;
    int abase = int(ta.off) + int(b0) * ta.nb[0] + int(b1) * ta.nb[1];
    int bbase = int(tb.off) + int(b0) * tb.nb[0] + int(b1) * tb.nb[1];
    float acc = 0.0;
    for (uint k0 = 0u; k0 < K; k0 += TILE) {
        uint ka = k0 + tx;   // column of A loaded by this invocation
        uint kb = k0 + ty;   // row of B loaded by this invocation
        As[ty][tx] = (m < M && ka < K) ? LOADF(a, DT0, uint(abase + int(m) * ta.nb[2] + int(ka) * ta.nb[3])) : 0.0;
        Bs[ty][tx] = (kb < K && n < N) ? LOADF(b, DT1, uint(bbase + int(kb) * tb.nb[2] + int(n) * tb.nb[3])) : 0.0;
        barrier();
        uint kend = min(TILE, K - k0);
        for (uint k = 0u; k < kend; k++) acc += As[ty][k] * Bs[k][tx];
        barrier();
    }
    if (m < M && n < N) {
        if (EPI != 0u) EPILOGUE(EPI, acc, eb, tensor_desc(3u), res, tensor_desc(4u), uvec4(b0, b1, m, n))
        STOREF(o, DT2, to.off + ((b0 * to.ne[1] + b1) * M + m) * N + n, acc)
    }
}
