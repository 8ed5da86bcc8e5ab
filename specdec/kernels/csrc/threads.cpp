// The thread pool every kernel call runs on (run_linear, run_job) and its spin setting.
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "skinny_gemm.h"

namespace sg {
namespace {

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

}  // namespace

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

}  // namespace sg

using namespace sg;

extern "C" {

// Microseconds pool workers spin-wait for the next call before sleeping (0 = sleep at once).
void sg_set_spin_us(int64_t spin_us) {
  g_spin_us.store(spin_us);
  std::lock_guard<std::mutex> lock(g_pool_mu);
  if (g_pool) g_pool->set_spin_us(spin_us);
}

}  // extern "C"
