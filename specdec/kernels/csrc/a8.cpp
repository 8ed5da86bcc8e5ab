// Int8 activations (the gguf-a8 mode): x quantized per block of 32 or 256 (the row layout is in
// skinny_gemm.h), d = amax / 127, q = round_half_even(x * (127 / amax)); integer dot products
// with the GGUF weight quants.
// 32-weight formats, per block: acc = fma(int32 lanes -> fp32, weight scale * d, acc).
// Then y = hsum(acc) + mins [+ bias].
// K-quants: the 6-bit / int8 sub-block scales multiply the exact integer dot products, and each
// output's lanes are summed to ONE integer per 256 weights (exact, so the same integer in any
// order, on either build), then one fp32 update per output: acc = fma(total, d_w * d, acc), and
// acc = fnmadd(sum of m * bsum, dmin * d, acc) for the min formats. Then y = acc [+ bias].
// Every output is one fixed instruction sequence: bitwise batch invariant, and the same bits on
// AVX2 and AVX-512 CPUs: every float step sees the same integers.
#include "a8_int.h"

namespace sg {
namespace {

// K-quant tiles that keep the AVX2 build's sums of all MR x NR outputs per sub-block (the decoded
// scratch of many rows, whose quants and scales are plain loads), where the blocks' own tiles walk
// one column at a time
template <typename Fmt, typename = void>
struct rows_outer : std::false_type {};
template <typename Fmt>
struct rows_outer<Fmt, std::void_t<decltype(Fmt::kRowsOuter)>> : std::bool_constant<Fmt::kRowsOuter> {};

// 32-weight formats: a block's min-term weights of the 4 columns (0 past NR). Every row adds
// m * ds per lane, the product and the sum each rounded as the scalar expression was: one 128-bit
// multiply and add per row for the 4 outputs instead of 4 scalar pairs.
template <typename Fmt, int NR, typename Scales>
__m128 min_cols(const Scales (&scales)[NR]) {
  auto min_of = [&](int c) { return c < NR ? Fmt::a8_min(scales[c], 0) : 0.0f; };
  return _mm_setr_ps(min_of(0), min_of(1), min_of(2), min_of(3));
}

// Formats whose a8 tile runs two columns per zmm (the decoded 32-weight blocks of the VNNI build)
template <typename Fmt, typename = void>
struct pairs_columns : std::false_type {};
template <typename Fmt>
struct pairs_columns<Fmt, std::void_t<decltype(Fmt::kPairColumns)>> : std::bool_constant<Fmt::kPairColumns> {};
// 32-weight formats whose raw blocks run two columns per zmm as unsigned quants (the VNNI build's
// 1-4 row tiles, the formats with quants_u64): u = q + kA8QuantOffset, so every int32 lane
// x . q = x . u - offset * (x's 4 bytes summed)
template <typename Fmt, typename = void>
struct raw_pairs : std::false_type {};
template <typename Fmt>
struct raw_pairs<Fmt, std::void_t<decltype(&Fmt::quants_u64)>> : std::true_type {};
// 32-weight formats, a block's float step per output: acc = fma(float(int32 lanes), d_w * d_x, acc)
inline __m256 block32_step(__m256 acc, __m256i dot, __m256 weight_scale, __m256 dx) {
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(weight_scale, dx), acc);
}
#ifdef SG_A8_ZMM
inline __m512 block32_step(__m512 acc, __m512i dot, __m512 weight_scales, __m512 dx) {  // two columns
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(weight_scales, dx), acc);
}
inline __m512 scale_pair(__m256 low, __m256 high) {  // column 2p's 8 lanes, then column 2p + 1's
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(low)), _mm256_castps_pd(high), 1));
}
// -offset * (the sum of each int32 lane's 4 activation bytes): the start that makes vpdpbusd on
// unsigned quants u = q + offset give exactly q . x per lane
inline __m512i neg_offset_lane_sums(__m512i x, int offset) {
  return _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8((char)offset), x));
}
#endif

// K-quants: a super-block's update of the tile's outputs (the AVX2 build, and 1-row tiles on the
// zmm build): `lanes` = each output's int32 lanes (8 per output), summed to ONE integer total (any
// order gives the same integer); then acc = fma(float(total), d_w * dx, acc) and, for Q4_K / Q5_K,
// acc = fnmadd(float(sum over sub-blocks of m * bsum), dmin * dx, acc), per lane (columns past NR
// are zero: d = dmin = 0). Row r's accumulators: a.saved[4 r + c], so two rows fill one 256-bit
// vector: rows go in pairs (an odd last row alone, in 128 bits), each lane the same float steps.
template <typename Fmt, int MR, int NR, typename Scales>
void k_quant_update_rows(const __m256i (&lanes)[MR][4], const Scales (&scales)[NR], const TileArgs& a, int64_t kb) {
  auto d_of = [&](int c) { return c < NR ? scales[c].d : 0.0f; };
  const __m128 d_cols = _mm_setr_ps(d_of(0), d_of(1), d_of(2), d_of(3));
  [[maybe_unused]] __m256i m_cols[2];  // int16: columns 0, 1 | 2, 3
  [[maybe_unused]] __m128 dmin_cols;
  if constexpr (Fmt::kHasMin) {
    auto m_of = [&](int c) { return c < NR ? _mm_load_si128((const __m128i*)scales[c].m) : _mm_setzero_si128(); };
    auto dmin_of = [&](int c) { return c < NR ? scales[c].dmin : 0.0f; };
    m_cols[0] = _mm256_set_m128i(m_of(1), m_of(0)), m_cols[1] = _mm256_set_m128i(m_of(3), m_of(2));
    dmin_cols = _mm_setr_ps(dmin_of(0), dmin_of(1), dmin_of(2), dmin_of(3));
  }
  const uint64_t block = (uint64_t)kb / Fmt::kA8Block, sub = (uint64_t)kb / kA8Sub;
  // every row's scale and activation sums, read before the first store (which may alias them)
  [[maybe_unused]] float dx_rows[MR];
  [[maybe_unused]] __m256i bsum_rows[MR];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    const A8Row row(a.xq + r * a.ldxq, a.K);
    dx_rows[r] = row.d[block];
    if constexpr (Fmt::kHasMin) bsum_rows[r] = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(row.bsum + sub)));
  }
  // hadd tree: lanes 0-3 of each half = the columns' partial sums (the halves added = totals)
  auto halves = [&](int r) {
    return _mm256_hadd_epi32(_mm256_hadd_epi32(lanes[r][0], lanes[r][1]), _mm256_hadd_epi32(lanes[r][2], lanes[r][3]));
  };
  // Q4_K / Q5_K: a row's m . bsum per column in int32 pairs: low half columns 0, 2 / high 1, 3, twice
  auto min_pairs = [&](int r) {
    return _mm256_hadd_epi32(_mm256_madd_epi16(m_cols[0], bsum_rows[r]), _mm256_madd_epi16(m_cols[1], bsum_rows[r]));
  };
  int r = 0;
#pragma GCC unroll 4
  for (; r + 1 < MR; r += 2) {  // rows r, r + 1: lanes [row r's columns 0-3 | row r + 1's]
    const __m256i h0 = halves(r), h1 = halves(r + 1);
    const __m256i totals = _mm256_add_epi32(_mm256_permute2x128_si256(h0, h1, 0x20), _mm256_permute2x128_si256(h0, h1, 0x31));
    const __m256 dx = _mm256_set_m128(_mm_set1_ps(dx_rows[r + 1]), _mm_set1_ps(dx_rows[r]));
    float* acc = a.saved + 4 * r;
    __m256 sum = _mm256_fmadd_ps(_mm256_cvtepi32_ps(totals), _mm256_mul_ps(_mm256_set_m128(d_cols, d_cols), dx), _mm256_loadu_ps(acc));
    if constexpr (Fmt::kHasMin) {
      // lanes [r: c0, c2, r + 1: c0, c2 | r: c1, c3, r + 1: c1, c3] -> [r: c0-3 | r + 1: c0-3]
      const __m256i m = _mm256_hadd_epi32(min_pairs(r), min_pairs(r + 1));
      const __m256i msum = _mm256_permutevar8x32_epi32(m, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      sum = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_mul_ps(_mm256_set_m128(dmin_cols, dmin_cols), dx), sum);
    }
    _mm256_storeu_ps(acc, sum);
  }
  if constexpr (MR % 2) {  // the last row alone
    const __m128 dx = _mm_set1_ps(dx_rows[r]);
    const __m256i h = halves(r);
    const __m128i totals = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
    float* acc = a.saved + 4 * r;
    __m128 sum = _mm_fmadd_ps(_mm_cvtepi32_ps(totals), _mm_mul_ps(d_cols, dx), _mm_loadu_ps(acc));
    if constexpr (Fmt::kHasMin) {
      __m256i m = min_pairs(r);
      m = _mm256_hadd_epi32(m, m);  // low half: columns 0, 2, high half: 1, 3
      const __m128i msum = _mm_unpacklo_epi32(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
      sum = _mm_fnmadd_ps(_mm_cvtepi32_ps(msum), _mm_mul_ps(dmin_cols, dx), sum);
    }
    _mm_storeu_ps(acc, sum);
  }
}

#ifdef SG_A8_ZMM
// per 128-bit chunk k: [the sum of chunk k's 4 lanes in i0, in i1, in i2, in i3] (exact integer adds)
inline __m512i sum_chunks_of_each(__m512i i0, __m512i i1, __m512i i2, __m512i i3) {
  const __m512i a = _mm512_add_epi32(_mm512_unpacklo_epi32(i0, i1), _mm512_unpackhi_epi32(i0, i1));
  const __m512i b = _mm512_add_epi32(_mm512_unpacklo_epi32(i2, i3), _mm512_unpackhi_epi32(i2, i3));
  return _mm512_add_epi32(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b));
}
// chunk j = the sum of the 4 chunks of cj
inline __m512i sum_over_chunks(__m512i c0, __m512i c1, __m512i c2, __m512i c3) {
  const __m512i t01 = _mm512_add_epi32(_mm512_shuffle_i32x4(c0, c1, 0x44), _mm512_shuffle_i32x4(c0, c1, 0xee));
  const __m512i t23 = _mm512_add_epi32(_mm512_shuffle_i32x4(c2, c3, 0x44), _mm512_shuffle_i32x4(c2, c3, 0xee));
  return _mm512_add_epi32(_mm512_shuffle_i32x4(t01, t23, 0x88), _mm512_shuffle_i32x4(t01, t23, 0xdd));
}

// K-quants, zmm build, 2-4 rows: the same update for the tile's 4 x 4 outputs at once in one zmm,
// lane 4r + c (row r, column c; a 1-row tile's lanes are those of k_quant_update_rows), the
// accumulators in a.saved[0, 16). Each output's 16 int32 lanes become its total by one
// transpose-and-add tree for all outputs, and each lane takes the same float steps on the same
// values as in k_quant_update_rows. Rows past MR and columns past NR are zero lanes.
template <typename Fmt, int MR, int NR, typename Scales>
void k_quant_update16(const __m512i (&isum2)[MR][NR], const Scales (&scales)[NR], const TileArgs& a, int64_t kb) {
  const __m512i zero = _mm512_setzero_si512();
  auto isum = [&](int r, int c) { return c < NR ? isum2[r][c] : zero; };
  __m512i per_row[4];  // chunk k, lane c: row r's chunk-k partial total of column c
#pragma GCC unroll 4
  for (int r = 0; r < 4; ++r) per_row[r] = r < MR ? sum_chunks_of_each(isum(r, 0), isum(r, 1), isum(r, 2), isum(r, 3)) : zero;
  const __m512i totals = sum_over_chunks(per_row[0], per_row[1], per_row[2], per_row[3]);
  auto columns = [&](auto value_of) {  // lane c of every chunk = value_of(c), 0 past NR
    return _mm512_broadcast_f32x4(_mm_setr_ps(value_of(0), value_of(1), value_of(2), value_of(3)));
  };
  auto dx_of = [&](int r) { return r < MR ? A8Row(a.xq + r * a.ldxq, a.K).d[kb / Fmt::kA8Block] : 0.0f; };
  const __m512i chunk_of_lane = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  const __m512 dx = _mm512_permutexvar_ps(chunk_of_lane, _mm512_castps128_ps512(_mm_setr_ps(dx_of(0), dx_of(1), dx_of(2), dx_of(3))));
  const __m512 d_w = columns([&](int c) { return c < NR ? scales[c].d : 0.0f; });
  __m512 acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(totals), _mm512_mul_ps(d_w, dx), _mm512_loadu_ps(a.saved));
  if constexpr (Fmt::kHasMin) {
    auto bsum_of = [&](int r) {
      return r < MR ? _mm_loadu_si128((const __m128i*)(A8Row(a.xq + r * a.ldxq, a.K).bsum + kb / kA8Sub)) : _mm_setzero_si128();
    };
    const __m512i bsums = _mm512_inserti32x4(  // chunk r: row r's 8 activation sums (int16)
        _mm512_inserti32x4(_mm512_inserti32x4(_mm512_castsi128_si512(bsum_of(0)), bsum_of(1), 1), bsum_of(2), 2), bsum_of(3), 3);
    __m512i per_column[4];  // chunk r: row r's m . bsum of column c in 4 partial sums (int16 pairs)
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c)
      per_column[c] = c < NR ? _mm512_madd_epi16(_mm512_broadcast_i32x4(_mm_load_si128((const __m128i*)scales[c].m)), bsums) : zero;
    const __m512i min_totals = sum_chunks_of_each(per_column[0], per_column[1], per_column[2], per_column[3]);  // lane 4r + c
    const __m512 dmin_w = columns([&](int c) { return c < NR ? scales[c].dmin : 0.0f; });
    acc = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(min_totals), _mm512_mul_ps(dmin_w, dx), acc);
  }
  _mm512_storeu_ps(a.saved, acc);
}
#endif

// The float accumulators live in a.saved (32-weight formats: 8 lanes + the min-term sum per output;
// K-quants: one float per output, touched once per 256 weights): keeping them out of registers
// leaves room for the integer sums.
template <typename Fmt, int MR, int NR>
void a8_tile(const TileArgs& a) {
  // a.saved, per row r (kRowFloats floats): the 8 acc lanes of each column side by side (two
  // columns = one 16-float vector), then the row's min-term sums: one float per column
  constexpr int kRowFloats = kColsPerTile * kSavedFloats;
  static_assert(NR <= 4 && kRowFloats >= 8 * 4 + 16, "a row's acc lanes and its min-term sums fit its kRowFloats");
  float* const saved = a.saved;
  auto acc_of = [saved](int r, int c) { return saved + r * kRowFloats + 8 * c; };
  auto mins_of = [saved](int r) { return saved + r * kRowFloats + 32; };  // 16 floats, column c at c
  if (a.k_begin == 0) {
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      _mm256_storeu_ps(mins_of(r), _mm256_setzero_ps()), _mm256_storeu_ps(mins_of(r) + 8, _mm256_setzero_ps());
#pragma GCC unroll 8
      for (int c = 0; c < NR; ++c) _mm256_storeu_ps(acc_of(r, c), _mm256_setzero_ps());
    }
    // K-quants: one float per output, saved[4 r + c] (k_quant_update16 / k_quant_update_rows)
    _mm256_storeu_ps(saved, _mm256_setzero_ps()), _mm256_storeu_ps(saved + 8, _mm256_setzero_ps());
  }
  constexpr int kSubs = Fmt::kBlock / kA8Sub;
  // 32-weight formats: the float accumulators are updated every 32 weights, so they stay in
  // registers over this K range (the same operations on the same values as in memory)
  constexpr bool kBlock32 = Fmt::kA8Block == kA8Sub;
  [[maybe_unused]] __m256 acc32[MR][NR];
  [[maybe_unused]] __m128 mins4[MR];  // the min-term sums of a row's (up to) 4 columns, lane c
  constexpr bool kPaired = pairs_columns<Fmt>::value;
  constexpr bool kRawPaired = raw_pairs<Fmt>::value;
  constexpr bool kZmmPairs = kPaired || kRawPaired;  // acc_pair holds columns 2p, 2p + 1
  constexpr int kPairs = NR / 2;  // paired: columns 2p, 2p + 1 in acc_pair[r][p]; an odd last column in acc32
#ifdef SG_A8_ZMM
  [[maybe_unused]] __m512 acc_pair[MR][kPairs > 0 ? kPairs : 1];
  auto load_pair = [&](int r, int c) { acc_pair[r][c / 2] = _mm512_loadu_ps(acc_of(r, c)); };
  auto store_pair = [&](int r, int c) { _mm512_storeu_ps(acc_of(r, c), acc_pair[r][c / 2]); };
#else
  auto load_pair = [](int, int) {}, store_pair = [](int, int) {};  // kPaired is zmm-only
#endif
  if constexpr (kBlock32) {
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
      for (int c = 0; c < NR; ++c) {
        if (kZmmPairs && c < 2 * kPairs) {
          if (c % 2 == 0) load_pair(r, c);
        } else {
          acc32[r][c] = _mm256_loadu_ps(acc_of(r, c));
        }
      }
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) mins4[r] = _mm_loadu_ps(mins_of(r));
  }
  constexpr int64_t kLine = 64;
  int64_t next_prefetch = INT64_MAX;
  if (a.prefetch) {
    const int64_t line = a.k_begin / Fmt::kBlock * Fmt::kBytes / kLine;
    next_prefetch = (line + ((a.pf_phase - line % a.pf_stride) % a.pf_stride + a.pf_stride) % a.pf_stride) * kLine;
  }
  for (int64_t kb = a.k_begin; kb < a.k_end; kb += Fmt::kBlock) {
    const int64_t offset = kb / Fmt::kBlock * Fmt::kBytes;
    while (next_prefetch < offset + Fmt::kBytes) {
#pragma GCC unroll 8
      for (int c = 0; c < NR; ++c) _mm_prefetch((const char*)(a.prefetch + c * a.ldw + next_prefetch), _MM_HINT_T1);
      next_prefetch += a.pf_stride * kLine;
    }
#ifdef SG_A8_ZMM
    if constexpr (kBlock32 && kPaired) {  // see DecodedBlock32A8
      typename Fmt::Scales scales[NR];
      __m512i wq2[kPairs > 0 ? kPairs : 1], start2[kPairs > 0 ? kPairs : 1];  // columns 2p | 2p + 1
      __m512 scale2[kPairs > 0 ? kPairs : 1];
      auto pair_of = [](__m256i lo, __m256i hi) { return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1); };
#pragma GCC unroll 8
      for (int c = 0; c < NR; ++c) Fmt::prepare(a.w + c * a.ldw + offset, scales[c]);
#pragma GCC unroll 4
      for (int p = 0; p < kPairs; ++p) {
        const uint8_t* b0 = a.w + 2 * p * a.ldw + offset;
        const uint8_t* b1 = b0 + a.ldw;
        wq2[p] = pair_of(Fmt::quants32(b0, 0), Fmt::quants32(b1, 0));
        start2[p] = Fmt::kSigned ? pair_of(Fmt::neg_offset_sums(b0), Fmt::neg_offset_sums(b1)) : _mm512_setzero_si512();
        scale2[p] = scale_pair(Fmt::a8_scale(scales[2 * p], 0), Fmt::a8_scale(scales[2 * p + 1], 0));
      }
      const uint8_t* last = a.w + (NR - 1) * a.ldw + offset;
      const int64_t ab = kb / kA8Sub;
      [[maybe_unused]] const __m128 m_cols = min_cols<Fmt, NR>(scales);
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        const A8Row row(a.xq + r * a.ldxq, a.K);
        __m512i xv = broadcast32(row.q + kb);
        if constexpr (Fmt::kSigned) xv = _mm512_xor_si512(xv, _mm512_set1_epi8((char)0x80));  // x + 128, unsigned
        const __m512 dx = _mm512_set1_ps(row.d[ab]);
#pragma GCC unroll 4
        for (int p = 0; p < kPairs; ++p) {
          const __m512i dot = Fmt::kSigned ? _mm512_dpbusd_epi32(start2[p], xv, wq2[p]) : _mm512_dpbusd_epi32(start2[p], wq2[p], xv);
          acc_pair[r][p] = block32_step(acc_pair[r][p], dot, scale2[p], dx);
        }
        if constexpr (NR % 2) {
          const __m256i x8 = _mm512_castsi512_si256(xv);
          const __m256i dot = Fmt::kSigned ? _mm256_dpbusd_epi32(Fmt::neg_offset_sums(last), x8, Fmt::quants32(last, 0))
                                           : _mm256_dpbusd_epi32(_mm256_setzero_si256(), Fmt::quants32(last, 0), x8);
          acc32[r][NR - 1] = block32_step(acc32[r][NR - 1], dot, Fmt::a8_scale(scales[NR - 1], 0), _mm512_castps512_ps256(dx));
        }
        if constexpr (Fmt::kHasMin) mins4[r] = _mm_add_ps(mins4[r], _mm_mul_ps(m_cols, _mm_set1_ps(row.ds[ab])));
      }
    } else if constexpr (kBlock32 && kRawPaired) {  // see raw_pairs: the lanes and float steps of the 256-bit code
      constexpr int kOffset = Fmt::kA8QuantOffset;
      typename Fmt::Scales scales[NR];
      __m512i wu2[kPairs > 0 ? kPairs : 1];  // columns 2p | 2p + 1
      __m512 scale2[kPairs > 0 ? kPairs : 1];
#pragma GCC unroll 8
      for (int c = 0; c < NR; ++c) Fmt::prepare(a.w + c * a.ldw + offset, scales[c]);
#pragma GCC unroll 4
      for (int p = 0; p < kPairs; ++p) {
        const uint8_t* b0 = a.w + 2 * p * a.ldw + offset;
        wu2[p] = Fmt::quants_u64(b0, b0 + a.ldw);
        scale2[p] = scale_pair(Fmt::a8_scale(scales[2 * p], 0), Fmt::a8_scale(scales[2 * p + 1], 0));
      }
      [[maybe_unused]] __m256i wu_last;  // an odd last column: its 32 quants + the offset (mod 256)
      if constexpr (NR % 2) wu_last = _mm256_add_epi8(Fmt::quants32(a.w + (NR - 1) * a.ldw + offset, 0), _mm256_set1_epi8((char)kOffset));
      const int64_t ab = kb / kA8Sub;
      [[maybe_unused]] const __m128 m_cols = min_cols<Fmt, NR>(scales);
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        const A8Row row(a.xq + r * a.ldxq, a.K);
        const __m512i xv = broadcast32(row.q + kb);
        const __m512i start = kOffset != 0 ? neg_offset_lane_sums(xv, kOffset) : _mm512_setzero_si512();
        const __m512 dx = _mm512_set1_ps(row.d[ab]);
#pragma GCC unroll 4
        for (int p = 0; p < kPairs; ++p) {
          const __m512i dot = _mm512_dpbusd_epi32(start, wu2[p], xv);
          acc_pair[r][p] = block32_step(acc_pair[r][p], dot, scale2[p], dx);
        }
        if constexpr (NR % 2) {
          const __m256i dot = _mm256_dpbusd_epi32(_mm512_castsi512_si256(start), wu_last, _mm512_castsi512_si256(xv));
          acc32[r][NR - 1] = block32_step(acc32[r][NR - 1], dot, Fmt::a8_scale(scales[NR - 1], 0), _mm512_castps512_ps256(dx));
        }
        if constexpr (Fmt::kHasMin) mins4[r] = _mm_add_ps(mins4[r], _mm_mul_ps(m_cols, _mm_set1_ps(row.ds[ab])));
      }
    } else
#endif
    if constexpr (Fmt::kA8Block == kA8Sub) {  // a float scale per 32 weights and per 32 activations
      typename Fmt::Scales scales[NR];
      __m256i wq[NR], wsign[NR];  // |q| for signed formats (the sign moves onto the activations)
#pragma GCC unroll 8
      for (int c = 0; c < NR; ++c) {
        Fmt::prepare(a.w + c * a.ldw + offset, scales[c]);
        wsign[c] = Fmt::quants32(a.w + c * a.ldw + offset, 0);
        wq[c] = Fmt::kSigned ? _mm256_sign_epi8(wsign[c], wsign[c]) : wsign[c];
      }
      const int64_t ab = kb / kA8Sub;
      [[maybe_unused]] const __m128 m_cols = min_cols<Fmt, NR>(scales);
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        const A8Row row(a.xq + r * a.ldxq, a.K);
        const __m256i xv = load32(row.q + kb);
        const __m256 dx = _mm256_set1_ps(row.d[ab]);
#pragma GCC unroll 8
        for (int c = 0; c < NR; ++c) {
          const __m256i dot = dot_u8_i8(wq[c], Fmt::kSigned ? _mm256_sign_epi8(xv, wsign[c]) : xv);
          acc32[r][c] = block32_step(acc32[r][c], dot, Fmt::a8_scale(scales[c], 0), dx);
        }
        if constexpr (Fmt::kHasMin) mins4[r] = _mm_add_ps(mins4[r], _mm_mul_ps(m_cols, _mm_set1_ps(row.ds[ab])));
      }
    } else {  // K-quants: integer sub-block scales, one fp32 update per 256
      typename Fmt::A8Scales scales[NR];
#pragma GCC unroll 8
      for (int c = 0; c < NR; ++c) Fmt::prepare_a8(a.w + c * a.ldw + offset, scales[c]);
#ifdef SG_A8_ZMM
      __m512i isum2[MR][NR];  // per output: 16 int32 lanes of scaled products, summed to its total below
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
        for (int c = 0; c < NR; ++c) isum2[r][c] = _mm512_setzero_si512();
#pragma GCC unroll 2
      for (int quad = 0; quad < kSubs / 4; ++quad) {  // 128 weights: sub-block pairs 2 quad, 2 quad + 1
        // dpbusd sums 4 byte products per int32 lane, each within int16 (|.| <= 4 * 63 * 127), so the
        // two pairs' lanes pack into one vector of int16 (exact) and ONE dpwssd applies the
        // sub-block scales: 3 multiply uops per 128 weights, where maddubs + dpwssd per pair take 4.
        // Columns outer, rows inner (x re-read from L1): MR * NR sums + one column's weights and
        // scales stay in the 32 registers, where all NR columns' would spill
        const uint8_t* xq = a.xq + kb + 4 * kA8Sub * quad;
        // where the dot products start: 0, or -kZmmOffset * (x sums per 4) so that each int32 lane is
        // (q - offset) . x exactly (|.| <= 4 * 32 * 127: the packs below do not saturate)
        __m512i start[MR][2];
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r)
#pragma GCC unroll 2
          for (int half = 0; half < 2; ++half) {
            start[r][half] = _mm512_setzero_si512();
            if constexpr (Fmt::kZmmOffset != 0) {
              const __m512i x = _mm512_loadu_si512((const void*)(xq + r * a.ldxq + 64 * half));
              start[r][half] = neg_offset_lane_sums(x, Fmt::kZmmOffset);
            }
          }
        const __m512i scale_index = quad_scale_index(quad, Fmt::kA8ScalePer16);
#pragma GCC unroll 8
        for (int c = 0; c < NR; ++c) {
          const __m512i w0 = Fmt::quants64(a.w + c * a.ldw + offset, 2 * quad);
          const __m512i w1 = Fmt::quants64(a.w + c * a.ldw + offset, 2 * quad + 1);
          const __m512i scale16 = _mm512_permutexvar_epi16(scale_index, _mm512_castsi256_si512(_mm256_load_si256((const __m256i*)scales[c].sc)));
#pragma GCC unroll 8
          for (int r = 0; r < MR; ++r) {
            const __m512i x0 = _mm512_loadu_si512((const void*)(xq + r * a.ldxq));
            const __m512i x1 = _mm512_loadu_si512((const void*)(xq + r * a.ldxq + 64));
            const __m512i products = _mm512_packs_epi32(_mm512_dpbusd_epi32(start[r][0], w0, x0), _mm512_dpbusd_epi32(start[r][1], w1, x1));
            isum2[r][c] = _mm512_dpwssd_epi32(isum2[r][c], products, scale16);
          }
        }
      }
      if constexpr (MR == 1) {  // one row: the 128-bit update costs less than a 16-lane tree of mostly zeros
        __m256i lanes[1][4];
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c)
          lanes[0][c] = c < NR ? _mm256_add_epi32(_mm512_castsi512_si256(isum2[0][c]), _mm512_extracti64x4_epi64(isum2[0][c], 1)) : _mm256_setzero_si256();
        k_quant_update_rows<Fmt, MR, NR>(lanes, scales, a, kb);
      } else {
        k_quant_update16<Fmt, MR, NR>(isum2, scales, a, kb);
      }
#else
      // per output: 8 int32 lanes of scaled products (which products a lane holds depends on the build's
      // pairing; their sum, the output's total, does not); columns past NR zero.
      // Columns outer, sub-blocks and rows inner: one column's MR sums, its quants and scales fit the 16
      // ymm registers (all MR x NR sums at once spilled every sub-block's products); x is re-read from L1.
      // Signed quants (Q6_K) as unsigned u = q + kQuantOffset (maddubs wants one unsigned side): the
      // sums run on u (|pair| <= 2 * 63 * 127, no saturation), then one madd per output and super-block
      // adds -offset * scale * (x's sum per 16-weight group): exactly the sums of (q - offset) . x
      constexpr int kOffset = Fmt::kQuantOffset;
      [[maybe_unused]] const int16_t* group_sums[MR];  // each row's x sums per 16 weights of this super-block
      if constexpr (kOffset != 0 && !rows_outer<Fmt>::value) {  // the column walk's offset term
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) group_sums[r] = A8Row(a.xq + r * a.ldxq, a.K).bsum16 + kb / 16;
      }
      __m256i lanes[MR][4];
      if constexpr (rows_outer<Fmt>::value) {  // the decoded scratch of many rows: all MR x NR sums per sub-block
        __m256i isum[MR][NR];
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
          for (int c = 0; c < NR; ++c) isum[r][c] = _mm256_setzero_si256();
#ifdef SG_A8_PAIRED
        // the scratch holds each sub-block pair interleaved with one scale vector (Decoded::decode): the
        // two halves' maddubs add in int16 (|.| <= 4 * 32 * 127 signed, 4 * 31 * 127 unsigned), one madd
        auto quants = [&](int c, int half) { return Fmt::quants32(a.w + c * a.ldw + offset, half); };
        auto products = [](__m256i w, __m256i x) {  // signed quants: |q| times x with q's sign
          return Fmt::kSigned ? _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w)) : _mm256_maddubs_epi16(w, x);
        };
#pragma GCC unroll 4
        for (int pair = 0; pair < kSubs / 2; ++pair) {
#pragma GCC unroll 8
          for (int r = 0; r < MR; ++r) {
            const uint8_t* xq = a.xq + r * a.ldxq + kb + 2 * kA8Sub * pair;
            const __m256i x0 = load32(xq), x1 = load32(xq + kA8Sub);
#pragma GCC unroll 8
            for (int c = 0; c < NR; ++c) {
              const __m256i pairs = _mm256_add_epi16(products(quants(c, 2 * pair), x0), products(quants(c, 2 * pair + 1), x1));
              isum[r][c] = scaled_pairs(isum[r][c], pairs, Fmt::a8_scale16(scales[c], 2 * pair));
            }
          }
        }
#else
#pragma GCC unroll 8
        for (int sub = 0; sub < kSubs; ++sub) {
          __m256i wq[NR], wsign[NR], scale16[NR];  // |q| for signed formats (the sign moves onto the activations)
#pragma GCC unroll 8
          for (int c = 0; c < NR; ++c) {
            wsign[c] = Fmt::quants32(a.w + c * a.ldw + offset, sub);
            wq[c] = Fmt::kSigned ? _mm256_sign_epi8(wsign[c], wsign[c]) : wsign[c];
            scale16[c] = Fmt::a8_scale16(scales[c], sub);
          }
#pragma GCC unroll 8
          for (int r = 0; r < MR; ++r) {
            const __m256i xv = load32(a.xq + r * a.ldxq + kb + kA8Sub * sub);
#pragma GCC unroll 8
            for (int c = 0; c < NR; ++c)
              isum[r][c] = scaled_pairs(isum[r][c], _mm256_maddubs_epi16(wq[c], Fmt::kSigned ? _mm256_sign_epi8(xv, wsign[c]) : xv), scale16[c]);
          }
        }
#endif
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
          for (int c = 0; c < 4; ++c) lanes[r][c] = c < NR ? isum[r][c] : _mm256_setzero_si256();
      }
#pragma GCC unroll 1
      for (int c = 0; c < (rows_outer<Fmt>::value ? 0 : 4); ++c) {
        __m256i isum[MR];
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) isum[r] = _mm256_setzero_si256();
        if (c < NR) {
          // sub-blocks 2p, 2p + 1 share one scale multiply: 3 multiplies per 64 weights and row where
          // maddubs + madd per sub-block take 4 (pair_scale16: the lanes of either step)
#pragma GCC unroll 4
          for (int pair = 0; pair < kSubs / 2; ++pair) {
            __m256i w0 = Fmt::quants32(a.w + c * a.ldw + offset, 2 * pair);
            __m256i w1 = Fmt::quants32(a.w + c * a.ldw + offset, 2 * pair + 1);
            if constexpr (kOffset != 0) {
              w0 = _mm256_add_epi8(w0, _mm256_set1_epi8(kOffset)), w1 = _mm256_add_epi8(w1, _mm256_set1_epi8(kOffset));
            }
#ifdef __AVXVNNI__
            // vpdpbusd sums 4 byte products per int32 lane, each within int16 (|.| <= 4 * 63 * 127), so
            // the two sub-blocks' lanes pack into one vector of int16 (exact) and ONE vpdpwssd scales both
            const __m256i scale16 = pair_scale16<Fmt, PairLanes::kPacked>(scales[c], pair);
#pragma GCC unroll 8
            for (int r = 0; r < MR; ++r) {
              const uint8_t* xq = a.xq + r * a.ldxq + kb + 2 * kA8Sub * pair;
              const __m256i products = _mm256_packs_epi32(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w0, load32(xq)),
                                                          _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w1, load32(xq + kA8Sub)));
              isum[r] = _mm256_dpwssd_avx_epi32(isum[r], products, scale16);
            }
#else  // SG_A8_PAIRED: the activations' pairs are interleaved (pair_sub_blocks), so are the weights
            const __m256i low = _mm256_unpacklo_epi16(w0, w1), high = _mm256_unpackhi_epi16(w0, w1);
            const __m256i scale16 = pair_scale16<Fmt, PairLanes::kInterleaved>(scales[c], pair);
#pragma GCC unroll 8
            for (int r = 0; r < MR; ++r) {
              const uint8_t* xq = a.xq + r * a.ldxq + kb + 2 * kA8Sub * pair;
              const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(low, load32(xq)), _mm256_maddubs_epi16(high, load32(xq + kA8Sub)));
              isum[r] = scaled_pairs(isum[r], pairs, scale16);
            }
#endif
          }
          if constexpr (kOffset != 0) {  // a scale per 16 weights (Q6_K), -offset * scale fits int16
            const __m256i neg_offset_scales = _mm256_mullo_epi16(_mm256_load_si256((const __m256i*)scales[c].sc), _mm256_set1_epi16((short)-kOffset));
#pragma GCC unroll 8
            for (int r = 0; r < MR; ++r)
              isum[r] = scaled_pairs(isum[r], _mm256_loadu_si256((const __m256i*)group_sums[r]), neg_offset_scales);
          }
        }
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) lanes[r][c] = isum[r];
      }
      k_quant_update_rows<Fmt, MR, NR>(lanes, scales, a, kb);
#endif
    }
  }
  if constexpr (kBlock32) {
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
      for (int c = 0; c < NR; ++c) {
        if (kZmmPairs && c < 2 * kPairs) {
          if (c % 2 == 0) store_pair(r, c);
        } else {
          _mm256_storeu_ps(acc_of(r, c), acc32[r][c]);
        }
      }
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) _mm_storeu_ps(mins_of(r), mins4[r]);
  }
  if (a.k_end < a.K) return;  // the sums stay parked in a.saved
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < NR; ++c) {
      float value;
      if constexpr (Fmt::kA8Block == kA8Sub) {
        value = hsum256(_mm256_loadu_ps(acc_of(r, c)));
        if constexpr (Fmt::kHasMin) value += mins_of(r)[c];
      } else {
        value = saved[4 * r + c];  // K-quants: one float per output, min terms included
      }
      if (a.bias) value += a.bias[c];
      a.y[r * a.ldy + c] = value;
    }
}

template <typename Fmt, std::size_t... I>
constexpr std::array<tile_fn, sizeof...(I)> a8_tiles_table(std::index_sequence<I...>) {
  return {a8_tile<Fmt, (int)(I / kColsPerTile) + 1, (int)(I % kColsPerTile) + 1>...};
}

}  // namespace

template <typename Fmt>
struct Tiles<Fmt, true> {
  static constexpr auto kTable = a8_tiles_table<Fmt>(std::make_index_sequence<kMaxRowsPerTile * kColsPerTile>{});
  static tile_fn pick(int mr, int nr) { return kTable[(mr - 1) * kColsPerTile + (nr - 1)]; }
};

// a8 mode, K-quants (Q4_K, Q5_K, Q6_K): per 256 weights the integer sub-block scales and the quant
// vectors exactly as a8_tile builds them from the block (AVX2 build: also the int16 scale vectors)
struct DecodedKQuantBlock {
  float d, dmin;
  alignas(16) int16_t m[8];
  alignas(32) int16_t sc[16];
  alignas(64) uint8_t quants[256];   // quants64 per pair (zmm build) or quants32 per sub-block
#ifndef SG_A8_ZMM
  alignas(64) uint8_t scale16[256];  // a8_scale16 per sub-block
#endif
};
struct DecodedKQuantScales {  // what a8_tile reads of Fmt::A8Scales, pointing into the block
  float d, dmin;
  const int16_t* m;
  const int16_t* sc;
  const uint8_t* scale16;
};
template <typename Fmt>
struct DecodedKQuantA8 {  // a8_tile's view of a DecodedKQuantBlock
  static constexpr int kBlock = 256, kBytes = sizeof(DecodedKQuantBlock);
  static constexpr bool kTail = false, kSigned = Fmt::kSigned, kHasMin = Fmt::kHasMin;
  static constexpr int kA8Block = 256, kQuantOffset = Fmt::kQuantOffset;
  static constexpr bool kRowsOuter = true, kA8ScalePer16 = Fmt::kA8ScalePer16;
  using A8Scales = DecodedKQuantScales;
  static const DecodedKQuantBlock& of(const uint8_t* b) { return *(const DecodedKQuantBlock*)b; }
  static __m256i quants32(const uint8_t* b, int sub) { return _mm256_load_si256((const __m256i*)(of(b).quants + 32 * sub)); }
#ifdef SG_A8_ZMM
  static void prepare_a8(const uint8_t* b, A8Scales& s) { s = {of(b).d, of(b).dmin, of(b).m, of(b).sc, nullptr}; }
  static constexpr int kZmmOffset = Fmt::kZmmOffset;
  static __m512i quants64(const uint8_t* b, int pair) { return _mm512_load_si512((const void*)(of(b).quants + 64 * pair)); }
#else
  static void prepare_a8(const uint8_t* b, A8Scales& s) { s = {of(b).d, of(b).dmin, of(b).m, of(b).sc, of(b).scale16}; }
  static __m256i a8_scale16(const A8Scales& s, int sub) { return _mm256_load_si256((const __m256i*)(s.scale16 + 32 * sub)); }
#endif
};
template <typename Fmt>
struct Decoded<Fmt, true, std::enable_if_t<Fmt::kA8Block == 256>> {
  static constexpr bool kAvailable = true;
  using Tile = DecodedKQuantA8<Fmt>;
  static constexpr int64_t kBlockBytes = sizeof(DecodedKQuantBlock);
  static constexpr int64_t kMinBlocks = Fmt::kA8DecodeOnceMinBlocks;
  static void decode(const uint8_t* block, uint8_t* out) {
    DecodedKQuantBlock& d = *(DecodedKQuantBlock*)out;
    typename Fmt::A8Scales scales;
    Fmt::prepare_a8(block, scales);
    d.d = scales.d, d.dmin = scales.dmin;
    std::memcpy(d.m, scales.m, sizeof d.m);
    std::memcpy(d.sc, scales.sc, sizeof d.sc);
#ifdef SG_A8_ZMM
#pragma GCC unroll 4
    for (int pair = 0; pair < 4; ++pair) _mm512_store_si512((void*)(d.quants + 64 * pair), Fmt::quants64(block, pair));
#elif defined(SG_A8_PAIRED)  // the activations' order (pair_sub_blocks): each pair interleaved, one scale vector
#pragma GCC unroll 4
    for (int pair = 0; pair < 4; ++pair) {
      const __m256i qa = Fmt::quants32(block, 2 * pair), qb = Fmt::quants32(block, 2 * pair + 1);
      const __m256i scale16 = pair_scale16<Fmt, PairLanes::kInterleaved>(scales, pair);
      _mm256_store_si256((__m256i*)(d.quants + 64 * pair), _mm256_unpacklo_epi16(qa, qb));
      _mm256_store_si256((__m256i*)(d.quants + 64 * pair + 32), _mm256_unpackhi_epi16(qa, qb));
      _mm256_store_si256((__m256i*)(d.scale16 + 64 * pair), scale16);
      _mm256_store_si256((__m256i*)(d.scale16 + 64 * pair + 32), scale16);
    }
#else
#pragma GCC unroll 8
    for (int sub = 0; sub < 8; ++sub) {
      _mm256_store_si256((__m256i*)(d.quants + 32 * sub), Fmt::quants32(block, sub));
      _mm256_store_si256((__m256i*)(d.scale16 + 32 * sub), Fmt::a8_scale16(scales, sub));
    }
#endif
  }
};

// a8 mode, 32-weight formats (Q4_0, Q4_1, Q5_0, Q8_0): the block's scales and its 32 quants
// zmm build (VNNI): two columns per zmm. vpdpbusd wants unsigned bytes on one side and AVX-512 has
// no vpsignb, so signed formats take x + 128 (x ^ 0x80) times the signed quants and start each
// int32 lane from -128 * (the lane's 4 quants summed), stored with the block: every int32 lane is
// again exactly the lane's x . q, and the float steps that follow are those of the 256-bit code.
template <typename Fmt>
struct DecodedBlock32A8 {  // a8_tile's view of a decoded block: Scales, the quants at byte 32 (zmm: -128 * sums at 64)
#ifdef SG_A8_ZMM
  static constexpr int kBlock = 32, kBytes = 96;
  static constexpr bool kPairColumns = true;
  static __m256i neg_offset_sums(const uint8_t* b) { return _mm256_load_si256((const __m256i*)(b + 64)); }
#else
  static constexpr int kBlock = 32, kBytes = 64;
  static constexpr bool kPairColumns = false;
#endif
  static_assert(sizeof(typename Fmt::Scales) <= 32, "the scales fit before the quants");
  static constexpr bool kTail = false, kSigned = Fmt::kSigned, kHasMin = Fmt::kHasMin;
  static constexpr int kA8Block = 32;
  using Scales = typename Fmt::Scales;
  static void prepare(const uint8_t* b, Scales& s) { std::memcpy(&s, b, sizeof s); }
  static __m256i quants32(const uint8_t* b, int) { return _mm256_load_si256((const __m256i*)(b + 32)); }
  static __m256 a8_scale(const Scales& s, int sub) { return Fmt::a8_scale(s, sub); }
  static float a8_min(const Scales& s, int sub) { return Fmt::a8_min(s, sub); }
};
template <typename Fmt>
struct Decoded<Fmt, true, std::enable_if_t<Fmt::kA8Block == 32>> {
  static constexpr bool kAvailable = true;
  using Tile = DecodedBlock32A8<Fmt>;
  static constexpr int64_t kBlockBytes = Tile::kBytes;
  static constexpr int64_t kMinBlocks = Fmt::kA8DecodeOnceMinBlocks;
  static void decode(const uint8_t* block, uint8_t* out) {
    typename Fmt::Scales scales;
    Fmt::prepare(block, scales);
    std::memcpy(out, &scales, sizeof scales);
    const __m256i quants = Fmt::quants32(block, 0);
    _mm256_store_si256((__m256i*)(out + 32), quants);
#ifdef SG_A8_ZMM
    const __m256i offset_sums = _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_set1_epi8((char)0x80), quants);  // 128 * sums
    _mm256_store_si256((__m256i*)(out + 64), _mm256_sub_epi32(_mm256_setzero_si256(), offset_sums));
#endif
  }
};

template <typename Fmt>
tiles_fn a8_tiles() {
  return run_tiles<Fmt, true>;
}
#define SG_INSTANTIATE(type_id, Fmt) template tiles_fn a8_tiles<Fmt>();
SG_GGUF_FORMATS(SG_INSTANTIATE)
#undef SG_INSTANTIATE

}  // namespace sg

using namespace sg;

extern "C" {

// int8-activation mode: y = sum over blocks of (weight scale * d) * (int8 q . weight quants)
// (+ min terms, + bias), x quantized per block of 32 first (see quantize_a8_row). Shapes as
// sg_linear_gguf. Batch invariant, and the same bits on AVX2 and AVX-512.
int sg_linear_gguf_a8(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, int ggml_type,
                      const float* bias, float* y, int num_threads) {
  const BlockFormat* f = find_block_format(ggml_type);
  if (!f || !f->run_tiles_a8 || K % f->block) return 1;
  int status;
  if (bad_shape(x, M, K, w, N, y, &status)) return status;
  std::vector<uint8_t> xq((size_t)(M * a8_row_bytes(K)));  // [M, a8_row_bytes(K)]
  quantize_a8_rows(x, M, K, f->a8_block, xq.data());
#ifdef SG_A8_PAIRED
  if (f->a8_block == 256)  // the K-quant tiles' order
    for (int64_t i = 0; i < M; ++i) pair_sub_blocks(xq.data() + i * a8_row_bytes(K), K);
#endif
  LinearJob job{x, M, K, w, K / f->block * f->bytes, nullptr, N, bias, y, 0, 0, f->run_tiles_a8};
  job.xq = xq.data();
#ifdef SG_AMX
  if (amx_applies(*f, ggml_type, M)) return run_amx_linear(job, *f, ggml_type, num_threads);
#endif
  return run_linear(job, num_threads);
}

// Bytes of one quantized activation row of K (K a multiple of 32), else 0.
int64_t sg_a8_row_bytes(int64_t K) { return K > 0 && K % kA8Sub == 0 ? a8_row_bytes(K) : 0; }

// Activation block (32 or 256) the a8 kernel uses with weights of `ggml_type`, or 0.
int sg_a8_block(int ggml_type) {
  const BlockFormat* f = find_block_format(ggml_type);
  return f ? f->a8_block : 0;
}

// x [M, K] fp32 -> out [M, sg_a8_row_bytes(K)]: the activation rows the a8 kernel computes on,
// in blocks of `block` (32 or 256; K a multiple of it).
int sg_quantize_a8(const float* x, int64_t M, int64_t K, int block, uint8_t* out) {
  if (M < 0 || K <= 0 || (block != 32 && block != 256) || K % block || (M > 0 && (!x || !out))) return 1;
  quantize_a8_rows(x, M, K, block, out);
  return 0;
}

// 1 when the integer dot products use VNNI (vpdpbusd: AVX-512 VNNI, or AVX-VNNI on 256 bits), 0 for AVX2
// maddubs; same results either way.
int sg_a8_vnni() {
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
  return 1;
#else
  return 0;
#endif
}

}  // extern "C"
