#version 450
// Block-quantized weights -> f32, bit-exact against gguf.quants (quant.glsl):
//   MODE 0  dequantize: out[..., r, :] = dequant(w[..., r, :])      (w [.., R, nb] blocks, any rank <= 4)
//   MODE 1  get_rows:   out[i..., :] = dequant(table[idx[i...], :])  (table [1, 1, R, nb]; idx i32/i64, any
//           shape; negative indices count from the end as in NumPy, out-of-range ones are clamped)
// One invocation per four output weights (every block size is a multiple of 4), so a
// block's scale is read once per four weights; outputs are f32 and contiguous.
#define NT 3u
layout(local_size_x = 256) in;
layout(std430, set = 0, binding = 1) readonly buffer BufW { uint qw[]; };
layout(std430, set = 0, binding = 2) readonly buffer BufI { uint ids[]; };
layout(std430, set = 0, binding = 3) buffer BufO { uvec4 o4[]; };
layout(std430, set = 0, binding = 3) buffer BufO1 { uint o[]; };
#include "common.glsl"
#include "quant.glsl"

void main() {
    Tensor tw = tensor_desc(0u);
    Tensor ti = tensor_desc(1u);
    Tensor to = tensor_desc(2u);
    uint e = 4u * invocation_linear();  // first of this invocation's four output weights
    if (e >= numel(to)) return;
    uint D = to.ne[3];                  // weights per output row = blocks per row * QK
    uint row = e / D, k = e % D;
    uint bb;  // byte of the block
    if (MODE == 0u) {
        bb = q_byte_at(tw, coords_of(row * tw.ne[3] + k / QK, tw));
    } else {
        int R = int(tw.ne[2]);
        int r = LOADI(ids, DT1, offset_of(ti, row));
        if (r < 0) r += R;
        r = clamp(r, 0, R - 1);
        bb = q_byte_at(tw, uvec4(0u, 0u, uint(r), k / QK));
    }
    uint p = k % QK;
    vec4 v = q_dequant4(q_ints(bb, p), q_scale(bb, p / QSUB));
    uint at = to.off + e;
    if ((at & 3u) == 0u) {
        o4[at >> 2] = floatBitsToUint(v);
    } else {
        [[unroll]] for (uint c = 0u; c < 4u; c++) o[at + c] = floatBitsToUint(v[c]);
    }
}
