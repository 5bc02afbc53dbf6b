/* The panel-packing GEMM driver that quant_gemm.c's panel path runs (many rows, a weight kept as stored), for
 * x86-64 CPUs with AVX2 and FMA: y[m, n] = x[m, k] W^T (+ b[n]), any m >= 1, with W given as a packer.
 *
 * A prefill step (hundreds to thousands of rows) is bound by arithmetic. The packer writes the weight into panels
 * of 16 output columns, [panel][k][16] (zero past n): one cache line per k; quant_gemm.c's packer dequantizes the
 * stored blocks as it goes, which a weight kept as stored needs on every call anyway. A 6x16 micro-kernel then
 * keeps 6 rows x 16 columns of sums in twelve registers; per k it loads two vectors of the panel and broadcasts
 * one value from each of six rows of x, eight loads for twelve multiply-adds, so the multiply-add units, not the
 * loads, set the pace. Each task packs a few panels and runs all of x against them, on one core: a panel packed
 * on another core would have to travel between the cores' caches. The scratch stays small (MAX_GROUP panels a
 * thread) even for an LM head.
 *
 * Float32 weights do not come here: past the skinny GEMM's rows they go to oneDNN, which measured as fast as
 * this driver with a float32 packer (docs/benchmarks_gemm.md), so that packer was removed.
 */
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

#define MR 6        /* rows of x per micro-kernel */
#define NR 16       /* output columns per panel (two vectors) */
#define MAX_GROUP 4 /* panels per task, packed by the thread that uses them */
#define PARALLEL_MIN_WORK (1L << 21) /* multiply-adds below which a call runs on the calling thread */

/* Floats of one thread's scratch: its panels, then a row for the packer (a whole number of vectors, so that the
 * next thread's panels stay aligned). */
static long thread_scratch(long k) { return MAX_GROUP * NR * k + (k + 7) / 8 * 8; }

/* Floats of scratch a call on `threads` threads needs: each thread's packed panels and a row for the packer, and
 * their alignment. */
long enginekit_panel_gemm_scratch(long k, int threads) { return threads * thread_scratch(k) + 8; }

/* y[r, c] = x[r, :] . panel[:, c] (+ bias[c]) for `rows` <= MR rows of x (`ldx` apart) and `cols` <= NR columns.
 * Missing rows read row 0 again; their sums are dropped. */
AVX2 static void micro_kernel(const float *x, long ldx, int rows, const float *wp, long k, const float *bias,
                              float *y, long ldy, int cols) {
  const float *r[MR];
  for (int i = 0; i < MR; i++) r[i] = x + (i < rows ? i : 0) * ldx;
  __m256 c00 = _mm256_setzero_ps(), c01 = _mm256_setzero_ps(), c10 = _mm256_setzero_ps(), c11 = _mm256_setzero_ps();
  __m256 c20 = _mm256_setzero_ps(), c21 = _mm256_setzero_ps(), c30 = _mm256_setzero_ps(), c31 = _mm256_setzero_ps();
  __m256 c40 = _mm256_setzero_ps(), c41 = _mm256_setzero_ps(), c50 = _mm256_setzero_ps(), c51 = _mm256_setzero_ps();
  for (long kk = 0; kk < k; kk++) {
    __m256 b0 = _mm256_load_ps(wp + kk * NR), b1 = _mm256_load_ps(wp + kk * NR + 8), a;
    a = _mm256_broadcast_ss(r[0] + kk), c00 = _mm256_fmadd_ps(a, b0, c00), c01 = _mm256_fmadd_ps(a, b1, c01);
    a = _mm256_broadcast_ss(r[1] + kk), c10 = _mm256_fmadd_ps(a, b0, c10), c11 = _mm256_fmadd_ps(a, b1, c11);
    a = _mm256_broadcast_ss(r[2] + kk), c20 = _mm256_fmadd_ps(a, b0, c20), c21 = _mm256_fmadd_ps(a, b1, c21);
    a = _mm256_broadcast_ss(r[3] + kk), c30 = _mm256_fmadd_ps(a, b0, c30), c31 = _mm256_fmadd_ps(a, b1, c31);
    a = _mm256_broadcast_ss(r[4] + kk), c40 = _mm256_fmadd_ps(a, b0, c40), c41 = _mm256_fmadd_ps(a, b1, c41);
    a = _mm256_broadcast_ss(r[5] + kk), c50 = _mm256_fmadd_ps(a, b0, c50), c51 = _mm256_fmadd_ps(a, b1, c51);
  }
  __m256 sums[MR][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}, {c40, c41}, {c50, c51}};
  float b[NR] = {0};
  if (bias) memcpy(b, bias, cols * sizeof(float));
  __m256 b0 = _mm256_loadu_ps(b), b1 = _mm256_loadu_ps(b + 8);
  for (int i = 0; i < rows; i++) {
    __m256 lo = _mm256_add_ps(sums[i][0], b0), hi = _mm256_add_ps(sums[i][1], b1);
    if (cols == NR) {
      _mm256_storeu_ps(y + i * ldy, lo);
      _mm256_storeu_ps(y + i * ldy + 8, hi);
    } else {
      float tile[NR];
      _mm256_storeu_ps(tile, lo);
      _mm256_storeu_ps(tile + 8, hi);
      memcpy(y + i * ldy, tile, cols * sizeof(float));
    }
  }
}

/* y = x W^T (+ bias): x [m, k] with rows `ldx` floats apart, W packed by `pack`, y [m, n] contiguous; `scratch`
 * holds enginekit_panel_gemm_scratch(k, threads) floats. Each task packs a group of panels into its thread's part
 * of the scratch (so they are in that core's caches), then runs every micro-panel of x against them. */
AVX2 void enginekit_panel_gemm(const float *x, long ldx, enginekit_pack_fn pack, const void *weights,
                               const float *bias, float *y, long m, long n, long k, float *scratch, int threads) {
  float *base = (float *)(((unsigned long)scratch + 31) & ~31UL); /* aligned panels */
  long panels = (n + NR - 1) / NR, group = panels / (8L * threads); /* at least eight tasks a thread if it can */
  group = group < 1 ? 1 : group > MAX_GROUP ? MAX_GROUP : group;
  long tasks = (panels + group - 1) / group;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) if (m * n * k >= PARALLEL_MIN_WORK)
  for (long task = 0; task < tasks; task++) {
    float *wp = base + omp_get_thread_num() * thread_scratch(k), *work = wp + MAX_GROUP * NR * k;
    long first = task * group, count = panels - first < group ? panels - first : group;
    for (long p = 0; p < count; p++) pack(weights, n, k, first + p, wp + p * k * NR, work);
    for (long r = 0; r < m; r += MR)
      for (long p = 0; p < count; p++) {
        long column = (first + p) * NR;
        micro_kernel(x + r * ldx, ldx, m - r < MR ? (int)(m - r) : MR, wp + p * k * NR, k,
                     bias ? bias + column : NULL, y + r * n + column, n, n - column < NR ? (int)(n - column) : NR);
      }
  }
}
