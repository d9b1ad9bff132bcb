/* qrows.c's SIMD tile, written once for two vector widths: included with QT_W 256 (one weight-row
 * group of 8 a vector: the AVX2, AVX-VNNI and AVX-512 VNNI builds) and, in the AVX-512 VNNI build,
 * again with QT_W 512 (groups g and g + 1 side by side in one vector: lanes 0-7 group g's rows,
 * lanes 8-15 group g + 1's). Every lane takes the same operations on the same values in both
 * widths (integer sums exact, one float multiply and the fused multiply-adds in block order), so a
 * row group's outputs have the same bits whichever width computed them. The 512-bit form halves
 * the instructions a pass of several rows issues per weight (about twice the products a cycle where
 * a core runs 512-bit vpdpbusd at the 256-bit rate); it takes only the VNNI code path. */

#if QT_W == 256
#define QT(x) x##_256
#define QT_VI __m256i
#define QT_VF __m256
#define QI_LOAD(p) _mm256_loadu_si256((const __m256i *)(p))
#define QI_SET8(c) _mm256_set1_epi8((char)(c))
#define QI_SET32(c) _mm256_set1_epi32(c)
#define QI_ZERO() _mm256_setzero_si256()
#define QI_AND _mm256_and_si256
#define QI_OR _mm256_or_si256
#define QI_SRLI16 _mm256_srli_epi16
#define QI_SLLI16 _mm256_slli_epi16
#define QI_ADD32 _mm256_add_epi32
#define QI_ABS8 _mm256_abs_epi8
#define QI_SIGN8(x, v) _mm256_sign_epi8(x, v)
#define QI_DPBUSD DPBUSD
#define QF_ZERO() _mm256_setzero_ps()
#define QF_MUL _mm256_mul_ps
#define QF_FMA _mm256_fmadd_ps
#define QF_CVT _mm256_cvtepi32_ps
#define QF_BCAST(p) _mm256_broadcast_ss(p)
#define QF_SCALES(p, fac, f16, i, fi, stride, fstride) load8_scales(p, fac, f16, i, fi)
#elif QT_W == 512
#define QT(x) x##_512
#define QT_VI __m512i
#define QT_VF __m512
/* 32 bytes of group g's codes and the same 32 of group g + 1's, gs bytes on (in scope where used) */
#define QI_LOAD(p) \
    _mm512_mask_loadu_epi64(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(p))), 0xF0, (p) + gs - 32)
#define QI_SET8(c) _mm512_set1_epi8((char)(c))
#define QI_SET32(c) _mm512_set1_epi32(c)
#define QI_ZERO() _mm512_setzero_si512()
#define QI_AND _mm512_and_si512
#define QI_OR _mm512_or_si512
#define QI_SRLI16 _mm512_srli_epi16
#define QI_SLLI16 _mm512_slli_epi16
#define QI_ADD32 _mm512_add_epi32
#define QI_ABS8 _mm512_abs_epi8
/* psignb without a 512-bit form: x negated where v < 0 (where v == 0 the code |v| is 0 anyway) */
#define QI_SIGN8(x, v) _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(v), _mm512_setzero_si512(), x)
#define QI_DPBUSD _mm512_dpbusd_epi32
#define QF_ZERO() _mm512_setzero_ps()
#define QF_MUL _mm512_mul_ps
#define QF_FMA _mm512_fmadd_ps
#define QF_CVT _mm512_cvtepi32_ps
#define QF_BCAST(p) _mm512_set1_ps(*(p))
#define QF_SCALES(p, fac, f16, i, fi, stride, fstride) \
    _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(load8_scales(p, fac, f16, i, fi))), \
                                        _mm256_castps_pd(load8_scales(p, fac, f16, (i) + (stride), (fi) + (fstride))), 1))
#endif

static inline QT_VI QT(bcast4)(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return QI_SET32(v);
}

/* acc + u . (4 activation codes at p, broadcast): with AVX-512 VL, vpdpbusd's own broadcast from
 * memory ({1to8}, {1to16}: one instruction where the broadcast was a second one; GCC 12 does not
 * fold it from the intrinsics), else the broadcast and the product apart. The same sums. Defined
 * once for both widths (the name QT gives is chosen where it is used). */
#ifndef DPM_ONCE
#define DPM_ONCE
#if defined(__AVX512VL__) && defined(__AVX512VNNI__) && !defined(FORERUN_EMULATE_VNNI)
static inline __m256i dpm_256(__m256i acc, __m256i u, const int8_t *p) {
    __asm__("vpdpbusd %1%{1to8%}, %2, %0" : "+v"(acc) : "m"(*(const int32_t *)p), "v"(u));
    return acc;
}
#if defined(__AVX512F__)
static inline __m512i dpm_512(__m512i acc, __m512i u, const int8_t *p) {
    __asm__("vpdpbusd %1%{1to16%}, %2, %0" : "+v"(acc) : "m"(*(const int32_t *)p), "v"(u));
    return acc;
}
#endif
#define QI_DPM(acc, u, p) QT(dpm)(acc, u, p)
#else
#define QI_DPM(acc, u, p) QI_DPBUSD(acc, u, QT(bcast4)(p))
#endif
#endif

/* Prefetch p and, at 512 bits, the same place in group g + 1's stream, ``next`` bytes on: into L1
 * where l1, else into L2 (qweight_t.pf_l1). */
static inline __attribute__((always_inline)) void QT(prefetch)(const void *p, int64_t next, int l1) {
    if (l1) {
        _mm_prefetch((const char *)p, _MM_HINT_T0);
        if (QT_W == 512) _mm_prefetch((const char *)p + next, _MM_HINT_T0);
    } else {
        _mm_prefetch((const char *)p, _MM_HINT_T1);
        if (QT_W == 512) _mm_prefetch((const char *)p + next, _MM_HINT_T1);
    }
}

/* Bit q of the codes of vector j (0..7) of a block, from its bit plane at p (bit j of each byte),
 * in place (value 1 << q): 16-bit shifts move bit j of each byte to bit q without crossing bytes
 * at that bit, and the mask drops the rest. j and q are constants where it is inlined. */
static inline QT_VI QT(plane_bits)(const uint8_t *p, int64_t gs, int j, int q) {
    (void)gs;
    QT_VI h = QI_LOAD(p);
    if (j < q) h = QI_SLLI16(h, q - j);
    if (j > q) h = QI_SRLI16(h, j - q);
    return QI_AND(h, QI_SET8(1 << q));
}

/* Rows r0 .. r0 + nr - 1 (nr <= RT) against group g (and g + 1 at 512 bits). Everything the loop
 * branches on is a constant where it is inlined (row count, code kind, scale groups, int16 span,
 * code bias, offset, scale storage), so a row's sums stay in registers: a float accumulator, an
 * int16 partial and (where a scale group needs more than one widening) an int32 sum. Each scale
 * group's integer sum is finished and folded into the float accumulator before the next one
 * starts, in the reference's order. Without VNNI (256 bits only) the u8 x s8 pair sums of
 * vpmaddubsw are added in int16 over SPAN vectors where that cannot overflow (codes below 16, 32,
 * 64 and 128 against |xq| <= 127: 8, 4, 2 and 1 vectors), then widened once by vpmaddwd. */
static inline __attribute__((always_inline)) void QT(group_tile)(const qweight_t *w, const qact_t *a, int64_t g,
                                                                 int r0, const int nr, const int kind, const int sub,
                                                                 const int span, const int has_zb, const int has_off,
                                                                 const int f16, QT_VF *res) {
    const int nb = w->D / 32;
    const int cb = code_bytes(kind);
    const int64_t gs = (int64_t)nb * cb;     /* bytes from one group's codes to the next one's */
    const int64_t ss = (int64_t)nb * sub * 8; /* scales from one group's to the next one's */
    const int64_t fs = fac_stride(w); /* factors (FACTORED) from one group's to the next one's */
    (void)gs;
    (void)ss;
    (void)fs;
    (void)span;
    const uint8_t *blk = w->codes + g * gs;
    const int64_t sbase = g * ss;
    const int per = 8 / sub; /* 4-column vectors per scale group */
    const int32_t zb = w->zb;
    const int8_t *xr[RT];
    const float *dxr[RT], *xsr[RT];
    const int32_t *bsr[RT];
    for (int r = 0; r < nr; r++) {
        xr[r] = a->xq + (int64_t)(r0 + r) * a->D;
        dxr[r] = a->dx + (int64_t)(r0 + r) * nb;
        xsr[r] = a->xs + 3 * (int64_t)(r0 + r) * nb;
        bsr[r] = a->bs + 2 * (int64_t)(r0 + r) * nb;
    }
    QT_VF acc[RT];
    for (int r = 0; r < nr; r++) acc[r] = QF_ZERO();
    const int l1 = w->pf_l1; /* the weight stream prefetched into L1 or L2, and how far ahead */
    const int64_t ahead = l1 ? PF_L1_AHEAD : PF_L2_AHEAD;
    const int ahead_b = (int)(ahead / cb); /* in blocks */
    for (int b = 0; b < nb; b++, blk += cb) {
        if (ahead) {
            for (int c = 0; c < cb; c += 64) QT(prefetch)(blk + ahead + c, gs, l1);
            /* The scales, offsets and factors of the block the codes' prefetch reaches: streams
             * of 8-32 bytes a block that the hardware prefetchers left to miss (a step stalled at
             * each new line of them; 8-10% of a pass of 1-8 rows on the 1.5B, docs/kernels.md). */
            const int pb = b + ahead_b, ssz = f16 == FACTORED ? 1 : f16 ? 2 : 4;
            const int64_t so = (sbase + (int64_t)pb * sub * 8) * ssz; /* byte offset of its first scale */
            if ((so & 63) < sub * 8 * ssz) { /* the first block on a new line */
                QT(prefetch)((const char *)w->scale + so, ss * ssz, l1);
                if (has_off) QT(prefetch)((const char *)w->offset + so, ss * ssz, l1);
            }
            if (f16 == FACTORED && pb % 8 == 0) { /* a factor per 8 blocks */
                const int64_t fo = g * fs + (pb / 8) * 8;
                QT(prefetch)(w->sfac + fo, fs * (int64_t)sizeof(float), l1);
                if (has_off) QT(prefetch)(w->ofac + fo, fs * (int64_t)sizeof(float), l1);
            }
        }
        for (int s = 0; s < sub; s++) {
            QT_VI isum[RT];
#if !VNNI
            QT_VI part[RT];
#endif
            if (kind == U4 && sub == 1) { /* one load serves both nibbles (columns 4i.. and 4i+16..) */
#pragma GCC unroll 4
                for (int i = 0; i < 4; i++) {
                    QT_VI v = QI_LOAD(blk + 32 * i);
                    QT_VI lo = QI_AND(v, QI_SET8(15));
                    QT_VI hi = QI_AND(QI_SRLI16(v, 4), QI_SET8(15));
#pragma GCC unroll 8
                    for (int r = 0; r < nr; r++) {
                        const int8_t *x = xr[r] + b * 32 + 4 * i;
#if VNNI
                        QT_VI t = QI_DPM(i == 0 ? QI_ZERO() : isum[r], lo, x);
                        isum[r] = QI_DPM(t, hi, x + 16);
#else /* 8 products of codes < 16: at most 8 * 2 * 15 * 127 < 32768 */
                        QT_VI p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, QT(bcast4)(x)),
                                                   _mm256_maddubs_epi16(hi, QT(bcast4)(x + 16)));
                        part[r] = i == 0 ? p : _mm256_add_epi16(part[r], p);
                        IN_ORDER(part[r]);
#endif
                    }
                }
#if !VNNI
                for (int r = 0; r < nr; r++) isum[r] = _mm256_madd_epi16(part[r], _mm256_set1_epi16(1));
#endif
            } else {
#pragma GCC unroll 8
                for (int jj = 0; jj < per; jj++) {
                    const int j = s * per + jj; /* vector j: U4 load j & 3, low nibbles below 4 */
                    QT_VI u, v;
                    if (nibble_kind(kind)) {
                        v = QI_LOAD(blk + 32 * (j & 3));
                        u = j < 4 ? QI_AND(v, QI_SET8(15)) : QI_AND(QI_SRLI16(v, 4), QI_SET8(15));
                        if (kind != U4) u = QI_OR(u, QT(plane_bits)(blk + 128, gs, j, 4));
                        if (kind == U6) u = QI_OR(u, QT(plane_bits)(blk + 160, gs, j, 5));
                    } else {
                        v = QI_LOAD(blk + 32 * j);
                        u = kind == S8 ? QI_ABS8(v) : v;
                    }
#pragma GCC unroll 8
                    for (int r = 0; r < nr; r++) {
                        const int8_t *x = xr[r] + b * 32 + 4 * j;
#if VNNI
                        if (kind == S8)
                            isum[r] = QI_DPBUSD(jj == 0 ? QI_ZERO() : isum[r], u, QI_SIGN8(QT(bcast4)(x), v));
                        else
                            isum[r] = QI_DPM(jj == 0 ? QI_ZERO() : isum[r], u, x);
#else
                        QT_VI xb = QT(bcast4)(x);
                        if (kind == S8) xb = QI_SIGN8(xb, v);
                        QT_VI p = _mm256_maddubs_epi16(u, xb);
                        part[r] = jj % span == 0 ? p : _mm256_add_epi16(part[r], p);
                        IN_ORDER(part[r]);
                        if (jj % span == span - 1) {
                            QT_VI m = _mm256_madd_epi16(part[r], _mm256_set1_epi16(1));
                            isum[r] = jj == span - 1 ? m : _mm256_add_epi32(isum[r], m);
                            IN_ORDER(isum[r]);
                        }
#endif
                    }
                }
            }
            const int64_t si = sbase + ((int64_t)b * sub + s) * 8;
            const int64_t fi = g * fs + (b / 8) * 8; /* fac_index(w, g, b) */
            const QT_VF sc = QF_SCALES(w->scale, w->sfac, f16, si, fi, ss, fs);
#pragma GCC unroll 8
            for (int r = 0; r < nr; r++) {
                if (has_zb) {
                    int32_t bsum = sub == 1 ? bsr[r][2 * b] + bsr[r][2 * b + 1] : bsr[r][2 * b + s];
                    isum[r] = QI_ADD32(isum[r], QI_SET32(zb * bsum));
                }
                QT_VF f = QF_MUL(sc, QF_BCAST(dxr[r] + b));
                acc[r] = QF_FMA(QF_CVT(isum[r]), f, acc[r]);
                if (has_off)
                    acc[r] = QF_FMA(QF_SCALES(w->offset, w->ofac, f16, si, fi, ss, fs), QF_BCAST(xsr[r] + 3 * b + (sub == 1 ? 0 : 1 + s)),
                                    acc[r]);
            }
        }
    }
    for (int r = 0; r < nr; r++) res[r] = acc[r];
}

/* One tile of nr rows, constants chosen for the common weights (Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K,
 * Q6_K, Q8_0; the K-quants with FACTORED scales, as their files give them) so that the tile's sums
 * stay in registers; anything else (U8: a Q8_0 tensor with no negative code) takes the same code
 * with run-time flags at 256 bits, and is refused (0) at 512
 * bits, where the caller runs it as two 256-bit groups: the 512-bit copies of those rare cases
 * would double the build's compile time for nothing. 1: done. */
#if QT_W == 256
#define QT_GENERIC(x) x
#else
#define QT_GENERIC(x) return 0
#endif
static inline __attribute__((always_inline)) int QT(tile)(const qweight_t *w, const qact_t *a, int64_t g, int r0,
                                                          const int nr, int span, QT_VF *res) {
    const int zb = w->zb != 0, off = w->offset != NULL, f16 = w->f16;
#define GT(K, S, SP, ZB, OFF, F16) QT(group_tile)(w, a, g, r0, nr, K, S, SP, ZB, OFF, F16, res)
    if (w->kind == U4 && w->sub == 1) {
        if (!zb && off && f16 == 1) GT(U4, 1, 8, 0, 1, 1);
        else if (!zb && off && f16 == FACTORED) GT(U4, 1, 8, 0, 1, FACTORED);
        else if (zb && !off && f16 == 1) GT(U4, 1, 8, 1, 0, 1);
        else QT_GENERIC(GT(U4, 1, 8, zb, off, f16));
    } else if (w->kind == U5 && w->sub == 1 && span >= 4) {
        if (zb && !off && f16 == 1) GT(U5, 1, 4, 1, 0, 1);
        else if (!zb && off && f16 == 1) GT(U5, 1, 4, 0, 1, 1);
        else if (!zb && off && f16 == FACTORED) GT(U5, 1, 4, 0, 1, FACTORED);
        else QT_GENERIC(GT(U5, 1, 4, zb, off, f16));
    } else if (w->kind == U6 && w->sub == 2 && span >= 2) {
        if (zb && !off && f16 == FACTORED) GT(U6, 2, 2, 1, 0, FACTORED);
        else QT_GENERIC(GT(U6, 2, 2, zb, off, f16));
    } else if (w->kind == U8 && w->sub == 2 && span >= 2) { /* Q6_K's codes a byte each (``QPart.as_bytes``) */
        if (zb && !off && f16 == FACTORED) GT(U8, 2, 2, 1, 0, FACTORED);
        else QT_GENERIC(GT(U8, 2, 1, zb, off, f16));
    } else if (w->kind == S8 && w->sub == 1) {
        if (!zb && !off && f16 == 1) GT(S8, 1, 1, 0, 0, 1);
        else QT_GENERIC(GT(S8, 1, 1, zb, off, f16));
    } else if (w->kind == U4) QT_GENERIC(GT(U4, 2, 4, zb, off, f16));
    else if (w->kind == U5 || w->kind == U6) QT_GENERIC(GT(w->kind, w->sub, 1, zb, off, f16));
    else if (w->kind == U8 && w->sub == 1) QT_GENERIC(GT(U8, 1, 1, zb, off, f16));
    else if (w->kind == U8) QT_GENERIC(GT(U8, 2, 1, zb, off, f16));
    else QT_GENERIC(GT(S8, 2, 1, zb, off, f16));
    return 1;
#undef GT
}
#undef QT_GENERIC

/* Group g (and g + 1 at 512 bits, lanes2 of its rows: 1..8) against every row of a: outputs for
 * activation row r to out[r * ldo + lane], lanes of group g + 1 at out[r * ldo + 8 + lane].
 * 1: done; 0: a weight the tile does not take at this width (nothing written). */
static int QT(group_simd)(const qweight_t *w, const qact_t *a, int64_t g, float *out, int64_t ldo, int lanes2) {
    int lanes = (int)(w->V - g * 8 < 8 ? w->V - g * 8 : 8);
    QT_VF res[RT];
    int tiles = (a->N + RT - 1) / RT;
    int span = span_of(w);
    (void)lanes2;
    for (int t = 0, r0 = 0; t < tiles; t++) { /* balanced tiles: 5 rows as 3 + 2, not 4 + 1 */
        int nr = (a->N - r0) / (tiles - t) + ((a->N - r0) % (tiles - t) != 0), done = 0;
        switch (nr) { /* the row count a constant in each copy */
        case 1: done = QT(tile)(w, a, g, r0, 1, span, res); break;
#if RT >= 2
        case 2: done = QT(tile)(w, a, g, r0, 2, span, res); break;
#endif
#if RT >= 3
        case 3: done = QT(tile)(w, a, g, r0, 3, span, res); break;
#endif
#if RT >= 4
        case 4: done = QT(tile)(w, a, g, r0, 4, span, res); break;
#endif
#if RT >= 8
        case 5: done = QT(tile)(w, a, g, r0, 5, span, res); break;
        case 6: done = QT(tile)(w, a, g, r0, 6, span, res); break;
        case 7: done = QT(tile)(w, a, g, r0, 7, span, res); break;
        case 8: done = QT(tile)(w, a, g, r0, 8, span, res); break;
#endif
        default: break;
        }
        if (!done) return 0; /* the same weight for every tile: refused at the first */
        for (int r = 0; r < nr; r++) {
            float *o = out + (int64_t)(r0 + r) * ldo;
#if QT_W == 512
            if (lanes2 == 8) {
                _mm512_storeu_ps(o, res[r]);
            } else {
                float tmp[16];
                _mm512_storeu_ps(tmp, res[r]);
                memcpy(o, tmp, sizeof(float) * (size_t)(8 + lanes2));
            }
#else
            if (lanes == 8) {
                _mm256_storeu_ps(o, res[r]);
            } else {
                float tmp[8];
                _mm256_storeu_ps(tmp, res[r]);
                memcpy(o, tmp, sizeof(float) * (size_t)lanes);
            }
#endif
        }
        r0 += nr;
    }
    (void)lanes;
    return 1;
}

#undef QT
#undef QT_VI
#undef QT_VF
#undef QI_LOAD
#undef QI_SET8
#undef QI_SET32
#undef QI_ZERO
#undef QI_AND
#undef QI_OR
#undef QI_SRLI16
#undef QI_SLLI16
#undef QI_ADD32
#undef QI_ABS8
#undef QI_SIGN8
#undef QI_DPBUSD
#undef QF_ZERO
#undef QF_MUL
#undef QF_FMA
#undef QF_CVT
#undef QF_BCAST
#undef QF_SCALES
#undef QT_W
