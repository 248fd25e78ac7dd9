#version 450
// Elementwise ops: binary (add sub mul div, NumPy broadcasting through stride-0 input
// descriptors laid out on the output's shape) and unary (scale relu gelu silu sigmoid
// tanh exp sqrt neg sqr). MODE selects the op; unary dispatches bind `a` twice.
#define NT 3u
layout(local_size_x = 256) in;
layout(std430, set = 0, binding = 1) buffer BufA { uint a[]; };
layout(std430, set = 0, binding = 2) buffer BufB { uint b[]; };
layout(std430, set = 0, binding = 3) buffer BufO { uint o[]; };
#include "common.glsl"

void main() {
    Tensor ta = tensor_desc(0u);
    Tensor tb = tensor_desc(1u);
    Tensor to = tensor_desc(2u);
    uint e = invocation_linear();
    if (e >= numel(to)) return;
    uvec4 c = coords_of(e, to);
    float x = LOADF(a, DT0, offset_at(ta, c));
    float r;
    if (MODE < 10u) {
        float y = LOADF(b, DT1, offset_at(tb, c));
        if (MODE == 0u) r = x + y;
        else if (MODE == 1u) r = x - y;
        else if (MODE == 2u) r = x * y;
        else r = x / y;
    } else if (MODE == 10u) r = x * param_f(0u) + param_f(1u);
    else if (MODE == 11u) r = max(x, 0.0);
    else if (MODE == 12u) r = gelu_erf(x);
    else if (MODE == 13u) r = x * sigmoid(x);
    else if (MODE == 14u) r = sigmoid(x);
    else if (MODE == 15u) r = tanh_acc(x);
    else if (MODE == 16u) r = exp(x);
    else if (MODE == 17u) r = sqrt(x);
    else if (MODE == 18u) r = -x;
    else r = x * x;
    STOREF(o, DT2, to.off + e, r)
}
