/* The small float32 operations of a decoder layer, for x86-64 CPUs with AVX2 and FMA: RMS norm, the MLP's
 * activation silu(gate) * up, rotary embedding fused with the KV-cache write, and attention of single queries
 * that reads the paged cache in place (a step's decodes, and the tokens of its prefill chunks over short contexts).
 *
 * At a decode step of a few sequences each of these is a handful of microseconds of arithmetic wrapped in
 * several torch ops (RMS norm alone is five, about 20 us at one row); at a step of many sequences, decode
 * attention through torch first copies every sequence's whole context out of the paged cache. Built together
 * with the other kernels into one library by enginekit/model/kernels/library.py, on torch's OpenMP thread pool.
 */
#include <math.h>

#include "common.h"

/* The attention's limits, written here alone: Python reads them (enginekit_layer_ops_limits) to check every call
 * and to choose torch's attention for a model past them. Overridable at build time, for tests. */
#ifndef MAX_GROUP
#define MAX_GROUP 64           /* query heads per KV head */
#endif
#ifndef MAX_GROUP_FLOATS
#define MAX_GROUP_FLOATS 4096  /* query heads per KV head x head_dim, kept on the stack per task */
#endif
#define MAX_SPAN 256           /* tokens scored at once (a power of two: all or part of a block), kept on the stack */
#define PARALLEL_MIN_WORK 4096  /* context tokens x query heads below which attention runs on one thread */

int enginekit_layer_ops_limits(long *max_group, long *max_group_floats) {
  *max_group = MAX_GROUP;
  *max_group_floats = MAX_GROUP_FLOATS;
  return 0;
}

/* e^x for x <= 0 (scores minus their running maximum), eight at a time: x = n ln2 + r with |r| <= ln2/2, e^r by
 * a degree-6 polynomial (relative error about 1e-7), 2^n through the exponent bits; e^x underflows to 0 below
 * -87. */
AVX2 static inline __m256 exp8(__m256 x) {
  const __m256 low = _mm256_set1_ps(-87.0f);
  __m256 underflow = _mm256_cmp_ps(x, low, _CMP_LT_OQ);
  x = _mm256_max_ps(x, low);
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(underflow, _mm256_mul_ps(p, _mm256_castsi256_ps(scale)));
}

/* out[i] = x[i] / sqrt(mean(x[i]^2) + eps) * w for each of `rows` rows of n values (rows `stride` apart in x). */
AVX2 void enginekit_rms_norm(const float *x, long stride, const float *w, float *out, long rows, long n, float eps,
                             int threads) {
  long vec_end = n - n % 8;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * n >= 65536)
  for (long i = 0; i < rows; i++) {
    const float *xi = x + i * stride;
    float *yi = out + i * n;
    __m256 acc = _mm256_setzero_ps();
    for (long j = 0; j < vec_end; j += 8) {
      __m256 v = _mm256_loadu_ps(xi + j);
      acc = _mm256_fmadd_ps(v, v, acc);
    }
    float sum = hsum8(acc);
    for (long j = vec_end; j < n; j++) sum += xi[j] * xi[j];
    float inv = 1.0f / sqrtf(sum / (float)n + eps);
    __m256 vinv = _mm256_set1_ps(inv);
    for (long j = 0; j < vec_end; j += 8)
      _mm256_storeu_ps(yi + j, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xi + j), vinv), _mm256_loadu_ps(w + j)));
    for (long j = vec_end; j < n; j++) yi[j] = xi[j] * inv * w[j];
  }
}

/* out[i, j] = silu(x[i, j]) * x[i, inter + j] for `rows` rows of [gate | up] (rows `stride` apart in x): the MLP's
 * activation. silu(g) = g * sigmoid(g), the sigmoid from e^-|g| so that nothing overflows. */
AVX2 void enginekit_silu_mul(const float *x, long stride, float *out, long rows, long inter, int threads) {
  long vec_end = inter - inter % 8;
  const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * inter >= 65536)
  for (long i = 0; i < rows; i++) {
    const float *gate = x + i * stride, *up = gate + inter;
    float *y = out + i * inter;
    for (long j = 0; j < vec_end; j += 8) {
      __m256 g = _mm256_loadu_ps(gate + j);
      __m256 e = exp8(_mm256_or_ps(g, sign)); /* e^-|g| */
      __m256 sigmoid = _mm256_div_ps(_mm256_blendv_ps(one, e, g), _mm256_add_ps(one, e)); /* g < 0: e / (1 + e) */
      _mm256_storeu_ps(y + j, _mm256_mul_ps(_mm256_mul_ps(g, sigmoid), _mm256_loadu_ps(up + j)));
    }
    for (long j = vec_end; j < inter; j++) y[j] = gate[j] / (1.0f + expf(-gate[j])) * up[j];
  }
}

/* out[i, j] = gelu_tanh(x[i, j]) * x[i, inter + j] for `rows` rows of [gate | up] (rows `stride` apart in x): the
 * MLP's activation of the models with GeLU-tanh (Gemma), used where a row's values must not depend on the other
 * rows (torch's vector loop rounds a row's last values by where the whole tensor's tail falls). gelu_tanh(g) =
 * 0.5 g (1 + tanh(u)) = g * sigmoid(2u), u = sqrt(2 / pi) (g + 0.044715 g^3); the sigmoid as in silu_mul. */
AVX2 void enginekit_gelu_tanh_mul(const float *x, long stride, float *out, long rows, long inter, int threads) {
  long vec_end = inter - inter % 8;
  const float scale = 2.0f * 0.7978845608028654f, cube = 0.044715f;
  const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f), vscale = _mm256_set1_ps(scale),
               vcube = _mm256_set1_ps(cube);
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * inter >= 65536)
  for (long i = 0; i < rows; i++) {
    const float *gate = x + i * stride, *up = gate + inter;
    float *y = out + i * inter;
    for (long j = 0; j < vec_end; j += 8) {
      __m256 g = _mm256_loadu_ps(gate + j);
      __m256 inner = _mm256_add_ps(g, _mm256_mul_ps(vcube, _mm256_mul_ps(g, _mm256_mul_ps(g, g))));
      __m256 u = _mm256_mul_ps(vscale, inner);
      __m256 e = exp8(_mm256_or_ps(u, sign)); /* e^-|u| */
      __m256 sigmoid = _mm256_div_ps(_mm256_blendv_ps(one, e, u), _mm256_add_ps(one, e));
      _mm256_storeu_ps(y + j, _mm256_mul_ps(_mm256_mul_ps(g, sigmoid), _mm256_loadu_ps(up + j)));
    }
    for (long j = vec_end; j < inter; j++) {
      float g = gate[j], u = scale * (g + cube * (g * (g * g)));
      y[j] = g / (1.0f + expf(-u)) * up[j];
    }
  }
}

/* Rotary embedding of one head of d values: out = x * cos + roll(x, d/2) * signed_sin (the sin table's first
 * half negated), the same products and sum as the torch formula. */
AVX2 static inline void rotate_head(const float *x, const float *cos, const float *sin, float *out, long d) {
  long half = d / 2;
  if (half % 8 == 0) {
    for (long j = 0; j < d; j += 8) {
      long partner = j < half ? j + half : j - half;
      __m256 a = _mm256_mul_ps(_mm256_loadu_ps(x + j), _mm256_loadu_ps(cos + j));
      __m256 b = _mm256_mul_ps(_mm256_loadu_ps(x + partner), _mm256_loadu_ps(sin + j));
      _mm256_storeu_ps(out + j, _mm256_add_ps(a, b));
    }
  } else {
    for (long j = 0; j < d; j++) out[j] = x[j] * cos[j] + x[j < half ? j + half : j - half] * sin[j];
  }
}

/* One step's new tokens, each row of qkv = [q heads | k heads | v heads] (rows `stride` apart): writes the rotated
 * q and k heads to qk_out [tokens, heads + kv_heads, d], and the rotated k and the v heads to the caches
 * [num_slots, kv_heads, d] at each token's slot. cos and sin are [tokens, d]. Returns 0, or -1 (nothing written)
 * if a slot is outside the caches. */
AVX2 int enginekit_rope_write_cache(const float *qkv, long stride, const float *cos, const float *sin,
                                    const long *slots, float *qk_out, float *k_cache, float *v_cache, long tokens,
                                    long heads, long kv_heads, long d, long num_slots, int threads) {
  for (long t = 0; t < tokens; t++)
    if (slots[t] < 0 || slots[t] >= num_slots) return -1;
  long rotated = heads + kv_heads;
#pragma omp parallel for num_threads(threads) schedule(static) if (tokens * rotated * d >= 65536)
  for (long t = 0; t < tokens; t++) {
    const float *row = qkv + t * stride;
    const float *c = cos + t * d, *s = sin + t * d;
    float *out = qk_out + t * rotated * d;
    for (long h = 0; h < rotated; h++) rotate_head(row + h * d, c, s, out + h * d, d);
    float *k_slot = k_cache + slots[t] * kv_heads * d, *v_slot = v_cache + slots[t] * kv_heads * d;
    const float *k = out + heads * d, *v = row + rotated * d;
    for (long j = 0; j < kv_heads * d; j++) {
      k_slot[j] = k[j];
      v_slot[j] = v[j];
    }
  }
  return 0;
}

/* scores[t] = scale * q . k_t for `count` keys `stride` floats apart, eight keys at a time: eight dot products in
 * eight registers, then one transposing reduction instead of eight horizontal sums. */
AVX2 static inline void score_span(const float *q, const float *k, long stride, long d, float scale, long count,
                                   float *scores) {
  long vec_d = d - d % 8, t = 0;
  __m256 vscale = _mm256_set1_ps(scale);
  for (; t + 8 <= count; t += 8) {
    __m256 a[8];
    for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();
    for (long j = 0; j < vec_d; j += 8) {
      __m256 qv = _mm256_loadu_ps(q + j);
      for (int i = 0; i < 8; i++) a[i] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + (t + i) * stride + j), a[i]);
    }
    __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
    __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
    __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
    __m256 sums = _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
    if (vec_d < d) {
      float tail[8];
      for (int i = 0; i < 8; i++) {
        tail[i] = 0.0f;
        for (long j = vec_d; j < d; j++) tail[i] += q[j] * k[(t + i) * stride + j];
      }
      sums = _mm256_add_ps(sums, _mm256_loadu_ps(tail));
    }
    _mm256_storeu_ps(scores + t, _mm256_mul_ps(sums, vscale));
  }
  for (; t < count; t++) {
    const float *kt = k + t * stride;
    __m256 dot = _mm256_setzero_ps();
    for (long j = 0; j < vec_d; j += 8) dot = _mm256_fmadd_ps(_mm256_loadu_ps(q + j), _mm256_loadu_ps(kt + j), dot);
    float sum = hsum8(dot);
    for (long j = vec_d; j < d; j++) sum += q[j] * kt[j];
    scores[t] = sum * scale;
  }
}

/* acc[j0 .. j0 + 8 NV) = acc * correction + sum_t weights[t] v_t, NV vectors of 8 columns held in registers. */
#define ACCUMULATE_COLUMNS(NV)                                                                                  \
  for (; j0 + 8 * (NV) <= d; j0 += 8 * (NV)) {                                                                  \
    __m256 r[NV];                                                                                               \
    for (int i = 0; i < (NV); i++) r[i] = _mm256_mul_ps(_mm256_loadu_ps(acc + j0 + 8 * i), c);                   \
    for (long t = 0; t < count; t++) {                                                                          \
      __m256 w = _mm256_set1_ps(weights[t]);                                                                    \
      const float *vt = v + t * stride + j0;                                                                    \
      for (int i = 0; i < (NV); i++) r[i] = _mm256_fmadd_ps(w, _mm256_loadu_ps(vt + 8 * i), r[i]);              \
    }                                                                                                           \
    for (int i = 0; i < (NV); i++) _mm256_storeu_ps(acc + j0 + 8 * i, r[i]);                                     \
  }

/* acc = acc * correction + sum_t weights[t] v_t over `count` values `stride` floats apart: 64 columns at a time,
 * then 32, 16 and 8 (a head of 32 or 40 columns is vectors too), the last d % 8 columns one by one. */
AVX2 static inline void accumulate_values(float *acc, float correction, const float *v, long stride, long d,
                                          const float *weights, long count) {
  long j0 = 0;
  __m256 c = _mm256_set1_ps(correction);
  ACCUMULATE_COLUMNS(8)
  ACCUMULATE_COLUMNS(4)
  ACCUMULATE_COLUMNS(2)
  ACCUMULATE_COLUMNS(1)
  for (long j = j0; j < d; j++) {
    float sum = acc[j] * correction;
    for (long t = 0; t < count; t++) sum += weights[t] * v[t * stride + j];
    acc[j] = sum;
  }
}

/* Paged attention of single query tokens, each over its own context in the cache, read in place: the decodes of
 * a step, and the tokens of its prefill chunks (a chunk's token at position p attends to the first p + 1 tokens of
 * its sequence, its own included, all already written). With a sliding `window` (0: none) a query attends only to
 * the last `window` tokens of its context (its own included), as a sliding-window layer does. A `softcap` above 0
 * caps each scaled score s at softcap * tanh(s / softcap) (attention-logit soft-capping).
 *
 * q: [rows, heads, d], rows `q_stride` floats apart; caches: [slots, kv_heads, d], slot = block * block_size +
 * offset; tables: block ids, `table_stride` apart, row `table_rows[r]` of them for query r (NULL: row r); lens:
 * the context length of each query, 0 to skip it (its output is left as it was); out: [rows, heads, d]. Each
 * task is one (query, KV head) pair with its group of query heads, so every key and value is read once per task;
 * the softmax runs online, a block (or MAX_SPAN tokens of one) at a time. block_size is a power of two, the caches
 * hold num_slots slots, tables has table_count rows of table_width block ids. Returns 0, or (nothing written) -1 for
 * a table row out of range, -2 for a context length below 0 or past its table row, -3 for a block id the context
 * reads outside the caches. */
AVX2 int enginekit_paged_attention(const float *q, long q_stride, const float *k_cache, const float *v_cache,
                                   const long *tables, long table_stride, const long *table_rows, const long *lens,
                                   float *out, long batch, long heads, long kv_heads, long d, long block_size,
                                   long num_slots, long table_count, long table_width, float scale, long window,
                                   float softcap, int threads) {
  long group = heads / kv_heads, work = 0, num_blocks = num_slots / block_size;
  long span = block_size < MAX_SPAN ? block_size : MAX_SPAN; /* tokens scored at once: all or part of a block */
  for (long b = 0; b < batch; b++) {
    long row = table_rows ? table_rows[b] : b;
    if (row < 0 || row >= table_count) return -1;
    if (lens[b] < 0 || lens[b] > table_width * block_size) return -2;
    for (long i = 0; i < (lens[b] + block_size - 1) / block_size; i++)
      if (tables[row * table_stride + i] < 0 || tables[row * table_stride + i] >= num_blocks) return -3;
    work += window > 0 && lens[b] > window ? window : lens[b];
  }
  work *= heads;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) if (work >= PARALLEL_MIN_WORK)
  for (long task = 0; task < batch * kv_heads; task++) {
    long b = task / kv_heads, kvh = task % kv_heads, len = lens[b];
    if (len == 0) continue;
    const long *table = tables + (table_rows ? table_rows[b] : b) * table_stride;
    const float *qs = q + b * q_stride + kvh * group * d;
    float acc[MAX_GROUP_FLOATS], scores[MAX_SPAN], running_max[MAX_GROUP], running_sum[MAX_GROUP];
    for (long i = 0; i < group * d; i++) acc[i] = 0.0f;
    for (long g = 0; g < group; g++) running_max[g] = -INFINITY, running_sum[g] = 0.0f;
    /* spans stay within a block: the first one (from a window's start) ends at the next multiple of span */
    for (long start = window > 0 && len > window ? len - window : 0, count; start < len; start += count) {
      count = span - start % span;
      if (count > len - start) count = len - start;
      const long base = table[start / block_size] * block_size + start % block_size;
      const float *keys = k_cache + (base * kv_heads + kvh) * d, *values = v_cache + (base * kv_heads + kvh) * d;
      for (long g = 0; g < group; g++) {
        float *acc_h = acc + g * d;
        score_span(qs + g * d, keys, kv_heads * d, d, scale, count, scores);
        if (softcap > 0)
          for (long t = 0; t < count; t++) scores[t] = softcap * tanhf(scores[t] / softcap);
        float block_max = -INFINITY;
        for (long t = 0; t < count; t++) block_max = scores[t] > block_max ? scores[t] : block_max;
        float new_max = block_max > running_max[g] ? block_max : running_max[g];
        float correction = expf(running_max[g] - new_max); /* 0 on the first span */
        __m256 vmax = _mm256_set1_ps(new_max), vsum = _mm256_setzero_ps();
        long t = 0;
        for (; t + 8 <= count; t += 8) {
          __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + t), vmax));
          _mm256_storeu_ps(scores + t, p);
          vsum = _mm256_add_ps(vsum, p);
        }
        float span_sum = hsum8(vsum);
        for (; t < count; t++) span_sum += scores[t] = expf(scores[t] - new_max);
        running_sum[g] = running_sum[g] * correction + span_sum;
        running_max[g] = new_max;
        accumulate_values(acc_h, correction, values, kv_heads * d, d, scores, count);
      }
    }
    float *o = out + (b * heads + kvh * group) * d;
    for (long g = 0; g < group; g++)
      for (long j = 0; j < d; j++) o[g * d + j] = acc[g * d + j] / running_sum[g];
  }
  return 0;
}
