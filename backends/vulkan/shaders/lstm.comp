#version 450
// lstm: T steps of an LSTM recurrence in one dispatch, one workgroup per batch row b.
//   z_t = x[t, b, :] + W_hh h_{t-1}              (x: the input projection, [T, B, 4H])
//   i, f, o = sigmoid(z_i, z_f, z_o); g = tanh(z_g)  (gate blocks of W_hh rows: i, f, g, o)
//   c_t = f c_{t-1} + i g;  h_t = o tanh(c_t);   out[t, b, :] = (h_t, c_t)
// h_{t-1} lives in shared memory (every invocation reads all of it), c in shared memory too;
// each step is: gate pre-activations (read h), barrier, cell update (write h, c, out),
// barrier. The host never sees an intermediate step.
//
// MODE 1 (PRIVATE, the CPU-driver variant): invocation u owns hidden unit u (WG >= H) and
//   keeps its four W_hh rows in a private array, loaded once, and reads h four units per
//   shared load. (lavapipe, measured: every shared or buffer load runs once per lane, about
//   20 ns per 8 lanes; a vec4 load costs little more than a scalar one, and private arrays
//   are several times cheaper than either; 128 units: 65 -> 42 us per step.) Needs H <= HCAP.
// MODE 0 (the GPU variant): the 4H gate rows are spread over the subgroups; the lanes of a
//   subgroup split k (neighbouring lanes read neighbouring W_hh elements: coalesced) and
//   subgroupAdd combines them; pre-activations go through shared memory to the invocations
//   that own the units.
// Specialization: WG (5), HCAP (6, H rounded up: the shared arrays and PRIVATE rows).
// Sums run in k order per lane (PRIVATE) or lane-strided then subgroup-reduced (GPU); f32.
#define NT 5u
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_arithmetic : require
layout(local_size_x_id = 5) in;
layout(std430, set = 0, binding = 1) readonly buffer BufX { uint x[]; };
layout(std430, set = 0, binding = 2) readonly buffer BufW { uint w[]; };
layout(std430, set = 0, binding = 3) readonly buffer BufH { uint h0[]; };
layout(std430, set = 0, binding = 4) readonly buffer BufC { uint c0[]; };
layout(std430, set = 0, binding = 5) buffer BufO { uint o[]; };
#include "common.glsl"

layout(constant_id = 5) const uint WG = 128;
layout(constant_id = 6) const uint HCAP = 128;

const bool PRIVATE = (MODE & 1u) != 0u;
const uint UPL = (HCAP + WG - 1u) / WG;  // hidden units per invocation

shared vec4 hsh4[HCAP / 4u];  // h_{t-1}, as vec4: one shared load per 4 units
shared float csh[HCAP];
shared float zsh[PRIVATE ? 1u : 4u * HCAP];

void main() {
    Tensor tx = tensor_desc(0u);  // [1, T, B, 4H]
    Tensor tw = tensor_desc(1u);  // [1, 1, 4H, H]
    Tensor th = tensor_desc(2u);  // [1, 1, B, H]
    Tensor tc = tensor_desc(3u);  // [1, 1, B, H]
    Tensor to = tensor_desc(4u);  // [1, T, B, 2H], contiguous
    const uint lid = gl_LocalInvocationID.x;
    const uint b = gl_WorkGroupID.x;
    const uint T = tx.ne[1], H = tw.ne[3];
    const uint H4 = (H + 3u) & ~3u;  // h is read 4 at a time; units H..H4 stay 0
    for (uint u = lid; u < H4; u += WG) {
        hsh4[u >> 2][u & 3u] = u < H ? LOADF(h0, DT2, offset_at(th, uvec4(0u, 0u, b, u))) : 0.0;
        if (u < H) csh[u] = LOADF(c0, DT3, offset_at(tc, uvec4(0u, 0u, b, u)));
    }
    vec4 wr[PRIVATE ? HCAP : 1u];  // wr[k] = W_hh[(i, f, g, o) rows of unit lid, k], 0 for k >= H
    if (PRIVATE && lid < H) {
        for (uint k = 0u; k < H4; k++) {
            [[unroll]] for (uint g = 0u; g < 4u; g++)
                wr[k][g] = k < H ? LOADF(w, DT1, uint(int(tw.off) + int(g * H + lid) * tw.nb[2] + int(k) * tw.nb[3])) : 0.0;
        }
    }
    barrier();
    for (uint t = 0u; t < T; t++) {
        int xb = int(tx.off) + int(t) * tx.nb[1] + int(b) * tx.nb[2];
        vec4 z[UPL];
        if (PRIVATE) {
            if (lid < H) {
                vec4 acc = vec4(0.0);
                for (uint k = 0u; k < H4; k += 4u) {  // h 4 at a time: on a CPU driver every shared load is per lane
                    vec4 hv = hsh4[k >> 2];
                    acc += wr[k] * hv.x + wr[k + 1u] * hv.y + wr[k + 2u] * hv.z + wr[k + 3u] * hv.w;
                }
                z[0] = acc;
            }
        } else {
            // rows j of W_hh per subgroup, the subgroup's lanes splitting k
            for (uint j = gl_SubgroupID; j < 4u * H; j += gl_NumSubgroups) {
                int rb = int(tw.off) + int(j) * tw.nb[2];
                float acc = 0.0;
                for (uint k = gl_SubgroupInvocationID; k < H; k += gl_SubgroupSize)
                    acc += LOADF(w, DT1, uint(rb + int(k) * tw.nb[3])) * hsh4[k >> 2][k & 3u];
                acc = subgroupAdd(acc);
                if (subgroupElect()) zsh[j] = acc;
            }
        }
        barrier();  // every read of h_{t-1} is done; z is complete
        for (uint r = 0u; r < UPL; r++) {
            uint u = lid + r * WG;
            if (u >= H) break;
            vec4 zu = PRIVATE ? z[0] : vec4(zsh[u], zsh[H + u], zsh[2u * H + u], zsh[3u * H + u]);
            zu += vec4(LOADF(x, DT0, uint(xb + int(u) * tx.nb[3])), LOADF(x, DT0, uint(xb + int(H + u) * tx.nb[3])),
                       LOADF(x, DT0, uint(xb + int(2u * H + u) * tx.nb[3])), LOADF(x, DT0, uint(xb + int(3u * H + u) * tx.nb[3])));
            float c = sigmoid(zu.y) * csh[u] + sigmoid(zu.x) * tanh_acc(zu.z);
            float h = sigmoid(zu.w) * tanh_acc(c);
            csh[u] = c;
            hsh4[u >> 2][u & 3u] = h;
            uint ob = to.off + (t * to.ne[2] + b) * to.ne[3];
            STOREF(o, DT_F32, ob + u, h)
            STOREF(o, DT_F32, ob + H + u, c)
        }
        barrier();  // h_t complete before the next step reads it
    }
}
