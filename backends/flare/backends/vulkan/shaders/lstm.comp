#version 450
// lstm: T steps of an LSTM recurrence in one dispatch, one workgroup per batch row b.
//   z_t = x[t, b, :] + W_hh h_{t-1}              (x: the input projection, [T, B, 4H])
//   i, f, o = sigmoid(z_i, z_f, z_o); g = tanh(z_g)  (gate blocks of W_hh rows: i, f, g, o)
//   c_t = f c_{t-1} + i g;  h_t = o tanh(c_t);   out[t, b, :] = (h_t, c_t)
// h lives in shared memory, double-buffered (step t reads one half and writes the other), so
// each step needs one barrier; c lives in shared memory, each unit touched by one owner.
// The host never sees an intermediate step.
//
// MODE 1 (PRIVATE, the CPU-driver variant): invocation u owns hidden unit u (WG >= H) and
//   keeps its four W_hh rows in a private array, loaded once, and reads h four units per
//   shared load. (lavapipe, measured: every shared or buffer load runs once per lane, about
//   20 ns per 8 lanes; a vec4 load costs little more than a scalar one, and private arrays
//   are several times cheaper than either; 128 units: 65 -> 42 us per step.) Needs H <= HCAP.
// MODE 0 (the GPU variant): a subgroup owns a hidden unit at a time and computes its four gate
//   rows together, the lanes splitting k (neighbouring lanes read neighbouring W_hh elements:
//   coalesced; each h[k] read once for the four rows), four subgroupAdds, then one lane
//   updates the cell; gate values never go through shared memory.
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
const uint HV = HCAP / 4u;  // vec4s per half of the h buffer

shared vec4 hbuf[2u * HV];  // h_{t-1} and h_t, as vec4: one shared load per 4 units (PRIVATE)
shared float csh[HCAP];

Tensor tx, to;
uint H;

// the cell update of unit u at step t from its gate pre-activations z (x not yet added)
void cell(uint t, uint b, uint u, vec4 z, uint dst) {
    int xb = int(tx.off) + int(t) * tx.nb[1] + int(b) * tx.nb[2];
    z += vec4(LOADF(x, DT0, uint(xb + int(u) * tx.nb[3])), LOADF(x, DT0, uint(xb + int(H + u) * tx.nb[3])),
              LOADF(x, DT0, uint(xb + int(2u * H + u) * tx.nb[3])), LOADF(x, DT0, uint(xb + int(3u * H + u) * tx.nb[3])));
    float c = sigmoid(z.y) * csh[u] + sigmoid(z.x) * tanh_acc(z.z);
    float h = sigmoid(z.w) * tanh_acc(c);
    csh[u] = c;
    hbuf[dst + (u >> 2)][u & 3u] = h;
    uint ob = to.off + (t * to.ne[2] + b) * to.ne[3];
    STOREF(o, DT_F32, ob + u, h)
    STOREF(o, DT_F32, ob + H + u, c)
}

void main() {
    tx = tensor_desc(0u);         // [1, T, B, 4H]
    Tensor tw = tensor_desc(1u);  // [1, 1, 4H, H]
    Tensor th = tensor_desc(2u);  // [1, 1, B, H]
    Tensor tc = tensor_desc(3u);  // [1, 1, B, H]
    to = tensor_desc(4u);         // [1, T, B, 2H], contiguous
    const uint lid = gl_LocalInvocationID.x;
    const uint b = gl_WorkGroupID.x;
    const uint T = tx.ne[1];
    H = tw.ne[3];
    const uint H4 = (H + 3u) & ~3u;  // h is read 4 at a time; units H..H4 stay 0 in both halves
    for (uint u = lid; u < H4; u += WG) {
        hbuf[u >> 2][u & 3u] = u < H ? LOADF(h0, DT2, offset_at(th, uvec4(0u, 0u, b, u))) : 0.0;
        hbuf[HV + (u >> 2)][u & 3u] = 0.0;
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
        const uint src = (t & 1u) * HV, dst = HV - src;
        if (PRIVATE) {
            if (lid < H) {
                vec4 acc = vec4(0.0);
                for (uint k = 0u; k < H4; k += 4u) {  // h 4 at a time: on a CPU driver every shared load is per lane
                    vec4 hv = hbuf[src + (k >> 2)];
                    acc += wr[k] * hv.x + wr[k + 1u] * hv.y + wr[k + 2u] * hv.z + wr[k + 3u] * hv.w;
                }
                cell(t, b, lid, acc, dst);
            }
        } else {
            for (uint u = gl_SubgroupID; u < H; u += gl_NumSubgroups) {
                vec4 acc = vec4(0.0);
                for (uint k = gl_SubgroupInvocationID; k < H; k += gl_SubgroupSize) {
                    float hk = hbuf[src + (k >> 2)][k & 3u];
                    int e = int(tw.off) + int(u) * tw.nb[2] + int(k) * tw.nb[3];
                    int gs = int(H) * tw.nb[2];  // from one gate block to the next
                    acc += vec4(LOADF(w, DT1, uint(e)), LOADF(w, DT1, uint(e + gs)), LOADF(w, DT1, uint(e + 2 * gs)),
                                LOADF(w, DT1, uint(e + 3 * gs))) * hk;
                }
                acc = vec4(subgroupAdd(acc.x), subgroupAdd(acc.y), subgroupAdd(acc.z), subgroupAdd(acc.w));
                if (subgroupElect()) cell(t, b, u, acc, dst);
            }
        }
        barrier();  // h_t complete before step t + 1 reads it (and h_{t-1} free to be overwritten)
    }
}
