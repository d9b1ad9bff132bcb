/* A whole transformer layer over a pass's rows for the native backend's GGUF path: norms, the
 * integer products of qrows.c (q, k, v; output; gate and up; down), rotary positions, attention over
 * the cache (attend_pass_* in attend_kv.h) and the gated MLP, in float32 with every operation written out (built with
 * -ffp-contract=off into qrows.c's library), so that a row's result does not depend on its pass. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "rows_common.h"
#include "qrows.h"

static inline float tanh_c(float x) { return 1.0f - 2.0f / (exp_c(2.0f * x) + 1.0f); }

/* y = x * rsqrt(mean(x^2) + eps) * w over n values (in place allowed). */
static void rms_norm(const float *x, const float *w, float *y, int n, float eps) {
    float ss = dot_f(x, x, n);
    float r = 1.0f / sqrtf(ss / (float)n + eps);
    for (int i = 0; i < n; i++) y[i] = (x[i] * r) * w[i];
}

/* x [D] rotated in place: x * cos + rotate_half(x) * sin. */
static void rope(float *x, const float *c, const float *s, int D) {
    int half = D / 2;
    float tmp[1024];
    for (int i = 0; i < half; i++) {
        tmp[i] = x[i] * c[i] + (-x[i + half]) * s[i];
        tmp[i + half] = x[i + half] * c[i + half] + x[i] * s[i + half];
    }
    memcpy(x, tmp, sizeof(float) * (size_t)D);
}

typedef struct {
    qweight_t w[8]; /* the parts of qkv, o, gate_up, down in that order (counts in parts) */
    int32_t parts[4];
    const float *qkv_bias, *o_bias, *gate_up_bias, *down_bias;
    const float *norm[4];
    const float *q_norm, *k_norm;
    int32_t n_q, n_kv, inter, sandwich, act, sliding;
    /* paired input (an EAGLE head's layer): the attention block reads [norm_x2(x2) ; norm[0](h)], two
     * rows of hidden values each normed with its own scale, instead of norm[0](h) */
    const float *norm_x2;
    int32_t paired, pad_;
} qlayer_t;

typedef struct {
    int32_t N, hidden, H, KVH, D;
    float eps, scale, softcap;
    const float *cos[2], *sin[2];       /* [N][D] per attention kind: 0 full, 1 sliding */
    const int64_t *kbase, *vbase, *cap; /* per row: its sequence's cache [layers][KVH][cap][D] */
    const int32_t *slot;                /* per row: the cache position its keys and values go to */
    const int32_t *lo[2], *hi[2], *xp[2], *extra[2];
    const float *x2; /* [N][hidden]: the second input of paired layers (else unused) */
    int32_t kv_f16, pad_; /* the caches hold float16 keys and values (else float32) */
} qpass_t;

enum { ACT_SILU = 0, ACT_GELU_TANH = 1, ACT_GELU = 2 };

static inline float gate_act(float g, int act) {
    if (act == ACT_SILU) return g / (1.0f + exp_c(-g));
    if (act == ACT_GELU_TANH) return 0.5f * g * (1.0f + tanh_c(0.7978845608028654f * (g + 0.044715f * g * g * g)));
    return 0.5f * g * (1.0f + erff(g * 0.7071067811865476f));
}

/* x [N][inter] = act(gate) * up from y [N][2 * inter] (gate, then up); AVX2 builds take 8 lanes at
 * a time with the same float operations as the plain loop. */
static void gate_rows(const float *y, float *x, int N, int inter, int act) {
    for (int r = 0; r < N; r++) {
        const float *g = y + (int64_t)r * 2 * inter, *u = g + inter;
        float *o = x + (int64_t)r * inter;
        int i = 0;
#if defined(__AVX2__) && defined(__FMA__)
        const __m256 one = _mm256_set1_ps(1.0f);
        if (act == ACT_SILU)
            for (; i + 8 <= inter; i += 8) { /* g / (1 + exp(-g)) * u */
                __m256 gv = _mm256_loadu_ps(g + i);
                __m256 e = exp_c8(_mm256_xor_ps(gv, _mm256_set1_ps(-0.0f)));
                _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
            }
        else if (act == ACT_GELU_TANH)
            for (; i + 8 <= inter; i += 8) { /* 0.5 g (1 + tanh(c (g + 0.044715 g^3))) * u */
                __m256 gv = _mm256_loadu_ps(g + i);
                __m256 cube = _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.044715f), gv), gv), gv);
                __m256 z = _mm256_mul_ps(_mm256_set1_ps(0.7978845608028654f), _mm256_add_ps(gv, cube));
                __m256 t = _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.0f),
                                                            _mm256_add_ps(exp_c8(_mm256_mul_ps(_mm256_set1_ps(2.0f), z)), one)));
                __m256 a = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), gv), _mm256_add_ps(one, t));
                _mm256_storeu_ps(o + i, _mm256_mul_ps(a, _mm256_loadu_ps(u + i)));
            }
#endif
        for (; i < inter; i++) o[i] = gate_act(g[i], act) * u[i];
    }
}

static void add_bias(float *y, const float *bias, int N, int n) {
    if (!bias) return;
    for (int r = 0; r < N; r++)
        for (int i = 0; i < n; i++) y[(int64_t)r * n + i] += bias[i];
}

/* Attention of every (row, head) over the keys that row sees (forerun's RowKeys), in slot order;
 * a sequence's rows read its keys and values once (attend_pass_f32 / _f16 by the cache's type). */
static int attend(const qpass_t *P, int idx, int kind, const float *q, float *out) {
    if (P->kv_f16)
        return attend_pass_f16(q, P->kbase, P->vbase, P->cap, idx, P->N, P->H, P->KVH, P->D, P->lo[kind], P->hi[kind],
                               P->xp[kind], P->extra[kind], P->scale, P->softcap, tanh_c, out);
    return attend_pass_f32(q, P->kbase, P->vbase, P->cap, idx, P->N, P->H, P->KVH, P->D, P->lo[kind], P->hi[kind],
                           P->xp[kind], P->extra[kind], P->scale, P->softcap, tanh_c, out);
}

/* One layer over the pass's rows: h [N][hidden] in place. 0, or -2 out of memory. */
int forerun_q_layer(const qlayer_t *L, const qpass_t *P, int idx, float *h) {
    int N = P->N, hid = P->hidden, D = P->D, H = P->H, KVH = P->KVH;
    int nqkv = L->n_q + 2 * L->n_kv, inter = L->inter, kind = L->sliding ? 1 : 0;
    int widest = hid > nqkv ? hid : nqkv;
    widest = widest > 2 * inter ? widest : 2 * inter;
    int din = L->paired ? 2 * hid : hid; /* the attention block's input width */
    int maxin = din > inter ? din : inter;
    maxin = maxin > L->n_q ? maxin : L->n_q;
    float *x = (float *)malloc(sizeof(float) * (size_t)N * maxin);
    float *y = (float *)malloc(sizeof(float) * (size_t)N * widest);
    float *att = (float *)malloc(sizeof(float) * (size_t)N * H * D);
    qact_t a;
    int rc = q_act_alloc(&a, N, maxin);
    if (!x || !y || !att || rc) {
        rc = -2;
        goto done;
    }
    /* attention block */
    if (L->paired) {
        for (int r = 0; r < N; r++) {
            float *xr = x + (int64_t)r * din;
            rms_norm(P->x2 + (int64_t)r * hid, L->norm_x2, xr, hid, P->eps);
            rms_norm(h + (int64_t)r * hid, L->norm[0], xr + hid, hid, P->eps);
        }
    } else {
        for (int r = 0; r < N; r++) rms_norm(h + (int64_t)r * hid, L->norm[0], x + (int64_t)r * hid, hid, P->eps);
    }
    a.D = din;
    q_quantize_rows(x, din, N, din, &a);
    q_matmul(L->w, L->parts[0], &a, y, nqkv);
    add_bias(y, L->qkv_bias, N, nqkv);
    float *q = att; /* q [N][H][D] gathered here, then attention writes its own output into x */
    for (int r = 0; r < N; r++) {
        float *yr = y + (int64_t)r * nqkv;
        const float *c = P->cos[kind] + (int64_t)r * D, *s = P->sin[kind] + (int64_t)r * D;
        for (int hh = 0; hh < H; hh++) {
            float *qh = q + ((int64_t)r * H + hh) * D;
            memcpy(qh, yr + (int64_t)hh * D, sizeof(float) * (size_t)D);
            if (L->q_norm) rms_norm(qh, L->q_norm, qh, D, P->eps);
            rope(qh, c, s, D);
        }
        int64_t layer = (int64_t)idx * KVH * P->cap[r] * D;
        for (int kh = 0; kh < KVH; kh++) {
            float *kr = yr + L->n_q + (int64_t)kh * D, *vr = yr + L->n_q + L->n_kv + (int64_t)kh * D;
            if (L->k_norm) rms_norm(kr, L->k_norm, kr, D, P->eps);
            rope(kr, c, s, D);
            int64_t at = layer + ((int64_t)kh * P->cap[r] + P->slot[r]) * D;
            if (P->kv_f16) {
                floats_to_half((uint16_t *)(intptr_t)P->kbase[r] + at, kr, D);
                floats_to_half((uint16_t *)(intptr_t)P->vbase[r] + at, vr, D);
            } else {
                memcpy((float *)(intptr_t)P->kbase[r] + at, kr, sizeof(float) * (size_t)D);
                memcpy((float *)(intptr_t)P->vbase[r] + at, vr, sizeof(float) * (size_t)D);
            }
        }
    }
    rc = attend(P, idx, kind, q, x);
    if (rc) goto done;
    a.D = L->n_q;
    q_quantize_rows(x, L->n_q, N, L->n_q, &a);
    q_matmul(L->w + L->parts[0], L->parts[1], &a, y, hid);
    add_bias(y, L->o_bias, N, hid);
    for (int r = 0; r < N; r++) {
        float *hr = h + (int64_t)r * hid, *yr = y + (int64_t)r * hid;
        if (L->sandwich) rms_norm(yr, L->norm[1], yr, hid, P->eps);
        for (int i = 0; i < hid; i++) hr[i] = hr[i] + yr[i];
        rms_norm(hr, L->norm[L->sandwich ? 2 : 1], x + (int64_t)r * hid, hid, P->eps);
    }
    /* MLP */
    a.D = hid;
    q_quantize_rows(x, hid, N, hid, &a);
    q_matmul(L->w + L->parts[0] + L->parts[1], L->parts[2], &a, y, 2 * inter);
    add_bias(y, L->gate_up_bias, N, 2 * inter);
    gate_rows(y, x, N, inter, L->act);
    a.D = inter;
    q_quantize_rows(x, inter, N, inter, &a);
    q_matmul(L->w + L->parts[0] + L->parts[1] + L->parts[2], L->parts[3], &a, y, hid);
    add_bias(y, L->down_bias, N, hid);
    for (int r = 0; r < N; r++) {
        float *hr = h + (int64_t)r * hid, *yr = y + (int64_t)r * hid;
        if (L->sandwich) rms_norm(yr, L->norm[3], yr, hid, P->eps);
        for (int i = 0; i < hid; i++) hr[i] = hr[i] + yr[i];
    }
done:
    free(x);
    free(y);
    free(att);
    q_act_free(&a);
    return rc;
}

/* Every layer of a pass in one call: layers[i] for i in 0..n-1 unless skip[i]; after layer i,
 * where keep[i] is not NULL, h is copied there ([N][hidden]: the drafters' feature layers).
 * 0, or -2 out of memory. */
int forerun_q_layers(const qlayer_t *layers, int n, const uint8_t *skip, float *const *keep, const qpass_t *P, float *h) {
    size_t bytes = sizeof(float) * (size_t)P->N * (size_t)P->hidden;
    for (int i = 0; i < n; i++) {
        if (!(skip && skip[i])) {
            int rc = forerun_q_layer(&layers[i], P, i, h);
            if (rc) return rc;
        }
        if (keep && keep[i]) memcpy(keep[i], h, bytes); /* a skipped layer passes h on unchanged */
    }
    return 0;
}

