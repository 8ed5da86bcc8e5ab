// a8 K-quants on AVX-512 VNNI without AMX tiles: weights repacked 16 output columns wide, so each
// 4-byte product instruction multiplies 4 weights of 16 columns by ONE broadcast group of 4
// activations, and every int32 lane is one column's running sum: no horizontal sums, the sub-block
// scale multiply (vpdpwssd) shared by 16 columns, and the unpacking shared by every row of the call.
//
// Why: a verify row on the raw-block tiles costs ~13 vector instructions per 128 weights (the
// per-column lanes are transposed and summed, and scaled per 4 weights), where two AVX-512 cores
// issue ~2 per cycle each; here a row costs 2.5 per 512 weights (Q4_K) or 4 per 128 (Q6_K).
//
// Bits: the integer totals per 256 weights and column (sum over sub-blocks of sc * (q . x), of m *
// bsum, of -32 * sc * bsum16 for Q6_K) are the same integers the raw-block tiles compute (exact, any
// order), and each output takes the same float steps in the same order (a8.cpp's header), so the
// outputs are bitwise those of sg_linear_gguf_a8 on the original blocks, on any row count and split.
//
// Repacked layout: per 16-column group, its super-blocks in K order, one tile each (64-aligned);
// columns past N (the last group when N % 16 != 0) are zero (d = 0), their outputs never stored.
//   Q4_K (2368 bytes): d fp16[16] | dmin fp16[16] | sc u8[8][16] | m u8[4][16][2] (sub-blocks 2p,
//     2p + 1 per column) | 8 sub-blocks x 4 vectors of 64 bytes: byte 4c + i of vector (s, j) holds
//     column c's quant 32 s + 4 j + i in its low nibble and 32 s + 16 + 4 j + i in its high nibble
//   Q6_K (3392 bytes): d fp16[16] | 32 zero | sc i8[8][16][2] (groups 2s, 2s + 1 per column) | 8
//     sub-blocks x 6 vectors of 64 bytes: 4 as Q4_K's (the low 4 bits of u = q + 32), then two whose
//     byte 4c + i holds the high 2 bits of quant 32 s + 4 j + i (resp. 32 s + 16 + 4 j + i) at bits 2j
#include "skinny_gemm.h"

#ifdef SG_A8_ZMM
#include "a8_int.h"

namespace sg {
namespace {

constexpr int kX16Cols = 16, kX16MaxRows = 8;

struct X16Args {
  const uint8_t* group;  // the group's first tile
  int64_t blocks;        // K / 256
  const uint8_t* xq;     // MR activation rows (a8_row_bytes(K) apart)
  int64_t ldxq, K;
  const float* bias;     // the group's 16 or null
  float* y;              // [MR, ldy] at the group's first column
  int64_t ldy;
  int n_cols;            // columns of the group that exist (16 but in the last group)
};

inline __m512i bcast4(const void* p) { return _mm512_set1_epi32(*(const int32_t*)p); }

// the weight stream kX16Prefetch tiles ahead, one share of the tile's lines per sub-block s: with
// three or more rows the arithmetic per byte leaves the hardware prefetcher behind (T(8) of the 1.5B
// 72 ms with, 94 without); one or two rows (two streams, see run_x16_groups) run faster without
constexpr int kX16Prefetch = 4;
template <int64_t kTileBytes>
inline void prefetch_ahead(const uint8_t* t, int s) {
  constexpr int kLines = (int)((kTileBytes / 64 + 7) / 8);
#pragma GCC unroll 8
  for (int l = 0; l < kLines; ++l) _mm_prefetch((const char*)(t + kX16Prefetch * kTileBytes + 64 * (kLines * s + l)), _MM_HINT_T0);
}

// rows' results: acc (+ bias) into the groups' existing columns (only the last group may be partial)
template <int MR, int NG>
inline void store_rows(const __m512 (&acc)[NG][MR], const X16Args& a) {
#pragma GCC unroll 2
  for (int g = 0; g < NG; ++g) {
    const __mmask16 keep = g + 1 < NG ? (__mmask16)0xFFFF : (__mmask16)((1u << a.n_cols) - 1);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      __m512 value = acc[g][r];
      if (a.bias) value = _mm512_add_ps(value, _mm512_maskz_loadu_ps(keep, a.bias + kX16Cols * g));
      _mm512_mask_storeu_ps(a.y + r * a.ldy + kX16Cols * g, keep, value);
    }
  }
}

struct Q4KX16 {
  static constexpr int64_t kBlockBytes = 144, kHeadBytes = 64 + 128 + 128, kTileBytes = kHeadBytes + 2048;  // 37 x 64

  // column c's Q4_K block (ggml's block_q4_K: d, dmin fp16, 12 bytes of 6-bit sc / m, qs[128]) into tile t
  static void repack(const uint8_t* b, int c, uint8_t* t) {
    std::memcpy(t + 2 * c, b, 2), std::memcpy(t + 32 + 2 * c, b + 2, 2);
    const uint8_t* s6 = b + 4;
    for (int s = 0; s < 8; ++s) {
      const int sc = s < 4 ? s6[s] & 63 : (s6[s + 4] & 0xF) | ((s6[s - 4] >> 6) << 4);
      const int m = s < 4 ? s6[s + 4] & 63 : (s6[s + 4] >> 4) | ((s6[s] >> 6) << 4);
      t[64 + 16 * s + c] = (uint8_t)sc, t[192 + 32 * (s / 2) + 2 * c + s % 2] = (uint8_t)m;
    }
    const uint8_t* qs = b + 16;  // quant 64 p + i: low nibble of qs[32 p + i] (i < 32), high of qs[32 p + i - 32]
    auto quant = [&](int k) { return (qs[32 * (k / 64) + k % 32] >> (4 * (k % 64 / 32))) & 0xF; };
    for (int s = 0; s < 8; ++s)
      for (int j = 0; j < 4; ++j)
        for (int i = 0; i < 4; ++i)
          t[kHeadBytes + 256 * s + 64 * j + 4 * c + i] = (uint8_t)(quant(32 * s + 4 * j + i) | (quant(32 * s + 16 + 4 * j + i) << 4));
  }

  template <int MR, int NG>
  static void tile(const X16Args& a) {
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    __m512 acc[NG][MR];
    const uint8_t* q[MR];
    const float* dx[MR];
    const int16_t* bsum[MR];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const A8Row row(a.xq + r * a.ldxq, a.K);
      q[r] = row.q, dx[r] = row.d, bsum[r] = row.bsum;
#pragma GCC unroll 2
      for (int g = 0; g < NG; ++g) acc[g][r] = _mm512_setzero_ps();
    }
    for (int64_t kb = 0; kb < a.blocks; ++kb) {
      const uint8_t* t[NG];
      __m512i total[NG][MR];
#pragma GCC unroll 2
      for (int g = 0; g < NG; ++g) {
        t[g] = a.group + (g * a.blocks + kb) * kTileBytes;
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) total[g][r] = _mm512_setzero_si512();
      }
#pragma GCC unroll 1
      for (int s = 0; s < 8; ++s) {
#pragma GCC unroll 2
        for (int g = 0; g < NG; ++g) {
          // (sc, 0) int16 pairs: vpdpwssd of an int32 lane (|.| <= 16 * 15 * 127 < 2^15: its low int16) times sc
          const __m512i sc = _mm512_cvtepu8_epi32(_mm_load_si128((const __m128i*)(t[g] + 64 + 16 * s)));
          __m512i lo[MR], hi[MR];
#pragma GCC unroll 8
          for (int r = 0; r < MR; ++r) lo[r] = _mm512_setzero_si512(), hi[r] = _mm512_setzero_si512();
          const uint8_t* qs = t[g] + kHeadBytes + 256 * s;
          if constexpr (NG == 1) prefetch_ahead<kTileBytes>(t[g], s);
#pragma GCC unroll 4
          for (int j = 0; j < 4; ++j) {
            const __m512i packed = _mm512_load_si512((const void*)(qs + 64 * j));
            const __m512i w_lo = _mm512_and_si512(packed, low4), w_hi = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low4);
            const int64_t k = 256 * kb + 32 * s + 4 * j;
#pragma GCC unroll 8
            for (int r = 0; r < MR; ++r) {
              lo[r] = _mm512_dpbusd_epi32(lo[r], w_lo, bcast4(q[r] + k));
              hi[r] = _mm512_dpbusd_epi32(hi[r], w_hi, bcast4(q[r] + k + 16));
            }
          }
#pragma GCC unroll 8
          for (int r = 0; r < MR; ++r) total[g][r] = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(total[g][r], lo[r], sc), hi[r], sc);
        }
      }
#pragma GCC unroll 2
      for (int g = 0; g < NG; ++g) {
        const __m512 d_w = _mm512_cvtph_ps(_mm256_load_si256((const __m256i*)t[g]));
        const __m512 dmin_w = _mm512_cvtph_ps(_mm256_load_si256((const __m256i*)(t[g] + 32)));
        __m512i m_pairs[4];
#pragma GCC unroll 4
        for (int p = 0; p < 4; ++p) m_pairs[p] = _mm512_cvtepu8_epi16(_mm256_load_si256((const __m256i*)(t[g] + 192 + 32 * p)));
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) {
          const __m512 dxv = _mm512_set1_ps(dx[r][kb]);
          acc[g][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total[g][r]), _mm512_mul_ps(d_w, dxv), acc[g][r]);
          __m512i msum = _mm512_setzero_si512();
#pragma GCC unroll 4
          for (int p = 0; p < 4; ++p) msum = _mm512_dpwssd_epi32(msum, m_pairs[p], bcast4(bsum[r] + 8 * kb + 2 * p));
          acc[g][r] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(msum), _mm512_mul_ps(dmin_w, dxv), acc[g][r]);
        }
      }
    }
    store_rows<MR, NG>(acc, a);
  }
};

struct Q6KX16 {
  static constexpr int64_t kBlockBytes = 210, kHeadBytes = 64 + 256, kSubBytes = 384, kTileBytes = kHeadBytes + 8 * kSubBytes;  // 53 x 64

  // quant k of a Q6_K block (ggml's block_q6_K: ql[128], qh[64], sc int8[16], d fp16) as u = q + 32 (0..63)
  static int quant(const uint8_t* b, int k) {
    const int h = k / 128, r = k % 128;
    return ((b[64 * h + r % 64] >> (4 * (r / 64))) & 0xF) | ((b[128 + 32 * h + r % 32] >> (2 * (r / 32))) & 3) << 4;
  }
  static void repack(const uint8_t* b, int c, uint8_t* t) {
    std::memcpy(t + 2 * c, b + 208, 2);
    for (int g = 0; g < 16; ++g) t[64 + 32 * (g / 2) + 2 * c + g % 2] = b[192 + g];
    for (int s = 0; s < 8; ++s) {
      uint8_t* sub = t + kHeadBytes + kSubBytes * s;
      for (int j = 0; j < 4; ++j)
        for (int i = 0; i < 4; ++i) {
          const int first = quant(b, 32 * s + 4 * j + i), second = quant(b, 32 * s + 16 + 4 * j + i);
          sub[64 * j + 4 * c + i] = (uint8_t)((first & 0xF) | (second & 0xF) << 4);
          sub[256 + 4 * c + i] |= (uint8_t)((first >> 4) << (2 * j));
          sub[320 + 4 * c + i] |= (uint8_t)((second >> 4) << (2 * j));
        }
    }
  }

  // bits 2j, 2j + 1 of each byte moved to bits 4, 5 (what lands elsewhere is masked off)
  static __m512i high_bits_of(__m512i h, int j) { return j < 2 ? _mm512_slli_epi16(h, 4 - 2 * j) : _mm512_srli_epi16(h, 2 * j - 4); }

  template <int MR, int NG>
  static void tile(const X16Args& a) {
    const __m512i low4 = _mm512_set1_epi8(0x0f), bits45 = _mm512_set1_epi8(0x30), low16 = _mm512_set1_epi32(0xffff);
    __m512 acc[NG][MR];
    const uint8_t* q[MR];
    const float* dx[MR];
    const int16_t* bsum16[MR];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const A8Row row(a.xq + r * a.ldxq, a.K);
      q[r] = row.q, dx[r] = row.d, bsum16[r] = row.bsum16;
#pragma GCC unroll 2
      for (int g = 0; g < NG; ++g) acc[g][r] = _mm512_setzero_ps();
    }
    // the b groups' products in a second sum where registers allow: two chains of dependent
    // vpdpwssd (latency ~5 each) instead of one, which alone bounds a row or two
    constexpr bool kTwoChains = MR * NG <= 4;
    for (int64_t kb = 0; kb < a.blocks; ++kb) {
      const uint8_t* t[NG];
      __m512i total[NG][MR], total_b[NG][MR];
#pragma GCC unroll 2
      for (int g = 0; g < NG; ++g) {
        t[g] = a.group + (g * a.blocks + kb) * kTileBytes;
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) total[g][r] = _mm512_setzero_si512(), total_b[g][r] = _mm512_setzero_si512();
      }
#pragma GCC unroll 1
      for (int s = 0; s < 8; ++s) {
#pragma GCC unroll 2
        for (int g = 0; g < NG; ++g) {
          // int16 lanes (sc_a, sc_b) per column: the scales of the sub-block's two 16-weight groups
          const __m512i sc_pairs = _mm512_cvtepi8_epi16(_mm256_load_si256((const __m256i*)(t[g] + 64 + 32 * s)));
          // (sc, sc) per column: a 4-quant product pair (|.| <= 4 * 63 * 127, int16) per int16 lane
          const __m512i sc_a = _mm512_ternarylogic_epi32(_mm512_slli_epi32(sc_pairs, 16), sc_pairs, low16, 0xF8);  // A | (B & C)
          const __m512i sc_b = _mm512_ternarylogic_epi32(_mm512_srli_epi32(sc_pairs, 16), sc_pairs, ~low16, 0xF8);
          // the quants' offset: -32 sc per group times the activations' sums per 16 (|32 sc| <= 4096)
          const __m512i offset_pairs = _mm512_sub_epi16(_mm512_setzero_si512(), _mm512_slli_epi16(sc_pairs, 5));
#pragma GCC unroll 8
          for (int r = 0; r < MR; ++r) total[g][r] = _mm512_dpwssd_epi32(total[g][r], offset_pairs, bcast4(bsum16[r] + 16 * kb + 2 * s));
          const uint8_t* qs = t[g] + kHeadBytes + kSubBytes * s;
          if constexpr (NG == 1) prefetch_ahead<kTileBytes>(t[g], s);
          const __m512i high_a = _mm512_load_si512((const void*)(qs + 256)), high_b = _mm512_load_si512((const void*)(qs + 320));
#pragma GCC unroll 4
          for (int j = 0; j < 4; ++j) {
            const __m512i packed = _mm512_load_si512((const void*)(qs + 64 * j));
            const __m512i u_a = _mm512_ternarylogic_epi32(_mm512_and_si512(packed, low4), high_bits_of(high_a, j), bits45, 0xF8);
            const __m512i u_b = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi16(packed, 4), low4), high_bits_of(high_b, j), bits45, 0xF8);
            const int64_t k = 256 * kb + 32 * s + 4 * j;
#pragma GCC unroll 8
            for (int r = 0; r < MR; ++r) {
              total[g][r] = _mm512_dpwssd_epi32(total[g][r], _mm512_maddubs_epi16(u_a, bcast4(q[r] + k)), sc_a);
              __m512i& sum_b = kTwoChains ? total_b[g][r] : total[g][r];
              sum_b = _mm512_dpwssd_epi32(sum_b, _mm512_maddubs_epi16(u_b, bcast4(q[r] + k + 16)), sc_b);
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
                                      _mm512_mul_ps(d_w, _mm512_set1_ps(dx[r][kb])), acc[g][r]);
      }
    }
    store_rows<MR, NG>(acc, a);
  }
};

// few rows walk two groups at once: two weight streams per thread (one alone left a row ~10 %
// below the raw blocks' speed) and twice the independent sums
constexpr int kX16PairedRows = 2;
using x16_tile_fn = void (*)(const X16Args&);
template <typename Fmt, int NG, std::size_t... I>
constexpr std::array<x16_tile_fn, sizeof...(I)> x16_tiles(std::index_sequence<I...>) {
  return {Fmt::template tile<(int)I + 1, NG>...};
}

template <typename Fmt>
void run_x16_groups(const LinearJob& job, int64_t g_begin, int64_t g_end) {
  static constexpr auto kTiles = x16_tiles<Fmt, 1>(std::make_index_sequence<kX16MaxRows>{});
  static constexpr auto kPairedTiles = x16_tiles<Fmt, 2>(std::make_index_sequence<kX16PairedRows>{});
  const int64_t blocks = job.K / 256, ldxq = a8_row_bytes(job.K);
  const int step = job.M <= kX16PairedRows ? 2 : 1;
  for (int64_t g = g_begin; g < g_end; g += step) {
    const int ng = (int)std::min<int64_t>(step, g_end - g);
    for (int64_t r = 0; r < job.M; r += kX16MaxRows) {  // the group's tiles stay in L2 for every row block
      const int mr = (int)std::min<int64_t>(kX16MaxRows, job.M - r);
      const X16Args args{job.w + g * blocks * Fmt::kTileBytes, blocks, job.xq + r * ldxq, ldxq, job.K,
                         job.bias ? job.bias + kX16Cols * g : nullptr, job.y + r * job.N + kX16Cols * g, job.N,
                         (int)std::min<int64_t>(kX16Cols, job.N - kX16Cols * (g + ng - 1))};
      (ng == 2 ? kPairedTiles[mr - 1] : kTiles[mr - 1])(args);
    }
  }
}

// groups [g_begin, g_end) of job.w (the raw blocks, [N, K / 256 blocks]) into job.ctx (the copy)
template <typename Fmt>
void repack_x16_groups(const LinearJob& job, int64_t g_begin, int64_t g_end) {
  const int64_t blocks = job.K / 256, row_bytes = blocks * Fmt::kBlockBytes;
  uint8_t* out = (uint8_t*)job.ctx;
  for (int64_t g = g_begin; g < g_end; ++g)
    for (int64_t kb = 0; kb < blocks; ++kb) {
      uint8_t* t = out + (g * blocks + kb) * Fmt::kTileBytes;
      std::memset(t, 0, Fmt::kTileBytes);
      for (int c = 0; c < std::min<int64_t>(kX16Cols, job.N - kX16Cols * g); ++c)
        Fmt::repack(job.w + (kX16Cols * g + c) * row_bytes + kb * Fmt::kBlockBytes, c, t);
    }
}

struct X16Format {
  int64_t tile_bytes;
  void (*repack_groups)(const LinearJob&, int64_t, int64_t);
  void (*run_groups)(const LinearJob&, int64_t, int64_t);
};
template <typename Fmt>
constexpr X16Format x16_format() {
  return {Fmt::kTileBytes, repack_x16_groups<Fmt>, run_x16_groups<Fmt>};
}

const X16Format* find_x16_format(int ggml_type) {
  static constexpr X16Format kQ4K = x16_format<Q4KX16>(), kQ6K = x16_format<Q6KX16>();
  switch (ggml_type) {
    case 12: return &kQ4K;  // GGML_TYPE_Q4_K
    case 14: return &kQ6K;  // GGML_TYPE_Q6_K
    default: return nullptr;
  }
}

}  // namespace
}  // namespace sg
#endif  // SG_A8_ZMM

using namespace sg;

extern "C" {

// Bytes of the 16-column repacked copy of an [N, K] matrix of `ggml_type`, or 0 when this build has
// no such copy (not AVX-512 VNNI, not Q4_K / Q6_K, or K not a multiple of 256).
int64_t sg_x16_bytes(int ggml_type, int64_t N, int64_t K) {
#ifdef SG_A8_ZMM
  const X16Format* f = find_x16_format(ggml_type);
  if (f && N > 0 && K > 0 && K % 256 == 0) return (N + kX16Cols - 1) / kX16Cols * (K / 256) * f->tile_bytes;
#endif
  (void)ggml_type, (void)N, (void)K;
  return 0;
}

// w [N, K / 256 blocks] of `ggml_type` -> out [sg_x16_bytes(ggml_type, N, K)], 64-byte aligned.
int sg_repack_x16(int ggml_type, const uint8_t* w, int64_t N, int64_t K, uint8_t* out, int num_threads) {
  if (!sg_x16_bytes(ggml_type, N, K) || !w || !out || (uintptr_t)out % 64) return 1;
#ifdef SG_A8_ZMM
  const X16Format* f = find_x16_format(ggml_type);
  LinearJob job{nullptr, 0, K, w, 0, nullptr, N, nullptr, nullptr, 0, (N + kX16Cols - 1) / kX16Cols, f->repack_groups};
  job.ctx = out;
  return run_job(job, num_threads, N * K);
#else
  (void)num_threads;
  return 1;
#endif
}

// y [M, N] = the a8 linear of x [M, K] with repacked weights (sg_repack_x16): bitwise
// sg_linear_gguf_a8 on the original blocks.
int sg_linear_x16_a8(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, int ggml_type, const float* bias,
                     float* y, int num_threads) {
  if (!sg_x16_bytes(ggml_type, N, K)) return 1;
#ifdef SG_A8_ZMM
  int status;
  if (bad_shape(x, M, K, w, N, y, &status)) return status;
  std::vector<uint8_t> xq((size_t)(M * a8_row_bytes(K)));
  for (int64_t i = 0; i < M; ++i) quantize_a8_row(x + i * K, K, 256, xq.data() + i * a8_row_bytes(K));
  LinearJob job{x, M, K, w, 0, nullptr, N, bias, y, 0, (N + kX16Cols - 1) / kX16Cols, find_x16_format(ggml_type)->run_groups};
  job.xq = xq.data();
  return run_job(job, num_threads, M * N * K);
#else
  (void)x, (void)M, (void)w, (void)bias, (void)y, (void)num_threads;
  return 1;
#endif
}

}  // extern "C"
