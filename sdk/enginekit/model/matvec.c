/* A float32 matrix-vector product for x86-64 CPUs with AVX2 and FMA: y = W x (+ b), W row-major [n, k].
 *
 * One token's projections are matrix-vector products: each weight is read once, so the time is the time to
 * stream the weights from memory. The library kernels torch calls for a one-row matmul read them at well
 * under the machine's bandwidth; this loop reads eight rows at a time with one accumulator each, splitting
 * the rows over OpenMP threads. Built by enginekit/model/matvec.py with the C compiler found at run time and
 * linked against the OpenMP runtime torch already loaded, so it shares torch's thread pool.
 */
#include <immintrin.h>

#define ROWS 8

int enginekit_matvec_supported(void) {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

__attribute__((target("avx2,fma"))) static inline float hsum(__m256 v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}

/* Dot products of `count` consecutive rows (count <= ROWS) starting at `w` with `x`, into `y`. */
__attribute__((target("avx2,fma"))) static inline void rows_dot(const float *w, const float *x, float *y,
                                                                 int count, long k) {
  __m256 acc[ROWS];
  float tail[ROWS] = {0};
  long vec_end = k - k % 8;
  for (int i = 0; i < ROWS; i++) acc[i] = _mm256_setzero_ps();
  if (count == ROWS) { /* the common case, unrolled by the compiler */
    for (long j = 0; j < vec_end; j += 8) {
      __m256 xv = _mm256_loadu_ps(x + j);
      for (int i = 0; i < ROWS; i++) acc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(w + i * k + j), xv, acc[i]);
    }
  } else {
    for (long j = 0; j < vec_end; j += 8) {
      __m256 xv = _mm256_loadu_ps(x + j);
      for (int i = 0; i < count; i++) acc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(w + i * k + j), xv, acc[i]);
    }
  }
  for (int i = 0; i < count; i++) {
    for (long j = vec_end; j < k; j++) tail[i] += w[i * k + j] * x[j];
    y[i] = hsum(acc[i]) + tail[i];
  }
}

/* y[n] = W[n, k] x[k] + bias[n] (bias may be NULL), on `threads` OpenMP threads. */
__attribute__((target("avx2,fma"))) void enginekit_matvec(const float *w, const float *x, const float *bias,
                                                          float *y, long n, long k, int threads) {
  long blocks = (n + ROWS - 1) / ROWS;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (long b = 0; b < blocks; b++) {
    long row = b * ROWS;
    int count = n - row < ROWS ? (int)(n - row) : ROWS;
    rows_dot(w + row * k, x, y + row, count, k);
    if (bias)
      for (int i = 0; i < count; i++) y[row + i] += bias[row + i];
  }
}
