/* A whole decoder layer in one call, for weights kept as a GGUF file stores them: the plain decoder's layer (RMS
 * norm, q/k/v projection with its optional bias, rotary embedding with the cache write, attention over the paged
 * cache in place, output projection, residual; RMS norm, gate/up projection, SiLU and multiply, down projection,
 * residual), each piece the same function the layer's Python calls one by one (layer_ops.c, quant_gemm.c), in the
 * same order, so the result is the same to the bit.
 *
 * At a decode step of the default model each of those pieces is a few microseconds of arithmetic behind a few
 * microseconds of Python; fifteen of them a layer made the Python a third of a one-request step. Called through
 * LayerOps.stored_layer (enginekit/model/kernels/native.py) by the function DecoderLayer.fuse sets up, which
 * Decoder.forward (enginekit/model/decoder.py) runs instead of the layer at the steps whose every query attends
 * natively.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* the pieces, from layer_ops.c and quant_gemm.c (one library) */
void enginekit_rms_norm(const float *x, long stride, const float *w, float *out, long rows, long n, float eps,
                        int threads);
void enginekit_silu_mul(const float *x, long stride, float *out, long rows, long inter, int threads);
int enginekit_rope_write_cache(const float *qkv, long stride, const float *cos, const float *sin, const long *slots,
                               float *qk_out, float *k_cache, float *v_cache, long tokens, long heads, long kv_heads,
                               long d, long num_slots, int threads);
int enginekit_paged_attention(const float *q, long q_stride, const float *k_cache, const float *v_cache,
                              const long *tables, long table_stride, const long *table_rows, const long *lens,
                              float *out, long batch, long heads, long kv_heads, long d, long block_size,
                              long num_slots, long table_count, long table_width, float scale, long window,
                              float softcap, int threads);
int enginekit_quant_gemm(const float *x, const uint8_t *w, int type, float *y, long m, long n, long k, int threads,
                         int isa, int path);
int enginekit_quant_format(int type, long *block, long *bytes);

enum { OK = 0, NO_MEMORY = -3, BAD_ROW_BYTES = -10, BAD_SLOT = -11, BAD_TABLE_ROW = -12, BAD_LENGTH = -13,
       BAD_BLOCK = -14 };

/* Whether a weight of `type` with `k` input features has rows of `row_bytes`; the product's own errors otherwise. */
static int rows_fit(int type, long k, long row_bytes) {
  long block, bytes;
  int error = enginekit_quant_format(type, &block, &bytes);
  if (error) return error;
  return k % block == 0 && k / block * bytes == row_bytes ? OK : BAD_ROW_BYTES;
}

static void add_rows(float *y, const float *x, long count) {
  for (long i = 0; i < count; i++) y[i] += x[i];
}

/* hidden [rows, size] becomes the layer's output, in place. Weights: w_qkv [n_qkv = (heads + 2 kv_heads) d] (with
 * b_qkv [n_qkv], or NULL), w_o [size] over heads x d, w_gate_up [2 inter] over size, w_down [size] over inter, each
 * rows of `*_bytes` bytes of its GGUF type. Attention: as enginekit_paged_attention; cos, sin [rows, d]; each row's
 * new key and value go to its slot. Returns 0; or, before anything is written, a weight's or a table's error
 * (BAD_*, or the product's: no kernel for a type); or NO_MEMORY from a product (hidden then partly updated). The
 * four products take `path` (enginekit_quant_gemm's). */
int enginekit_stored_layer(float *hidden, long rows, long size, const float *norm1, const float *norm2, float eps,
                           const uint8_t *w_qkv, int t_qkv, long qkv_bytes, const float *b_qkv, const uint8_t *w_o,
                           int t_o, long o_bytes, const uint8_t *w_gate_up, int t_gate_up, long gate_up_bytes,
                           const uint8_t *w_down, int t_down, long down_bytes, long inter, const float *cos,
                           const float *sin, const long *slots, float *k_cache, float *v_cache, long heads,
                           long kv_heads, long d, long num_slots, const long *tables, long table_stride,
                           const long *table_rows, const long *lens, long table_count, long table_width,
                           long block_size, float scale, long window, float softcap, int threads, int isa,
                           int path) {
  long n_qkv = (heads + 2 * kv_heads) * d, q_size = heads * d, num_blocks = num_slots / block_size;
  int error;
  if ((error = rows_fit(t_qkv, size, qkv_bytes)) || (error = rows_fit(t_o, q_size, o_bytes)) ||
      (error = rows_fit(t_gate_up, size, gate_up_bytes)) || (error = rows_fit(t_down, inter, down_bytes)))
    return error;
  for (long r = 0; r < rows; r++) { /* every table read, before anything is written */
    long row = table_rows ? table_rows[r] : r;
    if (slots[r] < 0 || slots[r] >= num_slots) return BAD_SLOT;
    if (row < 0 || row >= table_count) return BAD_TABLE_ROW;
    if (lens[r] < 0 || lens[r] > table_width * block_size) return BAD_LENGTH;
    for (long i = 0; i < (lens[r] + block_size - 1) / block_size; i++)
      if (tables[row * table_stride + i] < 0 || tables[row * table_stride + i] >= num_blocks) return BAD_BLOCK;
  }
  long widest = size > q_size ? size : q_size;
  float *normed = malloc(sizeof(float) * rows * (widest + n_qkv + (heads + kv_heads) * d + q_size + 3 * inter));
  if (!normed) return NO_MEMORY;
  float *qkv = normed + rows * widest, *qk = qkv + rows * n_qkv, *attended = qk + rows * (heads + kv_heads) * d;
  float *gate_up = attended + rows * q_size, *act = gate_up + rows * 2 * inter, *delta = normed;

  enginekit_rms_norm(hidden, size, norm1, normed, rows, size, eps, threads);
  error = enginekit_quant_gemm(normed, w_qkv, t_qkv, qkv, rows, n_qkv, size, threads, isa, path);
  if (!error && b_qkv)
    for (long r = 0; r < rows; r++) add_rows(qkv + r * n_qkv, b_qkv, n_qkv);
  if (!error)
    error = enginekit_rope_write_cache(qkv, n_qkv, cos, sin, slots, qk, k_cache, v_cache, rows, heads, kv_heads, d,
                                       num_slots, threads);
  if (!error)
    error = enginekit_paged_attention(qk, (heads + kv_heads) * d, k_cache, v_cache, tables, table_stride, table_rows,
                                      lens, attended, rows, heads, kv_heads, d, block_size, num_slots, table_count,
                                      table_width, scale, window, softcap, threads);
  if (!error) error = enginekit_quant_gemm(attended, w_o, t_o, delta, rows, size, q_size, threads, isa, path);
  if (!error) {
    add_rows(hidden, delta, rows * size);
    enginekit_rms_norm(hidden, size, norm2, normed, rows, size, eps, threads);
    error = enginekit_quant_gemm(normed, w_gate_up, t_gate_up, gate_up, rows, 2 * inter, size, threads, isa, path);
  }
  if (!error) {
    enginekit_silu_mul(gate_up, 2 * inter, act, rows, inter, threads);
    error = enginekit_quant_gemm(act, w_down, t_down, delta, rows, size, inter, threads, isa, path);
  }
  if (!error) add_rows(hidden, delta, rows * size);
  free(normed);
  return error;
}
