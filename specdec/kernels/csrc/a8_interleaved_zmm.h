// The interleaved a8 K-quant tiles on AVX-512 VNNI, 16 columns per zmm (a8_interleaved.cpp includes
// this inside its namespace; the layout and the bits are described there).
//   Q4_K: per row, 32 weights x 16 columns cost 8 vpdpbusd (low and high nibbles into two sums, each
//     lane |.| <= 16 * 15 * 127 < 2^15) and 2 vpdpwssd with the sub-block scale as (sc, 0) pairs;
//   Q6_K: 4 products of 63 x 127 fit int16 but 16 do not, so vpmaddubsw + vpdpwssd with (sc, sc)
//     per 4 weights; the offset -32 sc x bsum16 is one vpdpwssd per sub-block and row.

inline __m512i bcast4(const void* p) { return _mm512_set1_epi32(*(const int32_t*)p); }

// rows' results: acc (+ bias) into the groups' existing columns (only the last group may be partial)
template <int MR, int NG>
inline void store_rows(const __m512 (&acc)[NG][MR], const Args& a) {
#pragma GCC unroll 2
  for (int g = 0; g < NG; ++g) {
    const __mmask16 keep = g + 1 < NG ? (__mmask16)0xFFFF : (__mmask16)((1u << a.n_cols) - 1);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      __m512 value = acc[g][r];
      if (a.bias) value = _mm512_add_ps(value, _mm512_maskz_loadu_ps(keep, a.bias + kCols * g));
      _mm512_mask_storeu_ps(a.y + r * a.ldy + kCols * g, keep, value);
    }
  }
}

struct Q4KTiles : Q4KLayout {
  template <int MR, int NG>
  static void tile(const Args& a) {
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    const TileRows<MR> rows(a);
    __m512 acc[NG][MR] = {};  // zeros
    for (int64_t kb = 0; kb < a.blocks; ++kb) {
      const uint8_t* t[NG];
      group_tiles<kTileBytes>(a, kb, t);
      __m512i total[NG][MR] = {};  // zeros
#pragma GCC unroll 1
      for (int s = 0; s < 8; ++s) {
#pragma GCC unroll 2
        for (int g = 0; g < NG; ++g) {
          // (sc, 0) int16 pairs: vpdpwssd of an int32 lane (|.| <= 16 * 15 * 127 < 2^15: its low int16) times sc
          const __m512i sc = _mm512_cvtepu8_epi32(_mm_load_si128((const __m128i*)(t[g] + kScales + 16 * s)));
          __m512i lo[MR], hi[MR];
#pragma GCC unroll 8
          for (int r = 0; r < MR; ++r) lo[r] = _mm512_setzero_si512(), hi[r] = _mm512_setzero_si512();
          const uint8_t* qs = t[g] + kHeadBytes + kSubBytes * s;
          if constexpr (NG == 1) prefetch_ahead<kTileBytes>(t[g], s);
#pragma GCC unroll 4
          for (int j = 0; j < 4; ++j) {
            const __m512i packed = _mm512_load_si512((const void*)(qs + 64 * j));
            const __m512i w_lo = _mm512_and_si512(packed, low4), w_hi = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low4);
            const int64_t k = 256 * kb + 32 * s + 4 * j;
#pragma GCC unroll 8
            for (int r = 0; r < MR; ++r) {
              lo[r] = _mm512_dpbusd_epi32(lo[r], w_lo, bcast4(rows.q[r] + k));
              hi[r] = _mm512_dpbusd_epi32(hi[r], w_hi, bcast4(rows.q[r] + k + 16));
            }
          }
#pragma GCC unroll 8
          for (int r = 0; r < MR; ++r) total[g][r] = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(total[g][r], lo[r], sc), hi[r], sc);
        }
      }
#pragma GCC unroll 2
      for (int g = 0; g < NG; ++g) {
        const __m512 d_w = _mm512_cvtph_ps(_mm256_load_si256((const __m256i*)t[g]));
        const __m512 dmin_w = _mm512_cvtph_ps(_mm256_load_si256((const __m256i*)(t[g] + 2 * kCols)));
        __m512i m_pairs[4];
#pragma GCC unroll 4
        for (int p = 0; p < 4; ++p) m_pairs[p] = _mm512_cvtepu8_epi16(_mm256_load_si256((const __m256i*)(t[g] + kMins + 32 * p)));
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) {
          const __m512 dxv = _mm512_set1_ps(rows.dx[r][kb]);
          acc[g][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total[g][r]), _mm512_mul_ps(d_w, dxv), acc[g][r]);
          __m512i msum = _mm512_setzero_si512();
#pragma GCC unroll 4
          for (int p = 0; p < 4; ++p) msum = _mm512_dpwssd_epi32(msum, m_pairs[p], bcast4(rows.bsum[r] + 8 * kb + 2 * p));
          acc[g][r] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(msum), _mm512_mul_ps(dmin_w, dxv), acc[g][r]);
        }
      }
    }
    store_rows<MR, NG>(acc, a);
  }
};

struct Q6KTiles : Q6KLayout {
  // bits 2j, 2j + 1 of each byte moved to bits 4, 5 (what lands elsewhere is masked off)
  static __m512i high_bits_of(__m512i h, int j) { return j < 2 ? _mm512_slli_epi16(h, 4 - 2 * j) : _mm512_srli_epi16(h, 2 * j - 4); }

  template <int MR, int NG>
  static void tile(const Args& a) {
    const __m512i low4 = _mm512_set1_epi8(0x0f), bits45 = _mm512_set1_epi8(0x30), low16 = _mm512_set1_epi32(0xffff);
    const TileRows<MR> rows(a);
    __m512 acc[NG][MR] = {};  // zeros
    // the b groups' products in a second sum where registers allow: two chains of dependent
    // vpdpwssd (latency ~5 each) instead of one, which alone bounds a row or two
    constexpr bool kTwoChains = MR * NG <= 4;
    for (int64_t kb = 0; kb < a.blocks; ++kb) {
      const uint8_t* t[NG];
      group_tiles<kTileBytes>(a, kb, t);
      __m512i total[NG][MR] = {}, total_b[NG][MR] = {};  // zeros
#pragma GCC unroll 1
      for (int s = 0; s < 8; ++s) {
#pragma GCC unroll 2
        for (int g = 0; g < NG; ++g) {
          // int16 lanes (sc_a, sc_b) per column: the scales of the sub-block's two 16-weight groups
          const __m512i sc_pairs = _mm512_cvtepi8_epi16(_mm256_load_si256((const __m256i*)(t[g] + kScales + 32 * s)));
          // (sc, sc) per column: a 4-quant product pair (|.| <= 4 * 63 * 127, int16) per int16 lane
          const __m512i sc_a = _mm512_ternarylogic_epi32(_mm512_slli_epi32(sc_pairs, 16), sc_pairs, low16, 0xF8);  // A | (B & C)
          const __m512i sc_b = _mm512_ternarylogic_epi32(_mm512_srli_epi32(sc_pairs, 16), sc_pairs, ~low16, 0xF8);
          // the quants' offset: -32 sc per group times the activations' sums per 16 (|32 sc| <= 4096)
          const __m512i offset_pairs = _mm512_sub_epi16(_mm512_setzero_si512(), _mm512_slli_epi16(sc_pairs, 5));
#pragma GCC unroll 8
          for (int r = 0; r < MR; ++r) total[g][r] = _mm512_dpwssd_epi32(total[g][r], offset_pairs, bcast4(rows.bsum16[r] + 16 * kb + 2 * s));
          const uint8_t* qs = t[g] + kHeadBytes + kSubBytes * s;
          if constexpr (NG == 1) prefetch_ahead<kTileBytes>(t[g], s);
          const __m512i high_a = _mm512_load_si512((const void*)(qs + kHighA)), high_b = _mm512_load_si512((const void*)(qs + kHighB));
#pragma GCC unroll 4
          for (int j = 0; j < 4; ++j) {
            const __m512i packed = _mm512_load_si512((const void*)(qs + 64 * j));
            const __m512i u_a = _mm512_ternarylogic_epi32(_mm512_and_si512(packed, low4), high_bits_of(high_a, j), bits45, 0xF8);
            const __m512i u_b = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi16(packed, 4), low4), high_bits_of(high_b, j), bits45, 0xF8);
            const int64_t k = 256 * kb + 32 * s + 4 * j;
#pragma GCC unroll 8
            for (int r = 0; r < MR; ++r) {
              total[g][r] = _mm512_dpwssd_epi32(total[g][r], _mm512_maddubs_epi16(u_a, bcast4(rows.q[r] + k)), sc_a);
              __m512i& sum_b = kTwoChains ? total_b[g][r] : total[g][r];
              sum_b = _mm512_dpwssd_epi32(sum_b, _mm512_maddubs_epi16(u_b, bcast4(rows.q[r] + k + 16)), sc_b);
            }
          }
        }
      }
#pragma GCC unroll 2
      for (int g = 0; g < NG; ++g) {
        const __m512 d_w = _mm512_cvtph_ps(_mm256_load_si256((const __m256i*)t[g]));
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r)
          acc[g][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(total[g][r], total_b[g][r])),
                                      _mm512_mul_ps(d_w, _mm512_set1_ps(rows.dx[r][kb])), acc[g][r]);
      }
    }
    store_rows<MR, NG>(acc, a);
  }
};

// 32-weight formats, 16 columns per zmm: per row, block and 4 weights one vpdpbusd (its start the
// row's lane start), a convert and an fma into that lane's accumulator; two rows per pass share the
// unpacked weight vectors (a nibble split, Q5_0's fifth bits a masked add; 8 accumulators per row: 16
// of the 32 zmm registers).
template <typename Fmt>
struct Block32Tiles : Block32Layout<Fmt> {
  using L = Block32Layout<Fmt>;
  template <int RB>
  static void pass(Args a, int r0) {  // rows r0 .. r0 + RB - 1
    a.xq += r0 * a.ldxq, a.y += r0 * a.ldy;
    if (a.starts) a.starts += r0 * (a.K / 4);
    const TileRows<RB> rows(a);
    __m512 acc[RB][8] = {}, mins[RB] = {};  // zeros
    [[maybe_unused]] const __m512i low4 = _mm512_set1_epi8(0x0f), sixteen = _mm512_set1_epi8(16);
    const uint8_t* t = a.group;
    for (int64_t kb = 0; kb < a.blocks; ++kb, t += L::kTileBytes) {
#pragma GCC unroll 16
      for (int64_t l = 0; l < L::kTileBytes; l += 64) _mm_prefetch((const char*)(t + kPrefetch * L::kTileBytes + l), _MM_HINT_T0);
      const __m512 d_w = _mm512_cvtph_ps(_mm256_load_si256((const __m256i*)t));
      __m512 scale[RB];
#pragma GCC unroll 2
      for (int r = 0; r < RB; ++r) scale[r] = _mm512_mul_ps(d_w, _mm512_set1_ps(rows.dx[r][kb]));
      const uint8_t* quants = t + L::kHeadBytes;
#pragma GCC unroll 4
      for (int p = 0; p < 4; ++p) {  // weights 4p.. and 4(p + 4).. of every column
        __m512i u[2];
        if constexpr (L::kNibbles) {
          const __m512i packed = _mm512_load_si512((const void*)(quants + 64 * p));
          u[0] = _mm512_and_si512(packed, low4), u[1] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low4);
          if constexpr (L::kFifthBit) {
            const uint64_t* bits = (const uint64_t*)(quants + L::kQuantBytes);
            u[0] = _mm512_mask_add_epi8(u[0], _cvtu64_mask64(bits[p]), u[0], sixteen);
            u[1] = _mm512_mask_add_epi8(u[1], _cvtu64_mask64(bits[p + 4]), u[1], sixteen);
          }
        } else {
          u[0] = _mm512_load_si512((const void*)(quants + 64 * p)), u[1] = _mm512_load_si512((const void*)(quants + 64 * (p + 4)));
        }
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
          const int j = p + 4 * h;
#pragma GCC unroll 2
          for (int r = 0; r < RB; ++r) {
            const __m512i lane_start = L::kOffset ? _mm512_set1_epi32(a.starts[r * (a.K / 4) + 8 * kb + j]) : _mm512_setzero_si512();
            const __m512i dot = _mm512_dpbusd_epi32(lane_start, u[h], bcast4(rows.q[r] + 32 * kb + 4 * j));
            acc[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale[r], acc[r][j]);
          }
        }
      }
      if constexpr (L::kHasMin) {
        const __m512 m_w = _mm512_cvtph_ps(_mm256_load_si256((const __m256i*)(t + 2 * kCols)));
#pragma GCC unroll 2
        for (int r = 0; r < RB; ++r) mins[r] = _mm512_add_ps(mins[r], _mm512_mul_ps(m_w, _mm512_set1_ps(rows.ds[r][kb])));
      }
    }
    __m512 out[1][RB];
#pragma GCC unroll 2
    for (int r = 0; r < RB; ++r) {  // hsum256's tree over the 8 lanes, then the min terms
      const __m512 even = _mm512_add_ps(_mm512_add_ps(acc[r][0], acc[r][4]), _mm512_add_ps(acc[r][2], acc[r][6]));
      const __m512 odd = _mm512_add_ps(_mm512_add_ps(acc[r][1], acc[r][5]), _mm512_add_ps(acc[r][3], acc[r][7]));
      out[0][r] = _mm512_add_ps(even, odd);
      if constexpr (L::kHasMin) out[0][r] = _mm512_add_ps(out[0][r], mins[r]);
    }
    store_rows<RB, 1>(out, a);
  }
  template <int MR, int NG>
  static void tile(const Args& a) {
    static_assert(NG == 1, "the 32-weight tiles walk one column group");
    for (int r = 0; r + 2 <= MR; r += 2) pass<2>(a, r);
    if constexpr (MR % 2) pass<1>(a, MR - 1);
  }
};
