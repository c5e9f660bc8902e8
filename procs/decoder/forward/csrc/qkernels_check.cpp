// A standalone check of the block kernels (no PyTorch): built by tests/test_isa.py once per
// kernel path with that path's flags, and cross-built for aarch64 (run under qemu where it
// is installed). On fixed pseudo-random weights and rows it checks, for q4, q8 and 16-bit
// weights, that every row comes out the same whether computed alone or with 7 others, and
// that results are within the format's rounding of a double-precision reference; it prints
// the kernel path and a hash of the output bits, which must agree across paths for q4/q8.
//
//   c++ -std=c++17 -O2 <path flags> qkernels_check.cpp qkernels.cpp -o check && ./check

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "qkernels.h"

using namespace memspec::k;

namespace {

uint64_t rng = 0x9E3779B97F4A7C15ull;
uint32_t next_u32() {  // xorshift64*: the same numbers on every machine
  rng ^= rng >> 12;
  rng ^= rng << 25;
  rng ^= rng >> 27;
  return static_cast<uint32_t>((rng * 0x2545F4914F6CDD1Dull) >> 32);
}
float uniform() { return static_cast<float>(next_u32() >> 8) / 16777216.f * 2.f - 1.f; }

// fp16 bits of k / 1024 for 0 < |k| < 1024 (all exactly representable, all normal)
uint16_t half_bits(int k) {
  const uint16_t sign = k < 0 ? 0x8000 : 0;
  const int a = k < 0 ? -k : k;
  int e = 0;
  while ((2 << e) <= a) ++e;  // a in [2^e, 2^(e+1))
  const int man = (a - (1 << e)) << (10 - e);
  return static_cast<uint16_t>(sign | ((e + 5) << 10) | man);
}

uint16_t bf16_bits(float f) {  // truncation of an exactly representable value
  uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  return static_cast<uint16_t>(b >> 16);
}

uint64_t fnv(const std::vector<float>& y, uint64_t h = 1469598103934665603ull) {
  for (float v : y) {
    uint32_t b;
    std::memcpy(&b, &v, sizeof b);
    for (int i = 0; i < 4; ++i) {
      h ^= (b >> (8 * i)) & 0xFF;
      h *= 1099511628211ull;
    }
  }
  return h;
}

int failures = 0;
void expect(bool ok, const char* what) {
  if (!ok) {
    std::printf("FAIL %s\n", what);
    ++failures;
  }
}

template <typename Run>
std::vector<float> rows_alone_and_together(int64_t M, int64_t N, Run run, const char* what) {
  std::vector<float> all(M * N), one(M * N);
  run(0, M, all.data());
  for (int64_t r = 0; r < M; ++r) run(r, 1, one.data());
  expect(std::memcmp(all.data(), one.data(), all.size() * sizeof(float)) == 0, what);
  return all;
}

double max_rel(const std::vector<float>& y, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < y.size(); ++i) {
    num = std::fmax(num, std::fabs(y[i] - ref[i]));
    den = std::fmax(den, std::fabs(ref[i]));
  }
  return num / den;
}

}  // namespace

int main() {
  const int64_t M = 8, N = 64, K = 160, G = K / QGROUP;
  std::vector<float> x(M * K);
  for (auto& v : x) v = uniform() * (next_u32() % 7 == 0 ? 8.f : 1.f);

  // the rows' quantiser against its scalar reference, byte for byte: random rows, a group of
  // zeros, and a group whose scale is 1 so that x / s lands on halves (ties round to even)
  {
    std::vector<float> xq(x);
    xq.resize(M * K + 2 * K);
    for (int64_t kk = 0; kk < QGROUP; ++kk) {
      xq[M * K + kk] = 0.f;
      xq[M * K + QGROUP + kk] = kk == 0 ? 127.f : static_cast<float>(kk % 9) - 4.5f;
      xq[M * K + 2 * QGROUP + kk] = (kk % 2 ? -1e-38f : 3e-39f) * static_cast<float>(kk);
    }
    const int64_t rows = M + 2;
    const QuantRows a = quantize_rows(xq.data(), rows, K, false);
    const QuantRows b = quantize_rows_scalar(xq.data(), rows, K);
    expect(a.q == b.q, "quantised rows differ from the scalar reference");
    expect(std::memcmp(a.scale.data(), b.scale.data(), b.scale.size() * 4) == 0 &&
               std::memcmp(a.qsum.data(), b.qsum.data(), b.qsum.size() * 4) == 0,
           "row scales or sums differ from the scalar reference");
    expect(b.q[M * K + QGROUP + 1] == -4 && b.q[M * K + QGROUP + 2] == -2, "ties to even");
    bool tiny_zero = true;  // 1/s overflows: the group is zeros on every path
    for (int64_t kk = 0; kk < QGROUP; ++kk) tiny_zero &= a.q[M * K + 2 * QGROUP + kk] == 0;
    expect(tiny_zero, "a group too small to invert is not zeros");
  }

  // q4: codes 0..15, scales k/1024
  std::vector<uint8_t> q4(N * K);
  std::vector<uint16_t> d4(N * G), m4(N * G);
  std::vector<int> dk(N * G), mk(N * G);
  for (auto& v : q4) v = next_u32() % 16;
  for (int64_t i = 0; i < N * G; ++i) {
    dk[i] = 1 + next_u32() % 200;
    mk[i] = -1 - static_cast<int>(next_u32() % 900);
    d4[i] = half_bits(dk[i]);
    m4[i] = half_bits(mk[i]);
  }
  std::vector<uint8_t> nib(N * K / 2);
  std::vector<uint16_t> d4t(N * G), m4t(N * G);
  pack_q4(q4.data(), d4.data(), m4.data(), N, K, nib.data(), d4t.data(), m4t.data());
  expect(half_to_float(d4[0]) == dk[0] / 1024.f, "fp16 scale bits");
  const Q4 w4{nib.data(), d4t.data(), m4t.data(), N, K};
  auto y4 = rows_alone_and_together(M, N, [&](int64_t r0, int64_t rows, float* y) {
    const QuantRows xr = quantize_rows(x.data(), M, K, false);
    q4_tiles(xr, w4, y, r0, rows, 0, N / QTILE);
  }, "q4 rows depend on M");

  // q8: codes -127..127
  std::vector<int8_t> q8(N * K);
  std::vector<uint16_t> d8(N * G), d8t(N * G);
  std::vector<float> c8(N * G);
  std::vector<int32_t> s8(N * G);
  for (auto& v : q8) v = static_cast<int8_t>(static_cast<int>(next_u32() % 255) - 127);
  std::vector<int> d8k(N * G);
  for (int64_t i = 0; i < N * G; ++i) {
    d8k[i] = 1 + next_u32() % 30;
    d8[i] = half_bits(d8k[i]);
  }
  std::vector<int8_t> w8(N * K);
  pack_q8(q8.data(), d8.data(), N, K, w8.data(), d8t.data(), c8.data(), s8.data());
  const Q8 wq8{w8.data(), d8t.data(), c8.data(), s8.data(), N, K};
  auto y8 = rows_alone_and_together(M, N, [&](int64_t r0, int64_t rows, float* y) {
    const QuantRows xr = quantize_rows(x.data(), M, K, true);
    q8_tiles(xr, wq8, y, r0, rows, 0, N / QTILE);
  }, "q8 rows depend on M");

  // 16-bit weights
  std::vector<uint16_t> wb(N * K), wh(N * K), xb(M * K);
  std::vector<double> wbd(N * K), whd(N * K);
  for (int64_t i = 0; i < N * K; ++i) {
    int kk = static_cast<int>(next_u32() % 2046) - 1023;
    kk += kk >= 0;  // never 0
    wh[i] = half_bits(kk);
    whd[i] = kk / 1024.0;
    const float fb = static_cast<float>(static_cast<int>(next_u32() % 255) - 127) / 128.f;
    wb[i] = bf16_bits(fb);
    wbd[i] = fb;
  }
  for (int64_t i = 0; i < M * K; ++i) xb[i] = bf16_bits(x[i]);  // only read with native bf16
  auto yb = rows_alone_and_together(M, N, [&](int64_t r0, int64_t rows, float* y) {
    f16w_rows(x.data(), xb.data(), wb.data(), true, y, r0, rows, K, N, 0, N);
  }, "bf16 rows depend on M");
  auto yh = rows_alone_and_together(M, N, [&](int64_t r0, int64_t rows, float* y) {
    f16w_rows(x.data(), xb.data(), wh.data(), false, y, r0, rows, K, N, 0, N);
  }, "fp16 rows depend on M");

  // references in double precision
  std::vector<double> r4(M * N), r8(M * N), rb(M * N), rh(M * N);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double a4 = 0, a8 = 0, ab = 0, ah = 0;
      for (int64_t kk = 0; kk < K; ++kk) {
        const int64_t g = kk / QGROUP;
        const double xv = x[m * K + kk];
        a4 += xv * (dk[n * G + g] / 1024.0 * q4[n * K + kk] + mk[n * G + g] / 1024.0);
        a8 += xv * (d8k[n * G + g] / 1024.0 * q8[n * K + kk]);
        ab += xv * wbd[n * K + kk];
        ah += xv * whd[n * K + kk];
      }
      r4[m * N + n] = a4;
      r8[m * N + n] = a8;
      rb[m * N + n] = ab;
      rh[m * N + n] = ah;
    }
  // int8 rows lose ~1/254 of each group's largest value; bf16-rounded rows ~2^-9
  expect(max_rel(y4, r4) < 2e-2, "q4 far from reference");
  expect(max_rel(y8, r8) < 2e-2, "q8 far from reference");
  expect(max_rel(yb, rb) < (bf16_native() ? 1e-2 : 1e-5), "bf16 far from reference");
  expect(max_rel(yh, rh) < 1e-5, "fp16 far from reference");

  std::printf("path %s\n", kernel_path());
  std::printf("q4 %016llx\n", static_cast<unsigned long long>(fnv(y4)));
  std::printf("q8 %016llx\n", static_cast<unsigned long long>(fnv(y8)));
  std::printf("bf16 %016llx\n", static_cast<unsigned long long>(fnv(yb)));
  std::printf("fp16 %016llx\n", static_cast<unsigned long long>(fnv(yh)));
  std::printf("%s\n", failures ? "FAILED" : "OK");
  return failures ? 1 : 0;
}
