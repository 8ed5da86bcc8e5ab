// The a8 mode's integer side on 256 bits (a8.cpp and a8_interleaved.cpp include it): quantizing an activation row
// (the layout is in skinny_gemm.h), the exact integer dot-product steps of the 256-bit code, and the
// K-quants' sub-block pairing of the 256-bit builds (AVX-VNNI packs, plain AVX2 interleaves).
#pragma once
#include "skinny_gemm.h"

namespace sg {
namespace {

inline float hmax256(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}
inline int32_t hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

// x [K] -> one activation row (layout: skinny_gemm.h), blocks of `block` (32 or 256) weights.
void quantize_a8_row(const float* x, int64_t K, int block, uint8_t* out) {
  int8_t* q = (int8_t*)out;
  float* d = (float*)(out + K);
  float* ds = d + K / kA8Sub;
  int16_t* bsum = (int16_t*)(ds + K / kA8Sub);
  int16_t* bsum16 = bsum + K / kA8Sub;
  const __m256 sign_bit = _mm256_set1_ps(-0.0f);
  for (int64_t b = 0; b < K / block; ++b) {
    const float* xb = x + block * b;
    __m256 amax = _mm256_setzero_ps();
    for (int i = 0; i < block; i += 8) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign_bit, _mm256_loadu_ps(xb + i)));
    const float max_abs = hmax256(amax);
    float inverse = 127.0f / max_abs;
    if (!(inverse <= 3.4028234e38f)) inverse = 0.0f;  // all zero (or subnormal / NaN): q = 0
    const float scale = max_abs / 127.0f;
    d[b] = scale;
    for (int s = 0; s < block / kA8Sub; ++s) {
      __m256i qi[4];
      for (int i = 0; i < 4; ++i)  // round half to even (the default rounding mode)
        qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + kA8Sub * s + 8 * i), _mm256_set1_ps(inverse)));
      // int32 -> int8 (|q| <= 127): the packs interleave 128-bit lanes, the permute restores order
      const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
      _mm256_storeu_si256((__m256i*)(q + block * b + kA8Sub * s),
                          _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
      const int32_t first16 = hsum_epi32(_mm256_add_epi32(qi[0], qi[1])), second16 = hsum_epi32(_mm256_add_epi32(qi[2], qi[3]));
      const int32_t sum = first16 + second16;
      const int64_t j = (block * b) / kA8Sub + s;
      bsum[j] = (int16_t)sum;  // |sum| <= 32 * 127
      bsum16[2 * j] = (int16_t)first16, bsum16[2 * j + 1] = (int16_t)second16;
      ds[j] = scale * (float)sum;
    }
  }
}

// x [M, K] -> M activation rows, a8_row_bytes(K) apart (natural order; see pair_sub_blocks).
void quantize_a8_rows(const float* x, int64_t M, int64_t K, int block, uint8_t* out) {
  for (int64_t i = 0; i < M; ++i) quantize_a8_row(x + i * K, K, block, out + i * a8_row_bytes(K));
}

// 8 int32 lanes, lane i = start[i] + the sum of u[4i..4i+3] * s[4i..4i+3] (u unsigned, s signed bytes),
// exact: the maddubs int16 pairs cannot saturate (|u| <= 128 sign-moved or <= 31 unsigned, |s| <= 127).
inline __m256i dot_u8_i8(__m256i u, __m256i s, __m256i start = _mm256_setzero_si256()) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(start, u, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(start, u, s);
#else
  return _mm256_add_epi32(start, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}
// acc + the products of int16 pairs and scale16 (K-quant sub-block scales), summed per int32 lane, exact.
inline __m256i scaled_pairs(__m256i acc, __m256i pairs, __m256i scale16) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpwssd_epi32(acc, pairs, scale16);
#elif defined(__AVXVNNI__)
  return _mm256_dpwssd_avx_epi32(acc, pairs, scale16);
#else
  __m256i sum = _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, scale16));
  // integer adds are associative, so the compiler regroups a tile's adds into a tree of partial
  // sums that outnumber the 16 ymm registers and spills them (~2 stack moves per product); the
  // empty asm keeps each accumulator a running sum in its register (the same integers)
  asm("" : "+x"(sum));
  return sum;
#endif
}

// K-quants on 256 bits: sub-blocks 2p and 2p + 1 ("a", "b") share one scale multiply. The int16
// scale vector for a pair, per 128-bit half (the low half covers bytes 0-15 of each sub-block, the
// high half bytes 16-31; per-16 scales: groups 2 sb, 2 sb + 1), in one of two lane layouts:
// - kPacked (AVX-VNNI): the lanes of _mm256_packs_epi32(dpbusd of a, dpbusd of b): 4 x a, then 4 x b;
// - kInterleaved (plain AVX2, SG_A8_PAIRED): the lanes of maddubs over a and b's quants interleaved
//   by unpacklo / unpackhi_epi16: a, b, a, b, ...
enum class PairLanes { kPacked, kInterleaved };
template <typename Fmt, PairLanes kLanes, typename Scales>
inline __m256i pair_scale16(const Scales& s, int pair) {  // Scales: Fmt::A8Scales (s.sc: the int16 scales)
  auto pick = [](int lo_a, int lo_b, int hi_a, int hi_b) {  // the byte indices of the scales a, b per half
    auto b0 = [](int k) { return (char)(2 * k); };
    auto b1 = [](int k) { return (char)(2 * k + 1); };
    if constexpr (kLanes == PairLanes::kPacked)
      return _mm256_setr_epi8(b0(lo_a), b1(lo_a), b0(lo_a), b1(lo_a), b0(lo_a), b1(lo_a), b0(lo_a), b1(lo_a),
                              b0(lo_b), b1(lo_b), b0(lo_b), b1(lo_b), b0(lo_b), b1(lo_b), b0(lo_b), b1(lo_b),
                              b0(hi_a), b1(hi_a), b0(hi_a), b1(hi_a), b0(hi_a), b1(hi_a), b0(hi_a), b1(hi_a),
                              b0(hi_b), b1(hi_b), b0(hi_b), b1(hi_b), b0(hi_b), b1(hi_b), b0(hi_b), b1(hi_b));
    else
      return _mm256_setr_epi8(b0(lo_a), b1(lo_a), b0(lo_b), b1(lo_b), b0(lo_a), b1(lo_a), b0(lo_b), b1(lo_b),
                              b0(lo_a), b1(lo_a), b0(lo_b), b1(lo_b), b0(lo_a), b1(lo_a), b0(lo_b), b1(lo_b),
                              b0(hi_a), b1(hi_a), b0(hi_b), b1(hi_b), b0(hi_a), b1(hi_a), b0(hi_b), b1(hi_b),
                              b0(hi_a), b1(hi_a), b0(hi_b), b1(hi_b), b0(hi_a), b1(hi_a), b0(hi_b), b1(hi_b));
  };
  if constexpr (Fmt::kA8ScalePer16) {  // sc[g] per 16 weights: pairs 0, 1 read sc[0..7], pairs 2, 3 sc[8..15]
    const __m256i half = _mm256_broadcastsi128_si256(_mm_load_si128((const __m128i*)(s.sc + 8 * (pair / 2))));
    const int g = 4 * (pair % 2);  // a's groups g, g + 1 and b's g + 2, g + 3 within the eight
    return _mm256_shuffle_epi8(half, pick(g, g + 2, g + 1, g + 3));
  } else {  // sc[sb] per 32 weights
    const __m256i all = _mm256_broadcastsi128_si256(_mm_load_si128((const __m128i*)s.sc));
    return _mm256_shuffle_epi8(all, pick(2 * pair, 2 * pair + 1, 2 * pair, 2 * pair + 1));
  }
}

#if !defined(SG_A8_ZMM) && !defined(__AVXVNNI__)
// The plain AVX2 build pairs the K-quants' sub-blocks without VNNI: its K-quant activation rows keep
// each 64 quants of sub-blocks 2p, 2p + 1 (a, b) as [unpacklo_epi16(a, b) | unpackhi_epi16(a, b)]
// (pair_sub_blocks, once per row and call), and the tile interleaves the weights the same way. Then
// each int16 lane of maddubs is a pair of a's products or of b's, the two halves' maddubs add in
// int16 (|.| <= 4 * 63 * 127) and ONE madd applies both scales: 3 multiplies per 64 weights and row
// where maddubs + madd per sub-block take 4. The same integer products, so the same totals and bits.
#define SG_A8_PAIRED 1
inline void pair_sub_blocks(uint8_t* q, int64_t K) {  // K a multiple of 64
  for (int64_t k = 0; k < K; k += 2 * kA8Sub) {
    const __m256i a = load32(q + k), b = load32(q + k + kA8Sub);
    _mm256_storeu_si256((__m256i*)(q + k), _mm256_unpacklo_epi16(a, b));
    _mm256_storeu_si256((__m256i*)(q + k + kA8Sub), _mm256_unpackhi_epi16(a, b));
  }
}
#endif

}  // namespace
}  // namespace sg
