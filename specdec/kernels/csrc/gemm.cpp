// fp32-activation tiles (micro_tile) for every weight format, the exact mode's decoded form, and
// the dense linears: sg_linear_f32 (fp32 weights) and sg_linear_i8 (weight-only int8).
#include "skinny_gemm.h"

namespace sg {
namespace {


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
  constexpr int64_t kLine = 64;            // bytes per cache line
  int64_t next_prefetch = INT64_MAX;       // byte offset of the next line to prefetch
  if (a.prefetch) {
    const int64_t line = a.k_begin / Fmt::kBlock * Fmt::kBytes / kLine;
    next_prefetch = (line + ((a.pf_phase - line % a.pf_stride) % a.pf_stride + a.pf_stride) % a.pf_stride) * kLine;
  }
  for (int64_t kb = a.k_begin; kb < loop_end; kb += Fmt::kBlock) {
    const int64_t offset = kb / Fmt::kBlock * Fmt::kBytes;  // of this block in each w row
    while (next_prefetch < offset + Fmt::kBytes) {
#pragma GCC unroll 8
      for (int c = 0; c < NR; ++c) _mm_prefetch((const char*)(a.prefetch + c * a.ldw + next_prefetch), _MM_HINT_T1);
      next_prefetch += a.pf_stride * kLine;
    }
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
    for (int c = 0; c < NR; ++c) {
      float value = vhsum(acc[r][c]);
      if (a.scale) value *= a.scale[c];
      if (a.bias) value += a.bias[c];
      a.y[r * a.ldy + c] = value;
    }
}

template <typename Fmt, std::size_t... I>
constexpr std::array<tile_fn, sizeof...(I)> micro_tiles(std::index_sequence<I...>) {
  return {micro_tile<Fmt, (int)(I / kColsPerTile) + 1, (int)(I % kColsPerTile) + 1>...};
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
