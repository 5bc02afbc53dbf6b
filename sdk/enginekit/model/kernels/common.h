/* What the native kernels share: the instruction-set attributes their functions are compiled for, the horizontal
 * sum of a vector, and the panel-packing GEMM driver of panel_gemm.c, which quant_gemm.c runs with a weight
 * packer that dequantizes GGUF blocks.
 *
 * The library is compiled without -mavx2: each function says which instructions it may use, and the code that
 * calls it checks the CPU first (enginekit_skinny_supported, enginekit_quant_isa).
 */
#ifndef ENGINEKIT_COMMON_H
#define ENGINEKIT_COMMON_H

#include <immintrin.h>

#define AVX2 __attribute__((target("avx2,fma")))
#define AVX2_F16C __attribute__((target("avx2,fma,f16c")))
#define AVX512_VNNI __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))
#define AVX512_BF16 __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,avx512bf16")))

/* The sum of the eight floats of v. */
AVX2 static inline float hsum8(__m256 v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}

/* Writes panel `panel` of the weight W [n, k] (whatever its storage) as floats, wp[kk * 16 + j] = W[panel * 16 + j,
 * kk], zero past n. `work` is k floats of the calling thread's scratch. */
typedef void (*enginekit_pack_fn)(const void *weights, long n, long k, long panel, float *wp, float *work);

/* y = x W^T (+ bias) for x [m, k] with rows `ldx` floats apart, y [m, n] contiguous, W packed panel by panel by
 * `pack`; `scratch` holds enginekit_panel_gemm_scratch(k, threads) floats (panel_gemm.c). */
void enginekit_panel_gemm(const float *x, long ldx, enginekit_pack_fn pack, const void *weights, const float *bias,
                          float *y, long m, long n, long k, float *scratch, int threads);
long enginekit_panel_gemm_scratch(long k, int threads);

#endif
