// See qkernels.h. The kernel path is fixed at compile time by the build's -m flags.
#include "qkernels.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD)
#include <arm_neon.h>
#define MEMSPEC_NEON_DOT 1
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define MEMSPEC_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define MEMSPEC_AVX2 1
#if defined(__AVXVNNI__)
#define MEMSPEC_AVXVNNI 1
#endif
#endif
#if defined(MEMSPEC_AVX512) && defined(__AVX512BF16__)
#define MEMSPEC_BF16 1
#endif

namespace memspec {
namespace k {

const char* kernel_path() {
#if defined(MEMSPEC_BF16)
  return "avx512-bf16";
#elif defined(MEMSPEC_AVX512)
  return "avx512-vnni";
#elif defined(MEMSPEC_AVXVNNI)
  return "avx2-vnni";
#elif defined(MEMSPEC_AVX2)
  return "avx2";
#elif defined(MEMSPEC_NEON_DOT)
  return "neon-dotprod";
#else
  return "generic";
#endif
}

bool bf16_native() {
#if defined(MEMSPEC_BF16)
  return true;
#else
  return false;
#endif
}

float half_to_float(uint16_t h) {  // exact, every class (subnormals, inf, nan)
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu, bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    int e = -1;
    do {
      ++e;
      man <<= 1;
    } while ((man & 0x400u) == 0);
    bits = sign | (static_cast<uint32_t>(112 - e) << 23) | ((man & 0x3FFu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

namespace {

inline float bf16_to_float(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// [N, G] -> [N/16, G, 16]
template <typename T>
void tile_scales(const T* s, int64_t N, int64_t G, T* out) {
  for (int64_t n = 0; n < N; ++n)
    for (int64_t g = 0; g < G; ++g) out[((n / QTILE) * G + g) * QTILE + n % QTILE] = s[n * G + g];
}

}  // namespace

void pack_q4(const uint8_t* q, const uint16_t* d, const uint16_t* m, int64_t N, int64_t K,
             uint8_t* nib, uint16_t* d_out, uint16_t* m_out) {
  // byte b = 4j + i of pair e: output j's input 8e + i (low nibble) and 8e + 4 + i (high)
  for (int64_t t = 0; t < N / QTILE; ++t)
    for (int64_t e = 0; e < K / 8; ++e)
      for (int64_t b = 0; b < 64; ++b) {
        const int64_t j = b / 4, i = b % 4;
        const uint8_t* row = q + (t * QTILE + j) * K + 8 * e + i;
        nib[(t * (K / 8) + e) * 64 + b] = static_cast<uint8_t>((row[0] & 0x0F) | (row[4] << 4));
      }
  tile_scales(d, N, K / QGROUP, d_out);
  tile_scales(m, N, K / QGROUP, m_out);
}

void pack_q8(const int8_t* q, const uint16_t* d, int64_t N, int64_t K, int8_t* w,
             uint16_t* d_out, float* c_out, int32_t* s_out) {
  const int64_t G = K / QGROUP;
  for (int64_t t = 0; t < N / QTILE; ++t)
    for (int64_t c = 0; c < K / 4; ++c)
      for (int64_t j = 0; j < QTILE; ++j)
        for (int64_t i = 0; i < 4; ++i)
          w[((t * (K / 4) + c) * QTILE + j) * 4 + i] = q[(t * QTILE + j) * K + 4 * c + i];
  std::vector<float> c(N * G);
  std::vector<int32_t> s(N * G);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t g = 0; g < G; ++g) {
      int32_t sum = 0;
      for (int64_t kk = 0; kk < QGROUP; ++kk) sum += q[n * K + g * QGROUP + kk];
      c[n * G + g] = (half_to_float(d[n * G + g]) * static_cast<float>(sum)) * 128.f;
      s[n * G + g] = 128 * sum;
    }
  tile_scales(d, N, G, d_out);
  tile_scales(c.data(), N, G, c_out);
  tile_scales(s.data(), N, G, s_out);
}

namespace {

// One group of 32 inputs: s = max|x| / 127, q = round-half-even(x / s), and the group's sum.
// Scalar: every path's reference. The x86 body below gives the same bits: the max of |x| is
// exact in any order, x * inv is the same IEEE product, and vcvtps2dq rounds half to even
// as nearbyint does in the default rounding mode.
// 1/s, or 0 for a group of zeros and for one so small that 1/s overflows (max|x| below
// ~4e-37): x * inf would convert to INT_MIN in SIMD and to whatever the compiler makes of
// an out-of-range cast in scalar code; as zeros both paths agree, and lose nothing real.
inline float group_inverse(float s) {
  const float inv = s > 0.f ? 1.f / s : 0.f;
  return std::isfinite(inv) ? inv : 0.f;
}

inline void quantize_group_scalar(const float* xs, int8_t* qo, float* scale, float* qsum) {
  float amax = 0.f;
  for (int64_t kk = 0; kk < QGROUP; ++kk) amax = std::fmax(amax, std::fabs(xs[kk]));
  const float s = amax / 127.f;
  const float inv = group_inverse(s);
  int32_t sum = 0;
  for (int64_t kk = 0; kk < QGROUP; ++kk) {
    const int32_t v = static_cast<int32_t>(std::nearbyint(xs[kk] * inv));
    qo[kk] = static_cast<int8_t>(v);
    sum += v;
  }
  *scale = s;
  *qsum = s * static_cast<float>(sum);
}

}  // namespace

// The kernels of this build's ISA family: quantize_group, q4_tiles_m<M>, q8_tiles_m<M>,
// f16w_out<BF16>, f16w_native and Q8_UNSIGNED_ROWS. One source per family; the -m flags of
// the build (memspec.common.isa) pick the family and, within it, the instructions.
#if defined(MEMSPEC_AVX512) || defined(MEMSPEC_AVX2)
#include "arch/x86.inc"
#elif defined(MEMSPEC_NEON_DOT)
#include "arch/arm.inc"
#else
#include "arch/generic.inc"
#endif

namespace {

using GroupFn = void (*)(const float*, int8_t*, float*, float*);

template <GroupFn group>  // a template argument: the group body inlines into the loop
QuantRows quantize_with(const float* x, int64_t M, int64_t K) {
  QuantRows r;
  const int64_t G = K / QGROUP;
  r.q.resize(M * K);
  r.scale.resize(M * G);
  r.qsum.resize(M * G);
  for (int64_t mi = 0; mi < M; ++mi)
    for (int64_t g = 0; g < G; ++g)
      group(x + mi * K + g * QGROUP, r.q.data() + mi * K + g * QGROUP, &r.scale[mi * G + g],
            &r.qsum[mi * G + g]);
  return r;
}

}  // namespace

QuantRows quantize_rows(const float* x, int64_t M, int64_t K, bool for_q8) {
  QuantRows r = quantize_with<quantize_group>(x, M, K);
  if (for_q8 && Q8_UNSIGNED_ROWS) {
    r.u.resize(r.q.size());
    for (size_t i = 0; i < r.u.size(); ++i) r.u[i] = static_cast<uint8_t>(r.q[i] + 128);
  }
  return r;
}

QuantRows quantize_rows_scalar(const float* x, int64_t M, int64_t K) {
  return quantize_with<quantize_group_scalar>(x, M, K);
}

namespace {

#define MEMSPEC_ROWS_SWITCH(rows, CALL) \
  switch (rows) {                        \
    case 1: CALL(1); break;              \
    case 2: CALL(2); break;              \
    case 3: CALL(3); break;              \
    case 4: CALL(4); break;              \
    case 5: CALL(5); break;              \
    case 6: CALL(6); break;              \
    case 7: CALL(7); break;              \
    default: CALL(8); break;             \
  }

// fp32 rows times 16-bit weights widened to fp32, one output at a time for up to 8 rows
// (the family's f16w_out).
template <bool BF16>
void f16w_body(const float* xp, const uint16_t* wp, float* yp, int64_t r0, int64_t rows,
               int64_t K, int64_t N, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const uint16_t* wr = wp + n * K;
    f16w_out<BF16>(xp, wr, yp, r0, rows, K, N, n);
  }
}

}  // namespace

void q4_tiles(const QuantRows& xr, const Q4& w, float* y, int64_t row0, int64_t rows,
              int64_t t0, int64_t t1) {
#define MEMSPEC_Q4(R) q4_tiles_m<R>(xr, w, y, row0, w.N, t0, t1)
  MEMSPEC_ROWS_SWITCH(rows, MEMSPEC_Q4)
#undef MEMSPEC_Q4
}

void q8_tiles(const QuantRows& xr, const Q8& w, float* y, int64_t row0, int64_t rows,
              int64_t t0, int64_t t1) {
#define MEMSPEC_Q8(R) q8_tiles_m<R>(xr, w, y, row0, w.N, t0, t1)
  MEMSPEC_ROWS_SWITCH(rows, MEMSPEC_Q8)
#undef MEMSPEC_Q8
}

void f16w_rows(const float* x, const uint16_t* xb, const uint16_t* w, bool bf16, float* y,
               int64_t row0, int64_t rows, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  if (bf16 && f16w_native(xb, w, y, row0, rows, K, N, n0, n1)) return;
  if (bf16)
    f16w_body<true>(x, w, y, row0, rows, K, N, n0, n1);
  else
    f16w_body<false>(x, w, y, row0, rows, K, N, n0, n1);
}

}  // namespace k
}  // namespace memspec
