// See qgemm.h.
#include "qgemm.h"

#include <tuple>
#include <utility>

namespace memspec {

namespace {

const uint16_t* bits16(const at::Tensor& t) {
  return reinterpret_cast<const uint16_t*>(t.data_ptr());
}

at::Tensor fp16_bits(const at::Tensor& s) { return s.to(at::kFloat).to(at::kHalf).contiguous(); }

}  // namespace

k::Q4 PackedQ4::view() const {
  return {nib.data_ptr<uint8_t>(), bits16(d), bits16(m), N, K};
}

k::Q8 PackedQ8::view() const {
  return {w.data_ptr<int8_t>(), bits16(d), c.data_ptr<float>(), s.data_ptr<int32_t>(), N, K};
}

PackedQ4 pack_q4(const at::Tensor& q_in, const at::Tensor& d_in, const at::Tensor& m_in) {
  at::Tensor q = q_in.to(at::kByte).contiguous();
  const int64_t N = q.size(0), K = q.size(1);
  TORCH_CHECK(N % QTILE == 0 && K % QGROUP == 0, "q4 needs N % 16 == 0 and K % 32 == 0");
  at::Tensor d = fp16_bits(d_in), m = fp16_bits(m_in);
  TORCH_CHECK(d.numel() == N * (K / QGROUP) && m.numel() == d.numel(), "q4 scales: wrong size");
  PackedQ4 p;
  p.N = N;
  p.K = K;
  p.nib = at::empty({N / QTILE, K / 8, 64}, at::kByte);
  p.d = at::empty({N / QTILE, K / QGROUP, QTILE}, at::kHalf);
  p.m = at::empty_like(p.d);
  k::pack_q4(q.data_ptr<uint8_t>(), bits16(d), bits16(m), N, K, p.nib.data_ptr<uint8_t>(),
             reinterpret_cast<uint16_t*>(p.d.data_ptr()), reinterpret_cast<uint16_t*>(p.m.data_ptr()));
  return p;
}

PackedQ8 pack_q8(const at::Tensor& q_in, const at::Tensor& d_in) {
  at::Tensor q = q_in.to(at::kChar).contiguous();
  const int64_t N = q.size(0), K = q.size(1);
  TORCH_CHECK(N % QTILE == 0 && K % QGROUP == 0, "q8 needs N % 16 == 0 and K % 32 == 0");
  at::Tensor d = fp16_bits(d_in);
  TORCH_CHECK(d.numel() == N * (K / QGROUP), "q8 scales: wrong size");
  PackedQ8 p;
  p.N = N;
  p.K = K;
  p.w = at::empty({N / QTILE, K / 4, 64}, at::kChar);
  p.d = at::empty({N / QTILE, K / QGROUP, QTILE}, at::kHalf);
  p.c = at::empty({N / QTILE, K / QGROUP, QTILE}, at::kFloat);
  p.s = at::empty({N / QTILE, K / QGROUP, QTILE}, at::kInt);
  k::pack_q8(q.data_ptr<int8_t>(), bits16(d), N, K, p.w.data_ptr<int8_t>(),
             reinterpret_cast<uint16_t*>(p.d.data_ptr()), p.c.data_ptr<float>(),
             p.s.data_ptr<int32_t>());
  return p;
}

namespace {

// (N, K) of packed weights `w` ([N/16, K/inputs_per_row, 64] of `type`); every scale array
// in `scales` must be [N/16, K/32, 16] of its own dtype, contiguous (a head file's arrays
// are checked before the kernels point at them)
std::pair<int64_t, int64_t> packed_shape(const at::Tensor& w, at::ScalarType type,
                                         int64_t inputs_per_row, const char* what,
                                         const std::vector<std::pair<const at::Tensor*,
                                                                     at::ScalarType>>& scales,
                                         const char* scales_msg) {
  TORCH_CHECK(w.dim() == 3 && w.size(2) == 64 && w.scalar_type() == type && w.is_contiguous(),
              what);
  const int64_t N = w.size(0) * QTILE, K = w.size(1) * inputs_per_row;
  TORCH_CHECK(K % QGROUP == 0, what, " (K % 32 != 0)");
  const std::vector<int64_t> tiled{N / QTILE, K / QGROUP, QTILE};
  for (const auto& [t, st] : scales)
    TORCH_CHECK(t->sizes().vec() == tiled && t->scalar_type() == st && t->is_contiguous(),
                scales_msg);
  return {N, K};
}

}  // namespace

PackedQ8 packed_q8(const at::Tensor& w, const at::Tensor& d, const at::Tensor& c,
                   const at::Tensor& s) {
  PackedQ8 p;
  std::tie(p.N, p.K) = packed_shape(
      w, at::kChar, 4, "packed q8 weights: int8 [N/16, K/4, 64] expected",
      {{&d, at::kHalf}, {&c, at::kFloat}, {&s, at::kInt}},
      "packed q8 scales: fp16 / fp32 / int32 [N/16, K/32, 16] expected");
  p.w = w;
  p.d = d;
  p.c = c;
  p.s = s;
  return p;
}

PackedQ4 packed_q4(const at::Tensor& nib, const at::Tensor& d, const at::Tensor& m) {
  PackedQ4 p;
  std::tie(p.N, p.K) = packed_shape(
      nib, at::kByte, 8, "packed q4 weights: uint8 [N/16, K/8, 64] expected",
      {{&d, at::kHalf}, {&m, at::kHalf}}, "packed q4 scales: fp16 [N/16, K/32, 16] expected");
  p.nib = nib;
  p.d = d;
  p.m = m;
  return p;
}

namespace {

// Items are (block of up to 8 rows, output tile), block-major: one weight pass per block,
// and one parallel region per product rather than one per block.
template <typename F>
void over_items(int64_t M, int64_t tiles, int64_t batch, const F& run) {
  const int64_t blocks = (M + QMAXROWS - 1) / QMAXROWS;
  parallel_chunks(blocks * tiles, batch, [&](int64_t i0, int64_t i1) {
    while (i0 < i1) {  // split at block boundaries
      const int64_t b = i0 / tiles, t0 = i0 % tiles, t1 = std::min(tiles, t0 + (i1 - i0));
      run(b * QMAXROWS, std::min<int64_t>(QMAXROWS, M - b * QMAXROWS), t0, t1);
      i0 += t1 - t0;
    }
  });
}

at::Tensor rows_fp32(const at::Tensor& x, int64_t K, const char* what) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, what, ": input width ", x.size(-1), " != ", K);
  return x.to(at::kFloat).contiguous();
}

}  // namespace

at::Tensor gemm_q4(const at::Tensor& x_in, const PackedQ4& w) {
  at::Tensor x = rows_fp32(x_in, w.K, "q4 gemm");
  const int64_t M = x.size(0);
  at::Tensor y = at::empty({M, w.N}, x.options());
  const k::QuantRows xr = k::quantize_rows(x.data_ptr<float>(), M, w.K, false);
  const k::Q4 v = w.view();
  float* yp = y.data_ptr<float>();
  over_items(M, w.N / QTILE, 4, [&](int64_t r0, int64_t rows, int64_t t0, int64_t t1) {
    k::q4_tiles(xr, v, yp, r0, rows, t0, t1);
  });
  return y;
}

at::Tensor gemm_q8(const at::Tensor& x_in, const PackedQ8& w) {
  at::Tensor x = rows_fp32(x_in, w.K, "q8 gemm");
  const int64_t M = x.size(0);
  at::Tensor y = at::empty({M, w.N}, x.options());
  const k::QuantRows xr = k::quantize_rows(x.data_ptr<float>(), M, w.K, true);
  const k::Q8 v = w.view();
  float* yp = y.data_ptr<float>();
  over_items(M, w.N / QTILE, 4, [&](int64_t r0, int64_t rows, int64_t t0, int64_t t1) {
    k::q8_tiles(xr, v, yp, r0, rows, t0, t1);
  });
  return y;
}

at::Tensor gemm_f16w(const at::Tensor& x_in, const at::Tensor& w) {
  const bool bf16 = w.scalar_type() == at::kBFloat16;
  TORCH_CHECK((bf16 || w.scalar_type() == at::kHalf) && w.is_contiguous() && w.dim() == 2 &&
                  w.size(1) % QGROUP == 0,
              "16-bit gemm: weights must be contiguous bf16/fp16 [N, K], K % 32 == 0");
  const int64_t K = w.size(1), N = w.size(0);
  at::Tensor x = rows_fp32(x_in, K, "16-bit gemm");
  const int64_t M = x.size(0);
  at::Tensor xb;  // bf16-rounded rows, only where the hardware dot product takes them
  if (bf16 && k::bf16_native()) xb = x.to(at::kBFloat16).contiguous();
  const uint16_t* xbp = xb.defined() ? bits16(xb) : nullptr;
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  over_items(M, N, 64, [&](int64_t r0, int64_t rows, int64_t n0, int64_t n1) {
    k::f16w_rows(xp, xbp, bits16(w), bf16, yp, r0, rows, K, N, n0, n1);
  });
  return y;
}

}  // namespace memspec
