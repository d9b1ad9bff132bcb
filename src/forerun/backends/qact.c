/* A pass's activations for qrows.c's products: each row quantized per 32 values to 8-bit codes
 * with a float scale (amax / 127, as llama.cpp's CPU path quantizes them for its block dot
 * products), and the sums of each block's codes that the code bias and the offsets need. Built
 * into the qrows library with qrows.c and qlayer.c (layouts in qrows.h). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "rows_common.h"

#include "qrows.h"

/* Row-wise quantization: plain loops, or in AVX2 builds 8 lanes at a time with the same values. */
void q_quantize_rows(const float *x, int64_t ldx, int N, int D, qact_t *a) {
    int nb = D / 32;
#pragma omp parallel for schedule(static) if (N >= 16)
    for (int r = 0; r < N; r++) {
        const float *xr = x + (int64_t)r * ldx;
        int8_t *q = a->xq + (int64_t)r * D;
        for (int b = 0; b < nb; b++) {
            float d;
            int s0 = 0, s1 = 0;
#if defined(__AVX2__)
            { /* the same values as the plain loops, 8 lanes at a time (max, round to nearest even, clamp are exact) */
                const float *xb = xr + b * 32;
                const __m256 sign = _mm256_set1_ps(-0.0f);
                __m256 v[4], mx = _mm256_setzero_ps();
                for (int k = 0; k < 4; k++) {
                    v[k] = _mm256_loadu_ps(xb + 8 * k);
                    mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[k]));
                }
                float lanes[8];
                _mm256_storeu_ps(lanes, mx);
                float amax = 0.0f;
                for (int l = 0; l < 8; l++) amax = lanes[l] > amax ? lanes[l] : amax;
                d = amax / 127.0f;
                float id = d > 0.0f ? 127.0f / amax : 0.0f;
                __m256i c[4];
                for (int k = 0; k < 4; k++) {
                    __m256 y = _mm256_round_ps(_mm256_mul_ps(v[k], _mm256_set1_ps(id)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                    y = _mm256_min_ps(_mm256_max_ps(y, _mm256_set1_ps(-127.0f)), _mm256_set1_ps(127.0f));
                    c[k] = _mm256_cvtps_epi32(y);
                }
                int32_t t0[8], t1[8];
                _mm256_storeu_si256((__m256i *)t0, _mm256_add_epi32(c[0], c[1]));
                _mm256_storeu_si256((__m256i *)t1, _mm256_add_epi32(c[2], c[3]));
                for (int l = 0; l < 8; l++) {
                    s0 += t0[l];
                    s1 += t1[l];
                }
                __m256i w8 = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
                w8 = _mm256_permutevar8x32_epi32(w8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)); /* packs work per 128-bit half */
                _mm256_storeu_si256((__m256i *)(q + b * 32), w8);
            }
#else
            {
                float amax = 0.0f;
                for (int j = 0; j < 32; j++) {
                    float v = fabsf(xr[b * 32 + j]);
                    amax = v > amax ? v : amax;
                }
                d = amax / 127.0f;
                float id = d > 0.0f ? 127.0f / amax : 0.0f;
                for (int j = 0; j < 32; j++) {
                    int c = (int)nearbyintf(xr[b * 32 + j] * id);
                    c = c > 127 ? 127 : (c < -127 ? -127 : c);
                    q[b * 32 + j] = (int8_t)c;
                    if (j < 16) s0 += c; else s1 += c;
                }
            }
#endif
            int64_t i = (int64_t)r * nb + b;
            a->dx[i] = d;
            a->bs[2 * i] = s0;
            a->bs[2 * i + 1] = s1;
            a->xs[3 * i] = d * (float)(s0 + s1);
            a->xs[3 * i + 1] = d * (float)s0;
            a->xs[3 * i + 2] = d * (float)s1;
        }
    }
}

int q_act_alloc(qact_t *a, int N, int D) {
    int nb = D / 32;
    a->N = N;
    a->D = D;
    a->xq = (int8_t *)malloc((size_t)N * D + 64);
    a->dx = (float *)malloc(sizeof(float) * (size_t)N * nb + 64);
    a->bs = (int32_t *)malloc(sizeof(int32_t) * 2 * (size_t)N * nb + 64);
    a->xs = (float *)malloc(sizeof(float) * 3 * (size_t)N * nb + 64);
    return a->xq && a->dx && a->bs && a->xs ? 0 : -1;
}

void q_act_free(qact_t *a) {
    free(a->xq);
    free(a->dx);
    free(a->bs);
    free(a->xs);
}

/* Activation scales rounded to float16, as ggml's Q8_0 activations store them (the codes stay as
 * quantized from the float32 scale, as ggml's are): the LM heads that certify llama.cpp's argmax or
 * screen a float head against a Q8_0 copy use these (``greedy_head.py``). */
static void half_scales(qact_t *a) {
    int nb = a->D / 32;
    for (int64_t i = 0; i < (int64_t)a->N * nb; i++) {
        float d = half_to_float(float_to_half(a->dx[i]));
        a->dx[i] = d;
        a->xs[3 * i] = d * (float)(a->bs[2 * i] + a->bs[2 * i + 1]);
        a->xs[3 * i + 1] = d * (float)a->bs[2 * i];
        a->xs[3 * i + 2] = d * (float)a->bs[2 * i + 1];
    }
}

int q_act_quantize(const float *x, int N, int D, int f16_scales, qact_t *a) {
    if (q_act_alloc(a, N, D) != 0) return -2;
    q_quantize_rows(x, D, N, D, a);
    if (f16_scales) half_scales(a);
    return 0;
}

