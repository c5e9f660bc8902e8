// The forward's own worker pool: a parallel loop that never waits for a thread that has not
// started.
//
// Why not OpenMP (at::parallel_for): an OpenMP region ends at a barrier that every thread of
// the team must reach. On a 2-core device that another program also uses, the scheduler
// deschedules one of our threads for a whole time slice (milliseconds); every one of the
// ~100 regions of a decode step then waits at the barrier for it, and a 200-token/s decoder
// ran at 5 tokens/s beside one busy core. Here the caller publishes a job and works on it
// at once; a worker joins only if it wakes while the job is still open, and the caller waits
// only for workers that did join (whose items are in flight). A job's body must cover all of
// its work from any one participant (parallel_chunks' shares, which a finished thread takes
// from the others), so a late worker costs nothing but its help.
//
// Workers spin briefly for the next job (products follow each other within microseconds),
// then sleep on a condition variable: an idle server uses no CPU, and a worker the
// controller does not use (threads(n) below n) never competes for a core.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

namespace memspec {

namespace pool {

// Threads a parallel loop may use, the caller included. 0 (the default) follows PyTorch's
// count (at::get_num_threads); set_threads(n >= 1) fixes it until set_threads(0).
void set_threads(int n);
int threads();
// True inside a job's body: nested loops run serially.
bool in_job();
// Runs body(ctx, t) on the caller (t = 0) and on each of workers 1..nt-1 that wakes while the
// job is open; returns once the caller's body has returned and every joined worker is done.
void run(int64_t nt, void (*body)(const void*, int64_t), const void* ctx);
// MEMSPEC_POOL=openmp: parallel loops run as OpenMP regions (at::parallel_for), as before
// this pool: the before-and-after switch of `memspec bench contention`.
bool openmp();
void set_openmp(bool on);  // the same switch at run time (benchmarks interleave both)
// Tests: workers that wake for a job stop before joining it until hold(false), as a
// thread the scheduler has descheduled does; jobs must finish without them.
void hold(bool on);
// Native thread ids of the pool's workers (for the controller's per-thread CPU accounting).
std::vector<int64_t> worker_tids();
// Jobs run, and workers that joined one (how often help arrived in time).
std::vector<int64_t> counters();

}  // namespace pool

// Runs f(i0, i1) over [0, n). Each thread owns a contiguous share of the items, as a static
// split gives, and takes it `batch` items at a time in order (one weight stream per thread);
// a thread done with its share then takes what is left of the others'. The caller alone
// finishes everything when no worker comes (pool.h). Which thread computes an item never
// changes its bits.
template <typename F>
void parallel_chunks(int64_t n, int64_t batch, const F& f) {
  const int64_t nt = std::min<int64_t>(pool::threads(), (n + batch - 1) / batch);
  if (nt <= 1 || pool::in_job() || at::in_parallel_region()) {
    if (n > 0) f(0, n);
    return;
  }
  struct alignas(64) Share {
    std::atomic<int64_t> next;
    int64_t end;
  };
  std::vector<Share> shares(nt);
  for (int64_t t = 0; t < nt; ++t) {
    shares[t].next.store(n * t / nt, std::memory_order_relaxed);
    shares[t].end = n * (t + 1) / nt;
  }
  struct Ctx {
    std::vector<Share>* shares;
    int64_t nt, batch;
    const F* f;
  } ctx{&shares, nt, batch, &f};
  auto body = [](const void* p, int64_t t0) {
    const Ctx& c = *static_cast<const Ctx*>(p);
    for (int64_t k = 0; k < c.nt; ++k) {
      Share& s = (*c.shares)[(t0 + k) % c.nt];
      for (int64_t i; (i = s.next.fetch_add(c.batch, std::memory_order_relaxed)) < s.end;)
        (*c.f)(i, std::min(s.end, i + c.batch));
    }
  };
  if (pool::openmp())
    at::parallel_for(0, nt, 1, [&](int64_t t0, int64_t) { body(&ctx, t0); });
  else
    pool::run(nt, body, &ctx);
}

}  // namespace memspec
