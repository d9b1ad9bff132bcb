/* What qact.c (activations), qrows.c (the integer products) and qlayer.c (the layer around them)
 * share: the weight and activation layouts (described at the top of qrows.c) and the product entry
 * points. The files are built together into one library per instruction set (ckernels.py). */
#ifndef FORERUN_QROWS_H
#define FORERUN_QROWS_H

#include <stdint.h>

enum { U4 = 0, U8 = 1, S8 = 2, U5 = 3, U6 = 4 };

typedef struct qweight_s {
    const uint8_t *codes;
    const void *scale;
    const void *offset; /* NULL: none */
    int64_t V;          /* weight rows (before padding) */
    int32_t D;          /* columns, a multiple of 32 */
    int32_t kind;
    int32_t sub;        /* 1 or 2 scale groups per 32 columns */
    int32_t f16;        /* how scales and offsets are stored: float32 (0), float16 (1), FACTORED */
    int32_t zb;         /* integer code bias */
    int32_t col;        /* first output column it writes (a part of stacked weights: q, k, v) */
    int32_t cmax;       /* largest stored code (unsigned kinds): how many vpmaddubsw results int16 holds */
    int32_t wide;       /* the fewest activation rows at which the 512-bit tile takes it (0: PAIR_ROWS) */
    const float *sfac;  /* f16 == FACTORED: scale = sfac * (int8) scale, a factor per 256 columns */
    const float *ofac;  /* the same for the offsets */
    const struct qweight_s *many; /* NULL, or the same weight a byte a code (U8), which passes of */
    int32_t many_rows;            /* many_rows rows or more take: no unpacking, more bytes read */
    int32_t pf_l1;      /* 1: its codes and scales prefetched into L1, 8 KiB ahead; 0: into L2, 16 KiB */
} qweight_t;

/* qweight_t.f16: scales and offsets stored as float32 (0), float16 (1), or as int8 multipliers of
 * a float32 factor per row and 256 columns (FACTORED: the K-quants' sub-scales and super-block
 * scale, whose products are exact in float32), laid [group][256-column block][8 rows]. */
enum { FACTORED = 2 };

/* One pass's activations, quantized: xq [N][D] int8; per row and 32-block: dx, and the sums of
 * its codes over each half (bs) as integers and as dx * sum (xs: whole block, first half, second). */
typedef struct {
    int8_t *xq;
    float *dx;
    int32_t *bs; /* [N][nb][2] */
    float *xs;   /* [N][nb][3] */
    int N, D;
} qact_t;

/* x [N][ldx] quantized per row and 32-block into a (allocated by q_act_alloc for N rows of D). */
void q_quantize_rows(const float *x, int64_t ldx, int N, int D, qact_t *a);
int q_act_alloc(qact_t *a, int N, int D); /* 0, or -1 out of memory (q_act_free still frees) */
/* x [N][D] quantized into a, allocated here (q_act_free frees it either way); f16_scales: the
 * scales rounded to float16 as ggml's Q8_0 activations hold them. 0, or -2 out of memory. */
int q_act_quantize(const float *x, int N, int D, int f16_scales, qact_t *a);
void q_act_free(qact_t *a);
/* out[r][col + v] (row stride ldo) for all rows of a and the weight rows of the parts. */
void q_matmul(const qweight_t *w, int parts, const qact_t *a, float *out, int64_t ldo);

#endif
