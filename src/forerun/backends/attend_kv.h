/* Attention over one cache type, included by rows_common.h once per type: it defines KV_T, KV_SUF,
 * KV_GET, KV_LOAD8, KV_AVX2 and KV_WIDENS (1: a type narrower than float32, whose blocks are widened
 * once for a group of rows) before, and this file undefines them at its end. The float32 instance
 * comes first: the other one's widened blocks go through its score_block and value_block. */

/* a . b, the keys b of this cache's type, each widened exactly: 8 lanes, then ((l0 + l4) + (l1 +
 * l5)) + ((l2 + l6) + (l3 + l7)), then the tail (for float32, rows_common.h's dot_f). */
static inline float KVN(dot_kv)(const float *a, const KV_T *b, int D) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int d = 0;
#if KV_AVX2
    if (D >= 8) {
        __m256 v = _mm256_setzero_ps();
        for (; d + 8 <= D; d += 8) v = _mm256_add_ps(v, _mm256_mul_ps(_mm256_loadu_ps(a + d), KV_LOAD8(b + d)));
        _mm256_storeu_ps(acc, v);
    }
#endif
    for (; d + 8 <= D; d += 8)
        for (int l = 0; l < 8; l++) acc[l] += a[d + l] * KV_GET(b + d + l);
    float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (; d < D; d++) s += a[d] * KV_GET(b + d);
    return s;
}

#if KV_AVX2 && defined(__FMA__)
/* dot_kv of qv with the 8 keys kr[0..7], each times scale, into out[0..7]: every key's lanes and
 * final sums are dot_kv's, 8 keys' reductions done at once. D a multiple of 8. With AVX-512 two
 * keys share a vector (lanes 0-7 one key's, 8-15 the next one's): the same lane operations. */
static inline void KVN(dot8_scaled)(const float *qv, const KV_T *const *kr, int D, float scale, float *out) {
    __m256 acc[8];
#if defined(__AVX512F__)
    __m512 acc2[4];
    for (int k = 0; k < 4; k++) acc2[k] = _mm512_setzero_ps();
    for (int d = 0; d < D; d += 8) {
        __m512 qd = _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(qv + d))));
        for (int k = 0; k < 4; k++) acc2[k] = _mm512_add_ps(acc2[k], _mm512_mul_ps(qd, KV_LOAD2X8(kr[2 * k] + d, kr[2 * k + 1] + d)));
    }
    for (int k = 0; k < 4; k++) {
        acc[2 * k] = _mm512_castps512_ps256(acc2[k]);
        acc[2 * k + 1] = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc2[k]), 1));
    }
#else
    for (int k = 0; k < 8; k++) acc[k] = _mm256_setzero_ps();
    for (int d = 0; d < D; d += 8) {
        __m256 qd = _mm256_loadu_ps(qv + d);
        for (int k = 0; k < 8; k++) acc[k] = _mm256_add_ps(acc[k], _mm256_mul_ps(qd, KV_LOAD8(kr[k] + d)));
    }
#endif
    sums8_scaled(acc, scale, out);
}
#endif

/* Ask for the block of slots j .. min(j + KB, R) - 1 of a head's keys or values ([slots][D]) to be
 * brought into the cache. */
static inline void KVN(prefetch)(const KV_T *base, int j, int R, int KB, int D) {
    const char *p = (const char *)(base + (int64_t)j * D);
    const char *e = (const char *)(base + (int64_t)(j + KB < R ? j + KB : R) * D);
    for (; p < e; p += 64) __builtin_prefetch(p, 0, 3);
}

/* acc[0..D-1] += p * vr[0..D-1], element by element (a product, then a sum: every build alike). */
static inline void KVN(add_scaled)(float *acc, float p, const KV_T *vr, int D) {
    int d = 0;
#if KV_AVX2
    const __m256 pv = _mm256_set1_ps(p);
    for (; d + 8 <= D; d += 8)
        _mm256_storeu_ps(acc + d, _mm256_add_ps(_mm256_loadu_ps(acc + d), _mm256_mul_ps(pv, KV_LOAD8(vr + d))));
#endif
    for (; d < D; d++) acc[d] += p * KV_GET(vr + d);
}

/* dst[0..n-1] = src widened to float32 (exact). */
static inline void KVN(widen)(float *dst, const KV_T *src, int n) {
    int i = 0;
#if KV_AVX2
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, KV_LOAD8(src + i));
#endif
    for (; i < n; i++) dst[i] = KV_GET(src + i);
}

/* Scores of rows 0..n-1 against the keys at slots j0 .. j1 - 1 (clipped to each row's lo .. hi), the
 * key of slot j at kb + (j - base) * D: scaled dot products into w[r][j - lo[r]]. */
static inline void KVN(score_block)(int n, const float *const *q, const KV_T *kb, int base, int D, const int32_t *lo,
                                    const int32_t *hi, int j0, int j1, float scale, float *w, int smax) {
    for (int r = 0; r < n; r++) {
        int a = j0 > lo[r] ? j0 : lo[r], b = j1 < hi[r] ? j1 : hi[r];
        float *wr = w + (int64_t)r * smax - lo[r];
        int j = a;
#if KV_AVX2 && defined(__FMA__)
        if (D % 8 == 0)
            for (; j + 8 <= b; j += 8) {
                const KV_T *kr[8];
                for (int k = 0; k < 8; k++) kr[k] = kb + (int64_t)(j + k - base) * D;
                KVN(dot8_scaled)(q[r], kr, D, scale, wr + j);
            }
#endif
        for (; j < b; j++) wr[j] = KVN(dot_kv)(q[r], kb + (int64_t)(j - base) * D, D) * scale;
    }
}

/* Weighted values of slots j0 .. j1 - 1 (clipped to each row's lo .. hi) added to acc[r], in slot
 * order, the value of slot j at vb + (j - base) * D. */
static inline void KVN(value_block)(int n, const KV_T *vb, int base, int D, const int32_t *lo, const int32_t *hi,
                                    int j0, int j1, const float *w, int smax, float *acc) {
    for (int r = 0; r < n; r++) {
        int a = j0 > lo[r] ? j0 : lo[r], b = j1 < hi[r] ? j1 : hi[r];
        const float *wr = w + (int64_t)r * smax - lo[r];
        float *ar = acc + (int64_t)r * D;
#if KV_AVX2 && defined(__AVX512F__)
        if (D % 64 == 0) { /* register sums, 64 columns at a time, carried from block to block through ar */
            for (int d0 = 0; d0 < D; d0 += 64) {
                __m512 s[4];
                for (int u = 0; u < 4; u++) s[u] = _mm512_loadu_ps(ar + d0 + 16 * u);
                for (int j = a; j < b; j++) {
                    const KV_T *vr = vb + (int64_t)(j - base) * D + d0;
                    __m512 p = _mm512_set1_ps(wr[j]);
                    for (int u = 0; u < 4; u++) s[u] = _mm512_add_ps(s[u], _mm512_mul_ps(p, KV_LOAD16(vr + 16 * u)));
                }
                for (int u = 0; u < 4; u++) _mm512_storeu_ps(ar + d0 + 16 * u, s[u]);
            }
            continue;
        }
#elif KV_AVX2
        if (D % 64 == 0) { /* the same in 8-lane vectors */
            for (int d0 = 0; d0 < D; d0 += 64) {
                __m256 s[8];
                for (int u = 0; u < 8; u++) s[u] = _mm256_loadu_ps(ar + d0 + 8 * u);
                for (int j = a; j < b; j++) {
                    const KV_T *vr = vb + (int64_t)(j - base) * D + d0;
                    __m256 p = _mm256_set1_ps(wr[j]);
                    for (int u = 0; u < 8; u++) s[u] = _mm256_add_ps(s[u], _mm256_mul_ps(p, KV_LOAD8(vr + 8 * u)));
                }
                for (int u = 0; u < 8; u++) _mm256_storeu_ps(ar + d0 + 8 * u, s[u]);
            }
            continue;
        }
#endif
        for (int j = a; j < b; j++) KVN(add_scaled)(ar, wr[j], vb + (int64_t)(j - base) * D, D);
    }
}

/* Attention of n rows of one sequence for one head (row r: query q[r] over the keys kh and values
 * vh ([cap, D] of its KV head) at slots lo[r] .. hi[r] - 1, then extra[r][0 .. n_extra[r] - 1];
 * scores scaled, soft-capped where softcap > 0 (Gemma 2: cap * tanh(s / cap), with ``tanh_fn``),
 * softmax, weighted sum into o[r]). Each row's scores, softmax and value sums take the same
 * operations in an order fixed by its own slots, whatever the other rows: so a row's bits do not
 * depend on its pass. The rows share only the reads of the cache: keys and values go by in blocks
 * of about 16 KiB that every row uses while they are in the L1 cache, so a pass of n rows reads a
 * head's keys and values once, not n times (at a context of 1,000 the keys and values are most of
 * what a pass reads). A float16 cache's block is widened once into ``wide`` ([KB][D] floats) where
 * WIDEN_ROWS or more rows share it, and the rows then read floats: the widening is exact, so every
 * product is the one a row alone computes, without the conversion repeated per row (8% of a long
 * prompt's attention). n <= ROW_GROUP. Scratch: w [n][smax], acc [n][D] (smax: the most slots a
 * row sees), wide (NULL: nothing widened). */
#ifndef ROW_GROUP
#define ROW_GROUP 16
#endif
#ifndef WIDEN_ROWS
#define WIDEN_ROWS 8 /* the fewest rows that share a widened block (fewer: each converts its own reads, as cheap) */
#endif

static inline void KVN(attend_rows)(int n, const float *const *q, const KV_T *kh, const KV_T *vh, int D,
                                    const int32_t *lo, const int32_t *hi, const int32_t *const *extra,
                                    const int32_t *n_extra, float scale, float softcap, float (*tanh_fn)(float),
                                    float *w, int smax, float *acc, float *wide, float *const *o) {
    float inv[ROW_GROUP];
    int L = lo[0], R = hi[0];
    for (int r = 1; r < n; r++) {
        L = lo[r] < L ? lo[r] : L;
        R = hi[r] > R ? hi[r] : R;
    }
    const int KB = kv_block(D);
    const int widen = wide != NULL && n >= WIDEN_ROWS;
    /* The cache is out of the CPU's caches by the time a layer comes round again (a step streams
     * every weight in between), and a head's keys are too short a run for the hardware's prefetch
     * to ramp up: so each block of keys (values) is fetched while the one before is worked on, and
     * the first block of values while the last block of keys is. Reads only: no result changes. */
    KVN(prefetch)(kh, L, R, KB, D);
    for (int j0 = L; j0 < R; j0 += KB) { /* scores over the slot ranges, block by block */
        int j1 = j0 + KB < R ? j0 + KB : R;
        if (j1 < R) KVN(prefetch)(kh, j1, R, KB, D);
        else KVN(prefetch)(vh, L, R, KB, D);
        if (widen) {
            KVN(widen)(wide, kh + (int64_t)j0 * D, (j1 - j0) * D);
            score_block_f32(n, q, wide, j0, D, lo, hi, j0, j1, scale, w, smax);
        } else {
            KVN(score_block)(n, q, kh, 0, D, lo, hi, j0, j1, scale, w, smax);
        }
    }
    for (int r = 0; r < n; r++) { /* the extra slots, the caps, the softmax: row by row */
        float *wr = w + (int64_t)r * smax;
        int nr = hi[r] > lo[r] ? hi[r] - lo[r] : 0, S = nr + n_extra[r];
        for (int e = 0; e < n_extra[r]; e++) wr[nr + e] = KVN(dot_kv)(q[r], kh + (int64_t)extra[r][e] * D, D) * scale;
        if (softcap > 0.0f)
            for (int j = 0; j < S; j++) wr[j] = capped(wr[j], softcap, tanh_fn);
        float m = max_score(wr, S);
        inv[r] = 1.0f / softmax_weights(wr, S, m);
        for (int d = 0; d < D; d++) acc[(int64_t)r * D + d] = 0.0f;
    }
    for (int j0 = L; j0 < R; j0 += KB) { /* the weighted values, block by block, in slot order */
        int j1 = j0 + KB < R ? j0 + KB : R;
        if (j1 < R) KVN(prefetch)(vh, j1, R, KB, D);
        if (widen) {
            KVN(widen)(wide, vh + (int64_t)j0 * D, (j1 - j0) * D);
            value_block_f32(n, wide, j0, D, lo, hi, j0, j1, w, smax, acc);
        } else {
            KVN(value_block)(n, vh, 0, D, lo, hi, j0, j1, w, smax, acc);
        }
    }
    for (int r = 0; r < n; r++) {
        const float *wr = w + (int64_t)r * smax;
        int nr = hi[r] > lo[r] ? hi[r] - lo[r] : 0;
        float *ar = acc + (int64_t)r * D;
        for (int e = 0; e < n_extra[r]; e++) KVN(add_scaled)(ar, wr[nr + e], vh + (int64_t)extra[r][e] * D, D);
        for (int d = 0; d < D; d++) o[r][d] = ar[d] * inv[r];
    }
}

/* Attention of a pass's rows, every head: row t's query for head h at q + (t * H + h) * D, its
 * sequence's cache of this layer at kbase[t], vbase[t] + layer * KVH * cap[t] * D ([KVH][cap[t]][D]),
 * its slots lo[t] .. hi[t] - 1 then extra[xp[t] .. xp[t + 1] - 1]; out as q. Consecutive rows of one
 * sequence go together (up to ROW_GROUP) through attend_rows, head by head: a row's bits are what
 * it gets alone, so a row's result does not depend on its pass. OpenMP
 * splits (row group, head) jobs, never one row's sums. 0, or -2 out of memory. */
static inline int KVN(attend_pass)(const float *q, const int64_t *kbase, const int64_t *vbase, const int64_t *cap,
                              int64_t layer, int N, int H, int KVH, int D, const int32_t *lo, const int32_t *hi,
                              const int32_t *xp, const int32_t *extra, float scale, float softcap,
                              float (*tanh_fn)(float), float *out) {
    int group = H / KVH, smax = 1, ng = 0;
    for (int t = 0; t < N; t++) {
        int s = hi[t] - lo[t] + xp[t + 1] - xp[t];
        if (s > smax) smax = s;
    }
    int *start = (int *)malloc(sizeof(int) * (size_t)(N + 1));
    if (!start) return -2;
    for (int t = 0; t < N; t++) /* row groups: runs of rows on one cache, ROW_GROUP at most */
        if (t == 0 || kbase[t] != kbase[t - 1] || vbase[t] != vbase[t - 1] || cap[t] != cap[t - 1] ||
            t - start[ng - 1] == ROW_GROUP)
            start[ng++] = t;
    start[ng] = N;
    int failed = 0;
#pragma omp parallel
    {
        float *w = (float *)malloc(sizeof(float) * (size_t)smax * ROW_GROUP);
        float *acc = (float *)malloc(sizeof(float) * (size_t)D * ROW_GROUP);
        /* a block to widen only where a row group can reach WIDEN_ROWS (not in a one-token step) */
        const int widens = KV_WIDENS && N >= WIDEN_ROWS;
        float *wide = widens ? (float *)malloc(sizeof(float) * (size_t)kv_block(D) * D) : NULL;
        if (!w || !acc || (widens && !wide)) {
#pragma omp atomic write
            failed = 1;
        }
        /* One row group: each thread takes consecutive heads, so the heads that share keys and values
         * mostly read them on one core (from its L2 cache after the first). Several: round robin, since
         * a causal pass's later rows see more keys. */
        int tid = 0, nt = 1;
#ifdef _OPENMP
        tid = omp_get_thread_num();
        nt = omp_get_num_threads();
#endif
        int J = ng * H, j0 = ng == 1 ? (int)((int64_t)J * tid / nt) : tid, j1 = ng == 1 ? (int)((int64_t)J * (tid + 1) / nt) : J;
        for (int job = j0; job < j1; job += ng == 1 ? 1 : nt) {
            if (!w || !acc || (widens && !wide)) continue;
            int g = job / H, h = job % H, t0 = start[g], n = start[g + 1] - t0;
            int64_t off = (layer * KVH + h / group) * cap[t0] * D;
            const KV_T *kh = (const KV_T *)(intptr_t)kbase[t0] + off, *vh = (const KV_T *)(intptr_t)vbase[t0] + off;
            const float *qr[ROW_GROUP];
            float *orow[ROW_GROUP];
            const int32_t *ex[ROW_GROUP];
            int32_t nex[ROW_GROUP];
            for (int r = 0; r < n; r++) {
                qr[r] = q + ((int64_t)(t0 + r) * H + h) * D;
                orow[r] = out + ((int64_t)(t0 + r) * H + h) * D;
                ex[r] = extra + xp[t0 + r];
                nex[r] = xp[t0 + r + 1] - xp[t0 + r];
            }
            KVN(attend_rows)(n, qr, kh, vh, D, lo + t0, hi + t0, ex, nex, scale, softcap, tanh_fn, w, smax, acc, wide,
                             orow);
        }
        free(w);
        free(acc);
        free(wide);
    }
    free(start);
    return failed ? -2 : 0;
}

#undef KV_T
#undef KV_SUF
#undef KV_GET
#undef KV_LOAD8
#undef KV_LOAD16
#undef KV_LOAD2X8
#undef KV_AVX2
#undef KV_WIDENS
