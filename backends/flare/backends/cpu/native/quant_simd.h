/* The SIMD dot products of quant.c, included once per instruction set with
 *   QSFX       the suffix of the function names (avx2, vnni)
 *   QTARGET    the GCC target of the functions
 *   DOT_U8S8(acc, u, s)  acc (8 x int32) += the dot products of 4-byte groups of the
 *                        unsigned bytes u and the signed bytes s (32 of each)
 *   DOT_S16(acc, a, b)   acc (8 x int32) += the dot products of pairs of the signed 16-bit
 *                        values a and b (16 of each)
 * so the two variants are the same code around one instruction. Not a header to include
 * elsewhere. Each function computes one weight row against one activation row (quant.h). */
#define QCAT2(a, b) a##_##b
#define QCAT(a, b) QCAT2(a, b)
#define QFN(name) QCAT(name, QSFX)
#define QATTR __attribute__((target(QTARGET))) static

QATTR float QFN(hsum)(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 16 bytes of packed nibbles -> 32 16-bit weights in two halves: the low nibbles (weights
 * 0..15), then the high ones (16..31), ggml's order */
QATTR void QFN(nibbles16)(const uint8_t *p, __m256i *lo, __m256i *hi) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)p), m4 = _mm_set1_epi8(0x0F);
    *lo = _mm256_cvtepu8_epi16(_mm_and_si128(raw, m4));
    *hi = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), m4));
}

/* the 32 products of one block's 16-bit weights (lo, hi) with its 16-bit activations, summed
 * in 8 int32 lanes (exact: |w| <= 128, |x| <= 32767, 4 products a lane) */
QATTR __m256i QFN(block16)(__m256i lo, __m256i hi, const int16_t *x) {
    const __m256i p = DOT_S16(_mm256_setzero_si256(), lo, _mm256_loadu_si256((const __m256i *)x));
    return DOT_S16(p, hi, _mm256_loadu_si256((const __m256i *)(x + 16)));
}

QATTR float QFN(dot_q4_0)(const void *vw, const void *vx, int64_t k) {
    const blk_q4_0 *w = (const blk_q4_0 *)vw; const act32 *x = (const act32 *)vx;
    const __m256i eight = _mm256_set1_epi16(8);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < k / QK; ++i) {
        __m256i lo, hi;
        QFN(nibbles16)(w[i].qs, &lo, &hi);
        const __m256i p = QFN(block16)(_mm256_sub_epi16(lo, eight), _mm256_sub_epi16(hi, eight), x[i].qs);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(_cvtsh_ss(w[i].d) * x[i].d), acc);
    }
    return QFN(hsum)(acc);
}

QATTR float QFN(dot_q4_1)(const void *vw, const void *vx, int64_t k) {
    const blk_q4_1 *w = (const blk_q4_1 *)vw; const act32 *x = (const act32 *)vx;
    __m256 acc = _mm256_setzero_ps();
    float corr = 0.0f;
    for (int64_t i = 0; i < k / QK; ++i) {
        __m256i lo, hi;
        QFN(nibbles16)(w[i].qs, &lo, &hi);
        const __m256i p = QFN(block16)(lo, hi, x[i].qs);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(_cvtsh_ss(w[i].d) * x[i].d), acc);
        corr += _cvtsh_ss(w[i].m) * x[i].dsum;
    }
    return QFN(hsum)(acc) + corr;
}

QATTR float QFN(dot_q8_0)(const void *vw, const void *vx, int64_t k) {
    const blk_q8_0 *w = (const blk_q8_0 *)vw; const act32 *x = (const act32 *)vx;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < k / QK; ++i) {
        const __m256i lo = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)w[i].qs));
        const __m256i hi = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w[i].qs + 16)));
        const __m256i p = QFN(block16)(lo, hi, x[i].qs);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(_cvtsh_ss(w[i].d) * x[i].d), acc);
    }
    return QFN(hsum)(acc);
}

/* The same three products against four activation rows at once (xrb bytes apart), for
 * prefill: each weight block is unpacked once for the four. Per row the arithmetic is that of
 * the one-row functions above, in the same order, so the results are the same bits. */
#define QDOT4_BODY(UNPACK, SCALE, CORR)                                                         \
    const act32 *x[4];                                                                          \
    for (int j = 0; j < 4; ++j) x[j] = (const act32 *)(xb + j * xrb);                           \
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()}; \
    float corr[4] = {0.0f, 0.0f, 0.0f, 0.0f};                                                   \
    for (int64_t i = 0; i < k / QK; ++i) {                                                      \
        __m256i lo, hi;                                                                         \
        UNPACK;                                                                                 \
        for (int j = 0; j < 4; ++j) {                                                           \
            const __m256i p = QFN(block16)(lo, hi, x[j][i].qs);                                 \
            acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(SCALE), acc[j]);    \
            CORR;                                                                               \
        }                                                                                       \
    }                                                                                           \
    for (int j = 0; j < 4; ++j) out[j] = QFN(hsum)(acc[j]) + corr[j];

QATTR void QFN(dot4_q4_0)(const void *vw, const char *xb, int64_t xrb, int64_t k, float *out) {
    const blk_q4_0 *w = (const blk_q4_0 *)vw;
    const __m256i eight = _mm256_set1_epi16(8);
    QDOT4_BODY((QFN(nibbles16)(w[i].qs, &lo, &hi), lo = _mm256_sub_epi16(lo, eight), hi = _mm256_sub_epi16(hi, eight)),
               _cvtsh_ss(w[i].d) * x[j][i].d, (void)0)
}

QATTR void QFN(dot4_q4_1)(const void *vw, const char *xb, int64_t xrb, int64_t k, float *out) {
    const blk_q4_1 *w = (const blk_q4_1 *)vw;
    QDOT4_BODY(QFN(nibbles16)(w[i].qs, &lo, &hi), _cvtsh_ss(w[i].d) * x[j][i].d,
               corr[j] += _cvtsh_ss(w[i].m) * x[j][i].dsum)
}

QATTR void QFN(dot4_q8_0)(const void *vw, const char *xb, int64_t xrb, int64_t k, float *out) {
    const blk_q8_0 *w = (const blk_q8_0 *)vw;
    QDOT4_BODY((lo = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)w[i].qs)),
                hi = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w[i].qs + 16)))),
               _cvtsh_ss(w[i].d) * x[j][i].d, (void)0)
}
#undef QDOT4_BODY

QATTR float QFN(dot_q4_k)(const void *vw, const void *vx, int64_t k) {
    const blk_q4_k *w = (const blk_q4_k *)vw; const act256 *x = (const act256 *)vx;
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    __m256 acc = _mm256_setzero_ps();
    float corr = 0.0f;
    for (int64_t i = 0; i < k / QK_K; ++i) {
        uint8_t sc[8], mn[8];
        k4_scale_min(w[i].scales, sc, mn);
        __m256i s = _mm256_setzero_si256();
        int32_t smin = 0;
        for (int j = 0; j < 4; ++j) {
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(w[i].qs + 32 * j));
            const __m256i lo = _mm256_and_si256(raw, m4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
            const __m256i plo = DOT_U8S8(_mm256_setzero_si256(), lo, _mm256_loadu_si256((const __m256i *)(x[i].qs + 64 * j)));
            const __m256i phi = DOT_U8S8(_mm256_setzero_si256(), hi, _mm256_loadu_si256((const __m256i *)(x[i].qs + 64 * j + 32)));
            s = _mm256_add_epi32(s, _mm256_mullo_epi32(plo, _mm256_set1_epi32(sc[2 * j])));
            s = _mm256_add_epi32(s, _mm256_mullo_epi32(phi, _mm256_set1_epi32(sc[2 * j + 1])));
            smin += mn[2 * j] * (x[i].sum16[4 * j] + x[i].sum16[4 * j + 1])
                  + mn[2 * j + 1] * (x[i].sum16[4 * j + 2] + x[i].sum16[4 * j + 3]);
        }
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(x[i].d * _cvtsh_ss(w[i].d)), acc);
        corr -= x[i].d * _cvtsh_ss(w[i].dmin) * (float)smin;
    }
    return QFN(hsum)(acc) + corr;
}

QATTR float QFN(dot_q6_k)(const void *vw, const void *vx, int64_t k) {
    const blk_q6_k *w = (const blk_q6_k *)vw; const act256 *x = (const act256 *)vx;
    const __m256i m4 = _mm256_set1_epi8(0x0F), m3 = _mm256_set1_epi8(3);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < k / QK_K; ++i) {
        __m256i s = _mm256_setzero_si256();
        int32_t bias = 0;
        for (int g = 0; g < 16; ++g) bias += w[i].scales[g] * x[i].sum16[g];
        for (int h = 0; h < 2; ++h) {
            const __m256i a = _mm256_loadu_si256((const __m256i *)(w[i].ql + 64 * h));
            const __m256i b = _mm256_loadu_si256((const __m256i *)(w[i].ql + 64 * h + 32));
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(w[i].qh + 32 * h));
            const __m256i q[4] = {
                _mm256_or_si256(_mm256_and_si256(a, m4), _mm256_slli_epi16(_mm256_and_si256(qh, m3), 4)),
                _mm256_or_si256(_mm256_and_si256(b, m4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), m3), 4)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), m4),
                                _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), m3), 4)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b, 4), m4),
                                _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), m3), 4)),
            };
            for (int g = 0; g < 4; ++g) {
                const int e = 128 * h + 32 * g;          /* 32 weights: two groups of 16, two scales */
                const __m256i p = DOT_U8S8(_mm256_setzero_si256(), q[g], _mm256_loadu_si256((const __m256i *)(x[i].qs + e)));
                const int32_t s0 = w[i].scales[e / 16], s1 = w[i].scales[e / 16 + 1];
                s = _mm256_add_epi32(s, _mm256_mullo_epi32(p, _mm256_setr_epi32(s0, s0, s0, s0, s1, s1, s1, s1)));
            }
        }
        /* the 6-bit values are stored +32: subtract 32 * sum(x) per group, scaled */
        s = _mm256_sub_epi32(s, _mm256_setr_epi32(32 * bias, 0, 0, 0, 0, 0, 0, 0));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(x[i].d * _cvtsh_ss(w[i].d)), acc);
    }
    return QFN(hsum)(acc);
}

#undef QCAT2
#undef QCAT
#undef QFN
#undef QATTR
