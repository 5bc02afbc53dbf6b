/* The int8 path's kernels for one instruction set, included by quant_gemm.c once per set, with
 *   ISA         the function attribute (AVX2_F16C or AVX512_VNNI),
 *   INPUTS      the most input rows multiplied by each decoded block (4 or 8: what the set's registers hold),
 *   NAME(x)     x with the set's suffix,
 *   DOT_U       the int32 sums of four products each, of unsigned weight bytes (0-63) and signed input bytes,
 *   DOT_S       the same of signed weight bytes (-128-127), `corr` the input's correction for DOT_S.
 * Each weight block is decoded in registers straight from its stored bytes (no copy), four weight rows at a time,
 * then multiplied into up to INPUTS quantized input rows (see NAME(group)). The 4- and 5-bit types are decoded
 * unsigned (0-15, 0-31) and their offset (-8, -16) folded into the block's minimum, so they need no sign handling;
 * Q8_0 and Q6_K are signed.
 */

/* The float32 value of a float16 (exact, subnormals included). */
ISA static inline float NAME(half)(const uint8_t *p) {
  uint16_t h;
  memcpy(&h, p, sizeof h);
  return _cvtsh_ss(h);
}

/* 32 four-bit values: the low nibbles of qs[0..15], then their high nibbles. */
ISA static inline __m256i NAME(nibbles)(const uint8_t *qs) {
  __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)qs)); /* the upper half shifted by 4 */
  return _mm256_and_si256(_mm256_srlv_epi64(v, _mm256_setr_epi64x(0, 0, 4, 4)), _mm256_set1_epi8(0x0f));
}

/* 16 in byte i where bit i of qh is set, else 0: the fifth bit of Q5_0 / Q5_1 values. */
ISA static inline __m256i NAME(fifth_bits)(const uint8_t *p) {
  uint32_t qh;
  memcpy(&qh, p, sizeof qh);
  const __m256i byte_of = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2,
                                           3, 3, 3, 3, 3, 3, 3, 3); /* byte i / 8 of qh, within each 128-bit lane */
  const __m256i bit_of = _mm256_set1_epi64x(0x8040201008040201LL); /* bit i % 8 */
  __m256i bits = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)qh), byte_of), bit_of);
  return _mm256_and_si256(_mm256_cmpeq_epi8(bits, bit_of), _mm256_set1_epi8(16));
}

/* ---- Four weight rows at a time. Each block of the four rows is decoded once and multiplied into C input rows (up to
 * INPUTS): the four rows' products with one input block, each four values' integer sum scaled by its input scale,
 * summed (lanes reduced by unpacks) into one vector [rows 0-3 over values 0-15, rows 0-3 over values 16-31], whose
 * lanes each take their own scale (Q6_K's two scales per 32 values included), summed into one accumulator per input
 * row; the minimums' share is summed four rows at once into another. Per block and input row that is four multiplies
 * and two multiply-adds for four weight rows, on independent accumulators, with the blocks' float16 fields converted
 * four rows at a time. */

/* The four rows' sums of w[r] x over values 0-15 (lanes 0-3) and over values 16-31 (lanes 4-7), each four values'
 * integer sum scaled by its input scale xs first. */
ISA static inline __attribute__((always_inline)) __m256 NAME(dot4)(int is_signed, const __m256i *w, __m256i x,
                                                                    const int32_t *corr, __m256 xs) {
  __m256 d[4];
  for (int r = 0; r < 4; r++)
    d[r] = _mm256_mul_ps(_mm256_cvtepi32_ps(is_signed ? DOT_S(w[r], x, corr) : DOT_U(w[r], x)), xs);
  __m256 t0 = _mm256_add_ps(_mm256_unpacklo_ps(d[0], d[1]), _mm256_unpackhi_ps(d[0], d[1]));
  __m256 t1 = _mm256_add_ps(_mm256_unpacklo_ps(d[2], d[3]), _mm256_unpackhi_ps(d[2], d[3]));
  __m256d lo = _mm256_unpacklo_pd(_mm256_castps_pd(t0), _mm256_castps_pd(t1));
  __m256d hi = _mm256_unpackhi_pd(_mm256_castps_pd(t0), _mm256_castps_pd(t1));
  return _mm256_add_ps(_mm256_castpd_ps(lo), _mm256_castpd_ps(hi));
}

/* Four decoded weight blocks w (scales ws laid out as dot4's lanes, minimums wm per row) into C input rows from
 * r0, block b. */
ISA static inline __attribute__((always_inline)) void NAME(multiply)(int C, int is_signed, int has_min,
                                                                      const __m256i *w, __m256 ws, __m128 wm,
                                                                      const quantized *a, long r0, long b,
                                                                      __m256 *acc, __m128 *macc) {
  for (int c = 0; c < C; c++) {
    long block = (r0 + c) * a->blocks + b;
    __m256i x = _mm256_loadu_si256((const __m256i *)(a->q + QK * block));
    __m256 dots = NAME(dot4)(is_signed, w, x, a->corr + LANES * block, _mm256_loadu_ps(a->lanes + LANES * block));
    acc[c] = _mm256_fmadd_ps(dots, ws, acc[c]);
    if (has_min) macc[c] = _mm_fmadd_ps(wm, _mm_broadcast_ss(a->sums + block), macc[c]);
  }
}

/* The 32-bit words at p[0..3] as the four lanes of a vector. */
ISA static inline __m128i NAME(words)(const uint8_t *const *p) {
  uint32_t v[4];
  for (int r = 0; r < 4; r++) memcpy(&v[r], p[r], sizeof v[r]);
  return _mm_setr_epi32((int)v[0], (int)v[1], (int)v[2], (int)v[3]);
}

/* The six-bit scales and minimums of the eight sub-blocks of four Q4_K / Q5_K rows' super-blocks (their twelve
 * bytes at p[r] + 4), regrouped by sub-block: scale s of rows 0-3 at scales[4s], the same for mins. The four rows'
 * words go through the bit operations at once, one row a lane; a byte shuffle then transposes each 4 x 4 bytes. */
ISA static inline void NAME(k_scales4)(const uint8_t *const *p, uint8_t *scales, uint8_t *mins) {
  const uint8_t *at[4] = {p[0] + 4, p[1] + 4, p[2] + 4, p[3] + 4};
  __m128i s0 = NAME(words)(at);
  for (int r = 0; r < 4; r++) at[r] += 4;
  __m128i s1 = NAME(words)(at);
  for (int r = 0; r < 4; r++) at[r] += 4;
  __m128i s2 = NAME(words)(at);
  const __m128i six = _mm_set1_epi32(0x3f3f3f3f), four = _mm_set1_epi32(0x0f0f0f0f), top = _mm_set1_epi32(0x30303030);
  const __m128i by_position = _mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  __m128i scale_lo = _mm_and_si128(s0, six), min_lo = _mm_and_si128(s1, six);
  __m128i scale_hi = _mm_or_si128(_mm_and_si128(s2, four), _mm_and_si128(_mm_srli_epi32(s0, 2), top));
  __m128i min_hi = _mm_or_si128(_mm_and_si128(_mm_srli_epi32(s2, 4), four), _mm_and_si128(_mm_srli_epi32(s1, 2), top));
  _mm_storeu_si128((__m128i *)scales, _mm_shuffle_epi8(scale_lo, by_position));
  _mm_storeu_si128((__m128i *)(scales + 16), _mm_shuffle_epi8(scale_hi, by_position));
  _mm_storeu_si128((__m128i *)mins, _mm_shuffle_epi8(min_lo, by_position));
  _mm_storeu_si128((__m128i *)(mins + 16), _mm_shuffle_epi8(min_hi, by_position));
}

/* Weight rows rows[0..3] of `type` against C quantized input rows from r0, into y[c * ldy + r] for the first
 * `valid` rows (type and C constant at each call, so each use compiles to its own straight loop). */
ISA static inline __attribute__((always_inline)) void NAME(group)(int type, int C, const uint8_t *const *rows,
                                                                   const uint8_t *ahead, long k, const quantized *a,
                                                                   long r0, float *y, long ldy, int valid) {
  __m256 acc[8];
  __m128 macc[8];
  for (int c = 0; c < C; c++) acc[c] = _mm256_setzero_ps(), macc[c] = _mm_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0x0f), evens = _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6);
  const __m256i odds = _mm256_setr_epi32(1, 3, 5, 7, 1, 3, 5, 7);
  const uint8_t *p[4];
  __m256i w[4];
  int has_min = type != Q8_0 && type != Q6_K;
  if (type == Q8_0 || type == Q4_0 || type == Q4_1 || type == Q5_0 || type == Q5_1) {
    long bytes = format_of(type).bytes;
    for (long b = 0; b < k / QK; b++) {
      for (int r = 0; r < 4; r++) p[r] = rows[r] + b * bytes;
      for (long o = 0; o < 4 * bytes; o += 64) _mm_prefetch((const char *)ahead + 4 * b * bytes + o, _MM_HINT_T0);
      __m128i fields = NAME(words)(p); /* d (and m) of each row */
      if (type != Q4_1 && type != Q5_1) fields = _mm_and_si128(fields, _mm_set1_epi32(0xffff));
      __m256 dm = _mm256_cvtph_ps(fields);
      __m256 ws = _mm256_permutevar8x32_ps(dm, evens);
      __m128 wm = _mm256_castps256_ps128(_mm256_permutevar8x32_ps(dm, odds));
      if (type == Q4_0) wm = _mm_mul_ps(_mm256_castps256_ps128(ws), _mm_set1_ps(-8.0f));
      if (type == Q5_0) wm = _mm_mul_ps(_mm256_castps256_ps128(ws), _mm_set1_ps(-16.0f));
      for (int r = 0; r < 4; r++) {
        if (type == Q8_0) w[r] = _mm256_loadu_si256((const __m256i *)(p[r] + 2));
        else if (type == Q4_0) w[r] = NAME(nibbles)(p[r] + 2);
        else if (type == Q4_1) w[r] = NAME(nibbles)(p[r] + 4);
        else if (type == Q5_0) w[r] = _mm256_or_si256(NAME(nibbles)(p[r] + 6), NAME(fifth_bits)(p[r] + 2));
        else w[r] = _mm256_or_si256(NAME(nibbles)(p[r] + 8), NAME(fifth_bits)(p[r] + 4));
      }
      NAME(multiply)(C, type == Q8_0, has_min, w, ws, wm, a, r0, b, acc, macc);
    }
  } else if (type == Q4_K || type == Q5_K) {
    long bytes = format_of(type).bytes;
    for (long sb = 0; sb < k / 256; sb++) {
      for (int r = 0; r < 4; r++) p[r] = rows[r] + sb * bytes;
      __m256 dm = _mm256_cvtph_ps(NAME(words)(p)); /* d and dmin of each row */
      __m128 d = _mm256_castps256_ps128(_mm256_permutevar8x32_ps(dm, evens));
      __m128 dmin = _mm256_castps256_ps128(_mm256_permutevar8x32_ps(dm, odds));
      uint8_t scales[32], mins[32];
      NAME(k_scales4)(p, scales, mins);
#pragma GCC unroll 8
      for (int s = 0; s < 8; s++) {
        for (long o = 0; o < bytes / 2; o += 64)
          _mm_prefetch((const char *)ahead + 4 * sb * bytes + s * bytes / 2 + o, _MM_HINT_T0);
        uint32_t sc, mn;
        memcpy(&sc, scales + 4 * s, sizeof sc);
        memcpy(&mn, mins + 4 * s, sizeof mn);
        __m128 ds = _mm_mul_ps(d, _mm_cvtepi32_ps(_mm_cvtepu8_epi32(_mm_cvtsi32_si128((int)sc))));
        __m128 wm = _mm_xor_ps(_mm_mul_ps(dmin, _mm_cvtepi32_ps(_mm_cvtepu8_epi32(_mm_cvtsi32_si128((int)mn)))),
                               _mm_set1_ps(-0.0f));
        for (int r = 0; r < 4; r++) {
          const uint8_t *qs = p[r] + (type == Q4_K ? 16 : 48) + 32 * (s / 2);
          __m256i v = _mm256_loadu_si256((const __m256i *)qs);
          w[r] = _mm256_and_si256(s % 2 ? _mm256_srli_epi16(v, 4) : v, low);
          if (type == Q5_K) {
            __m256i bit = _mm256_set1_epi8((char)(1 << s)), high = _mm256_loadu_si256((const __m256i *)(p[r] + 16));
            w[r] = _mm256_or_si256(w[r], _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(high, bit), bit),
                                                          _mm256_set1_epi8(16)));
          }
        }
        NAME(multiply)(C, 0, 1, w, _mm256_set_m128(ds, ds), wm, a, r0, 8 * sb + s, acc, macc);
      }
    }
  } else { /* Q6_K */
    for (long sb = 0; sb < k / 256; sb++) {
      for (int r = 0; r < 4; r++) p[r] = rows[r] + sb * 210;
      uint16_t h[4];
      for (int r = 0; r < 4; r++) memcpy(&h[r], p[r] + 208, sizeof h[r]);
      __m128 d = _mm_cvtph_ps(_mm_setr_epi16((short)h[0], (short)h[1], (short)h[2], (short)h[3], 0, 0, 0, 0));
      __m256 d8 = _mm256_set_m128(d, d);
      int8_t scales[64]; /* scale j (of values 16j to 16j + 15) of rows 0-3 at 4j */
      {
        __m128i s0 = _mm_loadu_si128((const __m128i *)(p[0] + 192));
        __m128i s1 = _mm_loadu_si128((const __m128i *)(p[1] + 192));
        __m128i s2 = _mm_loadu_si128((const __m128i *)(p[2] + 192));
        __m128i s3 = _mm_loadu_si128((const __m128i *)(p[3] + 192));
        __m128i lo01 = _mm_unpacklo_epi8(s0, s1), hi01 = _mm_unpackhi_epi8(s0, s1);
        __m128i lo23 = _mm_unpacklo_epi8(s2, s3), hi23 = _mm_unpackhi_epi8(s2, s3);
        _mm_storeu_si128((__m128i *)scales, _mm_unpacklo_epi16(lo01, lo23));
        _mm_storeu_si128((__m128i *)(scales + 16), _mm_unpackhi_epi16(lo01, lo23));
        _mm_storeu_si128((__m128i *)(scales + 32), _mm_unpacklo_epi16(hi01, hi23));
        _mm_storeu_si128((__m128i *)(scales + 48), _mm_unpackhi_epi16(hi01, hi23));
      }
#pragma GCC unroll 8
      for (int s = 0; s < 8; s++) {
        int half = s / 4, quarter = s % 4;
        for (long o = 0; o < 105; o += 64) _mm_prefetch((const char *)ahead + 840 * sb + 105 * s + o, _MM_HINT_T0);
        __m256 ws = _mm256_mul_ps(
            d8, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(scales + 8 * s)))));
        for (int r = 0; r < 4; r++) {
          __m256i ql = _mm256_loadu_si256((const __m256i *)(p[r] + 64 * half + 32 * (quarter % 2)));
          __m256i qh = _mm256_loadu_si256((const __m256i *)(p[r] + 128 + 32 * half));
          ql = _mm256_and_si256(quarter / 2 ? _mm256_srli_epi16(ql, 4) : ql, low);
          qh = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * quarter), _mm256_set1_epi8(3));
          w[r] = _mm256_sub_epi8(_mm256_or_si256(ql, _mm256_slli_epi16(qh, 4)), _mm256_set1_epi8(32));
        }
        NAME(multiply)(C, 1, 0, w, ws, _mm_setzero_ps(), a, r0, 8 * sb + s, acc, macc);
      }
    }
  }
  for (int c = 0; c < C; c++) {
    __m128 sum = _mm_add_ps(_mm256_castps256_ps128(acc[c]), _mm256_extractf128_ps(acc[c], 1));
    if (has_min) sum = _mm_add_ps(sum, macc[c]);
    float out[4];
    _mm_storeu_ps(out, sum);
    for (int r = 0; r < valid; r++) y[c * ldy + r] = out[r];
  }
}

#define DEFINE_GROUP(T)                                                                                         \
  ISA static void NAME(group_##T)(int C, const uint8_t *const *rows, const uint8_t *ahead, long k,              \
                                  const quantized *a, long r0, float *y, long ldy, int valid) {                 \
    switch (C) {                                                                                                \
      case 8: NAME(group)(T, 8, rows, ahead, k, a, r0, y, ldy, valid); break;                                   \
      case 7: NAME(group)(T, 7, rows, ahead, k, a, r0, y, ldy, valid); break;                                   \
      case 6: NAME(group)(T, 6, rows, ahead, k, a, r0, y, ldy, valid); break;                                   \
      case 5: NAME(group)(T, 5, rows, ahead, k, a, r0, y, ldy, valid); break;                                   \
      case 4: NAME(group)(T, 4, rows, ahead, k, a, r0, y, ldy, valid); break;                                   \
      case 3: NAME(group)(T, 3, rows, ahead, k, a, r0, y, ldy, valid); break;                                   \
      case 2: NAME(group)(T, 2, rows, ahead, k, a, r0, y, ldy, valid); break;                                   \
      default: NAME(group)(T, 1, rows, ahead, k, a, r0, y, ldy, valid); break;                                  \
    }                                                                                                           \
  }
DEFINE_GROUP(Q8_0)
DEFINE_GROUP(Q4_0)
DEFINE_GROUP(Q4_1)
DEFINE_GROUP(Q5_0)
DEFINE_GROUP(Q5_1)
DEFINE_GROUP(Q4_K)
DEFINE_GROUP(Q5_K)
DEFINE_GROUP(Q6_K)
#undef DEFINE_GROUP

/* Stored weight rows r .. r + 3 (those below n) of `type`, `row_bytes` apart from w, against all m quantized input
 * rows (INPUTS at a time, then the rest together), into y[i * n + r ...]. */
ISA static void NAME(int8_rows)(int type, const uint8_t *w, long row_bytes, long n, long r, long k, const quantized *a,
                                long m, float *y) {
  const uint8_t *rows[4];
  int valid = n - r < 4 ? (int)(n - r) : 4;
  for (int i = 0; i < 4; i++) rows[i] = w + (i < valid ? r + i : r) * row_bytes; /* missing rows: repeat row r */
  const uint8_t *ahead = w + (r + PREFETCH_ROWS) * row_bytes; /* read PREFETCH_ROWS rows ahead (never faults) */
  for (long i = 0; i < m; i += INPUTS) {
    int C = m - i < INPUTS ? (int)(m - i) : INPUTS;
    float *out = y + i * n + r;
    switch (type) {
      case Q8_0: NAME(group_Q8_0)(C, rows, ahead, k, a, i, out, n, valid); break;
      case Q4_0: NAME(group_Q4_0)(C, rows, ahead, k, a, i, out, n, valid); break;
      case Q4_1: NAME(group_Q4_1)(C, rows, ahead, k, a, i, out, n, valid); break;
      case Q5_0: NAME(group_Q5_0)(C, rows, ahead, k, a, i, out, n, valid); break;
      case Q5_1: NAME(group_Q5_1)(C, rows, ahead, k, a, i, out, n, valid); break;
      case Q4_K: NAME(group_Q4_K)(C, rows, ahead, k, a, i, out, n, valid); break;
      case Q5_K: NAME(group_Q5_K)(C, rows, ahead, k, a, i, out, n, valid); break;
      default: NAME(group_Q6_K)(C, rows, ahead, k, a, i, out, n, valid); break;
    }
  }
}

#ifdef WITH_DEQUANTIZE /* once: dequantization gains nothing from AVX-512 VNNI */
/* 32 values q (int8) to floats: scale_lo * q for the first 16, scale_hi * q for the rest, then + m if has_min
 * (gguf-py's float32 operations, one rounding each). */
ISA static inline void NAME(store_block)(__m256i q, float scale_lo, float scale_hi, int has_min, float m, float *out) {
  __m128i halves[2] = {_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)};
  for (int i = 0; i < 4; i++) {
    __m128i bytes = i % 2 ? _mm_srli_si128(halves[i / 2], 8) : halves[i / 2];
    __m256 v = _mm256_mul_ps(_mm256_set1_ps(i < 2 ? scale_lo : scale_hi), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)));
    if (has_min) v = _mm256_add_ps(v, _mm256_set1_ps(m));
    _mm256_storeu_ps(out + 8 * i, v);
  }
}

/* One row of k values of `type` from its blocks into y, bit-exact with dequantize_row. */
ISA static void NAME(dequantize_row)(int type, const uint8_t *row, float *y, long k) {
  const __m256i low = _mm256_set1_epi8(0x0f);
  if (type == F16 || type == BF16) {
    long j = 0;
    for (; j + 8 <= k; j += 8) {
      __m128i h = _mm_loadu_si128((const __m128i *)(row + 2 * j));
      __m256 v = type == F16 ? _mm256_cvtph_ps(h) : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
      _mm256_storeu_ps(y + j, v);
    }
    if (j < k) dequantize_row(type, row + 2 * j, y + j, k - j);
  } else if (type == Q8_0 || type == Q4_0 || type == Q4_1 || type == Q5_0 || type == Q5_1) {
    long bytes = format_of(type).bytes;
    for (long b = 0; b < k / QK; b++) {
      const uint8_t *p = row + b * bytes;
      float d = NAME(half)(p), m = 0.0f;
      __m256i q;
      if (type == Q8_0) q = _mm256_loadu_si256((const __m256i *)(p + 2));
      else if (type == Q4_0) q = _mm256_sub_epi8(NAME(nibbles)(p + 2), _mm256_set1_epi8(8));
      else if (type == Q4_1) q = NAME(nibbles)(p + 4), m = NAME(half)(p + 2);
      else if (type == Q5_0)
        q = _mm256_sub_epi8(_mm256_or_si256(NAME(nibbles)(p + 6), NAME(fifth_bits)(p + 2)), _mm256_set1_epi8(16));
      else q = _mm256_or_si256(NAME(nibbles)(p + 8), NAME(fifth_bits)(p + 4)), m = NAME(half)(p + 2);
      NAME(store_block)(q, d, d, type == Q4_1 || type == Q5_1, m, y + QK * b);
    }
  } else if (type == Q4_K || type == Q5_K) {
    long bytes = format_of(type).bytes;
    for (long sb = 0; sb < k / 256; sb++) {
      const uint8_t *p = row + sb * bytes, *qs = p + (type == Q4_K ? 16 : 48);
      float d = NAME(half)(p), dmin = NAME(half)(p + 2);
      uint8_t scale[8], min[8];
      k_scales(p + 4, scale, min);
      __m256i high = type == Q5_K ? _mm256_loadu_si256((const __m256i *)(p + 16)) : _mm256_setzero_si256();
      for (int s = 0; s < 8; s++) {
        __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * (s / 2)));
        q = _mm256_and_si256(s % 2 ? _mm256_srli_epi16(q, 4) : q, low);
        if (type == Q5_K) {
          __m256i bit = _mm256_set1_epi8((char)(1 << s));
          q = _mm256_or_si256(q, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(high, bit), bit),
                                                  _mm256_set1_epi8(16)));
        }
        float ds = d * (float)scale[s];
        NAME(store_block)(q, ds, ds, 1, -(dmin * (float)min[s]), y + 256 * sb + 32 * s);
      }
    }
  } else { /* Q6_K */
    for (long sb = 0; sb < k / 256; sb++) {
      const uint8_t *p = row + sb * 210;
      float d = NAME(half)(p + 208);
#pragma GCC unroll 8
      for (int s = 0; s < 8; s++) {
        int half = s / 4, quarter = s % 4;
        __m256i ql = _mm256_loadu_si256((const __m256i *)(p + 64 * half + 32 * (quarter % 2)));
        __m256i qh = _mm256_loadu_si256((const __m256i *)(p + 128 + 32 * half));
        ql = _mm256_and_si256(quarter / 2 ? _mm256_srli_epi16(ql, 4) : ql, low);
        qh = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * quarter)), _mm256_set1_epi8(3));
        __m256i q = _mm256_sub_epi8(_mm256_or_si256(ql, _mm256_slli_epi16(qh, 4)), _mm256_set1_epi8(32));
        NAME(store_block)(q, d * (float)(int8_t)p[192 + 2 * s], d * (float)(int8_t)p[192 + 2 * s + 1], 0, 0.0f,
                          y + 256 * sb + 32 * s);
      }
    }
  }
}
#endif
