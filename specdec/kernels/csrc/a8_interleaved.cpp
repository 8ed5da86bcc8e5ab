// a8 linears from a copy of the weights interleaved 16 output columns wide (AVX-512 VNNI builds) or
// 8 wide (the 256-bit builds): one vector holds 4 consecutive weights of every column of a group,
// multiplied by ONE broadcast group of 4 activations, and int32 lane c is column c's running sum: no
// horizontal sums, the scale multiplies shared by the group's columns, and the unpacking shared by
// every row of the call. The K-quants (Q4_K, Q6_K) and the 32-weight formats (Q4_0, Q4_1, Q5_0, Q8_0;
// Q8_0 not on the plain AVX2 build, whose byte products cannot hold its quants: see Block32Layout).
//
// Why: a verify row on the raw-block tiles costs ~90-140 vector instructions per 1,024 multiply-adds
// (lanes of one column transposed and summed, scales applied per 4 weights); here ~23 (Q4_K) or ~34
// (Q6_K) on AVX-512 VNNI and ~70-80 on AVX2 (docs/performance.md).
//
// Bits: the integer totals per 256 weights and column (sum over sub-blocks of sc * (q . x), of m *
// bsum, of -32 * sc * bsum16 for Q6_K) are the same integers the raw-block tiles compute (exact, any
// order), and each output takes the same float steps in the same order (a8.cpp's header), so the
// outputs are bitwise those of sg_linear_gguf_a8 on the original blocks, on any row count and split.
// The 32-weight formats keep the raw tiles' 8 float lanes per output (lane j: the products of
// weights 4j..4j+3 of each block, fma'd block by block in K order) as 8 accumulators whose lanes are
// columns, summed at the end in hsum256's tree, then the min terms: the same float steps.
//
// Layout, C = 16 (zmm) or 8 (ymm) columns per group: per group its super-blocks in K order, one tile
// each (aligned to the vector); columns past N (the last group when N % C != 0) are zero (d = 0),
// their outputs never stored.
//   Q4_K (148 C bytes): d fp16[C] | dmin fp16[C] | sc u8[8][C] | m u8[4][C][2] (sub-blocks 2p, 2p + 1
//     per column) | 8 sub-blocks x 4 vectors of 4 C bytes: byte 4c + i of vector (s, j) holds column
//     c's quant 32 s + 4 j + i in its low nibble and 32 s + 16 + 4 j + i in its high nibble
//   Q6_K (212 C bytes): d fp16[C] | 2 C zero | sc i8[8][C][2] (groups 2s, 2s + 1 per column) | 8
//     sub-blocks x 6 vectors: 4 as Q4_K's (the low 4 bits of u = q + 32), then two whose byte
//     4c + i holds the high 2 bits of quant 32 s + 4 j + i (resp. 32 s + 16 + 4 j + i) at bits 2j
//   32-weight formats, per block of 32: d fp16[C] | m fp16[C] (Q4_1; zero otherwise) | the quants as
//     unsigned u = q + kA8QuantOffset (each int32 lane's start, -offset x its 4 activations summed,
//     comes from the row: Args::starts): Q8_0 8 vectors of 4 C bytes, byte 4c + i of vector j = column
//     c's u of weight 4j + i (36 C bytes); Q4_0 / Q4_1 / Q5_0 4 vectors whose byte 4c + i holds weight
//     4j + i in its low nibble and 4(j + 4) + i in its high one (20 C bytes), and Q5_0 8 bit planes of 4
//     C bits, bit 4c + i of plane j = the fifth bit of column c's weight 4j + i (24 C bytes; its blocks
//     hold 22 C)
#include "skinny_gemm.h"
#include "a8_int.h"

namespace sg {
namespace {

#ifdef SG_A8_ZMM
constexpr int kCols = 16, kMaxRows = 8;
#else
constexpr int kCols = 8, kMaxRows = 4;
#endif
// 1 and 2 rows walk two column groups at once: two weight streams per thread (one stream left a
// 1-row Q6_K step ~10 % below the raw blocks' speed) and twice the independent sums
constexpr int kPairedRows = 2;
// The fewest rows for which the copy beats the raw blocks (callers run fewer on the blocks): one row
// is bound by memory on both, and on the 256-bit builds the 2-row tiles measured ~10 % slower (the
// 1.5B's T(2), AVX2 build: 74.6-75.7 ms on the blocks, 83.3-84.9 on the copy; from 3 rows the copy wins)
#ifdef SG_A8_ZMM
constexpr int kMinRows = 2;
#else
constexpr int kMinRows = 3;
#endif

struct Args {
  const uint8_t* group;  // the first group's first tile (a second group follows its `blocks` tiles)
  int64_t blocks;        // K / the format's block (256 or 32)
  const uint8_t* xq;     // MR activation rows (a8_row_bytes(K) apart)
  int64_t ldxq, K;
  const int32_t* starts; // 32-weight formats with an offset: per row K / 4 lane starts (K / 4 apart), else null
  const float* bias;     // the first group's columns or null
  float* y;              // [MR, ldy] at the first group's first column
  int64_t ldy;
  int n_cols;            // columns of the last group that exist (C but in the matrix's last group)
};

// the weight stream kPrefetch tiles ahead, one share of the tile's lines per sub-block s: with three
// or more rows the arithmetic per byte leaves the hardware prefetcher behind (T(8) of the 1.5B 72 ms
// with, 94 without); one or two rows (two streams) run faster without
constexpr int kPrefetch = 4;
template <int64_t kTileBytes>
inline void prefetch_ahead(const uint8_t* t, int s) {
  constexpr int kLines = (int)((kTileBytes / 64 + 7) / 8);
#pragma GCC unroll 8
  for (int l = 0; l < kLines; ++l) _mm_prefetch((const char*)(t + kPrefetch * kTileBytes + 64 * (kLines * s + l)), _MM_HINT_T0);
}

// A tile's activation rows: each row's quants, scales per block, scaled sums (ds), sums per 32 and per 16
// (A8Row views), and the first tile of each of its NG groups for super-block kb.
template <int MR>
struct TileRows {
  const uint8_t* q[MR];
  const float* dx[MR];
  const float* ds[MR];
  const int16_t* bsum[MR];
  const int16_t* bsum16[MR];
  explicit TileRows(const Args& a) {
    for (int r = 0; r < MR; ++r) {
      const A8Row row(a.xq + r * a.ldxq, a.K);
      q[r] = row.q, dx[r] = row.d, ds[r] = row.ds, bsum[r] = row.bsum, bsum16[r] = row.bsum16;
    }
  }
};
template <int64_t kTileBytes, int NG>
inline void group_tiles(const Args& a, int64_t kb, const uint8_t* (&t)[NG]) {
  for (int g = 0; g < NG; ++g) t[g] = a.group + (g * a.blocks + kb) * kTileBytes;
}

// The raw blocks into the tiles (the same for both widths): column c's block b into tile t.
struct Q4KLayout {
  static constexpr int64_t kWeights = 256;
  static constexpr bool kTwoGroups = true;  // 1-2 rows walk two column groups at once
  static constexpr int64_t kBlockBytes = 144, kHeadBytes = 20 * kCols, kSubBytes = 16 * kCols;
  static constexpr int64_t kTileBytes = kHeadBytes + 8 * kSubBytes;
  static constexpr int64_t kScales = 4 * kCols, kMins = 12 * kCols;
  // ggml's block_q4_K: d, dmin fp16, 12 bytes of 6-bit sc / m, qs[128]
  static void repack(const uint8_t* b, int c, uint8_t* t) {
    std::memcpy(t + 2 * c, b, 2), std::memcpy(t + 2 * kCols + 2 * c, b + 2, 2);
    const uint8_t* s6 = b + 4;
    for (int s = 0; s < 8; ++s) {
      const int sc = s < 4 ? s6[s] & 63 : (s6[s + 4] & 0xF) | ((s6[s - 4] >> 6) << 4);
      const int m = s < 4 ? s6[s + 4] & 63 : (s6[s + 4] >> 4) | ((s6[s] >> 6) << 4);
      t[kScales + kCols * s + c] = (uint8_t)sc, t[kMins + 2 * kCols * (s / 2) + 2 * c + s % 2] = (uint8_t)m;
    }
    const uint8_t* qs = b + 16;  // quant 64 p + i: low nibble of qs[32 p + i] (i < 32), high of qs[32 p + i - 32]
    auto quant = [&](int k) { return (qs[32 * (k / 64) + k % 32] >> (4 * (k % 64 / 32))) & 0xF; };
    for (int s = 0; s < 8; ++s)
      for (int j = 0; j < 4; ++j)
        for (int i = 0; i < 4; ++i)
          t[kHeadBytes + kSubBytes * s + 4 * kCols * j + 4 * c + i] =
              (uint8_t)(quant(32 * s + 4 * j + i) | (quant(32 * s + 16 + 4 * j + i) << 4));
  }
};

struct Q6KLayout {
  static constexpr int64_t kWeights = 256;
  static constexpr bool kTwoGroups = true;
  static constexpr int64_t kBlockBytes = 210, kHeadBytes = 20 * kCols, kSubBytes = 24 * kCols;
  static constexpr int64_t kTileBytes = kHeadBytes + 8 * kSubBytes;
  static constexpr int64_t kScales = 4 * kCols, kHighA = 16 * kCols, kHighB = 20 * kCols;  // kHigh*: within a sub-block
  // quant k of ggml's block_q6_K (ql[128], qh[64], sc int8[16], d fp16) as u = q + 32 (0..63)
  static int quant(const uint8_t* b, int k) {
    const int h = k / 128, r = k % 128;
    return ((b[64 * h + r % 64] >> (4 * (r / 64))) & 0xF) | ((b[128 + 32 * h + r % 32] >> (2 * (r / 32))) & 3) << 4;
  }
  static void repack(const uint8_t* b, int c, uint8_t* t) {
    std::memcpy(t + 2 * c, b + 208, 2);
    for (int g = 0; g < 16; ++g) t[kScales + 2 * kCols * (g / 2) + 2 * c + g % 2] = b[192 + g];
    for (int s = 0; s < 8; ++s) {
      uint8_t* sub = t + kHeadBytes + kSubBytes * s;
      for (int j = 0; j < 4; ++j)
        for (int i = 0; i < 4; ++i) {
          const int first = quant(b, 32 * s + 4 * j + i), second = quant(b, 32 * s + 16 + 4 * j + i);
          sub[4 * kCols * j + 4 * c + i] = (uint8_t)((first & 0xF) | (second & 0xF) << 4);
          sub[kHighA + 4 * c + i] |= (uint8_t)((first >> 4) << (2 * j));
          sub[kHighB + 4 * c + i] |= (uint8_t)((second >> 4) << (2 * j));
        }
    }
  }
};

// The 32-weight formats' tile (see the layout above). Fmt: skinny_gemm's format (quants32, the offset).
template <typename Fmt>
struct Block32Layout {
  static constexpr int64_t kWeights = 32;
  static constexpr bool kTwoGroups = false;  // 8 float accumulators per row leave no room for a second group
  static constexpr int kOffset = Fmt::kA8QuantOffset;
  static constexpr bool kHasMin = Fmt::kHasMin;
  static constexpr bool kNibbles = kOffset != 128;  // Q4_0, Q4_1, Q5_0: 4-bit fields (Q5_0: + a bit plane)
  static constexpr bool kFifthBit = kOffset == 16;   // Q5_0
  static constexpr int64_t kBlockBytes = Fmt::kBytes, kHeadBytes = 4 * kCols;
  static constexpr int64_t kQuantBytes = kNibbles ? 16 * kCols : 32 * kCols, kBitsBytes = kFifthBit ? 4 * kCols : 0;
  static constexpr int64_t kTileBytes = kHeadBytes + kQuantBytes + kBitsBytes;
  // The raw tiles of the 4/5-bit formats are bound by their arithmetic even at one row, their copy
  // (the blocks' bytes or ~10 % more) by memory: it runs every row count. Q8_0's copy (36 bytes per 32 weights where its blocks hold 34) gained nothing
  // below 8 rows (docs/performance.md).
  static constexpr int kMinRows = kNibbles ? 1 : 8;
  // the byte products: vpdpbusd where the build has VNNI; otherwise vpmaddubsw pairs, exact only while
  // 2 * u * 127 fits int16, which Q8_0's u = q + 128 does not (that build keeps it on the raw blocks)
#if defined(SG_A8_ZMM) || defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
  static constexpr bool kAvailable = true;
#else
  static constexpr bool kAvailable = kNibbles;  // Q8_0's u reaches 255; the others' 31
#endif
  static void repack(const uint8_t* b, int c, uint8_t* t) {  // t zeroed
    std::memcpy(t + 2 * c, b, 2);
    if constexpr (kHasMin) std::memcpy(t + 2 * kCols + 2 * c, b + 2, 2);
    alignas(32) uint32_t u[8];  // u[j]: the unsigned quants of weights 4j..4j+3, a byte each
    _mm256_store_si256((__m256i*)u, _mm256_add_epi8(Fmt::quants32(b, 0), _mm256_set1_epi8((char)kOffset)));
    uint8_t* quants = t + kHeadBytes;
    for (int j = 0; j < (kNibbles ? 4 : 8); ++j) {
      // each byte <= 15 after the mask, so the shift moves nibbles within their bytes
      const uint32_t word = kNibbles ? (u[j] & 0x0F0F0F0Fu) | (u[j + 4] & 0x0F0F0F0Fu) << 4 : u[j];
      std::memcpy(quants + 4 * kCols * j + 4 * c, &word, 4);
    }
    if constexpr (kFifthBit)  // plane j, bits 4c..4c+3: byte c / 2, nibble c % 2
      for (int j = 0; j < 8; ++j) {
        const uint32_t high = (u[j] >> 4) & 0x01010101u;  // the fifth bit of each byte, at its bit 0
        const uint32_t nibble = (high | high >> 7 | high >> 14 | high >> 21) & 0xFu;
        quants[kQuantBytes + kCols / 2 * j + c / 2] |= (uint8_t)(nibble << (4 * (c % 2)));
      }
  }
};

#ifdef SG_A8_ZMM
#include "a8_interleaved_zmm.h"
#else
#include "a8_interleaved_ymm.h"
#endif

using tile_fn_x = void (*)(const Args&);
template <typename Fmt, int NG, std::size_t... I>
constexpr std::array<tile_fn_x, sizeof...(I)> interleaved_tiles(std::index_sequence<I...>) {
  return {Fmt::template tile<(int)I + 1, NG>...};
}

template <typename Fmt>
void run_groups(const LinearJob& job, int64_t g_begin, int64_t g_end) {
  static constexpr auto kTiles = interleaved_tiles<Fmt, 1>(std::make_index_sequence<kMaxRows>{});
  const int64_t blocks = job.K / Fmt::kWeights, ldxq = a8_row_bytes(job.K);
  const int32_t* starts = (const int32_t*)job.ctx;  // lane starts of the 32-weight formats, or null
  const int step = Fmt::kTwoGroups && job.M <= kPairedRows ? 2 : 1;
  for (int64_t g = g_begin; g < g_end; g += step) {
    const int ng = (int)std::min<int64_t>(step, g_end - g);
    for (int64_t r = 0; r < job.M; r += kMaxRows) {  // the group's tiles stay in L2 for every row block
      const int mr = (int)std::min<int64_t>(kMaxRows, job.M - r);
      const Args args{job.w + g * blocks * Fmt::kTileBytes, blocks, job.xq + r * ldxq, ldxq, job.K,
                      starts ? starts + r * (job.K / 4) : nullptr,
                      job.bias ? job.bias + kCols * g : nullptr, job.y + r * job.N + kCols * g, job.N,
                      (int)std::min<int64_t>(kCols, job.N - kCols * (g + ng - 1))};
      tile_fn_x tile = kTiles[mr - 1];
      if constexpr (Fmt::kTwoGroups) {
        static constexpr auto kPairedTiles = interleaved_tiles<Fmt, 2>(std::make_index_sequence<kPairedRows>{});
        if (ng == 2) tile = kPairedTiles[mr - 1];
      }
      tile(args);
    }
  }
}

// groups [g_begin, g_end) of job.w (the raw blocks, [N, K / block blocks]) into job.ctx (the copy)
template <typename Fmt>
void repack_groups(const LinearJob& job, int64_t g_begin, int64_t g_end) {
  const int64_t blocks = job.K / Fmt::kWeights, row_bytes = blocks * Fmt::kBlockBytes;
  uint8_t* out = (uint8_t*)job.ctx;
  for (int64_t g = g_begin; g < g_end; ++g)
    for (int64_t kb = 0; kb < blocks; ++kb) {
      uint8_t* t = out + (g * blocks + kb) * Fmt::kTileBytes;
      std::memset(t, 0, Fmt::kTileBytes);
      for (int c = 0; c < std::min<int64_t>(kCols, job.N - kCols * g); ++c)
        Fmt::repack(job.w + (kCols * g + c) * row_bytes + kb * Fmt::kBlockBytes, c, t);
    }
}

struct InterleavedFormat {
  int64_t tile_bytes, weights;  // a tile's bytes; the weights of a column per tile (the format's block)
  int offset;                   // 32-weight formats: the quants' offset (the rows' lane starts), else 0
  int min_rows;                 // the fewest rows for which the copy beats the raw blocks
  void (*repack_groups)(const LinearJob&, int64_t, int64_t);
  void (*run_groups)(const LinearJob&, int64_t, int64_t);
};
template <typename Fmt>
constexpr InterleavedFormat interleaved_format(int offset = 0, int min_rows = kMinRows) {
  return {Fmt::kTileBytes, Fmt::kWeights, offset, min_rows, repack_groups<Fmt>, run_groups<Fmt>};
}
template <typename Fmt>
const InterleavedFormat* block32_format() {
  using Tiles = Block32Tiles<Fmt>;
  static constexpr InterleavedFormat kFormat = interleaved_format<Tiles>(Tiles::kOffset, Tiles::kMinRows);
  return Tiles::kAvailable ? &kFormat : nullptr;
}

const InterleavedFormat* find_interleaved_format(int ggml_type) {
  static constexpr InterleavedFormat kQ4K = interleaved_format<Q4KTiles>(), kQ6K = interleaved_format<Q6KTiles>();
  switch (ggml_type) {  // GGML_TYPE_*
    case 2: return block32_format<Q4_0Format>();
    case 3: return block32_format<Q4_1Format>();
    case 6: return block32_format<Q5_0Format>();
    case 8: return block32_format<Q8_0Format>();
    case 12: return &kQ4K;
    case 14: return &kQ6K;
    default: return nullptr;
  }
}

// Each row's int32 lane starts for a format whose quants carry `offset`: -offset x the sum of every
// 4 activation quants (so vpdpbusd of the unsigned u = q + offset gives exactly q . x per lane)
std::vector<int32_t> lane_starts(const uint8_t* xq, int64_t M, int64_t K, int offset) {
  std::vector<int32_t> starts((size_t)(M * (K / 4)));
  for (int64_t r = 0; r < M; ++r) {
    const int8_t* q = (const int8_t*)(xq + r * a8_row_bytes(K));
    for (int64_t l = 0; l < K / 4; ++l) starts[r * (K / 4) + l] = -offset * (q[4 * l] + q[4 * l + 1] + q[4 * l + 2] + q[4 * l + 3]);
  }
  return starts;
}

}  // namespace
}  // namespace sg

using namespace sg;

extern "C" {

// Columns per group of this build's interleaved copy (16 or 8).
int sg_interleaved_cols() { return kCols; }

// Rows from which a linear of `ggml_type` should run on the copy rather than on the raw blocks (same
// bits either way); 0 when this build has no copy of the format.
int sg_interleaved_min_rows(int ggml_type) {
  const InterleavedFormat* f = find_interleaved_format(ggml_type);
  return f ? f->min_rows : 0;
}

// Bytes of the interleaved copy of an [N, K] matrix of `ggml_type`, or 0 when there is none (a
// format without a copy on this build, or K not a multiple of its block).
int64_t sg_interleaved_bytes(int ggml_type, int64_t N, int64_t K) {
  const InterleavedFormat* f = find_interleaved_format(ggml_type);
  return f && N > 0 && K > 0 && K % f->weights == 0 ? (N + kCols - 1) / kCols * (K / f->weights) * f->tile_bytes : 0;
}

// w [N, K / block blocks] of `ggml_type` -> out [sg_interleaved_bytes(ggml_type, N, K)], 64-byte aligned.
int sg_interleave(int ggml_type, const uint8_t* w, int64_t N, int64_t K, uint8_t* out, int num_threads) {
  if (!sg_interleaved_bytes(ggml_type, N, K) || !w || !out || (uintptr_t)out % 64) return 1;
  LinearJob job{nullptr, 0, K, w, 0, nullptr, N, nullptr, nullptr, 0, (N + kCols - 1) / kCols,
                find_interleaved_format(ggml_type)->repack_groups};
  job.ctx = out;
  return run_job(job, num_threads, N * K);
}

// y [M, N] = the a8 linear of x [M, K] with the interleaved copy (sg_interleave): bitwise
// sg_linear_gguf_a8 on the original blocks.
int sg_linear_interleaved_a8(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, int ggml_type,
                             const float* bias, float* y, int num_threads) {
  if (!sg_interleaved_bytes(ggml_type, N, K)) return 1;
  int status;
  if (bad_shape(x, M, K, w, N, y, &status)) return status;
  const InterleavedFormat* f = find_interleaved_format(ggml_type);
  std::vector<uint8_t> xq((size_t)(M * a8_row_bytes(K)));  // natural order (no SG_A8_PAIRED interleave)
  quantize_a8_rows(x, M, K, (int)f->weights, xq.data());
  const std::vector<int32_t> starts = f->offset ? lane_starts(xq.data(), M, K, f->offset) : std::vector<int32_t>();
  LinearJob job{x, M, K, w, 0, nullptr, N, bias, y, 0, (N + kCols - 1) / kCols, f->run_groups};
  job.xq = xq.data();
  job.ctx = f->offset ? (void*)starts.data() : nullptr;
  return run_job(job, num_threads, M * N * K);
}

}  // extern "C"
