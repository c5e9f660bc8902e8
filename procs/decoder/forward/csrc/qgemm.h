// PyTorch glue for the block kernels of qkernels.h: packed weights held as tensors, rows
// quantised per call, output tiles split across threads. See qkernels.h for the formats,
// the kernel paths and why every path gives the same bits.
#pragma once

#include <ATen/ATen.h>  // not torch/extension.h: this unit needs no Python (builds 3x faster)
#include "pool.h"
#include "qkernels.h"

namespace memspec {

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
