// PyTorch glue for the block kernels of qkernels.h: packed weights held as tensors, rows
// quantised per call, output tiles split across threads. See qkernels.h for the formats,
// the kernel paths and why every path gives the same bits.
#pragma once

#include <ATen/ATen.h>  // not torch/extension.h: this unit needs no Python (builds 3x faster)
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <vector>

#include "qkernels.h"

namespace memspec {

// Runs f(i0, i1) over [0, n). Each thread owns a contiguous share of the items, as a static
// split gives, and takes it `batch` items at a time in order (one weight stream per thread);
// a thread done with its share then takes what is left of the others'. On a 2-core device
// the loader and predictor take a core now and then (a load's read and hash bursts beside a
// prefill); with a static split the thread that lost its core holds the other at the
// barrier for the whole burst. Which thread computes an item never changes its bits.
template <typename F>
void parallel_chunks(int64_t n, int64_t batch, const F& f) {
  const int64_t nt = std::min<int64_t>(at::get_num_threads(), (n + batch - 1) / batch);
  if (nt <= 1 || at::in_parallel_region()) {
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
  at::parallel_for(0, nt, 1, [&](int64_t t0, int64_t) {
    for (int64_t k = 0; k < nt; ++k) {
      Share& s = shares[(t0 + k) % nt];
      for (int64_t i; (i = s.next.fetch_add(batch, std::memory_order_relaxed)) < s.end;)
        f(i, std::min(s.end, i + batch));
    }
  });
}

using k::QGROUP;
using k::QMAXROWS;
using k::QTILE;

struct PackedQ4 {
  at::Tensor nib;   // uint8 [N/16, K/8, 64]
  at::Tensor d, m;  // fp16 [N/16, K/32, 16]
  int64_t N = 0, K = 0;
  k::Q4 view() const;
};

struct PackedQ8 {
  at::Tensor w;  // int8 [N/16, K/4, 64]
  at::Tensor d;  // fp16 [N/16, K/32, 16]
  at::Tensor c;  // fp32 [N/16, K/32, 16]
  at::Tensor s;  // int32 [N/16, K/32, 16]
  int64_t N = 0, K = 0;
  k::Q8 view() const;
};

// q: [N, K] integer codes; d, m: [N, K/32] scales (any float dtype holding fp16 values)
PackedQ4 pack_q4(const at::Tensor& q, const at::Tensor& d, const at::Tensor& m);
PackedQ8 pack_q8(const at::Tensor& q, const at::Tensor& d);
// w, d, c, s already in the packed layout (a head file's arrays): checked, then used as
// they are (views of a slot stay views)
PackedQ8 packed_q8(const at::Tensor& w, const at::Tensor& d, const at::Tensor& c,
                   const at::Tensor& s);
PackedQ4 packed_q4(const at::Tensor& nib, const at::Tensor& d, const at::Tensor& m);
// x: [M, K] any float dtype (used as fp32); returns fp32 [M, N]; M may exceed 8 (done 8
// rows at a time, one weight pass each).
at::Tensor gemm_q4(const at::Tensor& x, const PackedQ4& w);
at::Tensor gemm_q8(const at::Tensor& x, const PackedQ8& w);
// x: [M, K] any float dtype; w: bf16 or fp16 [N, K] contiguous, K % 32 == 0; fp32 [M, N].
// Small draft matrices run in microseconds instead of the ~70 us a BLAS call costs at these
// sizes, and a row's result does not depend on M.
at::Tensor gemm_f16w(const at::Tensor& x, const at::Tensor& w);

}  // namespace memspec
