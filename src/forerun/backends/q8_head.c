/* Multi-row product of a Q8_0 matrix with Q8_0-quantized activations, with each row's top two.
 *
 * out[r][v] = sum_b  d_w[v][b] * d_x[r][b] * sum_j q_w[v][b][j] * q_x[r][b][j]
 *
 * The same quantity llama.cpp computes for its Q8_0 LM head, but every weight block is
 * loaded once for all rows, so n rows cost little more than one (llama.cpp's kernels
 * cost about one full pass over the weights per row on small CPUs). The float
 * summation order differs from llama.cpp's; the caller bounds that difference. Every
 * float term passes through at most nb + 3 roundings here (row-major: nb lane accumulations
 * and an 8-lane sum; interleaved: nb accumulations and the scale product), within the
 * caller's (nb + 6) bound.
 *
 * Two layouts of the weights: row-major (forerun_q8_rows: qw [V][nb][32] int8, dw [V][nb]
 * fp16 as stored in the GGUF file; AVX2 or plain C) and interleaved (forerun_q8_rows_x16,
 * AVX-512 VNNI, see below). Both take qx [n][nb][32] int8, dx [n][nb] float and write out
 * [n][V] float, top [n][2] float and top_idx [n][2] int64: the largest and second-largest
 * logit of each row (ties: the lower index first).
 * Built for each instruction set (ckernels.py); OpenMP splits the vocabulary.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <immintrin.h>
#include "rows_common.h"

#define QK 32
#define MAXR 64
#define RG 8 /* rows per register group */

static inline float fp16_to_f32(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    return half_to_float(h);
#endif
}

static inline void top2_push(float f, int64_t v, float *b1, int64_t *i1, float *b2, int64_t *i2) {
    /* v arrives in increasing order within a thread: a tie keeps the earlier index first. */
    if (f > *b1) {
        *b2 = *b1; *i2 = *i1; *b1 = f; *i1 = v;
    } else if (f > *b2) {
        *b2 = f; *i2 = v;
    }
}

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
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define FORERUN_Q8_AVX512 1
#endif

/* Each thread keeps the top two of every row; merged in thread order (threads hold increasing
 * ranges of the vocabulary), so a tie keeps the lower index first. */
static int top2_alloc(int n, int nth, float **tb, int64_t **ti) {
    *tb = (float *)malloc(sizeof(float) * 2 * n * nth);
    *ti = (int64_t *)malloc(sizeof(int64_t) * 2 * n * nth);
    if (!*tb || !*ti) { free(*tb); free(*ti); return -2; }
    for (int i = 0; i < 2 * n * nth; i++) { (*tb)[i] = -INFINITY; (*ti)[i] = -1; }
    return 0;
}

static void top2_merge(int n, int nth, float *tb, int64_t *ti, float *top, int64_t *top_idx) {
    for (int r = 0; r < n; r++) {
        float b1 = -INFINITY, b2 = -INFINITY;
        int64_t i1 = -1, i2 = -1;
        for (int t = 0; t < nth; t++)
            for (int k = 0; k < 2; k++)
                if (ti[2 * n * t + 2 * r + k] >= 0)
                    top2_push(tb[2 * n * t + 2 * r + k], ti[2 * n * t + 2 * r + k], &b1, &i1, &b2, &i2);
        top[2 * r] = b1; top[2 * r + 1] = b2;
        top_idx[2 * r] = i1; top_idx[2 * r + 1] = i2;
    }
    free(tb);
    free(ti);
}

/* Interleaved layouts: each block's integer sum starts at -128 * sum(x) of the block, which takes
 * the weights' +128 offset back exactly. Returns the [n][nb] starts (malloc'ed), or NULL. */
__attribute__((unused)) static int32_t *offset_corr(const int8_t *qx, int n, int nb) {
    int32_t *corr = (int32_t *)malloc(sizeof(int32_t) * (size_t)n * nb);
    if (!corr) return NULL;
    for (int r = 0; r < n; r++)
        for (int b = 0; b < nb; b++) {
            int32_t sx = 0;
            for (int j = 0; j < QK; j++) sx += qx[((int64_t)r * nb + b) * QK + j];
            corr[r * nb + b] = 128 * sx;
        }
    return corr;
}

static int max_threads(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

static int thread_num(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

/* Row-major layout (CPUs without AVX-512 VNNI): one vocabulary row at a time, all activation rows. */
int forerun_q8_rows(const int8_t *qw, const uint16_t *dw, int64_t V, int nb,
                    const int8_t *qx, const float *dx, int n, float *out,
                    float *top, int64_t *top_idx) {
    if (n < 1 || n > MAXR) return -1;
    const int nth = max_threads();
    float *tb;
    int64_t *ti;
    if (top2_alloc(n, nth, &tb, &ti)) return -2;
#pragma omp parallel
    {
        const int t = thread_num();
        float *b = tb + 2 * n * t;
        int64_t *bi = ti + 2 * n * t;
#pragma omp for schedule(static)
        for (int64_t v = 0; v < V; v++) {
            const int8_t *wrow = qw + v * nb * QK;
            const uint16_t *dwr = dw + v * nb;
            float vals[MAXR];
            {
#if defined(__AVX2__)
                for (int r0 = 0; r0 < n; r0 += RG) {
                    int m = n - r0 < RG ? n - r0 : RG;
                    __m256 acc[RG];
                    for (int r = 0; r < m; r++) acc[r] = _mm256_setzero_ps();
                    for (int bb = 0; bb < nb; bb++) {
                        __m256i w = _mm256_loadu_si256((const __m256i *)(wrow + bb * QK));
                        float d = fp16_to_f32(dwr[bb]);
                        for (int r = 0; r < m; r++) {
                            int rr = r0 + r;
                            __m256i x = _mm256_loadu_si256((const __m256i *)(qx + ((int64_t)rr * nb + bb) * QK));
                            __m256 s = _mm256_set1_ps(d * dx[rr * nb + bb]);
                            acc[r] = _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(dot_i8(w, x)), acc[r]);
                        }
                    }
                    for (int r = 0; r < m; r++) vals[r0 + r] = hsum8(acc[r]);
                }
#else
                for (int r = 0; r < n; r++) {
                    float acc = 0.0f;
                    for (int bb = 0; bb < nb; bb++) {
                        int32_t isum = 0;
                        const int8_t *w = wrow + bb * QK, *x = qx + ((int64_t)r * nb + bb) * QK;
                        for (int j = 0; j < QK; j++) isum += (int32_t)w[j] * (int32_t)x[j];
                        acc += (fp16_to_f32(dwr[bb]) * dx[r * nb + bb]) * (float)isum;
                    }
                    vals[r] = acc;
                }
#endif
            }
            for (int r = 0; r < n; r++) {
                out[(int64_t)r * V + v] = vals[r];
                top2_push(vals[r], v, &b[2 * r], &bi[2 * r], &b[2 * r + 1], &bi[2 * r + 1]);
            }
        }
    }
    top2_merge(n, nth, tb, ti, top, top_idx);
    return 0;
}

typedef void (*group_fn)(const uint8_t *wg, const uint16_t *dg, int nb, const int8_t *qx, const float *dx,
                         const int32_t *corr, int r0, int m, float *vals);

/* The interleaved layouts' pass: OpenMP splits the groups of ``lanes`` vocabulary rows, ``group``
 * computes one group's logits for up to ``rg`` activation rows at a time (vals [row][lanes]), and
 * each row's logits are stored and pushed into its top two (skipped when none beats the second). */
__attribute__((unused)) static int interleaved_rows(group_fn group, int lanes, int rg, const uint8_t *wu,
                                                    const uint16_t *dh, int64_t V, int nb, const int8_t *qx,
                                                    const float *dx, int n, float *out, float *top, int64_t *top_idx) {
    if (n < 1 || n > MAXR) return -1;
    const int64_t G = (V + lanes - 1) / lanes;
    const int nth = max_threads();
    int32_t *corr = offset_corr(qx, n, nb);
    float *tb;
    int64_t *ti;
    if (!corr) return -2;
    if (top2_alloc(n, nth, &tb, &ti)) { free(corr); return -2; }
#pragma omp parallel
    {
        const int t = thread_num();
        float *bt = tb + 2 * n * t;
        int64_t *bi = ti + 2 * n * t;
        float vals[MAXR * 16];
#pragma omp for schedule(static)
        for (int64_t g = 0; g < G; g++) {
            const uint8_t *wg = wu + g * (int64_t)nb * 32 * lanes;
            const uint16_t *dg = dh + g * (int64_t)nb * lanes;
            for (int r0 = 0; r0 < n; r0 += rg)
                group(wg, dg, nb, qx, dx, corr, r0, n - r0 < rg ? n - r0 : rg, vals + (int64_t)r0 * lanes);
            const int64_t v0 = g * lanes;
            const int live = V - v0 < lanes ? (int)(V - v0) : lanes;
            for (int r = 0; r < n; r++) {
                const float *vr = vals + (int64_t)r * lanes;
                memcpy(out + (int64_t)r * V + v0, vr, sizeof(float) * live);
                float mx = vr[0];
                for (int l = 1; l < live; l++) mx = vr[l] > mx ? vr[l] : mx;
                if (mx <= bt[2 * r + 1]) continue;
                for (int l = 0; l < live; l++)
                    top2_push(vr[l], v0 + l, &bt[2 * r], &bi[2 * r], &bt[2 * r + 1], &bi[2 * r + 1]);
            }
        }
    }
    top2_merge(n, nth, tb, ti, top, top_idx);
    free(corr);
    return 0;
}

/* ---- Interleaved layout: 16 vocabulary rows per 64-byte vector (AVX-512 VNNI) ----
 *
 * wu [G][nb][8][16][4] uint8: weight q + 128 of vocabulary row 16g + lane, bytes 4k..4k+3 of
 * block b; dh [G][nb][16] fp16 block scales (rows past V: q = 0, scale 0). One vpdpbusd then
 * adds 4 products for 16 vocabulary rows at once, so a block's integer dot needs 8 of them and
 * no horizontal sums. Each accumulation starts at -128 * sum(x) of the block, which takes the
 * +128 offset back exactly. Per lane (one logit) the float terms pass through nb + 2 roundings.
 */
int forerun_q8_has_x16(void) {
#ifdef FORERUN_Q8_AVX512
    return 1;
#else
    return 0;
#endif
}

#ifdef FORERUN_Q8_AVX512
static inline __attribute__((always_inline)) void group_x16(const uint8_t *wg, const uint16_t *dg, int nb,
                                                            const int8_t *qx, const float *dx, const int32_t *corr,
                                                            int r0, const int m, float *vals) {
    __m512 acc[RG];
    for (int r = 0; r < m; r++) acc[r] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *wb = wg + (int64_t)b * 512;
        __m512i w0 = _mm512_loadu_si512((const void *)(wb + 0)), w1 = _mm512_loadu_si512((const void *)(wb + 64));
        __m512i w2 = _mm512_loadu_si512((const void *)(wb + 128)), w3 = _mm512_loadu_si512((const void *)(wb + 192));
        __m512i w4 = _mm512_loadu_si512((const void *)(wb + 256)), w5 = _mm512_loadu_si512((const void *)(wb + 320));
        __m512i w6 = _mm512_loadu_si512((const void *)(wb + 384)), w7 = _mm512_loadu_si512((const void *)(wb + 448));
        __m512 dwv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(dg + (int64_t)b * 16)));
        for (int r = 0; r < m; r++) {
            const int rr = r0 + r;
            const int32_t *xp = (const int32_t *)(qx + ((int64_t)rr * nb + b) * QK);
            __m512i i = _mm512_set1_epi32(-corr[rr * nb + b]);
            i = _mm512_dpbusd_epi32(i, w0, _mm512_set1_epi32(xp[0]));
            i = _mm512_dpbusd_epi32(i, w1, _mm512_set1_epi32(xp[1]));
            i = _mm512_dpbusd_epi32(i, w2, _mm512_set1_epi32(xp[2]));
            i = _mm512_dpbusd_epi32(i, w3, _mm512_set1_epi32(xp[3]));
            i = _mm512_dpbusd_epi32(i, w4, _mm512_set1_epi32(xp[4]));
            i = _mm512_dpbusd_epi32(i, w5, _mm512_set1_epi32(xp[5]));
            i = _mm512_dpbusd_epi32(i, w6, _mm512_set1_epi32(xp[6]));
            i = _mm512_dpbusd_epi32(i, w7, _mm512_set1_epi32(xp[7]));
            __m512 sc = _mm512_mul_ps(dwv, _mm512_set1_ps(dx[rr * nb + b]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), sc, acc[r]);
        }
    }
    for (int r = 0; r < m; r++) _mm512_storeu_ps(vals + (int64_t)r * 16, acc[r]);
}

static void group_x16_n(const uint8_t *wg, const uint16_t *dg, int nb, const int8_t *qx, const float *dx,
                        const int32_t *corr, int r0, int m, float *vals) {
    switch (m) {
    case 1: group_x16(wg, dg, nb, qx, dx, corr, r0, 1, vals); break;
    case 2: group_x16(wg, dg, nb, qx, dx, corr, r0, 2, vals); break;
    case 3: group_x16(wg, dg, nb, qx, dx, corr, r0, 3, vals); break;
    case 4: group_x16(wg, dg, nb, qx, dx, corr, r0, 4, vals); break;
    case 5: group_x16(wg, dg, nb, qx, dx, corr, r0, 5, vals); break;
    case 6: group_x16(wg, dg, nb, qx, dx, corr, r0, 6, vals); break;
    case 7: group_x16(wg, dg, nb, qx, dx, corr, r0, 7, vals); break;
    default: group_x16(wg, dg, nb, qx, dx, corr, r0, 8, vals); break;
    }
}
#endif

int forerun_q8_rows_x16(const uint8_t *wu, const uint16_t *dh, int64_t V, int nb,
                        const int8_t *qx, const float *dx, int n, float *out,
                        float *top, int64_t *top_idx) {
#ifndef FORERUN_Q8_AVX512
    (void)wu; (void)dh; (void)V; (void)nb; (void)qx; (void)dx; (void)n; (void)out; (void)top; (void)top_idx;
    return -3;
#else
    return interleaved_rows(group_x16_n, 16, RG, wu, dh, V, nb, qx, dx, n, out, top, top_idx);
#endif
}

/* ---- Interleaved layout for AVX2: 8 vocabulary rows per 32-byte vector, 7-bit activations ----
 *
 * wu [G][nb][8][8][4] uint8: weight q + 128 of vocabulary row 8g + lane, bytes 4k..4k+3 of block b;
 * dh [G][nb][8] fp16 block scales (rows past V: q = 0, scale 0). vpmaddubsw multiplies the
 * unsigned weight bytes with 4 broadcast activation bytes and adds pairs into int16, then
 * vpmaddwd adds those into int32: 4 products for each of 8 vocabulary rows, no horizontal sums.
 * The int16 pairs cannot saturate because the activations lie in [-63, 63] (7-bit, the caller
 * quantizes so): 2 * 255 * 63 = 32130 < 32767. Each block's integer sum starts at -128 * sum(x)
 * of the block, which takes the +128 offset back exactly. Per lane (one logit) the float terms
 * pass through nb + 2 roundings, as in the AVX-512 layout.
 */
int forerun_q8_has_x8(void) {
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    return 1;
#else
    return 0;
#endif
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define RG8 4 /* activation rows per register group: 2 x RG8 accumulators + 4 of the 16 registers */
static inline __attribute__((always_inline)) void group_x8(const uint8_t *wg, const uint16_t *dg, int nb,
                                                           const int8_t *qx, const float *dx, const int32_t *corr,
                                                           int r0, const int m, float *vals) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[RG8];
    for (int r = 0; r < m; r++) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *wb = wg + (int64_t)b * 256;
        __m256i isum[RG8];
        for (int r = 0; r < m; r++) isum[r] = _mm256_set1_epi32(-corr[(r0 + r) * nb + b]);
        for (int k = 0; k < 8; k++) {
            __m256i w = _mm256_loadu_si256((const __m256i *)(wb + 32 * k));
            for (int r = 0; r < m; r++) {
                const int32_t *xp = (const int32_t *)(qx + ((int64_t)(r0 + r) * nb + b) * QK);
                __m256i p = _mm256_maddubs_epi16(w, _mm256_set1_epi32(xp[k]));
                isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(p, ones));
            }
        }
        __m256 dwv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dg + (int64_t)b * 8)));
        for (int r = 0; r < m; r++) {
            __m256 sc = _mm256_mul_ps(dwv, _mm256_set1_ps(dx[(r0 + r) * nb + b]));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), sc, acc[r]);
        }
    }
    for (int r = 0; r < m; r++) _mm256_storeu_ps(vals + (int64_t)r * 8, acc[r]);
}

static void group_x8_n(const uint8_t *wg, const uint16_t *dg, int nb, const int8_t *qx, const float *dx,
                       const int32_t *corr, int r0, int m, float *vals) {
    switch (m) {
    case 1: group_x8(wg, dg, nb, qx, dx, corr, r0, 1, vals); break;
    case 2: group_x8(wg, dg, nb, qx, dx, corr, r0, 2, vals); break;
    case 3: group_x8(wg, dg, nb, qx, dx, corr, r0, 3, vals); break;
    default: group_x8(wg, dg, nb, qx, dx, corr, r0, RG8, vals); break;
    }
}
#endif

int forerun_q8_rows_x8(const uint8_t *wu, const uint16_t *dh, int64_t V, int nb,
                       const int8_t *qx, const float *dx, int n, float *out,
                       float *top, int64_t *top_idx) {
#if !(defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
    (void)wu; (void)dh; (void)V; (void)nb; (void)qx; (void)dx; (void)n; (void)out; (void)top; (void)top_idx;
    return -3;
#else
    for (int64_t i = 0; i < (int64_t)n * nb * QK; i++)
        if (qx[i] < -63 || qx[i] > 63) return -4;
    return interleaved_rows(group_x8_n, 8, RG8, wu, dh, V, nb, qx, dx, n, out, top, top_idx);
#endif
}

void forerun_q8_threads(int n) { rows_threads(n); }
