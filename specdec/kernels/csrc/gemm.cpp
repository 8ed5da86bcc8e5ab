// fp32-activation tiles (micro_tile; column_tile for the K-quants on AVX2) for every weight format,
// the exact mode's decoded form, and the dense linears: sg_linear_f32 (fp32 weights) and
// sg_linear_i8 (weight-only int8).
#include "skinny_gemm.h"

namespace sg {
namespace {

constexpr int64_t kLine = 64;  // bytes per cache line

// The first cache line micro_tile prefetches in this K range (a byte offset in each w row; none:
// INT64_MAX): the next line at or after the range's start that is row block pf_phase's to fetch.
template <typename Fmt>
int64_t first_prefetch(const TileArgs& a) {
  if (!a.prefetch) return INT64_MAX;
  const int64_t line = a.k_begin / Fmt::kBlock * Fmt::kBytes / kLine;
  return (line + ((a.pf_phase - line % a.pf_stride) % a.pf_stride + a.pf_stride) % a.pf_stride) * kLine;
}

// Prefetch this block's share of the lines up to the end of the block at `offset` (in every column).
template <typename Fmt, int NR>
void prefetch_block(const TileArgs& a, int64_t offset, int64_t& next_prefetch) {
  while (next_prefetch < offset + Fmt::kBytes) {
#pragma GCC unroll 8
    for (int c = 0; c < NR; ++c) _mm_prefetch((const char*)(a.prefetch + c * a.ldw + next_prefetch), _MM_HINT_T1);
    next_prefetch += a.pf_stride * kLine;
  }
}

// y[r, c] = hsum(acc) [* scale[c] for int8] [+ bias[c]]
inline void finish_output(const TileArgs& a, int r, int c, vec acc) {
  float value = vhsum(acc);
  if (a.scale) value *= a.scale[c];
  if (a.bias) value += a.bias[c];
  a.y[r * a.ldy + c] = value;
}

// One MR x NR block of outputs, each a full-K dot product with its own accumulator:
// y = hsum(acc) [* scale[j] for int8] [+ bias[j]]. Splitting K into ranges only parks the
// accumulators in memory in between (exact), so the arithmetic is the same as in one call.
// `prefetch`: the same rows of a tile further down the stream, pulled into L2 while this tile is
// computed. On cold weights this keeps more DRAM requests in flight than the hardware
// prefetcher alone (measured: 1-row calls ~1.3-1.7x faster). With several row blocks, block
// `pf_phase` of `pf_stride` fetches every pf_stride-th cache line, so the fetches spread over
// all blocks and overlap their compute.
template <typename Fmt, int MR, int NR>
void micro_tile(const TileArgs& a) {
  vec acc[MR][NR];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < NR; ++c) acc[r][c] = a.k_begin == 0 ? vzero() : vload(a.saved + (r * NR + c) * kSavedFloats);
  const int64_t k_full = Fmt::kTail ? a.K - a.K % V : a.K;
  const int64_t loop_end = std::min(a.k_end, k_full);
  int64_t next_prefetch = first_prefetch<Fmt>(a);
  for (int64_t kb = a.k_begin; kb < loop_end; kb += Fmt::kBlock) {
    const int64_t offset = kb / Fmt::kBlock * Fmt::kBytes;  // of this block in each w row
    prefetch_block<Fmt, NR>(a, offset, next_prefetch);
    typename Fmt::Scales scales[NR];
#pragma GCC unroll 8
    for (int c = 0; c < NR; ++c) Fmt::prepare(a.w + c * a.ldw + offset, scales[c]);
#pragma GCC unroll 32
    for (int e = 0; e < Fmt::kBlock; e += V) {
      vec wv[NR];
#pragma GCC unroll 8
      for (int c = 0; c < NR; ++c) wv[c] = Fmt::load(a.w + c * a.ldw + offset, scales[c], e);
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        const vec xv = vload(a.x + r * a.ldx + kb + e);
#pragma GCC unroll 8
        for (int c = 0; c < NR; ++c) acc[r][c] = vfma(xv, wv[c], acc[r][c]);
      }
    }
  }
  if (a.k_end < a.K) {
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
      for (int c = 0; c < NR; ++c) vstore(a.saved + (r * NR + c) * kSavedFloats, acc[r][c]);
    return;
  }
  if constexpr (Fmt::kTail) {
    if (a.K % V) {
      const tail_mask m = make_tail_mask(a.K % V);
      const int64_t offset = k_full / Fmt::kBlock * Fmt::kBytes;
      vec wv[NR];
#pragma GCC unroll 8
      for (int c = 0; c < NR; ++c) wv[c] = Fmt::load_tail(a.w + c * a.ldw + offset, a.K % V, m);
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        const vec xv = vload_tail(a.x + r * a.ldx + k_full, m);
#pragma GCC unroll 8
        for (int c = 0; c < NR; ++c) acc[r][c] = vfma(xv, wv[c], acc[r][c]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < NR; ++c) finish_output(a, r, c, acc[r][c]);
}

// AVX2, K-quants (Q4_K, Q5_K, Q6_K): micro_tile's FMAs, walked one column at a time per super-block.
// micro_tile holds all MR x NR accumulators while it unpacks every column's weights, and on AVX2's 16
// ymm registers the unpacking does not fit beside 12 accumulators: the 4 x 3 tiles made 854 (Q4_K),
// 1267 (Q5_K), 1116 (Q6_K) stack accesses per super-block. Here the accumulators live in a.saved
// (as between K ranges): per super-block and column, fma_by_column loads the column's MR
// accumulators, runs the column's weight vectors through them in K order (x read from L1 by the
// FMAs) and stores them back; the stack accesses left are 0 / 97 / 146 (128-bit weight bytes).
// Every output sees the same FMAs on the same values in the same order (rule 4).
template <typename Fmt>
constexpr bool kByColumn = V == 8 && Fmt::kBlock == 256;

// One column c of the tile over the super-block at byte `offset` (weights kb .. kb + 255 of each row).
template <typename Fmt, int MR, int NR>
void fma_by_column(const TileArgs& a, int c, int64_t kb, int64_t offset) {
  const uint8_t* block = a.w + c * a.ldw + offset;
  typename Fmt::Scales scales;
  Fmt::prepare(block, scales);
  auto saved = [&](int r) { return a.saved + (r * NR + c) * kSavedFloats; };
  vec acc[MR];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) acc[r] = vload(saved(r));
#pragma GCC unroll 32
  for (int e = 0; e < Fmt::kBlock; e += V) {
    const vec wv = Fmt::load(block, scales, e);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) acc[r] = vfma(vload(a.x + r * a.ldx + kb + e), wv, acc[r]);
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) vstore(saved(r), acc[r]);
}

template <typename Fmt, int MR, int NR>
void column_tile(const TileArgs& a) {
  if (a.k_begin == 0)
#pragma GCC unroll 8
    for (int i = 0; i < MR * NR; ++i) vstore(a.saved + i * kSavedFloats, vzero());
  int64_t next_prefetch = first_prefetch<Fmt>(a);
  for (int64_t kb = a.k_begin; kb < a.k_end; kb += Fmt::kBlock) {
    const int64_t offset = kb / Fmt::kBlock * Fmt::kBytes;
    prefetch_block<Fmt, NR>(a, offset, next_prefetch);
#pragma GCC unroll 8
    for (int c = 0; c < NR; ++c) fma_by_column<Fmt, MR, NR>(a, c, kb, offset);
  }
  if (a.k_end < a.K) return;
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < NR; ++c) finish_output(a, r, c, vload(a.saved + (r * NR + c) * kSavedFloats));
}

template <typename Fmt, int MR, int NR>
constexpr tile_fn exact_tile() {
  if constexpr (kByColumn<Fmt>) return column_tile<Fmt, MR, NR>;
  return micro_tile<Fmt, MR, NR>;
}

template <typename Fmt, std::size_t... I>
constexpr std::array<tile_fn, sizeof...(I)> micro_tiles(std::index_sequence<I...>) {
  return {exact_tile<Fmt, (int)(I / kColsPerTile) + 1, (int)(I % kColsPerTile) + 1>()...};
}

}  // namespace

template <typename Fmt>
struct Tiles<Fmt, false> {
  static constexpr auto kTable = micro_tiles<Fmt>(std::make_index_sequence<kMaxRowsPerTile * kColsPerTile>{});
  static tile_fn pick(int mr, int nr) { return kTable[(mr - 1) * kColsPerTile + (nr - 1)]; }
};

// exact mode, any GGUF format: the fp32 weights, read back as an fp32 row (F32Format)
template <typename Fmt>
struct Decoded<Fmt, false, std::enable_if_t<!Fmt::kTail>> {
  static constexpr bool kAvailable = true;
  using Tile = F32Format;
  static constexpr int64_t kBlockBytes = Fmt::kBlock * (int64_t)sizeof(float);
  static constexpr int64_t kMinBlocks = kDecodeOnceMinBlocks;
  static void decode(const uint8_t* block, uint8_t* out) {
    typename Fmt::Scales scales;
    Fmt::prepare(block, scales);
#pragma GCC unroll 32
    for (int e = 0; e < Fmt::kBlock; e += V) vstore((float*)out + e, Fmt::load(block, scales, e));
  }
};

template <typename Fmt>
tiles_fn exact_tiles() {
  return run_tiles<Fmt>;
}
#define SG_INSTANTIATE(type_id, Fmt) template tiles_fn exact_tiles<Fmt>();
SG_GGUF_FORMATS(SG_INSTANTIATE)
#undef SG_INSTANTIATE

}  // namespace sg

using namespace sg;

extern "C" {

const char* sg_isa() { return kIsa; }
int sg_vector_width() { return V; }

// y = x @ w^T (+ bias). x [M, K], w [N, K], bias [N] or null, y [M, N]: contiguous fp32.
// Returns 0 on success, 1 on bad arguments.
int sg_linear_f32(const float* x, int64_t M, int64_t K, const float* w, int64_t N, const float* bias, float* y,
                  int num_threads) {
  int status;
  if (bad_shape(x, M, K, w, N, y, &status)) return status;
  LinearJob job{x, M, K, (const uint8_t*)w, K * 4, nullptr, N, bias, y, 0, 0, run_tiles<F32Format>};
  return run_linear(job, num_threads);
}

// Weight-only int8: y = (x @ q^T) * scale (+ bias). q [N, K] int8, scale [N] fp32; else as above.
int sg_linear_i8(const float* x, int64_t M, int64_t K, const int8_t* q, int64_t N, const float* scale,
                 const float* bias, float* y, int num_threads) {
  int status;
  if (bad_shape(x, M, K, q, N, y, &status)) return status;
  if (!scale) return 1;
  LinearJob job{x, M, K, (const uint8_t*)q, K, scale, N, bias, y, 0, 0, run_tiles<Int8Format>};
  return run_linear(job, num_threads);
}

}  // extern "C"
