// Workgroup-wide reductions for the row kernels (one workgroup per row): a subgroup
// operation first, then the per-subgroup results through shared memory, combined in
// subgroup order by every invocation (deterministic; one barrier pair, none at all when
// the workgroup is one subgroup, as with the CPU-driver default of WG = subgroup size).
// Requires subgroup arithmetic (kernels.supports checks the device). WG is the workgroup
// size, specialization constant 5 (a tuning variant); it bounds the subgroup count.
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_arithmetic : require

layout(constant_id = 5) const uint WG = 128;
shared float wg_f[WG];
shared uint wg_k[WG];
shared uint wg_i[WG];

// sum (is_max false) or maximum (true) over the workgroup; callers pass a constant, so
// the selects fold away after inlining
float wg_reduce_f(float v, const bool is_max) {
    v = is_max ? subgroupMax(v) : subgroupAdd(v);
    if (gl_NumSubgroups == 1u) return v;
    if (subgroupElect()) wg_f[gl_SubgroupID] = v;
    barrier();
    float s = wg_f[0];
    for (uint g = 1u; g < gl_NumSubgroups; g++) s = is_max ? max(s, wg_f[g]) : s + wg_f[g];
    barrier();
    return s;
}

float wg_sum(float v) { return wg_reduce_f(v, false); }
float wg_max(float v) { return wg_reduce_f(v, true); }

// Order keys: a uint that sorts like the float (-0 as +0, so equal floats tie), with every
// NaN mapped to `nan_key` (0xFFFFFFFF: NaN beats everything; 0: NaN loses to everything).
uint order_key(float v, uint nan_key) {
    if (isnan(v)) return nan_key;
    uint b = v == 0.0 ? 0u : floatBitsToUint(v);
    return (b & 0x80000000u) != 0u ? ~b : (b | 0x80000000u);
}

float key_value(uint key) {  // inverse of order_key for non-NaN keys
    return uintBitsToFloat((key & 0x80000000u) != 0u ? (key & 0x7FFFFFFFu) : ~key);
}

// The largest key and, among invocations holding it, the lowest index.
uvec2 wg_best(uint key, uint idx) {
    uint mk = subgroupMax(key);
    uint mi = subgroupMin(key == mk ? idx : 0xFFFFFFFFu);
    if (gl_NumSubgroups == 1u) return uvec2(mk, mi);
    if (subgroupElect()) { wg_k[gl_SubgroupID] = mk; wg_i[gl_SubgroupID] = mi; }
    barrier();
    uvec2 best = uvec2(wg_k[0], wg_i[0]);
    for (uint g = 1u; g < gl_NumSubgroups; g++) {
        if (wg_k[g] > best.x || (wg_k[g] == best.x && wg_i[g] < best.y)) best = uvec2(wg_k[g], wg_i[g]);
    }
    barrier();
    return best;
}
