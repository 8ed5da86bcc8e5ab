// The GGUF block formats by ggml type id (their byte layouts: skinny_gemm.h), each with its tile
// runners in every mode; the exact-mode linear (sg_linear_gguf) and embedding rows (sg_dequantize_rows).
#include "skinny_gemm.h"

namespace sg {
namespace {

// Rows of a block-format weight written out as fp32 (an embedding lookup), with the same
// per-weight expressions as the linear.
template <typename Fmt>
void dequantize_row(const uint8_t* row, int64_t K, float* out) {
  for (int64_t kb = 0; kb < K; kb += Fmt::kBlock) {
    const uint8_t* block = row + kb / Fmt::kBlock * Fmt::kBytes;
    typename Fmt::Scales scales;
    Fmt::prepare(block, scales);
#pragma GCC unroll 32
    for (int e = 0; e < Fmt::kBlock; e += V) vstore(out + kb + e, Fmt::load(block, scales, e));
  }
}

template <typename Fmt>
BlockFormat block_format() {
  return {Fmt::kBlock, Fmt::kBytes, exact_tiles<Fmt>(), dequantize_row<Fmt>, a8_tiles<Fmt>(), Fmt::kA8Block,
#ifdef SG_AMX
          amx_tiles_of<Fmt>(),
#endif
  };
}

}  // namespace

const BlockFormat* find_block_format(int ggml_type) {
  switch (ggml_type) {
#define SG_CASE(type_id, Fmt)                                \
  case type_id: {                                            \
    static const BlockFormat format = block_format<Fmt>(); \
    return &format;                                          \
  }
    SG_GGUF_FORMATS(SG_CASE)
#undef SG_CASE
    default:
      return nullptr;
  }
}

}  // namespace sg

using namespace sg;

extern "C" {

// Weights of `ggml_type` per block, or 0 when the kernel does not know the type.
int sg_block_size(int ggml_type) {
  const BlockFormat* f = find_block_format(ggml_type);
  return f ? f->block : 0;
}
// Bytes per block of `ggml_type`, or 0.
int sg_block_bytes(int ggml_type) {
  const BlockFormat* f = find_block_format(ggml_type);
  return f ? f->bytes : 0;
}

// GGUF block weights: y = x @ dequantize(w)^T (+ bias), bitwise the fp32 kernel on the
// dequantized matrix. w [N, K / block * bytes] (ggml row layout); K a multiple of the block size.
int sg_linear_gguf(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, int ggml_type,
                   const float* bias, float* y, int num_threads) {
  const BlockFormat* f = find_block_format(ggml_type);
  if (!f || K % f->block) return 1;
  int status;
  if (bad_shape(x, M, K, w, N, y, &status)) return status;
  LinearJob job{x, M, K, w, K / f->block * f->bytes, nullptr, N, bias, y, 0, 0, f->run_tiles};
  return run_linear(job, num_threads);
}

// out[i, :] = dequantize(w[rows[i], :]) for i < n (an embedding lookup); rows must be in [0, N).
int sg_dequantize_rows(const uint8_t* w, int64_t K, int ggml_type, const int64_t* rows, int64_t n, float* out) {
  const BlockFormat* f = find_block_format(ggml_type);
  if (!f || K <= 0 || K % f->block || n < 0) return 1;
  const int64_t row_bytes = K / f->block * f->bytes;
  for (int64_t i = 0; i < n; ++i) f->dequantize_row(w + rows[i] * row_bytes, K, out + i * K);
  return 0;
}

}  // extern "C"
