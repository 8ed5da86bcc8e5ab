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
// a few g++ invocations with no torch headers; the parts are compiled together into one library:
//     skinny_gemm.h   this header: the ISA's vector type, the weight formats (fp32, int8 and the
//                     GGUF block layouts), the tile arguments and the panel walk (run_tiles), and
//                     what the parts call of each other
//     gemm.cpp        fp32-activation tiles (micro_tile): sg_linear_f32, sg_linear_i8
//     gguf.cpp        the GGUF formats by ggml type id, sg_linear_gguf, sg_dequantize_rows
//     a8.cpp          int8 activations (a8_tile): sg_linear_gguf_a8, sg_quantize_a8
//     a8_int.h        a8's integer side on 256 bits (a8.cpp, a8_interleaved.cpp): activation rows, dot-product steps,
//                     the 256-bit builds' sub-block pairing
//     amx.cpp         the a8 K-quant linears on AMX int8 tiles (built where the CPU has AMX)
//     a8_interleaved.cpp  the a8 K-quants (Q4_K, Q6_K) from a copy interleaved 16 (zmm, a8_interleaved_zmm.h)
//                     or 8 (ymm, a8_interleaved_ymm.h) columns wide: sg_interleave, sg_linear_interleaved_a8
//     attention.cpp   batch-invariant attention and rotary embedding (and both as one call with the
//                     KV cache writes: a layer's attention step)
//     norm.cpp        RMSNorm, with the residual add before it (the glue between a layer's linears)
//     layer.cpp       a layer's GGUF linears in fewer calls: q / k / v, and silu(gate) * up
//     threads.cpp     the thread pool every call runs on
// Only the sg_* functions are exported; everything else is hidden in namespace sg.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#pragma GCC visibility push(hidden)
namespace sg {

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
#ifdef __AVXVNNI__
constexpr const char* kIsa = "avx2-vnni";  // the AVX2 build whose a8 dot products use AVX-VNNI (a8.cpp)
#else
constexpr const char* kIsa = "avx2";
#endif
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
// The 32-weight formats' blocks of two columns, one per 256-bit half (the raw blocks' 1-4 row tiles):
// 16 bytes of each -> its 16 low nibbles, then its 16 high nibbles (split_nibbles32 of each half)
inline __m512i split_nibbles_pair(const uint8_t* p0, const uint8_t* p1) {
  const __m512i b = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)p0))),
                                       _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)p1)), 1);
  return _mm512_and_si512(_mm512_mask_srli_epi16(b, 0xff00ff00u, b, 4), _mm512_set1_epi8(0x0f));  // words of 128-bit lanes 1, 3
}
inline __m512i load_pair64(const uint8_t* p0, const uint8_t* p1) {  // 32 bytes of each, p0's in the low half
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)p0)), _mm256_loadu_si256((const __m256i*)p1), 1);
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

// ---- decode once per row panel (Decoded, run_tiles): the row blocks (of MR rows) a panel needs
// before decoding each weight block once into an L1 scratch, for all its blocks to reuse, pays
// for the scratch stores and loads (below it, each block decodes the weights itself).
// Exact mode (both builds) and the a8 32-weight formats on AVX2: from 2 blocks (5+ rows), measured
// with the decode's prefetch (run_tiles): 1.5B T(5) / T(8) exact 199 / 228 -> 181 / 223 ms (a8 K-quants
// on AVX2: kA8DecodeOnceFewBlocks below)
constexpr int64_t kDecodeOnceMinBlocks = 2;
// a8 on the VNNI build, per format (kA8DecodeOnceMinBlocks): from 2 blocks (5+ rows) where two
// blocks' savings outweigh one decode. Without the scratch every row block unpacks the weight
// blocks again (nibbles, 5th bits, scales); on the scratch the 32-weight formats also run two
// columns per zmm. Static counts per 4 columns (docs/performance.md), e.g. Q4_K per super-block:
// the 4-row tile 584 instructions on the blocks, 437 on the scratch, the decode 268.
#ifdef SG_A8_ZMM
constexpr int64_t kA8DecodeOnceFewBlocks = 2;
// The 32-weight formats' raw blocks run two columns per zmm too (raw_pairs in a8.cpp), so there the
// scratch pays only from more blocks: from n blocks where decode + n x (4-row tile on the scratch) <
// n x (4-row tile on the blocks), static counts per 4 columns (docs/performance.md)
constexpr int64_t a8_pairs_min_blocks(int64_t zmm_blocks) { return zmm_blocks; }
#else
// a8 K-quants on AVX2: from 3 blocks (9+ rows). With the raw tile's sums in registers, two 4-row
// blocks on the raw blocks beat one decode + the scratch (1.5B T(5) / T(8) 126 / 169 -> 121 / 162 ms)
constexpr int64_t kA8DecodeOnceFewBlocks = 3;
constexpr int64_t a8_pairs_min_blocks(int64_t) { return kDecodeOnceMinBlocks; }
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
  static constexpr int64_t kA8DecodeOnceMinBlocks = a8_pairs_min_blocks(7);
  static constexpr bool kSigned = true, kHasMin = false;
  static __m256i quants32(const uint8_t* b, int) { return _mm256_sub_epi8(split_nibbles32(b + 2), _mm256_set1_epi8(8)); }
  static __m256 a8_scale(const Scales& s, int) { return _mm256_set1_ps(s.d); }
  static float a8_min(const Scales&, int) { return 0.0f; }
  // unsigned quants u = q + kA8QuantOffset: the VNNI build's raw 1-4 row tiles (two columns' quants
  // per zmm) and every build's interleaved copy (a8_interleaved.cpp)
  static constexpr int kA8QuantOffset = 8;
#ifdef SG_A8_ZMM
  static __m512i quants_u64(const uint8_t* b0, const uint8_t* b1) {
    return split_nibbles_pair(b0 + 2, b1 + 2);
  }
#endif
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
  static constexpr int64_t kA8DecodeOnceMinBlocks = a8_pairs_min_blocks(8);
  static constexpr bool kSigned = false, kHasMin = true;
  static __m256i quants32(const uint8_t* b, int) { return split_nibbles32(b + 4); }
  static __m256 a8_scale(const Scales& s, int) { return _mm256_set1_ps(s.d); }
  static float a8_min(const Scales& s, int) { return s.m; }
  // unsigned quants u = q + kA8QuantOffset: the VNNI build's raw 1-4 row tiles (two columns' quants
  // per zmm) and every build's interleaved copy (a8_interleaved.cpp)
  static constexpr int kA8QuantOffset = 0;
#ifdef SG_A8_ZMM
  static __m512i quants_u64(const uint8_t* b0, const uint8_t* b1) {
    return split_nibbles_pair(b0 + 4, b1 + 4);
  }
#endif
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
  static constexpr int64_t kA8DecodeOnceMinBlocks = a8_pairs_min_blocks(5);
  static constexpr bool kSigned = true, kHasMin = false;
  static __m256i quants32(const uint8_t* b, int) {  // (nibble | 16 * bit j of qh) - 16
    uint32_t qh;
    std::memcpy(&qh, b + 2, 4);
    const __m256i high = _mm256_and_si256(bits_to_bytes32(qh), _mm256_set1_epi8(16));
    return _mm256_sub_epi8(_mm256_or_si256(split_nibbles32(b + 6), high), _mm256_set1_epi8(16));
  }
  static __m256 a8_scale(const Scales& s, int) { return _mm256_set1_ps(s.d); }
  static float a8_min(const Scales&, int) { return 0.0f; }
  // unsigned quants u = q + kA8QuantOffset: the VNNI build's raw 1-4 row tiles (two columns' quants
  // per zmm) and every build's interleaved copy (a8_interleaved.cpp)
  static constexpr int kA8QuantOffset = 16;
#ifdef SG_A8_ZMM
  static __m512i quants_u64(const uint8_t* b0, const uint8_t* b1) {
    uint32_t qh0, qh1;  // bit j: 16 on weight j
    std::memcpy(&qh0, b0 + 2, 4), std::memcpy(&qh1, b1 + 2, 4);
    const __m512i low = split_nibbles_pair(b0 + 6, b1 + 6);
    return _mm512_mask_add_epi8(low, _cvtu64_mask64((uint64_t)qh1 << 32 | qh0), low, _mm512_set1_epi8(16));
  }
#endif
};

struct Q8_0Format {  // d fp16, qs int8[32]
  static constexpr int kBlock = 32, kBytes = 34;
  static constexpr bool kTail = false;
  using Scales = Scale1;
  static void prepare(const uint8_t* b, Scales& s) { s.d = fp16_to_fp32(b); }
  static vec load(const uint8_t* b, const Scales& s, int e) { return vmul(i8_to_vec(load_bytes(b + 2 + e)), vset1(s.d)); }
  static constexpr int kA8Block = 32;
  static constexpr int64_t kA8DecodeOnceMinBlocks = a8_pairs_min_blocks(8);
  static constexpr bool kSigned = true, kHasMin = false;
  static __m256i quants32(const uint8_t* b, int) { return load32(b + 2); }
  static __m256 a8_scale(const Scales& s, int) { return _mm256_set1_ps(s.d); }
  static float a8_min(const Scales&, int) { return 0.0f; }
  // unsigned quants u = q + kA8QuantOffset: the VNNI build's raw 1-4 row tiles (two columns' quants
  // per zmm) and every build's interleaved copy (a8_interleaved.cpp)
  static constexpr int kA8QuantOffset = 128;
#ifdef SG_A8_ZMM
  static __m512i quants_u64(const uint8_t* b0, const uint8_t* b1) {
    return _mm512_xor_si512(load_pair64(b0 + 2, b1 + 2), _mm512_set1_epi8((char)0x80));  // q + 128 (mod 256)
  }
#endif
};

// Q4_K / Q5_K: 256 weights in 8 sub-blocks of 32, each with a 6-bit scale and min packed in 12 bytes.
struct SubBlockScales { float d[8], dm[8]; };  // d * sc and dmin * m per sub-block

// A K-quant block's first 16 bytes: d, dmin (fp16), then 12 bytes of 6-bit scales and mins: bytes
// 0-3 the low 6 bits of sc 0-3, 4-7 of m 0-3, 8-11 the low 4 bits of sc / m 4-7 (their high 2 bits
// are the top 2 of bytes 0-7). Unpacked in one 128-bit register, 32-bit words at a time (a tile on
// the raw blocks unpacks every block it touches): int16 lanes 0-7 = sc, 8-15 = m.
inline __m256i k_quant_6bit_epi16(__m128i head) {
  const __m128i lo_mid = _mm_shuffle_epi32(head, _MM_SHUFFLE(2, 1, 2, 1));
  const __m128i hi_hi4 = _mm_srlv_epi32(_mm_shuffle_epi32(head, _MM_SHUFFLE(3, 3, 3, 3)), _mm_setr_epi32(0, 4, 0, 4));
  const __m128i low6 = _mm_and_si128(lo_mid, _mm_set1_epi8(0x3f));  // sc 0-3 | m 0-3
  const __m128i high6 = _mm_or_si128(_mm_and_si128(hi_hi4, _mm_set1_epi8(0x0f)),
                                     _mm_and_si128(_mm_srli_epi32(lo_mid, 2), _mm_set1_epi8(0x30)));  // sc 4-7 | m 4-7
  return _mm256_cvtepu8_epi16(_mm_unpacklo_epi32(low6, high6));
}

inline void k_quant_scales(const uint8_t* b, SubBlockScales& s) {
  const __m256i sc_m = k_quant_6bit_epi16(_mm_loadu_si128((const __m128i*)b));
  // d * (float)sc per lane: the same single rounded product as the scalar expression
  const __m256 d = _mm256_set1_ps(fp16_to_fp32(b)), dmin = _mm256_set1_ps(fp16_to_fp32(b + 2));
  _mm256_storeu_ps(s.d, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(sc_m)))));
  _mm256_storeu_ps(s.dm, _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_extracti128_si256(sc_m, 1)))));
}

// a8 mode, K-quants: the integer sub-block scales multiply the integer dot products (exact), the
// fp16 super-block scales come once per 256 weights (activations quantized per 256, as q8_K).
struct KQuantA8Scales {
  float d, dmin;
  alignas(32) int16_t sc[16];  // per 32 weights (Q4_K, Q5_K: first 8, then the 8 m) or per 16 (Q6_K)
  alignas(16) int16_t m[8];    // per 32 weights (Q4_K, Q5_K)
};
inline void k_quant_a8_scales(const uint8_t* b, KQuantA8Scales& s) {
  const __m128i head = _mm_loadu_si128((const __m128i*)b);
  // one 32-byte store, so that the 32-byte loads of the scales forward from it (two halves would stall)
  const __m256i sc_m = k_quant_6bit_epi16(head);
  _mm256_store_si256((__m256i*)s.sc, sc_m);
  _mm_store_si128((__m128i*)s.m, _mm256_extracti128_si256(sc_m, 1));
  static_assert(offsetof(KQuantA8Scales, dmin) == offsetof(KQuantA8Scales, d) + sizeof(float), "d, dmin adjacent");
  _mm_storel_pi((__m64*)&s.d, _mm_cvtph_ps(head));  // d, dmin (fp16 -> fp32 is exact)
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
  static constexpr int64_t kA8DecodeOnceMinBlocks = kA8DecodeOnceFewBlocks;
  static constexpr bool kSigned = false, kHasMin = true;
  static constexpr int kQuantOffset = 0;  // quants32 + this = the unsigned quant (AVX2 K-quant tile)
  static constexpr bool kA8ScalePer16 = false;  // an integer scale per 32 weights
  using A8Scales = KQuantA8Scales;
  static void prepare_a8(const uint8_t* b, A8Scales& s) { k_quant_a8_scales(b, s); }
  static __m256i quants32(const uint8_t* b, int sub) { return nibbles32(b + 16 + 32 * (sub / 2), sub % 2); }
  static __m256i a8_scale16(const A8Scales& s, int sub) { return _mm256_set1_epi16(s.sc[sub]); }
#ifdef SG_A8_ZMM
  static constexpr int kZmmOffset = 0;  // quants64 - kZmmOffset = the weights
  static __m512i quants64(const uint8_t* b, int pair) { return nibble_pair64(b + 16 + 32 * pair); }
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
  static constexpr int64_t kA8DecodeOnceMinBlocks = kA8DecodeOnceFewBlocks;
  static constexpr bool kSigned = false, kHasMin = true;
  static constexpr int kQuantOffset = 0;  // quants32 + this = the unsigned quant (AVX2 K-quant tile)
  static constexpr bool kA8ScalePer16 = false;  // an integer scale per 32 weights
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
#ifdef SG_A8_ZMM
  // VNNI: decode once from 4 row blocks: its scratch saves the tile less (556 -> 468 instructions per
  // super-block x 4 columns, the decode 212), and 2 blocks measured slower (1.5B T(8) 121 -> 124 ms)
  static constexpr int64_t kA8DecodeOnceMinBlocks = 4;
#else
  static constexpr int64_t kA8DecodeOnceMinBlocks = kA8DecodeOnceFewBlocks;
#endif
  static constexpr bool kSigned = true, kHasMin = false;
  static constexpr int kQuantOffset = 32;  // quants32 + 32 = the 6-bit quant, 0..63
  static constexpr bool kA8ScalePer16 = true;  // an integer scale per 16 weights
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
  const uint8_t* prefetch;  // see micro_tile (gemm.cpp), or null
  int64_t pf_phase, pf_stride;
  const uint8_t* xq;    // a8 mode: first quantized activation row of the block (row stride ldxq bytes)
  int64_t ldxq;
};

// ---------------------------------------------------------------- int8 activations (a8 mode, a8.cpp)
// x is quantized to int8 per activation block with an fp32 scale, as llama.cpp does: blocks of 32
// for the 32-weight formats (q8_0), of 256 for the K-quants (q8_K).
// One activation row is, in bytes (K / 32 slots per table; K-quants use the first K / 256 d):
//     q int8[K] | d float[K / 32] | ds float[K / 32] | bsum int16[K / 32] | bsum16 int16[K / 16]
// with bsum = the sum of q over each 32, ds = d * bsum (the min formats' terms) and bsum16 = the sum
// of q over each 16 (Q6_K's offset term on the AVX2 build). The plain AVX2 build stores the q of
// K-quant rows (blocks of 256) in sub-block pairs interleaved (a8_int.h, pair_sub_blocks); the sums
// are over the natural order.
constexpr int kA8Sub = 32;
inline int64_t a8_row_bytes(int64_t K) {
  return K + (K / kA8Sub) * (int64_t)(2 * sizeof(float) + sizeof(int16_t)) + (K / 16) * (int64_t)sizeof(int16_t);
}

struct A8Row {  // views into one quantized activation row
  const uint8_t* q;
  const float* d;
  const float* ds;
  const int16_t* bsum;
  const int16_t* bsum16;
  A8Row(const uint8_t* row, int64_t K)
      : q(row), d((const float*)(row + K)), ds(d + K / kA8Sub), bsum((const int16_t*)(ds + K / kA8Sub)), bsum16(bsum + K / kA8Sub) {}
};

using tile_fn = void (*)(const TileArgs&);

// Tiles<Fmt, kA8>::pick(mr, nr): the tile function for an mr x nr block of outputs (1..MR x
// 1..NR, for the edges of M and N), specialised by the part that holds the tiles: micro_tile
// (fp32 activations, gemm.cpp) or a8_tile (int8 activations, kA8, a8.cpp).
template <typename Fmt, bool kA8>
struct Tiles;

// ---------------------------------------------------------------- decode once per row panel
// Many rows (a long prefill): the weights of a tile's K-chunk are decoded ONCE into an L1-sized
// scratch and every row block of the panel runs against that, instead of each 4-row block
// decoding the same blocks again. The scratch holds exactly the values the tile would compute
// from the blocks (exact mode: the fp32 weight vectors of Fmt::load; a8: the int8 quants and
// int16 scale vectors, integers), and the tile does the same float operations on them in the
// same order, so every output keeps its bits: a row is the same in a 741-row call and alone.
// Decoded<Fmt, kA8>::kAvailable says whether a format has a decoded form; Tile is the format the
// tile reads the scratch with, kBlockBytes the scratch bytes per Fmt::kBlock weights of a row,
// kMinBlocks the row blocks a panel needs before it decodes once (kDecodeOnceMinBlocks, or the
// format's kA8DecodeOnceMinBlocks in the a8 mode).
// The decoded forms are specialisations in the parts: exact mode in gemm.cpp, a8 in a8.cpp.
template <typename Fmt, bool kA8, typename = void>
struct Decoded {
  static constexpr bool kAvailable = false;
};

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
    if (max_blocks >= Dec::kMinBlocks) {
      scratch_ldw = job.K / Fmt::kBlock * Dec::kBlockBytes;
      scratch_buffer.reset(new uint8_t[(size_t)(kColsPerTile * scratch_ldw + 64)]);
      scratch = scratch_buffer.get() + (64 - (uintptr_t)scratch_buffer.get() % 64) % 64;
    }
  }
  for (int64_t p0 = 0; p0 < job.M; p0 += job.rows_per_panel) {
    const int64_t panel_rows = std::min(job.rows_per_panel, job.M - p0);
    const int64_t row_blocks = (panel_rows + kMaxRowsPerTile - 1) / kMaxRowsPerTile;
    const int64_t k_chunk = row_blocks > 1 ? kKChunk : job.K;
    bool decode_once = false;
    if constexpr (Dec::kAvailable) decode_once = scratch && row_blocks >= Dec::kMinBlocks;
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
          if (decode_once) {
            for (int c = 0; c < nr; ++c)
              for (int64_t kb = k0; kb < args.k_end; kb += Fmt::kBlock)
                Dec::decode(w + c * job.row_bytes + kb / Fmt::kBlock * Fmt::kBytes,
                            scratch + c * scratch_ldw + kb / Fmt::kBlock * Dec::kBlockBytes);
            // the same K range of the tile kPrefetchTiles ahead: the decode reads each weight once,
            // so without this its stream stalls on memory between the compute-bound row blocks
            const int64_t ahead = t + kPrefetchTiles < tile_end ? std::min<int64_t>(kColsPerTile, job.N - (j0 + kPrefetchTiles * kColsPerTile)) : 0;
            for (int c = 0; c < ahead; ++c)
                for (int64_t line = k0 / Fmt::kBlock * Fmt::kBytes / 64 * 64; line < args.k_end / Fmt::kBlock * Fmt::kBytes; line += 64)
                  _mm_prefetch((const char*)(w + (kPrefetchTiles * kColsPerTile + c) * job.row_bytes + line), _MM_HINT_T1);
          }
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
              Tiles<typename Dec::Tile, kA8>::pick(mr, nr)(args);
              continue;
            }
          }
          Tiles<Fmt, kA8>::pick(mr, nr)(args);
        }
      }
    }
  }
}

using tiles_fn = void (*)(const LinearJob&, int64_t tile_begin, int64_t tile_end);

// The GGUF formats by ggml type id (GGMLQuantizationType): X(type id, format) for each.
#define SG_GGUF_FORMATS(X) \
  X(2, Q4_0Format) X(3, Q4_1Format) X(6, Q5_0Format) X(8, Q8_0Format) X(12, Q4_KFormat) X(13, Q5_KFormat) X(14, Q6_KFormat)

// Each format's tile runners, defined (and instantiated for every format) by their part.
template <typename Fmt>
tiles_fn exact_tiles();  // gemm.cpp: run_tiles<Fmt>
template <typename Fmt>
tiles_fn a8_tiles();  // a8.cpp: run_tiles<Fmt, true>

#if defined(SG_A8_ZMM) && defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512VBMI__)
#define SG_AMX 1  // amx.cpp: the a8 K-quant linears on AMX int8 tiles
template <typename Fmt>
std::array<tiles_fn, 3> amx_tiles_of();  // 4 / 8 / 16 activation rows per B tile; null for 32-weight formats
#endif

// gguf.cpp: the GGUF formats by ggml type id
struct BlockFormat {
  int block, bytes;
  tiles_fn run_tiles;
  void (*dequantize_row)(const uint8_t*, int64_t, float*);
  tiles_fn run_tiles_a8;  // int8 activations
  int a8_block;  // activation block of the a8 mode (32, or 256 for K-quants)
#ifdef SG_AMX
  std::array<tiles_fn, 3> run_tiles_amx;  // a8 on AMX, 4 / 8 / 16 rows per B tile (K-quants)
#endif
};
const BlockFormat* find_block_format(int ggml_type);  // null for a type the kernel does not know

#ifdef SG_AMX
// amx.cpp: whether an a8 linear of M rows of `ggml_type` runs on AMX tiles now, and running it
bool amx_applies(const BlockFormat& f, int ggml_type, int64_t M);
int run_amx_linear(LinearJob& job, const BlockFormat& f, int ggml_type, int num_threads);
#endif

// threads.cpp: a linear (tiles of NR output columns, row panels) or any job on the thread pool
int run_linear(LinearJob& job, int num_threads);
int run_job(LinearJob& job, int num_threads, int64_t work);

inline bool bad_shape(const void* x, int64_t M, int64_t K, const void* w, int64_t N, const float* y, int* status) {
  if (M < 0 || K <= 0 || N < 0) return *status = 1, true;
  if (M == 0 || N == 0) return *status = 0, true;  // nothing to do; empty tensors may have null data
  if (!x || !w || !y) return *status = 1, true;
  return false;
}

}  // namespace sg
#pragma GCC visibility pop
