/* What the package's C kernels share: the OpenMP thread setting, exact float16 -> float, and
 * attention over the cache slots each row sees, in an order fixed by those slots alone (so a
 * verify pass's row gives what a one-token step gives; a sequence's rows read its keys and values
 * once for all of them). Plain float operations in a written-out order: every build of every file
 * that includes it (built with -ffp-contract=off) computes the same bits. */
#ifndef FORERUN_ROWS_COMMON_H
#define FORERUN_ROWS_COMMON_H
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX2__)
#include <immintrin.h>

/* The sum of 8 float lanes in one fixed order: (0+4, 1+5, 2+6, 3+7), then pairs, then the two. */
static inline float hsum8(__m256 a) {
    __m128 lo = _mm256_castps256_ps128(a), hi = _mm256_extractf128_ps(a, 1);
    __m128 s = _mm_add_ps(lo, hi);
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

static inline int rows_threads(int n) {
#ifdef _OPENMP
    if (n > 0) omp_set_num_threads(n);
    return omp_get_max_threads();
#else
    (void)n;
    return 1;
#endif
}

/* float16 bits -> float, exactly (normal, subnormal, zero, inf/nan). */
static inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 31, man = h & 1023, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: renormalise */
            exp = 127 - 15 + 1;
            while (!(man & 1024)) {
                man <<= 1;
                exp--;
            }
            bits = sign | (exp << 23) | ((man & 1023) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* exp(x), x clamped to [-87, 88]: 2^n * p(r), Cephes-style polynomial, plain float operations
 * (loops that call it vectorise). */
static inline float exp_c(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float shifter = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    float n = (x * 1.44269504088896341f + shifter) - shifter;
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    float y = p * r * r + r + 1.0f;
    int32_t e = ((int32_t)n + 127) << 23;
    float s;
    memcpy(&s, &e, sizeof s);
    return y * s;
}

#if defined(__AVX2__) && defined(__FMA__)
/* exp_c on 8 lanes: the same float operations in the same order (NaN passes through as there). */
static inline __m256 exp_c8(__m256 x) {
    x = _mm256_min_ps(_mm256_set1_ps(88.0f), _mm256_max_ps(_mm256_set1_ps(-87.0f), x));
    const __m256 shifter = _mm256_set1_ps(12582912.0f);
    __m256 n = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), shifter), shifter);
    __m256 r = _mm256_add_ps(_mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f))),
                             _mm256_mul_ps(n, _mm256_set1_ps(2.12194440e-4f)));
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(5.0000001201e-1f));
    __m256 y = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(p, r), r), r), _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
#endif

/* A score as attention uses it: soft-capped where softcap > 0 (Gemma 2: cap * tanh(s / cap)). */
static inline float capped(float s, float softcap, float (*tanh_fn)(float)) {
    return softcap > 0.0f ? tanh_fn(s / softcap) * softcap : s;
}

/* The largest of w[0..S-1] as the loop m = -inf; m = w[j] > m ? w[j] : m gives it (a NaN never
 * taken), in 8 lanes where the build has them: the same value, bar the sign of a zero maximum,
 * which softmax_weights' exp(w - m) cannot tell apart. */
static inline float max_score(const float *w, int S) {
    float m = -INFINITY;
    int j = 0;
#if defined(__AVX2__)
    if (S >= 8) {
        __m256 v = _mm256_set1_ps(-INFINITY);
        for (; j + 8 <= S; j += 8) v = _mm256_max_ps(_mm256_loadu_ps(w + j), v); /* w > v ? w : v, as below */
        float l[8];
        _mm256_storeu_ps(l, v);
        for (int k = 0; k < 8; k++) m = l[k] > m ? l[k] : m;
    }
#endif
    for (; j < S; j++) m = w[j] > m ? w[j] : m;
    return m;
}

/* Softmax weights in place: w[j] = exp(w[j] - m) for j < S; returns their sum, added in 8 lanes by
 * j's position in w and then in a fixed order (so it depends on the row's own scores only). */
static inline float softmax_weights(float *w, int S, float m) {
    float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int j = 0;
#if defined(__AVX2__) && defined(__FMA__)
    {
        __m256 pv = _mm256_setzero_ps(), mv = _mm256_set1_ps(m);
        for (; j + 8 <= S; j += 8) {
            __m256 e = exp_c8(_mm256_sub_ps(_mm256_loadu_ps(w + j), mv));
            _mm256_storeu_ps(w + j, e);
            pv = _mm256_add_ps(pv, e);
        }
        _mm256_storeu_ps(part, pv);
    }
#endif
    for (; j + 8 <= S; j += 8)
        for (int l = 0; l < 8; l++) {
            w[j + l] = exp_c(w[j + l] - m);
            part[l] += w[j + l];
        }
    float sum = ((part[0] + part[4]) + (part[1] + part[5])) + ((part[2] + part[6]) + (part[3] + part[7]));
    for (; j < S; j++) {
        w[j] = exp_c(w[j] - m);
        sum += w[j];
    }
    return sum;
}

/* float -> float16 bits, rounded to nearest even (overflow to infinity, subnormals kept, NaN stays a
 * quiet NaN with the top of its payload): what F16C's conversion gives, in plain C. */
static inline uint16_t float_to_half(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000, a = x & 0x7fffffffu;
    if (a >= 0x7f800000u) return (uint16_t)(sign | 0x7c00 | (a > 0x7f800000u ? 0x200 | ((a >> 13) & 0x3ff) : 0));
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00); /* 65520 and up: infinity */
    if (a < 0x38800000u) {                                   /* below 2^-14: a subnormal half, or zero */
        if (a <= 0x33000000u) return (uint16_t)sign;         /* up to 2^-25 (a tie, to even): zero */
        uint32_t m = (a & 0x7fffff) | 0x800000, shift = 126 - (a >> 23);
        uint32_t q = m >> shift, rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
        q += rem > half || (rem == half && (q & 1));
        return (uint16_t)(sign | q);
    }
    uint32_t q = (a - 0x38000000u) >> 13, rem = a & 0x1fff;
    q += rem > 0x1000 || (rem == 0x1000 && (q & 1));
    return (uint16_t)(sign | q);
}

/* n floats into float16 bits at dst (every build the same bits: F16C's rounding is float_to_half's). */
static inline void floats_to_half(uint16_t *dst, const float *src, int n) {
    int i = 0;
#if defined(__F16C__) && defined(__AVX2__)
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
    for (; i < n; i++) dst[i] = float_to_half(src[i]);
}

/* Attention over caches of float32 (names ending _f32) and of float16 keys and values (_f16, the
 * integer path's cache: half the bytes a step reads at long contexts; each value widened exactly
 * before the same float operations). */
static inline int kv_block(int D) { return D <= 64 ? 64 : D <= 128 ? 32 : 16; } /* keys per block: 16 KiB at D = 64 */

#define KV_CAT2(a, b) a##_##b
#define KV_CAT(a, b) KV_CAT2(a, b)
#define KVN(x) KV_CAT(x, KV_SUF)

#if defined(__AVX2__) && defined(__FMA__)
/* The 8 sums acc[k] (8 lanes each) as dot_kv reduces them, times scale, into out[0..7]: per key
 * ((l0 + l4) + (l1 + l5)) + ((l2 + l6) + (l3 + l7)): halves added, then two pair sums. */
static inline void sums8_scaled(const __m256 *acc, float scale, float *out) {
    __m256 h[4];
    for (int k = 0; k < 4; k++)
        h[k] = _mm256_add_ps(_mm256_permute2f128_ps(acc[2 * k], acc[2 * k + 1], 0x20),
                             _mm256_permute2f128_ps(acc[2 * k], acc[2 * k + 1], 0x31));
    __m256 sums = _mm256_hadd_ps(_mm256_hadd_ps(h[0], h[1]), _mm256_hadd_ps(h[2], h[3])); /* keys 0 2 4 6 1 3 5 7 */
    sums = _mm256_permutevar8x32_ps(sums, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_ps(out, _mm256_mul_ps(sums, _mm256_set1_ps(scale)));
}
#endif

#define KV_T float
#define KV_SUF f32
#define KV_GET(p) (*(p))
#define KV_LOAD8(p) _mm256_loadu_ps(p)
#define KV_LOAD16(p) _mm512_loadu_ps(p)
#define KV_LOAD2X8(a, b) \
    _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(_mm256_loadu_ps(a))), \
                                        _mm256_castps_pd(_mm256_loadu_ps(b)), 1))
#define KV_WIDENS 0
#if defined(__AVX2__)
#define KV_AVX2 1
#else
#define KV_AVX2 0
#endif
#include "attend_kv.h"

#define KV_T uint16_t
#define KV_SUF f16
#define KV_GET(p) half_to_float(*(p))
#define KV_LOAD8(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define KV_LOAD16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define KV_LOAD2X8(a, b) \
    _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(a))), \
                                            _mm_loadu_si128((const __m128i *)(b)), 1))
#define KV_WIDENS 1
#if defined(__AVX2__) && defined(__F16C__)
#define KV_AVX2 1
#else
#define KV_AVX2 0
#endif
#include "attend_kv.h"

/* a . b over D floats in 8 lanes, then ((l0 + l4) + (l1 + l5)) + ((l2 + l6) + (l3 + l7)), then the
 * tail: attention's key products, and the norms' sums of squares. */
static inline float dot_f(const float *a, const float *b, int D) { return dot_kv_f32(a, b, D); }
#endif
