// See pool.h.
#include "pool.h"

#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define MEMSPEC_PAUSE() _mm_pause()
#elif defined(__aarch64__)
#define MEMSPEC_PAUSE() asm volatile("yield" ::: "memory")
#else
#define MEMSPEC_PAUSE() ((void)0)
#endif

namespace memspec {
namespace pool {
namespace {

// How long a worker spins for the next job before it sleeps. Within a forward the next
// product follows in microseconds; between decode steps Python runs for ~0.1-0.3 ms.
// MEMSPEC_POOL_SPIN_US overrides it (0: sleep at once).
int64_t spin_ns() {
  static const int64_t ns = [] {
    const char* v = std::getenv("MEMSPEC_POOL_SPIN_US");
    const long us = v && *v ? std::strtol(v, nullptr, 10) : 300;
    return static_cast<int64_t>(us < 0 ? 0 : us) * 1000;
  }();
  return ns;
}

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

thread_local bool tls_in_job = false;

struct alignas(64) Slot {
  std::atomic<bool> asleep{false};
  std::mutex mu;
  std::condition_variable cv;
};

struct Pool {
  std::atomic<int> fixed{0};
  std::atomic<bool> held{false};  // tests: workers wait here, as if descheduled
  // (job number << 1) | open. A worker joins job s only while state == s.
  alignas(64) std::atomic<uint64_t> state{0};
  alignas(64) std::atomic<int> inside{0};  // workers that joined the current job
  // the current job; written by the caller before it opens the job
  void (*body)(const void*, int64_t) = nullptr;
  const void* ctx = nullptr;
  std::atomic<int64_t> nt{0};
  std::exception_ptr error;  // a worker's, rethrown by the caller
  std::mutex error_mu;
  std::mutex submit;         // one job at a time; a concurrent caller runs its loop alone
  std::mutex grow;           // guards slots / tids
  std::vector<std::unique_ptr<Slot>> slots;  // [0] unused: the caller
  std::vector<int64_t> tids;
  std::atomic<int> workers{0};
  std::atomic<int64_t> jobs{0}, joins{0};
};

Pool* g = new Pool();  // never freed: detached workers may wait on it at exit

void after_fork_in_child() {
  // the child has none of the parent's workers; a fresh pool starts them again on demand
  Pool* fresh = new Pool();
  fresh->fixed.store(g->fixed.load());
  g = fresh;
  tls_in_job = false;
}

const bool registered = [] {
  pthread_atfork(nullptr, nullptr, after_fork_in_child);
  return true;
}();

bool wanted(const Pool& p, int64_t w, uint64_t s, uint64_t seen) {
  return s != seen && (s & 1) && w < p.nt.load(std::memory_order_acquire);
}

void worker(Pool* p, int64_t w) {
  Slot* mine;
  {
    std::lock_guard<std::mutex> l(p->grow);
    p->tids[w] = static_cast<int64_t>(syscall(SYS_gettid));
    mine = p->slots[w].get();
  }
  Slot& slot = *mine;
  uint64_t seen = p->state.load(std::memory_order_acquire);
  for (;;) {
    uint64_t s = p->state.load(std::memory_order_acquire);
    if (!wanted(*p, w, s, seen)) {
      seen = s;
      // spin a while for the next job, then sleep until one wants this worker
      const int64_t deadline = now_ns() + spin_ns();
      bool got = false;
      for (int i = 1; !got; ++i) {
        s = p->state.load(std::memory_order_acquire);
        if (s != seen) {
          got = wanted(*p, w, s, seen);
          if (!got) seen = s;
          continue;
        }
        MEMSPEC_PAUSE();
        if ((i & 63) == 0 && now_ns() > deadline) break;
      }
      if (!got) {
        std::unique_lock<std::mutex> lk(slot.mu);
        slot.asleep.store(true, std::memory_order_seq_cst);
        while (!wanted(*p, w, s = p->state.load(std::memory_order_seq_cst), seen)) {
          seen = s;
          slot.cv.wait(lk);
        }
        slot.asleep.store(false, std::memory_order_relaxed);
      }
    }
    seen = s;
    while (p->held.load(std::memory_order_relaxed))
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    p->inside.fetch_add(1, std::memory_order_seq_cst);
    if (p->state.load(std::memory_order_seq_cst) == s) {  // still open: the job's fields hold
      tls_in_job = true;
      try {
        p->body(p->ctx, w);
      } catch (...) {
        std::lock_guard<std::mutex> l(p->error_mu);
        if (!p->error) p->error = std::current_exception();
      }
      tls_in_job = false;
      p->joins.fetch_add(1, std::memory_order_relaxed);
    }
    p->inside.fetch_sub(1, std::memory_order_release);
  }
}

void ensure_workers(Pool* p, int64_t n) {
  if (p->workers.load(std::memory_order_acquire) >= n) return;
  std::lock_guard<std::mutex> l(p->grow);
  int64_t have = p->workers.load();
  if (p->slots.empty()) {
    p->slots.emplace_back(new Slot());
    p->tids.push_back(0);
  }
  // slots never move once made: reserve for every core the machine could give
  p->slots.reserve(std::max<int64_t>(n + 1, std::thread::hardware_concurrency() + 1));
  for (; have < n; ++have) {
    const int64_t w = have + 1;
    p->slots.emplace_back(new Slot());
    p->tids.push_back(0);
    std::thread(worker, p, w).detach();
  }
  p->workers.store(static_cast<int>(have), std::memory_order_release);
}

}  // namespace

void set_threads(int n) { g->fixed.store(n < 0 ? 0 : n); }

int threads() {
  const int n = g->fixed.load(std::memory_order_relaxed);
  return n > 0 ? n : at::get_num_threads();
}

bool in_job() { return tls_in_job; }

void hold(bool on) { g->held.store(on); }

std::atomic<int> g_openmp{-1};  // -1: not read from the environment yet

bool openmp() {
  int on = g_openmp.load(std::memory_order_relaxed);
  if (on < 0) {
    const char* v = std::getenv("MEMSPEC_POOL");
    on = v && std::string(v) == "openmp";
    g_openmp.store(on, std::memory_order_relaxed);
  }
  return on != 0;
}

void set_openmp(bool on) { g_openmp.store(on ? 1 : 0); }

void run(int64_t nt, void (*body)(const void*, int64_t), const void* ctx) {
  Pool* p = g;
  std::unique_lock<std::mutex> own(p->submit, std::try_to_lock);
  if (!own.owns_lock() || nt <= 1) {  // another thread's job is running: this one alone
    body(ctx, 0);
    return;
  }
  ensure_workers(p, nt - 1);
  p->body = body;
  p->ctx = ctx;
  p->nt.store(nt, std::memory_order_release);
  const uint64_t open = ((p->state.load(std::memory_order_relaxed) >> 1) + 1) << 1 | 1;
  p->state.store(open, std::memory_order_seq_cst);
  p->jobs.fetch_add(1, std::memory_order_relaxed);
  for (int64_t w = 1; w < nt; ++w) {
    Slot& slot = *p->slots[w];
    if (slot.asleep.load(std::memory_order_seq_cst)) {
      { std::lock_guard<std::mutex> l(slot.mu); }
      slot.cv.notify_one();
    }
  }
  std::exception_ptr mine;
  tls_in_job = true;
  try {
    body(ctx, 0);
  } catch (...) {
    mine = std::current_exception();
  }
  tls_in_job = false;
  p->state.store(open & ~uint64_t{1}, std::memory_order_seq_cst);  // no one joins from now
  // a joined worker finishes its last item (microseconds); one descheduled in the middle of
  // it holds us for its time off the CPU, so after a short spin this core is offered to
  // whatever else may run here (that worker included, should the kernel move it)
  for (int i = 1; p->inside.load(std::memory_order_seq_cst) != 0; ++i) {
    if (i < 4096)
      MEMSPEC_PAUSE();
    else
      std::this_thread::yield();
  }
  std::exception_ptr theirs;
  {
    std::lock_guard<std::mutex> l(p->error_mu);
    std::swap(theirs, p->error);
  }
  if (mine) std::rethrow_exception(mine);
  if (theirs) std::rethrow_exception(theirs);
}

std::vector<int64_t> worker_tids() {
  std::lock_guard<std::mutex> l(g->grow);
  if (g->tids.size() <= 1) return {};
  return std::vector<int64_t>(g->tids.begin() + 1, g->tids.end());
}

std::vector<int64_t> counters() {
  return {g->jobs.load(), g->joins.load(), g->workers.load()};
}

}  // namespace pool
}  // namespace memspec
