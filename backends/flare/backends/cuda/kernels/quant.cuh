// quant.cuh: ggml's block-quantized weights (q4_0, q4_1, q8_0, q4_k, q6_k), unpacked on the device.
//
// A quantized tensor's element is one block (flare.core.dtypes.QUANT_TYPES): its descriptor's
// offset, shape and strides count blocks, and a block of type QT lives at
// ptr + element * QBLOCK_BYTES. The layouts are ggml's, byte for byte (ggml-common.h):
//   q4_0  18 B / 32:  d f16, qs[16]           w = d * (q - 8)
//   q4_1  20 B / 32:  d f16, m f16, qs[16]    w = d * q + m
//   q8_0  34 B / 32:  d f16, qs[32] (int8)    w = q * d
//   q4_k 144 B / 256: d, dmin f16, scales[12] (eight 6-bit scales and mins), qs[128]
//                                             w = (d * sc) * q - (dmin * mn)
//   q6_k 210 B / 256: ql[128], qh[64], scales[16] (int8, one per 16), d f16
//                                             w = (d * sc) * (q - 32)
// Every block size is even, so the f16 fields are 2-byte aligned; everything else is read
// as bytes (a block's start is only 2-byte aligned).
//
// Dequantization is bit-exact with ggml (and gguf.quants, the reference): the products and
// sums are rounded one at a time (__fmul_rn/__fadd_rn/__fsub_rn), so nvcc/NVRTC cannot
// contract them into an FMA, whose single rounding would give other bits.
#pragma once
#include "common.cuh"

enum { DT_Q4_0 = 4, DT_Q4_1 = 5, DT_Q8_0 = 6, DT_Q4_K = 7, DT_Q6_K = 8 };  // args.DTYPE_CODES

template <int QT> struct QBlock;
template <> struct QBlock<DT_Q4_0> { enum { SIZE = 32, BYTES = 18 }; };
template <> struct QBlock<DT_Q4_1> { enum { SIZE = 32, BYTES = 20 }; };
template <> struct QBlock<DT_Q8_0> { enum { SIZE = 32, BYTES = 34 }; };
template <> struct QBlock<DT_Q4_K> { enum { SIZE = 256, BYTES = 144 }; };
template <> struct QBlock<DT_Q6_K> { enum { SIZE = 256, BYTES = 210 }; };

FLARE_DEVICE float flare_qh2f(const unsigned char* p) { return flare_h2f(*(const unsigned short*)p); }

// q4_k's j-th (0..7) 6-bit scale and min (ggml's get_scale_min_k4)
FLARE_DEVICE void flare_q4k_scale_min(const unsigned char* s, int j, int* sc, int* mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

// NW consecutive weights j0 .. j0+NW-1 (NW in 4, 8, 16; j0 a multiple of NW) of sub-block `sub`
// (< SIZE / 32) of a block, bit-exact: a range within one half of the sub-block, so for the
// 4-bit types one nibble (low or high) of consecutive bytes, and for q6_k one scale.
template <int QT, int NW>
FLARE_DEVICE void flare_dqn(const unsigned char* blk, int sub, int j0, float* w) {
    static_assert(NW == 4 || NW == 8 || NW == 16, "a range within one half of a sub-block");
    if (QT == DT_Q4_0 || QT == DT_Q4_1) {
        const float d = flare_qh2f(blk);
        const unsigned char* qs = blk + (QT == DT_Q4_0 ? 2 : 4) + (j0 & 15);
        const int shift = j0 >= 16 ? 4 : 0;  // weights 0..15: low nibbles, 16..31: high
        if (QT == DT_Q4_0) {
            for (int i = 0; i < NW; ++i) w[i] = __fmul_rn(d, (float)((int)((qs[i] >> shift) & 0x0F) - 8));
        } else {
            const float m = flare_qh2f(blk + 2);
            for (int i = 0; i < NW; ++i) w[i] = __fadd_rn(__fmul_rn(d, (float)((qs[i] >> shift) & 0x0F)), m);
        }
    } else if (QT == DT_Q8_0) {
        const float d = flare_qh2f(blk);
        const signed char* qs = (const signed char*)(blk + 2) + j0;
        for (int i = 0; i < NW; ++i) w[i] = __fmul_rn((float)qs[i], d);
    } else if (QT == DT_Q4_K) {
        int sc, mn;
        flare_q4k_scale_min(blk + 4, sub, &sc, &mn);
        const float d = __fmul_rn(flare_qh2f(blk), (float)sc);
        const float m = __fmul_rn(flare_qh2f(blk + 2), (float)mn);
        const unsigned char* qs = blk + 16 + (sub >> 1) * 32 + j0;  // 32 bytes: sub-blocks 2c (low), 2c+1 (high)
        const int shift = (sub & 1) * 4;
        for (int i = 0; i < NW; ++i) w[i] = __fsub_rn(__fmul_rn(d, (float)((qs[i] >> shift) & 0x0F)), m);
    } else {  // DT_Q6_K: halves of 128 weights, groups of 32 within a half, a scale per 16
        const int h = sub >> 2, g = sub & 3;
        const unsigned char* ql = blk + h * 64 + (g & 1) * 32 + j0;
        const unsigned char* qh = blk + 128 + h * 32 + j0;
        const float ds = __fmul_rn(flare_qh2f(blk + 208), (float)((const signed char*)blk)[192 + sub * 2 + (j0 >> 4)]);
        const int shift = (g >> 1) * 4;
        for (int i = 0; i < NW; ++i) {
            const int q = (((ql[i] >> shift) & 0x0F) | (((qh[i] >> (2 * g)) & 3) << 4)) - 32;
            w[i] = __fmul_rn(ds, (float)q);
        }
    }
}

// The 32 weights of sub-block `sub` (a whole legacy block, an eighth of a super-block).
template <int QT>
FLARE_DEVICE void flare_dq32(const unsigned char* blk, int sub, float* w) {
    flare_dqn<QT, 16>(blk, sub, 0, w);
    flare_dqn<QT, 16>(blk, sub, 16, w + 16);
}

// One weight j (0 .. SIZE-1) of a block, bit-exact (the element-wise kernels: dequantize,
// get_rows); `qt` at run time.
FLARE_DEVICE float flare_dq1(int qt, const unsigned char* blk, int j) {
    switch (qt) {
        case DT_Q4_0: {
            const int q = j < 16 ? (blk[2 + j] & 0x0F) : (blk[2 + j - 16] >> 4);
            return __fmul_rn(flare_qh2f(blk), (float)(q - 8));
        }
        case DT_Q4_1: {
            const int q = j < 16 ? (blk[4 + j] & 0x0F) : (blk[4 + j - 16] >> 4);
            return __fadd_rn(__fmul_rn(flare_qh2f(blk), (float)q), flare_qh2f(blk + 2));
        }
        case DT_Q8_0:
            return __fmul_rn((float)((const signed char*)blk)[2 + j], flare_qh2f(blk));
        case DT_Q4_K: {
            const int sub = j >> 5, l = j & 31;
            int sc, mn;
            flare_q4k_scale_min(blk + 4, sub, &sc, &mn);
            const int q = (blk[16 + (sub >> 1) * 32 + l] >> ((sub & 1) * 4)) & 0x0F;
            return __fsub_rn(__fmul_rn(__fmul_rn(flare_qh2f(blk), (float)sc), (float)q),
                             __fmul_rn(flare_qh2f(blk + 2), (float)mn));
        }
        default: {  // DT_Q6_K
            const int h = j >> 7, r = j & 127, g = r >> 5, l = r & 31;
            const int lo = (blk[h * 64 + (g & 1) * 32 + l] >> ((g >> 1) * 4)) & 0x0F;
            const int hi = (blk[128 + h * 32 + l] >> (2 * g)) & 3;
            const float ds = __fmul_rn(flare_qh2f(blk + 208), (float)((const signed char*)blk)[192 + (j >> 4)]);
            return __fmul_rn(ds, (float)((lo | (hi << 4)) - 32));
        }
    }
}

// (block size, block bytes) of a run-time dtype code
FLARE_DEVICE int flare_qblock_size(int qt) { return qt == DT_Q4_K || qt == DT_Q6_K ? 256 : 32; }
FLARE_DEVICE int flare_qblock_bytes(int qt) {
    switch (qt) {
        case DT_Q4_0: return 18;
        case DT_Q4_1: return 20;
        case DT_Q8_0: return 34;
        case DT_Q4_K: return 144;
        default: return 210;
    }
}

// ---- integer dot products with 8-bit activations (matmul_q.cu's q8 matrix-vector kernels) ----

// 4 bytes at a 2-byte aligned address (a block's fields are only 2-byte aligned: 18, 34 and
// 210 bytes per block), as two 16-bit loads
FLARE_DEVICE int flare_ld32(const unsigned char* p) {
    const unsigned short* h = (const unsigned short*)p;
    return (int)((unsigned)h[0] | ((unsigned)h[1] << 16));
}

// sum over sub-block `sub` (32 weights) of w_l * x_l, where the activations are x_l = d8 * q8_l
// (q8: 8 words of 4 int8 values, in order; sum8 = sum of the q8_l): the weights' integer
// quants times q8 by __dp4a (4 products and a sum per instruction), then their scales — ggml's
// vec_dot_*_q8_1, the zero points (q4_0's 8, q6_k's 32) and mins taken out through sum8.
template <int QT>
FLARE_DEVICE float flare_dot_q8(const unsigned char* blk, int sub, const int* q8, float d8, int sum8) {
    if (QT == DT_Q4_0 || QT == DT_Q4_1) {
        const unsigned char* qs = blk + (QT == DT_Q4_0 ? 2 : 4);
        int s = 0;
        for (int i = 0; i < 4; ++i) {  // byte l holds weight l (low nibble) and l + 16 (high)
            const unsigned v = (unsigned)flare_ld32(qs + 4 * i);
            s = __dp4a((int)(v & 0x0F0F0F0Fu), q8[i], s);
            s = __dp4a((int)((v >> 4) & 0x0F0F0F0Fu), q8[i + 4], s);
        }
        const float dd = flare_qh2f(blk) * d8;
        if (QT == DT_Q4_0) return dd * (float)(s - 8 * sum8);
        return dd * (float)s + flare_qh2f(blk + 2) * d8 * (float)sum8;
    } else if (QT == DT_Q8_0) {
        int s = 0;
        for (int i = 0; i < 8; ++i) s = __dp4a(flare_ld32(blk + 2 + 4 * i), q8[i], s);
        return flare_qh2f(blk) * d8 * (float)s;
    } else if (QT == DT_Q4_K) {
        const unsigned char* qs = blk + 16 + (sub >> 1) * 32;
        const int shift = (sub & 1) * 4;
        int s = 0;
        for (int i = 0; i < 8; ++i)
            s = __dp4a((int)(((unsigned)flare_ld32(qs + 4 * i) >> shift) & 0x0F0F0F0Fu), q8[i], s);
        int sc, mn;
        flare_q4k_scale_min(blk + 4, sub, &sc, &mn);
        return flare_qh2f(blk) * (float)sc * d8 * (float)s - flare_qh2f(blk + 2) * (float)mn * d8 * (float)sum8;
    } else {  // DT_Q6_K: 6-bit quants 0..63 (zero point 32), a scale per 16 weights
        const int h = sub >> 2, g = sub & 3;
        const unsigned char* ql = blk + h * 64 + (g & 1) * 32;
        const unsigned char* qh = blk + 128 + h * 32;
        const signed char* scales = (const signed char*)(blk + 192) + sub * 2;
        const int shift = (g >> 1) * 4;
        int acc = 0;
        for (int half = 0; half < 2; ++half) {
            int s = 0, sq = 0;
            for (int i = half * 4; i < half * 4 + 4; ++i) {
                const unsigned lo = ((unsigned)flare_ld32(ql + 4 * i) >> shift) & 0x0F0F0F0Fu;
                const unsigned hi = (((unsigned)flare_ld32(qh + 4 * i) >> (2 * g)) & 0x03030303u) << 4;
                s = __dp4a((int)(lo | hi), q8[i], s);
                sq = __dp4a(0x01010101, q8[i], sq);
            }
            acc += (int)scales[half] * (s - 32 * sq);
        }
        return flare_qh2f(blk + 208) * d8 * (float)acc;
    }
}
