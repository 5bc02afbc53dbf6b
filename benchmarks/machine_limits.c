/* The machine's own limits, for the benchmark page: peak multiply-add rates and memory read bandwidth.
 *
 *   machine_limits fma32 THREADS REPEATS SECONDS   float32 fused multiply-adds, GFLOP/s (2 per multiply-add)
 *   machine_limits bf16  THREADS REPEATS SECONDS   bfloat16 dot products into float32 (AVX512-BF16), GFLOP/s
 *   machine_limits int8  THREADS REPEATS SECONDS   u8 x s8 dot products into int32 (AVX512-VNNI), GOP/s
 *   machine_limits read  THREADS REPEATS MIB       a STREAM-like read: sum a MIB-sized float32 array, GB/s
 *
 * Prints one figure per repeat, one per line; prints "unsupported" and exits 2 when this CPU (or this
 * compiler's target) has no such instruction. The multiply-add loops touch registers only: twelve independent
 * accumulators per thread, enough to cover the instructions' latency, so the figure is the cores' issue rate.
 * Built by benchmarks/bench_limits.py with `cc -O2 -march=native -fopenmp` when the benchmarks run.
 */
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static volatile float sink_f;
static volatile int32_t sink_i;

/* Twelve accumulators a0 .. a11 of `type`, each starting at its own value (start + k * step): chains that start
 * equal compute equal values, and the compiler then keeps one chain and does one instruction where the loop
 * asks for twelve (the figure would be the latency-bound rate of one chain times twelve, not the issue rate). */
#define START(type, set1, start, step)                                                                          \
    type a0 = set1(start), a1 = set1(start + step), a2 = set1(start + 2 * step), a3 = set1(start + 3 * step);   \
    type a4 = set1(start + 4 * step), a5 = set1(start + 5 * step), a6 = set1(start + 6 * step);                 \
    type a7 = set1(start + 7 * step), a8 = set1(start + 8 * step), a9 = set1(start + 9 * step);                 \
    type a10 = set1(start + 10 * step), a11 = set1(start + 11 * step)

/* Each kernel runs `iterations` loop trips on the calling thread and returns the operations it did. */
typedef double (*kernel_fn)(long iterations);

#if defined(__AVX512F__)
static double fma32(long iterations) {
    START(__m512, _mm512_set1_ps, 1.0f, 0.01f);
    const __m512 m = _mm512_set1_ps(0.9999999f), b = _mm512_set1_ps(1e-7f);
    for (long i = 0; i < iterations; i++) {
        a0 = _mm512_fmadd_ps(a0, m, b); a1 = _mm512_fmadd_ps(a1, m, b); a2 = _mm512_fmadd_ps(a2, m, b);
        a3 = _mm512_fmadd_ps(a3, m, b); a4 = _mm512_fmadd_ps(a4, m, b); a5 = _mm512_fmadd_ps(a5, m, b);
        a6 = _mm512_fmadd_ps(a6, m, b); a7 = _mm512_fmadd_ps(a7, m, b); a8 = _mm512_fmadd_ps(a8, m, b);
        a9 = _mm512_fmadd_ps(a9, m, b); a10 = _mm512_fmadd_ps(a10, m, b); a11 = _mm512_fmadd_ps(a11, m, b);
    }
    __m512 s = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)),
                             _mm512_add_ps(_mm512_add_ps(a4, a5), _mm512_add_ps(a6, a7)));
    s = _mm512_add_ps(s, _mm512_add_ps(_mm512_add_ps(a8, a9), _mm512_add_ps(a10, a11)));
    sink_f = _mm512_reduce_add_ps(s);
    return (double)iterations * 12 * 16 * 2;
}
#elif defined(__AVX2__) && defined(__FMA__)
static double fma32(long iterations) {
    START(__m256, _mm256_set1_ps, 1.0f, 0.01f);
    const __m256 m = _mm256_set1_ps(0.9999999f), b = _mm256_set1_ps(1e-7f);
    for (long i = 0; i < iterations; i++) {
        a0 = _mm256_fmadd_ps(a0, m, b); a1 = _mm256_fmadd_ps(a1, m, b); a2 = _mm256_fmadd_ps(a2, m, b);
        a3 = _mm256_fmadd_ps(a3, m, b); a4 = _mm256_fmadd_ps(a4, m, b); a5 = _mm256_fmadd_ps(a5, m, b);
        a6 = _mm256_fmadd_ps(a6, m, b); a7 = _mm256_fmadd_ps(a7, m, b); a8 = _mm256_fmadd_ps(a8, m, b);
        a9 = _mm256_fmadd_ps(a9, m, b); a10 = _mm256_fmadd_ps(a10, m, b); a11 = _mm256_fmadd_ps(a11, m, b);
    }
    __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)),
                             _mm256_add_ps(_mm256_add_ps(a4, a5), _mm256_add_ps(a6, a7)));
    s = _mm256_add_ps(s, _mm256_add_ps(_mm256_add_ps(a8, a9), _mm256_add_ps(a10, a11)));
    float out[8];
    _mm256_storeu_ps(out, s);
    sink_f = out[0] + out[7];
    return (double)iterations * 12 * 8 * 2;
}
#else
/* Any other CPU: the compiler's own vectors (it emits fused multiply-adds where the target has them). */
typedef float vec4 __attribute__((vector_size(16)));
static double fma32(long iterations) {
    vec4 a[12];
    const vec4 m = {0.9999999f, 0.9999999f, 0.9999999f, 0.9999999f}, b = {1e-7f, 1e-7f, 1e-7f, 1e-7f};
    for (int k = 0; k < 12; k++) a[k] = (vec4){1.0f, 1.0f, 1.0f, 1.0f} + 0.01f * (float)k;
    for (long i = 0; i < iterations; i++)
        for (int k = 0; k < 12; k++) a[k] = a[k] * m + b;
    float s = 0;
    for (int k = 0; k < 12; k++) s += a[k][0];
    sink_f = s;
    return (double)iterations * 12 * 4 * 2;
}
#endif

#if defined(__AVX512BF16__)
static double bf16(long iterations) {
    START(__m512, _mm512_set1_ps, 0.0f, 1.0f);
    const __m512bh x = (__m512bh)_mm512_set1_epi16(0x3f80), y = (__m512bh)_mm512_set1_epi16(0x3380);
    for (long i = 0; i < iterations; i++) {
        a0 = _mm512_dpbf16_ps(a0, x, y); a1 = _mm512_dpbf16_ps(a1, x, y); a2 = _mm512_dpbf16_ps(a2, x, y);
        a3 = _mm512_dpbf16_ps(a3, x, y); a4 = _mm512_dpbf16_ps(a4, x, y); a5 = _mm512_dpbf16_ps(a5, x, y);
        a6 = _mm512_dpbf16_ps(a6, x, y); a7 = _mm512_dpbf16_ps(a7, x, y); a8 = _mm512_dpbf16_ps(a8, x, y);
        a9 = _mm512_dpbf16_ps(a9, x, y); a10 = _mm512_dpbf16_ps(a10, x, y); a11 = _mm512_dpbf16_ps(a11, x, y);
    }
    __m512 s = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)),
                             _mm512_add_ps(_mm512_add_ps(a4, a5), _mm512_add_ps(a6, a7)));
    s = _mm512_add_ps(s, _mm512_add_ps(_mm512_add_ps(a8, a9), _mm512_add_ps(a10, a11)));
    sink_f = _mm512_reduce_add_ps(s);
    return (double)iterations * 12 * 32 * 2; /* 32 bfloat16 pairs per instruction, 2 operations each */
}
#define HAVE_BF16 1
#endif

#if defined(__AVX512VNNI__)
static double int8(long iterations) {
    START(__m512i, _mm512_set1_epi32, 0, 1);
    const __m512i x = _mm512_set1_epi8(3), y = _mm512_set1_epi8(-2);
    for (long i = 0; i < iterations; i++) {
        a0 = _mm512_dpbusd_epi32(a0, x, y); a1 = _mm512_dpbusd_epi32(a1, x, y); a2 = _mm512_dpbusd_epi32(a2, x, y);
        a3 = _mm512_dpbusd_epi32(a3, x, y); a4 = _mm512_dpbusd_epi32(a4, x, y); a5 = _mm512_dpbusd_epi32(a5, x, y);
        a6 = _mm512_dpbusd_epi32(a6, x, y); a7 = _mm512_dpbusd_epi32(a7, x, y); a8 = _mm512_dpbusd_epi32(a8, x, y);
        a9 = _mm512_dpbusd_epi32(a9, x, y); a10 = _mm512_dpbusd_epi32(a10, x, y); a11 = _mm512_dpbusd_epi32(a11, x, y);
    }
    __m512i s = _mm512_add_epi32(_mm512_add_epi32(_mm512_add_epi32(a0, a1), _mm512_add_epi32(a2, a3)),
                                 _mm512_add_epi32(_mm512_add_epi32(a4, a5), _mm512_add_epi32(a6, a7)));
    s = _mm512_add_epi32(s, _mm512_add_epi32(_mm512_add_epi32(a8, a9), _mm512_add_epi32(a10, a11)));
    sink_i = _mm512_reduce_add_epi32(s);
    return (double)iterations * 12 * 64 * 2; /* 64 byte products per instruction, 2 operations each */
}
#define HAVE_INT8 1
#endif

/* Operations per second of `kernel` on `threads` threads, each running for about `seconds`. */
static double rate(kernel_fn kernel, int threads, double seconds) {
    long calibrate = 1 << 16;
    double t0 = now();
    kernel(calibrate);
    double per_trip = (now() - t0) / calibrate;
    long iterations = (long)(seconds / (per_trip > 1e-12 ? per_trip : 1e-12));
    double total = 0;
    double start = now();
#pragma omp parallel num_threads(threads) reduction(+ : total)
    total += kernel(iterations);
    return total / (now() - start);
}

typedef float vec16 __attribute__((vector_size(64)));

/* Bytes per second of reading `mib` MiB of float32 once, on `threads` threads (each its own slice). */
static double read_rate(const vec16 *data, long count, int threads) {
    float total = 0;
    double start = now();
#pragma omp parallel for num_threads(threads) schedule(static) reduction(+ : total)
    for (long block = 0; block < count; block += 4096) {
        vec16 s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
        long end = block + 4096 < count ? block + 4096 : count;
        for (long i = block; i + 3 < end; i += 4) {
            s0 += data[i];
            s1 += data[i + 1];
            s2 += data[i + 2];
            s3 += data[i + 3];
        }
        vec16 s = s0 + s1 + s2 + s3;
        for (int k = 0; k < 16; k++) total += s[k];
    }
    double elapsed = now() - start;
    sink_f = total;
    return count * sizeof(vec16) / elapsed;
}

int main(int argc, char **argv) {
    if (argc != 5) {
        fprintf(stderr, "usage: %s fma32|bf16|int8|read THREADS REPEATS SECONDS|MIB\n", argv[0]);
        return 1;
    }
    const char *what = argv[1];
    int threads = atoi(argv[2]), repeats = atoi(argv[3]);
    double amount = atof(argv[4]);
    if (threads < 1 || repeats < 1 || amount <= 0) {
        fprintf(stderr, "THREADS, REPEATS and SECONDS|MIB must be positive\n");
        return 1;
    }
    if (strcmp(what, "read") == 0) {
        long count = (long)(amount * 1024 * 1024 / sizeof(vec16));
        vec16 *data = aligned_alloc(64, count * sizeof(vec16));
        if (data == NULL) {
            fprintf(stderr, "cannot allocate %.0f MiB\n", amount);
            return 1;
        }
#pragma omp parallel for num_threads(threads) schedule(static)
        for (long block = 0; block < count; block += 4096) /* first touch by the thread that reads it */
            for (long i = block; i < block + 4096 && i < count; i++)
                for (int k = 0; k < 16; k++) data[i][k] = 1.0f;
        read_rate(data, count, threads);
        for (int r = 0; r < repeats; r++) printf("%.3f\n", read_rate(data, count, threads) / 1e9);
        free(data);
        return 0;
    }
    kernel_fn kernel = NULL;
    if (strcmp(what, "fma32") == 0) kernel = fma32;
#ifdef HAVE_BF16
    if (strcmp(what, "bf16") == 0) kernel = bf16;
#endif
#ifdef HAVE_INT8
    if (strcmp(what, "int8") == 0) kernel = int8;
#endif
    if (kernel == NULL) {
        printf("unsupported\n");
        return 2;
    }
    for (int r = 0; r < repeats; r++) printf("%.3f\n", rate(kernel, threads, amount) / 1e9);
    return 0;
}
