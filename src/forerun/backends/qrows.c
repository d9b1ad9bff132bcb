/* Integer products of GGUF-quantized weights with a few activation rows, for the native backend's
 * GGUF path (with ``qact.c``, the activations, and ``qlayer.c``, a whole layer around the products,
 * built into one library).
 *
 * Why: a verify pass of K + 1 rows should cost about one one-token step. A one-token step of a
 * small model reads every weight once and is bound by memory; each further row only adds
 * arithmetic. So every weight block is read once per pass and used for all its rows, and the
 * arithmetic is integer: activations are quantized per row and per 32 values to 8 bits (scale
 * amax / 127, as llama.cpp's CPU path quantizes them for its block dot products), so a block's
 * dot product is an exact integer sum of code products.
 *
 * Weight layout (``qweight_t``), built once at load by ``forerun.backends.qweights``: weight rows in
 * groups of 8 (the last group padded with zero rows); per group and per 32-column block the codes
 * of all 8 rows are interleaved 4 columns at a time, so one 32-byte vector holds 4 consecutive
 * codes of each of the 8 rows, and one (u8 x s8) multiply-add of it against a broadcast of 4
 * activation codes leaves 8 lanes, one per weight row: no horizontal sums, no shuffles.
 *   kind U4: unsigned 4-bit codes, 4 vectors per block; vector i holds columns 4i..4i+3 in its low
 *            nibbles and 4(i+4)..4(i+4)+3 in its high ones;
 *   kind U5, U6: unsigned 5- and 6-bit codes, as U4's 128 bytes (their low 4 bits) followed by one
 *            32-byte bit plane per further bit (U5: bit 4; U6: bits 4 and 5): byte k of a plane
 *            holds, as its bit j, that bit of the code at byte k of vector j (160 and 192 bytes a
 *            block against U8's 256: Q5_0, Q5_1, Q5_K and Q6_K read what their GGUF blocks hold);
 *   kind U8: unsigned codes < 128, 8 vectors per block; vector j holds columns 4j..4j+3;
 *   kind S8: signed codes, same as U8 (llama.cpp's sign trick makes the product u8 x s8).
 * Each weight is  w = scale * (code + zb) + offset  per group of 32 columns (sub = 1) or 16
 * (sub = 2, Q6_K), with an integer code bias zb (-8 for Q4_0, -16 for Q5_0, -32 for Q6_K) and an
 * offset for the types with a minimum (Q4_1, Q5_1, Q4_K, Q5_K). Scales and offsets are stored
 * [group][block][sub][8 rows], as float16 where that holds them exactly (f16 = 1), as int8
 * multipliers of a float32 factor per 256 columns where the file has them so (f16 = FACTORED: the
 * K-quants' sub-scales and super-block d, 1 byte a group instead of 4), else float32.
 *
 * The sums, for output (activation row r, weight row v), whatever the pass size or the CPU:
 *   acc = 0; for each block b in order, for each sub-group s in order:
 *     isum = sum of code * xq over the sub-group (exact int32) + zb * sum of xq over it
 *     acc = fma((float)isum, scale * dx, acc)            dx: row r's scale of block b
 *     acc = fma(offset, dx * (float)sum of xq over it, acc)   (types with an offset)
 * Integer sums are exact, every float operation is written out (the file is built with
 * -ffp-contract=off, fma explicit), so the portable, AVX2 and AVX-512 VNNI builds of this file give
 * the same bits, and a row's outputs do not depend on the other rows of its pass: a verify pass
 * is batch-invariant by construction. Threads split weight-row groups, never one output's sums.
 *
 * The same source is compiled once per instruction set (portable, -mavx2 -mfma -mf16c, with
 * AVX-VNNI or with AVX-512 VNNI added: ckernels.BUILDS); the Python side loads the fastest build
 * the CPU reports it can run (or the one FORERUN_KERNEL asks for). The SIMD tile is written once
 * in qtile.h for 256-bit vectors (one row group) and, in the AVX-512 VNNI build, 512-bit ones (two
 * row groups side by side: the same lane operations, so the same bits), which that build takes
 * for passes of two rows or more.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "rows_common.h"

#include "qrows.h"

int forerun_q_threads(int n) { return rows_threads(n); }

/* U4, U5, U6: nibbles in U4's 128 bytes, then 0, 1 or 2 bit planes of 32 bytes */
static inline int nibble_kind(int kind) { return kind == U4 || kind == U5 || kind == U6; }
static inline int code_planes(int kind) { return kind == U5 ? 1 : kind == U6 ? 2 : 0; }
static inline int code_bytes(int kind) { return nibble_kind(kind) ? 128 + 32 * code_planes(kind) : 256; }

/* ---- one group of 8 weight rows against all activation rows ---------------------------------- */

/* Scale (offset) i of the layout, fi that of its factor where they are FACTORED (an exact product). */
static inline float stored_at(const void *p, const float *fac, int f16, int64_t i, int64_t fi) {
    if (f16 == FACTORED) return fac[fi] * (float)((const int8_t *)p)[i];
    return f16 ? half_to_float(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}
/* FACTORED factors are laid [group][256-column block][8 rows]: from one group's to the next one's, */
static inline int64_t fac_stride(const qweight_t *w) { return (int64_t)((w->D / 32 + 7) / 8) * 8; }
/* and the index of group g's factor for 32-column block b (lane 0). */
static inline int64_t fac_index(const qweight_t *w, int64_t g, int b) { return g * fac_stride(w) + (b / 8) * 8; }

/* Code of lane l (weight row), column c (0..31) of a block's interleaved codes, as an integer. */
static inline int code_at(const uint8_t *blk, int kind, int l, int c) {
    int j = c / 4, e = c % 4;
    if (nibble_kind(kind)) {
        uint8_t b = blk[(j & 3) * 32 + l * 4 + e];
        int code = j < 4 ? (b & 15) : (b >> 4);
        for (int p = 0; p < code_planes(kind); p++) code |= ((blk[128 + 32 * p + l * 4 + e] >> j) & 1) << (4 + p);
        return code;
    }
    if (kind == U8) return blk[j * 32 + l * 4 + e];
    return (int8_t)blk[j * 32 + l * 4 + e];
}

/* The reference: plain C, every build has it (FORERUN_KERNEL=portable runs it). Group g's outputs
 * for activation row r go to out[r * ldo + lane], as in qtile.h's group_simd. */
static void group_portable(const qweight_t *w, const qact_t *a, int64_t g, float *out, int64_t ldo) {
    int nb = w->D / 32, sub = w->sub;
    const uint8_t *cg = w->codes + g * nb * code_bytes(w->kind);
    int64_t sbase = g * nb * sub * 8;
    int lanes = (int)(w->V - g * 8 < 8 ? w->V - g * 8 : 8);
    for (int r = 0; r < a->N; r++) {
        const int8_t *xr = a->xq + (int64_t)r * a->D;
        for (int l = 0; l < lanes; l++) {
            float acc = 0.0f;
            for (int b = 0; b < nb; b++) {
                const uint8_t *blk = cg + (int64_t)b * code_bytes(w->kind);
                int64_t xi = (int64_t)r * nb + b;
                float dx = a->dx[xi];
                for (int s = 0; s < sub; s++) {
                    int c0 = sub == 1 ? 0 : 16 * s, c1 = sub == 1 ? 32 : 16 * s + 16;
                    int32_t isum = 0;
                    for (int c = c0; c < c1; c++) isum += code_at(blk, w->kind, l, c) * xr[b * 32 + c];
                    int32_t bsum = sub == 1 ? a->bs[2 * xi] + a->bs[2 * xi + 1] : a->bs[2 * xi + s];
                    isum += w->zb * bsum;
                    int64_t si = sbase + ((int64_t)b * sub + s) * 8 + l;
                    int64_t fi = fac_index(w, g, b) + l;
                    acc = fmaf((float)isum, stored_at(w->scale, w->sfac, w->f16, si, fi) * dx, acc);
                    if (w->offset)
                        acc = fmaf(stored_at(w->offset, w->ofac, w->f16, si, fi), a->xs[3 * xi + (sub == 1 ? 0 : 1 + s)], acc);
                }
            }
            out[(int64_t)r * ldo + l] = acc;
        }
    }
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define HAVE_SIMD 1
/* How far ahead the tile prefetches a weight's stream (bytes): into L1 (qweight_t.pf_l1) or L2 */
#ifndef PF_L1_AHEAD
#define PF_L1_AHEAD 8192
#endif
#ifndef PF_L2_AHEAD
#define PF_L2_AHEAD 16384
#endif
#ifndef RT
#if defined(__AVX512VL__)
#define RT 8 /* activation rows per register tile: 32 vector registers hold 8 rows' sums */
#else
#define RT 4 /* 16 vector registers: 4 rows */
#endif
#endif

static inline __m256 load8_scales(const void *p, const float *fac, int f16, int64_t i, int64_t fi) {
    if (f16 == FACTORED) /* int8 -> float and the product are exact: the bits of the float32 layout */
        return _mm256_mul_ps(_mm256_loadu_ps(fac + fi),
                             _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((const int8_t *)p + i)))));
    if (f16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)));
    return _mm256_loadu_ps((const float *)p + i);
}

/* Keep v's running sum where it is written: without it GCC reassociates a tile's int16 additions
 * into one balanced tree per block, which keeps every product of the block live at once and spills
 * them to the stack (about a quarter slower for 4-row tiles). The sums are exact either way. */
#define IN_ORDER(v) __asm__("" : "+x"(v))

#if defined(FORERUN_EMULATE_VNNI) && !defined(__AVX512VNNI__)
/* Tests only: the VNNI code path on a CPU without VNNI, vpdpbusd done with AVX2 (exact). */
#define VNNI 1
static inline __m256i emulated_dpbusd(__m256i acc, __m256i u, __m256i s) {
    __m256i lo8 = _mm256_set1_epi16(0x00FF);
    __m256i ue = _mm256_and_si256(u, lo8), uo = _mm256_srli_epi16(u, 8);
    __m256i se = _mm256_srai_epi16(_mm256_slli_epi16(s, 8), 8), so = _mm256_srai_epi16(s, 8);
    return _mm256_add_epi32(acc, _mm256_add_epi32(_mm256_madd_epi16(ue, se), _mm256_madd_epi16(uo, so)));
}
#define DPBUSD emulated_dpbusd
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define VNNI 1
#define DPBUSD _mm256_dpbusd_epi32
#elif defined(__AVXVNNI__)
#define VNNI 1 /* the same instruction in its VEX form (AVX-VNNI: Alder Lake and later, without AVX-512) */
#define DPBUSD _mm256_dpbusd_avx_epi32
#else
#define VNNI 0
#endif

/* int16 span of a weight (see qtile.h's group_tile): how many vectors of pair sums fit in int16. */
static inline int span_of(const qweight_t *w) {
    if (w->kind == U4) return 8 / w->sub;
    if (w->kind == S8) return 1;
    return w->cmax < 32 ? 4 : w->cmax < 64 ? 2 : 1;
}

#define QT_W 256
#include "qtile.h"
#if VNNI && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define PAIR 2 /* row groups a 512-bit tile takes */
#ifndef PAIR_ROWS
#define PAIR_ROWS 2 /* the fewest activation rows it takes (one row: the 256-bit tile streams the weights faster) */
#endif
#define QT_W 512
#include "qtile.h"
#else
#define PAIR 1
#endif
#else
#define HAVE_SIMD 0
#define PAIR 1
#endif

static int force_portable = 0;

/* 1: every product takes the plain C reference even in a SIMD build (tests compare the two). */
void forerun_q_portable(int on) { force_portable = on; }

/* n floats to float16 bits as the cache stores keys and values (tests: every build against torch). */
void forerun_q_to_half(const float *x, uint16_t *out, int n) { floats_to_half(out, x, n); }

/* Row groups g .. g + n - 1 (n <= PAIR, all of w) against every row of a, outputs to
 * out[r * ldo + 8 * (group - g) + lane]: this build's SIMD tiles (two groups at once in 512-bit
 * vectors where the build has them, from w->wide rows on: measured per weight, see
 * qweights.tune_wide), or the plain C reference where it is forced. Same bits either way. */
static inline void run_groups(const qweight_t *w, const qact_t *a, int64_t g, int n, float *out, int64_t ldo) {
    if (w->many && a->N >= w->many_rows) w = w->many; /* the same codes, sums and order: the same bits */
#if HAVE_SIMD
    if (!force_portable) {
#if PAIR == 2
        if (n == 2 && a->N >= (w->wide > 0 ? w->wide : PAIR_ROWS) &&
            group_simd_512(w, a, g, out, ldo, (int)(w->V - (g + 1) * 8 < 8 ? w->V - (g + 1) * 8 : 8)))
            return;
#endif
        for (int k = 0; k < n; k++) group_simd_256(w, a, g + k, out + 8 * k, ldo, 0);
        return;
    }
#endif
    for (int k = 0; k < n; k++) group_portable(w, a, g + k, out + 8 * k, ldo);
}

/* The stacked parts' row groups counted in order: part p's are start[p] .. start[p + 1] - 1; and
 * their units of work, PAIR groups each (the last of a part may hold one): part p's are
 * ustart[p] .. ustart[p + 1] - 1. */
static void group_starts(const qweight_t *w, int parts, int64_t start[9]) {
    start[0] = 0;
    for (int p = 0; p < parts; p++) start[p + 1] = start[p] + (w[p].V + 7) / 8;
}
static void unit_starts(const qweight_t *w, int parts, int64_t ustart[9]) {
    ustart[0] = 0;
    for (int p = 0; p < parts; p++) ustart[p + 1] = ustart[p] + ((w[p].V + 7) / 8 + PAIR - 1) / PAIR;
}

/* out[r][col + v] (row stride ldo) for all rows of a and the weight rows of every part: the
 * parts of a stacked weight (q, k and v; gate and up) share one loop over their row groups. */
void q_matmul(const qweight_t *w, int parts, const qact_t *a, float *out, int64_t ldo) {
    int64_t ustart[9];
    unit_starts(w, parts, ustart);
#pragma omp parallel for schedule(static)
    for (int64_t ui = 0; ui < ustart[parts]; ui++) {
        int p = 0;
        while (ui >= ustart[p + 1]) p++;
        int64_t g = (ui - ustart[p]) * PAIR, G = (w[p].V + 7) / 8;
        run_groups(&w[p], a, g, G - g < PAIR ? (int)(G - g) : PAIR, out + w[p].col + g * 8, ldo);
    }
}

static int sizes_ok(const qweight_t *w, int parts, int N) {
    if (N <= 0 || parts < 1 || parts > 8) return 0;
    for (int p = 0; p < parts; p++)
        if (w[p].D != w[0].D || w[p].D <= 0 || w[p].D % 32 || w[p].V <= 0) return 0;
    return 1;
}

/* The LM head's one entry: each row's k (1 or 2) largest outputs without storing the outputs.
 * For each row r of x: idx[r][0] the index (counted over the parts' rows in order, as
 * forerun_q_linear's columns) of its largest output, val[r][0] that output; with k = 2 also the
 * runner-up. Every output is computed exactly as forerun_q_linear computes it, and equal values
 * keep the lower index first with NaN above everything (torch.argmax's rule): each thread keeps
 * the top k of its contiguous range of row groups, and the ranges are merged in order. So the
 * answer is the top k of forerun_q_linear's outputs, for any thread count and any pass size.
 * f16_scales: activation scales rounded to float16 (qact.c, half_scales).
 * 0, -1 bad sizes, -2 out of memory. */
static inline int beats(float v, float best) { return v > best || (v != v && best == best); }

/* Push (v, i) into a top-k list (k 1 or 2) kept as b[0..k), bi[0..k) (index -1: empty). Indices
 * arrive in increasing order, so an equal value never displaces an earlier one. */
static inline void top_push(float v, int64_t i, int k, float *b, int64_t *bi) {
    if (bi[0] < 0 || beats(v, b[0])) {
        if (k == 2) { b[1] = b[0]; bi[1] = bi[0]; }
        b[0] = v; bi[0] = i;
    } else if (k == 2 && (bi[1] < 0 || beats(v, b[1]))) {
        b[1] = v; bi[1] = i;
    }
}

/* Whether any of o[0..n) (n a multiple of 8) is NaN or above floor: the filter before the exact scan. */
static int chunk_may_beat(const float *o, int n, float floor) {
#if HAVE_SIMD
    __m256 m = _mm256_set1_ps(floor), hit = _mm256_setzero_ps();
    for (int j = 0; j < n; j += 8) {
        __m256 v = _mm256_loadu_ps(o + j);
        hit = _mm256_or_ps(hit, _mm256_cmp_ps(v, m, _CMP_NLE_UQ)); /* v > floor, or unordered */
    }
    return _mm256_movemask_ps(hit) != 0;
#else
    for (int j = 0; j < n; j++)
        if (!(o[j] <= floor)) return 1;
    return 0;
#endif
}

int forerun_q_top(const qweight_t *w, int parts, const float *x, int N, int k, int f16_scales, int64_t *idx,
                  float *val) {
    if (!sizes_ok(w, parts, N) || k < 1 || k > 2) return -1;
    int64_t start[9];
    group_starts(w, parts, start);
    enum { CH = 64 }; /* row groups per scan: 512 outputs per activation row stay in cache */
    const int nt = rows_threads(0);
    qact_t a;
    float *tv = (float *)malloc(sizeof(float) * (size_t)nt * N * k);         /* per thread and row: top k */
    int64_t *ti = (int64_t *)malloc(sizeof(int64_t) * (size_t)nt * N * k);  /* and their indices (-1: none) */
    float *bufs = (float *)malloc(sizeof(float) * (size_t)nt * N * CH * 8);
    int rc = q_act_quantize(x, N, w->D, f16_scales, &a) != 0 || !tv || !ti || !bufs ? -2 : 0;
    if (rc == 0) {
        for (int64_t i = 0; i < (int64_t)nt * N * k; i++) ti[i] = -1;
#pragma omp parallel num_threads(nt)
        {
            int t = 0, used = 1;
#ifdef _OPENMP
            t = omp_get_thread_num();
            used = omp_get_num_threads();
#endif
            float *buf = bufs + (size_t)t * N * CH * 8, *bv = tv + (size_t)t * N * k;
            int64_t *bi = ti + (size_t)t * N * k;
            int64_t G = start[parts], lo = G * t / used, hi = G * (t + 1) / used;
            for (int64_t c0 = lo; c0 < hi; c0 += CH) {
                int64_t c1 = c0 + CH < hi ? c0 + CH : hi;
                int p = 0;
                for (int64_t gi = c0; gi < c1;) {
                    while (gi >= start[p + 1]) p++;
                    int n = gi + PAIR <= c1 && gi + PAIR <= start[p + 1] ? PAIR : 1;
                    run_groups(&w[p], &a, gi - start[p], n, buf + (gi - c0) * 8, CH * 8);
                    gi += n;
                }
                for (int r = 0; r < N; r++) {
                    const float *o = buf + (int64_t)r * CH * 8;
                    float *rb = bv + (int64_t)r * k;
                    int64_t *ri = bi + (int64_t)r * k;
                    /* the chunk against the row's current k-th value first (a filter: the lanes past a
                     * weight's last row hold stale values, which can only send a chunk to the scan) */
                    if (ri[k - 1] >= 0 && !chunk_may_beat(o, (int)(c1 - c0) * 8, rb[k - 1])) continue;
                    p = 0;
                    for (int64_t gi = c0; gi < c1; gi++) {
                        while (gi >= start[p + 1]) p++;
                        int64_t g = gi - start[p], first = w[p].col + g * 8;
                        int lanes = (int)(w[p].V - g * 8 < 8 ? w[p].V - g * 8 : 8);
                        for (int l = 0; l < lanes; l++) top_push(o[(gi - c0) * 8 + l], first + l, k, rb, ri);
                    }
                }
            }
        }
        for (int r = 0; r < N; r++) { /* the threads' ranges in order: the first maxima overall */
            for (int j = 0; j < k; j++) idx[(int64_t)r * k + j] = -1;
            for (int t = 0; t < nt; t++)
                for (int j = 0; j < k; j++) {
                    int64_t i = ti[((size_t)t * N + r) * k + j];
                    if (i >= 0) top_push(tv[((size_t)t * N + r) * k + j], i, k, val + (int64_t)r * k, idx + (int64_t)r * k);
                }
        }
    }
    q_act_free(&a);
    free(tv);
    free(ti);
    free(bufs);
    return rc;
}

/* out [N][ldo] = x [N][D] . w^T for the parts of one stacked weight, activations quantized here
 * (f16_scales: qact.c, half_scales). 0, -1 bad sizes, -2 out of memory. */
int forerun_q_linear(const qweight_t *w, int parts, const float *x, int N, float *out, int64_t ldo, int f16_scales) {
    if (!sizes_ok(w, parts, N)) return -1;
    for (int p = 0; p < parts; p++)
        if (w[p].col + w[p].V > ldo) return -1;
    qact_t a;
    int rc = q_act_quantize(x, N, w->D, f16_scales, &a);
    if (rc == 0) q_matmul(w, parts, &a, out, ldo);
    q_act_free(&a);
    return rc;
}
