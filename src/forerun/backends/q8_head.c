/* Multi-row product of a Q8_0 matrix with Q8_0-quantized activations.
 *
 * out[r][v] = sum_b  d_w[v][b] * d_x[r][b] * sum_j q_w[v][b][j] * q_x[r][b][j]
 *
 * The same quantity llama.cpp computes for its Q8_0 LM head, but every weight block is
 * loaded once for all rows, so n rows cost little more than one (llama.cpp's kernels
 * cost about one full pass over the weights per row on small CPUs). The float
 * summation order differs from llama.cpp's; the caller bounds that difference.
 *
 * Layout: qw [V][nb][32] int8, dw [V][nb] float, qx [n][nb][32] int8, dx [n][nb] float,
 * out [n][V] float. Built with -O3 -march=native; OpenMP splits the vocabulary.
 */
#include <stdint.h>
#include <immintrin.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define QK 32
#define MAXR 64

#if defined(__AVX2__)
static inline __m256i dot_i8(__m256i w, __m256i x) {
    /* 8 int32 lanes, each the sum of 4 products w*x (signed x signed). */
    __m256i u = _mm256_sign_epi8(w, w);      /* |w| as unsigned bytes */
    __m256i s = _mm256_sign_epi8(x, w);      /* x carrying w's sign */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
    __m256i p16 = _mm256_maddubs_epi16(u, s);
    return _mm256_madd_epi16(p16, _mm256_set1_epi16(1));
#endif
}

static inline float hsum(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}
#endif

int forerun_q8_rows(const int8_t *qw, const float *dw, int64_t V, int nb,
                    const int8_t *qx, const float *dx, int n, float *out) {
    if (n < 1 || n > MAXR) return -1;
#pragma omp parallel for schedule(static)
    for (int64_t v = 0; v < V; v++) {
        const int8_t *wrow = qw + v * nb * QK;
        const float *dwr = dw + v * nb;
#if defined(__AVX2__)
        __m256 acc[MAXR];
        for (int r = 0; r < n; r++) acc[r] = _mm256_setzero_ps();
        for (int b = 0; b < nb; b++) {
            __m256i w = _mm256_loadu_si256((const __m256i *)(wrow + b * QK));
            float d = dwr[b];
            for (int r = 0; r < n; r++) {
                __m256i x = _mm256_loadu_si256((const __m256i *)(qx + ((int64_t)r * nb + b) * QK));
                __m256 s = _mm256_set1_ps(d * dx[r * nb + b]);
                acc[r] = _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(dot_i8(w, x)), acc[r]);
            }
        }
        for (int r = 0; r < n; r++) out[(int64_t)r * V + v] = hsum(acc[r]);
#else
        for (int r = 0; r < n; r++) {
            float acc = 0.0f;
            for (int b = 0; b < nb; b++) {
                int32_t isum = 0;
                const int8_t *w = wrow + b * QK, *x = qx + ((int64_t)r * nb + b) * QK;
                for (int j = 0; j < QK; j++) isum += (int32_t)w[j] * (int32_t)x[j];
                acc += (dwr[b] * dx[r * nb + b]) * (float)isum;
            }
            out[(int64_t)r * V + v] = acc;
        }
#endif
    }
    return 0;
}

void forerun_q8_threads(int n) {
#ifdef _OPENMP
    if (n > 0) omp_set_num_threads(n);
#else
    (void)n;
#endif
}
