// A layer's GGUF linears in fewer calls: q / k / v on one input (sg_linear3), the MLP's
// silu(gate(x)) * up(x) (sg_gate_up_silu), and a whole Llama block of few rows (sg_layer). Each
// linear runs the entry point it would run alone and the glue is the same functions, so the outputs
// are bitwise those of separate calls; what is saved is the calls' overhead (docs/performance.md,
// "Between the linears").
#include "skinny_gemm.h"

extern "C" {
int sg_linear_gguf(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, int ggml_type,
                   const float* bias, float* y, int num_threads);
int sg_linear_gguf_a8(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, int ggml_type,
                      const float* bias, float* y, int num_threads);
int sg_linear_interleaved_a8(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, int ggml_type,
                             const float* bias, float* y, int num_threads);
int sg_rms_norm(const float* x, const float* delta, const float* weight, int64_t M, int64_t H, float eps, float* sum,
                float* normed);
int sg_attention_step(const float* q, const float* k, const float* v, const float* cos, const float* sin,
                      float* cache_k, float* cache_v, int64_t kv_stride_b, int64_t kv_stride_h, const int64_t* starts,
                      const uint8_t* mask, int64_t B, int64_t H, int64_t Hkv, int64_t T, int64_t S, int64_t D,
                      float scale, float* out, int num_threads);
}

namespace sg {
namespace {

// Which entry point runs a GGUF linear (GGUFLinear.route in Python picks it by the row count).
enum Route { kExact = 0, kA8 = 1, kInterleavedA8 = 2 };

int run_route(int route, const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, int ggml_type,
              const float* bias, float* y, int num_threads) {
  switch (route) {
    case kExact: return sg_linear_gguf(x, M, K, w, N, ggml_type, bias, y, num_threads);
    case kA8: return sg_linear_gguf_a8(x, M, K, w, N, ggml_type, bias, y, num_threads);
    case kInterleavedA8: return sg_linear_interleaved_a8(x, M, K, w, N, ggml_type, bias, y, num_threads);
    default: return 1;
  }
}

// exp on 8 lanes by one fixed sequence of IEEE operations (no FMA), 256-bit in every build, so the
// same bits on AVX2 and AVX-512: x clamped to [-87.3, 88.3], n = round(x log2 e), r = x - n ln2
// (ln2 in two parts), exp(r) = 1 + r + r^2 p(r) with Cephes' degree-5 p, times 2^n.
inline __m256 exp256(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f)));
  r = _mm256_sub_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(-2.12194440e-4f)));
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(5.0000001201e-1f));
  const __m256 e = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(p, _mm256_mul_ps(r, r)), r), _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(e, _mm256_castsi256_ps(bits));
}

// out[i] = gate[i] / (1 + exp(-gate[i])) * up[i] (silu(gate) * up; out may be gate), 8 lanes at a
// time; the tail through the same vector code on a zero-padded copy, so every element has the same bits.
void silu_mul(const float* gate, const float* up, float* out, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
  auto step = [&](__m256 g, __m256 u) {
    return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, exp256(_mm256_xor_ps(g, sign)))), u);
  };
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, step(_mm256_loadu_ps(gate + i), _mm256_loadu_ps(up + i)));
  if (i < n) {
    float g[8] = {}, u[8] = {}, y[8];
    std::memcpy(g, gate + i, (size_t)(n - i) * sizeof(float));
    std::memcpy(u, up + i, (size_t)(n - i) * sizeof(float));
    _mm256_storeu_ps(y, step(_mm256_loadu_ps(g), _mm256_loadu_ps(u)));
    std::memcpy(out + i, y, (size_t)(n - i) * sizeof(float));
  }
}

}  // namespace

// One GGUF linear of a layer as sg_layer takes it (route as in sg_linear3).
struct LayerLinear {
  int32_t route;
  int32_t ggml_type;
  const uint8_t* w;
  int64_t N;
  const float* bias;  // [N] or null
};

// A Llama block over B x T rows (library.py's LayerArgs mirrors this layout).
struct LayerArgs {
  int64_t B, T, H, heads, kv_heads, D, I;  // rows; hidden, query / KV heads, head dim, MLP width
  float eps, scale;                        // the norms' epsilon, attention's 1 / sqrt(D)
  int32_t threads, unused;
  const float* x;                          // [B, T, H] the residual stream in
  float* out;                              // [B, T, H] the residual stream out
  const float* norm1;                      // [H] input_layernorm
  const float* norm2;                      // [H] post_attention_layernorm
  LayerLinear q, k, v, o, gate, up, down;
  const float* cos;                        // [B, T, D]
  const float* sin;
  float* cache_k;                          // [B, Hkv, capacity, D], strides below (floats)
  float* cache_v;
  int64_t kv_stride_b, kv_stride_h;
  const int64_t* starts;                   // [B] each row's first new slot
  int64_t span;                            // slots attention reads
  const uint8_t* mask;                     // [B, T, span] or null
};

}  // namespace sg

using namespace sg;

extern "C" {

// Three linears of one input x [M, K]: y_i = x @ W_i^T (+ bias_i), W_i [N_i, ...] GGUF blocks (or their
// interleaved copy) of type_i run by `route_i` (0 sg_linear_gguf, 1 sg_linear_gguf_a8, 2
// sg_linear_interleaved_a8). Returns 0, or the first failing linear's status.
int sg_linear3(const float* x, int64_t M, int64_t K,
               int route0, const uint8_t* w0, int64_t N0, int type0, const float* bias0, float* y0,
               int route1, const uint8_t* w1, int64_t N1, int type1, const float* bias1, float* y1,
               int route2, const uint8_t* w2, int64_t N2, int type2, const float* bias2, float* y2, int num_threads) {
  int status = run_route(route0, x, M, K, w0, N0, type0, bias0, y0, num_threads);
  if (!status) status = run_route(route1, x, M, K, w1, N1, type1, bias1, y1, num_threads);
  if (!status) status = run_route(route2, x, M, K, w2, N2, type2, bias2, y2, num_threads);
  return status;
}

// The MLP's silu(x @ Wg^T + bg) * (x @ Wu^T + bu) -> y [M, N] (routes as sg_linear3; biases may be
// null); `scratch` [M, N] holds the up projection. Returns 0, or the failing linear's status.
int sg_gate_up_silu(const float* x, int64_t M, int64_t K,
                    int route_gate, const uint8_t* w_gate, int type_gate, const float* bias_gate,
                    int route_up, const uint8_t* w_up, int type_up, const float* bias_up,
                    int64_t N, float* y, float* scratch, int num_threads) {
  int status = run_route(route_gate, x, M, K, w_gate, N, type_gate, bias_gate, y, num_threads);
  if (!status) status = run_route(route_up, x, M, K, w_up, N, type_up, bias_up, scratch, num_threads);
  if (!status && M > 0) silu_mul(y, scratch, y, M * N);
  return status;
}

// out[i] = silu(gate[i]) * up[i] for n elements (the SiLU of sg_gate_up_silu and sg_layer, for
// projections the kernel did not run as GGUF linears). Returns 0, or 1 on bad arguments.
int sg_silu_mul(const float* gate, const float* up, float* out, int64_t n) {
  if (n < 0 || (n > 0 && (!gate || !up || !out))) return 1;
  silu_mul(gate, up, out, n);
  return 0;
}

// A whole Llama block of B x T rows in one call: out = h + down(silu(gate(n2)) * up(n2)) with
// h = x + o(attention_step(q(n1), k(n1), v(n1))), n1 = rms_norm(x), n2 = rms_norm(h), each part by the
// function that runs it alone (sg_rms_norm, the routed linears, sg_attention_step, sg_gate_up_silu's
// silu_mul, a float add), so the bits of the op-by-op block. Scratch is per thread and grows to the
// largest call (the caller keeps this to few rows). Returns 0, or the first failing part's status.
int sg_layer(const LayerArgs* a) {
  const int64_t M = a->B * a->T, H = a->H, q_width = a->heads * a->D, kv_width = a->kv_heads * a->D;
  if (M <= 0 || H <= 0 || a->I <= 0 || !a->x || !a->out) return M == 0 ? 0 : 1;
  // each buffer on a 64-byte boundary, as torch's allocations are: the exact mode's tiles load x rows
  // straight from them (a row split across cache lines costs ~10 % at 8 rows)
  auto padded = [](int64_t floats) { return (floats + 15) / 16 * 16; };
  const int64_t sizes[8] = {M * H, M * q_width, M * kv_width, M * kv_width, M * q_width, M * H, M * a->I, M * a->I};
  int64_t total = 16;
  for (int64_t size : sizes) total += padded(size);
  thread_local std::vector<float> scratch;
  if ((int64_t)scratch.size() < total) scratch.resize((size_t)total);
  float* buffers[8];
  float* next = scratch.data() + (-(int64_t)((uintptr_t)scratch.data() / sizeof(float)) & 15);
  for (int i = 0; i < 8; ++i) buffers[i] = next, next += padded(sizes[i]);
  float *normed = buffers[0], *q = buffers[1], *k = buffers[2], *v = buffers[3];  // [M, H], [M, heads D], [M, Hkv D] x 2
  float *attended = buffers[4], *projected = buffers[5];  // [M, heads D]; [M, H]: o, then down
  float *gate = buffers[6], *up = buffers[7];             // [M, I] each
  auto linear = [&](const LayerLinear& l, const float* in, int64_t K, float* y) {
    return run_route(l.route, in, M, K, l.w, l.N, l.ggml_type, l.bias, y, a->threads);
  };
  int status = sg_rms_norm(a->x, nullptr, a->norm1, M, H, a->eps, nullptr, normed);
  if (!status) status = linear(a->q, normed, H, q);
  if (!status) status = linear(a->k, normed, H, k);
  if (!status) status = linear(a->v, normed, H, v);
  if (!status)
    status = sg_attention_step(q, k, v, a->cos, a->sin, a->cache_k, a->cache_v, a->kv_stride_b, a->kv_stride_h,
                               a->starts, a->mask, a->B, a->heads, a->kv_heads, a->T, a->span, a->D, a->scale,
                               attended, a->threads);
  if (!status) status = linear(a->o, attended, q_width, projected);
  if (!status) status = sg_rms_norm(a->x, projected, a->norm2, M, H, a->eps, a->out, normed);  // out = x + o
  if (!status) status = linear(a->gate, normed, H, gate);
  if (!status) status = linear(a->up, normed, H, up);
  if (!status) {
    silu_mul(gate, up, gate, M * a->I);
    status = linear(a->down, gate, a->I, projected);
  }
  if (!status) {
    float* residual = a->out;
    int64_t i = 0;
    for (; i + 8 <= M * H; i += 8)
      _mm256_storeu_ps(residual + i, _mm256_add_ps(_mm256_loadu_ps(residual + i), _mm256_loadu_ps(projected + i)));
    for (; i < M * H; ++i) residual[i] += projected[i];
  }
  return status;
}

}  // extern "C"
