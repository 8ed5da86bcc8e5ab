// Batch-invariant attention and rotary embedding (sg_attention, sg_rotary), and both with the KV
// cache writes as one layer's attention step (sg_attention_step).
#include "skinny_gemm.h"

namespace sg {
namespace {

// ---------------------------------------------------------------- attention
// Batch-invariant attention: out[b, h, t] = softmax(scale * q . k_s) @ v_s over the key slots s
// that mask[b, t, s] lets query t see, each (b, h, t) computed alone by one fixed sequence:
//     visible slots in slot order; score = hsum8(fma over D in 8-lane chunks) (+ scalar tail) * scale;
//     m = max score; e = exp(score - m), summed in slot order; out = (sum_s e_s * v_s) / sum.
// Masked slots are skipped, not added as zeros, so a row's result depends only on its own query
// and the keys / values it sees, in order: the same whether it is a decode row, one of k verify
// rows, a tree node (its ancestors come before it in slot order, as in plain decoding) or a row
// of a ragged batch. 256-bit vectors in both ISA builds: the same bits on AVX2 and AVX-512 CPUs.
// (torch's scaled_dot_product_attention blocks its GEMMs by the number of queries, so a row's
// bits depend on how many rows share the call.)
struct AttentionArgs {
  const float* q;          // [B, H, T, D] contiguous
  const float* k;          // [B, Hkv, S, D] with strides (b, h); rows of D contiguous
  const float* v;
  int64_t kv_stride_b, kv_stride_h;
  const uint8_t* mask;     // [B, T, S] (1 = visible) or null (every slot visible)
  int64_t B, H, Hkv, T, S, D;
  float scale;
  float* out;              // [B, H, T, D] contiguous, or [B, T, H, D] when heads_last
  bool heads_last;
};

inline float dot_fixed(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float sum = hsum256(acc);
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// dot_fixed(a, b[j], n) for four rows b[j] at once: the same per-row sequence (so the same bits),
// four independent FMA chains instead of one (latency-bound otherwise), `a` loaded once.
inline void dot_fixed4(const float* a, const float* const b[4], int64_t n, float out[4]) {
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 av = _mm256_loadu_ps(a + i);
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) acc[j] = _mm256_fmadd_ps(av, _mm256_loadu_ps(b[j] + i), acc[j]);
  }
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) {
    float sum = hsum256(acc[j]);
    for (int64_t t = i; t < n; ++t) sum += a[t] * b[j][t];
    out[j] = sum;
  }
}

// acc[d] += weights[i] * rows[i][d] for i < count in order, for d in [d0, d0 + 8 kVecs): one fma
// per slot and lane (acc = fma(w, v, acc)), the accumulators held in registers across the slots.
template <int kVecs>
inline void weighted_sum(const float* weights, const float* const* rows, int64_t count, int64_t d0, float* acc) {
  __m256 sum[kVecs];
#pragma GCC unroll 8
  for (int c = 0; c < kVecs; ++c) sum[c] = _mm256_loadu_ps(acc + d0 + 8 * c);
  for (int64_t i = 0; i < count; ++i) {
    const __m256 w = _mm256_set1_ps(weights[i]);
    const float* row = rows[i] + d0;
#pragma GCC unroll 8
    for (int c = 0; c < kVecs; ++c) sum[c] = _mm256_fmadd_ps(w, _mm256_loadu_ps(row + 8 * c), sum[c]);
  }
#pragma GCC unroll 8
  for (int c = 0; c < kVecs; ++c) _mm256_storeu_ps(acc + d0 + 8 * c, sum[c]);
}

constexpr int64_t kAttentionRows = 4;  // query rows per task: each key / value row is loaded once for them
constexpr int64_t kSlotBlockBytes = 32 * 1024;  // keys (or values) walked per step: stay in L1 for all heads and rows

// One task = batch row b, KV head, and up to kAttentionRows consecutive queries. Each (query head,
// query) is computed alone over the slots it sees, in slot order (see above); the slots are walked
// in blocks of kSlotBlockBytes so each block of keys / values is read from memory once for all the
// query heads sharing the KV head (GQA) and all the task's queries, and reused from L1. Between
// blocks a row's weighted-value sums are parked in memory (exact), so blocking changes no bits.
void attention_rows(const LinearJob& job, int64_t begin, int64_t end) {
  const AttentionArgs& a = *(const AttentionArgs*)job.ctx;
  const int64_t group = a.H / a.Hkv;  // query heads per KV head
  const int64_t row_blocks = (a.T + kAttentionRows - 1) / kAttentionRows;
  const int64_t slot_block = std::max<int64_t>(8, kSlotBlockBytes / (a.D * (int64_t)sizeof(float)));
  std::vector<float> scores((size_t)(kAttentionRows * group * a.S));   // [row][head][visible slot]
  std::vector<float> sums((size_t)(kAttentionRows * group * a.D));     // [row][head][D] weighted values
  std::vector<const float*> seen((size_t)(2 * kAttentionRows * a.S));  // [row][visible slot]: key rows | value rows
  std::vector<int64_t> slot((size_t)(kAttentionRows * a.S));           // [row][visible slot]: slot index
  for (int64_t task = begin; task < end; ++task) {  // task = (b * Hkv + kv_head) * row_blocks + block
    const int64_t block = task % row_blocks, kv_head = task / row_blocks % a.Hkv, b = task / (row_blocks * a.Hkv);
    const int64_t t0 = block * kAttentionRows, rows = std::min(kAttentionRows, a.T - t0);
    const float* keys = a.k + b * a.kv_stride_b + kv_head * a.kv_stride_h;
    const float* values = a.v + b * a.kv_stride_b + kv_head * a.kv_stride_h;
    auto query = [&](int64_t r, int64_t g) { return a.q + ((b * a.H + kv_head * group + g) * a.T + t0 + r) * a.D; };
    auto score_row = [&](int64_t r, int64_t g) { return scores.data() + (r * group + g) * a.S; };
    auto sum_row = [&](int64_t r, int64_t g) { return sums.data() + (r * group + g) * a.D; };
    int64_t count[kAttentionRows];
    for (int64_t r = 0; r < rows; ++r) {  // the slots each row sees, in order
      const uint8_t* mask = a.mask ? a.mask + (b * a.T + t0 + r) * a.S : nullptr;
      const float** key_rows = seen.data() + 2 * r * a.S;
      count[r] = 0;
      for (int64_t s = 0; s < a.S; ++s)
        if (!mask || mask[s]) {
          key_rows[count[r]] = keys + s * a.D, key_rows[a.S + count[r]] = values + s * a.D;
          slot[r * a.S + count[r]++] = s;
        }
    }
    // [begin, end) of row r's visible slots inside the slot block starting at s0 (cursor: the next one)
    int64_t cursor[kAttentionRows];
    auto block_range = [&](int64_t r, int64_t s0, int64_t& lo, int64_t& hi) {
      lo = hi = cursor[r];
      while (hi < count[r] && slot[r * a.S + hi] < s0 + slot_block) ++hi;
      cursor[r] = hi;
    };
    float max_score[kAttentionRows][64];  // group <= 64 (checked by the caller)
    for (int64_t r = 0; r < rows; ++r) {
      cursor[r] = 0;
      for (int64_t g = 0; g < group; ++g) max_score[r][g] = -INFINITY;
    }
    for (int64_t s0 = 0; s0 < a.S; s0 += slot_block)  // scores, each row over the slots it sees
      for (int64_t r = 0; r < rows; ++r) {
        int64_t lo, hi;
        block_range(r, s0, lo, hi);
        const float* const* key_rows = seen.data() + 2 * r * a.S;
        for (int64_t g = 0; g < group; ++g) {
          float* score = score_row(r, g);
          float& top = max_score[r][g];
          int64_t i = lo;
          for (; i + 4 <= hi; i += 4) {
            float dots[4];
            dot_fixed4(query(r, g), key_rows + i, a.D, dots);
            for (int j = 0; j < 4; ++j) score[i + j] = dots[j] * a.scale, top = std::max(top, score[i + j]);
          }
          for (; i < hi; ++i) score[i] = dot_fixed(query(r, g), key_rows[i], a.D) * a.scale, top = std::max(top, score[i]);
        }
      }
    float total[kAttentionRows][64];
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t g = 0; g < group; ++g) {  // softmax numerators in place, summed in slot order
        float* row = score_row(r, g);
        float sum = 0.0f;
        for (int64_t i = 0; i < count[r]; ++i) sum += (row[i] = std::exp(row[i] - max_score[r][g]));
        total[r][g] = sum;
      }
    std::fill(sums.begin(), sums.end(), 0.0f);
    for (int64_t r = 0; r < rows; ++r) cursor[r] = 0;
    for (int64_t s0 = 0; s0 < a.S; s0 += slot_block)  // weighted values, slot order
      for (int64_t r = 0; r < rows; ++r) {
        int64_t lo, hi;
        block_range(r, s0, lo, hi);
        const float* const* value_rows = seen.data() + 2 * r * a.S + a.S + lo;
        for (int64_t g = 0; g < group; ++g) {
          const float* weight = score_row(r, g) + lo;
          float* acc = sum_row(r, g);
          int64_t d = 0;
          for (; d + 64 <= a.D; d += 64) weighted_sum<8>(weight, value_rows, hi - lo, d, acc);
          for (; d + 8 <= a.D; d += 8) weighted_sum<1>(weight, value_rows, hi - lo, d, acc);
          for (; d < a.D; ++d)  // scalar tail of D
            for (int64_t i = 0; i < hi - lo; ++i) acc[d] += weight[i] * value_rows[i][d];
        }
      }
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t g = 0; g < group; ++g) {
        const int64_t head = kv_head * group + g, t = t0 + r;
        float* out = a.out + (a.heads_last ? (b * a.T + t) * a.H + head : (b * a.H + head) * a.T + t) * a.D;
        const float* sum = sum_row(r, g);
        if (count[r] == 0) {  // a padding row of a ragged batch: nothing to see, its output is dropped
          std::fill(out, out + a.D, 0.0f);
          continue;
        }
        for (int64_t d = 0; d < a.D; ++d) out[d] = sum[d] / total[r][g];
      }
  }
}

// Rotary embedding of one head row, out = x * cos + rotate_half(x) * sin per element, with
// rotate_half(x) = (-x[D/2:], x[:D/2]): two products and a sum, each rounded once (no FMA), as torch
// computes `x * cos + rotate_half(x) * sin`, so the same bits.
void rotary_row(const float* x, const float* cos, const float* sin, int64_t D, float* out) {
  const int64_t half = D / 2;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  int64_t d = 0;
  for (; d + 8 <= half; d += 8) {  // first half: x * cos - x[d + D/2] * sin, second: x * cos + x[d - D/2] * sin
    const __m256 lo = _mm256_loadu_ps(x + d), hi = _mm256_loadu_ps(x + half + d);
    _mm256_storeu_ps(out + d, _mm256_add_ps(_mm256_mul_ps(lo, _mm256_loadu_ps(cos + d)),
                                            _mm256_mul_ps(_mm256_xor_ps(hi, sign), _mm256_loadu_ps(sin + d))));
    _mm256_storeu_ps(out + half + d, _mm256_add_ps(_mm256_mul_ps(hi, _mm256_loadu_ps(cos + half + d)),
                                                   _mm256_mul_ps(lo, _mm256_loadu_ps(sin + half + d))));
  }
  for (; d < half; ++d) {
    const float lo = x[d], hi = x[half + d];
    out[d] = lo * cos[d] + (-hi) * sin[d];
    out[half + d] = hi * cos[half + d] + lo * sin[half + d];
  }
}

int run_attention(AttentionArgs& args, int num_threads) {
  LinearJob job{};
  job.num_tiles = args.B * args.Hkv * ((args.T + kAttentionRows - 1) / kAttentionRows);
  job.run_tiles = attention_rows;
  job.ctx = &args;
  return run_job(job, num_threads, args.B * args.H * args.T * args.S * args.D * 2);  // multiply-adds: scores and weighted values
}

}  // namespace
}  // namespace sg

using namespace sg;

extern "C" {

// Attention (see AttentionArgs): q / out [B, H, T, D] contiguous; k, v [B, Hkv, S, D] with
// strides kv_stride_b / kv_stride_h (floats) and rows of D contiguous; mask [B, T, S] bytes
// (nonzero = visible) or null. H a multiple of Hkv. Returns 0, or 1 on bad arguments.
int sg_attention(const float* q, const float* k, const float* v, int64_t kv_stride_b, int64_t kv_stride_h,
                 const uint8_t* mask, int64_t B, int64_t H, int64_t Hkv, int64_t T, int64_t S, int64_t D,
                 float scale, float* out, int num_threads) {
  if (B < 0 || T < 0 || S < 0 || D <= 0 || H <= 0 || Hkv <= 0 || H % Hkv || H / Hkv > 64) return 1;
  if (B == 0 || T == 0) return 0;
  if (!q || !out || (S > 0 && (!k || !v))) return 1;
  AttentionArgs args{q, k, v, kv_stride_b, kv_stride_h, mask, B, H, Hkv, T, S, D, scale, out, false};
  return run_attention(args, num_threads);
}

// One layer's attention step after its q / k / v projections, in one call: k rotated and v written
// into the cache at slots starts[b] + t, q rotated, then sg_attention over slots [0, S) of the cache
// with the output in the o projection's layout. q [B, T, H, D], k / v [B, T, Hkv, D] contiguous (the
// projections' outputs); cos / sin [B, T, D]; cache_k / cache_v [B, Hkv, capacity, D] with strides
// kv_stride_b / kv_stride_h, capacity >= every starts[b] + T and S <= capacity; mask [B, T, S] or
// null; out [B, T, H, D]. The same bits as sg_rotary, the cache writes and sg_attention one by one.
int sg_attention_step(const float* q, const float* k, const float* v, const float* cos, const float* sin,
                      float* cache_k, float* cache_v, int64_t kv_stride_b, int64_t kv_stride_h, const int64_t* starts,
                      const uint8_t* mask, int64_t B, int64_t H, int64_t Hkv, int64_t T, int64_t S, int64_t D,
                      float scale, float* out, int num_threads) {
  if (B < 0 || T < 0 || S < 0 || D <= 0 || D % 2 || H <= 0 || Hkv <= 0 || H % Hkv || H / Hkv > 64) return 1;
  if (B == 0 || T == 0) return 0;
  if (!q || !k || !v || !cos || !sin || !cache_k || !cache_v || !starts || !out) return 1;
  for (int64_t b = 0; b < B; ++b)
    if (starts[b] < 0 || starts[b] + T > S) return 1;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      const float* row_cos = cos + (b * T + t) * D;
      const float* row_sin = sin + (b * T + t) * D;
      for (int64_t h = 0; h < Hkv; ++h) {
        const int64_t slot = b * kv_stride_b + h * kv_stride_h + (starts[b] + t) * D;
        rotary_row(k + ((b * T + t) * Hkv + h) * D, row_cos, row_sin, D, cache_k + slot);
        std::memcpy(cache_v + slot, v + ((b * T + t) * Hkv + h) * D, (size_t)D * sizeof(float));
      }
    }
  std::vector<float> rotated((size_t)(B * H * T * D));  // q as [B, H, T, D]
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < H; ++h)
        rotary_row(q + ((b * T + t) * H + h) * D, cos + (b * T + t) * D, sin + (b * T + t) * D, D,
                   rotated.data() + ((b * H + h) * T + t) * D);
  AttentionArgs args{rotated.data(), cache_k, cache_v, kv_stride_b, kv_stride_h, mask, B, H, Hkv, T, S, D, scale, out, true};
  return run_attention(args, num_threads);
}

// Rotary embedding into the attention layout (see rotary_row): x [B, T, H, D] contiguous (a
// projection's output), cos / sin [B, T, D] contiguous, out [B, H, T, D] contiguous. D even. 0, or 1.
int sg_rotary(const float* x, const float* cos, const float* sin, int64_t B, int64_t T, int64_t H, int64_t D,
              float* out) {
  if (B < 0 || T < 0 || H < 0 || D <= 0 || D % 2) return 1;
  if (B == 0 || T == 0 || H == 0) return 0;
  if (!x || !cos || !sin || !out) return 1;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < H; ++h)
        rotary_row(x + ((b * T + t) * H + h) * D, cos + (b * T + t) * D, sin + (b * T + t) * D, D,
                   out + ((b * H + h) * T + t) * D);
  return 0;
}

}  // extern "C"
