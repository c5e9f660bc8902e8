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

#if defined(__AVX2__)
// The rows of a verify are quantised before every matmul, on one thread: in scalar code
// that was ~0.65 ms per row per target forward on a Zen 3 core, a fifth of a 5-row verify.
inline void quantize_group(const float* xs, int8_t* qo, float* scale, float* qsum) {
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 v[4];
  __m256 mx = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(xs + 8 * i);
    mx = _mm256_max_ps(_mm256_and_ps(v[i], absmask), mx);  // a NaN lane keeps mx, as fmax
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float s = _mm_cvtss_f32(m4) / 127.f;
  const float inv = group_inverse(s);
  const __m256 iv = _mm256_set1_ps(inv);
  __m256i qi[4];
  for (int i = 0; i < 4; ++i) qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], iv));
  const __m256i tot = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]),
                                       _mm256_add_epi32(qi[2], qi[3]));
  __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(tot), _mm256_extracti128_si256(tot, 1));
  t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4E));
  t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xB1));
  const int32_t sum = _mm_cvtsi128_si32(t4);
  // |q| <= 127: the saturating packs are exact; the permute undoes their lane interleave
  const __m256i p16a = _mm256_packs_epi32(qi[0], qi[1]);
  const __m256i p16b = _mm256_packs_epi32(qi[2], qi[3]);
  const __m256i p8 = _mm256_packs_epi16(p16a, p16b);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(qo),
                      _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  *scale = s;
  *qsum = s * static_cast<float>(sum);
}
#else
inline void quantize_group(const float* xs, int8_t* qo, float* scale, float* qsum) {
  quantize_group_scalar(xs, qo, scale, qsum);
}
#endif

}  // namespace

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
#if defined(MEMSPEC_AVX512) || defined(MEMSPEC_AVXVNNI)
  if (for_q8) {
    r.u.resize(r.q.size());
    for (size_t i = 0; i < r.u.size(); ++i) r.u[i] = static_cast<uint8_t>(r.q[i] + 128);
  }
#else
  (void)for_q8;
#endif
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

#if defined(MEMSPEC_AVX512) || defined(MEMSPEC_AVX2)
// The x86 kernels prefetch the weights 4 KB ahead (8 KB for q8, twice the bytes per step):
// a batch-1 pass streams them from DRAM, and the hardware prefetcher alone left 10-20% on
// the table, 2 threads, A/B in one process: AVX2 on a Zen 3 EPYC 10% of a 1-3 row pass and
// 4% of 5 rows; AVX-512 on a Sapphire Rapids Xeon 12-13% of 1-3 rows, 17-20% of 5-8 rows.
constexpr int64_t PREFETCH = 4096;
#endif

#if defined(MEMSPEC_AVX512)

template <int M>
void q4_tiles_m(const QuantRows& xr, const Q4& w, float* y, int64_t row0, int64_t ldy,
              int64_t t0, int64_t t1) {
  const int64_t K = w.K, G = K / QGROUP, C = K / 4;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const uint8_t* nib = w.nib;
  const uint16_t* dp = w.d;
  const uint16_t* mp = w.m;
  const int32_t* xq = reinterpret_cast<const int32_t*>(xr.q.data()) + row0 * C;
  const float* xs = xr.scale.data() + row0 * G;
  const float* xsum = xr.qsum.data() + row0 * G;
  for (int64_t t = t0; t < t1; ++t) {
    __m512 acc[M];
    for (int mi = 0; mi < M; ++mi) acc[mi] = _mm512_setzero_ps();
    const uint8_t* tile = nib + t * C * 32;
    for (int64_t g = 0; g < G; ++g) {
      const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(dp + (t * G + g) * QTILE)));
      const __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(mp + (t * G + g) * QTILE)));
      __m512i dot[M];
      for (int mi = 0; mi < M; ++mi) dot[mi] = _mm512_setzero_si512();
      for (int64_t c = g * 8; c < g * 8 + 8; c += 2) {  // one 64-byte load: inputs of c, c+1
        _mm_prefetch(reinterpret_cast<const char*>(tile + c * 32 + PREFETCH), _MM_HINT_T0);
        const __m512i p = _mm512_loadu_si512(tile + c * 32);
        const __m512i w0 = _mm512_and_si512(p, low4);
        const __m512i w1 = _mm512_and_si512(_mm512_srli_epi16(p, 4), low4);
        for (int mi = 0; mi < M; ++mi) {
          dot[mi] = _mm512_dpbusd_epi32(dot[mi], w0, _mm512_set1_epi32(xq[mi * C + c]));
          dot[mi] = _mm512_dpbusd_epi32(dot[mi], w1, _mm512_set1_epi32(xq[mi * C + c + 1]));
        }
      }
      for (int mi = 0; mi < M; ++mi) {
        const __m512 part = _mm512_mul_ps(_mm512_cvtepi32_ps(dot[mi]), dv);
        acc[mi] = _mm512_fmadd_ps(part, _mm512_set1_ps(xs[mi * G + g]), acc[mi]);
        acc[mi] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xsum[mi * G + g]), acc[mi]);
      }
    }
    for (int mi = 0; mi < M; ++mi) _mm512_storeu_ps(y + (row0 + mi) * ldy + t * QTILE, acc[mi]);
  }
}

template <int M>
void q8_tiles_m(const QuantRows& xr, const Q8& w, float* y, int64_t row0, int64_t ldy,
              int64_t t0, int64_t t1) {
  const int64_t K = w.K, G = K / QGROUP, C = K / 4;
  const int8_t* wp = w.w;
  const uint16_t* dp = w.d;
  const float* cp = w.c;
  const int32_t* xu = reinterpret_cast<const int32_t*>(xr.u.data()) + row0 * C;
  const float* xs = xr.scale.data() + row0 * G;
  for (int64_t t = t0; t < t1; ++t) {
    __m512 acc[M];
    for (int mi = 0; mi < M; ++mi) acc[mi] = _mm512_setzero_ps();
    const int8_t* tile = wp + t * C * 64;
    for (int64_t g = 0; g < G; ++g) {
      const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(dp + (t * G + g) * QTILE)));
      const __m512 cv = _mm512_loadu_ps(cp + (t * G + g) * QTILE);
      __m512i dot[M];
      for (int mi = 0; mi < M; ++mi) dot[mi] = _mm512_setzero_si512();
      for (int64_t c = g * 8; c < g * 8 + 8; ++c) {
        _mm_prefetch(reinterpret_cast<const char*>(tile + c * 64 + 2 * PREFETCH), _MM_HINT_T0);
        const __m512i wq = _mm512_loadu_si512(tile + c * 64);
        for (int mi = 0; mi < M; ++mi)  // (xq + 128) unsigned times w signed
          dot[mi] = _mm512_dpbusd_epi32(dot[mi], _mm512_set1_epi32(xu[mi * C + c]), wq);
      }
      for (int mi = 0; mi < M; ++mi) {
        const __m512 part = _mm512_fmsub_ps(_mm512_cvtepi32_ps(dot[mi]), dv, cv);
        acc[mi] = _mm512_fmadd_ps(part, _mm512_set1_ps(xs[mi * G + g]), acc[mi]);
      }
    }
    for (int mi = 0; mi < M; ++mi) _mm512_storeu_ps(y + (row0 + mi) * ldy + t * QTILE, acc[mi]);
  }
}

#elif defined(MEMSPEC_AVX2)

// Eight outputs (half H of a 16-output tile) at a time: an AVX2 register holds 8 fp32.
// The first half's pass prefetches (see PREFETCH).

inline __m256 load_half8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

template <int M, int H>
void q4_half(const QuantRows& xr, const Q4& w, float* y, int64_t row0, int64_t ldy,
             int64_t t) {
  const int64_t K = w.K, G = K / QGROUP, C = K / 4;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const uint8_t* tile = w.nib + t * C * 32;
  const uint16_t* dp = w.d + t * G * QTILE + 8 * H;
  const uint16_t* mp = w.m + t * G * QTILE + 8 * H;
  const int32_t* xq = reinterpret_cast<const int32_t*>(xr.q.data()) + row0 * C;
  const float* xs = xr.scale.data() + row0 * G;
  const float* xsum = xr.qsum.data() + row0 * G;
#if !defined(MEMSPEC_AVXVNNI)
  const __m256i ones = _mm256_set1_epi16(1);
#endif
  __m256 acc[M];
  for (int mi = 0; mi < M; ++mi) acc[mi] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m256i dot[M];
    for (int mi = 0; mi < M; ++mi) dot[mi] = _mm256_setzero_si256();
    for (int64_t c = g * 8; c < g * 8 + 8; c += 2) {  // half H's 32 bytes of the c, c+1 pair
      if (H == 0) _mm_prefetch(reinterpret_cast<const char*>(tile + c * 32 + PREFETCH), _MM_HINT_T0);
      const __m256i p = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + c * 32 + 32 * H));
      const __m256i w0 = _mm256_and_si256(p, low4);
      const __m256i w1 = _mm256_and_si256(_mm256_srli_epi16(p, 4), low4);
      for (int mi = 0; mi < M; ++mi) {
        const __m256i x0 = _mm256_set1_epi32(xq[mi * C + c]);
        const __m256i x1 = _mm256_set1_epi32(xq[mi * C + c + 1]);
#if defined(MEMSPEC_AVXVNNI)
        dot[mi] = _mm256_dpbusd_avx_epi32(dot[mi], w0, x0);
        dot[mi] = _mm256_dpbusd_avx_epi32(dot[mi], w1, x1);
#else
        // nibble x int8 pairs: |sum| <= 2 * 15 * 127, and eight of them still fit in
        // int16 (30480), so the group is summed in int16 and widened once
        dot[mi] = _mm256_add_epi16(dot[mi], _mm256_maddubs_epi16(w0, x0));
        dot[mi] = _mm256_add_epi16(dot[mi], _mm256_maddubs_epi16(w1, x1));
#endif
      }
    }
    const __m256 dv = load_half8(dp + g * QTILE);
    const __m256 mv = load_half8(mp + g * QTILE);
    for (int mi = 0; mi < M; ++mi) {
#if !defined(MEMSPEC_AVXVNNI)
      dot[mi] = _mm256_madd_epi16(dot[mi], ones);
#endif
      const __m256 part = _mm256_mul_ps(_mm256_cvtepi32_ps(dot[mi]), dv);
      acc[mi] = _mm256_fmadd_ps(part, _mm256_set1_ps(xs[mi * G + g]), acc[mi]);
      acc[mi] = _mm256_fmadd_ps(mv, _mm256_set1_ps(xsum[mi * G + g]), acc[mi]);
    }
  }
  for (int mi = 0; mi < M; ++mi)
    _mm256_storeu_ps(y + (row0 + mi) * ldy + t * QTILE + 8 * H, acc[mi]);
}

template <int M>
void q4_tiles_m(const QuantRows& xr, const Q4& w, float* y, int64_t row0, int64_t ldy,
              int64_t t0, int64_t t1) {
  for (int64_t t = t0; t < t1; ++t) {
    q4_half<M, 0>(xr, w, y, row0, ldy, t);
    q4_half<M, 1>(xr, w, y, row0, ldy, t);
  }
}

template <int M, int H>
void q8_half(const QuantRows& xr, const Q8& w, float* y, int64_t row0, int64_t ldy,
             int64_t t) {
  const int64_t K = w.K, G = K / QGROUP, C = K / 4;
  const int8_t* tile = w.w + t * C * 64 + 32 * H;
  const uint16_t* dp = w.d + t * G * QTILE + 8 * H;
  const float* cp = w.c + t * G * QTILE + 8 * H;
  const float* xs = xr.scale.data() + row0 * G;
#if defined(MEMSPEC_AVXVNNI)
  const int32_t* xu = reinterpret_cast<const int32_t*>(xr.u.data()) + row0 * C;
#else
  const int32_t* xq = reinterpret_cast<const int32_t*>(xr.q.data()) + row0 * C;
  const int32_t* sp = w.s + t * G * QTILE + 8 * H;
  const __m256i ones = _mm256_set1_epi16(1);
#endif
  __m256 acc[M];
  for (int mi = 0; mi < M; ++mi) acc[mi] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m256i dot[M];
    for (int mi = 0; mi < M; ++mi) dot[mi] = _mm256_setzero_si256();
    for (int64_t c = g * 8; c < g * 8 + 8; ++c) {
      if (H == 0) _mm_prefetch(reinterpret_cast<const char*>(tile + c * 64 + 2 * PREFETCH), _MM_HINT_T0);
      const __m256i wq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + c * 64));
      for (int mi = 0; mi < M; ++mi) {
#if defined(MEMSPEC_AVXVNNI)
        dot[mi] = _mm256_dpbusd_avx_epi32(dot[mi], _mm256_set1_epi32(xu[mi * C + c]), wq);
#else
        // |x| times w with x's sign moved onto w: pairs stay within int16 (2 * 127 * 127)
        const __m256i xb = _mm256_set1_epi32(xq[mi * C + c]);
        const __m256i pr = _mm256_maddubs_epi16(_mm256_sign_epi8(xb, xb),
                                                _mm256_sign_epi8(wq, xb));
        dot[mi] = _mm256_add_epi32(dot[mi], _mm256_madd_epi16(pr, ones));
#endif
      }
    }
    const __m256 dv = load_half8(dp + g * QTILE);
    const __m256 cv = _mm256_loadu_ps(cp + g * QTILE);
#if !defined(MEMSPEC_AVXVNNI)
    const __m256i sv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sp + g * QTILE));
#endif
    for (int mi = 0; mi < M; ++mi) {
#if !defined(MEMSPEC_AVXVNNI)
      dot[mi] = _mm256_add_epi32(dot[mi], sv);  // (xq + 128) . w, as vpdpbusd sums it
#endif
      const __m256 part = _mm256_fmsub_ps(_mm256_cvtepi32_ps(dot[mi]), dv, cv);
      acc[mi] = _mm256_fmadd_ps(part, _mm256_set1_ps(xs[mi * G + g]), acc[mi]);
    }
  }
  for (int mi = 0; mi < M; ++mi)
    _mm256_storeu_ps(y + (row0 + mi) * ldy + t * QTILE + 8 * H, acc[mi]);
}

template <int M>
void q8_tiles_m(const QuantRows& xr, const Q8& w, float* y, int64_t row0, int64_t ldy,
              int64_t t0, int64_t t1) {
  for (int64_t t = t0; t < t1; ++t) {
    q8_half<M, 0>(xr, w, y, row0, ldy, t);
    q8_half<M, 1>(xr, w, y, row0, ldy, t);
  }
}

#elif defined(MEMSPEC_NEON_DOT)

// aarch64 with the dot-product extension (Jetson Orin, Graviton 2+, Apple M1+): sdot on 4
// outputs x 4 inputs per register, the same integers and the same float operations as the
// other paths (vfmaq is fused, as FMA is).

template <int M>
void q4_tiles_m(const QuantRows& xr, const Q4& w, float* y, int64_t row0, int64_t ldy,
                int64_t t0, int64_t t1) {
  const int64_t K = w.K, G = K / QGROUP, C = K / 4;
  const uint8x16_t low4 = vdupq_n_u8(0x0F);
  const int32_t* xq = reinterpret_cast<const int32_t*>(xr.q.data()) + row0 * C;
  const float* xs = xr.scale.data() + row0 * G;
  const float* xsum = xr.qsum.data() + row0 * G;
  for (int64_t t = t0; t < t1; ++t) {
    float32x4_t acc[M][4];
    for (int mi = 0; mi < M; ++mi)
      for (int h = 0; h < 4; ++h) acc[mi][h] = vdupq_n_f32(0.f);
    const uint8_t* tile = w.nib + t * C * 32;
    for (int64_t g = 0; g < G; ++g) {
      int32x4_t dot[M][4];
      for (int mi = 0; mi < M; ++mi)
        for (int h = 0; h < 4; ++h) dot[mi][h] = vdupq_n_s32(0);
      for (int64_t c = g * 8; c < g * 8 + 8; c += 2) {
        for (int h = 0; h < 4; ++h) {  // outputs 4h..4h+3: bytes 16h.. of the pair
          const uint8x16_t p = vld1q_u8(tile + c * 32 + 16 * h);
          const int8x16_t w0 = vreinterpretq_s8_u8(vandq_u8(p, low4));
          const int8x16_t w1 = vreinterpretq_s8_u8(vshrq_n_u8(p, 4));
          for (int mi = 0; mi < M; ++mi) {
            const int8x16_t x0 = vreinterpretq_s8_s32(vdupq_n_s32(xq[mi * C + c]));
            const int8x16_t x1 = vreinterpretq_s8_s32(vdupq_n_s32(xq[mi * C + c + 1]));
            dot[mi][h] = vdotq_s32(vdotq_s32(dot[mi][h], w0, x0), w1, x1);
          }
        }
      }
      for (int h = 0; h < 4; ++h) {
        const float32x4_t dv = {half_to_float(w.d[(t * G + g) * QTILE + 4 * h]),
                                half_to_float(w.d[(t * G + g) * QTILE + 4 * h + 1]),
                                half_to_float(w.d[(t * G + g) * QTILE + 4 * h + 2]),
                                half_to_float(w.d[(t * G + g) * QTILE + 4 * h + 3])};
        const float32x4_t mv = {half_to_float(w.m[(t * G + g) * QTILE + 4 * h]),
                                half_to_float(w.m[(t * G + g) * QTILE + 4 * h + 1]),
                                half_to_float(w.m[(t * G + g) * QTILE + 4 * h + 2]),
                                half_to_float(w.m[(t * G + g) * QTILE + 4 * h + 3])};
        for (int mi = 0; mi < M; ++mi) {
          const float32x4_t part = vmulq_f32(vcvtq_f32_s32(dot[mi][h]), dv);
          acc[mi][h] = vfmaq_f32(acc[mi][h], part, vdupq_n_f32(xs[mi * G + g]));
          acc[mi][h] = vfmaq_f32(acc[mi][h], mv, vdupq_n_f32(xsum[mi * G + g]));
        }
      }
    }
    for (int mi = 0; mi < M; ++mi)
      for (int h = 0; h < 4; ++h) vst1q_f32(y + (row0 + mi) * ldy + t * QTILE + 4 * h, acc[mi][h]);
  }
}

template <int M>
void q8_tiles_m(const QuantRows& xr, const Q8& w, float* y, int64_t row0, int64_t ldy,
                int64_t t0, int64_t t1) {
  const int64_t K = w.K, G = K / QGROUP, C = K / 4;
  const int32_t* xq = reinterpret_cast<const int32_t*>(xr.q.data()) + row0 * C;
  const float* xs = xr.scale.data() + row0 * G;
  for (int64_t t = t0; t < t1; ++t) {
    float32x4_t acc[M][4];
    for (int mi = 0; mi < M; ++mi)
      for (int h = 0; h < 4; ++h) acc[mi][h] = vdupq_n_f32(0.f);
    const int8_t* tile = w.w + t * C * 64;
    for (int64_t g = 0; g < G; ++g) {
      int32x4_t dot[M][4];
      for (int mi = 0; mi < M; ++mi)
        for (int h = 0; h < 4; ++h) dot[mi][h] = vdupq_n_s32(0);
      for (int64_t c = g * 8; c < g * 8 + 8; ++c)
        for (int h = 0; h < 4; ++h) {
          const int8x16_t wq = vld1q_s8(tile + c * 64 + 16 * h);
          for (int mi = 0; mi < M; ++mi)
            dot[mi][h] = vdotq_s32(dot[mi][h], wq,
                                   vreinterpretq_s8_s32(vdupq_n_s32(xq[mi * C + c])));
        }
      for (int h = 0; h < 4; ++h) {
        const int64_t o = (t * G + g) * QTILE + 4 * h;
        const float32x4_t dv = {half_to_float(w.d[o]), half_to_float(w.d[o + 1]),
                                half_to_float(w.d[o + 2]), half_to_float(w.d[o + 3])};
        const float32x4_t cv = vld1q_f32(w.c + o);
        const int32x4_t sv = vld1q_s32(w.s + o);
        for (int mi = 0; mi < M; ++mi) {  // (xq + 128) . w, then d * it - c, fused
          const float32x4_t u = vcvtq_f32_s32(vaddq_s32(dot[mi][h], sv));
          const float32x4_t part = vfmaq_f32(vnegq_f32(cv), u, dv);
          acc[mi][h] = vfmaq_f32(acc[mi][h], part, vdupq_n_f32(xs[mi * G + g]));
        }
      }
    }
    for (int mi = 0; mi < M; ++mi)
      for (int h = 0; h < 4; ++h) vst1q_f32(y + (row0 + mi) * ldy + t * QTILE + 4 * h, acc[mi][h]);
  }
}

#else  // portable C++: the same integers and the same float operations, in plain loops

// One 16-output tile, one 32-input group: the weights unpacked once to int16 [16][32] and
// shared by every row, then per row the integer dot products (exact, so their order does
// not matter; the compiler vectorises them for whatever the target has).
template <int M>
void int_dots(const int16_t (&wg)[QTILE][QGROUP], const int16_t* x16, int64_t K, int64_t g,
              int32_t (&dot)[QMAXROWS][QTILE]) {
  for (int mi = 0; mi < M; ++mi) {
    const int16_t* xr = x16 + mi * K + g * QGROUP;
    for (int64_t j = 0; j < QTILE; ++j) {
      int32_t s = 0;
      for (int64_t k = 0; k < QGROUP; ++k) s += static_cast<int32_t>(wg[j][k]) * xr[k];
      dot[mi][j] = s;
    }
  }
}

std::vector<int16_t> widen_rows(const QuantRows& xr, int64_t row0, int64_t M, int64_t K) {
  std::vector<int16_t> x16(M * K);
  for (int64_t i = 0; i < M * K; ++i) x16[i] = xr.q[row0 * K + i];
  return x16;
}

template <int M>
void q4_tiles_m(const QuantRows& xr, const Q4& w, float* y, int64_t row0, int64_t ldy,
              int64_t t0, int64_t t1) {
  const int64_t K = w.K, G = K / QGROUP, C = K / 4;
  const std::vector<int16_t> x16 = widen_rows(xr, row0, M, K);
  const float* xs = xr.scale.data() + row0 * G;
  const float* xsum = xr.qsum.data() + row0 * G;
  int16_t wg[QTILE][QGROUP];
  int32_t dot[QMAXROWS][QTILE];
  for (int64_t t = t0; t < t1; ++t) {
    float acc[M][QTILE] = {};
    const uint8_t* tile = w.nib + t * C * 32;
    for (int64_t g = 0; g < G; ++g) {
      for (int64_t e = 0; e < 4; ++e)  // pairs of 4-input columns, 64 bytes each
        for (int64_t b = 0; b < 64; ++b) {
          const uint8_t p = tile[(g * 4 + e) * 64 + b];
          wg[b / 4][8 * e + b % 4] = p & 0x0F;
          wg[b / 4][8 * e + 4 + b % 4] = p >> 4;
        }
      int_dots<M>(wg, x16.data(), K, g, dot);
      const uint16_t* dp = w.d + (t * G + g) * QTILE;
      const uint16_t* mp = w.m + (t * G + g) * QTILE;
      for (int mi = 0; mi < M; ++mi)
        for (int64_t j = 0; j < QTILE; ++j) {
          const float part = static_cast<float>(dot[mi][j]) * half_to_float(dp[j]);
          const float a = std::fma(part, xs[mi * G + g], acc[mi][j]);
          acc[mi][j] = std::fma(half_to_float(mp[j]), xsum[mi * G + g], a);
        }
    }
    for (int mi = 0; mi < M; ++mi)
      std::memcpy(y + (row0 + mi) * ldy + t * QTILE, acc[mi], sizeof acc[mi]);
  }
}

template <int M>
void q8_tiles_m(const QuantRows& xr, const Q8& w, float* y, int64_t row0, int64_t ldy,
              int64_t t0, int64_t t1) {
  const int64_t K = w.K, G = K / QGROUP, C = K / 4;
  const std::vector<int16_t> x16 = widen_rows(xr, row0, M, K);
  const float* xs = xr.scale.data() + row0 * G;
  int16_t wg[QTILE][QGROUP];
  int32_t dot[QMAXROWS][QTILE];
  for (int64_t t = t0; t < t1; ++t) {
    float acc[M][QTILE] = {};
    const int8_t* tile = w.w + t * C * 64;
    for (int64_t g = 0; g < G; ++g) {
      for (int64_t cc = 0; cc < 8; ++cc)
        for (int64_t j = 0; j < QTILE; ++j)
          for (int64_t i = 0; i < 4; ++i)
            wg[j][cc * 4 + i] = tile[((g * 8 + cc) * QTILE + j) * 4 + i];
      int_dots<M>(wg, x16.data(), K, g, dot);
      const uint16_t* dp = w.d + (t * G + g) * QTILE;
      const float* cp = w.c + (t * G + g) * QTILE;
      const int32_t* sp = w.s + (t * G + g) * QTILE;
      for (int mi = 0; mi < M; ++mi)
        for (int64_t j = 0; j < QTILE; ++j) {
          const float u = static_cast<float>(dot[mi][j] + sp[j]);  // (xq + 128) . w
          const float part = std::fma(u, half_to_float(dp[j]), -cp[j]);
          acc[mi][j] = std::fma(part, xs[mi * G + g], acc[mi][j]);
        }
    }
    for (int mi = 0; mi < M; ++mi)
      std::memcpy(y + (row0 + mi) * ldy + t * QTILE, acc[mi], sizeof acc[mi]);
  }
}

#endif

// fp32 rows times 16-bit weights widened to fp32, one output at a time for up to 8 rows:
// lane-wise FMAs over K in order, then a fixed reduction tree, so M never changes a row.
template <bool BF16>
void f16w_body(const float* xp, const uint16_t* wp, float* yp, int64_t r0, int64_t rows,
               int64_t K, int64_t N, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const uint16_t* wr = wp + n * K;
#if defined(MEMSPEC_AVX512)
    __m512 acc[QMAXROWS];
    for (int64_t mi = 0; mi < rows; ++mi) acc[mi] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + k));
      const __m512 wv = BF16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16))
                             : _mm512_cvtph_ps(raw);
      for (int64_t mi = 0; mi < rows; ++mi)
        acc[mi] = _mm512_fmadd_ps(_mm512_loadu_ps(xp + (r0 + mi) * K + k), wv, acc[mi]);
    }
    for (int64_t mi = 0; mi < rows; ++mi) yp[(r0 + mi) * N + n] = _mm512_reduce_add_ps(acc[mi]);
#elif defined(MEMSPEC_AVX2)
    __m256 acc[QMAXROWS];
    for (int64_t mi = 0; mi < rows; ++mi) acc[mi] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) {
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + k));
      const __m256 wv = BF16 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16))
                             : _mm256_cvtph_ps(raw);
      for (int64_t mi = 0; mi < rows; ++mi)
        acc[mi] = _mm256_fmadd_ps(_mm256_loadu_ps(xp + (r0 + mi) * K + k), wv, acc[mi]);
    }
    for (int64_t mi = 0; mi < rows; ++mi) {
      const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(acc[mi]), _mm256_extractf128_ps(acc[mi], 1));
      const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
      const __m128 s1 = _mm_add_ss(s2, _mm_movehdup_ps(s2));
      yp[(r0 + mi) * N + n] = _mm_cvtss_f32(s1);
    }
#elif defined(MEMSPEC_NEON_DOT)
    for (int64_t mi = 0; mi < rows; ++mi) {  // lanes 0-3 and 4-7: the portable path's tree
      float32x4_t lo = vdupq_n_f32(0.f), hi = vdupq_n_f32(0.f);
      const float* xr = xp + (r0 + mi) * K;
      for (int64_t k = 0; k < K; k += 8) {
        const uint16x8_t raw = vld1q_u16(wr + k);
        float32x4_t w0, w1;
        if (BF16) {
          w0 = vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(raw), 16));
          w1 = vreinterpretq_f32_u32(vshll_n_u16(vget_high_u16(raw), 16));
        } else {
          const float16x8_t h = vreinterpretq_f16_u16(raw);
          w0 = vcvt_f32_f16(vget_low_f16(h));
          w1 = vcvt_f32_f16(vget_high_f16(h));
        }
        lo = vfmaq_f32(lo, vld1q_f32(xr + k), w0);
        hi = vfmaq_f32(hi, vld1q_f32(xr + k + 4), w1);
      }
      const float32x4_t s4 = vaddq_f32(lo, hi);
      const float32x2_t s2 = vadd_f32(vget_low_f32(s4), vget_high_f32(s4));
      yp[(r0 + mi) * N + n] = vget_lane_f32(s2, 0) + vget_lane_f32(s2, 1);
    }
#else
    constexpr int64_t L = 8;  // fixed lanes: the same sums whatever the compiler vectorises
    float wf[L];
    for (int64_t mi = 0; mi < rows; ++mi) {
      float acc[L] = {};
      const float* xr = xp + (r0 + mi) * K;
      for (int64_t k = 0; k < K; k += L) {
        for (int64_t l = 0; l < L; ++l) {
          wf[l] = BF16 ? bf16_to_float(wr[k + l]) : half_to_float(wr[k + l]);
        }
        for (int64_t l = 0; l < L; ++l) acc[l] = std::fma(xr[k + l], wf[l], acc[l]);
      }
      yp[(r0 + mi) * N + n] = ((acc[0] + acc[4]) + (acc[2] + acc[6])) +
                              ((acc[1] + acc[5]) + (acc[3] + acc[7]));
    }
#endif
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
#if defined(MEMSPEC_BF16)
  if (bf16) {
    for (int64_t n = n0; n < n1; ++n) {
      __m512 acc[QMAXROWS];
      for (int64_t mi = 0; mi < rows; ++mi) acc[mi] = _mm512_setzero_ps();
      const uint16_t* wr = w + n * K;
      for (int64_t kk = 0; kk < K; kk += 32) {
        const __m512bh wv = (__m512bh)_mm512_loadu_si512(wr + kk);
        for (int64_t mi = 0; mi < rows; ++mi) {
          const __m512bh xv = (__m512bh)_mm512_loadu_si512(xb + (row0 + mi) * K + kk);
          acc[mi] = _mm512_dpbf16_ps(acc[mi], xv, wv);
        }
      }
      for (int64_t mi = 0; mi < rows; ++mi) y[(row0 + mi) * N + n] = _mm512_reduce_add_ps(acc[mi]);
    }
    return;
  }
#else
  (void)xb;
#endif
  if (bf16)
    f16w_body<true>(x, w, y, row0, rows, K, N, n0, n1);
  else
    f16w_body<false>(x, w, y, row0, rows, K, N, n0, n1);
}

}  // namespace k
}  // namespace memspec
