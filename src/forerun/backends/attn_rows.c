/* Attention computed one (row, head) at a time, the same way whatever the pass: a verify pass's
 * row gives bit for bit what a one-token step at that position gives.
 *
 * Library attention (PyTorch's scaled_dot_product_attention) tiles its products and reductions
 * by the shape of the whole pass, so a row of a 9-row pass and the same row run alone round
 * differently (measured on the bundled model: up to 2e-5 in a layer's output). Here every
 * (row, head) pair is one independent job: its scores over the keys it sees (a consecutive
 * range of cache slots, then an optional list of further slots: a tree row's ancestors and
 * itself), their softmax, and the weighted sum of values, each summed in a fixed order that
 * depends only on that row's keys. OpenMP splits the pairs, never one pair's sums.
 *
 * q: [T, H, D]; k, v: one layer's cache [KVH, cap, D]; out: [T, H, D]; all float32, contiguous.
 * Row t sees slots lo[t] .. hi[t]-1, then extra[xp[t] .. xp[t+1]-1].
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

int forerun_attn_threads(int n) {
#ifdef _OPENMP
    if (n > 0) omp_set_num_threads(n);
    return omp_get_max_threads();
#else
    (void)n;
    return 1;
#endif
}

/* exp(x) for x <= 0 (a score minus the row's maximum): 2^n * p(r), Cephes-style polynomial;
 * plain float operations, so the loops that call it vectorise. */
static inline float exp_nonpos(float x) {
    x = x < -87.0f ? -87.0f : x;
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

static float dot(const float *a, const float *b, int D) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int d = 0;
    for (; d + 8 <= D; d += 8)
        for (int l = 0; l < 8; l++) acc[l] += a[d + l] * b[d + l];
    float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (; d < D; d++) s += a[d] * b[d];
    return s;
}

/* The keys and values k, v [T, KVH, D] of a pass's rows into their sequences' layer caches: row t
 * goes to position pos[t] of the cache at kp[t], vp[t] ([KVH, caps[t], D]). Plain copies, one
 * call per layer for every sequence of a batched pass. */
void forerun_store_rows(const float *k, const float *v, const int64_t *kp, const int64_t *vp, const int64_t *caps,
                        const int32_t *pos, int T, int KVH, int D) {
    for (int t = 0; t < T; t++)
        for (int h = 0; h < KVH; h++) {
            int64_t at = ((int64_t)h * caps[t] + pos[t]) * D;
            memcpy((float *)(intptr_t)kp[t] + at, k + ((int64_t)t * KVH + h) * D, sizeof(float) * (size_t)D);
            memcpy((float *)(intptr_t)vp[t] + at, v + ((int64_t)t * KVH + h) * D, sizeof(float) * (size_t)D);
        }
}

/* Rows of several sequences in one call: row t reads the layer cache at kp[t], vp[t] (each
 * [KVH, caps[t], D]); everything else as forerun_attn_rows. Each (row, head) job is computed
 * exactly as there, so a row's result does not depend on the sequences beside it. */
int forerun_attn_rows_multi(const float *q, const int64_t *kp, const int64_t *vp, const int64_t *caps, int T, int H,
                            int KVH, int D, const int32_t *lo, const int32_t *hi, const int32_t *xp,
                            const int32_t *extra, float scale, float *out) {
    int smax = 0;
    for (int t = 0; t < T; t++) {
        int s = hi[t] - lo[t] + xp[t + 1] - xp[t];
        if (s > smax) smax = s;
    }
    int group = H / KVH;
    int failed = 0;
#pragma omp parallel
    {
        float *w = (float *)malloc(sizeof(float) * (size_t)(smax > 0 ? smax : 1));
        int32_t *slot = (int32_t *)malloc(sizeof(int32_t) * (size_t)(smax > 0 ? smax : 1));
        if (w == NULL || slot == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int job = 0; job < T * H; job++) {
            if (w == NULL || slot == NULL) continue;
            int t = job / H, h = job % H;
            const float *qv = q + ((int64_t)t * H + h) * D;
            const float *kh = (const float *)(intptr_t)kp[t] + (int64_t)(h / group) * caps[t] * D;
            const float *vh = (const float *)(intptr_t)vp[t] + (int64_t)(h / group) * caps[t] * D;
            int S = 0;
            for (int j = lo[t]; j < hi[t]; j++) slot[S++] = j;
            for (int j = xp[t]; j < xp[t + 1]; j++) slot[S++] = extra[j];
            float m = -INFINITY;
            for (int j = 0; j < S; j++) {
                w[j] = dot(qv, kh + (int64_t)slot[j] * D, D) * scale;
                m = w[j] > m ? w[j] : m;
            }
            float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            int j = 0;
            for (; j + 8 <= S; j += 8)
                for (int l = 0; l < 8; l++) {
                    w[j + l] = exp_nonpos(w[j + l] - m);
                    part[l] += w[j + l];
                }
            float sum = ((part[0] + part[4]) + (part[1] + part[5])) + ((part[2] + part[6]) + (part[3] + part[7]));
            for (; j < S; j++) {
                w[j] = exp_nonpos(w[j] - m);
                sum += w[j];
            }
            float *o = out + ((int64_t)t * H + h) * D;
            for (int d = 0; d < D; d++) o[d] = 0.0f;
            for (int jj = 0; jj < S; jj++) {
                const float *vr = vh + (int64_t)slot[jj] * D;
                float p = w[jj];
                for (int d = 0; d < D; d++) o[d] += p * vr[d];
            }
            float inv = 1.0f / sum;
            for (int d = 0; d < D; d++) o[d] *= inv;
        }
        free(w);
        free(slot);
    }
    return failed ? -1 : 0;
}

/* One sequence: q [T, H, D] over one layer's cache k, v [KVH, cap, D]. */
int forerun_attn_rows(const float *q, const float *k, const float *v, int64_t cap, int T, int H, int KVH, int D,
                      const int32_t *lo, const int32_t *hi, const int32_t *xp, const int32_t *extra, float scale,
                      float *out) {
    int64_t *p = (int64_t *)malloc(sizeof(int64_t) * 3 * (size_t)(T > 0 ? T : 1));
    if (p == NULL) return -1;
    for (int t = 0; t < T; t++) {
        p[t] = (int64_t)(intptr_t)k;
        p[T + t] = (int64_t)(intptr_t)v;
        p[2 * T + t] = cap;
    }
    int rc = forerun_attn_rows_multi(q, p, p + T, p + 2 * T, T, H, KVH, D, lo, hi, xp, extra, scale, out);
    free(p);
    return rc;
}
