// The interleaved a8 K-quant tiles on the 256-bit builds (AVX2, AVX2 + AVX-VNNI; AVX-512 without
// VNNI), 8 columns per ymm (a8_interleaved.cpp includes this inside its namespace; the layout and
// the bits are described there). The products are vpmaddubsw pairs (2 products per int16 lane) and
// the scales one vpmaddwd (AVX2) or vpdpwssd (VNNI) with (sc, sc) per column (scaled_pairs):
//   Q4_K: a sub-block's 8 pairs per lane add in int16 (|.| <= 16 * 15 * 127), one scale step per
//     sub-block and row: 8 + 7 + 1 (+1) instructions per 32 weights x 8 columns;
//   Q6_K: u = q + 32 up to 63, so two pairs per lane at most (2 * 2 * 63 * 127 < 2^15): a scale
//     step per 8 weights; the offset -32 sc x bsum16 is one step per sub-block and row.

inline __m256i bcast4(const void* p) { return _mm256_set1_epi32(*(const int32_t*)p); }

// rows' results: acc (+ bias) into the groups' existing columns (only the last group may be partial)
template <int MR, int NG>
inline void store_rows(const __m256 (&acc)[NG][MR], const Args& a) {
#pragma GCC unroll 2
  for (int g = 0; g < NG; ++g) {
    const int n = g + 1 < NG ? kCols : a.n_cols;
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) {
      float* y = a.y + r * a.ldy + kCols * g;
      if (n == kCols) {
        _mm256_storeu_ps(y, a.bias ? _mm256_add_ps(acc[g][r], _mm256_loadu_ps(a.bias + kCols * g)) : acc[g][r]);
      } else {
        alignas(32) float lanes[kCols];
        _mm256_store_ps(lanes, acc[g][r]);
        for (int c = 0; c < n; ++c) y[c] = a.bias ? lanes[c] + a.bias[kCols * g + c] : lanes[c];
      }
    }
  }
}

struct Q4KTiles : Q4KLayout {
  template <int MR, int NG>
  static void tile(const Args& a) {
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    const TileRows<MR> rows(a);
    __m256 acc[NG][MR] = {};  // zeros
    for (int64_t kb = 0; kb < a.blocks; ++kb) {
      const uint8_t* t[NG];
      group_tiles<kTileBytes>(a, kb, t);
      __m256i total[NG][MR] = {};  // zeros
#pragma GCC unroll 1
      for (int s = 0; s < 8; ++s) {
#pragma GCC unroll 2
        for (int g = 0; g < NG; ++g) {
          // (sc, sc) int16 pairs per column: each int16 lane of the sums holds 2 products of one column
          const __m256i sc32 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(t[g] + kScales + kCols * s)));
          const __m256i sc = _mm256_or_si256(sc32, _mm256_slli_epi32(sc32, 16));
          __m256i sum16[MR];
#pragma GCC unroll 4
          for (int r = 0; r < MR; ++r) sum16[r] = _mm256_setzero_si256();
          const uint8_t* qs = t[g] + kHeadBytes + kSubBytes * s;
          if constexpr (NG == 1) prefetch_ahead<kTileBytes>(t[g], s);
#pragma GCC unroll 4
          for (int j = 0; j < 4; ++j) {
            const __m256i packed = _mm256_load_si256((const __m256i*)(qs + 32 * j));
            const __m256i w_lo = _mm256_and_si256(packed, low4), w_hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low4);
            const int64_t k = 256 * kb + 32 * s + 4 * j;
#pragma GCC unroll 4
            for (int r = 0; r < MR; ++r)
              sum16[r] = _mm256_add_epi16(sum16[r], _mm256_add_epi16(_mm256_maddubs_epi16(w_lo, bcast4(rows.q[r] + k)),
                                                                     _mm256_maddubs_epi16(w_hi, bcast4(rows.q[r] + k + 16))));
          }
#pragma GCC unroll 4
          for (int r = 0; r < MR; ++r) total[g][r] = scaled_pairs(total[g][r], sum16[r], sc);
        }
      }
#pragma GCC unroll 2
      for (int g = 0; g < NG; ++g) {
        const __m256 d_w = _mm256_cvtph_ps(_mm_load_si128((const __m128i*)t[g]));
        const __m256 dmin_w = _mm256_cvtph_ps(_mm_load_si128((const __m128i*)(t[g] + 2 * kCols)));
        __m256i m_pairs[4];
#pragma GCC unroll 4
        for (int p = 0; p < 4; ++p) m_pairs[p] = _mm256_cvtepu8_epi16(_mm_load_si128((const __m128i*)(t[g] + kMins + 2 * kCols * p)));
#pragma GCC unroll 4
        for (int r = 0; r < MR; ++r) {
          const __m256 dxv = _mm256_set1_ps(rows.dx[r][kb]);
          acc[g][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total[g][r]), _mm256_mul_ps(d_w, dxv), acc[g][r]);
          __m256i msum = _mm256_setzero_si256();
#pragma GCC unroll 4
          for (int p = 0; p < 4; ++p) msum = _mm256_add_epi32(msum, _mm256_madd_epi16(m_pairs[p], bcast4(rows.bsum[r] + 8 * kb + 2 * p)));
          acc[g][r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_mul_ps(dmin_w, dxv), acc[g][r]);
        }
      }
    }
    store_rows<MR, NG>(acc, a);
  }
};

struct Q6KTiles : Q6KLayout {
  // bits 2j, 2j + 1 of each byte moved to bits 4, 5 (what lands elsewhere is masked off)
  static __m256i high_bits_of(__m256i h, int j) { return j < 2 ? _mm256_slli_epi16(h, 4 - 2 * j) : _mm256_srli_epi16(h, 2 * j - 4); }

  template <int MR, int NG>
  static void tile(const Args& a) {
    const __m256i low4 = _mm256_set1_epi8(0x0f), bits45 = _mm256_set1_epi8(0x30), low16 = _mm256_set1_epi32(0xffff);
    const TileRows<MR> rows(a);
    __m256 acc[NG][MR] = {};  // zeros
    for (int64_t kb = 0; kb < a.blocks; ++kb) {
      const uint8_t* t[NG];
      group_tiles<kTileBytes>(a, kb, t);
      __m256i total[NG][MR] = {};  // zeros
#pragma GCC unroll 1
      for (int s = 0; s < 8; ++s) {
#pragma GCC unroll 2
        for (int g = 0; g < NG; ++g) {
          // int16 lanes (sc_a, sc_b) per column, then each duplicated: (sc_a, sc_a) and (sc_b, sc_b)
          const __m256i sc_pairs = _mm256_cvtepi8_epi16(_mm_load_si128((const __m128i*)(t[g] + kScales + 2 * kCols * s)));
          const __m256i sc_a = _mm256_or_si256(_mm256_slli_epi32(sc_pairs, 16), _mm256_and_si256(sc_pairs, low16));
          const __m256i sc_b = _mm256_or_si256(_mm256_srli_epi32(sc_pairs, 16), _mm256_andnot_si256(low16, sc_pairs));
          // the quants' offset: -32 sc per group times the activations' sums per 16 (|32 sc| <= 4096)
          const __m256i offset_pairs = _mm256_sub_epi16(_mm256_setzero_si256(), _mm256_slli_epi16(sc_pairs, 5));
#pragma GCC unroll 4
          for (int r = 0; r < MR; ++r) total[g][r] = scaled_pairs(total[g][r], offset_pairs, bcast4(rows.bsum16[r] + 16 * kb + 2 * s));
          const uint8_t* qs = t[g] + kHeadBytes + kSubBytes * s;
          const __m256i high_a = _mm256_load_si256((const __m256i*)(qs + kHighA)), high_b = _mm256_load_si256((const __m256i*)(qs + kHighB));
          if constexpr (NG == 1) prefetch_ahead<kTileBytes>(t[g], s);
#pragma GCC unroll 2
          for (int jp = 0; jp < 2; ++jp) {  // quants 4 j .. 4 j + 3 for j = 2 jp, 2 jp + 1: one scale step
            __m256i u_a[2], u_b[2];
#pragma GCC unroll 2
            for (int h = 0; h < 2; ++h) {
              const int j = 2 * jp + h;
              const __m256i packed = _mm256_load_si256((const __m256i*)(qs + 32 * j));
              u_a[h] = _mm256_or_si256(_mm256_and_si256(packed, low4), _mm256_and_si256(high_bits_of(high_a, j), bits45));
              u_b[h] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(packed, 4), low4), _mm256_and_si256(high_bits_of(high_b, j), bits45));
            }
            const int64_t k = 256 * kb + 32 * s + 8 * jp;
#pragma GCC unroll 4
            for (int r = 0; r < MR; ++r) {
              const __m256i pairs_a = _mm256_add_epi16(_mm256_maddubs_epi16(u_a[0], bcast4(rows.q[r] + k)), _mm256_maddubs_epi16(u_a[1], bcast4(rows.q[r] + k + 4)));
              const __m256i pairs_b = _mm256_add_epi16(_mm256_maddubs_epi16(u_b[0], bcast4(rows.q[r] + k + 16)), _mm256_maddubs_epi16(u_b[1], bcast4(rows.q[r] + k + 20)));
              total[g][r] = scaled_pairs(scaled_pairs(total[g][r], pairs_a, sc_a), pairs_b, sc_b);
            }
          }
        }
      }
#pragma GCC unroll 2
      for (int g = 0; g < NG; ++g) {
        const __m256 d_w = _mm256_cvtph_ps(_mm_load_si128((const __m128i*)t[g]));
#pragma GCC unroll 4
        for (int r = 0; r < MR; ++r)
          acc[g][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total[g][r]), _mm256_mul_ps(d_w, _mm256_set1_ps(rows.dx[r][kb])), acc[g][r]);
      }
    }
    store_rows<MR, NG>(acc, a);
  }
};

// 32-weight formats, 8 columns per ymm: per row, block and 4 weights the byte products from the
// row's lane start (dot_u8_i8: vpdpbusd with VNNI, else vpmaddubsw + vpmaddwd, exact for u <= 31:
// Block32Layout), a convert and an fma into that lane's accumulator.

template <typename Fmt>
struct Block32Tiles : Block32Layout<Fmt> {
  using L = Block32Layout<Fmt>;
  // the 8 weight vectors of a block, unpacked once for every row of the tile
  static void unpack(const uint8_t* quants, __m256i (&u)[8]) {
    [[maybe_unused]] const __m256i low4 = _mm256_set1_epi8(0x0f), sixteen = _mm256_set1_epi8(16);
#pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) {  // weights 4p.. and 4(p + 4).. of every column
      if constexpr (L::kNibbles) {
        const __m256i packed = _mm256_load_si256((const __m256i*)(quants + 32 * p));
        u[p] = _mm256_and_si256(packed, low4), u[p + 4] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low4);
        if constexpr (L::kFifthBit) {
          const uint32_t* bits = (const uint32_t*)(quants + L::kQuantBytes);
          u[p] = _mm256_or_si256(u[p], _mm256_and_si256(bits_to_bytes32(bits[p]), sixteen));
          u[p + 4] = _mm256_or_si256(u[p + 4], _mm256_and_si256(bits_to_bytes32(bits[p + 4]), sixteen));
        }
      } else {
        u[p] = _mm256_load_si256((const __m256i*)(quants + 32 * p)), u[p + 4] = _mm256_load_si256((const __m256i*)(quants + 32 * (p + 4)));
      }
    }
  }
  // The rows' 8 accumulators each live in memory (16 ymm registers hold the weights and one row's
  // work), so the unpacking is shared by every row of the tile.
  template <int MR, int NG>
  static void tile(const Args& a) {
    static_assert(NG == 1, "the 32-weight tiles walk one column group");
    const TileRows<MR> rows(a);
    alignas(32) float acc[MR][8][kCols] = {}, mins[MR][kCols] = {};  // zeros
    const uint8_t* t = a.group;
    for (int64_t kb = 0; kb < a.blocks; ++kb, t += L::kTileBytes) {
#pragma GCC unroll 16
      for (int64_t l = 0; l < L::kTileBytes; l += 64) _mm_prefetch((const char*)(t + kPrefetch * L::kTileBytes + l), _MM_HINT_T0);
      __m256i u[8];
      unpack(t + L::kHeadBytes, u);
      const __m256 d_w = _mm256_cvtph_ps(_mm_load_si128((const __m128i*)t));
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r) {
        const __m256 scale = _mm256_mul_ps(d_w, _mm256_set1_ps(rows.dx[r][kb]));
        const int32_t* start = a.starts ? a.starts + r * (a.K / 4) + 8 * kb : nullptr;
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) {
          const __m256i lane_start = L::kOffset ? _mm256_set1_epi32(start[j]) : _mm256_setzero_si256();
          const __m256i dot = dot_u8_i8(u[j], bcast4(rows.q[r] + 32 * kb + 4 * j), lane_start);
          _mm256_store_ps(acc[r][j], _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, _mm256_load_ps(acc[r][j])));
        }
        if constexpr (L::kHasMin) {
          const __m256 m_w = _mm256_cvtph_ps(_mm_load_si128((const __m128i*)(t + 2 * kCols)));
          _mm256_store_ps(mins[r], _mm256_add_ps(_mm256_load_ps(mins[r]), _mm256_mul_ps(m_w, _mm256_set1_ps(rows.ds[r][kb]))));
        }
      }
    }
    __m256 out[1][MR];
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) {  // hsum256's tree over the 8 lanes, then the min terms
      auto lane = [&](int j) { return _mm256_load_ps(acc[r][j]); };
      const __m256 even = _mm256_add_ps(_mm256_add_ps(lane(0), lane(4)), _mm256_add_ps(lane(2), lane(6)));
      const __m256 odd = _mm256_add_ps(_mm256_add_ps(lane(1), lane(5)), _mm256_add_ps(lane(3), lane(7)));
      out[0][r] = _mm256_add_ps(even, odd);
      if constexpr (L::kHasMin) out[0][r] = _mm256_add_ps(out[0][r], _mm256_load_ps(mins[r]));
    }
    store_rows<MR, 1>(out, a);
  }
};
