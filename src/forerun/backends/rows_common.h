/* What the package's C kernels share: the OpenMP thread setting, exact float16 -> float, and
 * attention of one (row, head) over the cache slots that row sees, in an order fixed by those
 * slots alone (so a verify pass's row gives what a one-token step gives). Plain float operations
 * in a written-out order: every build of every file that includes it computes the same bits. */
#ifndef FORERUN_ROWS_COMMON_H
#define FORERUN_ROWS_COMMON_H
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX2__)
#include <immintrin.h>
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

static inline float dot_f(const float *a, const float *b, int D) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int d = 0;
#if defined(__AVX2__)
    if (D >= 8) { /* the same lanes and order as below, in one register */
        __m256 v = _mm256_setzero_ps();
        for (; d + 8 <= D; d += 8) v = _mm256_add_ps(v, _mm256_mul_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d)));
        _mm256_storeu_ps(acc, v);
    }
#endif
    for (; d + 8 <= D; d += 8)
        for (int l = 0; l < 8; l++) acc[l] += a[d + l] * b[d + l];
    float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (; d < D; d++) s += a[d] * b[d];
    return s;
}

/* One (row, head): query qv [D] over the keys kh and values vh ([cap, D] of its KV head) at slots
 * lo .. hi - 1, then extra[0 .. n_extra - 1]; scores scaled, soft-capped where softcap > 0 (Gemma 2:
 * cap * tanh(s / cap), with ``tanh_fn``), softmax, weighted sum into o [D]. w, slot: scratch of at
 * least the row's slot count. */
static inline void attend_one(const float *qv, const float *kh, const float *vh, int D, int lo, int hi,
                              const int32_t *extra, int n_extra, float scale, float softcap,
                              float (*tanh_fn)(float), float *w, int32_t *slot, float *o) {
    int S = 0;
    for (int j = lo; j < hi; j++) slot[S++] = j;
    for (int j = 0; j < n_extra; j++) slot[S++] = extra[j];
    float m = -INFINITY;
    int j = 0;
#if defined(__AVX2__) && defined(__FMA__)
    if (D % 8 == 0) /* 8 keys at a time: each key's dot_f, its lanes and its final sums unchanged */
        for (; j + 8 <= S; j += 8) {
            __m256 acc[8];
            const float *kr[8];
            for (int k = 0; k < 8; k++) {
                acc[k] = _mm256_setzero_ps();
                kr[k] = kh + (int64_t)slot[j + k] * D;
            }
            for (int d = 0; d < D; d += 8) {
                __m256 qd = _mm256_loadu_ps(qv + d);
                for (int k = 0; k < 8; k++) acc[k] = _mm256_add_ps(acc[k], _mm256_mul_ps(qd, _mm256_loadu_ps(kr[k] + d)));
            }
            /* per key ((l0 + l4) + (l1 + l5)) + ((l2 + l6) + (l3 + l7)): halves added, then two pair sums */
            __m256 h[4];
            for (int k = 0; k < 4; k++)
                h[k] = _mm256_add_ps(_mm256_permute2f128_ps(acc[2 * k], acc[2 * k + 1], 0x20),
                                     _mm256_permute2f128_ps(acc[2 * k], acc[2 * k + 1], 0x31));
            __m256 sums = _mm256_hadd_ps(_mm256_hadd_ps(h[0], h[1]), _mm256_hadd_ps(h[2], h[3])); /* keys 0 2 4 6 1 3 5 7 */
            sums = _mm256_permutevar8x32_ps(sums, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_ps(w + j, _mm256_mul_ps(sums, _mm256_set1_ps(scale)));
            for (int k = 0; k < 8; k++) {
                float s = w[j + k];
                if (softcap > 0.0f) s = tanh_fn(s / softcap) * softcap;
                w[j + k] = s;
                m = s > m ? s : m;
            }
        }
#endif
    for (; j < S; j++) {
        float s = dot_f(qv, kh + (int64_t)slot[j] * D, D) * scale;
        if (softcap > 0.0f) s = tanh_fn(s / softcap) * softcap;
        w[j] = s;
        m = s > m ? s : m;
    }
    float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    j = 0;
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
    float inv = 1.0f / sum;
#if defined(__AVX2__)
    if (D % 64 == 0) { /* the same sums as below, 64 columns at a time held in registers */
        const __m256 vi = _mm256_set1_ps(inv);
        for (int d0 = 0; d0 < D; d0 += 64) {
            __m256 acc[8];
            for (int v = 0; v < 8; v++) acc[v] = _mm256_setzero_ps();
            for (int jj = 0; jj < S; jj++) {
                const float *vr = vh + (int64_t)slot[jj] * D + d0;
                __m256 p = _mm256_set1_ps(w[jj]);
                for (int v = 0; v < 8; v++) acc[v] = _mm256_add_ps(acc[v], _mm256_mul_ps(p, _mm256_loadu_ps(vr + 8 * v)));
            }
            for (int v = 0; v < 8; v++) _mm256_storeu_ps(o + d0 + 8 * v, _mm256_mul_ps(acc[v], vi));
        }
        return;
    }
#endif
    for (int d = 0; d < D; d++) o[d] = 0.0f;
    for (int jj = 0; jj < S; jj++) {
        const float *vr = vh + (int64_t)slot[jj] * D;
        float p = w[jj];
        for (int d = 0; d < D; d++) o[d] += p * vr[d];
    }
    for (int d = 0; d < D; d++) o[d] *= inv;
}
#endif
