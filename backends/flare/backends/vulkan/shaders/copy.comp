#version 450
// Data movement, one output element per invocation:
//   MODE 0: strided copy / cast of src0 into a contiguous output (contiguous, cast, copy_into)
//   MODE 1: concat of src0 and src1 along axis param0 (right-aligned to rank 4)
//   MODE 2: pad of src0: params = before[4], mode (0 constant, 1 reflect), value
// Same dtypes copy bits exactly (i32/i64 values beyond 2^24 survive); different dtypes convert.
#define NT 3u
layout(local_size_x = 256) in;
layout(std430, set = 0, binding = 1) buffer BufS0 { uint s0[]; };
layout(std430, set = 0, binding = 2) buffer BufS1 { uint s1[]; };
layout(std430, set = 0, binding = 3) buffer BufO { uint o[]; };
#include "common.glsl"

int reflect_index(int i, int n) {
    if (n == 1) return 0;
    int period = 2 * (n - 1);
    int j = i % period;
    if (j < 0) j += period;
    return j >= n ? period - j : j;
}

void main() {
    Tensor t0 = tensor_desc(0u);
    Tensor t1 = tensor_desc(1u);
    Tensor to = tensor_desc(2u);
    uint e = invocation_linear();
    if (e >= numel(to)) return;
    uint de = to.off + e;
    if (MODE == 0u) {
        COPY_ELEM(o, DT2, de, s0, DT0, offset_of(t0, e))
    } else if (MODE == 1u) {
        uint axis = param_u(0u);
        uvec4 c = coords_of(e, to);
        uint split = t0.ne[axis];
        if (c[axis] < split) {
            COPY_ELEM(o, DT2, de, s0, DT0, offset_at(t0, c))
        } else {
            c[axis] -= split;
            COPY_ELEM(o, DT2, de, s1, DT1, offset_at(t1, c))
        }
    } else {
        uvec4 c = coords_of(e, to);
        bool reflect = param_u(4u) == 1u;
        bool inside = true;
        uvec4 src;
        [[unroll]] for (uint k = 0u; k < 4u; k++) {
            int i = int(c[k]) - param_i(k);
            int n = int(t0.ne[k]);
            if (i < 0 || i >= n) {
                if (reflect) i = reflect_index(i, n); else inside = false;
            }
            src[k] = uint(max(i, 0));
        }
        if (inside) {
            COPY_ELEM(o, DT2, de, s0, DT0, offset_at(t0, src))
        } else {
            STOREF(o, DT2, de, param_f(5u))
        }
    }
}
