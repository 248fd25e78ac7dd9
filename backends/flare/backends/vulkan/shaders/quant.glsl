// ggml's block-quantized weights read inside a shader (quant.glsl): the shader declares the
// blocks as a `uint qw[]` buffer before including this file, and specialization constant 9
// (QT) names the block type. Layouts are ggml's byte for byte (flare.core.dtypes.QUANT_TYPES):
//
//   QT  type  weights/block  bytes  layout
//   0   q4_0   32   18  d f16 | qs[16]: weight j<16 = lo nibble of qs[j], j>=16 = hi nibble of qs[j-16]; (q-8)*d
//   1   q4_1   32   20  d f16, m f16 | qs[16] as q4_0; q*d + m
//   2   q8_0   32   34  d f16 | qs[32] int8; q*d
//   3   q4_k  256  144  d, dmin f16 | scales[12] (eight 6-bit scale/min pairs) | qs[128]: 64 weights
//                       per 32 bytes, lo nibbles then hi nibbles; (d*sc)*q - (dmin*mn), 32 per scale
//   4   q6_k  256  210  ql[128] | qh[64] | scales[16] int8 | d f16: two halves of 128; 6-bit q =
//                       4 bits of ql + 2 of qh, minus 32; (d*sc)*q, 16 weights per scale
//
// Blocks of 18, 34 and 210 bytes are not 4-byte aligned, so nothing here assumes it: every
// field starts at an even byte (true of all five layouts), and a 32-bit read at an offset of
// 2 mod 4 joins the halves of two words (the second word is read only then, so the last
// block of a buffer never reads past it). No 8- or 16-bit storage feature is needed;
// halves go through unpackHalf2x16.
//
// A block is cut into sub-blocks of QSUB weights sharing one scale (and offset); a weight is
// `q * s.x + s.y` with q an integer (already recentred) and s = q_scale(block, sub-block).
// Dequantization is bit-exact against gguf.quants: the products and the sum are `precise`
// (no FMA contraction) and follow ggml's operation order (docs/ops.md): d1 = d*sc and
// m1 = dmin*mn are rounded first, then d1*q, then the offset is added (q4_1: +m; q4_k: -m1,
// which is the same bits as `d1*q - m1`).

layout(constant_id = 9) const uint QT = 0;
#define QT_Q4_0 0u
#define QT_Q4_1 1u
#define QT_Q8_0 2u
#define QT_Q4_K 3u
#define QT_Q6_K 4u

const bool Q_KQUANT = QT == QT_Q4_K || QT == QT_Q6_K;
const uint QK = Q_KQUANT ? 256u : 32u;                                       // weights per block
const uint QB = QT == QT_Q4_0 ? 18u : QT == QT_Q4_1 ? 20u : QT == QT_Q8_0 ? 34u : QT == QT_Q4_K ? 144u : 210u;
const uint QSUB = QT == QT_Q6_K ? 16u : 32u;                                 // weights per scale
const bool Q_HAS_MIN = QT == QT_Q4_1 || QT == QT_Q4_K;                       // an offset per sub-block

// A quantized tensor's descriptor gives its offset in bytes (any even byte: a planner's arena
// need not place it at a multiple of the block size) and its strides in blocks.
uint q_byte_at(Tensor t, uvec4 c) {
    return t.off + uint(int(c.x) * t.nb[0] + int(c.y) * t.nb[1] + int(c.z) * t.nb[2] + int(c.w) * t.nb[3]) * QB;
}

// 16 bits at an even byte offset
uint q_u16(uint byte) {
    uint w = qw[byte >> 2];
    return (byte & 2u) != 0u ? w >> 16 : w & 0xFFFFu;
}

float q_half(uint byte) { return unpackHalf2x16(q_u16(byte)).x; }

uint q_u8(uint byte) { return bitfieldExtract(qw[byte >> 2], int((byte & 3u) << 3), 8); }

// 32 bits (four bytes, little-endian) at an even byte offset
uint q_u32(uint byte) {
    uint w = qw[byte >> 2];
    if ((byte & 2u) != 0u) w = (w >> 16) | (qw[(byte >> 2) + 1u] << 16);
    return w;
}

uvec4 q_bytes(uint w) { return uvec4(w, w >> 8, w >> 16, w >> 24) & 0xFFu; }

// The scale (x) and offset (y) of sub-block s of the block at byte `bb`.
vec2 q_scale(uint bb, uint s) {
    if (QT == QT_Q4_0 || QT == QT_Q8_0) return vec2(q_half(bb), 0.0);
    if (QT == QT_Q4_1) return vec2(q_half(bb), q_half(bb + 2u));
    if (QT == QT_Q4_K) {  // ggml's get_scale_min_k4: six bits each, the top two of 4..7 spread
        uint sb = bb + 4u;
        uint sc, mn;
        if (s < 4u) {
            sc = q_u8(sb + s) & 63u;
            mn = q_u8(sb + s + 4u) & 63u;
        } else {
            uint lo = q_u8(sb + s + 4u);
            sc = (lo & 0xFu) | ((q_u8(sb + s - 4u) >> 6) << 4);
            mn = (lo >> 4) | ((q_u8(sb + s) >> 6) << 4);
        }
        precise float d1 = q_half(bb) * float(sc);
        precise float m1 = q_half(bb + 2u) * float(mn);
        return vec2(d1, -m1);
    }
    int sc = bitfieldExtract(int(q_u8(bb + 192u + s)), 0, 8);  // q6_k: int8 scale per 16
    precise float d1 = q_half(bb + 208u) * float(sc);
    return vec2(d1, 0.0);
}

// The integer values of the four weights p..p+3 (p a multiple of 4) of the block at byte `bb`.
ivec4 q_ints(uint bb, uint p) {
    if (QT == QT_Q4_0 || QT == QT_Q4_1) {
        uint w = q_u32(bb + (QT == QT_Q4_0 ? 2u : 4u) + (p & 15u)) >> ((p & 16u) >> 2);
        ivec4 q = ivec4(q_bytes(w) & 0xFu);
        return QT == QT_Q4_0 ? q - 8 : q;
    }
    if (QT == QT_Q8_0) {
        uint w = q_u32(bb + 2u + p);
        return ivec4(bitfieldExtract(int(w), 0, 8), bitfieldExtract(int(w), 8, 8),
                     bitfieldExtract(int(w), 16, 8), bitfieldExtract(int(w), 24, 8));
    }
    if (QT == QT_Q4_K) {
        uint w = q_u32(bb + 16u + 32u * (p >> 6) + (p & 31u)) >> ((p & 32u) >> 3);
        return ivec4(q_bytes(w) & 0xFu);
    }
    uint h = p >> 7, qq = (p >> 5) & 3u, l = p & 31u;  // q6_k: half, quarter of the half, lane
    uint lo = q_u32(bb + 64u * h + 32u * (qq & 1u) + l) >> (4u * (qq >> 1));
    uint hi = q_u32(bb + 128u + 32u * h + l) >> (2u * qq);
    return ivec4((q_bytes(lo) & 0xFu) | ((q_bytes(hi) & 3u) << 4)) - 32;
}

// -- the legacy types (q4_0, q4_1, q8_0) a whole block at a time --------------------------------
// Their scale and quant bytes fit in a few words, so a kernel that consumes a whole block reads
// it with ceil(((bb & 3) + QB) / 4) word loads (5, 5 or 6, 9) instead of a read per field and
// per four weights (about twice as many), then unpacks from registers.
const uint QNW = QT == QT_Q8_0 ? 8u : 4u;                 // words of quant bytes per block
const uint QWMAX = (QB + 5u) / 4u;                         // words covering a block at 2 mod 4

// The block at byte `bb`: its scale/offset and its quant bytes q[0 .. QNW-1] as aligned words.
void q_legacy(uint bb, out vec2 sc, out uint q[8]) {
    uint r[10];
    const uint nw = ((bb & 3u) + QB + 3u) >> 2;
    [[unroll]] for (uint i = 0u; i < 10u; i++) {
        r[i] = 0u;
        if (i < QWMAX && i < nw) r[i] = qw[(bb >> 2) + i];
    }
    const bool odd = (bb & 2u) != 0u;
    vec2 dm = unpackHalf2x16(odd ? (r[0] >> 16) | (r[1] << 16) : r[0]);  // d (and m for q4_1)
    sc = QT == QT_Q4_1 ? dm : vec2(dm.x, 0.0);
    [[unroll]] for (uint i = 0u; i < 8u; i++) {  // quant bytes start at byte 4 (q4_1) or 2
        if (QT == QT_Q4_1) q[i] = odd ? (r[1u + i] >> 16) | (r[2u + i] << 16) : r[1u + i];
        else q[i] = odd ? r[1u + i] : (r[i] >> 16) | (r[i + 1u] << 16);
    }
}

// Which of q_legacy's words holds weights 4g..4g+3 (q4: the low nibbles for g < 4, else the high).
uint q_legacy_word(uint g) { return QT == QT_Q8_0 ? g : g & 3u; }

// The integer weights 4g..4g+3 from that word.
ivec4 q_legacy_quad(uint w, uint g) {
    if (QT == QT_Q8_0) {
        return ivec4(bitfieldExtract(int(w), 0, 8), bitfieldExtract(int(w), 8, 8),
                     bitfieldExtract(int(w), 16, 8), bitfieldExtract(int(w), 24, 8));
    }
    ivec4 v = ivec4(q_bytes(g < 4u ? w : w >> 4) & 0xFu);
    return QT == QT_Q4_0 ? v - 8 : v;
}

// Four weights dequantized exactly as ggml does (see the header).
vec4 q_dequant4(ivec4 q, vec2 s) {
    precise vec4 v = vec4(q) * s.x;
    if (Q_HAS_MIN) v = v + s.y;
    return v;
}

// Four weights for a product (rounding may differ from q_dequant4: contraction is allowed).
vec4 q_weights4(ivec4 q, vec2 s) {
    return Q_HAS_MIN ? vec4(q) * s.x + s.y : vec4(q) * s.x;
}
