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
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>
#include <unistd.h>

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

// What one micro-tile call works on: MR rows of x times NR rows of w, over K range [k_begin, k_end).
template <typename WT>
struct TileArgs {
  const float* x;       // first x row of the block (row stride ldx)
  int64_t ldx;
  const WT* w;          // first w row of the tile (row stride ldw)
  int64_t ldw;
  int64_t K, k_begin, k_end;  // k_end == K: finish (tail chunk, horizontal sums, epilogue)
  float* saved;         // MR * NR partial accumulators (V floats each) carried between K ranges
  const float* scale;   // per-output dequantisation scale (int8) or null
  const float* bias;    // or null
  float* y;
  int64_t ldy;
  const WT* prefetch;   // see below, or null
  int64_t pf_phase, pf_stride;
};

// One MR x NR block of outputs, each a full-K dot product with its own accumulator:
// y = hsum(acc) [* scale[j] for int8] [+ bias[j]]. Splitting K into ranges only parks the
// accumulators in memory in between (exact), so the arithmetic is the same as in one call.
// `prefetch`: the same rows of a tile further down the stream, pulled into L2 while this tile is
// computed. On cold weights this keeps more DRAM requests in flight than the hardware
// prefetcher alone (measured: 1-row calls ~1.3-1.7x faster). With several row blocks, block
// `pf_phase` of `pf_stride` fetches every pf_stride-th cache line, so the fetches spread over
// all blocks and overlap their compute.
template <typename WT, int MR, int NR>
void micro_tile(const TileArgs<WT>& a) {
  vec acc[MR][NR];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < NR; ++c) acc[r][c] = a.k_begin == 0 ? vzero() : vload(a.saved + (r * NR + c) * V);
  const int64_t k_full = a.K - a.K % V;
  const int64_t loop_end = std::min(a.k_end, k_full);
  constexpr int64_t kLine = 64 / sizeof(WT);  // elements per cache line
  int64_t next_prefetch = a.K;                // element offset of the next line to prefetch
  if (a.prefetch) {
    const int64_t line = a.k_begin / kLine;
    next_prefetch = (line + ((a.pf_phase - line % a.pf_stride) % a.pf_stride + a.pf_stride) % a.pf_stride) * kLine;
  }
  for (int64_t kk = a.k_begin; kk < loop_end; kk += V) {
    if (kk == next_prefetch) {
#pragma GCC unroll 8
      for (int c = 0; c < NR; ++c) _mm_prefetch((const char*)(a.prefetch + c * a.ldw + kk), _MM_HINT_T1);
      next_prefetch += a.pf_stride * kLine;
    }
    vec wv[NR];
#pragma GCC unroll 8
    for (int c = 0; c < NR; ++c) wv[c] = load_w(a.w + c * a.ldw + kk);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const vec xv = vload(a.x + r * a.ldx + kk);
#pragma GCC unroll 8
      for (int c = 0; c < NR; ++c) acc[r][c] = vfma(xv, wv[c], acc[r][c]);
    }
  }
  if (a.k_end < a.K) {
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
      for (int c = 0; c < NR; ++c) vstore(a.saved + (r * NR + c) * V, acc[r][c]);
    return;
  }
  if (a.K % V) {
    const tail_mask m = make_tail_mask(a.K % V);
    vec wv[NR];
#pragma GCC unroll 8
    for (int c = 0; c < NR; ++c) wv[c] = load_w_tail(a.w + c * a.ldw + k_full, a.K % V, m);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const vec xv = vload_tail(a.x + r * a.ldx + k_full, m);
#pragma GCC unroll 8
      for (int c = 0; c < NR; ++c) acc[r][c] = vfma(xv, wv[c], acc[r][c]);
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

template <typename WT>
using tile_fn = void (*)(const TileArgs<WT>&);

// Every (rows, cols) block size from 1x1 up to MR x NR, for the edges of M and N.
template <typename WT, std::size_t... I>
constexpr std::array<tile_fn<WT>, sizeof...(I)> make_tile_table(std::index_sequence<I...>) {
  return {micro_tile<WT, (int)(I / kColsPerTile) + 1, (int)(I % kColsPerTile) + 1>...};
}
template <typename WT>
constexpr auto kTileTable = make_tile_table<WT>(std::make_index_sequence<kMaxRowsPerTile * kColsPerTile>{});

template <typename WT>
inline tile_fn<WT> pick_tile(int mr, int nr) {
  return kTileTable<WT>[(mr - 1) * kColsPerTile + (nr - 1)];
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
// With several row blocks, K is walked in kKChunk pieces with all row blocks advancing together,
// so the weight stream and the arithmetic of every block overlap (one block after another
// would leave memory idle while the later blocks compute).
template <typename WT>
void run_tiles(const LinearJob& job, int64_t tile_begin, int64_t tile_end) {
  const int64_t max_blocks = (std::min(job.rows_per_panel, job.M) + kMaxRowsPerTile - 1) / kMaxRowsPerTile;
  std::vector<float> saved((size_t)(max_blocks * kMaxRowsPerTile * kColsPerTile * V));
  for (int64_t p0 = 0; p0 < job.M; p0 += job.rows_per_panel) {
    const int64_t panel_rows = std::min(job.rows_per_panel, job.M - p0);
    const int64_t row_blocks = (panel_rows + kMaxRowsPerTile - 1) / kMaxRowsPerTile;
    const int64_t k_chunk = row_blocks > 1 ? kKChunk : job.K;
    for (int64_t t = tile_begin; t < tile_end; ++t) {
      const int64_t j0 = t * kColsPerTile;
      const int nr = (int)std::min<int64_t>(kColsPerTile, job.N - j0);
      TileArgs<WT> args;
      args.w = static_cast<const WT*>(job.w) + j0 * job.K;
      args.ldx = args.ldw = args.K = job.K;
      args.scale = job.scale ? job.scale + j0 : nullptr;
      args.bias = job.bias ? job.bias + j0 : nullptr;
      args.ldy = job.N;
      // prefetch the tile kPrefetchTiles ahead (within this thread's range) while computing this one
      args.prefetch = t + kPrefetchTiles < tile_end ? args.w + kPrefetchTiles * kColsPerTile * job.K : nullptr;
      args.pf_stride = row_blocks;
      for (int64_t k0 = 0; k0 < job.K; k0 += k_chunk) {
        args.k_begin = k0;
        args.k_end = std::min(job.K, k0 + k_chunk);
        for (int64_t block = 0; block < row_blocks; ++block) {
          const int64_t row = p0 + block * kMaxRowsPerTile;
          const int mr = (int)std::min<int64_t>(kMaxRowsPerTile, p0 + panel_rows - row);
          args.x = job.x + row * job.K;
          args.y = job.y + row * job.N + j0;
          args.saved = saved.data() + block * kMaxRowsPerTile * kColsPerTile * V;
          args.pf_phase = block;
          pick_tile<WT>(mr, nr)(args);
        }
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

  // Little work: splitting costs more than it saves.
  const int threads = std::max(1, num_threads);
  if (threads == 1 || job.num_tiles == 1 || job.M * job.N * job.K < (int64_t)1 << 18) {
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
