/* Float32 products of up to ENGINEKIT_MAX_ROWS rows with a weight matrix, for x86-64 CPUs with AVX2 and FMA:
 * y[m, n] = x[m, k] W[n, k]^T (+ b[n]) for 1 <= m <= ENGINEKIT_MAX_ROWS, W row-major.
 *
 * A decode step of a few sequences multiplies every weight by a few vectors: each weight is read once, so the
 * time is the time to stream the weights from memory. The library kernels torch calls at these shapes read
 * them at well under the machine's bandwidth, and their cost grows with the rows; here, up to
 * ENGINEKIT_SKINNY_ROWS rows, every weight row is loaded once and multiplied into all m input rows while it is
 * in registers. One row takes eight weight rows at a time (eight independent sums); more rows take one weight
 * row against all of them. Past that, a step of tens of sequences is bound by arithmetic: tiles of four input
 * rows by three weight rows keep twelve sums in registers, seven loads for twelve multiply-adds, the weight
 * tile staying in the L1 cache while every input row passes it (faster than torch's kernels up to 128 rows on
 * an AVX2 CPU, slower past that: docs/benchmarks_gemm.md). Weight rows are split over OpenMP threads. Built by
 * enginekit/model/kernels/library.py with the C compiler found at run time and linked against the OpenMP runtime
 * torch already loaded, so it runs on torch's thread pool.
 */
#include "common.h"

#define ENGINEKIT_MAX_ROWS 128
#define ENGINEKIT_SKINNY_ROWS 8 /* up to this many rows, each weight row once against all of them */
#define BLOCK 8                 /* weight rows per task with one input row */
#define TILE_ROWS 4             /* input rows per tile past ENGINEKIT_SKINNY_ROWS */
#define TILE_WEIGHTS 3          /* weight rows per tile */
/* Below these a call runs on the calling thread: waking the pool costs more than it saves (a background
 * engine's workers sleep between regions). Up to ENGINEKIT_SKINNY_ROWS rows the weights' size decides (their
 * bytes are the time), past it the multiply-adds. */
#define PARALLEL_MIN_WEIGHTS (1L << 18)
#define PARALLEL_MIN_TILED (1L << 21)

int enginekit_skinny_max_rows(void) { return ENGINEKIT_MAX_ROWS; }

int enginekit_skinny_supported(void) {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

/* One input row: dot products of `count` (<= BLOCK) consecutive weight rows with x, into y. */
AVX2 static inline void block_dot(const float *w, const float *x, float *y, int count, long k) {
  __m256 acc[BLOCK];
  long vec_end = k - k % 8;
  for (int i = 0; i < BLOCK; i++) acc[i] = _mm256_setzero_ps();
  if (count == BLOCK) { /* the common case, unrolled by the compiler */
    for (long j = 0; j < vec_end; j += 8) {
      __m256 xv = _mm256_loadu_ps(x + j);
      for (int i = 0; i < BLOCK; i++) acc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(w + i * k + j), xv, acc[i]);
    }
  } else {
    for (long j = 0; j < vec_end; j += 8) {
      __m256 xv = _mm256_loadu_ps(x + j);
      for (int i = 0; i < count; i++) acc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(w + i * k + j), xv, acc[i]);
    }
  }
  for (int i = 0; i < count; i++) {
    float tail = 0.0f;
    for (long j = vec_end; j < k; j++) tail += w[i * k + j] * x[j];
    y[i] = hsum8(acc[i]) + tail;
  }
}

/* M input rows: one weight row w against all of x[M, k], into y[0], y[ldy], ... (M known at compile time). */
#define DEFINE_ROW_TIMES(M)                                                                                  \
  AVX2 static inline void row_times_##M(const float *w, const float *x, float *y, long k, long ldy) {        \
    __m256 acc[M];                                                                                           \
    long vec_end = k - k % 8;                                                                                \
    for (int m = 0; m < M; m++) acc[m] = _mm256_setzero_ps();                                                \
    for (long j = 0; j < vec_end; j += 8) {                                                                  \
      __m256 wv = _mm256_loadu_ps(w + j);                                                                    \
      for (int m = 0; m < M; m++) acc[m] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + m * k + j), acc[m]);     \
    }                                                                                                        \
    for (int m = 0; m < M; m++) {                                                                            \
      float tail = 0.0f;                                                                                     \
      for (long j = vec_end; j < k; j++) tail += w[j] * x[m * k + j];                                        \
      y[m * ldy] = hsum8(acc[m]) + tail;                                                                      \
    }                                                                                                        \
  }
DEFINE_ROW_TIMES(2)
DEFINE_ROW_TIMES(3)
DEFINE_ROW_TIMES(4)
DEFINE_ROW_TIMES(5)
DEFINE_ROW_TIMES(6)
DEFINE_ROW_TIMES(7)
DEFINE_ROW_TIMES(8)

/* A tile: MB input rows of x by NB weight rows of w, into y[i * ldy + j] (MB and NB known at compile time). */
#define DEFINE_TILE(MB, NB)                                                                                  \
  AVX2 static void tile_##MB##_##NB(const float *w, const float *x, float *y, long k, long ldy) {           \
    __m256 acc[MB][NB];                                                                                      \
    long vec_end = k - k % 8;                                                                                \
    for (int i = 0; i < MB; i++)                                                                             \
      for (int j = 0; j < NB; j++) acc[i][j] = _mm256_setzero_ps();                                         \
    for (long c = 0; c < vec_end; c += 8) {                                                                  \
      __m256 wv[NB];                                                                                         \
      for (int j = 0; j < NB; j++) wv[j] = _mm256_loadu_ps(w + j * k + c);                                  \
      for (int i = 0; i < MB; i++) {                                                                         \
        __m256 xv = _mm256_loadu_ps(x + i * k + c);                                                          \
        for (int j = 0; j < NB; j++) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);                     \
      }                                                                                                      \
    }                                                                                                        \
    for (int i = 0; i < MB; i++)                                                                             \
      for (int j = 0; j < NB; j++) {                                                                         \
        float tail = 0.0f;                                                                                   \
        for (long c = vec_end; c < k; c++) tail += w[j * k + c] * x[i * k + c];                              \
        y[i * ldy + j] = hsum8(acc[i][j]) + tail;                                                             \
      }                                                                                                      \
  }
DEFINE_TILE(1, 1) DEFINE_TILE(1, 2) DEFINE_TILE(1, 3)
DEFINE_TILE(2, 1) DEFINE_TILE(2, 2) DEFINE_TILE(2, 3)
DEFINE_TILE(3, 1) DEFINE_TILE(3, 2) DEFINE_TILE(3, 3)
DEFINE_TILE(4, 1) DEFINE_TILE(4, 2) DEFINE_TILE(4, 3)

typedef void (*tile_fn)(const float *, const float *, float *, long, long);
static const tile_fn TILES[TILE_ROWS + 1][TILE_WEIGHTS + 1] = {
    {0, 0, 0, 0},
    {0, tile_1_1, tile_1_2, tile_1_3},
    {0, tile_2_1, tile_2_2, tile_2_3},
    {0, tile_3_1, tile_3_2, tile_3_3},
    {0, tile_4_1, tile_4_2, tile_4_3},
};

/* y[m, n] = x[m, k] W[n, k]^T + bias[n] (bias may be NULL), 1 <= m <= ENGINEKIT_MAX_ROWS, on `threads` OpenMP
 * threads. Returns 0, or -1 (nothing written) for an m out of range. */
AVX2 int enginekit_skinny_gemm(const float *w, const float *x, const float *bias, float *y, long m, long n,
                               long k, int threads) {
  if (m < 1 || m > ENGINEKIT_MAX_ROWS) return -1;
  if (m > ENGINEKIT_SKINNY_ROWS) {
    long tiles = (n + TILE_WEIGHTS - 1) / TILE_WEIGHTS;
#pragma omp parallel for num_threads(threads) schedule(static) if (m * n * k >= PARALLEL_MIN_TILED)
    for (long t = 0; t < tiles; t++) {
      long row = t * TILE_WEIGHTS, nb = n - row < TILE_WEIGHTS ? n - row : TILE_WEIGHTS, i = 0;
      for (; i + TILE_ROWS <= m; i += TILE_ROWS) TILES[TILE_ROWS][nb](w + row * k, x + i * k, y + i * n + row, k, n);
      if (i < m) TILES[m - i][nb](w + row * k, x + i * k, y + i * n + row, k, n);
    }
  } else if (m == 1) {
    long blocks = (n + BLOCK - 1) / BLOCK;
#pragma omp parallel for num_threads(threads) schedule(static) if (n * k >= PARALLEL_MIN_WEIGHTS)
    for (long b = 0; b < blocks; b++) {
      long row = b * BLOCK;
      block_dot(w + row * k, x, y + row, n - row < BLOCK ? (int)(n - row) : BLOCK, k);
    }
  } else {
#pragma omp parallel for num_threads(threads) schedule(static) if (n * k >= PARALLEL_MIN_WEIGHTS)
    for (long r = 0; r < n; r++) {
      const float *wr = w + r * k;
      switch (m) {
        case 2: row_times_2(wr, x, y + r, k, n); break;
        case 3: row_times_3(wr, x, y + r, k, n); break;
        case 4: row_times_4(wr, x, y + r, k, n); break;
        case 5: row_times_5(wr, x, y + r, k, n); break;
        case 6: row_times_6(wr, x, y + r, k, n); break;
        case 7: row_times_7(wr, x, y + r, k, n); break;
        default: row_times_8(wr, x, y + r, k, n); break;
      }
    }
  }
  if (bias)
    for (long i = 0; i < m; i++)
      for (long r = 0; r < n; r++) y[i * n + r] += bias[r];
  return 0;
}
