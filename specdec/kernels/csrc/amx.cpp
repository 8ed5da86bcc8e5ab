// ---------------------------------------------------------------- a8 K-quants on AMX int8 tiles
// CPUs with AMX (Sapphire Rapids on): one TDPBSSD multiplies a 16 x 64-byte int8 tile by a 64 x 16
// one into 16 x 16 int32 sums. The a8 K-quant outputs are defined by exact integers (see a8.cpp:
// per output and super-block ONE integer total of sub-block scale * sub-block dot
// product, and one of the min terms) followed by one fixed sequence of float steps, so any exact
// way of getting the integers gives the same bits: here, per 16 weight rows and group of sub-blocks
// (Q4_K / Q5_K: 32 weights each; see AmxActivations), ONE tile product of A = the 16 rows' decoded
// quants (natural layout, an L1 scratch decoded once per call, tile and K-chunk, shared by every
// activation row) and B = up to 16 activation rows in the VNNI layout (4 consecutive bytes of a row
// side by side, prepared once per call), stored as [16 weight rows][sub-block, row] int32 and
// multiplied by the rows' sub-block scales in AVX-512 (vpmulld: exact, |total| < 2^31), summed
// to the totals. Q6_K (a scale per 16 weights) puts the scales into A instead: two byte planes of
// (q - 32) * scale, see amx_tiles. Then the same float steps as a8_tile, lane by lane:
//     acc = fma(float(total), d_w * d_x, acc);  acc = fnmadd(float(min total), dmin * d_x, acc)
// The tiles' int32 sums are exact (|.| <= 32 * 31 * 127 per sub-block; Q6_K planes <= 128 * 255 *
// 127 per C tile), so the bits are those of the AVX2 and VNNI builds, for any row count, row
// position and thread count.
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>

#include "skinny_gemm.h"

namespace sg {
namespace {

// AMX on when the build has it, the CPU has it, the kernel asked Linux for the tile state and got
// it, and the caller wants it (sg_set_amx); from amx_min_rows activation rows (below, the decode
// of 16 weight rows per tile costs more than the tile products save; a decode step stays on VNNI).
// Measured (one core, 8960 x 1536, min of 20): Q4_K 3 rows 0.56 ms on AMX vs 0.65 on VNNI (2 rows
// 0.56 vs 0.53); Q6_K, whose planes cost the same decode at any row count, 5 rows 1.34 vs 1.37 (4
// rows 1.28 vs 0.97, 8 rows 1.40 vs 1.89; thread CPU time, min of 30, loaded machine).
std::atomic<int> g_amx_on{0};
std::atomic<int64_t> g_amx_min_rows{0};  // 0: the measured thresholds; tests set 1 to run every path

}  // namespace

#ifdef SG_AMX
namespace {

inline int64_t amx_min_rows(int ggml_type) {
  const int64_t forced = g_amx_min_rows.load();
  return forced > 0 ? forced : ggml_type == 14 ? 5 : 3;
}

constexpr int kAmxTileRows = 16;      // weight rows per tile = output columns per tile
constexpr int kAmxBlockRows = 16;     // activation rows per B tile
constexpr int64_t kAmxKChunk = 512;  // weights per row decoded at a time (two buffers: 16 rows x 1 KiB in L1)

struct alignas(64) AmxTileConfig {  // LDTILECFG's 64-byte layout (palette 1)
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// One call's activation rows, per block of kAmxBlockRows rows, in the lanes the tile code reads:
// mp = 4, 8 or 16 rows per block (the next of those >= M, 16 past it); lane l of a 16-lane vector
// belongs to row l % mp of the block (rows past M are zero and their outputs are dropped).
// B tiles: `group` sub-blocks of `sub` weights share one tile product (K = group * sub <= 64), each
// in its own mp columns: column g * mp + m holds row m's bytes of sub-block g of the group and zeros
// elsewhere, so one product gives each sub-block's dot products separately ([16][group * mp] int32).
struct AmxActivations {
  int64_t blocks;
  int width;                        // group * mp: int32 columns of a B / C tile
  std::vector<int32_t> vnni;        // [blocks][K / 4][width]: 4 bytes of row m at k = 4 i .. 4 i + 3
  std::vector<float> dx;            // [blocks][K / 256][16]: the rows' activation scales
  std::vector<int32_t> bsum_pairs;  // [blocks][K / 256][4][16]: the int16 bsum pair (2p, 2p + 1)
};

void prepare_amx_activations(const uint8_t* xq, int64_t M, int64_t K, int mp, int group, int sub, AmxActivations& act) {
  const int64_t ldxq = a8_row_bytes(K), supers = K / 256;
  act.blocks = (M + kAmxBlockRows - 1) / kAmxBlockRows;
  act.width = group * mp;
  act.vnni.assign((size_t)(act.blocks * (K / 4) * act.width), 0);
  act.dx.assign((size_t)(act.blocks * supers * 16), 0.0f);
  act.bsum_pairs.assign((size_t)(act.blocks * supers * 4 * 16), 0);
  for (int64_t b = 0; b < act.blocks; ++b)
    for (int m = 0; m < mp; ++m) {
      const int64_t row = b * kAmxBlockRows + m;
      if (row >= M) break;
      const A8Row x(xq + row * ldxq, K);
      int32_t* vnni = act.vnni.data() + b * (K / 4) * act.width + m;
      for (int64_t i = 0; i < K / 4; ++i) std::memcpy(vnni + i * act.width + (i / (sub / 4)) % group * mp, x.q + 4 * i, 4);
      for (int64_t sb = 0; sb < supers; ++sb)
        for (int lane = m; lane < 16; lane += mp) {
          act.dx[(size_t)((b * supers + sb) * 16 + lane)] = x.d[sb];
          for (int p = 0; p < 4; ++p)
            std::memcpy(&act.bsum_pairs[(size_t)(((b * supers + sb) * 4 + p) * 16 + lane)], x.bsum + 8 * sb + 2 * p, 4);
        }
    }
}

// Sub-blocks per tile product for mp rows: Q4_K / Q5_K (32 weights each) as many as fit 16 int32
// columns and 64 bytes of K; Q6_K (`planes`, see amx_tiles) one product per 64 weights, no split.
constexpr int amx_group(bool planes, int mp) { return planes ? 1 : std::min(16 / mp, 2); }

// Into L2 (prefetcht0 for 16 rows at once stalls on the L1 fill buffers). A loop of nothing but
// _mm_prefetch counts as side-effect free in C++ (-ffinite-loops) and GCC deletes it; asm stays.
inline void prefetch_l2(const char* p) { asm volatile("prefetcht1 %0" ::"m"(*p)); }

struct AmxJob {
  const AmxActivations* act;
};

// The K-quant scales of one super-block of 16 weight rows as 16-lane vectors over the rows (lane r
// = row r; rows past N are masked to zero): gathered and decoded for all rows at once, the same
// integers and fp16 values as Fmt::prepare_a8 gives per row.
struct AmxScales {
  __m512i sc[8];         // Q4_K / Q5_K: the sub-block scales (8 per 32 weights); Q6_K: see amx_tiles
  __m512i min_pairs[4];  // Q4_K / Q5_K: the 6-bit mins of sub-blocks 2p, 2p + 1 as an int16 pair
  __m512 d, dmin;
};
inline __m512i gather_rows(const uint8_t* base, __m512i offsets, __mmask16 rows) {  // 4 bytes per row
  return _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), rows, offsets, base, 1);
}
inline __m512 fp16_lanes(__m512i v) { return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(v)); }  // the low 16 bits of each lane
template <typename Fmt>
void amx_scales(const uint8_t* block, __m512i offsets, __mmask16 rows, AmxScales& s) {
  if constexpr (Fmt::kA8ScalePer16) {  // Q6_K: d at 208 (its sub-block scales are in the planes)
    s.d = fp16_lanes(_mm512_srli_epi32(gather_rows(block + 206, offsets, rows), 16));  // bytes 208, 209 (none past the block)
  } else {  // Q4_K / Q5_K: d, dmin at 0, 2; 6-bit scales and mins in bytes 4-15 (k_quant_6bit_epi16, per lane)
    const __m512i d_dmin = gather_rows(block, offsets, rows);
    const __m512i lo = gather_rows(block + 4, offsets, rows), mid = gather_rows(block + 8, offsets, rows),
                  hi = gather_rows(block + 12, offsets, rows);
    const __m512i six = _mm512_set1_epi32(0x3f3f3f3f), four = _mm512_set1_epi32(0x0f0f0f0f), top = _mm512_set1_epi32(0x30303030);
    const __m512i sc[2] = {_mm512_and_si512(lo, six), _mm512_or_si512(_mm512_and_si512(hi, four), _mm512_and_si512(_mm512_srli_epi32(lo, 2), top))};
    const __m512i m[2] = {_mm512_and_si512(mid, six),
                          _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(hi, 4), four), _mm512_and_si512(_mm512_srli_epi32(mid, 2), top))};
    for (int sub = 0; sub < 8; ++sub)
      s.sc[sub] = _mm512_and_si512(_mm512_srl_epi32(sc[sub / 4], _mm_cvtsi32_si128(8 * (sub % 4))), _mm512_set1_epi32(0xff));
    // bytes 0, 1 -> int16 pair 0; bytes 2, 3 -> pair 1 (per 32-bit lane)
    const __m512i pair_low = _mm512_set4_epi32((int)0x800d800c, (int)0x80098008, (int)0x80058004, (int)0x80018000);
    const __m512i pair_high = _mm512_set4_epi32((int)0x800f800e, (int)0x800b800a, (int)0x80078006, (int)0x80038002);
    for (int half = 0; half < 2; ++half) {
      s.min_pairs[2 * half] = _mm512_shuffle_epi8(m[half], pair_low);
      s.min_pairs[2 * half + 1] = _mm512_shuffle_epi8(m[half], pair_high);
    }
    s.d = fp16_lanes(d_dmin);
    s.dmin = fp16_lanes(_mm512_srli_epi32(d_dmin, 16));
  }
}

// Output columns [16 tile_begin, 16 tile_end) for every row. kMp: activation rows per B tile.
// Steps = (tile, K-chunk) in order; the weights of step s + 1 are decoded (into the other of two
// buffers) before the tiles of step s run, so the tile loads never wait for just-stored bytes,
// and the blocks 1024 weights ahead are prefetched (2 steps; Q6_K 4).
//
// Q6_K (`kPlanes`) has a scale per 16 weights: split per sub-block, its tile products would cover
// only 16-32 bytes of K each, and every product would need its own scale multiply (twice the work of
// Q4_K). Instead the decode multiplies each quant by its sub-block scale, w = (q - 32) * sc (an
// exact int16, |w| <= 4096), and stores w as two byte planes, hi = w >> 8 (signed) and lo = w & 0xff
// (unsigned): per super-block ONE chain of full 64-byte tile products per plane (TDPBSSD for hi,
// TDPBUSD for lo) gives the integer totals sum w x = 256 * sum hi x + sum lo x directly, with no
// per-sub-block scaling and activations in their plain VNNI layout.
template <typename Fmt, int kMp>
void amx_tiles(const LinearJob& job, int64_t tile_begin, int64_t tile_end) {
  constexpr bool kPlanes = Fmt::kA8ScalePer16;
  constexpr int kSub = 32, kSubs = 256 / kSub;  // Q4_K / Q5_K sub-blocks
  // tile products per super-block: Q4_K / Q5_K one per group of sub-blocks; Q6_K one per 64 weights and plane
  constexpr int kGroup = amx_group(kPlanes, kMp), kGroups = kPlanes ? 4 : kSubs / kGroup, kWidth = kGroup * kMp,
                kK = kPlanes ? 64 : kGroup * kSub;
  static_assert(kGroups % 4 == 0, "groups of sub-blocks run four at a time");
  // Q6_K: one super-block per step (hi and lo planes, 512 bytes per row)
  constexpr int64_t kChunk = kPlanes ? 256 : kAmxKChunk, kPlaneCount = kPlanes ? 2 : 1, kLda = kChunk * kPlaneCount;
  constexpr int64_t kSupers = kChunk / 256;
  const AmxActivations& act = *((const AmxJob*)job.ctx)->act;
  const int64_t K = job.K, supers = K / 256, chunks = (K + kChunk - 1) / kChunk;
  const int64_t steps = (tile_end - tile_begin) * chunks;
  AmxTileConfig config{};
  config.palette = 1;
  for (int i = 0; i < 2; ++i) config.rows[i] = kAmxTileRows, config.colsb[i] = kK;          // tmm0, 1: A, the weights
  for (int i = 2; i < 4; ++i) config.rows[i] = kK / 4, config.colsb[i] = kWidth * 4;         // tmm2, 3: B, the activations
  for (int i = 4; i < 8; ++i) config.rows[i] = kAmxTileRows, config.colsb[i] = kWidth * 4;   // tmm4-7: C, [weight row][sub-block, activation row] (Q6_K: [weight row][activation row])
  _tile_loadconfig(&config);
  alignas(64) int8_t quants[2][kAmxTileRows][kLda];  // two steps' decoded K-chunks of the tile's 16 rows (Q6_K: hi plane, lo plane)
  alignas(64) AmxScales scales[2][kSupers];
  alignas(64) int32_t products[kGroups][kAmxTileRows * kWidth];  // one super-block's sub-block products
  std::vector<float> acc_buffer((size_t)(act.blocks * kAmxTileRows * kMp));  // per block: [16 columns][kMp rows]
  // lane l of vector j (of kMp) is output (column (16 j + l) / kMp, row l % kMp)
  __m512i column_of[kMp];
  for (int j = 0; j < kMp; ++j)
    column_of[j] = _mm512_srli_epi32(_mm512_add_epi32(_mm512_set1_epi32(16 * j), _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)),
                                     kMp == 16 ? 4 : kMp == 8 ? 3 : 2);
  // Scales of group q in the lanes of product vector j (lane l: column (16 j + l) / kWidth, sub-block
  // q kGroup + l % kWidth / kMp): lane indices into the sub-blocks' 16-lane vectors (16 +: the second)
  __m512i pick[kWidth];
  for (int j = 0; j < kWidth; ++j) {
    alignas(64) int32_t lanes[16];
    for (int l = 0; l < 16; ++l) lanes[l] = (16 * j + l) / kWidth + 16 * (l % kWidth / kMp % 2);
    pick[j] = _mm512_load_si512((const void*)lanes);
  }
  auto group_scales = [&](const AmxScales& sc, int q, int j) {
    if constexpr (kGroup == 1) {
      return _mm512_set1_epi32(((const int32_t*)&sc.sc[q])[j]);
    } else {
      return _mm512_permutex2var_epi32(sc.sc[2 * q], pick[j], sc.sc[2 * q + 1]);
    }
  };
  // Q6_K planes: byte k of a 64-weight vector, for the index of its sub-block scale
  [[maybe_unused]] const __m512i byte_index = _mm512_set_epi8(63, 62, 61, 60, 59, 58, 57, 56, 55, 54, 53, 52, 51, 50, 49, 48, 47, 46, 45, 44, 43, 42, 41, 40, 39, 38, 37, 36, 35, 34, 33, 32,
                                                              31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16, 15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i row_offsets = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                                 _mm512_set1_epi32((int)job.row_bytes));
  struct Step {
    int64_t n0, k0, supers;  // first output column, first weight, super-blocks in the chunk
    int rows;                // weight rows (<= 16; past N: zeros, outputs dropped)
  };
  auto step_of = [&](int64_t step) {
    const int64_t n0 = (tile_begin + step / chunks) * kAmxTileRows, k0 = step % chunks * kChunk;
    return Step{n0, k0, std::min<int64_t>(kSupers, (K - k0) / 256), (int)std::min<int64_t>(kAmxTileRows, job.N - n0)};
  };
  auto first_block = [&](const Step& st) { return job.w + st.n0 * job.row_bytes + st.k0 / 256 * Fmt::kBytes; };
  auto decode = [&](int64_t step) {
    const Step st = step_of(step);
    for (int64_t sb = 0; sb < st.supers; ++sb) {
      const uint8_t* first = first_block(st) + sb * Fmt::kBytes;
      amx_scales<Fmt>(first, row_offsets, (__mmask16)((1u << st.rows) - 1u), scales[step % 2][sb]);
      for (int r = 0; r < kAmxTileRows; ++r) {
        int8_t* out = quants[step % 2][r] + 256 * sb;
        if (r >= st.rows) {
          for (int64_t plane = 0; plane < kPlaneCount; ++plane) std::memset(out + plane * kChunk, 0, 256);
          continue;
        }
        const uint8_t* block = first + r * job.row_bytes;
        if constexpr (kPlanes) {
          const __m512i sc = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i*)(block + 192)));
#pragma GCC unroll 4
          for (int pair = 0; pair < 4; ++pair) {  // 64 weights: q in [0, 63] at byte k, sub-block 4 pair + k / 16
            // int16 lane i covers bytes 2i, 2i + 1 of sub-block 4 pair + i / 8: its scale as (sc, 0) and (0, sc)
            const __m512i index = _mm512_add_epi8(_mm512_set1_epi8((char)(4 * pair)), _mm512_srli_epi16(_mm512_and_si512(byte_index, _mm512_set1_epi8(0x30)), 4));
            const __m512i even_sc = _mm512_maskz_permutexvar_epi8(0x5555555555555555ull, index, sc);
            const __m512i odd_sc = _mm512_slli_epi16(even_sc, 8);
            const __m512i sc32 = _mm512_srai_epi16(odd_sc, 3);  // 32 * sc per int16 lane
            const __m512i q = Fmt::quants64(block, pair);
            const __m512i even = _mm512_sub_epi16(_mm512_maddubs_epi16(q, even_sc), sc32);  // (q - 32) sc of bytes 2i
            const __m512i odd = _mm512_sub_epi16(_mm512_maddubs_epi16(q, odd_sc), sc32);    // ... of bytes 2i + 1
            const __m512i low_byte = _mm512_set1_epi16(0xff);  // the planes in natural order: byte 2i from even, 2i + 1 from odd
            _mm512_store_si512((void*)(out + 64 * pair), _mm512_ternarylogic_epi32(_mm512_srli_epi16(even, 8), odd, low_byte, 0xe4));
            _mm512_store_si512((void*)(out + kChunk + 64 * pair), _mm512_ternarylogic_epi32(even, _mm512_slli_epi16(odd, 8), low_byte, 0xe4));
          }
        } else {
#pragma GCC unroll 4
          for (int pair = 0; pair < 4; ++pair)
            _mm512_store_si512((void*)(out + 64 * pair), _mm512_sub_epi8(Fmt::quants64(block, pair), _mm512_set1_epi8((char)Fmt::kZmmOffset)));
        }
      }
    }
  };
  auto prefetch = [&](int64_t step) {
    if (step >= steps) return;
    const Step st = step_of(step);
    const char* first = (const char*)first_block(st);
    const int64_t bytes = st.supers * Fmt::kBytes;
    for (int r = 0; r < st.rows; ++r)
      for (int64_t line = 0; line < bytes; line += 64) prefetch_l2(first + r * job.row_bytes + line);
  };
  if (steps > 0) decode(0);
  constexpr int64_t kAhead = 2 * kAmxKChunk / kChunk;  // steps: the same bytes ahead for both step sizes
  for (int64_t s = 1; s < kAhead; ++s) prefetch(s);
  for (int64_t step = 0; step < steps; ++step) {
    if (step + 1 < steps) decode(step + 1);
    prefetch(step + kAhead);
    asm volatile("" ::: "memory");  // the tile loads (asm without a memory operand) read the stores above
    const Step st = step_of(step);
    if (st.k0 == 0) std::fill(acc_buffer.begin(), acc_buffer.end(), 0.0f);
    for (int64_t b = 0; b < act.blocks; ++b) {
      float* acc = acc_buffer.data() + b * kAmxTileRows * kMp;
      for (int64_t sb = 0; sb < st.supers; ++sb) {
        const int64_t super = st.k0 / 256 + sb;
        const int32_t* x_tile = act.vnni.data() + (b * (K / 4) + super * 64) * kWidth;
        const int8_t* w_tile = quants[step % 2][0] + 256 * sb;
        constexpr int64_t kLdb = kWidth * 4, kStepB = kK / 4 * kWidth;
        if constexpr (kPlanes) {
          // hi (tmm0) and lo (tmm1) planes of the 4 x 64 weights, the two halves of K in C tiles 4, 5 and 6, 7
          const int8_t* lo_tile = w_tile + kChunk;
          _tile_zero(4); _tile_zero(5); _tile_zero(6); _tile_zero(7);
          _tile_loadd(2, x_tile, kLdb); _tile_loadd(0, w_tile, kLda); _tile_dpbssd(4, 0, 2); _tile_loadd(1, lo_tile, kLda); _tile_dpbusd(5, 1, 2);
          _tile_loadd(3, x_tile + kStepB, kLdb); _tile_loadd(0, w_tile + 64, kLda); _tile_dpbssd(6, 0, 3); _tile_loadd(1, lo_tile + 64, kLda); _tile_dpbusd(7, 1, 3);
          _tile_loadd(2, x_tile + 2 * kStepB, kLdb); _tile_loadd(0, w_tile + 128, kLda); _tile_dpbssd(4, 0, 2); _tile_loadd(1, lo_tile + 128, kLda); _tile_dpbusd(5, 1, 2);
          _tile_loadd(3, x_tile + 3 * kStepB, kLdb); _tile_loadd(0, w_tile + 192, kLda); _tile_dpbssd(6, 0, 3); _tile_loadd(1, lo_tile + 192, kLda); _tile_dpbusd(7, 1, 3);
          _tile_stored(4, products[0], kLdb); _tile_stored(5, products[1], kLdb);
          _tile_stored(6, products[2], kLdb); _tile_stored(7, products[3], kLdb);
        } else {
          // four groups in flight (C tiles 4-7, A and B alternating between two tiles each)
          for (int q = 0; q < kGroups; q += 4) {
            _tile_zero(4); _tile_zero(5); _tile_zero(6); _tile_zero(7);
            _tile_loadd(0, w_tile + kK * q, kLda); _tile_loadd(2, x_tile + kStepB * q, kLdb); _tile_dpbssd(4, 0, 2);
            _tile_loadd(1, w_tile + kK * (q + 1), kLda); _tile_loadd(3, x_tile + kStepB * (q + 1), kLdb); _tile_dpbssd(5, 1, 3);
            _tile_loadd(0, w_tile + kK * (q + 2), kLda); _tile_loadd(2, x_tile + kStepB * (q + 2), kLdb); _tile_dpbssd(6, 0, 2);
            _tile_loadd(1, w_tile + kK * (q + 3), kLda); _tile_loadd(3, x_tile + kStepB * (q + 3), kLdb); _tile_dpbssd(7, 1, 3);
            _tile_stored(4, products[q], kLdb); _tile_stored(5, products[q + 1], kLdb);
            _tile_stored(6, products[q + 2], kLdb); _tile_stored(7, products[q + 3], kLdb);
          }
        }
        const AmxScales& s = scales[step % 2][sb];
        __m512i total[kMp];  // one integer total per output, lanes as column_of
        if constexpr (kPlanes) {  // C: [16 weight rows][kMp rows], the lanes of column_of: 256 * hi + lo
#pragma GCC unroll 16
          for (int j = 0; j < kMp; ++j) {
            auto product = [&](int c) { return _mm512_load_si512((const void*)(products[c] + 16 * j)); };
            total[j] = _mm512_add_epi32(_mm512_slli_epi32(_mm512_add_epi32(product(0), product(2)), 8), _mm512_add_epi32(product(1), product(3)));
          }
        } else {
          __m512i lanes[kWidth];  // scale * product summed over the groups, lanes as in `products`
#pragma GCC unroll 16
          for (int j = 0; j < kWidth; ++j) {
            lanes[j] = _mm512_setzero_si512();
#pragma GCC unroll 16
            for (int q = 0; q < kGroups; ++q)
              lanes[j] = _mm512_add_epi32(lanes[j], _mm512_mullo_epi32(_mm512_load_si512((const void*)(products[q] + 16 * j)), group_scales(s, q, j)));
          }
          // add the group's sub-blocks (128-bit blocks of mp = 4 rows, or 256-bit halves of 8)
          if constexpr (kGroup == 1) {
#pragma GCC unroll 16
            for (int j = 0; j < kMp; ++j) total[j] = lanes[j];
          } else if constexpr (kMp == 8) {  // lanes[j]: column j, halves = sub-blocks
#pragma GCC unroll 8
            for (int i = 0; i < 8; ++i)
              total[i] = _mm512_add_epi32(_mm512_shuffle_i64x2(lanes[2 * i], lanes[2 * i + 1], 0x44), _mm512_shuffle_i64x2(lanes[2 * i], lanes[2 * i + 1], 0xee));
          } else {  // mp 4: lanes[j]: columns 2j, 2j + 1, blocks (column, sub-block)
#pragma GCC unroll 4
            for (int i = 0; i < 4; ++i)
              total[i] = _mm512_add_epi32(_mm512_shuffle_i32x4(lanes[2 * i], lanes[2 * i + 1], 0x88), _mm512_shuffle_i32x4(lanes[2 * i], lanes[2 * i + 1], 0xdd));
          }
        }
        const __m512 dx = _mm512_loadu_ps(act.dx.data() + (b * supers + super) * 16);
        [[maybe_unused]] __m512i bsum_pairs[4];
        if constexpr (Fmt::kHasMin)
          for (int p = 0; p < 4; ++p)
            bsum_pairs[p] = _mm512_loadu_si512((const void*)(act.bsum_pairs.data() + ((b * supers + super) * 4 + p) * 16));
#pragma GCC unroll 16
        for (int j = 0; j < kMp; ++j) {
          __m512 sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total[j]), _mm512_mul_ps(_mm512_permutexvar_ps(column_of[j], s.d), dx),
                                       _mm512_loadu_ps(acc + 16 * j));
          if constexpr (Fmt::kHasMin) {
            __m512i mins = _mm512_setzero_si512();
            for (int p = 0; p < 4; ++p) mins = _mm512_dpwssd_epi32(mins, _mm512_permutexvar_epi32(column_of[j], s.min_pairs[p]), bsum_pairs[p]);
            sum = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(mins), _mm512_mul_ps(_mm512_permutexvar_ps(column_of[j], s.dmin), dx), sum);
          }
          _mm512_storeu_ps(acc + 16 * j, sum);
        }
      }
    }
    if (st.k0 + kChunk < K) continue;
    for (int64_t b = 0; b < act.blocks; ++b) {  // the tile's last K-chunk: write its outputs
      const float* acc = acc_buffer.data() + b * kAmxTileRows * kMp;
      for (int m = 0; m < kMp && b * kAmxBlockRows + m < job.M; ++m) {
        float* y = job.y + (b * kAmxBlockRows + m) * job.N + st.n0;
        for (int c = 0; c < st.rows; ++c) {
          float value = acc[c * kMp + m];
          if (job.bias) value += job.bias[st.n0 + c];
          y[c] = value;
        }
      }
    }
  }
  _tile_release();
}

}  // namespace

template <typename Fmt>
std::array<tiles_fn, 3> amx_tiles_of() {
  if constexpr (Fmt::kA8Block == 256) return {amx_tiles<Fmt, 4>, amx_tiles<Fmt, 8>, amx_tiles<Fmt, 16>};
  else return {nullptr, nullptr, nullptr};
}
#define SG_INSTANTIATE(type_id, Fmt) template std::array<tiles_fn, 3> amx_tiles_of<Fmt>();
SG_GGUF_FORMATS(SG_INSTANTIATE)
#undef SG_INSTANTIATE

bool amx_applies(const BlockFormat& f, int ggml_type, int64_t M) {
  return g_amx_on.load() && f.run_tiles_amx[0] && M >= amx_min_rows(ggml_type);
}

int run_amx_linear(LinearJob& job, const BlockFormat& f, int ggml_type, int num_threads) {
  const int mp = job.M <= 4 ? 4 : job.M <= 8 ? 8 : 16;
  AmxActivations act;
  prepare_amx_activations(job.xq, job.M, job.K, mp, amx_group(ggml_type == 14, mp), 32, act);
  const AmxJob amx{&act};
  job.ctx = &amx;
  job.run_tiles = f.run_tiles_amx[mp == 4 ? 0 : mp == 8 ? 1 : 2];
  job.num_tiles = (job.N + kAmxTileRows - 1) / kAmxTileRows;
  return run_job(job, num_threads, job.M * job.N * job.K);
}
#endif

}  // namespace sg

using namespace sg;

extern "C" {

// AMX for the a8 K-quants at >= 3 rows (Q6_K >= 5): `on` = 1 asks for it (the first time, the kernel requests
// the tile state from Linux: arch_prctl ARCH_REQ_XCOMP_PERM), 0 turns it off. Returns whether it
// is on now: 0 when the build or the CPU lacks AMX or Linux refused. The bits are the same either way.
// min_rows > 0 replaces the measured row thresholds (tests: every row count on AMX); 0 restores them.
int sg_set_amx(int on, int64_t min_rows) {
  g_amx_min_rows.store(std::max<int64_t>(0, min_rows));
#ifdef SG_AMX
  static const bool granted = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((d >> 24) & 1) || !((d >> 25) & 1)) return false;  // AMX-TILE, AMX-INT8
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
  }();
  g_amx_on.store(on && granted ? 1 : 0);
  return g_amx_on.load();
#else
  (void)on;
  return 0;
#endif
}
int sg_amx() { return g_amx_on.load(); }

}  // extern "C"
