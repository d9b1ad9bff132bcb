/* Products of block-quantized weights with a few float32 activation rows, bit for bit as
 * f32_rows.c computes them on the dequantized float32 weights.
 *
 * A GGUF model's linear layers store small integer codes c with a float scale s and, for some
 * types, an offset o per group of 16 or 32 weights; the float32 weight its dequantization gives
 * is w = fl(fl(s * c) + o) (Q4_1, Q4_K, Q5_1, Q5_K) or fl(s * c) (Q4_0, Q5_0, Q6_K, Q8_0). These
 * kernels rebuild each w in registers with those same two rounded operations (this file is built
 * with -ffp-contract=off so that the compiler never fuses them) and then multiply-add exactly as
 * f32_rows.c does: 8 lanes over k in order, then the same lane sum. The result is identical to
 * f32_rows on the float32 weights, so a model may switch between the two freely, while memory
 * traffic falls from 4 bytes per weight to 0.75 (4-bit codes) or 1.5 (8-bit codes).
 *
 * Two layouts, both row-major over the weight rows [V][D]:
 *   q4: codes as nibbles, 16 bytes per 32 weights (byte j holds weight j in its low half and
 *       weight j + 16 in its high half, as GGUF's Q4_0/Q4_1 blocks do), a code bias (-8 for
 *       Q4_0, else 0) added before the scale, scale[V][D / 32] and offset[V][D / 32] or NULL;
 *   q8: signed 8-bit codes, scale[V][D / 16] and offset[V][D / 16] or NULL.
 * OpenMP splits the weight rows; each tile of TV weight rows x TR activation rows rebuilds its
 * weights once per 8 columns for all its activation rows. The tiling decides which products run
 * together, never the order of any output's sums, so each output row is the same whatever n is.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif
#include "rows_common.h"

#define TV 4 /* weight rows per tile */
#define TR 2 /* activation rows per tile */

int forerun_block_threads(int n) { return rows_threads(n); }

/* The weights a tile reads: one of the two layouts. */
typedef struct {
    const uint8_t *q4;
    const int8_t *q8;
    const float *scale, *offset;
    int bias;
} weights_t;

/* Scalar weight w[v][k], as the dequantizer computes it. */
static inline float q4_weight(const uint8_t *codes, const float *scale, const float *offset, int bias, int64_t v,
                              int D, int k) {
    int64_t blk = v * (D / 32) + k / 32;
    int j = k % 32;
    uint8_t b = codes[blk * 16 + (j & 15)];
    int c = (j < 16 ? (b & 15) : (b >> 4)) + bias;
    float w = scale[blk] * (float)c;
    if (offset) w = w + offset[blk];
    return w;
}

static inline float q8_weight(const int8_t *codes, const float *scale, const float *offset, int64_t v, int D, int k) {
    int64_t g = v * (D / 16) + k / 16;
    float w = scale[g] * (float)codes[v * D + k];
    if (offset) w = w + offset[g];
    return w;
}

#if defined(__AVX2__) && defined(__FMA__)

/* Eight weights of row v from column k (k % 8 == 0) as float32. */
static inline __m256 q4_load8(const uint8_t *codes, const float *scale, const float *offset, __m256i bias, int64_t v,
                              int D, int k) {
    int64_t blk = v * (D / 32) + k / 32;
    int part = (k % 32) / 8; /* 0, 1: low halves of bytes 0-7, 8-15; 2, 3: high halves */
    __m128i b = _mm_loadl_epi64((const __m128i *)(codes + blk * 16 + (part & 1) * 8));
    if (part >= 2) b = _mm_srli_epi16(b, 4);
    b = _mm_and_si128(b, _mm_set1_epi8(15));
    __m256 c = _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_cvtepu8_epi32(b), bias));
    __m256 w = _mm256_mul_ps(_mm256_broadcast_ss(scale + blk), c);
    if (offset) w = _mm256_add_ps(w, _mm256_broadcast_ss(offset + blk));
    return w;
}

static inline __m256 q8_load8(const int8_t *codes, const float *scale, const float *offset, int64_t v, int D, int k) {
    int64_t g = v * (D / 16) + k / 16;
    __m128i b = _mm_loadl_epi64((const __m128i *)(codes + v * D + k));
    __m256 c = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    __m256 w = _mm256_mul_ps(_mm256_broadcast_ss(scale + g), c);
    if (offset) w = _mm256_add_ps(w, _mm256_broadcast_ss(offset + g));
    return w;
}

/* One tile: weight rows [v0, v0 + tv) against activation rows [r0, r0 + tr). LOAD8 gives eight
 * weights of a row; the k loop and the sums are f32_rows.c's. */
#define TILE(NAME, LOAD8)                                                                                  \
    static inline __attribute__((always_inline)) void NAME(const weights_t *W, const float *x, float *out, \
                                                           int64_t V, int D, int64_t v0, int tv, int r0,   \
                                                           int tr) {                                       \
        __m256 acc[TV][TR];                                                                                \
        int64_t vr[TV];                                                                                    \
        const __m256i vbias = _mm256_set1_epi32(W->bias);                                                  \
        (void)vbias;                                                                                       \
        for (int a = 0; a < TV; a++) {                                                                     \
            vr[a] = v0 + (a < tv ? a : 0); /* a short tile repeats its first row, unused */               \
            for (int b = 0; b < TR; b++) acc[a][b] = _mm256_setzero_ps();                                  \
        }                                                                                                  \
        const float *xr = x + (int64_t)r0 * D;                                                             \
        for (int k = 0; k < D; k += 8) {                                                                   \
            __m256 wa[TV];                                                                                 \
            for (int a = 0; a < TV; a++) wa[a] = LOAD8(vr[a], k);                                          \
            for (int b = 0; b < tr; b++) {                                                                 \
                __m256 xb = _mm256_loadu_ps(xr + (int64_t)b * D + k);                                      \
                for (int a = 0; a < TV; a++) acc[a][b] = _mm256_fmadd_ps(wa[a], xb, acc[a][b]);           \
            }                                                                                              \
        }                                                                                                  \
        for (int a = 0; a < tv; a++)                                                                       \
            for (int b = 0; b < tr; b++) out[(int64_t)(r0 + b) * V + v0 + a] = hsum8(acc[a][b]);           \
    }

/* Passes of more than TR rows rebuild a tile's TV weight rows once into a float32 buffer (L1 for
 * layers up to D = 2048 or so) and run f32_rows.c's tile over it for every group of TR3 rows:
 * the rebuild is paid once per weight instead of once per group. Same products, same order.
 * With AVX-512's 32 vector registers a group is 4 rows (16 accumulators; 16 rows, a full batch,
 * then fill four groups exactly), with AVX2's 16 it is 3 (12 accumulators, no spills). */
#if defined(__AVX512VL__) || defined(FORERUN_WIDE_GROUPS) /* the latter: tests, on AVX2 */
#define TR3 4
#else
#define TR3 3
#endif
static inline __attribute__((always_inline)) void f32_tile(const float *wbuf, const float *x, float *out, int64_t V,
                                                          int D, int64_t v0, int tv, int r0, int tr) {
    __m256 acc[TV][TR3];
    for (int a = 0; a < TV; a++)
        for (int b = 0; b < TR3; b++) acc[a][b] = _mm256_setzero_ps();
    const float *xr = x + (int64_t)r0 * D;
    for (int k = 0; k < D; k += 8) {
        __m256 wa[TV];
        for (int a = 0; a < TV; a++) wa[a] = _mm256_load_ps(wbuf + (int64_t)a * D + k);
        for (int b = 0; b < tr; b++) {
            __m256 xb = _mm256_loadu_ps(xr + (int64_t)b * D + k);
            for (int a = 0; a < TV; a++) acc[a][b] = _mm256_fmadd_ps(wa[a], xb, acc[a][b]);
        }
    }
    for (int a = 0; a < tv; a++)
        for (int b = 0; b < tr; b++) out[(int64_t)(r0 + b) * V + v0 + a] = hsum8(acc[a][b]);
}

/* Blocks of 32 weight rows split between threads (a 576-row layer: 18 blocks, even on 2 threads);
 * within a block, a few activation rows go straight through the register tiles, more go through
 * the buffer. */
#define ROWS(NAME, TILEFN, LOAD8)                                                                          \
    static int NAME(const weights_t *W, const float *x, int n, float *out, int64_t V, int D) {            \
        int64_t vb = 32;                                                                                   \
        int64_t blocks = (V + vb - 1) / vb;                                                                \
        int failed = 0;                                                                                    \
        _Pragma("omp parallel reduction(|: failed)")                                                       \
        {                                                                                                  \
            float *wbuf = NULL;                                                                            \
            if (n > TR && posix_memalign((void **)&wbuf, 32, sizeof(float) * TV * (size_t)D) != 0) {       \
                wbuf = NULL;                                                                               \
                failed = 1;                                                                                \
            }                                                                                              \
            const __m256i vbias = _mm256_set1_epi32(W->bias);                                              \
            (void)vbias;                                                                                   \
            _Pragma("omp for schedule(static)")                                                            \
            for (int64_t bi = 0; bi < blocks; bi++) {                                                      \
                int64_t b0 = bi * vb, b1 = b0 + vb < V ? b0 + vb : V;                                      \
                if (n <= TR) {                                                                             \
                    for (int64_t v0 = b0; v0 < b1; v0 += TV)                                               \
                        TILEFN(W, x, out, V, D, v0, (int)(b1 - v0 < TV ? b1 - v0 : TV), 0, n);             \
                } else if (wbuf) {                                                                         \
                    for (int64_t v0 = b0; v0 < b1; v0 += TV) {                                             \
                        int tv = (int)(b1 - v0 < TV ? b1 - v0 : TV);                                       \
                        for (int a = 0; a < TV; a++)                                                       \
                            for (int k = 0; k < D; k += 8)                                                 \
                                _mm256_store_ps(wbuf + (int64_t)a * D + k, LOAD8(v0 + (a < tv ? a : 0), k)); \
                        for (int r0 = 0; r0 < n; r0 += TR3)                                                \
                            f32_tile(wbuf, x, out, V, D, v0, tv, r0, n - r0 < TR3 ? n - r0 : TR3);         \
                    }                                                                                      \
                }                                                                                          \
            }                                                                                              \
            free(wbuf);                                                                                    \
        }                                                                                                  \
        return failed ? -2 : 0;                                                                            \
    }

#define Q4_LOAD(v, k) q4_load8(W->q4, W->scale, W->offset, vbias, v, D, k)
#define Q8_LOAD(v, k) q8_load8(W->q8, W->scale, W->offset, v, D, k)
TILE(q4_tile, Q4_LOAD)
ROWS(q4_all, q4_tile, Q4_LOAD)
TILE(q8_tile, Q8_LOAD)
ROWS(q8_all, q8_tile, Q8_LOAD)
#endif

/* Without AVX2 and FMA: each output alone, the weights rebuilt one by one (f32_rows.c's loop). */
static __attribute__((unused)) int scalar_rows(const weights_t *W, int64_t V, int D, const float *x, int n, float *out) {
#pragma omp parallel for schedule(static)
    for (int64_t v = 0; v < V; v++) {
        for (int r = 0; r < n; r++) {
            const float *xr = x + (int64_t)r * D;
            float s = 0.0f;
            for (int k = 0; k < D; k++) {
                float w = W->q4 ? q4_weight(W->q4, W->scale, W->offset, W->bias, v, D, k)
                                : q8_weight(W->q8, W->scale, W->offset, v, D, k);
                s += w * xr[k];
            }
            out[(int64_t)r * V + v] = s;
        }
    }
    return 0;
}

/* q4 layout (see the top): out [n][V] = x [n][D] . w[V][D]^T. Returns 0, -1 for bad sizes, -2 out of memory. */
int forerun_q4_rows(const uint8_t *codes, const float *scale, const float *offset, int bias, int64_t V, int D,
                    const float *x, int n, float *out) {
    if (V <= 0 || D <= 0 || D % 32 != 0 || n <= 0) return -1;
    weights_t W = {codes, NULL, scale, offset, bias};
#if defined(__AVX2__) && defined(__FMA__)
    return q4_all(&W, x, n, out, V, D);
#else
    return scalar_rows(&W, V, D, x, n, out);
#endif
}

/* q8 layout (see the top). Returns as forerun_q4_rows. */
int forerun_q8w_rows(const int8_t *codes, const float *scale, const float *offset, int64_t V, int D, const float *x,
                     int n, float *out) {
    if (V <= 0 || D <= 0 || D % 16 != 0 || n <= 0) return -1;
    weights_t W = {NULL, codes, scale, offset, 0};
#if defined(__AVX2__) && defined(__FMA__)
    return q8_all(&W, x, n, out, V, D);
#else
    return scalar_rows(&W, V, D, x, n, out);
#endif
}
