// a8 K-quants on AVX-512 VNNI without AMX tiles: weights repacked 16 output columns wide, so each
// vpdpbusd multiplies 4 weights of 16 columns by ONE broadcast group of 4 activations, and every
// int32 lane is one column's running sum: no horizontal sums, and the sub-block scale multiply
// (vpdpwssd) comes once per 16 weights, 16 columns and row instead of per 4 weights.
//
// Why: a verify row on the raw-block tiles costs ~13 instructions per 128 weights (the per-column
// lanes are transposed and summed, and scaled per 4 weights); here it costs 2.5 (8 vpdpbusd + 2
// vpdpwssd per 512 weights), and the unpacking (3 per 128 weights) is shared by the rows.
//
// Bits: the integer totals per 256 weights (sum over sub-blocks of sc * (q . x), and of m * bsum)
// are the same integers the raw-block tiles compute (exact, any order), and each output takes the
// same float steps in the same order (a8.cpp's header), so the outputs are bitwise those of the
// raw-block path, on any row count and thread split.
//
// Repacked layout, per 16-column group, its super-blocks in K order (kX16TileBytes each, 64-aligned):
//     d fp16[16] | dmin fp16[16] | sc u8[8][16] | m u8[4][16][2] (sub-blocks 2p, 2p + 1 per column) |
//     qs: 8 sub-blocks x 4 vectors of 64 bytes: byte 4c + i of vector (s, j) holds column c's weight
//         32 s + 4 j + i in its low nibble and weight 32 s + 16 + 4 j + i in its high nibble
// Columns past N (the last group of N % 16 != 0) are zero: d = dmin = 0, their outputs unused.
#define X16_PF 4
#include "skinny_gemm.h"

#ifdef SG_A8_ZMM
#include "a8_int.h"

namespace sg {
namespace {

constexpr int kX16Cols = 16;
constexpr int64_t kX16HeadBytes = 64 + 128 + 128, kX16TileBytes = kX16HeadBytes + 2048;  // 2368 = 37 x 64

// Q4_K block (ggml's block_q4_K): d, dmin fp16, 12 bytes of 6-bit sc / m, qs[128]
void unpack_q4_k_scales(const uint8_t* b, uint8_t sc[8], uint8_t m[8]) {
  const uint8_t* s = b + 4;
  for (int j = 0; j < 8; ++j) {
    if (j < 4) {
      sc[j] = s[j] & 63, m[j] = s[j + 4] & 63;
    } else {
      sc[j] = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
      m[j] = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
  }
}

void repack_q4_k_group(const uint8_t* w, int64_t row_bytes, int64_t n_cols, int64_t blocks, uint8_t* out) {
  for (int64_t kb = 0; kb < blocks; ++kb) {
    uint8_t* t = out + kb * kX16TileBytes;
    std::memset(t, 0, kX16TileBytes);
    for (int c = 0; c < n_cols; ++c) {
      const uint8_t* b = w + c * row_bytes + kb * 144;
      std::memcpy(t + 2 * c, b, 2), std::memcpy(t + 32 + 2 * c, b + 2, 2);
      uint8_t sc[8], m[8];
      unpack_q4_k_scales(b, sc, m);
      for (int s = 0; s < 8; ++s) t[64 + 16 * s + c] = sc[s], t[192 + 32 * (s / 2) + 2 * c + s % 2] = m[s];
      const uint8_t* qs = b + 16;  // weight 64 p + i: low nibble of qs[32 p + i] (i < 32), high of qs[32 p + i - 32]
      auto weight = [&](int k) { return k % 64 < 32 ? qs[32 * (k / 64) + k % 32] & 0xF : qs[32 * (k / 64) + k % 32] >> 4; };
      for (int s = 0; s < 8; ++s)
        for (int j = 0; j < 4; ++j)
          for (int i = 0; i < 4; ++i)
            t[kX16HeadBytes + 256 * s + 64 * j + 4 * c + i] = (uint8_t)(weight(32 * s + 4 * j + i) | (weight(32 * s + 16 + 4 * j + i) << 4));
    }
  }
}

inline __m512i bcast4(const uint8_t* p) { return _mm512_set1_epi32(*(const int32_t*)p); }

// MR rows x one 16-column group, the whole K: y[r, 16 g + c] for c < n_cols
template <int MR>
void x16_tile(const uint8_t* group, int64_t blocks, const uint8_t* xq, int64_t ldxq, int64_t K,
              const float* bias, float* y, int64_t ldy, int n_cols) {
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  __m512 acc[MR];
  const uint8_t* q[MR];
  const float* dx[MR];
  const int16_t* bsum[MR];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    const A8Row row(xq + r * ldxq, K);
    acc[r] = _mm512_setzero_ps(), q[r] = row.q, dx[r] = row.d, bsum[r] = row.bsum;
  }
  for (int64_t kb = 0; kb < blocks; ++kb) {
    const uint8_t* t = group + kb * kX16TileBytes;
    __m512i total[MR];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) total[r] = _mm512_setzero_si512();
#pragma GCC unroll 1
    for (int s = 0; s < 8; ++s) {
      // (sc, 0) int16 pairs: vpdpwssd of an int32 lane (|.| < 2^15: its low int16) times sc
      const __m512i sc = _mm512_cvtepu8_epi32(_mm_load_si128((const __m128i*)(t + 64 + 16 * s)));
      __m512i lo[MR], hi[MR];
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) lo[r] = _mm512_setzero_si512(), hi[r] = _mm512_setzero_si512();
      const uint8_t* qs = t + kX16HeadBytes + 256 * s;
#ifdef X16_PF
      // the weight stream: this super-block's lines X16_PF tiles ahead, 5 per sub-block (37 lines a tile)
#pragma GCC unroll 5
      for (int l = 0; l < 5; ++l) _mm_prefetch((const char*)(t + X16_PF * kX16TileBytes + 64 * (5 * s + l)), _MM_HINT_T0);
#endif
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
      for (int r = 0; r < MR; ++r) total[r] = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(total[r], lo[r], sc), hi[r], sc);
    }
    const __m512 d_w = _mm512_cvtph_ps(_mm256_load_si256((const __m256i*)t));
    const __m512 dmin_w = _mm512_cvtph_ps(_mm256_load_si256((const __m256i*)(t + 32)));
    __m512i m_pairs[4];
#pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) m_pairs[p] = _mm512_cvtepu8_epi16(_mm256_load_si256((const __m256i*)(t + 192 + 32 * p)));
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m512 dxv = _mm512_set1_ps(dx[r][kb]);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total[r]), _mm512_mul_ps(d_w, dxv), acc[r]);
      __m512i msum = _mm512_setzero_si512();
#pragma GCC unroll 4
      for (int p = 0; p < 4; ++p) msum = _mm512_dpwssd_epi32(msum, m_pairs[p], bcast4((const uint8_t*)(bsum[r] + 8 * kb + 2 * p)));
      acc[r] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(msum), _mm512_mul_ps(dmin_w, dxv), acc[r]);
    }
  }
  const __mmask16 keep = (__mmask16)((1u << n_cols) - 1);
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    __m512 value = acc[r];
    if (bias) value = _mm512_add_ps(value, _mm512_maskz_loadu_ps(keep, bias));
    _mm512_mask_storeu_ps(y + r * ldy, keep, value);
  }
}

constexpr int kX16MaxRows = 8;
using x16_fn = void (*)(const uint8_t*, int64_t, const uint8_t*, int64_t, int64_t, const float*, float*, int64_t, int);
constexpr x16_fn kX16Tiles[kX16MaxRows + 1] = {nullptr, x16_tile<1>, x16_tile<2>, x16_tile<3>, x16_tile<4>, x16_tile<5>, x16_tile<6>, x16_tile<7>, x16_tile<8>};

void run_x16_groups(const LinearJob& job, int64_t g_begin, int64_t g_end) {
  const int64_t blocks = job.K / 256, ldxq = a8_row_bytes(job.K);
  for (int64_t g = g_begin; g < g_end; ++g) {
    const int n_cols = (int)std::min<int64_t>(kX16Cols, job.N - kX16Cols * g);
    const uint8_t* group = job.w + g * blocks * kX16TileBytes;
    for (int64_t r = 0; r < job.M; r += kX16MaxRows) {
      const int mr = (int)std::min<int64_t>(kX16MaxRows, job.M - r);
      kX16Tiles[mr](group, blocks, job.xq + r * ldxq, ldxq, job.K, job.bias ? job.bias + kX16Cols * g : nullptr,
                    job.y + r * job.N + kX16Cols * g, job.N, n_cols);
    }
  }
}

}  // namespace
}  // namespace sg

using namespace sg;

extern "C" {

// Bytes of the 16-column repacked copy of an [N, K] Q4_K matrix (K a multiple of 256), else 0.
int64_t sg_x16_bytes(int64_t N, int64_t K) {
  return N > 0 && K > 0 && K % 256 == 0 ? (N + kX16Cols - 1) / kX16Cols * (K / 256) * kX16TileBytes : 0;
}

// w [N, K / 256 blocks of 144 bytes] -> out [sg_x16_bytes(N, K)], 64-byte aligned.
int sg_repack_q4_k_x16(const uint8_t* w, int64_t N, int64_t K, uint8_t* out) {
  if (!sg_x16_bytes(N, K) || !w || !out || (uintptr_t)out % 64) return 1;
  const int64_t blocks = K / 256, groups = (N + kX16Cols - 1) / kX16Cols;
  for (int64_t g = 0; g < groups; ++g)
    repack_q4_k_group(w + g * kX16Cols * blocks * 144, blocks * 144, std::min<int64_t>(kX16Cols, N - kX16Cols * g), blocks,
                      out + g * blocks * kX16TileBytes);
  return 0;
}

// y [M, N] = the a8 linear of x [M, K] with the repacked Q4_K weights (sg_repack_q4_k_x16): bitwise
// sg_linear_gguf_a8 on the original blocks.
int sg_linear_q4_k_x16_a8(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, const float* bias, float* y,
                          int num_threads) {
  if (!sg_x16_bytes(N, K)) return 1;
  int status;
  if (bad_shape(x, M, K, w, N, y, &status)) return status;
  std::vector<uint8_t> xq((size_t)(M * a8_row_bytes(K)));
  for (int64_t i = 0; i < M; ++i) quantize_a8_row(x + i * K, K, 256, xq.data() + i * a8_row_bytes(K));
  LinearJob job{x, M, K, w, 0, nullptr, N, bias, y, 0, (N + kX16Cols - 1) / kX16Cols, run_x16_groups};
  job.xq = xq.data();
  return run_job(job, num_threads, M * N * K);
}

}  // extern "C"
#endif
