/* Products of float32 rows with a weight kept as the GGUF file stores it: y[m, n] = x[m, k] W[n, k]^T, W given as
 * its n rows of blocks, byte for byte as in the file (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, F16, BF16).
 *
 * A decode step of a few rows is bound by the bytes it streams, so the weight is read once, in its stored form:
 * - the int8 path (block types, up to 16 rows): each input row is quantized once per call to int8 blocks of 32, as ggml
 *   does for its dot products, but with one float scale per four values (ggml: per 32). Weight rows go four at a time:
 *   each block of the four is decoded in registers straight from its stored bytes and multiplied into up to eight input
 *   rows (four on AVX2) with integer dot products (AVX-512 VNNI's vpdpbusd, else AVX2's vpmaddubsw), each four values'
 *   sum scaled in float by its input scale, and the four rows' vectors reduced by unpacks to one vector of the four
 *   rows' sums over each half block, scaled by the four rows' scales converted at once; the minimums' share is summed
 *   four rows at once in a vector. Independent accumulators (one per input row) keep the multiply-adds from waiting on
 *   each other, and the weight is prefetched PREFETCH_ROWS rows ahead (four interleaved row streams defeat the hardware
 *   prefetcher). Against one row at a time with one accumulator this measured 1.5-1.7x at one input row and 1.3-1.9x at
 *   eight on the default model's Q4_1 shapes (benchmarks/quant_kernels_ab.py). Quantizing the input costs at most half
 *   a step (the largest magnitude of its four values / 127) per value (see docs/models.md for the cost in quality);
 * - the bf16 path (block types from BF16_MIN_ROWS rows on, a prefill's included, on CPUs with AVX-512 BF16): the
 *   input rows and each task's four dequantized weight rows rounded to bf16 once per chunk of input rows, then
 *   vdpbf16ps with no scaling left in the inner loop (see gemm_bf16): from 6 rows it beats the int8 path, bound by
 *   its per-four-values float work, and at any count of rows the panel path, bound by float32 multiply-adds (16 a
 *   vector where vdpbf16ps does 32);
 * - the float path (F16 and BF16 at a few rows; every type without AVX2): each weight row dequantized into the L1
 *   cache and multiplied into every input row with float multiply-adds, no quantization of the input;
 * - the panel path (many rows): the weight dequantized panel by panel into panel_gemm.c's panels, and its 6x16
 *   micro-kernel: a prefill step is bound by arithmetic, and the dequantization is paid once for all the rows.
 * Each path computes a row's outputs from that row alone, the same whatever the other rows, but the paths differ: so
 * PATH_AUTO's choice by the row count makes a row's result depend on how many rows share its call. PATH_INVARIANT
 * takes one path at every row count (the engine's batch_invariant mode): the bf16 path on CPUs with AVX-512 BF16
 * (every type), else the int8 path for the block types and the float path for F16 and BF16.
 * Dequantization is bit-exact with gguf-py's (the same float products, in the same order, never fused).
 * Weight rows are split over OpenMP threads (torch's pool). Built with the other kernels into one library by
 * enginekit/model/kernels/library.py.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

enum { F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14, BF16 = 30 };
enum { ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_AVX512_VNNI = 2, ISA_AVX512_BF16 = 3 };
enum { PATH_AUTO = 0, PATH_INT8 = 1, PATH_FLOAT = 2, PATH_PANELS = 3, PATH_BF16 = 4, PATH_INVARIANT = 5 };
enum { OK = 0, BAD_TYPE = -1, BAD_SHAPE = -2, NO_MEMORY = -3, BAD_ISA = -4, BAD_PATH = -5 };

#define QK 32                         /* values per unpacked block (and per quantized input block) */
#define LANES 8                       /* scales per unpacked block: one per four values, as the dot products sum them */
#ifndef INPUT_GROUP
#define INPUT_GROUP 4 /* input values per int8 scale (a multiple of 4 dividing QK): see quantize_rows */
#endif
#define INT8_MAX_ROWS 16              /* the int8 path up to this many rows, the panel path past it */
#define BF16_MIN_ROWS 6               /* with AVX-512 BF16, the bf16 path from this many rows on */
#define BF16_MIN_ROWS_Q6_K 8          /* Q6_K's from this many: its values are converted 16 at a time, not looked up */
#define BF16_TILE 6                   /* the bf16 path's input rows per pass over four decoded weight rows */
#define BF16_CHUNK_VALUES (192L * 1024) /* the bf16 path's input rows per pass over the weight: this many values */
#define FLOAT_MAX_ROWS 8              /* F16/BF16: the float path up to this many rows */
#define ROWS_PER_TASK 4               /* weight rows per parallel task (a multiple of 4: the int8 path's group) */
#define PREFETCH_ROWS 8               /* the int8 path asks for the weight this many rows ahead */
#define PARALLEL_MIN_BYTES (1L << 16) /* weight bytes below which a call runs on the calling thread */

typedef struct {
  long block, bytes; /* values per block, bytes per block */
} format;

static format format_of(int type) {
  switch (type) {
    case F16: case BF16: return (format){1, 2};
    case Q4_0: return (format){32, 18};
    case Q4_1: return (format){32, 20};
    case Q5_0: return (format){32, 22};
    case Q5_1: return (format){32, 24};
    case Q8_0: return (format){32, 34};
    case Q4_K: return (format){256, 144};
    case Q5_K: return (format){256, 176};
    case Q6_K: return (format){256, 210};
    default: return (format){0, 0};
  }
}

/* Values per block and bytes per block of a GGUF type; 0 if the library has no kernel for it. */
int enginekit_quant_format(int type, long *block, long *bytes) {
  format f = format_of(type);
  *block = f.block;
  *bytes = f.bytes;
  return f.block ? OK : BAD_TYPE;
}

/* The best instruction set of this CPU for the block types: ISA_AVX512_BF16 (AVX-512 VNNI and BF16),
 * ISA_AVX512_VNNI, ISA_AVX2 or ISA_SCALAR. */
int enginekit_quant_isa(void) {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
    return __builtin_cpu_supports("avx512bf16") ? ISA_AVX512_BF16 : ISA_AVX512_VNNI;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
    return ISA_AVX2;
  return ISA_SCALAR;
}

/* ---- Dequantization: gguf-py's float32 formulas, operation by operation (the library is built with
 * -ffp-contract=off, so a * b + c stays two roundings). */

static inline float half_to_float(const uint8_t *p) {
  uint32_t h = (uint32_t)p[0] | (uint32_t)p[1] << 8;
  uint32_t sign = (h & 0x8000u) << 16, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff, bits;
  if (exponent == 0 && mantissa == 0) {
    bits = sign;
  } else if (exponent == 0) { /* subnormal: shift the mantissa up to its leading one */
    exponent = 113;
    while (!(mantissa & 0x400)) mantissa <<= 1, exponent--;
    bits = sign | exponent << 23 | (mantissa & 0x3ff) << 13;
  } else if (exponent == 31) {
    bits = sign | 0x7f800000u | mantissa << 13;
  } else {
    bits = sign | (exponent + 112) << 23 | mantissa << 13;
  }
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}

static inline uint32_t le32(const uint8_t *p) {
  return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* The six-bit scales and minimums of a Q4_K / Q5_K block's eight sub-blocks, from their twelve bytes. */
static inline void k_scales(const uint8_t *s, uint8_t *scale, uint8_t *min) {
  for (int j = 0; j < 4; j++) {
    scale[j] = s[j] & 0x3f;
    min[j] = s[4 + j] & 0x3f;
    scale[4 + j] = (s[8 + j] & 0x0f) | ((s[j] >> 2) & 0x30);
    min[4 + j] = (s[8 + j] >> 4) | ((s[4 + j] >> 2) & 0x30);
  }
}

/* The five-bit value i (0-31) of a Q5_0 / Q5_1 block: its nibble and its bit of qh. */
static inline int q5_value(const uint8_t *qs, uint32_t qh, int i) {
  int nibble = i < 16 ? qs[i] & 0x0f : qs[i - 16] >> 4;
  return nibble | (int)((qh >> i) & 1) << 4;
}

/* The six-bit value i (0-255) of a Q6_K block, minus 32. */
static inline int q6_value(const uint8_t *ql, const uint8_t *qh, int i) {
  int half = i / 128, within = i % 128;
  int low = (ql[64 * half + within % 64] >> (4 * (within / 64))) & 0x0f;
  int high = (qh[32 * half + within % 32] >> (2 * (within / 32))) & 0x03;
  return (low | high << 4) - 32;
}

/* One row of k values of `type` from its blocks into y. */
static void dequantize_row(int type, const uint8_t *row, float *y, long k) {
  format f = format_of(type);
  for (long b = 0; b < k / f.block; b++) {
    const uint8_t *p = row + b * f.bytes;
    float *out = y + b * f.block;
    switch (type) {
      case F16: out[0] = half_to_float(p); break;
      case BF16: {
        uint32_t bits = (uint32_t)(p[0] | p[1] << 8) << 16;
        memcpy(out, &bits, sizeof bits);
        break;
      }
      case Q8_0: {
        float d = half_to_float(p);
        for (int i = 0; i < 32; i++) out[i] = (float)(int8_t)p[2 + i] * d;
        break;
      }
      case Q4_0: {
        float d = half_to_float(p);
        for (int i = 0; i < 16; i++) out[i] = d * (float)((p[2 + i] & 0x0f) - 8), out[16 + i] = d * (float)((p[2 + i] >> 4) - 8);
        break;
      }
      case Q4_1: {
        float d = half_to_float(p), m = half_to_float(p + 2);
        for (int i = 0; i < 16; i++) out[i] = d * (float)(p[4 + i] & 0x0f) + m, out[16 + i] = d * (float)(p[4 + i] >> 4) + m;
        break;
      }
      case Q5_0: {
        float d = half_to_float(p);
        uint32_t qh = le32(p + 2);
        for (int i = 0; i < 32; i++) out[i] = d * (float)(q5_value(p + 6, qh, i) - 16);
        break;
      }
      case Q5_1: {
        float d = half_to_float(p), m = half_to_float(p + 2);
        uint32_t qh = le32(p + 4);
        for (int i = 0; i < 32; i++) out[i] = d * (float)q5_value(p + 8, qh, i) + m;
        break;
      }
      case Q4_K: case Q5_K: {
        float d = half_to_float(p), dmin = half_to_float(p + 2);
        uint8_t scale[8], min[8];
        k_scales(p + 4, scale, min);
        const uint8_t *qh = p + 16, *qs = type == Q4_K ? p + 16 : p + 48;
        for (int s = 0; s < 8; s++) {
          float ds = d * (float)scale[s], dm = dmin * (float)min[s];
          for (int i = 0; i < 32; i++) {
            int q = (qs[32 * (s / 2) + i] >> (4 * (s % 2))) & 0x0f;
            if (type == Q5_K) q |= ((qh[i] >> s) & 1) << 4;
            out[32 * s + i] = ds * (float)q - dm;
          }
        }
        break;
      }
      case Q6_K: {
        float d = half_to_float(p + 208);
        for (int i = 0; i < 256; i++) {
          float ds = d * (float)(int8_t)p[192 + i / 16];
          out[i] = ds * (float)q6_value(p, p + 128, i);
        }
        break;
      }
    }
  }
}

/* ---- The int8 path. A weight row unpacked: per block of 32 values, q[32] (int8), lanes[8] (the scale of each
 * four values) and min, the value being lanes[i / 4] * q[i] + min. An input row quantized: per block q[32] (int8),
 * lanes[8] (the scale of each four values), sums (the scaled sum of q) and corr[8] (-128 x each four values' sum,
 * for vpdpbusd, which takes the weights unsigned: q + 128). */

typedef struct {
  int8_t *q;
  float *lanes, *sums;
  int32_t *corr;
  long blocks; /* per row */
} quantized;

static void unpack_row(int type, const uint8_t *row, long k, int8_t *q, float *lanes, float *mins) {
  format f = format_of(type);
  for (long b = 0; b < k / f.block; b++) {
    const uint8_t *p = row + b * f.bytes;
    switch (type) {
      case Q8_0: case Q4_0: case Q4_1: case Q5_0: case Q5_1: {
        float d = half_to_float(p), m = 0.0f;
        int8_t *out = q + 32 * b;
        if (type == Q8_0) {
          memcpy(out, p + 2, 32);
        } else if (type == Q4_0 || type == Q4_1) {
          const uint8_t *qs = p + (type == Q4_0 ? 2 : 4);
          int offset = type == Q4_0 ? 8 : 0;
          for (int i = 0; i < 16; i++) out[i] = (int8_t)((qs[i] & 0x0f) - offset), out[16 + i] = (int8_t)((qs[i] >> 4) - offset);
        } else {
          const uint8_t *qs = p + (type == Q5_0 ? 6 : 8);
          uint32_t qh = le32(p + (type == Q5_0 ? 2 : 4));
          int offset = type == Q5_0 ? 16 : 0;
          for (int i = 0; i < 32; i++) out[i] = (int8_t)(q5_value(qs, qh, i) - offset);
        }
        if (type == Q4_1 || type == Q5_1) m = half_to_float(p + 2);
        for (int l = 0; l < LANES; l++) lanes[LANES * b + l] = d;
        mins[b] = m;
        break;
      }
      case Q4_K: case Q5_K: {
        float d = half_to_float(p), dmin = half_to_float(p + 2);
        uint8_t scale[8], min[8];
        k_scales(p + 4, scale, min);
        const uint8_t *qh = p + 16, *qs = type == Q4_K ? p + 16 : p + 48;
        for (int s = 0; s < 8; s++) {
          long block = 8 * b + s;
          int8_t *out = q + 32 * block;
          for (int i = 0; i < 32; i++) {
            int value = (qs[32 * (s / 2) + i] >> (4 * (s % 2))) & 0x0f;
            if (type == Q5_K) value |= ((qh[i] >> s) & 1) << 4;
            out[i] = (int8_t)value;
          }
          float ds = d * (float)scale[s];
          for (int l = 0; l < LANES; l++) lanes[LANES * block + l] = ds;
          mins[block] = -(dmin * (float)min[s]);
        }
        break;
      }
      case Q6_K: {
        float d = half_to_float(p + 208);
        for (int i = 0; i < 256; i++) q[256 * b + i] = (int8_t)q6_value(p, p + 128, i);
        for (int s = 0; s < 16; s++) {
          float ds = d * (float)(int8_t)p[192 + s];
          for (int l = 0; l < 4; l++) lanes[LANES * (8 * b + s / 2) + 4 * (s % 2) + l] = ds;
        }
        for (int s = 0; s < 8; s++) mins[8 * b + s] = 0.0f;
        break;
      }
    }
  }
}

/* Each row of x [m, k] to int8 blocks of 32, with one scale per INPUT_GROUP values (their largest magnitude maps
 * to 127). The dot products scale each four values' sum on its own anyway (the weight's scales are per four values
 * in a block's lanes), so a finer input scale costs nothing there; per four values instead of per 32 took the
 * default model's mean deviation from the float32 reference from 0.051 to 0.017 nats a token (benchmarks/
 * bench_quant.py; llama.cpp, with one scale per 32: 0.054). */
static void quantize_rows(const float *x, long m, long k, const quantized *a) {
  for (long r = 0; r < m; r++)
    for (long b = 0; b < k / QK; b++) {
      const float *v = x + r * k + b * QK;
      long block = r * a->blocks + b;
      int8_t *q = a->q + block * QK;
      float total = 0.0f;
      for (int g = 0; g < QK / INPUT_GROUP; g++) { /* one scale per INPUT_GROUP values */
        const float *u = v + g * INPUT_GROUP;
        int8_t *out = q + g * INPUT_GROUP;
        float largest = 0.0f;
        for (int i = 0; i < INPUT_GROUP; i++) largest = fmaxf(largest, fabsf(u[i]));
        float d = largest / 127.0f, inverse = d > 0.0f ? 1.0f / d : 0.0f;
        int sum = 0;
        for (int i = 0; i < INPUT_GROUP; i++) {
          float scaled = fminf(fmaxf(u[i] * inverse, -127.0f), 127.0f);
          out[i] = (int8_t)lrintf(scaled);
          sum += out[i];
        }
        for (int l = g * INPUT_GROUP / 4; l < (g + 1) * INPUT_GROUP / 4; l++) a->lanes[block * LANES + l] = d;
        total += d * (float)sum;
      }
      for (int l = 0; l < LANES; l++)
        a->corr[block * LANES + l] = -128 * (q[4 * l] + q[4 * l + 1] + q[4 * l + 2] + q[4 * l + 3]);
      a->sums[block] = total;
    }
}

#if INPUT_GROUP == 4
/* quantize_rows with AVX2, the same results for finite inputs: the same float operations per value (largest
 * magnitude, division, multiply, clamp, round to nearest even), the same sequential sum of the scaled sums. */
AVX2 static void quantize_rows_avx2(const float *x, long m, long k, const quantized *a) {
  const __m256 sign = _mm256_set1_ps(-0.0f), low = _mm256_set1_ps(-127.0f), high = _mm256_set1_ps(127.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (long r = 0; r < m; r++)
    for (long b = 0; b < k / QK; b++) {
      const float *v = x + r * k + b * QK;
      long block = r * a->blocks + b;
      float scales[QK];
      __m256i q[4];
      for (int i = 0; i < 4; i++) { /* values 8i .. 8i + 7: two groups of four */
        __m256 values = _mm256_loadu_ps(v + 8 * i), magnitude = _mm256_andnot_ps(sign, values);
        __m256 largest = _mm256_max_ps(magnitude, _mm256_permute_ps(magnitude, 0xb1));
        largest = _mm256_max_ps(largest, _mm256_permute_ps(largest, 0x4e)); /* each group's in its four lanes */
        __m256 d = _mm256_div_ps(largest, _mm256_set1_ps(127.0f));
        __m256 inverse = _mm256_and_ps(_mm256_div_ps(_mm256_set1_ps(1.0f), d),
                                       _mm256_cmp_ps(d, _mm256_setzero_ps(), _CMP_GT_OQ));
        _mm256_storeu_ps(scales + 8 * i, d);
        q[i] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(values, inverse), low), high));
      }
      __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
      bytes = _mm256_permutevar8x32_epi32(bytes, order);
      _mm256_storeu_si256((__m256i *)(a->q + block * QK), bytes);
      __m256i fours = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), bytes), _mm256_set1_epi16(1));
      _mm256_storeu_si256((__m256i *)(a->corr + block * LANES), _mm256_mullo_epi32(fours, _mm256_set1_epi32(-128)));
      int32_t sums[LANES];
      _mm256_storeu_si256((__m256i *)sums, fours);
      float total = 0.0f;
      for (int l = 0; l < LANES; l++) {
        a->lanes[block * LANES + l] = scales[4 * l];
        total += scales[4 * l] * (float)sums[l];
      }
      a->sums[block] = total;
    }
}
#endif

/* The minimums' share of a dot product: sum over blocks of the weight's min x the input block's scaled sum. */
static inline float min_share(const float *mins, const float *sums, long blocks) {
  float total = 0.0f;
  for (long b = 0; b < blocks; b++) total += mins[b] * sums[b];
  return total;
}

/* One unpacked weight row against `rows` quantized input rows from r0, into y[0], y[ldy], ... */
static void int8_rows_scalar(const int8_t *wq, const float *wl, const float *wm, int has_min, const quantized *a,
                             long r0, int rows, float *y, long ldy) {
  for (int c = 0; c < rows; c++) {
    long base = (r0 + c) * a->blocks;
    float lane_sums[LANES] = {0};
    for (long b = 0; b < a->blocks; b++)
      for (int l = 0; l < LANES; l++) {
        int dot = 0;
        for (int i = 4 * l; i < 4 * l + 4; i++) dot += wq[QK * b + i] * a->q[(base + b) * QK + i];
        lane_sums[l] += (float)dot * (wl[LANES * b + l] * a->lanes[(base + b) * LANES + l]);
      }
    float total = 0.0f;
    for (int l = 0; l < LANES; l++) total += lane_sums[l];
    y[c * ldy] = total + (has_min ? min_share(wm, a->sums + base, a->blocks) : 0.0f);
  }
}

/* The fused kernels of quant_dot.h, once for AVX2 (vpmaddubsw: |w| times x with w's sign, pairs then fours summed)
 * and once for AVX-512 VNNI (vpdpbusd on 256-bit vectors; signed weights as w + 128, from -128 x the input's four
 * value sums). */
#define ISA AVX2_F16C
#define NAME(x) x##_avx2
#define INPUTS 4 /* input rows per decoded block: 16 vector registers */
#define WITH_DEQUANTIZE
#define DOT_U(w, x) _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1))
#define DOT_S(w, x, corr) \
  _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w)), _mm256_set1_epi16(1))
#include "quant_dot.h"
#undef ISA
#undef NAME
#undef INPUTS
#undef DOT_U
#undef DOT_S
#undef WITH_DEQUANTIZE
#define ISA AVX512_VNNI
#define NAME(x) x##_vnni
#define INPUTS 8 /* 32 vector registers */
#define DOT_U(w, x) _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x)
#define DOT_S(w, x, corr)                                                                                     \
  _mm256_dpbusd_epi32(_mm256_loadu_si256((const __m256i *)(corr)), _mm256_xor_si256(w, _mm256_set1_epi8((char)0x80)), x)
#include "quant_dot.h"
#undef ISA
#undef NAME
#undef INPUTS
#undef DOT_U
#undef DOT_S

static int gemm_int8(const float *x, const uint8_t *w, int type, float *y, long m, long n, long k, int threads,
                     int isa) {
  format f = format_of(type);
  long blocks = k / QK, row_bytes = k / f.block * f.bytes;
  int has_min = type == Q4_1 || type == Q5_1 || type == Q4_K || type == Q5_K;
  /* the input, quantized, then each thread's unpacked row: q, lanes and minimums */
  size_t input = (size_t)m * (k + blocks * (2 * LANES * 4 + 4)), row = (size_t)k + blocks * (LANES + 1) * 4 + 64;
  char *memory = aligned_alloc(64, (input + row * threads + 63) / 64 * 64);
  if (!memory) return NO_MEMORY;
  quantized a = {(int8_t *)memory, (float *)(memory + m * k), NULL, NULL, blocks};
  a.corr = (int32_t *)(a.lanes + m * blocks * LANES);
  a.sums = (float *)(a.corr + m * blocks * LANES);
#if INPUT_GROUP == 4
  if (isa != ISA_SCALAR) quantize_rows_avx2(x, m, k, &a);
  else
#endif
    quantize_rows(x, m, k, &a);
  long tasks = (n + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
#pragma omp parallel for num_threads(threads) schedule(static) if (n * row_bytes >= PARALLEL_MIN_BYTES)
  for (long t = 0; t < tasks; t++) {
    long end = (t + 1) * ROWS_PER_TASK < n ? (t + 1) * ROWS_PER_TASK : n;
    if (isa != ISA_SCALAR) {
      for (long r = t * ROWS_PER_TASK; r < end; r += 4) {
        if (isa >= ISA_AVX512_VNNI) int8_rows_vnni(type, w, row_bytes, n, r, k, &a, m, y);
        else int8_rows_avx2(type, w, row_bytes, n, r, k, &a, m, y);
      }
      continue;
    }
    char *mine = memory + input + row * omp_get_thread_num();
    int8_t *wq = (int8_t *)mine;
    float *wl = (float *)(mine + k), *wm = wl + blocks * LANES;
    for (long r = t * ROWS_PER_TASK; r < end; r++) {
      unpack_row(type, w + r * row_bytes, k, wq, wl, wm);
      for (long i = 0; i < m; i += 4)
        int8_rows_scalar(wq, wl, wm, has_min, &a, i, m - i < 4 ? (int)(m - i) : 4, y + i * n + r, n);
    }
  }
  free(memory);
  return OK;
}

/* ---- The bf16 path (AVX-512 BF16; BF16_MIN_ROWS rows of a block type or more, or when asked). Each input
 * row is rounded to bf16 once per call; each task's four weight rows are dequantized (dequantize_row's float32
 * values) and rounded to bf16 into the thread's L1-sized buffer once, then multiplied into the input rows
 * BF16_TILE at a time with vdpbf16ps (32 products a row pair per instruction, float32 sums): per 32 values, four
 * weight loads and BF16_TILE input loads feed 4 x BF16_TILE multiply-adds on independent accumulators, with no
 * per-block scaling left in the loop (the block's scale and minimum are in the rounded values). Rounding both sides
 * to bf16 (8 significant bits) costs at most 2^-8 of each value's magnitude on each side (see docs/models.md for
 * the cost in quality). */

/* Rows of x [m, k] rounded to bf16 (nearest even) into out, rows kp values apart (a multiple of 32), zero past k. */
AVX512_BF16 static void round_rows_bf16(const float *x, long m, long k, long kp, uint16_t *out) {
  for (long r = 0; r < m; r++)
    for (long j = 0; j < kp; j += 32) {
      long left = k - j;
      __mmask16 lo = left >= 16 ? 0xffff : left > 0 ? (__mmask16)((1u << left) - 1) : 0;
      __mmask16 hi = left >= 32 ? 0xffff : left > 16 ? (__mmask16)((1u << (left - 16)) - 1) : 0;
      __m512 a = _mm512_maskz_loadu_ps(lo, x + r * k + j), b = _mm512_maskz_loadu_ps(hi, x + r * k + j + 16);
      _mm512_storeu_si512((void *)(out + r * kp + j), (__m512i)_mm512_cvtne2ps_pbh(b, a));
    }
}

/* 32 values, lo the first 16 and hi the rest, as bf16 (nearest even) at out. */
AVX512_BF16 static inline void store_bf16(__m512 lo, __m512 hi, uint16_t *out) {
  _mm512_storeu_si512((void *)out, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}

/* The float32 value of the float16 at p, in every lane. */
AVX512_BF16 static inline __m512 half_bf16(const uint8_t *p) {
  uint16_t h;
  memcpy(&h, p, sizeof h);
  return _mm512_set1_ps(_cvtsh_ss(h));
}

/* 16 bytes at p, each an int32 lane. */
AVX512_BF16 static inline __m512i bytes_bf16(const uint8_t *p) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
}

/* The bf16 values d * i + m (one float32 rounding, then the bf16 one) for i = 0 .. 31, as the 32 words of a table for
 * vpermw; with `five` false, those for i = 0 .. 15 twice (an index's bit 4 then changes nothing). */
AVX512_BF16 static inline __m512i table_bf16(__m512 d, __m512 m, int five) {
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512 lo = _mm512_fmadd_ps(d, iota, m);
  __m512 hi = five ? _mm512_fmadd_ps(d, _mm512_add_ps(iota, _mm512_set1_ps(16.0f)), m) : lo;
  return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}

/* The 32 values of a block of bytes qs[0..15] as words: the low nibbles, then the high ones (the low nibbles'
 * words keep bits 4-7 of their byte: the table's second half covers bit 4, vpermw reads five bits). */
AVX512_BF16 static inline __m512i nibble_words(const uint8_t *qs) {
  const __m512i shifts = _mm512_set_epi64(0x0004000400040004LL, 0x0004000400040004LL, 0x0004000400040004LL,
                                          0x0004000400040004LL, 0, 0, 0, 0);
  __m512i x = _mm512_cvtepu8_epi16(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)qs)));
  return _mm512_srlv_epi16(x, shifts);
}

/* One weight row of k values of a block type, dequantized in float32 (each value d * q + m with one rounding, the
 * Q4_0 / Q5_0 offset as the minimum -8d / -16d) and rounded to bf16 into out: the bf16 path's decoding. The 4- and
 * 5-bit types build each (sub-)block's 16 or 32 possible values once and look its values up (vpermw), 32 a
 * vector; Q8_0 and Q6_K convert 16 values a vector. F16 and BF16 go through dequantize_row_avx2 and
 * round_rows_bf16 (`work`: k floats). Each block asks for the one `ahead` bytes further (the next task's row), so the
 * reads ahead are spread over the decoding. */
AVX512_BF16 static inline void ask_bf16(const uint8_t *p, long bytes) {
  for (long o = 0; o < bytes; o += 64) _mm_prefetch((const char *)p + o, _MM_HINT_T0);
}

AVX512_BF16 static void decode_bf16(int type, const uint8_t *row, long k, uint16_t *out, float *work, long ahead) {
  const __m512i low = _mm512_set1_epi32(0x0f), low16 = _mm512_set1_epi16(0x0f), sixteen = _mm512_set1_epi16(16);
  if (type == F16 || type == BF16) {
    dequantize_row_avx2(type, row, work, k);
    round_rows_bf16(work, 1, k, (k + 31) / 32 * 32, out);
  } else if (type == Q8_0) {
    for (long b = 0; b < k / QK; b++) {
      const uint8_t *p = row + b * 34;
      ask_bf16(p + ahead, 34);
      __m512 d = half_bf16(p);
      __m512 lo = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 2)))));
      __m512 hi = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 18)))));
      store_bf16(lo, hi, out + QK * b);
    }
  } else if (type == Q4_0 || type == Q4_1 || type == Q5_0 || type == Q5_1) {
    long bytes = format_of(type).bytes;
    int five = type == Q5_0 || type == Q5_1, with_min = type == Q4_1 || type == Q5_1;
    for (long b = 0; b < k / QK; b++) {
      const uint8_t *p = row + b * bytes;
      ask_bf16(p + ahead, bytes);
      __m512 d = half_bf16(p);
      __m512 m = with_min ? half_bf16(p + 2) : _mm512_mul_ps(d, _mm512_set1_ps(five ? -16.0f : -8.0f));
      __m512i index = nibble_words(p + (type == Q4_0 ? 2 : type == Q4_1 ? 4 : type == Q5_0 ? 6 : 8));
      if (five) {
        uint32_t bits;
        memcpy(&bits, p + (type == Q5_0 ? 2 : 4), sizeof bits);
        index = _mm512_and_si512(index, low16);
        index = _mm512_mask_add_epi16(index, (__mmask32)bits, index, sixteen);
      }
      _mm512_storeu_si512((void *)(out + QK * b), _mm512_permutexvar_epi16(index, table_bf16(d, m, five)));
    }
  } else if (type == Q4_K || type == Q5_K) {
    long bytes = format_of(type).bytes;
    for (long sb = 0; sb < k / 256; sb++) {
      const uint8_t *p = row + sb * bytes, *qs = p + (type == Q4_K ? 16 : 48);
      ask_bf16(p + ahead, bytes);
      float d = _cvtsh_ss((uint16_t)(p[0] | p[1] << 8)), dmin = _cvtsh_ss((uint16_t)(p[2] | p[3] << 8));
      uint8_t scale[8], min[8];
      k_scales(p + 4, scale, min);
      __m256i high = type == Q5_K ? _mm256_loadu_si256((const __m256i *)(p + 16)) : _mm256_setzero_si256();
      for (int s = 0; s < 8; s++) {
        __m512i index = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(qs + 32 * (s / 2))));
        if (s % 2) index = _mm512_srli_epi16(index, 4);
        if (type == Q5_K) {
          __mmask32 bits = _mm256_test_epi8_mask(high, _mm256_set1_epi8((char)(1 << s)));
          index = _mm512_and_si512(index, low16);
          index = _mm512_mask_add_epi16(index, bits, index, sixteen);
        }
        __m512 ds = _mm512_set1_ps(d * (float)scale[s]), dm = _mm512_set1_ps(-(dmin * (float)min[s]));
        _mm512_storeu_si512((void *)(out + 256 * sb + 32 * s),
                            _mm512_permutexvar_epi16(index, table_bf16(ds, dm, type == Q5_K)));
      }
    }
  } else { /* Q6_K */
    const __m512i three = _mm512_set1_epi32(3), offset = _mm512_set1_epi32(32);
    for (long sb = 0; sb < k / 256; sb++) {
      const uint8_t *p = row + sb * 210;
      ask_bf16(p + ahead, 210);
      float d = _cvtsh_ss((uint16_t)(p[208] | p[209] << 8));
#pragma GCC unroll 8
      for (int s = 0; s < 8; s++) {
        int half = s / 4, quarter = s % 4;
        __m512 v[2];
        for (int i = 0; i < 2; i++) { /* values 16i .. 16i + 15 of the sub-block */
          __m512i ql = bytes_bf16(p + 64 * half + 32 * (quarter % 2) + 16 * i);
          __m512i qh = bytes_bf16(p + 128 + 32 * half + 16 * i);
          ql = _mm512_and_si512(_mm512_srli_epi32(ql, 4 * (quarter / 2)), low);
          qh = _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(qh, 2 * quarter), three), 4);
          __m512i q = _mm512_sub_epi32(_mm512_or_si512(ql, qh), offset);
          v[i] = _mm512_mul_ps(_mm512_set1_ps(d * (float)(int8_t)p[192 + 2 * s + i]), _mm512_cvtepi32_ps(q));
        }
        store_bf16(v[0], v[1], out + 256 * sb + 32 * s);
      }
    }
  }
}

/* Four bf16 weight rows wb (kp apart) against C bf16 input rows xb (kp apart), into y[c * ldy + r] for r < valid. */
AVX512_BF16 static inline __attribute__((always_inline)) void bf16_tile(int C, const uint16_t *wb, const uint16_t *xb,
                                                                       long kp, float *y, long ldy, int valid) {
  __m512 acc[4][BF16_TILE];
  for (int r = 0; r < 4; r++)
    for (int c = 0; c < C; c++) acc[r][c] = _mm512_setzero_ps();
  for (long j = 0; j < kp; j += 32) {
    __m512bh w[4];
    for (int r = 0; r < 4; r++) w[r] = (__m512bh)_mm512_loadu_si512((const void *)(wb + r * kp + j));
    for (int c = 0; c < C; c++) {
      __m512bh v = (__m512bh)_mm512_loadu_si512((const void *)(xb + c * kp + j));
      for (int r = 0; r < 4; r++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], w[r], v);
    }
  }
  for (int c = 0; c < C; c++) { /* the four rows' sums at once: halves added, then unpacks as in quant_dot.h */
    __m256 h[4];
    for (int r = 0; r < 4; r++)
      h[r] = _mm256_add_ps(_mm512_castps512_ps256(acc[r][c]),
                           _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[r][c]), 1)));
    __m256 t0 = _mm256_add_ps(_mm256_unpacklo_ps(h[0], h[1]), _mm256_unpackhi_ps(h[0], h[1]));
    __m256 t1 = _mm256_add_ps(_mm256_unpacklo_ps(h[2], h[3]), _mm256_unpackhi_ps(h[2], h[3]));
    __m256 s = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(_mm256_castps_pd(t0), _mm256_castps_pd(t1))),
                             _mm256_castpd_ps(_mm256_unpackhi_pd(_mm256_castps_pd(t0), _mm256_castps_pd(t1))));
    float out[4];
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1)));
    for (int r = 0; r < valid; r++) y[c * ldy + r] = out[r];
  }
}

AVX512_BF16 static void bf16_tiles(int C, const uint16_t *wb, const uint16_t *xb, long kp, float *y, long ldy,
                                   int valid) {
  switch (C) {
    case 6: bf16_tile(6, wb, xb, kp, y, ldy, valid); break;
    case 5: bf16_tile(5, wb, xb, kp, y, ldy, valid); break;
    case 4: bf16_tile(4, wb, xb, kp, y, ldy, valid); break;
    case 3: bf16_tile(3, wb, xb, kp, y, ldy, valid); break;
    case 2: bf16_tile(2, wb, xb, kp, y, ldy, valid); break;
    default: bf16_tile(1, wb, xb, kp, y, ldy, valid); break;
  }
}

static void bf16_chunk(const float *x, const uint8_t *w, int type, float *y, long m, long n, long k, long kp,
                       long row_bytes, long tasks, char *memory, size_t input, size_t mine, uint16_t *xb,
                       int threads);

static int gemm_bf16(const float *x, const uint8_t *w, int type, float *y, long m, long n, long k, int threads) {
  format f = format_of(type);
  long row_bytes = k / f.block * f.bytes, kp = (k + 31) / 32 * 32, tasks = (n + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
  /* the input rounded, then each thread's four rounded weight rows and one dequantized row */
  /* the input in chunks of rows whose bf16 copy stays in the L2 cache (every task reads all of it), each chunk a
   * pass over the weight: a prefill's rows share each decoded weight row by the chunk, not all at once */
  long chunk = BF16_CHUNK_VALUES / kp > BF16_TILE ? BF16_CHUNK_VALUES / kp : BF16_TILE;
  if (chunk > m) chunk = m;
  size_t input = ((size_t)chunk * kp * 2 + 63) / 64 * 64, mine = ((size_t)4 * kp * 2 + (size_t)kp * 4 + 63) / 64 * 64;
  char *memory = aligned_alloc(64, input + mine * threads);
  if (!memory) return NO_MEMORY;
  uint16_t *xb = (uint16_t *)memory;
  for (long first = 0; first < m; first += chunk) {
    long rows = m - first < chunk ? m - first : chunk;
    bf16_chunk(x + first * k, w, type, y + first * n, rows, n, k, kp, row_bytes, tasks, memory, input, mine, xb,
               threads);
  }
  free(memory);
  return OK;
}

/* One chunk of m input rows (see gemm_bf16) against every weight row. */
static void bf16_chunk(const float *x, const uint8_t *w, int type, float *y, long m, long n, long k, long kp,
                       long row_bytes, long tasks, char *memory, size_t input, size_t mine, uint16_t *xb,
                       int threads) {
  round_rows_bf16(x, m, k, kp, xb);
#pragma omp parallel for num_threads(threads) schedule(static) if (n * row_bytes >= PARALLEL_MIN_BYTES)
  for (long t = 0; t < tasks; t++) {
    uint16_t *wb = (uint16_t *)(memory + input + mine * omp_get_thread_num());
    float *wf = (float *)(wb + 4 * kp);
    long r0 = t * ROWS_PER_TASK;
    int valid = n - r0 < 4 ? (int)(n - r0) : 4;
    for (int i = 0; i < 4; i++) {
      if (i < valid) {
        decode_bf16(type, w + (r0 + i) * row_bytes, k, wb + i * kp, wf, ROWS_PER_TASK * row_bytes);
      } else {
        memset(wb + i * kp, 0, (size_t)kp * 2);
      }
    }
    long passes = (m + BF16_TILE - 1) / BF16_TILE; /* the input rows split evenly: 16 as 6, 5, 5 */
    for (long p = 0, i = 0; p < passes; p++) {
      int C = (int)((m - i + passes - p - 1) / (passes - p));
      bf16_tiles(C, wb, xb + i * kp, kp, y + i * n + r0, n, valid);
      i += C;
    }
  }
}

/* ---- The float path: a weight row dequantized, then float dot products with every input row. */

static void float_rows_scalar(const float *wr, const float *x, long k, int rows, float *y, long ldy) {
  for (int c = 0; c < rows; c++) {
    float sum = 0.0f;
    for (long j = 0; j < k; j++) sum += wr[j] * x[c * k + j];
    y[c * ldy] = sum;
  }
}

#define DEFINE_FLOAT_AVX2(C)                                                                                    \
  AVX2 static void float_avx2_##C(const float *wr, const float *x, long k, float *y, long ldy) {              \
    __m256 acc[C];                                                                                              \
    long vec_end = k - k % 8;                                                                                   \
    for (int c = 0; c < C; c++) acc[c] = _mm256_setzero_ps();                                                  \
    for (long j = 0; j < vec_end; j += 8) {                                                                     \
      __m256 wv = _mm256_loadu_ps(wr + j);                                                                      \
      for (int c = 0; c < C; c++) acc[c] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + c * k + j), acc[c]);       \
    }                                                                                                           \
    for (int c = 0; c < C; c++) {                                                                               \
      float tail = 0.0f;                                                                                        \
      for (long j = vec_end; j < k; j++) tail += wr[j] * x[c * k + j];                                          \
      y[c * ldy] = hsum8(acc[c]) + tail;                                                                        \
    }                                                                                                           \
  }
DEFINE_FLOAT_AVX2(1)
DEFINE_FLOAT_AVX2(2)
DEFINE_FLOAT_AVX2(3)
DEFINE_FLOAT_AVX2(4)

typedef void (*float_fn)(const float *, const float *, long, float *, long);
static const float_fn FLOAT_AVX2[5] = {0, float_avx2_1, float_avx2_2, float_avx2_3, float_avx2_4};

static int gemm_float(const float *x, const uint8_t *w, int type, float *y, long m, long n, long k, int threads,
                      int isa) {
  format f = format_of(type);
  long row_bytes = k / f.block * f.bytes, tasks = (n + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
  long row = (k + 15) / 16 * 16;
  float *memory = aligned_alloc(64, (size_t)row * threads * sizeof(float));
  if (!memory) return NO_MEMORY;
#pragma omp parallel for num_threads(threads) schedule(static) if (n * row_bytes >= PARALLEL_MIN_BYTES)
  for (long t = 0; t < tasks; t++) {
    float *wr = memory + row * omp_get_thread_num();
    for (long r = t * ROWS_PER_TASK; r < n && r < (t + 1) * ROWS_PER_TASK; r++) {
      if (isa == ISA_SCALAR) dequantize_row(type, w + r * row_bytes, wr, k);
      else dequantize_row_avx2(type, w + r * row_bytes, wr, k);
      for (long i = 0; i < m; i += 4) {
        int rows = m - i < 4 ? (int)(m - i) : 4;
        if (isa == ISA_SCALAR) float_rows_scalar(wr, x + i * k, k, rows, y + i * n + r, n);
        else FLOAT_AVX2[rows](wr, x + i * k, k, y + i * n + r, n);
      }
    }
  }
  free(memory);
  return OK;
}

/* ---- The panel path: panel_gemm.c's driver with a packer that dequantizes. */

typedef struct {
  const uint8_t *w;
  int type;
  long row_bytes;
} stored_weight;

AVX2_F16C static void pack_stored_panel(const void *weights, long n, long k, long panel, float *wp, float *work) {
  const stored_weight *s = weights;
  for (long j = 0; j < 16; j++) {
    long r = panel * 16 + j;
    if (r < n) {
      dequantize_row_avx2(s->type, s->w + r * s->row_bytes, work, k);
      for (long kk = 0; kk < k; kk++) wp[kk * 16 + j] = work[kk];
    } else {
      for (long kk = 0; kk < k; kk++) wp[kk * 16 + j] = 0.0f;
    }
  }
}

static int gemm_panels(const float *x, const uint8_t *w, int type, float *y, long m, long n, long k, int threads) {
  format f = format_of(type);
  stored_weight s = {w, type, k / f.block * f.bytes};
  float *scratch = aligned_alloc(64, ((size_t)enginekit_panel_gemm_scratch(k, threads) * 4 + 63) / 64 * 64);
  if (!scratch) return NO_MEMORY;
  enginekit_panel_gemm(x, k, pack_stored_panel, &s, NULL, y, m, n, k, scratch, threads);
  free(scratch);
  return OK;
}

/* y[m, n] = x[m, k] W^T for a contiguous float32 x and W [n, k] of `type` stored as n contiguous rows of blocks, on
 * `threads` threads, with instruction set `isa` (at most enginekit_quant_isa()) and `path` (PATH_AUTO: by the
 * rows and the type; PATH_INVARIANT: by the type and `isa` alone). Returns OK, or (nothing written) BAD_TYPE, BAD_SHAPE (k not a whole number of blocks),
 * BAD_ISA, BAD_PATH (the int8 path of F16/BF16, the panel path without AVX2) or NO_MEMORY. */
int enginekit_quant_gemm(const float *x, const uint8_t *w, int type, float *y, long m, long n, long k, int threads,
                         int isa, int path) {
  format f = format_of(type);
  if (!f.block) return BAD_TYPE;
  if (m < 0 || n < 0 || k < 0 || k % f.block) return BAD_SHAPE;
  if (isa < ISA_SCALAR || isa > enginekit_quant_isa()) return BAD_ISA;
  if (m == 0 || n == 0) return OK;
  if (k == 0) {
    memset(y, 0, (size_t)m * n * sizeof(float));
    return OK;
  }
  int blocks = f.block > 1;
  if (path == PATH_INVARIANT) /* one path at every row count: see the top of this file */
    path = isa >= ISA_AVX512_BF16 ? PATH_BF16 : blocks ? PATH_INT8 : PATH_FLOAT;
  if (path == PATH_AUTO)
    path = blocks && isa >= ISA_AVX512_BF16 && m >= (type == Q6_K ? BF16_MIN_ROWS_Q6_K : BF16_MIN_ROWS) ? PATH_BF16
           : m > (blocks ? INT8_MAX_ROWS : FLOAT_MAX_ROWS) && isa != ISA_SCALAR  ? PATH_PANELS
           : blocks                                                           ? PATH_INT8
                                                                              : PATH_FLOAT;
  if ((path == PATH_INT8 && !blocks) || (path == PATH_PANELS && isa == ISA_SCALAR) ||
      (path == PATH_BF16 && isa < ISA_AVX512_BF16))
    return BAD_PATH;
  switch (path) {
    case PATH_BF16: return gemm_bf16(x, w, type, y, m, n, k, threads);
    case PATH_INT8: return gemm_int8(x, w, type, y, m, n, k, threads, isa);
    case PATH_FLOAT: return gemm_float(x, w, type, y, m, n, k, threads, isa);
    case PATH_PANELS: return gemm_panels(x, w, type, y, m, n, k, threads);
    default: return BAD_PATH;
  }
}

/* y[n, k] = W dequantized, rows split over `threads` threads. Returns OK, or BAD_TYPE / BAD_SHAPE. */
int enginekit_dequantize(const uint8_t *w, int type, float *y, long n, long k, int threads) {
  format f = format_of(type);
  int simd = enginekit_quant_isa() != ISA_SCALAR;
  if (!f.block) return BAD_TYPE;
  if (n < 0 || k < 0 || k % f.block) return BAD_SHAPE;
  long row_bytes = k / f.block * f.bytes;
#pragma omp parallel for num_threads(threads) schedule(static) if (n * row_bytes >= PARALLEL_MIN_BYTES)
  for (long r = 0; r < n; r++) {
    if (simd) dequantize_row_avx2(type, w + r * row_bytes, y + r * k, k);
    else dequantize_row(type, w + r * row_bytes, y + r * k, k);
  }
  return OK;
}
