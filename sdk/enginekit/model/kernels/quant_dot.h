/* The int8 path's kernels for one instruction set, included by quant_gemm.c once per set, with
 *   ISA        the function attribute (AVX2_F16C or AVX512_VNNI),
 *   NAME(x)    x with the set's suffix,
 *   DOT_U      the int32 sums of four products each, of unsigned weight bytes (0-63) and signed input bytes,
 *   DOT_S      the same of signed weight bytes (-128-127), `corr` the input's correction for DOT_S.
 * Each weight block is decoded in registers straight from its stored bytes (no copy), then multiplied into one
 * or four quantized input rows. The 4- and 5-bit types are decoded unsigned (0-15, 0-31) and their offset (-8,
 * -16) folded into the block's minimum, so they need no sign handling; Q8_0 and Q6_K are signed.
 */

/* The float32 value of a float16 (exact, subnormals included). */
ISA static inline float NAME(half)(const uint8_t *p) {
  uint16_t h;
  memcpy(&h, p, sizeof h);
  return _cvtsh_ss(h);
}

/* 32 four-bit values: the low nibbles of qs[0..15], then their high nibbles. */
ISA static inline __m256i NAME(nibbles)(const uint8_t *qs) {
  __m128i v = _mm_loadu_si128((const __m128i *)qs), low = _mm_set1_epi8(0x0f);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), low), _mm_and_si128(v, low));
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

/* One decoded weight block (values w, scales ws per four values, minimum wm) into C input rows from r0. */
ISA static inline __attribute__((always_inline)) void NAME(accumulate)(int C, int is_signed, int has_min, __m256i w,
                                                                        __m256 ws, float wm, const quantized *a,
                                                                        long r0, long b, __m256 *acc, float *mins) {
  for (int c = 0; c < C; c++) {
    long block = (r0 + c) * a->blocks + b;
    __m256i x = _mm256_loadu_si256((const __m256i *)(a->q + QK * block)), dot;
    if (is_signed) dot = DOT_S(w, x, a->corr + LANES * block);
    else dot = DOT_U(w, x);
    acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(ws, _mm256_loadu_ps(a->lanes + LANES * block)),
                             acc[c]);
    if (has_min) mins[c] += wm * a->sums[block];
  }
}

/* One stored weight row of `type` against C (1 or 4) quantized input rows from r0, into y[0], y[ldy], ... (type
 * and C constant at each call, so each use compiles to its own straight loop). */
ISA static inline __attribute__((always_inline)) void NAME(rows)(int type, int C, const uint8_t *row, long k,
                                                                  const quantized *a, long r0, float *y, long ldy) {
  __m256 acc[4];
  float mins[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int c = 0; c < C; c++) acc[c] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0x0f);
  if (type == Q8_0 || type == Q4_0 || type == Q4_1 || type == Q5_0 || type == Q5_1) {
    long bytes = format_of(type).bytes;
    for (long b = 0; b < k / QK; b++) {
      const uint8_t *p = row + b * bytes;
      float d = NAME(half)(p), m = 0.0f;
      __m256i w;
      if (type == Q8_0) w = _mm256_loadu_si256((const __m256i *)(p + 2));
      else if (type == Q4_0) w = NAME(nibbles)(p + 2), m = d * -8.0f;
      else if (type == Q4_1) w = NAME(nibbles)(p + 4), m = NAME(half)(p + 2);
      else if (type == Q5_0) w = _mm256_or_si256(NAME(nibbles)(p + 6), NAME(fifth_bits)(p + 2)), m = d * -16.0f;
      else w = _mm256_or_si256(NAME(nibbles)(p + 8), NAME(fifth_bits)(p + 4)), m = NAME(half)(p + 2);
      NAME(accumulate)(C, type == Q8_0, type != Q8_0, w, _mm256_set1_ps(d), m, a, r0, b, acc, mins);
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
        __m256i w = _mm256_loadu_si256((const __m256i *)(qs + 32 * (s / 2)));
        w = _mm256_and_si256(s % 2 ? _mm256_srli_epi16(w, 4) : w, low);
        if (type == Q5_K) {
          __m256i bit = _mm256_set1_epi8((char)(1 << s));
          w = _mm256_or_si256(w, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(high, bit), bit),
                                                  _mm256_set1_epi8(16)));
        }
        NAME(accumulate)(C, 0, 1, w, _mm256_set1_ps(d * (float)scale[s]), -(dmin * (float)min[s]), a, r0, 8 * sb + s,
                         acc, mins);
      }
    }
  } else { /* Q6_K */
    for (long sb = 0; sb < k / 256; sb++) {
      const uint8_t *p = row + sb * 210;
      float d = NAME(half)(p + 208);
      for (int s = 0; s < 8; s++) {
        int half = s / 4, quarter = s % 4;
        __m256i ql = _mm256_loadu_si256((const __m256i *)(p + 64 * half + 32 * (quarter % 2)));
        __m256i qh = _mm256_loadu_si256((const __m256i *)(p + 128 + 32 * half));
        ql = _mm256_and_si256(quarter / 2 ? _mm256_srli_epi16(ql, 4) : ql, low);
        qh = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * quarter)), _mm256_set1_epi8(3));
        __m256i w = _mm256_sub_epi8(_mm256_or_si256(ql, _mm256_slli_epi16(qh, 4)), _mm256_set1_epi8(32));
        __m256 ws = _mm256_set_m128(_mm_set1_ps(d * (float)(int8_t)p[192 + 2 * s + 1]),
                                    _mm_set1_ps(d * (float)(int8_t)p[192 + 2 * s]));
        NAME(accumulate)(C, 1, 0, w, ws, 0.0f, a, r0, 8 * sb + s, acc, mins);
      }
    }
  }
  for (int c = 0; c < C; c++) y[c * ldy] = hsum8(acc[c]) + mins[c];
}

#define DEFINE_ROWS(T)                                                                                          \
  ISA static void NAME(rows_##T)(int C, const uint8_t *row, long k, const quantized *a, long r0, float *y,     \
                                 long ldy) {                                                                    \
    if (C == 4) NAME(rows)(T, 4, row, k, a, r0, y, ldy);                                                        \
    else NAME(rows)(T, 1, row, k, a, r0, y, ldy);                                                               \
  }
DEFINE_ROWS(Q8_0)
DEFINE_ROWS(Q4_0)
DEFINE_ROWS(Q4_1)
DEFINE_ROWS(Q5_0)
DEFINE_ROWS(Q5_1)
DEFINE_ROWS(Q4_K)
DEFINE_ROWS(Q5_K)
DEFINE_ROWS(Q6_K)
#undef DEFINE_ROWS

/* The stored weight row of `type` against input rows r0 .. r0 + rows - 1 (four at a time, then one by one). */
ISA static void NAME(int8_rows)(int type, const uint8_t *row, long k, const quantized *a, long r0, long rows, float *y,
                                long ldy) {
  for (long i = 0; i < rows;) {
    int C = rows - i >= 4 ? 4 : 1;
    switch (type) {
      case Q8_0: NAME(rows_Q8_0)(C, row, k, a, r0 + i, y + i * ldy, ldy); break;
      case Q4_0: NAME(rows_Q4_0)(C, row, k, a, r0 + i, y + i * ldy, ldy); break;
      case Q4_1: NAME(rows_Q4_1)(C, row, k, a, r0 + i, y + i * ldy, ldy); break;
      case Q5_0: NAME(rows_Q5_0)(C, row, k, a, r0 + i, y + i * ldy, ldy); break;
      case Q5_1: NAME(rows_Q5_1)(C, row, k, a, r0 + i, y + i * ldy, ldy); break;
      case Q4_K: NAME(rows_Q4_K)(C, row, k, a, r0 + i, y + i * ldy, ldy); break;
      case Q5_K: NAME(rows_Q5_K)(C, row, k, a, r0 + i, y + i * ldy, ldy); break;
      default: NAME(rows_Q6_K)(C, row, k, a, r0 + i, y + i * ldy, ldy); break;
    }
    i += C;
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
