// See qgemm.h. Compiled with -march=native; without AVX-512 VNNI the kernels report
// themselves unavailable and the caller keeps PyTorch's own int4/int8 kernels.
#include "qgemm.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define MEMSPEC_QGEMM 1
#else
#define MEMSPEC_QGEMM 0
#endif

namespace memspec {

bool qgemm_available() { return MEMSPEC_QGEMM == 1; }

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define MEMSPEC_BF16 1
#else
#define MEMSPEC_BF16 0
#endif

bool bf16_available() { return MEMSPEC_BF16 == 1; }

PackedQ4 pack_q4(const at::Tensor& q_in, const at::Tensor& d_in, const at::Tensor& m_in) {
  at::Tensor q = q_in.to(at::kByte).contiguous();
  const int64_t N = q.size(0), K = q.size(1);
  TORCH_CHECK(N % QTILE == 0 && K % QGROUP == 0, "q4 needs N % 16 == 0 and K % 32 == 0");
  PackedQ4 p;
  p.N = N;
  p.K = K;
  p.nib = at::empty({N / QTILE, K / 4, 32}, at::kByte);
  const uint8_t* src = q.data_ptr<uint8_t>();
  uint8_t* dst = p.nib.data_ptr<uint8_t>();
  for (int64_t t = 0; t < N / QTILE; ++t)
    for (int64_t c = 0; c < K / 4; ++c)
      for (int64_t b = 0; b < 32; ++b) {
        const int64_t j = b / 4, i = b % 4, k = 4 * c + i;
        const uint8_t lo = src[(t * QTILE + j) * K + k] & 0x0F;
        const uint8_t hi = src[(t * QTILE + 8 + j) * K + k] & 0x0F;
        dst[(t * (K / 4) + c) * 32 + b] = static_cast<uint8_t>(lo | (hi << 4));
      }
  // [N, K/32] -> [N/16, K/32, 16]
  auto tile = [&](const at::Tensor& s) {
    return s.to(at::kFloat).view({N / QTILE, QTILE, K / QGROUP}).permute({0, 2, 1})
        .to(at::kHalf).contiguous();
  };
  p.d = tile(d_in);
  p.m = tile(m_in);
  return p;
}

PackedQ8 pack_q8(const at::Tensor& q_in, const at::Tensor& d_in) {
  at::Tensor q = q_in.to(at::kChar).contiguous();
  const int64_t N = q.size(0), K = q.size(1);
  TORCH_CHECK(N % QTILE == 0 && K % QGROUP == 0, "q8 needs N % 16 == 0 and K % 32 == 0");
  PackedQ8 p;
  p.N = N;
  p.K = K;
  p.w = at::empty({N / QTILE, K / 4, 64}, at::kChar);
  const int8_t* src = q.data_ptr<int8_t>();
  int8_t* dst = p.w.data_ptr<int8_t>();
  for (int64_t t = 0; t < N / QTILE; ++t)
    for (int64_t c = 0; c < K / 4; ++c)
      for (int64_t j = 0; j < QTILE; ++j)
        for (int64_t i = 0; i < 4; ++i)
          dst[((t * (K / 4) + c) * QTILE + j) * 4 + i] = src[(t * QTILE + j) * K + 4 * c + i];
  at::Tensor sums = q.to(at::kFloat).view({N, K / QGROUP, QGROUP}).sum(2);  // [N, K/32]
  at::Tensor d = d_in.to(at::kHalf).to(at::kFloat);  // the kernel multiplies by fp16 scales
  auto tile = [&](const at::Tensor& s) {
    return s.view({N / QTILE, QTILE, K / QGROUP}).permute({0, 2, 1}).contiguous();
  };
  p.d = tile(d).to(at::kHalf).contiguous();
  p.c = tile(d * sums * 128.f).contiguous();
  return p;
}

namespace {

// Each row, each group of 32: xq = round(x / s) in [-127, 127] with s = max|x| / 127.
struct QuantRows {
  std::vector<int8_t> q;     // [M, K]
  std::vector<float> scale;  // [M, K/32]
  std::vector<float> qsum;   // [M, K/32]: scale * sum(xq), for the q4 offset term
};

QuantRows quantize_rows(const float* x, int64_t M, int64_t K) {
  QuantRows r;
  const int64_t G = K / QGROUP;
  r.q.resize(M * K);
  r.scale.resize(M * G);
  r.qsum.resize(M * G);
  for (int64_t mi = 0; mi < M; ++mi)
    for (int64_t g = 0; g < G; ++g) {
      const float* xs = x + mi * K + g * QGROUP;
      float amax = 0.f;
      for (int64_t k = 0; k < QGROUP; ++k) amax = std::fmax(amax, std::fabs(xs[k]));
      const float s = amax / 127.f;
      const float inv = s > 0.f ? 1.f / s : 0.f;
      int32_t sum = 0;
      int8_t* qo = r.q.data() + mi * K + g * QGROUP;
      for (int64_t k = 0; k < QGROUP; ++k) {
        const int32_t v = static_cast<int32_t>(std::nearbyint(xs[k] * inv));
        qo[k] = static_cast<int8_t>(v);
        sum += v;
      }
      r.scale[mi * G + g] = s;
      r.qsum[mi * G + g] = s * static_cast<float>(sum);
    }
  return r;
}

#if MEMSPEC_QGEMM

template <int M>
void q4_tiles(const QuantRows& xr, const PackedQ4& w, float* y, int64_t row0, int64_t ldy,
              int64_t t0, int64_t t1) {
  const int64_t K = w.K, G = K / QGROUP, C = K / 4;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const uint8_t* nib = w.nib.data_ptr<uint8_t>();
  const at::Half* dp = w.d.data_ptr<at::Half>();
  const at::Half* mp = w.m.data_ptr<at::Half>();
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
      for (int64_t c = g * 8; c < g * 8 + 8; ++c) {
        const __m256i p = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + c * 32));
        const __m256i lo = _mm256_and_si256(p, low4);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(p, 4), low4);
        const __m512i wq = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
        for (int mi = 0; mi < M; ++mi)
          dot[mi] = _mm512_dpbusd_epi32(dot[mi], wq, _mm512_set1_epi32(xq[mi * C + c]));
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
void q8_tiles(const std::vector<uint8_t>& xu, const QuantRows& xr, const PackedQ8& w, float* y,
              int64_t row0, int64_t ldy, int64_t t0, int64_t t1) {
  const int64_t K = w.K, G = K / QGROUP, C = K / 4;
  const int8_t* wp = w.w.data_ptr<int8_t>();
  const at::Half* dp = w.d.data_ptr<at::Half>();
  const float* cp = w.c.data_ptr<float>();
  const int32_t* xq = reinterpret_cast<const int32_t*>(xu.data()) + row0 * C;
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
        const __m512i wq = _mm512_loadu_si512(tile + c * 64);
        for (int mi = 0; mi < M; ++mi)  // (xq + 128) unsigned times w signed
          dot[mi] = _mm512_dpbusd_epi32(dot[mi], _mm512_set1_epi32(xq[mi * C + c]), wq);
      }
      for (int mi = 0; mi < M; ++mi) {
        const __m512 part = _mm512_fmsub_ps(_mm512_cvtepi32_ps(dot[mi]), dv, cv);
        acc[mi] = _mm512_fmadd_ps(part, _mm512_set1_ps(xs[mi * G + g]), acc[mi]);
      }
    }
    for (int mi = 0; mi < M; ++mi) _mm512_storeu_ps(y + (row0 + mi) * ldy + t * QTILE, acc[mi]);
  }
}

template <typename F>
void over_rows(int64_t M, int64_t tiles, F&& run) {
  // rows in blocks of up to 8 (one weight pass each), tiles split across threads
  for (int64_t r0 = 0; r0 < M; r0 += QMAXROWS) {
    const int64_t rows = std::min<int64_t>(QMAXROWS, M - r0);
    at::parallel_for(0, tiles, 4, [&](int64_t t0, int64_t t1) { run(r0, rows, t0, t1); });
  }
}

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

#endif

}  // namespace

at::Tensor gemm_q4(const at::Tensor& x_in, const PackedQ4& w) {
  at::Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t M = x.size(0);
  TORCH_CHECK(x.size(1) == w.K, "q4 gemm: input width ", x.size(1), " != ", w.K);
  at::Tensor y = at::empty({M, w.N}, x.options());
#if MEMSPEC_QGEMM
  const QuantRows xr = quantize_rows(x.data_ptr<float>(), M, w.K);
  float* yp = y.data_ptr<float>();
  over_rows(M, w.N / QTILE, [&](int64_t r0, int64_t rows, int64_t t0, int64_t t1) {
#define MEMSPEC_Q4(R) q4_tiles<R>(xr, w, yp, r0, w.N, t0, t1)
    MEMSPEC_ROWS_SWITCH(rows, MEMSPEC_Q4)
#undef MEMSPEC_Q4
  });
#else
  TORCH_CHECK(false, "q4 kernels need AVX-512 VNNI");
#endif
  return y;
}

at::Tensor gemm_q8(const at::Tensor& x_in, const PackedQ8& w) {
  at::Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t M = x.size(0);
  TORCH_CHECK(x.size(1) == w.K, "q8 gemm: input width ", x.size(1), " != ", w.K);
  at::Tensor y = at::empty({M, w.N}, x.options());
#if MEMSPEC_QGEMM
  const QuantRows xr = quantize_rows(x.data_ptr<float>(), M, w.K);
  std::vector<uint8_t> xu(xr.q.size());
  for (size_t i = 0; i < xu.size(); ++i) xu[i] = static_cast<uint8_t>(xr.q[i] + 128);
  float* yp = y.data_ptr<float>();
  over_rows(M, w.N / QTILE, [&](int64_t r0, int64_t rows, int64_t t0, int64_t t1) {
#define MEMSPEC_Q8(R) q8_tiles<R>(xu, xr, w, yp, r0, w.N, t0, t1)
    MEMSPEC_ROWS_SWITCH(rows, MEMSPEC_Q8)
#undef MEMSPEC_Q8
  });
#else
  TORCH_CHECK(false, "q8 kernels need AVX-512 VNNI");
#endif
  return y;
}

at::Tensor gemm_bf16(const at::Tensor& x_in, const at::Tensor& w) {
  at::Tensor x = x_in.to(at::kBFloat16).contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.is_contiguous() && w.size(1) == K &&
                  K % 32 == 0, "bf16 gemm: weights must be contiguous bf16 [N, K], K % 32 == 0");
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
#if MEMSPEC_BF16
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  float* yp = y.data_ptr<float>();
  for (int64_t r0 = 0; r0 < M; r0 += QMAXROWS) {
    const int64_t rows = std::min<int64_t>(QMAXROWS, M - r0);
    at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
      for (int64_t n = n0; n < n1; ++n) {
        __m512 acc[QMAXROWS];
        for (int64_t mi = 0; mi < rows; ++mi) acc[mi] = _mm512_setzero_ps();
        const uint16_t* wr = wp + n * K;
        for (int64_t k = 0; k < K; k += 32) {
          const __m512bh wv = (__m512bh)_mm512_loadu_si512(wr + k);
          for (int64_t mi = 0; mi < rows; ++mi) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(xp + (r0 + mi) * K + k);
            acc[mi] = _mm512_dpbf16_ps(acc[mi], xv, wv);
          }
        }
        for (int64_t mi = 0; mi < rows; ++mi) yp[(r0 + mi) * N + n] = _mm512_reduce_add_ps(acc[mi]);
      }
    });
  }
#else
  TORCH_CHECK(false, "bf16 gemm needs AVX-512 BF16");
#endif
  return y;
}

}  // namespace memspec
