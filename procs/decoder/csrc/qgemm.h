// Block-quantised weights times a few activation rows, for batch-1 decoding on CPUs.
//
// A decode step (1 row) or a verify (gamma+1 rows) reads every weight once; what it costs
// is the bytes read plus the work of turning them into numbers. PyTorch's int4/int8 CPU
// kernels decode the weights once per activation row, so a 5-row verify costs ~2.5 steps.
// These kernels decode each weight block once and apply it to all rows (up to 8), with
// AVX-512 VNNI integer dot products on activations quantised per 32-value group to int8,
// the scheme llama.cpp uses for its Q4_1 / Q8_0 formats:
//   q4: w = d * q + m, q in [0, 15], d and m per 32 inputs (GGUF Q4_1 blocks, exactly)
//   q8: w = d * q,     q in [-127, 127], d per 32 inputs (GGUF Q8_0 blocks, exactly)
// Every row is computed on its own in a fixed order, so results do not depend on M.
#pragma once

#include <torch/extension.h>

namespace memspec {

constexpr int64_t QGROUP = 32;  // inputs per scale
constexpr int64_t QTILE = 16;   // outputs per tile: one AVX-512 register of fp32
constexpr int64_t QMAXROWS = 8;

struct PackedQ4 {
  at::Tensor nib;  // uint8 [N/16, K/4, 32]: nibbles of 16 outputs x 4 inputs
  at::Tensor d, m;  // fp16 [N/16, K/32, 16]
  int64_t N = 0, K = 0;
};

struct PackedQ8 {
  at::Tensor w;  // int8 [N/16, K/4, 64]: 16 outputs x 4 inputs
  at::Tensor d;  // fp16 [N/16, K/32, 16]
  at::Tensor c;  // fp32 [N/16, K/32, 16]: 128 * d * sum(q) over the group
  int64_t N = 0, K = 0;
};

bool qgemm_available();
bool bf16_available();
PackedQ4 pack_q4(const at::Tensor& q, const at::Tensor& d, const at::Tensor& m);
PackedQ8 pack_q8(const at::Tensor& q, const at::Tensor& d);
// x: fp32 [M, K] contiguous; returns fp32 [M, N]. M may exceed 8 (done 8 rows at a time).
at::Tensor gemm_q4(const at::Tensor& x, const PackedQ4& w);
at::Tensor gemm_q8(const at::Tensor& x, const PackedQ8& w);
// x: [M, K] (any float dtype, rounded to bf16); w: bf16 [N, K] contiguous, K % 32 == 0.
// AVX-512 BF16 dot products, one output row at a time: small draft matrices run in
// microseconds instead of the ~70 us a BLAS call costs at these sizes, and a row's result
// does not depend on M.
at::Tensor gemm_bf16(const at::Tensor& x, const at::Tensor& w);

}  // namespace memspec
