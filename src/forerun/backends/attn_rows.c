/* Attention computed the same way whatever the pass: a verify pass's row gives bit for bit what a
 * one-token step at that position gives.
 *
 * Library attention (PyTorch's scaled_dot_product_attention) tiles its products and reductions
 * by the shape of the whole pass, so a row of a 9-row pass and the same row run alone round
 * differently (measured on the bundled model: up to 2e-5 in a layer's output). Here each row's
 * scores over the keys it sees (a consecutive range of cache slots, then an optional list of
 * further slots: a tree row's ancestors and itself), their softmax and the weighted sum of values
 * are each summed in a fixed order that depends only on that row's keys (``rows_common.h``:
 * attend_pass_f32; a sequence's rows share the reads of its keys and values, not their sums). OpenMP
 * splits (rows, head) jobs, never one row's sums.
 *
 * q: [T, H, D]; k, v: one layer's cache [KVH, cap, D]; out: [T, H, D]; all float32, contiguous.
 * Row t sees slots lo[t] .. hi[t]-1, then extra[xp[t] .. xp[t+1]-1].
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "rows_common.h"

int forerun_attn_threads(int n) { return rows_threads(n); }

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
    return attend_pass_f32(q, kp, vp, caps, 0, T, H, KVH, D, lo, hi, xp, extra, scale, 0.0f, NULL, out) ? -1 : 0;
}

/* forerun_attn_rows_multi over float16 caches (the integer path's): for tests of that code. */
int forerun_attn_rows_multi_f16(const float *q, const int64_t *kp, const int64_t *vp, const int64_t *caps, int T, int H,
                                int KVH, int D, const int32_t *lo, const int32_t *hi, const int32_t *xp,
                                const int32_t *extra, float scale, float *out) {
    return attend_pass_f16(q, kp, vp, caps, 0, T, H, KVH, D, lo, hi, xp, extra, scale, 0.0f, NULL, out) ? -1 : 0;
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
