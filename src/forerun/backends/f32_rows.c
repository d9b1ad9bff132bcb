/* Float32 product of a weight matrix with a few activation rows: out[r][v] = sum_k w[v][k] x[r][k].
 *
 * Built for the LM head of a verify pass on a small CPU: V = 262,144 vocabulary rows of D = 640,
 * n = 1-32 activation rows. The weights (671 MB) do not fit in any cache, so the pass is bound by
 * memory traffic for a few rows and by multiply-adds past that; a general matrix product
 * (oneDNN, MKL) is tuned for larger n and took 2-3x the one-row time for 4-17 rows here. This
 * kernel reads every weight row from memory once for all n rows: each register tile holds 4
 * weight rows x up to 3 activation rows of 8-lane partial sums (12 of the 16 vector registers;
 * 2 x 6, 3 x 4 and 1 x 12 measured within noise of it), the weights go through in 64 KB blocks
 * that every group of 3 activation rows (in L1) takes in turn while the next block is
 * prefetched, and OpenMP splits the vocabulary. The tiling decides only which products run
 * together, never the order of any output's sums, so each output row is the same whatever n is.
 *
 * The summation order differs from other kernels' (8 lanes, then a fixed pairwise lane sum), so
 * results can differ from theirs in the last bits, as the other kernels differ among themselves.
 * Built for each instruction set (ckernels.py); without AVX2 and FMA a plain C loop is used.
 */
#include <stdint.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif
#include "rows_common.h"

/* The plain C product (no AVX2 and FMA, or D not a multiple of 8): weights of type WT [V][D],
 * each widened to float by TO_FLOAT, times x [n][D] into out [n][V]. */
#define ROWS_PLAIN(WT, TO_FLOAT)                                                  \
    _Pragma("omp parallel for schedule(static)")                                  \
    for (int64_t v = 0; v < V; v++) {                                             \
        const WT *wv = w + v * D;                                                 \
        for (int r = 0; r < n; r++) {                                             \
            const float *xr = x + (int64_t)r * D;                                 \
            float s = 0.0f;                                                       \
            for (int k = 0; k < D; k++) s += TO_FLOAT(wv[k]) * xr[k];             \
            out[(int64_t)r * V + v] = s;                                          \
        }                                                                         \
    }

#ifndef TV
#define TV 4 /* weight rows per tile */
#endif
#ifndef TR
#define TR 3 /* activation rows per tile */
#endif

int forerun_f32_threads(int n) { return rows_threads(n); }

#if defined(__AVX2__) && defined(__FMA__)

/* The k loop of a tile over nr activation rows. Inlined into each call: called with the constant
 * TR (the common case) it is fully unrolled, with a smaller nr (the last group) it loops.
 * Generated for float32 weights and for float16 weights (converted to float32 in registers,
 * F16C), which halve the bytes read: the products and sums are the same float32 operations. */
#define TILE_FUNCS(SUF, WT, LOADW)                                                                         \
    static inline __attribute__((always_inline)) void tile_k##SUF(const WT *const *wp, const float *xr,     \
                                                                  int D, int nr, __m256 acc[TV][TR]) {     \
        for (int k = 0; k < D; k += 8) {                                                                   \
            __m256 wa[TV];                                                                                 \
            for (int a = 0; a < TV; a++) wa[a] = LOADW(wp[a] + k);                                         \
            for (int b = 0; b < nr; b++) {                                                                 \
                __m256 xb = _mm256_loadu_ps(xr + (int64_t)b * D + k);                                      \
                for (int a = 0; a < TV; a++) acc[a][b] = _mm256_fmadd_ps(wa[a], xb, acc[a][b]);           \
            }                                                                                              \
        }                                                                                                  \
    }                                                                                                      \
    /* Rows [v0, v0 + tv) of w against rows [r0, r0 + tr) of x, tv <= TV, tr <= TR, D % 8 == 0. */        \
    static inline void tile##SUF(const WT *w, const float *x, float *out, int64_t V, int D, int64_t v0,     \
                                 int tv, int r0, int tr) {                                                 \
        __m256 acc[TV][TR];                                                                                \
        const WT *wp[TV];                                                                                  \
        for (int a = 0; a < TV; a++) {                                                                     \
            wp[a] = w + (v0 + (a < tv ? a : 0)) * D; /* a short tile repeats its first row, unused */      \
            for (int b = 0; b < TR; b++) acc[a][b] = _mm256_setzero_ps();                                  \
        }                                                                                                  \
        const float *xr = x + (int64_t)r0 * D;                                                             \
        if (tr == TR)                                                                                      \
            tile_k##SUF(wp, xr, D, TR, acc);                                                               \
        else                                                                                               \
            tile_k##SUF(wp, xr, D, tr, acc);                                                               \
        for (int a = 0; a < tv; a++)                                                                       \
            for (int b = 0; b < tr; b++) out[(int64_t)(r0 + b) * V + v0 + a] = hsum8(acc[a][b]);           \
    }                                                                                                      \
    /* Blocks of vb weight rows (about 64 KB of float32): the first group of activation rows brings   \
     * the block in from memory, the other groups find it in cache; each group's activations (TR x D   \
     * floats) stay in L1 throughout. Small blocks also split small matrices evenly between threads. */ \
    static void rows##SUF(const WT *w, int64_t V, int D, const float *x, int n, float *out) {              \
        int64_t vb = (int64_t)(16384 / D) / TV * TV;                                                       \
        if (vb < TV) vb = TV;                                                                              \
        int64_t blocks = (V + vb - 1) / vb;                                                                \
        _Pragma("omp parallel for schedule(static)")                                                       \
        for (int64_t bi = 0; bi < blocks; bi++) {                                                          \
            int64_t b0 = bi * vb, b1 = b0 + vb < V ? b0 + vb : V;                                          \
            /* While the later groups work on this block from cache, the next block is prefetched: \
             * its lines spread evenly over their tiles, so memory never idles. */                    \
            const char *nx = (const char *)(w + b1 * D);                                                   \
            int64_t nbytes = (b1 < V ? (b1 + vb < V ? vb : V - b1) * D : 0) * (int64_t)sizeof(WT);        \
            int64_t ntiles = ((b1 - b0 + TV - 1) / TV) * ((n - 1) / TR);                                   \
            int64_t per = ntiles > 0 ? (nbytes / 64 + ntiles - 1) / ntiles : 0, sent = 0;                  \
            for (int r0 = 0; r0 < n; r0 += TR) {                                                           \
                int tr = n - r0 < TR ? n - r0 : TR;                                                        \
                for (int64_t v0 = b0; v0 < b1; v0 += TV) {                                                 \
                    if (r0 > 0)                                                                            \
                        for (int64_t q = 0; q < per && sent < nbytes; q++, sent += 64)                     \
                            _mm_prefetch(nx + sent, _MM_HINT_T0);                                          \
                    tile##SUF(w, x, out, V, D, v0, (int)(b1 - v0 < TV ? b1 - v0 : TV), r0, tr);            \
                }                                                                                          \
            }                                                                                              \
        }                                                                                                  \
    }

#define LOAD_F32(p) _mm256_loadu_ps(p)
TILE_FUNCS(_f32, float, LOAD_F32)
#ifdef __F16C__
#define LOAD_F16(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
TILE_FUNCS(_f16, uint16_t, LOAD_F16)
#endif
#endif

/* w [V][D], x [n][D], out [n][V], all float32 and contiguous. Returns 0, or -1 for bad sizes. */
int forerun_f32_rows(const float *w, int64_t V, int D, const float *x, int n, float *out) {
    if (V <= 0 || D <= 0 || n <= 0) return -1;
#if defined(__AVX2__) && defined(__FMA__)
    if (D % 8 == 0) {
        rows_f32(w, V, D, x, n, out);
        return 0;
    }
#endif
    ROWS_PLAIN(float, (float));
    return 0;
}


/* As forerun_f32_rows with float16 weights w [V][D] (IEEE half, as torch.float16 stores them). */
int forerun_f16w_rows(const uint16_t *w, int64_t V, int D, const float *x, int n, float *out) {
    if (V <= 0 || D <= 0 || n <= 0) return -1;
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    if (D % 8 == 0) {
        rows_f16(w, V, D, x, n, out);
        return 0;
    }
#endif
    ROWS_PLAIN(uint16_t, half_to_float);
    return 0;
}
