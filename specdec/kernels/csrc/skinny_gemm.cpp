// Batch-invariant skinny GEMM for CPU: y[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]), fp32
// activations; fp32, int8 (weight-only, per-row scale) or GGUF block (Q4_0 ... Q6_K) weights.
//
// Why this exists: a decode step (M = 1) and a verification forward (M = k draft tokens)
// are both memory-bound on the weight stream, so a kernel that reads every weight row once
// for all M rows makes verifying k tokens cost about as much as decoding one.
//
// Batch invariance: every output y[i, j] is computed by the same instruction sequence
// whatever M is and however rows / columns are tiled or split across threads:
//     acc = 0 (one SIMD vector of V lanes)
//     for each full V-wide chunk of K, in order:  acc = fma(x[i, chunk], w[j, chunk], acc)
//     if K % V:                                   acc = fma(masked tail chunks, acc)
//     y[i, j] = horizontal_sum(acc) (fixed tree)  [* scale[j] for int8] [+ bias[j]]
// The M/N tiling below only decides which of these independent sequences run interleaved (and
// when the K walk pauses, parking acc in memory exactly); the order over K is always the same.
// So row i of an M-row call is bitwise equal to that row alone, for any M and thread count.
// (Per ISA: the AVX2 and AVX-512 builds have different V and so different bits.)
//
// The weight is used in its native nn.Linear layout [N, K] (no packed copy: tied embeddings
// and checkpoint memory stay as they are). Plain C ABI (called through ctypes) so the build is
// one g++ invocation of a few seconds, with no torch headers.

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <condition_variable>
#include <chrono>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>
#include <unistd.h>
#include <cpuid.h>
#include <sys/syscall.h>

namespace {

#if defined(__AVX512F__)
constexpr int V = 16;  // fp32 lanes per vector
using vec = __m512;
using tail_mask = __mmask16;
inline vec vzero() { return _mm512_setzero_ps(); }
inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vec v) { _mm512_storeu_ps(p, v); }
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline tail_mask make_tail_mask(int64_t remaining) { return (tail_mask)((1u << remaining) - 1u); }
inline vec vload_tail(const float* p, tail_mask m) { return _mm512_maskz_loadu_ps(m, p); }
inline float hsum256(__m256 v);
inline float vhsum(vec v) {
  // fixed tree: 16 -> 8 -> 4 -> 2 -> 1
  __m256 lo = _mm512_castps512_ps256(v);
  __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
  return hsum256(_mm256_add_ps(lo, hi));
}
constexpr const char* kIsa = "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int V = 8;
using vec = __m256;
using tail_mask = __m256i;
inline vec vzero() { return _mm256_setzero_ps(); }
inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vec v) { _mm256_storeu_ps(p, v); }
inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline tail_mask make_tail_mask(int64_t remaining) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)remaining), lane);
}
inline vec vload_tail(const float* p, tail_mask m) { return _mm256_maskload_ps(p, m); }
inline float hsum256(__m256 v);
inline float vhsum(vec v) { return hsum256(v); }
constexpr const char* kIsa = "avx2";
#else
#error "skinny_gemm needs AVX2 + FMA (or AVX-512F)"
#endif
#if !defined(__F16C__)
#error "skinny_gemm needs F16C (fp16 block scales)"
#endif

inline float hsum256(__m256 v) {
  // fixed tree: 8 -> 4 -> 2 -> 1
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Register blocking: MR x NR accumulators + NR weight vectors + 1 x vector must fit the vector
// registers (32 zmm with AVX-512, 16 ymm with AVX2) or the accumulators spill. Measured (one
// core, weights in L2): 4x4 / 4x3 reach ~100 / ~85 GFLOP/s at 8-16 rows; 8x3, 6x3, 2x8 and, for
// AVX2, 4x4 (spills) and 2x4 are slower.
#ifndef SG_MR
#if defined(__AVX512F__)
#define SG_MR 4
#define SG_NR 4
#else
#define SG_MR 4
#define SG_NR 3
#endif
#endif
constexpr int kMaxRowsPerTile = SG_MR;  // MR: rows of x per micro-tile
constexpr int kColsPerTile = SG_NR;     // NR: rows of w (output columns) per micro-tile
constexpr int64_t kPrefetchTiles = 2;   // software prefetch distance, in tiles (1, 2, 4, 8 measured)
constexpr int64_t kKChunk = 512;        // K elements per step when row blocks interleave (multiple of V and of 64)
constexpr int kSavedFloats = 16;        // floats parked per accumulator between K ranges (>= V; a8: 8, see a8_tile)

// ---------------------------------------------------------------- weight formats
// A weight row is a sequence of blocks; a format says how one block becomes V-wide fp32 vectors:
//   kBlock weights per block in kBytes bytes; Scales = what is computed once per block (per
//   sub-block products such as d * sc); load(block, scales, e) = weights [e, e + V) of the block.
// fp32 and int8 rows are blocks of V weights with nothing to prepare. The GGUF formats
// (ggml's block layouts) dequantize each weight with gguf-py's own per-weight expression, one
// separately rounded fp32 operation at a time (the build has -ffp-contract=off), so the vector
// handed to the FMA is bitwise the weight `gguf.quants.dequantize` produces: the output is
// bitwise the fp32 kernel's on the dequantized matrix, without that matrix ever existing.

inline float fp16_to_fp32(const uint8_t* p) {  // exact (every fp16 is an fp32); F16C, as every AVX2 CPU has
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// V consecutive bytes; widened to V fp32 lanes (unsigned or signed); nibbles; bit fields.
inline __m128i load_bytes(const uint8_t* p) {
  return V == 16 ? _mm_loadu_si128((const __m128i*)p) : _mm_loadl_epi64((const __m128i*)p);
}
inline __m128i low_nibbles(__m128i b) { return _mm_and_si128(b, _mm_set1_epi8(0x0f)); }
inline __m128i high_nibbles(__m128i b) { return _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0x0f)); }
inline __m128i nibbles(__m128i b, bool high) { return high ? high_nibbles(b) : low_nibbles(b); }
inline __m128i bit_field(__m128i b, int shift, int mask) {  // (b >> shift) & mask per byte (shift < 8)
  return _mm_and_si128(_mm_srl_epi16(b, _mm_cvtsi32_si128(shift)), _mm_set1_epi8((char)mask));
}
#if defined(__AVX512F__)
inline vec u8_to_vec(__m128i b) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b)); }
inline vec i8_to_vec(__m128i b) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)); }
inline vec vset1(float v) { return _mm512_set1_ps(v); }
inline vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
inline vec vsub(vec a, vec b) { return _mm512_sub_ps(a, b); }
// lanes [0, V): (u8[i] | (bit i of `bits` ? 16 : 0)) - 16, as fp32 (Q5_0's 5-bit weights)
inline vec u8_with_high_bits_minus_16(__m128i low, uint32_t bits) {
  const __m512i q = _mm512_or_si512(_mm512_cvtepu8_epi32(low), _mm512_maskz_set1_epi32((__mmask16)bits, 16));
  return _mm512_cvtepi32_ps(_mm512_sub_epi32(q, _mm512_set1_epi32(16)));
}
#else
inline vec u8_to_vec(__m128i b) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)); }
inline vec i8_to_vec(__m128i b) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)); }
inline vec vset1(float v) { return _mm256_set1_ps(v); }
inline vec vmul(vec a, vec b) { return _mm256_mul_ps(a, b); }
inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
inline vec vsub(vec a, vec b) { return _mm256_sub_ps(a, b); }
inline vec u8_with_high_bits_minus_16(__m128i low, uint32_t bits) {
  const __m256i lane_bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256i set = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((int)bits), lane_bit), lane_bit);
  const __m256i q = _mm256_or_si256(_mm256_cvtepu8_epi32(low), _mm256_and_si256(set, _mm256_set1_epi32(16)));
  return _mm256_cvtepi32_ps(_mm256_sub_epi32(q, _mm256_set1_epi32(16)));
}
#endif

// ---- int8-activation (a8) helpers: 32 weights of a sub-block as 32 int8 lanes of a ymm (both
// builds; the AVX-512 VNNI build runs the K-quants two sub-blocks per zmm, see SG_A8_ZMM). Integer
// dot products are exact, so both builds give the a8 results bitwise the same.
inline __m256i low_nibbles32(__m256i b) { return _mm256_and_si256(b, _mm256_set1_epi8(0x0f)); }
inline __m256i high_nibbles32(__m256i b) { return _mm256_and_si256(_mm256_srli_epi16(b, 4), _mm256_set1_epi8(0x0f)); }
inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256((const __m256i*)p); }
inline __m256i nibbles32(const uint8_t* p, bool high) {  // 32 bytes -> their low or high nibbles
  return high ? high_nibbles32(load32(p)) : low_nibbles32(load32(p));
}
inline __m256i split_nibbles32(const uint8_t* p) {  // 16 bytes -> 16 low nibbles, then 16 high nibbles
  const __m128i b = _mm_loadu_si128((const __m128i*)p);
  return _mm256_set_m128i(high_nibbles(b), low_nibbles(b));
}
inline __m256i bit_field32(__m256i b, int shift, int mask) {  // (b >> shift) & mask per byte
  return _mm256_and_si256(_mm256_srl_epi16(b, _mm_cvtsi32_si128(shift)), _mm256_set1_epi8((char)mask));
}
inline __m256i bits_to_bytes32(uint32_t bits) {  // byte j = 0xff where bit j is set, else 0
  const __m256i byte_of_bit = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                               2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m256i bit_in_byte = _mm256_set1_epi64x(0x8040201008040201LL);
  const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), byte_of_bit);  // per 128-bit lane: all 4 bytes there
  return _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit_in_byte), bit_in_byte);
}

// ---- a8, AVX-512 BW + VNNI builds only: two sub-blocks (64 weights) per zmm, sub-block 2p in
// the low 256 bits, 2p + 1 in the high. The tile folds the two halves into the same 8 int32
// lanes the 256-bit code produces (integer adds: exact, in any order) before any float step, so
// the bits stay those of the AVX2 build.
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define SG_A8_ZMM 1
constexpr __mmask32 kHighWords = 0xffff0000u;  // the 16 int16 lanes of the high 256 bits
inline __m512i broadcast32(const uint8_t* p) { return _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)p)); }
inline __m512i nibble_pair64(const uint8_t* p) {  // 32 bytes -> their low nibbles, then their high nibbles
  const __m512i b = broadcast32(p);
  return _mm512_and_si512(_mm512_mask_srli_epi16(b, kHighWords, b, 4), _mm512_set1_epi8(0x0f));
}
// The int16 lanes of _mm512_packs_epi32(dpbusd of pair 2 quad, dpbusd of pair 2 quad + 1): lanes 8k ..
// 8k + 3 are 16-weight group 8 quad + k, lanes 8k + 4 .. 8k + 7 group 8 quad + 4 + k. -> the index of
// each lane's scale in KQuantA8Scales::sc (a scale per 16 weights, or per 32: group / 2).
inline __m512i quad_scale_index(int quad, bool per16) {
  const __m512i group = _mm512_add_epi16(_mm512_setr_epi64(0x0000000000000000LL, 0x0004000400040004LL, 0x0001000100010001LL, 0x0005000500050005LL,
                                                           0x0002000200020002LL, 0x0006000600060006LL, 0x0003000300030003LL, 0x0007000700070007LL),
                                         _mm512_set1_epi16((short)(8 * quad)));
  return per16 ? group : _mm512_srli_epi16(group, 1);
}
#endif

struct NoScales {};

struct F32Format {  // nn.Linear weights as they are
  static constexpr int kBlock = V, kBytes = V * 4;
  static constexpr bool kTail = true;  // any K: the last K % V weights come through load_tail
  using Scales = NoScales;
  static void prepare(const uint8_t*, Scales&) {}
  static vec load(const uint8_t* b, const Scales&, int) { return vload((const float*)b); }
  static vec load_tail(const uint8_t* b, int64_t, tail_mask m) { return vload_tail((const float*)b, m); }
};

struct Int8Format {  // weight-only int8 (per-row scale applied after the sum)
  static constexpr int kBlock = V, kBytes = V;
  static constexpr bool kTail = true;
  using Scales = NoScales;
  static void prepare(const uint8_t*, Scales&) {}
  static vec load(const uint8_t* b, const Scales&, int) { return i8_to_vec(load_bytes(b)); }
  static vec load_tail(const uint8_t* b, int64_t remaining, tail_mask) {
    alignas(16) uint8_t padded[16] = {0};  // zero lanes past K, like the fp32 masked load
    std::memcpy(padded, b, (size_t)remaining);
    return load(padded, NoScales{}, 0);
  }
};

// GGUF formats (K is a multiple of kBlock: no tail). Byte layouts as in ggml's block_* structs.
struct Scale1 { float d; };
struct Scale2 { float d, m; };

struct Q4_0Format {  // d fp16, qs[16]: weight j < 16 = low nibble of qs[j], j >= 16 = high nibble of qs[j-16]
  static constexpr int kBlock = 32, kBytes = 18;
  static constexpr bool kTail = false;
  using Scales = Scale1;
  static void prepare(const uint8_t* b, Scales& s) { s.d = fp16_to_fp32(b); }
  static vec load(const uint8_t* b, const Scales& s, int e) {  // d * (q - 8)
    const __m128i q = _mm_sub_epi8(nibbles(load_bytes(b + 2 + e % 16), e >= 16), _mm_set1_epi8(8));
    return vmul(vset1(s.d), i8_to_vec(q));
  }
  // a8: signed quants (dot with |q| and sign-moved activations), one scale per 32, no min term
  static constexpr int kA8Block = 32;
  static constexpr bool kSigned = true, kHasMin = false;
  static __m256i quants32(const uint8_t* b, int) { return _mm256_sub_epi8(split_nibbles32(b + 2), _mm256_set1_epi8(8)); }
  static __m256 a8_scale(const Scales& s, int) { return _mm256_set1_ps(s.d); }
  static float a8_min(const Scales&, int) { return 0.0f; }
};

struct Q4_1Format {  // d fp16, m fp16, qs[16] as Q4_0
  static constexpr int kBlock = 32, kBytes = 20;
  static constexpr bool kTail = false;
  using Scales = Scale2;
  static void prepare(const uint8_t* b, Scales& s) { s.d = fp16_to_fp32(b), s.m = fp16_to_fp32(b + 2); }
  static vec load(const uint8_t* b, const Scales& s, int e) {  // (d * q) + m
    return vadd(vmul(vset1(s.d), u8_to_vec(nibbles(load_bytes(b + 4 + e % 16), e >= 16))), vset1(s.m));
  }
  // a8: d * sum(q * a) + m * sum(a)
  static constexpr int kA8Block = 32;
  static constexpr bool kSigned = false, kHasMin = true;
  static __m256i quants32(const uint8_t* b, int) { return split_nibbles32(b + 4); }
  static __m256 a8_scale(const Scales& s, int) { return _mm256_set1_ps(s.d); }
  static float a8_min(const Scales& s, int) { return s.m; }
};

struct Q5_0Format {  // d fp16, qh u32 (bit j = 5th bit of weight j), qs[16] as Q4_0
  static constexpr int kBlock = 32, kBytes = 22;
  static constexpr bool kTail = false;
  using Scales = Scale1;
  static void prepare(const uint8_t* b, Scales& s) { s.d = fp16_to_fp32(b); }
  static vec load(const uint8_t* b, const Scales& s, int e) {  // d * (q - 16)
    uint32_t qh;
    std::memcpy(&qh, b + 2, 4);
    const uint32_t bits = (qh >> e) & ((1u << V) - 1u);
    return vmul(vset1(s.d), u8_with_high_bits_minus_16(nibbles(load_bytes(b + 6 + e % 16), e >= 16), bits));
  }
  static constexpr int kA8Block = 32;
  static constexpr bool kSigned = true, kHasMin = false;
  static __m256i quants32(const uint8_t* b, int) {  // (nibble | 16 * bit j of qh) - 16
    uint32_t qh;
    std::memcpy(&qh, b + 2, 4);
    const __m256i high = _mm256_and_si256(bits_to_bytes32(qh), _mm256_set1_epi8(16));
    return _mm256_sub_epi8(_mm256_or_si256(split_nibbles32(b + 6), high), _mm256_set1_epi8(16));
  }
  static __m256 a8_scale(const Scales& s, int) { return _mm256_set1_ps(s.d); }
  static float a8_min(const Scales&, int) { return 0.0f; }
};

struct Q8_0Format {  // d fp16, qs int8[32]
  static constexpr int kBlock = 32, kBytes = 34;
  static constexpr bool kTail = false;
  using Scales = Scale1;
  static void prepare(const uint8_t* b, Scales& s) { s.d = fp16_to_fp32(b); }
  static vec load(const uint8_t* b, const Scales& s, int e) { return vmul(i8_to_vec(load_bytes(b + 2 + e)), vset1(s.d)); }
  static constexpr int kA8Block = 32;
  static constexpr bool kSigned = true, kHasMin = false;
  static __m256i quants32(const uint8_t* b, int) { return load32(b + 2); }
  static __m256 a8_scale(const Scales& s, int) { return _mm256_set1_ps(s.d); }
  static float a8_min(const Scales&, int) { return 0.0f; }
};

// Q4_K / Q5_K: 256 weights in 8 sub-blocks of 32, each with a 6-bit scale and min packed in 12 bytes.
struct SubBlockScales { float d[8], dm[8]; };  // d * sc and dmin * m per sub-block

// bytes 0-3: low 6 bits of sc 0-3; 4-7: of m 0-3; 8-11: low 4 bits of sc/m 4-7 (their high 2
// bits are the top 2 of bytes 0-7). Four bytes at a time in 32-bit words: the 8 sc, then the 8 m.
inline void k_quant_6bit_bytes(const uint8_t* q, uint32_t sc[2], uint32_t m[2]) {
  uint32_t lo, mid, hi;  // bytes 0-3, 4-7, 8-11
  std::memcpy(&lo, q, 4), std::memcpy(&mid, q + 4, 4), std::memcpy(&hi, q + 8, 4);
  sc[0] = lo & 0x3f3f3f3fu;
  m[0] = mid & 0x3f3f3f3fu;
  sc[1] = (hi & 0x0f0f0f0fu) | ((lo >> 2) & 0x30303030u);
  m[1] = ((hi >> 4) & 0x0f0f0f0fu) | ((mid >> 2) & 0x30303030u);
}
inline __m128i k_quant_6bit_epi16(const uint32_t v[2]) {  // 8 bytes -> 8 int16 lanes
  return _mm_cvtepu8_epi16(_mm_set_epi32(0, 0, (int)v[1], (int)v[0]));
}

inline void k_quant_scales(const uint8_t* b, SubBlockScales& s) {
  uint32_t sc[2], m[2];
  k_quant_6bit_bytes(b + 4, sc, m);
  // d * (float)sc per lane: the same single rounded product as the scalar expression
  const __m256 d = _mm256_set1_ps(fp16_to_fp32(b)), dmin = _mm256_set1_ps(fp16_to_fp32(b + 2));
  _mm256_storeu_ps(s.d, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(k_quant_6bit_epi16(sc)))));
  _mm256_storeu_ps(s.dm, _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(k_quant_6bit_epi16(m)))));
}

// a8 mode, K-quants: the integer sub-block scales multiply the integer dot products (exact), the
// fp16 super-block scales come once per 256 weights (activations quantized per 256, as q8_K).
struct KQuantA8Scales {
  float d, dmin;
  alignas(32) int16_t sc[16];  // per 32 weights (Q4_K, Q5_K: first 8) or per 16 (Q6_K)
  alignas(16) int16_t m[8];    // per 32 weights (Q4_K, Q5_K)
};
inline void k_quant_a8_scales(const uint8_t* b, KQuantA8Scales& s) {
  s.d = fp16_to_fp32(b), s.dmin = fp16_to_fp32(b + 2);
  uint32_t sc[2], m[2];
  k_quant_6bit_bytes(b + 4, sc, m);
  _mm256_store_si256((__m256i*)s.sc, _mm256_castsi128_si256(k_quant_6bit_epi16(sc)));  // lanes 8-15 unused; one
  // 32-byte store so that the 32-byte loads of the scales forward from it (two halves would stall)
  _mm_store_si128((__m128i*)s.m, k_quant_6bit_epi16(m));
}

struct Q4_KFormat {  // d, dmin fp16, scales[12], qs[128]: sub-block 2i / 2i+1 = low / high nibbles of qs[32i..32i+31]
  static constexpr int kBlock = 256, kBytes = 144;
  static constexpr bool kTail = false;
#if defined(__AVX512F__)
  // 16 lanes = the 16 values a 4-bit quant can take: per sub-block a table of (d * sc) * q - dmin * m
  // for q = 0..15, computed with the same operations as per weight (so the same bits), and each
  // weight vector is one vpermps lookup instead of cvt, mul and sub per 16 weights.
  struct Scales { __m512 table[8]; };
  static void prepare(const uint8_t* b, Scales& s) {
    SubBlockScales sub;
    k_quant_scales(b, sub);
    const __m512 q = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) s.table[i] = vsub(vmul(vset1(sub.d[i]), q), vset1(sub.dm[i]));
  }
  static vec load(const uint8_t* b, const Scales& s, int e) {  // vpermps reads the low 4 bits of each index
    const int sub = e / 32;
    __m512i index = _mm512_cvtepu8_epi32(load_bytes(b + 16 + 32 * (sub / 2) + e % 32));
    if (sub % 2) index = _mm512_srli_epi32(index, 4);
    return _mm512_permutexvar_ps(index, s.table[sub]);
  }
#else
  using Scales = SubBlockScales;
  static void prepare(const uint8_t* b, Scales& s) { k_quant_scales(b, s); }
  static vec load(const uint8_t* b, const Scales& s, int e) {  // (d * sc) * q - (dmin * m)
    const int sub = e / 32;
    const __m128i q = nibbles(load_bytes(b + 16 + 32 * (sub / 2) + e % 32), sub % 2);
    return vsub(vmul(vset1(s.d[sub]), u8_to_vec(q)), vset1(s.dm[sub]));
  }
#endif
  // a8 per super-block: d * sum_sub(sc * sum(q * a)) * dx - dmin * sum_sub(m * sum(a)) * dx
  static constexpr int kA8Block = 256;
  static constexpr bool kSigned = false, kHasMin = true;
  using A8Scales = KQuantA8Scales;
  static void prepare_a8(const uint8_t* b, A8Scales& s) { k_quant_a8_scales(b, s); }
  static __m256i quants32(const uint8_t* b, int sub) { return nibbles32(b + 16 + 32 * (sub / 2), sub % 2); }
  static __m256i a8_scale16(const A8Scales& s, int sub) { return _mm256_set1_epi16(s.sc[sub]); }
#ifdef SG_A8_ZMM
  static constexpr int kZmmOffset = 0;  // quants64 - kZmmOffset = the weights
  static __m512i quants64(const uint8_t* b, int pair) { return nibble_pair64(b + 16 + 32 * pair); }
  static constexpr bool kA8ScalePer16 = false;
#endif
};

struct Q5_KFormat {  // d, dmin, scales[12], qh[32] (bit s of qh[j] = 5th bit of weight j of sub-block s), qs[128]
  static constexpr int kBlock = 256, kBytes = 176;
  static constexpr bool kTail = false;
  using Scales = SubBlockScales;
  static void prepare(const uint8_t* b, Scales& s) { k_quant_scales(b, s); }
  static vec load(const uint8_t* b, const Scales& s, int e) {
    const int sub = e / 32;
    const __m128i low = nibbles(load_bytes(b + 48 + 32 * (sub / 2) + e % 32), sub % 2);
    const __m128i high = _mm_slli_epi16(bit_field(load_bytes(b + 16 + e % 32), sub, 1), 4);
    return vsub(vmul(vset1(s.d[sub]), u8_to_vec(_mm_or_si128(low, high))), vset1(s.dm[sub]));
  }
  static constexpr int kA8Block = 256;
  static constexpr bool kSigned = false, kHasMin = true;
  using A8Scales = KQuantA8Scales;
  static void prepare_a8(const uint8_t* b, A8Scales& s) { k_quant_a8_scales(b, s); }
  static __m256i quants32(const uint8_t* b, int sub) {
    const __m256i high = _mm256_slli_epi16(bit_field32(load32(b + 16), sub, 1), 4);
    return _mm256_or_si256(nibbles32(b + 48 + 32 * (sub / 2), sub % 2), high);
  }
  static __m256i a8_scale16(const A8Scales& s, int sub) { return _mm256_set1_epi16(s.sc[sub]); }
#ifdef SG_A8_ZMM
  static constexpr int kZmmOffset = 0;
  static __m512i quants64(const uint8_t* b, int pair) {  // 5th bits: bit 2p of qh (low half), 2p + 1 (high half)
    __m512i qh = _mm512_srl_epi16(broadcast32(b + 16), _mm_cvtsi32_si128(2 * pair));
    qh = _mm512_mask_srli_epi16(qh, kHighWords, qh, 1);
    const __m512i high = _mm512_slli_epi16(_mm512_and_si512(qh, _mm512_set1_epi8(1)), 4);
    return _mm512_or_si512(nibble_pair64(b + 48 + 32 * pair), high);
  }
  static constexpr bool kA8ScalePer16 = false;
#endif
};

struct Q6_KFormat {  // ql[128], qh[64], scales int8[16] (one per 16 weights), d fp16
  static constexpr int kBlock = 256, kBytes = 210;
  static constexpr bool kTail = false;
  struct Scales { float d[16]; };  // d * scale per 16 weights
  static void prepare(const uint8_t* b, Scales& s) {  // d * (float)scale per lane, as the scalar product
    const __m256 d = _mm256_set1_ps(fp16_to_fp32(b + 208));
    const __m128i scales = _mm_loadu_si128((const __m128i*)(b + 192));
    _mm256_storeu_ps(s.d, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(scales))));
    _mm256_storeu_ps(s.d + 8, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(scales, 8)))));
  }
  // weight 128h + r: low 4 bits from ql[64h + r % 64] (nibble r / 64), high 2 from qh[32h + r % 32] (bits 2 (r / 32))
  static vec load(const uint8_t* b, const Scales& s, int e) {  // (d * scale) * (q - 32)
    const int h = e / 128, r = e % 128;
    const __m128i low = nibbles(load_bytes(b + 64 * h + r % 64), r >= 64);
    const __m128i high = _mm_slli_epi16(bit_field(load_bytes(b + 128 + 32 * h + r % 32), 2 * (r / 32), 3), 4);
    const __m128i q = _mm_sub_epi8(_mm_or_si128(low, high), _mm_set1_epi8(32));
    return vmul(vset1(s.d[e / 16]), i8_to_vec(q));
  }
  // a8: sub-block `sub` = weights 32 sub .. + 31 (h = sub / 4, r = 32 (sub % 4)); an int8 scale per 16
  static constexpr int kA8Block = 256;
  static constexpr bool kSigned = true, kHasMin = false;
  using A8Scales = KQuantA8Scales;
  static void prepare_a8(const uint8_t* b, A8Scales& s) {
    s.d = fp16_to_fp32(b + 208);
    _mm256_store_si256((__m256i*)s.sc, _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(b + 192))));
  }
  static __m256i a8_scale16(const A8Scales& s, int sub) {  // int16 lanes 0-7 = bytes 0-15, 8-15 = bytes 16-31
    return _mm256_set_m128i(_mm_set1_epi16(s.sc[2 * sub + 1]), _mm_set1_epi16(s.sc[2 * sub]));
  }
  static __m256i quants32(const uint8_t* b, int sub) {
    const int h = sub / 4, quarter = sub % 4;
    const __m256i low = nibbles32(b + 64 * h + 32 * (quarter % 2), quarter >= 2);
    const __m256i high = _mm256_slli_epi16(bit_field32(load32(b + 128 + 32 * h), 2 * quarter, 3), 4);
    return _mm256_sub_epi8(_mm256_or_si256(low, high), _mm256_set1_epi8(32));
  }
#ifdef SG_A8_ZMM
  // sub-blocks 2p, 2p + 1 = quarters 2 (p % 2) and + 1 of half p / 2: the 64 bytes of ql there (low
  // nibbles for even p, high for odd), and qh bits 4 (p % 2) (low half) / + 2 (high half). Unsigned
  // q in [0, 63] (AVX-512 has no vpsignb): the tile subtracts 32 * the activation sums instead.
  static constexpr int kZmmOffset = 32;
  static __m512i quants64(const uint8_t* b, int pair) {
    const int h = pair / 2, odd = pair % 2;
    __m512i low = _mm512_loadu_si512((const void*)(b + 64 * h));
    if (odd) low = _mm512_srli_epi16(low, 4);
    low = _mm512_and_si512(low, _mm512_set1_epi8(0x0f));
    __m512i qh = broadcast32(b + 128 + 32 * h);
    if (odd) qh = _mm512_srli_epi16(qh, 4);
    qh = _mm512_mask_srli_epi16(qh, kHighWords, qh, 2);
    const __m512i high = _mm512_and_si512(_mm512_slli_epi16(qh, 4), _mm512_set1_epi8(0x30));
    return _mm512_or_si512(low, high);
  }
  static constexpr bool kA8ScalePer16 = true;
#endif
};

// What one micro-tile call works on: MR rows of x times NR rows of w, over K range [k_begin, k_end).
struct TileArgs {
  const float* x;       // first x row of the block (row stride ldx)
  int64_t ldx;
  const uint8_t* w;     // first w row of the tile (row stride ldw bytes)
  int64_t ldw;
  int64_t K, k_begin, k_end;  // k_end == K: finish (tail chunk, horizontal sums, epilogue)
  float* saved;         // MR * NR partial accumulators (V floats each) carried between K ranges
  const float* scale;   // per-output dequantisation scale (int8) or null
  const float* bias;    // or null
  float* y;
  int64_t ldy;
  const uint8_t* prefetch;  // see below, or null
  int64_t pf_phase, pf_stride;
  const uint8_t* xq;    // a8 mode: first quantized activation row of the block (row stride ldxq bytes)
  int64_t ldxq;
};

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

// ---------------------------------------------------------------- int8 activations (a8 mode)
// x is quantized to int8 per activation block with an fp32 scale, as llama.cpp does: blocks of 32
// for the 32-weight formats (q8_0), of 256 for the K-quants (q8_K):
//     d = amax / 127,  q = round_half_even(x * (127 / amax)).
// One activation row is, in bytes (K / 32 slots per table; K-quants use the first K / 256 d):
//     q int8[K] | d float[K / 32] | ds float[K / 32] | bsum int16[K / 32]
// with bsum = the sum of q over each 32 and ds = d * bsum (the min formats' terms).
// 32-weight formats, per block: acc = fma(int32 lanes -> fp32, weight scale * d, acc).
// Then y = hsum(acc) + mins [+ bias].
// K-quants: the 6-bit / int8 sub-block scales multiply the exact integer dot products, and each
// output's lanes are summed to ONE integer per 256 weights (exact, so the same integer in any
// order, on either build), then one fp32 update per output: acc = fma(total, d_w * d, acc), and
// acc = fnmadd(sum of m * bsum, dmin * d, acc) for the min formats. Then y = acc [+ bias].
// Every output is one fixed instruction sequence: bitwise batch invariant, and the same bits on
// AVX2 and AVX-512 CPUs: every float step sees the same integers.
constexpr int kA8Sub = 32;
inline int64_t a8_row_bytes(int64_t K) { return K + (K / kA8Sub) * (int64_t)(2 * sizeof(float) + sizeof(int16_t)); }

struct A8Row {  // views into one quantized activation row
  const uint8_t* q;
  const float* d;
  const float* ds;
  const int16_t* bsum;
  A8Row(const uint8_t* row, int64_t K)
      : q(row), d((const float*)(row + K)), ds(d + K / kA8Sub), bsum((const int16_t*)(ds + K / kA8Sub)) {}
};

inline float hmax256(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}
inline int32_t hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

// x [K] -> one activation row (see above), blocks of `block` (32 or 256) weights.
void quantize_a8_row(const float* x, int64_t K, int block, uint8_t* out) {
  int8_t* q = (int8_t*)out;
  float* d = (float*)(out + K);
  float* ds = d + K / kA8Sub;
  int16_t* bsum = (int16_t*)(ds + K / kA8Sub);
  const __m256 sign_bit = _mm256_set1_ps(-0.0f);
  for (int64_t b = 0; b < K / block; ++b) {
    const float* xb = x + block * b;
    __m256 amax = _mm256_setzero_ps();
    for (int i = 0; i < block; i += 8) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign_bit, _mm256_loadu_ps(xb + i)));
    const float max_abs = hmax256(amax);
    float inverse = 127.0f / max_abs;
    if (!(inverse <= 3.4028234e38f)) inverse = 0.0f;  // all zero (or subnormal / NaN): q = 0
    const float scale = max_abs / 127.0f;
    d[b] = scale;
    for (int s = 0; s < block / kA8Sub; ++s) {
      __m256i qi[4];
      for (int i = 0; i < 4; ++i)  // round half to even (the default rounding mode)
        qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + kA8Sub * s + 8 * i), _mm256_set1_ps(inverse)));
      // int32 -> int8 (|q| <= 127): the packs interleave 128-bit lanes, the permute restores order
      const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
      _mm256_storeu_si256((__m256i*)(q + block * b + kA8Sub * s),
                          _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
      const int32_t sum = hsum_epi32(_mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3])));
      const int64_t j = (block * b) / kA8Sub + s;
      bsum[j] = (int16_t)sum;  // |sum| <= 32 * 127
      ds[j] = scale * (float)sum;
    }
  }
}

// 8 int32 lanes, lane i = sum of u[4i..4i+3] * s[4i..4i+3] (u unsigned, s signed bytes), exact:
// the maddubs int16 pairs cannot saturate (|u| <= 128 sign-moved or <= 31 unsigned, |s| <= 127).
inline __m256i dot_u8_i8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}
// acc + the int16 pair products of (u . s per byte pair) and scale16 (K-quant sub-block scales), exact.
inline __m256i dot_u8_i8_scaled(__m256i acc, __m256i u, __m256i s, __m256i scale16) {
  const __m256i pairs = _mm256_maddubs_epi16(u, s);  // |pair| <= 2 * 32 * 127 (Q6_K) or 2 * 31 * 127
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpwssd_epi32(acc, pairs, scale16);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, scale16));
#endif
}

// Formats whose a8 tile runs two columns per zmm (the decoded 32-weight blocks of the VNNI build)
template <typename Fmt, typename = void>
struct pairs_columns : std::false_type {};
template <typename Fmt>
struct pairs_columns<Fmt, std::void_t<decltype(Fmt::kPairColumns)>> : std::bool_constant<Fmt::kPairColumns> {};

// The float accumulators live in a.saved (32-weight formats: 8 lanes + the min-term sum per output;
// K-quants: one float per output, touched once per 256 weights): keeping them out of registers
// leaves room for the integer sums.
template <typename Fmt, int MR, int NR>
void a8_tile(const TileArgs& a) {
  // a.saved, per row r (kRowFloats floats): the 8 acc lanes of each column side by side (two
  // columns = one 16-float vector), then the row's min-term sums: 4 lanes per column (all equal)
  constexpr int kRowFloats = kColsPerTile * kSavedFloats;
  static_assert(NR <= 4 && kRowFloats >= 8 * 4 + 16, "a row's acc lanes and its min-term sums fit its kRowFloats");
  float* const saved = a.saved;
  auto acc_of = [saved](int r, int c) { return saved + r * kRowFloats + 8 * c; };
  auto mins_of = [saved](int r) { return saved + r * kRowFloats + 32; };  // 16 floats, column c at 4c
  if (a.k_begin == 0) {
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      _mm256_storeu_ps(mins_of(r), _mm256_setzero_ps()), _mm256_storeu_ps(mins_of(r) + 8, _mm256_setzero_ps());
#pragma GCC unroll 8
      for (int c = 0; c < NR; ++c) _mm256_storeu_ps(acc_of(r, c), _mm256_setzero_ps());
    }
  }
  constexpr int kSubs = Fmt::kBlock / kA8Sub;
  // 32-weight formats: the float accumulators are updated every 32 weights, so they stay in
  // registers over this K range (the same operations on the same values as in memory)
  constexpr bool kBlock32 = Fmt::kA8Block == kA8Sub;
  [[maybe_unused]] __m256 acc32[MR][NR];
  [[maybe_unused]] float mins32[MR][NR];
  constexpr bool kPaired = pairs_columns<Fmt>::value;
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
        if (kPaired && c < 2 * kPairs) {
          if (c % 2 == 0) load_pair(r, c);
        } else {
          acc32[r][c] = _mm256_loadu_ps(acc_of(r, c));
        }
        mins32[r][c] = mins_of(r)[4 * c];
      }
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
        scale2[p] = _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(Fmt::a8_scale(scales[2 * p], 0))),
                                                        _mm256_castps_pd(Fmt::a8_scale(scales[2 * p + 1], 0)), 1));
      }
      const uint8_t* last = a.w + (NR - 1) * a.ldw + offset;
      const int64_t ab = kb / kA8Sub;
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        const A8Row row(a.xq + r * a.ldxq, a.K);
        __m512i xv = broadcast32(row.q + kb);
        if constexpr (Fmt::kSigned) xv = _mm512_xor_si512(xv, _mm512_set1_epi8((char)0x80));  // x + 128, unsigned
        const __m512 dx = _mm512_set1_ps(row.d[ab]);
#pragma GCC unroll 4
        for (int p = 0; p < kPairs; ++p) {
          const __m512i dot = Fmt::kSigned ? _mm512_dpbusd_epi32(start2[p], xv, wq2[p]) : _mm512_dpbusd_epi32(start2[p], wq2[p], xv);
          acc_pair[r][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(scale2[p], dx), acc_pair[r][p]);
        }
        if constexpr (NR % 2) {
          const __m256i x8 = _mm512_castsi512_si256(xv);
          const __m256i dot = Fmt::kSigned ? _mm256_dpbusd_epi32(Fmt::neg_offset_sums(last), x8, Fmt::quants32(last, 0))
                                           : _mm256_dpbusd_epi32(_mm256_setzero_si256(), Fmt::quants32(last, 0), x8);
          acc32[r][NR - 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(Fmt::a8_scale(scales[NR - 1], 0), _mm512_castps512_ps256(dx)),
                                             acc32[r][NR - 1]);
        }
        if constexpr (Fmt::kHasMin) {
#pragma GCC unroll 8
          for (int c = 0; c < NR; ++c) mins32[r][c] = mins32[r][c] + Fmt::a8_min(scales[c], 0) * row.ds[ab];
        }
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
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        const A8Row row(a.xq + r * a.ldxq, a.K);
        const __m256i xv = load32(row.q + kb);
        const __m256 dx = _mm256_set1_ps(row.d[ab]);
#pragma GCC unroll 8
        for (int c = 0; c < NR; ++c) {
          const __m256i dot = dot_u8_i8(wq[c], Fmt::kSigned ? _mm256_sign_epi8(xv, wsign[c]) : xv);
          acc32[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(Fmt::a8_scale(scales[c], 0), dx), acc32[r][c]);
          if constexpr (Fmt::kHasMin) mins32[r][c] = mins32[r][c] + Fmt::a8_min(scales[c], 0) * row.ds[ab];
        }
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
        __m512i offset16[MR];  // kZmmOffset * (x sums per 4), packed as the products: (q - offset) . x = q . x - this
        if constexpr (Fmt::kZmmOffset != 0) {
#pragma GCC unroll 8
          for (int r = 0; r < MR; ++r) {
            const __m512i offset = _mm512_set1_epi8(Fmt::kZmmOffset);
            offset16[r] = _mm512_packs_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), offset, _mm512_loadu_si512((const void*)(xq + r * a.ldxq))),
                                             _mm512_dpbusd_epi32(_mm512_setzero_si512(), offset, _mm512_loadu_si512((const void*)(xq + r * a.ldxq + 64))));
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
            __m512i products = _mm512_packs_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), w0, x0),
                                                  _mm512_dpbusd_epi32(_mm512_setzero_si512(), w1, x1));
            if constexpr (Fmt::kZmmOffset != 0) products = _mm512_sub_epi16(products, offset16[r]);
            isum2[r][c] = _mm512_dpwssd_epi32(isum2[r][c], products, scale16);
          }
        }
      }
#else
      __m256i isum[MR][NR];  // per output: 8 int32 lanes, lane j = sum over sub-blocks of sc * (bytes 4j..4j+3)
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
        for (int c = 0; c < NR; ++c) isum[r][c] = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int sub = 0; sub < kSubs; ++sub) {
        __m256i wq[NR], wsign[NR], scale16[NR];
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
            isum[r][c] = dot_u8_i8_scaled(isum[r][c], wq[c], Fmt::kSigned ? _mm256_sign_epi8(xv, wsign[c]) : xv, scale16[c]);
        }
      }
#endif
      // Each output's lanes -> ONE exact integer total per super-block (any order gives the same
      // integer), then one 4-column fp32 update per row: acc = fma(total, d_w * dx, acc), and for
      // Q4_K / Q5_K acc = fnmadd(sum over sub-blocks of m * bsum, dmin * dx, acc). Both builds run
      // these same 128-bit float ops per output. Columns past NR are zero (d = dmin = 0).
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
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        const A8Row row(a.xq + r * a.ldxq, a.K);
        const __m128 dx = _mm_set1_ps(row.d[kb / Fmt::kA8Block]);
        __m256i lanes[4];  // 8 int32 per column
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) {
#ifdef SG_A8_ZMM
          lanes[c] = c < NR ? _mm256_add_epi32(_mm512_castsi512_si256(isum2[r][c]), _mm512_extracti64x4_epi64(isum2[r][c], 1))
                            : _mm256_setzero_si256();
#else
          lanes[c] = c < NR ? isum[r][c] : _mm256_setzero_si256();
#endif
        }
        // hadd tree: lanes 0-3 of each half = the columns' partial sums, the halves added = totals
        const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(lanes[0], lanes[1]), _mm256_hadd_epi32(lanes[2], lanes[3]));
        const __m128i totals = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
        float* acc = acc_of(r, 0);  // the 4 columns' accumulators
        __m128 sum = _mm_fmadd_ps(_mm_cvtepi32_ps(totals), _mm_mul_ps(d_cols, dx), _mm_loadu_ps(acc));
        if constexpr (Fmt::kHasMin) {
          const __m256i bsum = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(row.bsum + kb / kA8Sub)));
          __m256i m = _mm256_hadd_epi32(_mm256_madd_epi16(m_cols[0], bsum), _mm256_madd_epi16(m_cols[1], bsum));
          m = _mm256_hadd_epi32(m, m);  // low half: columns 0, 2, high half: 1, 3
          const __m128i msum = _mm_unpacklo_epi32(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
          sum = _mm_fnmadd_ps(_mm_cvtepi32_ps(msum), _mm_mul_ps(dmin_cols, dx), sum);
        }
        _mm_storeu_ps(acc, sum);
      }
    }
  }
  if constexpr (kBlock32) {
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
      for (int c = 0; c < NR; ++c) {
        if (kPaired && c < 2 * kPairs) {
          if (c % 2 == 0) store_pair(r, c);
        } else {
          _mm256_storeu_ps(acc_of(r, c), acc32[r][c]);
        }
        mins_of(r)[4 * c] = mins32[r][c];
      }
  }
  if (a.k_end < a.K) return;  // the sums stay parked in a.saved
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < NR; ++c) {
      float value;
      if constexpr (Fmt::kA8Block == kA8Sub) {
        value = hsum256(_mm256_loadu_ps(acc_of(r, c)));
        if constexpr (Fmt::kHasMin) value += mins_of(r)[4 * c];
      } else {
        value = acc_of(r, 0)[c];  // K-quants: one float per output, min terms included
      }
      if (a.bias) value += a.bias[c];
      a.y[r * a.ldy + c] = value;
    }
}

using tile_fn = void (*)(const TileArgs&);

// Every (rows, cols) block size from 1x1 up to MR x NR, for the edges of M and N.
// kA8: the int8-activation tiles (a8_tile) instead of the fp32-activation ones (micro_tile).
template <typename Fmt, bool kA8, std::size_t... I>
constexpr std::array<tile_fn, sizeof...(I)> make_tile_table(std::index_sequence<I...>) {
  if constexpr (kA8) {
    return {a8_tile<Fmt, (int)(I / kColsPerTile) + 1, (int)(I % kColsPerTile) + 1>...};
  } else {
    return {micro_tile<Fmt, (int)(I / kColsPerTile) + 1, (int)(I % kColsPerTile) + 1>...};
  }
}
template <typename Fmt, bool kA8>
constexpr auto kTileTable = make_tile_table<Fmt, kA8>(std::make_index_sequence<kMaxRowsPerTile * kColsPerTile>{});

template <typename Fmt, bool kA8>
inline tile_fn pick_tile(int mr, int nr) {
  return kTileTable<Fmt, kA8>[(mr - 1) * kColsPerTile + (nr - 1)];
}

// ---------------------------------------------------------------- decode once per row panel
// Many rows (a long prefill): the weights of a tile's K-chunk are decoded ONCE into an L1-sized
// scratch and every row block of the panel runs against that, instead of each 4-row block
// decoding the same blocks again. The scratch holds exactly the values the tile would compute
// from the blocks (exact mode: the fp32 weight vectors of Fmt::load; a8: the int8 quants and
// int16 scale vectors, integers), and the tile does the same float operations on them in the
// same order, so every output keeps its bits: a row is the same in a 741-row call and alone.
// Decoded<Fmt, kA8>::kAvailable says whether a format has a decoded form; Tile is the format the
// tile reads the scratch with, kBlockBytes the scratch bytes per Fmt::kBlock weights of a row.
template <typename Fmt, bool kA8, typename = void>
struct Decoded {
  static constexpr bool kAvailable = false;
};

// exact mode, any GGUF format: the fp32 weights, read back as an fp32 row (F32Format)
template <typename Fmt>
struct Decoded<Fmt, false, std::enable_if_t<!Fmt::kTail>> {
  static constexpr bool kAvailable = true;
  using Tile = F32Format;
  static constexpr int64_t kBlockBytes = Fmt::kBlock * (int64_t)sizeof(float);
  static void decode(const uint8_t* block, uint8_t* out) {
    typename Fmt::Scales scales;
    Fmt::prepare(block, scales);
#pragma GCC unroll 32
    for (int e = 0; e < Fmt::kBlock; e += V) vstore((float*)out + e, Fmt::load(block, scales, e));
  }
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
  static constexpr int kA8Block = 256;
  using A8Scales = DecodedKQuantScales;
  static const DecodedKQuantBlock& of(const uint8_t* b) { return *(const DecodedKQuantBlock*)b; }
  static __m256i quants32(const uint8_t* b, int sub) { return _mm256_load_si256((const __m256i*)(of(b).quants + 32 * sub)); }
#ifdef SG_A8_ZMM
  static void prepare_a8(const uint8_t* b, A8Scales& s) { s = {of(b).d, of(b).dmin, of(b).m, of(b).sc, nullptr}; }
  static constexpr int kZmmOffset = Fmt::kZmmOffset;
  static constexpr bool kA8ScalePer16 = Fmt::kA8ScalePer16;
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

// Row blocks (of MR rows) a panel needs before decoding once pays for the scratch stores and
// loads (below it, each block decodes the weights itself, as for a decode step or a verify).
constexpr int64_t kDecodeOnceMinBlocks = 4;

struct LinearJob {
  const float* x;
  int64_t M, K;
  const uint8_t* w;      // [N, row_bytes]: fp32, int8 or GGUF blocks
  int64_t row_bytes;
  const float* scale;    // [N] per-row dequantisation scale (int8) or null
  int64_t N;
  const float* bias;
  float* y;
  int64_t rows_per_panel;  // x rows kept hot in L2 while a w tile is reused across them
  int64_t num_tiles;       // ceil(N / NR)
  void (*run_tiles)(const LinearJob&, int64_t, int64_t);
  const uint8_t* xq = nullptr;  // a8 mode: x quantized, M rows of a8_row_bytes(K)
  const void* ctx = nullptr;    // jobs that are not a linear (attention): their own arguments
};

// Output columns [tile_begin, tile_end) * NR for every row: w is streamed once per row panel.
// With several row blocks, K is walked in kKChunk pieces with all row blocks advancing together,
// so the weight stream and the arithmetic of every block overlap (one block after another
// would leave memory idle while the later blocks compute).
template <typename Fmt, bool kA8 = false>
void run_tiles(const LinearJob& job, int64_t tile_begin, int64_t tile_end) {
  using Dec = Decoded<Fmt, kA8>;
  const int64_t max_blocks = (std::min(job.rows_per_panel, job.M) + kMaxRowsPerTile - 1) / kMaxRowsPerTile;
  std::vector<float> saved((size_t)(max_blocks * kMaxRowsPerTile * kColsPerTile * kSavedFloats));
  // decode-once scratch: NR decoded rows of the whole K (only the current chunk is written and
  // read, so what is touched stays in L1), 64-byte aligned
  std::unique_ptr<uint8_t[]> scratch_buffer;
  uint8_t* scratch = nullptr;
  int64_t scratch_ldw = 0;
  if constexpr (Dec::kAvailable) {
    if (max_blocks >= kDecodeOnceMinBlocks) {
      scratch_ldw = job.K / Fmt::kBlock * Dec::kBlockBytes;
      scratch_buffer.reset(new uint8_t[(size_t)(kColsPerTile * scratch_ldw + 64)]);
      scratch = scratch_buffer.get() + (64 - (uintptr_t)scratch_buffer.get() % 64) % 64;
    }
  }
  for (int64_t p0 = 0; p0 < job.M; p0 += job.rows_per_panel) {
    const int64_t panel_rows = std::min(job.rows_per_panel, job.M - p0);
    const int64_t row_blocks = (panel_rows + kMaxRowsPerTile - 1) / kMaxRowsPerTile;
    const int64_t k_chunk = row_blocks > 1 ? kKChunk : job.K;
    const bool decode_once = scratch && row_blocks >= kDecodeOnceMinBlocks;
    for (int64_t t = tile_begin; t < tile_end; ++t) {
      const int64_t j0 = t * kColsPerTile;
      const int nr = (int)std::min<int64_t>(kColsPerTile, job.N - j0);
      const uint8_t* w = job.w + j0 * job.row_bytes;
      TileArgs args;
      args.w = decode_once ? scratch : w;
      args.ldw = decode_once ? scratch_ldw : job.row_bytes;
      args.ldx = args.K = job.K;
      args.scale = job.scale ? job.scale + j0 : nullptr;
      args.bias = job.bias ? job.bias + j0 : nullptr;
      args.ldy = job.N;
      // prefetch the tile kPrefetchTiles ahead (within this thread's range) while computing this one
      // (decoding once: many rows make the tile compute-bound, the hardware prefetcher keeps up)
      args.prefetch = !decode_once && t + kPrefetchTiles < tile_end ? w + kPrefetchTiles * kColsPerTile * job.row_bytes : nullptr;
      args.pf_stride = row_blocks;
      args.ldxq = a8_row_bytes(job.K);
      for (int64_t k0 = 0; k0 < job.K; k0 += k_chunk) {
        args.k_begin = k0;
        args.k_end = std::min(job.K, k0 + k_chunk);
        if constexpr (Dec::kAvailable) {
          if (decode_once)
            for (int c = 0; c < nr; ++c)
              for (int64_t kb = k0; kb < args.k_end; kb += Fmt::kBlock)
                Dec::decode(w + c * job.row_bytes + kb / Fmt::kBlock * Fmt::kBytes,
                            scratch + c * scratch_ldw + kb / Fmt::kBlock * Dec::kBlockBytes);
        }
        for (int64_t block = 0; block < row_blocks; ++block) {
          const int64_t row = p0 + block * kMaxRowsPerTile;
          const int mr = (int)std::min<int64_t>(kMaxRowsPerTile, p0 + panel_rows - row);
          args.x = job.x + row * job.K;
          args.xq = kA8 ? job.xq + row * args.ldxq : nullptr;
          args.y = job.y + row * job.N + j0;
          args.saved = saved.data() + block * kMaxRowsPerTile * kColsPerTile * kSavedFloats;
          args.pf_phase = block;
          if constexpr (Dec::kAvailable) {
            if (decode_once) {
              pick_tile<typename Dec::Tile, kA8>(mr, nr)(args);
              continue;
            }
          }
          pick_tile<Fmt, kA8>(mr, nr)(args);
        }
      }
    }
  }
}

// ---------------------------------------------------------------- a8 K-quants on AMX int8 tiles
// CPUs with AMX (Sapphire Rapids on): one TDPBSSD multiplies a 16 x 64-byte int8 tile by a 64 x 16
// one into 16 x 16 int32 sums. The a8 K-quant outputs are defined by exact integers (see "int8
// activations": per output and super-block ONE integer total of sub-block scale * sub-block dot
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
#if defined(SG_A8_ZMM) && defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512VBMI__)
#define SG_AMX 1
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
  } else {  // Q4_K / Q5_K: d, dmin at 0, 2; 6-bit scales and mins in bytes 4-15 (k_quant_6bit_bytes, per lane)
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

template <typename Fmt>
constexpr std::array<void (*)(const LinearJob&, int64_t, int64_t), 3> amx_tile_runners() {
  if constexpr (Fmt::kA8Block == 256) return {amx_tiles<Fmt, 4>, amx_tiles<Fmt, 8>, amx_tiles<Fmt, 16>};
  else return {nullptr, nullptr, nullptr};
}
#endif

// AMX on when the build has it, the CPU has it, the kernel asked Linux for the tile state and got
// it, and the caller wants it (sg_set_amx); from amx_min_rows activation rows (below, the decode
// of 16 weight rows per tile costs more than the tile products save; a decode step stays on VNNI).
// Measured (one core, 8960 x 1536, min of 20): Q4_K 3 rows 0.56 ms on AMX vs 0.65 on VNNI (2 rows
// 0.56 vs 0.53); Q6_K, whose planes cost the same decode at any row count, 5 rows 1.34 vs 1.37 (4
// rows 1.28 vs 0.97, 8 rows 1.40 vs 1.89; thread CPU time, min of 30, loaded machine).
std::atomic<int> g_amx_on{0};
std::atomic<int64_t> g_amx_min_rows{0};  // 0: the measured thresholds; tests set 1 to run every path
inline int64_t amx_min_rows(int ggml_type) {
  const int64_t forced = g_amx_min_rows.load();
  return forced > 0 ? forced : ggml_type == 14 ? 5 : 3;
}

// Rows of a block-format weight written out as fp32 (an embedding lookup), with the same
// per-weight expressions as the linear.
template <typename Fmt>
void dequantize_row(const uint8_t* row, int64_t K, float* out) {
  for (int64_t kb = 0; kb < K; kb += Fmt::kBlock) {
    const uint8_t* block = row + kb / Fmt::kBlock * Fmt::kBytes;
    typename Fmt::Scales scales;
    Fmt::prepare(block, scales);
#pragma GCC unroll 32
    for (int e = 0; e < Fmt::kBlock; e += V) vstore(out + kb + e, Fmt::load(block, scales, e));
  }
}

// The GGUF formats by ggml type id (GGMLQuantizationType).
struct BlockFormat {
  int block, bytes;
  void (*run_tiles)(const LinearJob&, int64_t, int64_t);
  void (*dequantize_row)(const uint8_t*, int64_t, float*);
  void (*run_tiles_a8)(const LinearJob&, int64_t, int64_t);  // int8 activations
  int a8_block;  // activation block of the a8 mode (32, or 256 for K-quants)
#ifdef SG_AMX
  std::array<void (*)(const LinearJob&, int64_t, int64_t), 3> run_tiles_amx;  // a8 on AMX, 4 / 8 / 16 rows per B tile (K-quants)
#endif
};
template <typename Fmt>
constexpr BlockFormat block_format() {
  return {Fmt::kBlock, Fmt::kBytes, run_tiles<Fmt>, dequantize_row<Fmt>, run_tiles<Fmt, true>, Fmt::kA8Block,
#ifdef SG_AMX
          amx_tile_runners<Fmt>(),
#endif
  };
}
const BlockFormat* find_block_format(int ggml_type) {
  static const BlockFormat q4_0 = block_format<Q4_0Format>(), q4_1 = block_format<Q4_1Format>(),
                           q5_0 = block_format<Q5_0Format>(), q8_0 = block_format<Q8_0Format>(),
                           q4_k = block_format<Q4_KFormat>(), q5_k = block_format<Q5_KFormat>(),
                           q6_k = block_format<Q6_KFormat>();
  switch (ggml_type) {
    case 2: return &q4_0;
    case 3: return &q4_1;
    case 6: return &q5_0;
    case 8: return &q8_0;
    case 12: return &q4_k;
    case 13: return &q5_k;
    case 14: return &q6_k;
    default: return nullptr;
  }
}

// A tiny persistent thread pool. Work is handed out in chunks of output tiles through an atomic
// counter, so a worker that the (shared, oversubscribed) CPU preempts or wakes late just takes
// fewer chunks instead of stalling the call; which thread computes a tile never changes its bits.
// Workers spin briefly after each job (the linears of a layer arrive microseconds apart), then
// sleep on a condition variable so an idle process does not burn the other core.
class Pool {
 public:
  explicit Pool(int num_workers) : pid_(getpid()) {
    // workers start from generation 0 explicitly: a job may be posted before a thread first runs
    for (int i = 0; i < num_workers; ++i) workers_.emplace_back([this] { worker_loop(0); });
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_.store(true);
      generation_.fetch_add(1);
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
  }
  int size() const { return (int)workers_.size() + 1; }
  pid_t pid() const { return pid_; }
  void set_spin_us(int64_t us) { spin_us_.store(us); }

  // Runs all `num_chunks` chunks of `job`; returns when every chunk is written and no worker
  // still looks at `job` (so the caller may post the next one).
  void run(const LinearJob& job, int64_t num_chunks) {
    job_ = &job;
    num_chunks_ = num_chunks;
    next_chunk_.store(0);
    done_chunks_.store(0);
    uint64_t gen;
    {
      std::lock_guard<std::mutex> lock(mu_);
      gen = generation_.fetch_add(1) + 1;
    }
    if (sleepers_.load() > 0) cv_.notify_all();
    work_on_current_job();
    while (done_chunks_.load() < num_chunks) _mm_pause();
    retired_.store(gen);                        // late workers must not start on this job ...
    while (active_.load() > 0) _mm_pause();     // ... and those already inside finish claiming
  }

 private:
  void work_on_current_job() {
    for (;;) {
      const int64_t chunk = next_chunk_.fetch_add(1);
      if (chunk >= num_chunks_) return;
      const int64_t n = job_->num_tiles;
      job_->run_tiles(*job_, n * chunk / num_chunks_, n * (chunk + 1) / num_chunks_);
      done_chunks_.fetch_add(1);
    }
  }

  void worker_loop(uint64_t seen) {
    while (true) {
      const auto spin_until = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us_.load());
      while (generation_.load() == seen && std::chrono::steady_clock::now() < spin_until) {
        for (int i = 0; i < 32; ++i) _mm_pause();
      }
      if (generation_.load() == seen) {
        std::unique_lock<std::mutex> lock(mu_);
        sleepers_.fetch_add(1);
        cv_.wait(lock, [&] { return generation_.load() != seen; });
        sleepers_.fetch_sub(1);
      }
      seen = generation_.load();
      if (stop_.load()) return;
      // Dekker-style handshake with run(): either run() sees us active and waits, or we see the
      // job retired / superseded and leave its fields alone.
      active_.fetch_add(1);
      if (generation_.load() == seen && retired_.load() != seen) work_on_current_job();
      active_.fetch_sub(1);
    }
  }

  pid_t pid_;
  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<uint64_t> retired_{0};
  std::atomic<int64_t> next_chunk_{0};
  std::atomic<int64_t> done_chunks_{0};
  std::atomic<int> active_{0};
  std::atomic<int> sleepers_{0};
  std::atomic<int64_t> spin_us_{50};
  std::atomic<bool> stop_{false};
  const LinearJob* job_ = nullptr;
  int64_t num_chunks_ = 0;
};

std::mutex g_pool_mu;            // one multi-threaded call at a time; others run single-threaded
std::unique_ptr<Pool> g_pool;    // rebuilt when the thread count asked for changes
std::atomic<int64_t> g_spin_us{50};

int run_job(LinearJob& job, int num_threads, int64_t work);

// Splits `job` over the thread pool (or runs it inline when small / the pool is busy).
int run_linear(LinearJob& job, int num_threads) {
  // Keep a panel of x rows within ~512 KiB of L2 so each w tile is reused from cache across it;
  // beyond that (long prefills) w is streamed once per panel. Multiple of MR, at least 16 rows.
  const int64_t panel = (512 * 1024 / 4) / job.K;
  job.rows_per_panel = std::max<int64_t>(16, panel - panel % kMaxRowsPerTile);
  job.num_tiles = (job.N + kColsPerTile - 1) / kColsPerTile;

  return run_job(job, num_threads, job.M * job.N * job.K);
}

// Runs job.run_tiles over [0, job.num_tiles) on the pool, or inline when `work` (multiply-adds)
// is small or the pool is busy. Which thread runs a tile never changes its bits.
int run_job(LinearJob& job, int num_threads, int64_t work) {
  // Little work: splitting costs more than it saves.
  const int threads = std::max(1, num_threads);
  if (threads == 1 || job.num_tiles == 1 || work < (int64_t)1 << 18) {
    job.run_tiles(job, 0, job.num_tiles);
    return 0;
  }
  std::unique_lock<std::mutex> lock(g_pool_mu, std::try_to_lock);
  if (!lock.owns_lock()) {  // another thread is using the pool: same result, single-threaded
    job.run_tiles(job, 0, job.num_tiles);
    return 0;
  }
  if (g_pool && g_pool->pid() != getpid()) g_pool.release();  // forked child: the workers are gone
  if (!g_pool || g_pool->size() != threads) {  // every pool thread joins in: match the count asked for
    g_pool.reset();
    g_pool = std::make_unique<Pool>(threads - 1);
    g_pool->set_spin_us(g_spin_us.load());
  }
  // ~8 chunks per thread: fine enough to rebalance around a preempted thread, coarse enough
  // that each chunk streams a long contiguous run of w.
  g_pool->run(job, std::min<int64_t>(job.num_tiles, 8 * (int64_t)threads));
  return 0;
}

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
  float* out;              // [B, H, T, D] contiguous
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
        float* out = a.out + ((b * a.H + kv_head * group + g) * a.T + t0 + r) * a.D;
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

bool bad_shape(const void* x, int64_t M, int64_t K, const void* w, int64_t N, const float* y, int* status) {
  if (M < 0 || K <= 0 || N < 0) return *status = 1, true;
  if (M == 0 || N == 0) return *status = 0, true;  // nothing to do; empty tensors may have null data
  if (!x || !w || !y) return *status = 1, true;
  return false;
}

}  // namespace

extern "C" {

const char* sg_isa() { return kIsa; }
int sg_vector_width() { return V; }

// Microseconds pool workers spin-wait for the next call before sleeping (0 = sleep at once).
void sg_set_spin_us(int64_t spin_us) {
  g_spin_us.store(spin_us);
  std::lock_guard<std::mutex> lock(g_pool_mu);
  if (g_pool) g_pool->set_spin_us(spin_us);
}

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

// Weights of `ggml_type` per block, or 0 when the kernel does not know the type.
int sg_block_size(int ggml_type) {
  const BlockFormat* f = find_block_format(ggml_type);
  return f ? f->block : 0;
}
// Bytes per block of `ggml_type`, or 0.
int sg_block_bytes(int ggml_type) {
  const BlockFormat* f = find_block_format(ggml_type);
  return f ? f->bytes : 0;
}

// GGUF block weights: y = x @ dequantize(w)^T (+ bias), bitwise the fp32 kernel on the
// dequantized matrix. w [N, K / block * bytes] (ggml row layout); K a multiple of the block size.
int sg_linear_gguf(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, int ggml_type,
                   const float* bias, float* y, int num_threads) {
  const BlockFormat* f = find_block_format(ggml_type);
  if (!f || K % f->block) return 1;
  int status;
  if (bad_shape(x, M, K, w, N, y, &status)) return status;
  LinearJob job{x, M, K, w, K / f->block * f->bytes, nullptr, N, bias, y, 0, 0, f->run_tiles};
  return run_linear(job, num_threads);
}

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
  for (int64_t i = 0; i < M; ++i) quantize_a8_row(x + i * K, K, f->a8_block, xq.data() + i * a8_row_bytes(K));
  LinearJob job{x, M, K, w, K / f->block * f->bytes, nullptr, N, bias, y, 0, 0, f->run_tiles_a8};
  job.xq = xq.data();
#ifdef SG_AMX
  if (g_amx_on.load() && f->run_tiles_amx[0] && M >= amx_min_rows(ggml_type)) {
    const int mp = M <= 4 ? 4 : M <= 8 ? 8 : 16;
    AmxActivations act;
    prepare_amx_activations(xq.data(), M, K, mp, amx_group(ggml_type == 14, mp), 32, act);
    const AmxJob amx{&act};
    job.ctx = &amx;
    job.run_tiles = f->run_tiles_amx[mp == 4 ? 0 : mp == 8 ? 1 : 2];
    job.num_tiles = (N + kAmxTileRows - 1) / kAmxTileRows;
    return run_job(job, num_threads, M * N * K);
  }
#endif
  return run_linear(job, num_threads);
}

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
  for (int64_t i = 0; i < M; ++i) quantize_a8_row(x + i * K, K, block, out + i * a8_row_bytes(K));
  return 0;
}

// 1 when the integer dot products use VNNI (vpdpbusd), 0 for AVX2 maddubs; same results either way.
int sg_a8_vnni() {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return 1;
#else
  return 0;
#endif
}

// out[i, :] = dequantize(w[rows[i], :]) for i < n (an embedding lookup); rows must be in [0, N).
int sg_dequantize_rows(const uint8_t* w, int64_t K, int ggml_type, const int64_t* rows, int64_t n, float* out) {
  const BlockFormat* f = find_block_format(ggml_type);
  if (!f || K <= 0 || K % f->block || n < 0) return 1;
  const int64_t row_bytes = K / f->block * f->bytes;
  for (int64_t i = 0; i < n; ++i) f->dequantize_row(w + rows[i] * row_bytes, K, out + i * K);
  return 0;
}

// Attention (see AttentionArgs): q / out [B, H, T, D] contiguous; k, v [B, Hkv, S, D] with
// strides kv_stride_b / kv_stride_h (floats) and rows of D contiguous; mask [B, T, S] bytes
// (nonzero = visible) or null. H a multiple of Hkv. Returns 0, or 1 on bad arguments.
int sg_attention(const float* q, const float* k, const float* v, int64_t kv_stride_b, int64_t kv_stride_h,
                 const uint8_t* mask, int64_t B, int64_t H, int64_t Hkv, int64_t T, int64_t S, int64_t D,
                 float scale, float* out, int num_threads) {
  if (B < 0 || T < 0 || S < 0 || D <= 0 || H <= 0 || Hkv <= 0 || H % Hkv || H / Hkv > 64) return 1;
  if (B == 0 || T == 0) return 0;
  if (!q || !out || (S > 0 && (!k || !v))) return 1;
  AttentionArgs args{q, k, v, kv_stride_b, kv_stride_h, mask, B, H, Hkv, T, S, D, scale, out};
  LinearJob job{};
  job.num_tiles = B * Hkv * ((T + kAttentionRows - 1) / kAttentionRows);
  job.run_tiles = attention_rows;
  job.ctx = &args;
  return run_job(job, num_threads, B * H * T * S * D * 2);  // multiply-adds: scores and weighted values
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
