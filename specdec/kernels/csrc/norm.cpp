// RMSNorm for the native forward (sg_rms_norm), optionally with the residual add before it.
#include "skinny_gemm.h"

namespace sg {
namespace {

// One row, one fixed sequence on 256-bit vectors in every build (the same bits on AVX2 and AVX-512):
//     sum of squares: lane j of 16 accumulates src[i]^2 for the i = j (mod 16) of the whole 16-wide
//     chunks (a product, then a sum, each rounded), the 16 lanes added pairwise (8 + 8) and summed in
//     hsum256's tree, then the tail's squares in order;
//     scale = 1 / sqrt(sum / H + eps);  out[i] = (src[i] * scale) * weight[i].
// A row depends on nothing but itself, so the norm is batch invariant.
void rms_norm_row(const float* src, const float* weight, int64_t H, float eps, float* out) {
  __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= H; i += 16) {
    const __m256 a = _mm256_loadu_ps(src + i), b = _mm256_loadu_ps(src + i + 8);
    lo = _mm256_add_ps(lo, _mm256_mul_ps(a, a));
    hi = _mm256_add_ps(hi, _mm256_mul_ps(b, b));
  }
  float sum = hsum256(_mm256_add_ps(lo, hi));
  for (; i < H; ++i) sum += src[i] * src[i];
  const float scale = 1.0f / std::sqrt(sum / (float)H + eps);
  const __m256 scale8 = _mm256_set1_ps(scale);
  i = 0;
  for (; i + 8 <= H; i += 8)
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(src + i), scale8), _mm256_loadu_ps(weight + i)));
  for (; i < H; ++i) out[i] = (src[i] * scale) * weight[i];
}

}  // namespace
}  // namespace sg

using namespace sg;

extern "C" {

// normed[m] = rms_norm(x[m]) * weight for M rows of H (see rms_norm_row). With `delta`, first
// sum[m] = x[m] + delta[m] (each element rounded once) and the norm is of that sum: the residual add
// and the next norm in one pass. x, delta, sum, normed [M, H] contiguous (sum may be x itself);
// weight [H]. Returns 0, or 1 on bad arguments.
int sg_rms_norm(const float* x, const float* delta, const float* weight, int64_t M, int64_t H, float eps, float* sum,
                float* normed) {
  if (M < 0 || H <= 0) return 1;
  if (M == 0) return 0;
  if (!x || !weight || !normed || (delta && !sum)) return 1;
  for (int64_t m = 0; m < M; ++m) {
    const float* src = x + m * H;
    if (delta) {
      float* row = sum + m * H;
      const float* add = delta + m * H;
      int64_t i = 0;
      for (; i + 8 <= H; i += 8) _mm256_storeu_ps(row + i, _mm256_add_ps(_mm256_loadu_ps(src + i), _mm256_loadu_ps(add + i)));
      for (; i < H; ++i) row[i] = src[i] + add[i];
      src = row;
    }
    rms_norm_row(src, weight, H, eps, normed + m * H);
  }
  return 0;
}

}  // extern "C"
