// Shared by every Flare compute shader: the dispatch's metadata and tensor descriptors,
// dtype-aware loads and stores on raw uint buffers, and a few math helpers.
//
// Data buffers are declared as `uint d[]` and bound whole (offset 0); a tensor is a
// descriptor in the metadata buffer: element offset (in units of its dtype), shape[4]
// and element strides[4], right-aligned to rank 4 (leading dims 1, stride 0). Inputs
// may be strided views (stride 0 = broadcast); outputs are contiguous.
// Dtypes are specialization constants (DT_*), so the branches below fold away.

#extension GL_EXT_control_flow_attributes : enable

layout(push_constant) uniform PushConstants { uint meta_base; } pc;
layout(std430, set = 0, binding = 0) readonly buffer MetaBuffer { uint meta[]; };

layout(constant_id = 0) const uint MODE = 0;
layout(constant_id = 1) const uint DT0 = 0;
layout(constant_id = 2) const uint DT1 = 0;
layout(constant_id = 3) const uint DT2 = 0;
layout(constant_id = 4) const uint DT3 = 0;

#define DT_F32 0u
#define DT_F16 1u
#define DT_I32 2u
#define DT_I64 3u

struct Tensor { uint off; uint ne[4]; int nb[4]; };
#define DESC_WORDS 9u

Tensor tensor_desc(uint slot) {
    uint b = pc.meta_base + slot * DESC_WORDS;
    Tensor t;
    t.off = meta[b];
    [[unroll]] for (uint i = 0u; i < 4u; i++) { t.ne[i] = meta[b + 1u + i]; t.nb[i] = int(meta[b + 5u + i]); }
    return t;
}

// Parameters follow the NT tensor descriptors of this dispatch.
uint param_u(uint i) { return meta[pc.meta_base + NT * DESC_WORDS + i]; }
int param_i(uint i) { return int(param_u(i)); }
float param_f(uint i) { return uintBitsToFloat(param_u(i)); }

uvec4 coords_of(uint lin, Tensor t) {
    uvec4 c;
    c.w = lin % t.ne[3]; lin /= t.ne[3];
    c.z = lin % t.ne[2]; lin /= t.ne[2];
    c.y = lin % t.ne[1];
    c.x = lin / t.ne[1];
    return c;
}

uint offset_at(Tensor t, uvec4 c) {
    return uint(int(t.off) + int(c.x) * t.nb[0] + int(c.y) * t.nb[1] + int(c.z) * t.nb[2] + int(c.w) * t.nb[3]);
}

// element offset of the lin (row-major logical) index of t
uint offset_of(Tensor t, uint lin) { return offset_at(t, coords_of(lin, t)); }

uint numel(Tensor t) { return t.ne[0] * t.ne[1] * t.ne[2] * t.ne[3]; }

// linear workgroup id over a 2-D grid (grids wider than maxComputeWorkGroupCount[0] wrap into y)
uint group_linear() { return gl_WorkGroupID.y * gl_NumWorkGroups.x + gl_WorkGroupID.x; }
uint invocation_linear() { return group_linear() * gl_WorkGroupSize.x + gl_LocalInvocationID.x; }

// exact (one rounding) for values in i32 range; beyond it the two parts may round twice
float i64_to_float(uint lo, uint hi) {
    if (hi == ((int(lo) < 0) ? 0xFFFFFFFFu : 0u)) return float(int(lo));
    return float(int(hi)) * 4294967296.0 + float(lo);
}

// f32 -> i64 words, truncating toward zero; exact for every finite f32 in i64 range
uvec2 float_to_i64(float v) {
    float t = trunc(v);
    if (abs(t) < 2147483648.0) { int i = int(t); return uvec2(uint(i), i < 0 ? 0xFFFFFFFFu : 0u); }
    float hi = floor(t / 4294967296.0);
    float lo = t - hi * 4294967296.0;  // exact: see backends/vulkan/README.md
    return uvec2(uint(lo), uint(int(hi)));
}

// value loads (any dtype -> float), index loads (i32/i64 -> int)
#define LOADF(BUF, DT, e) ((DT) == DT_F32 ? uintBitsToFloat(BUF[e]) : \
    (DT) == DT_F16 ? unpackHalf2x16(BUF[(e) >> 1] >> (((e) & 1u) << 4)).x : \
    (DT) == DT_I32 ? float(int(BUF[e])) : i64_to_float(BUF[2u * (e)], BUF[2u * (e) + 1u]))
#define LOADI(BUF, DT, e) ((DT) == DT_I64 ? int(BUF[2u * (e)]) : (DT) == DT_I32 ? int(BUF[e]) : int(LOADF(BUF, DT, e)))

// a half is written with two atomics on its word, so neighbours written by other
// invocations (odd row lengths, odd offsets) are never clobbered
#define STORE_HALF_BITS(BUF, e, bits) { uint _sh = ((e) & 1u) << 4; \
    atomicAnd(BUF[(e) >> 1], ~(0xFFFFu << _sh)); atomicOr(BUF[(e) >> 1], ((bits) & 0xFFFFu) << _sh); }

#define STOREF(BUF, DT, e, v) { uint _e = (e); float _v = (v); \
    if ((DT) == DT_F32) { BUF[_e] = floatBitsToUint(_v); } \
    else if ((DT) == DT_F16) { STORE_HALF_BITS(BUF, _e, packHalf2x16(vec2(_v, 0.0))) } \
    else if ((DT) == DT_I32) { BUF[_e] = uint(int(_v)); } \
    else { uvec2 _w = float_to_i64(_v); BUF[2u * _e] = _w.x; BUF[2u * _e + 1u] = _w.y; } }

#define STOREI(BUF, DT, e, v) { uint _e = (e); int _v = (v); \
    if ((DT) == DT_I32) { BUF[_e] = uint(_v); } \
    else if ((DT) == DT_I64) { BUF[2u * _e] = uint(_v); BUF[2u * _e + 1u] = _v < 0 ? 0xFFFFFFFFu : 0u; } \
    else { STOREF(BUF, DT, _e, float(_v)) } }

// element copy between dtypes: bit-exact when they match, a value conversion otherwise
#define COPY_ELEM(DST, DDT, de, SRC, SDT, se) { uint _de = (de); uint _se = (se); \
    if ((DDT) == (SDT)) { \
        if ((SDT) == DT_F16) { STORE_HALF_BITS(DST, _de, SRC[_se >> 1] >> ((_se & 1u) << 4)) } \
        else if ((SDT) == DT_I64) { DST[2u * _de] = SRC[2u * _se]; DST[2u * _de + 1u] = SRC[2u * _se + 1u]; } \
        else { DST[_de] = SRC[_se]; } \
    } else if ((SDT) == DT_I64 && (DDT) == DT_I32) { DST[_de] = SRC[2u * _se]; } \
    else if ((SDT) == DT_I32 && (DDT) == DT_I64) { int _i = int(SRC[_se]); DST[2u * _de] = uint(_i); DST[2u * _de + 1u] = _i < 0 ? 0xFFFFFFFFu : 0u; } \
    else { STOREF(DST, DDT, _de, LOADF(SRC, SDT, _se)) } }

// erfc with relative error < 1.2e-7 everywhere (Numerical Recipes' erfcc), so gelu
// stays accurate in relative terms for negative inputs where 1 + erf(x) is tiny
float erfc_pos(float z) {  // z >= 0
    float t = 1.0 / (1.0 + 0.5 * z);
    return t * exp(-z * z - 1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 +
           t * (-0.18628806 + t * (0.27886807 + t * (-1.13520398 + t * (1.48851587 +
           t * (-0.82215223 + t * 0.17087277)))))))));
}

float gelu_erf(float x) {
    float z = abs(x) * 0.70710678118654752;
    float c = erfc_pos(z);
    return x >= 0.0 ? 0.5 * x * (2.0 - c) : 0.5 * x * c;
}

// tanh without the cancellation of (e^2x - 1)/(e^2x + 1) near 0 and without inf/inf for large x
float tanh_acc(float x) {
    float a = abs(x);
    float r;
    if (a < 0.3) {
        float x2 = a * a;
        r = a * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0 + x2 * (62.0 / 2835.0 +
            x2 * (-1382.0 / 155925.0 + x2 * (21844.0 / 6081075.0)))))));
    } else if (a < 15.0) {
        r = 1.0 - 2.0 / (exp(2.0 * a) + 1.0);
    } else {
        r = 1.0;
    }
    return x < 0.0 ? -r : r;
}

float sigmoid(float x) { return 1.0 / (1.0 + exp(-x)); }

// The elementwise op of eltwise.comp and eltwise_chain.comp: MODE < 10 binary (add sub mul
// div), 10 scale (x * scale + bias), 11.. unary (relu gelu silu sigmoid tanh exp sqrt neg sqr).
float eltwise_op(uint mode, float x, float y, float scale, float bias) {
    if (mode == 0u) return x + y;
    if (mode == 1u) return x - y;
    if (mode == 2u) return x * y;
    if (mode == 3u) return x / y;
    if (mode == 10u) return x * scale + bias;
    if (mode == 20u) return x * scale + max(x, 0.0) * bias;  // leaky_relu: scale alpha, bias 1 - alpha
    if (mode == 11u) return max(x, 0.0);
    if (mode == 12u) return gelu_erf(x);
    if (mode == 13u) return x * sigmoid(x);
    if (mode == 14u) return sigmoid(x);
    if (mode == 15u) return tanh_acc(x);
    if (mode == 16u) return exp(x);
    if (mode == 17u) return sqrt(x);
    if (mode == 18u) return -x;
    return x * x;
}

// linear's epilogue (the fused matmul node), applied to an output value v before its store:
// EPI bits 1 bias (+ bias), 2 residual (+ residual after the activation), act = EPI >> 2
// (0 none, 1 gelu, 2 relu, 3 sigmoid). Bias and residual are f32 descriptors laid out on the
// output's coordinates c (the bias with stride 0 on every axis but the last).
#define EPILOGUE(EPI, v, EB, tbias, ER, tres, c) { \
    if (((EPI) & 1u) != 0u) v += uintBitsToFloat(EB[offset_at(tbias, c)]); \
    if (((EPI) >> 2) == 1u) v = gelu_erf(v); \
    else if (((EPI) >> 2) == 2u) v = max(v, 0.0); \
    else if (((EPI) >> 2) == 3u) v = sigmoid(v); \
    if (((EPI) & 2u) != 0u) v += uintBitsToFloat(ER[offset_at(tres, c)]); }
