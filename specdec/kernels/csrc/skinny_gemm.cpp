// Batch-invariant skinny GEMM for CPU: y[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]), fp32
// activations, fp32 or int8 (weight-only, per-row scale) weights.
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
//     y[i, j] = horizontal_sum(acc) (fixed tree)  [+ bias[j]]
// The M/N tiling below only decides which of these independent sequences run interleaved;
// the K loop is never split. So row i of an M-row call is bitwise equal to that row alone.
//
// The weight is used in its native nn.Linear layout [N, K] (no packed copy: tied embeddings
// and checkpoint memory stay as they are). Plain C ABI (called through ctypes) so the build is
// one g++ invocation of a few seconds, with no torch headers.

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>
#include <unistd.h>

namespace {

#if defined(__AVX512F__)
constexpr int V = 16;  // fp32 lanes per vector
using vec = __m512;
using tail_mask = __mmask16;
inline vec vzero() { return _mm512_setzero_ps(); }
inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
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

inline float hsum256(__m256 v) {
  // fixed tree: 8 -> 4 -> 2 -> 1
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

constexpr int kMaxRowsPerTile = 4;  // MR: rows of x per micro-tile
constexpr int kColsPerTile = 4;     // NR: rows of w (output columns) per micro-tile

// Weight loads: fp32 as is; int8 (weight-only quantisation) widened to fp32 in registers, so
// x rows stay fp32 and the accumulation is the same as for fp32 weights.
inline vec load_w(const float* p) { return vload(p); }
inline vec load_w_tail(const float* p, int64_t, tail_mask m) { return vload_tail(p, m); }
#if defined(__AVX512F__)
inline vec load_w(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
}
#else
inline vec load_w(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}
#endif
inline vec load_w_tail(const int8_t* p, int64_t remaining, tail_mask) {
  alignas(16) int8_t padded[16] = {0};  // zero lanes past K, like the fp32 masked load
  std::memcpy(padded, p, (size_t)remaining);
  return load_w(padded);
}

// One MR x NR block of outputs, each a full-K dot product with its own accumulator:
// y = hsum(acc) [* scale[j] for int8] [+ bias[j]].
template <typename WT, int MR, int NR>
void micro_tile(const float* x, int64_t ldx, const WT* w, int64_t ldw, int64_t K, const float* scale,
                const float* bias, float* y, int64_t ldy) {
  vec acc[MR][NR];
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < NR; ++c) acc[r][c] = vzero();
  const int64_t k_full = K - K % V;
  for (int64_t kk = 0; kk < k_full; kk += V) {
    vec wv[NR];
#pragma GCC unroll 4
    for (int c = 0; c < NR; ++c) wv[c] = load_w(w + c * ldw + kk);
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) {
      const vec xv = vload(x + r * ldx + kk);
#pragma GCC unroll 4
      for (int c = 0; c < NR; ++c) acc[r][c] = vfma(xv, wv[c], acc[r][c]);
    }
  }
  if (K % V) {
    const tail_mask m = make_tail_mask(K % V);
    vec wv[NR];
#pragma GCC unroll 4
    for (int c = 0; c < NR; ++c) wv[c] = load_w_tail(w + c * ldw + k_full, K % V, m);
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) {
      const vec xv = vload_tail(x + r * ldx + k_full, m);
#pragma GCC unroll 4
      for (int c = 0; c < NR; ++c) acc[r][c] = vfma(xv, wv[c], acc[r][c]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < NR; ++c) {
      float value = vhsum(acc[r][c]);
      if (scale) value *= scale[c];
      if (bias) value += bias[c];
      y[r * ldy + c] = value;
    }
}

template <typename WT>
using tile_fn = void (*)(const float*, int64_t, const WT*, int64_t, int64_t, const float*, const float*, float*,
                         int64_t);

template <typename WT, int MR>
constexpr tile_fn<WT> pick_cols(int nr) {
  return nr == 1   ? micro_tile<WT, MR, 1>
         : nr == 2 ? micro_tile<WT, MR, 2>
         : nr == 3 ? micro_tile<WT, MR, 3>
                   : micro_tile<WT, MR, 4>;
}

template <typename WT>
tile_fn<WT> pick_tile(int mr, int nr) {
  switch (mr) {
    case 1: return pick_cols<WT, 1>(nr);
    case 2: return pick_cols<WT, 2>(nr);
    case 3: return pick_cols<WT, 3>(nr);
    default: return pick_cols<WT, 4>(nr);
  }
}

struct LinearJob {
  const float* x;
  int64_t M, K;
  const void* w;         // [N, K] fp32 or int8
  const float* scale;    // [N] per-row dequantisation scale (int8) or null
  int64_t N;
  const float* bias;
  float* y;
  int64_t rows_per_panel;  // x rows kept hot in L2 while a w tile is reused across them
  int64_t num_tiles;       // ceil(N / NR)
  void (*run_tiles)(const LinearJob&, int64_t, int64_t);
};

// Output columns [tile_begin, tile_end) * NR for every row: w is streamed once per row panel.
template <typename WT>
void run_tiles(const LinearJob& job, int64_t tile_begin, int64_t tile_end) {
  for (int64_t p0 = 0; p0 < job.M; p0 += job.rows_per_panel) {
    const int64_t panel_rows = std::min(job.rows_per_panel, job.M - p0);
    for (int64_t t = tile_begin; t < tile_end; ++t) {
      const int64_t j0 = t * kColsPerTile;
      const int nr = (int)std::min<int64_t>(kColsPerTile, job.N - j0);
      const WT* w = static_cast<const WT*>(job.w) + j0 * job.K;
      const float* scale = job.scale ? job.scale + j0 : nullptr;
      const float* bias = job.bias ? job.bias + j0 : nullptr;
      for (int64_t r0 = 0; r0 < panel_rows; r0 += kMaxRowsPerTile) {
        const int mr = (int)std::min<int64_t>(kMaxRowsPerTile, panel_rows - r0);
        const int64_t row = p0 + r0;
        pick_tile<WT>(mr, nr)(job.x + row * job.K, job.K, w, job.K, job.K, scale, bias, job.y + row * job.N + j0,
                              job.N);
      }
    }
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

// Splits `job` over the thread pool (or runs it inline when small / the pool is busy).
int run_linear(LinearJob& job, int num_threads) {
  // Keep a panel of x rows within ~512 KiB of L2 so each w tile is reused from cache across it;
  // beyond that (long prefills) w is streamed once per panel. Multiple of MR, at least 16 rows.
  const int64_t panel = (512 * 1024 / 4) / job.K;
  job.rows_per_panel = std::max<int64_t>(16, panel - panel % kMaxRowsPerTile);
  job.num_tiles = (job.N + kColsPerTile - 1) / kColsPerTile;

  // Few tiles: splitting costs more than it saves.
  int threads = std::max(1, num_threads);
  if (job.M * job.N * job.K < (int64_t)1 << 18) threads = 1;
  threads = (int)std::min<int64_t>(threads, job.num_tiles);
  if (threads == 1) {
    job.run_tiles(job, 0, job.num_tiles);
    return 0;
  }
  std::unique_lock<std::mutex> lock(g_pool_mu, std::try_to_lock);
  if (!lock.owns_lock()) {  // another thread is using the pool: same result, single-threaded
    job.run_tiles(job, 0, job.num_tiles);
    return 0;
  }
  if (g_pool && g_pool->pid() != getpid()) g_pool.release();  // forked child: the workers are gone
  if (!g_pool || g_pool->size() != threads) {  // every pool thread takes chunks: match the count asked for
    g_pool.reset();
    g_pool = std::make_unique<Pool>(threads - 1);
    g_pool->set_spin_us(g_spin_us.load());
  }
  // ~8 chunks per thread: fine enough to rebalance around a preempted thread, coarse enough
  // that each chunk streams a long contiguous run of w.
  g_pool->run(job, std::min<int64_t>(job.num_tiles, 8 * (int64_t)threads));
  return 0;
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
  LinearJob job{x, M, K, w, nullptr, N, bias, y, 0, 0, run_tiles<float>};
  return run_linear(job, num_threads);
}

// Weight-only int8: y = (x @ q^T) * scale (+ bias). q [N, K] int8, scale [N] fp32; else as above.
int sg_linear_i8(const float* x, int64_t M, int64_t K, const int8_t* q, int64_t N, const float* scale,
                 const float* bias, float* y, int num_threads) {
  int status;
  if (bad_shape(x, M, K, q, N, y, &status)) return status;
  if (!scale) return 1;
  LinearJob job{x, M, K, q, scale, N, bias, y, 0, 0, run_tiles<int8_t>};
  return run_linear(job, num_threads);
}

}  // extern "C"
