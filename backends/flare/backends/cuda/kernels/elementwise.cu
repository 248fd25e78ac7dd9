// elementwise.cu: unary ops, scale, and broadcasting binary ops.
#include "common.cuh"

// op codes: keep in step with flare/backends/cuda/lowering.py (UNARY_CODES, BINARY_CODES)
enum { U_RELU = 0, U_GELU, U_SILU, U_SIGMOID, U_TANH, U_EXP, U_SQRT, U_NEG, U_SQR, U_SCALE, U_LEAKY_RELU };
enum { B_ADD = 0, B_SUB, B_MUL, B_DIV };

FLARE_DEVICE float flare_unary_op(int op, float x, float scale, float bias) {
    switch (op) {
        case U_RELU: return x > 0.0f ? x : 0.0f;
        case U_GELU: return flare_gelu(x);
        case U_SILU: return x / (1.0f + expf(-x));
        case U_SIGMOID: return flare_sigmoid(x);
        case U_TANH: return tanhf(x);
        case U_EXP: return expf(x);
        case U_SQRT: return sqrtf(x);
        case U_NEG: return -x;
        case U_SQR: return x * x;
        // the fused leaky_relu: scale = alpha, bias = 1 - alpha (the chain's two factors)
        case U_LEAKY_RELU: return x * scale + (x > 0.0f ? x : 0.0f) * bias;
        default: return x * scale + bias;  // U_SCALE
    }
}

// t0 = x (shape = out shape), t1 = out; i[0] = op; f[0] = scale, f[1] = bias
FLARE_KERNEL(flare_unary) {
    i64 e = flare_thread_index();
    if (e >= A.n) return;
    float x = flare_load(A.t[0], flare_linear(A.t[0], e));
    flare_store(A.t[1], A.t[1].offset + e, flare_unary_op((int)A.i[0], x, A.f[0], A.f[1]));
}

// t0 = a, t1 = b (both described with the out shape, stride 0 on broadcast axes),
// t2 = out; i[0] = op
FLARE_KERNEL(flare_binary) {
    i64 e = flare_thread_index();
    if (e >= A.n) return;
    i64 c[4];
    flare_unravel(A.t[2].shape, e, c);
    float a = flare_load(A.t[0], flare_at(A.t[0], c));
    float b = flare_load(A.t[1], flare_at(A.t[1], c));
    float r;
    switch ((int)A.i[0]) {
        case B_ADD: r = a + b; break;
        case B_SUB: r = a - b; break;
        case B_MUL: r = a * b; break;
        default: r = a / b; break;
    }
    flare_store(A.t[2], A.t[2].offset + e, r);
}
