#version 450
// Elementwise ops: binary (add sub mul div, NumPy broadcasting through stride-0 input
// descriptors laid out on the output's shape) and unary (scale relu gelu silu sigmoid
// tanh exp sqrt neg sqr, and 20 the fused leaky_relu: x * alpha + relu(x) * (1 - alpha), both factors
// as parameters). MODE selects the op; unary dispatches bind `a` twice.
// Operands laid out exactly like the output skip the index arithmetic (FLAT).
#define NT 3u
layout(local_size_x = 256) in;
layout(std430, set = 0, binding = 1) buffer BufA { uint a[]; };
layout(std430, set = 0, binding = 2) buffer BufB { uint b[]; };
layout(std430, set = 0, binding = 3) buffer BufO { uint o[]; };
#include "common.glsl"

// bit 0: a, bit 1: b is contiguous on the output's shape, so element e is at off + e
// (no index arithmetic; integer division is slow on GPUs and scalarized on CPU drivers)
layout(constant_id = 5) const uint FLAT = 0;

void main() {
    Tensor ta = tensor_desc(0u);
    Tensor tb = tensor_desc(1u);
    Tensor to = tensor_desc(2u);
    uint e = invocation_linear();
    if (e >= numel(to)) return;
    uvec4 c = (FLAT & 3u) == 3u ? uvec4(0u) : coords_of(e, to);
    float x = LOADF(a, DT0, (FLAT & 1u) != 0u ? ta.off + e : offset_at(ta, c));
    float y = MODE < 10u ? LOADF(b, DT1, (FLAT & 2u) != 0u ? tb.off + e : offset_at(tb, c)) : 0.0;
    bool params = MODE == 10u || MODE == 20u;
    float r = params ? eltwise_op(MODE, x, y, param_f(0u), param_f(1u)) : eltwise_op(MODE, x, y, 1.0, 0.0);
    STOREF(o, DT2, to.off + e, r)
}
