// The lean Llama-family forward for CPUs, as one C++ call per forward.
//
// Why C++: at batch 1 a decode step on a CPU is a pass over the weights (the matmuls,
// done by the block kernels of qgemm.cpp) plus ~50 small operators per layer
// (norms, rotary, cache writes, attention, SiLU). From Python each of those costs a few
// microseconds of dispatch; over 30 layers that is as much time as the weights. Here the
// small operators are plain loops over fp32, and each query row is computed alone with a
// fixed order of operations, so a token's logits do not depend on how many tokens were
// batched with it (a verify of gamma+1 tokens agrees bit for bit with single steps).
//
// Layout: residual stream and every matmul's input and output fp32 [T, hidden] (the
// kernels round rows themselves where their format needs it); K caches fp32 in blocks of
// 16 keys, V caches fp32 [kv_heads, capacity, head_dim] per layer; rotary in the
// half-split layout of HF Llama. Built once per kernel path (native.py); the loops here are
// plain C++ that the compiler vectorises for that path.

#include <torch/extension.h>

#include "qgemm.h"

#if defined(__linux__)
#include <sys/mman.h>
#endif
#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

namespace {

constexpr int64_t KB = 16;  // keys per K-cache block (one AVX-512 register of fp32)
constexpr int64_t QR = 3;   // queries scored together in attention (one KV group of SmolLM2)

struct Lin {
  int64_t kind = 0;
  // 0 dense (BLAS), 2 int4 (PyTorch kernel), 3 q4 / 4 q8 (block kernels), 5 bf16 / fp16
  // weights (qgemm.h); a spec of kind 6 (q8 packed before: q8blocks.py) runs as kind 4, one
  // of kind 7 (q4 packed before: q4blocks.py) as kind 3. Every kind takes fp32 rows and
  // returns fp32 rows; the kinds that run someone else's kernel cast to and from the dtype
  // that kernel needs.
  at::Tensor w, aux, bias;
  memspec::PackedQ4 q4;
  memspec::PackedQ8 q8;
  // a join's parts (joined) until to_huge_pages writes them side by side into its block:
  // concatenated first, they took a copy of their own in fresh memory (~70 MB of the target)
  std::vector<Lin> parts;

  int64_t pad_rows = 0;  // dense: run up to this many rows as exactly this many (see below)

  at::Tensor operator()(const at::Tensor& x) const {
    at::Tensor y;
    switch (kind) {
      case 0: return dense(x);
      case 2: y = at::_weight_int4pack_mm_for_cpu(x.to(aux.scalar_type()), w, memspec::QGROUP, aux)
                      .to(at::kFloat); break;
      case 3: y = memspec::gemm_q4(x, q4); break;
      case 4: y = memspec::gemm_q8(x, q8); break;
      case 5: y = memspec::gemm_f16w(x, w); break;
      default: TORCH_CHECK(false, "unknown weight format ", kind);
    }
    if (bias.defined()) y.add_(bias.to(at::kFloat));
    return y;
  }

  // Dense BLAS kernels pick their blocking by the number of rows, so a row's result can
  // differ between a 1-row step and a 5-row verify; padded to a fixed row count, the same
  // kernel runs for both and every row comes out the same bit for bit. (Larger calls, e.g.
  // prefill chunks, are not padded: a runner with dense layers does not chunk.)
  at::Tensor dense(const at::Tensor& x_in) const {
    const at::Tensor x = x_in.to(w.scalar_type());
    const int64_t M = x.size(0);
    if (pad_rows <= M)
      return (bias.defined() ? at::linear(x, w, bias) : at::linear(x, w)).to(at::kFloat);
    at::Tensor xp = at::zeros({pad_rows, x.size(1)}, x.options());
    xp.slice(0, 0, M).copy_(x);
    at::Tensor y = bias.defined() ? at::linear(xp, w, bias) : at::linear(xp, w);
    return y.slice(0, 0, M).to(at::kFloat);
  }
};

Lin make_lin(const py::tuple& t) {
  Lin l;
  l.kind = t[0].cast<int64_t>();
  auto tensor = [&](int i) { return t[i].is_none() ? at::Tensor() : t[i].cast<at::Tensor>(); };
  if (!t[4].is_none()) l.bias = t[4].cast<at::Tensor>();
  if (l.kind == 3) {
    l.q4 = memspec::pack_q4(tensor(1), tensor(2), tensor(3));
  } else if (l.kind == 4) {
    l.q8 = memspec::pack_q8(tensor(1), tensor(2));
  } else if (l.kind == 6) {  // Q8_0 already packed (a head file's arrays): views, no copy
    const py::tuple cs = t[3].cast<py::tuple>();
    l.kind = 4;
    l.q8 = memspec::packed_q8(tensor(1), tensor(2), cs[0].cast<at::Tensor>(),
                              cs[1].cast<at::Tensor>());
  } else if (l.kind == 7) {  // Q4_1 already packed (a head file's arrays): views, no copy
    l.kind = 3;
    l.q4 = memspec::packed_q4(tensor(1), tensor(2), tensor(3));
  } else {
    l.w = tensor(1);
    l.aux = tensor(2);
  }
  return l;
}

// a packed Lin's arrays, in one order per format
std::vector<at::Tensor*> packed_arrays(Lin& l) {
  if (l.kind == 3) return {&l.q4.nib, &l.q4.d, &l.q4.m};
  if (l.kind == 4) return {&l.q8.w, &l.q8.d, &l.q8.c, &l.q8.s};
  return {};
}

// a join's parts concatenated where no block takes them: their rows in turn
void concat_parts(Lin& l) {
  if (l.parts.empty()) return;
  const auto arrays = packed_arrays(l);
  for (size_t f = 0; f < arrays.size(); ++f) {
    std::vector<at::Tensor> ps;
    for (auto& p : l.parts) ps.push_back(*packed_arrays(p)[f]);
    *arrays[f] = at::cat(ps, 0);
  }
  l.parts.clear();
}

// The target's packed weights moved into one 2 MB-aligned block, advised as huge pages
// where the kernel takes the advice (Linux THP in "madvise" mode, a common default): a
// decode step streams all ~70 MB of them, and on 4 KiB pages every page is a TLB miss and a
// boundary the hardware prefetchers stop at. Same bytes, other addresses: the same bits.
// A join's parts are written one after another into its place, which is their concatenation.
// `arena`: a block faulted in beforehand (forward/arena.py), taken when it is exactly the
// size needed and aligned. Returns the block's size (0: nothing moved).
size_t to_huge_pages(std::vector<Lin*> lins, const at::Tensor& arena = at::Tensor()) {
  constexpr size_t HUGE = size_t(2) << 20, ALIGN = 64;
  struct Dest {
    at::Tensor* t;
    std::vector<at::Tensor> src;  // one array, or the parts' arrays in turn
    std::vector<int64_t> sizes;
    size_t bytes = 0;
  };
  std::vector<Dest> dests;
  bool movable = true;
  for (Lin* l : lins) {
    const auto arrays = packed_arrays(*l);
    for (size_t f = 0; f < arrays.size() && movable; ++f) {
      Dest d{arrays[f], {}, {}, 0};
      if (l->parts.empty()) d.src.push_back(*arrays[f]);
      for (auto& p : l->parts) d.src.push_back(*packed_arrays(p)[f]);
      int64_t rows = 0;
      for (const auto& t : d.src) {
        movable = movable && t.defined() && t.is_contiguous() && t.device().type() == at::kCPU;
        if (!movable) break;
        rows += t.size(0);
        d.bytes += t.nbytes();
      }
      if (!movable) break;
      d.sizes = d.src[0].sizes().vec();
      d.sizes[0] = rows;
      dests.push_back(std::move(d));
    }
  }
  auto padded = [&](size_t n) { return (n + ALIGN - 1) / ALIGN * ALIGN; };
  size_t total = 0;
  for (const auto& d : dests) total += padded(d.bytes);
  const size_t size = (total + HUGE - 1) / HUGE * HUGE;
  const bool faulted = arena.defined() && arena.is_contiguous() &&
                       arena.device().type() == at::kCPU &&
                       static_cast<size_t>(arena.nbytes()) == size &&
                       reinterpret_cast<uintptr_t>(arena.data_ptr()) % HUGE == 0;
  std::shared_ptr<void> block;
  if (movable && total >= HUGE && faulted) {
    block = std::shared_ptr<void>(arena.data_ptr(), [arena](void*) {});  // kept by the weights
  } else if (movable && total >= HUGE) {
    if (void* fresh = std::aligned_alloc(HUGE, size)) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
      madvise(fresh, size, MADV_HUGEPAGE);  // advice: refused or ignored: 4 KiB pages
#endif
      block = std::shared_ptr<void>(fresh, std::free);
    }
  }
  if (!block) {  // keep them where they are
    for (Lin* l : lins) concat_parts(*l);
    return 0;
  }
  void* base = block.get();
  char* dst = static_cast<char*>(base);
  for (auto& d : dests) {
    at::Tensor moved = at::from_blob(dst, d.sizes, [block](void*) {}, d.src[0].options());
    int64_t row = 0;
    for (const auto& t : d.src) {
      moved.slice(0, row, row + t.size(0)).copy_(t);
      row += t.size(0);
    }
    *d.t = moved;
    dst += padded(d.bytes);
  }
  for (Lin* l : lins) l->parts.clear();
#if defined(__GLIBC__)
  malloc_trim(0);  // the old copies' pages back to the system, not kept in the heap
#endif
  return size;
}

// Projections that read the same rows (q, k, v; gate, up) as one block-kernel matmul: their
// tiles concatenated, which is the same arithmetic per output, so the same bits. The rows
// are quantised once instead of once per projection, and one split across threads covers
// all outputs (k and v alone are 12 tiles each). Only our own packed copies are joined; a
// draft head's weights stay views of its slot. The arrays are not written here: the caller
// passes the join to to_huge_pages, which places them (concat_parts where it cannot).
std::vector<Lin> joined(std::vector<Lin> lins) {
  if (lins.size() < 2) return lins;
  const int64_t kind = lins[0].kind;
  const bool bias = lins[0].bias.defined();
  for (const auto& l : lins) {
    const int64_t K = kind == 3 ? l.q4.K : l.q8.K;
    if ((kind != 3 && kind != 4) || l.kind != kind || l.bias.defined() != bias ||
        K != (kind == 3 ? lins[0].q4.K : lins[0].q8.K))
      return lins;
  }
  auto cat = [&](auto field) {
    std::vector<at::Tensor> parts;
    for (const auto& l : lins) parts.push_back(field(l));
    return at::cat(parts, 0);
  };
  Lin j;
  j.kind = kind;
  if (bias) j.bias = cat([](const Lin& l) { return l.bias.to(at::kFloat); });
  if (kind == 3) {
    j.q4.K = lins[0].q4.K;
    for (const auto& l : lins) j.q4.N += l.q4.N;
  } else {
    j.q8.K = lins[0].q8.K;
    for (const auto& l : lins) j.q8.N += l.q8.N;
  }
  j.parts = std::move(lins);  // written side by side by to_huge_pages (or concat_parts)
  return {j};
}

struct Layer {
  at::Tensor ln1, ln2;  // fp32
  std::vector<Lin> qkv, gate_up;
  Lin o, down;
};

template <typename T>
inline float f32(T v) { return static_cast<float>(v); }

// exp for softmax and SiLU: range reduction to 2^k * e^r and a degree-6 polynomial (relative
// error ~2e-7), written so the compiler vectorises it; libm's expf is a scalar call, and
// with ~250k of them per decode step it would cost more than the attention arithmetic.
// GCC vectorises it only with -fno-trapping-math (native.py): under the default it keeps
// the clamp's selects as branches and floorf scalar, so these loops ran one lane at a time
// (AVX2 Zen 3: ~30% of attention's samples).
inline float fexp(float x) {
  x = x < -87.f ? -87.f : (x > 88.f ? 88.f : x);
  const float k = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - k * 0.693145751953125f - k * 1.428606765330187e-06f;
  float p = 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// out[r, :] = act(x[r, :] * rsqrt(mean(x^2) + eps) * w)
template <typename S>
void rmsnorm(const float* x, const float* w, S* out, int64_t rows, int64_t n, float eps,
             int64_t out_stride) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * n;
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < n; ++i) ss += xr[i] * xr[i];
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
    S* o = out + r * out_stride;
    for (int64_t i = 0; i < n; ++i) o[i] = static_cast<S>(xr[i] * inv * w[i]);
  }
}

// Dimensions and the per-layer kernels shared by the target model and draft heads.
class Core {
 public:
  Core(py::tuple dims, double rope_theta) {
    hidden_ = dims[0].cast<int64_t>();
    heads_ = dims[1].cast<int64_t>();
    kvh_ = dims[2].cast<int64_t>();
    hd_ = dims[3].cast<int64_t>();
    inter_ = dims[4].cast<int64_t>();
    eps_ = dims[5].cast<double>();
    const int64_t half = hd_ / 2;
    inv_freq_.resize(half);
    for (int64_t i = 0; i < half; ++i)
      inv_freq_[i] = static_cast<float>(1.0 / std::pow(rope_theta, static_cast<double>(i) / half));
  }

 protected:
  void check_cache(const at::Tensor& vc, int64_t pos, int64_t T) {
    TORCH_CHECK(pos + T <= vc.size(1), "context exceeds the KV cache");
    TORCH_CHECK(vc.size(1) % KB == 0, "KV cache capacity must be a multiple of 16");
  }

  void rope_tables(int64_t pos, int64_t T, std::vector<float>& cosv, std::vector<float>& sinv) {
    const int64_t half = hd_ / 2;
    cosv.resize(T * half);
    sinv.resize(T * half);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t i = 0; i < half; ++i) {
        const float a = static_cast<float>(pos + t) * inv_freq_[i];
        cosv[t * half + i] = std::cos(a);
        sinv[t * half + i] = std::sin(a);
      }
  }

  // One decoder layer after its input norm: attention over the cache (K/V of positions
  // pos.. written), residual into x (fp32 [T, hidden]), then the MLP block.
  void layer_body(at::Tensor& x, const at::Tensor& a_in, const std::vector<Lin>& qkv_lins,
                  const Lin& o, const at::Tensor& ln2, const std::vector<Lin>& gate_up,
                  const Lin& down, const at::Tensor& kc, const at::Tensor& vc, int64_t pos,
                  const std::vector<float>& cosv, const std::vector<float>& sinv) {
    const int64_t T = x.size(0);
    auto opts = at::TensorOptions().dtype(at::kFloat);
    at::Tensor q = at::empty({T, heads_ * hd_}, opts);
    at::Tensor att = at::empty({T, heads_ * hd_}, opts.dtype(act_));
    at::Tensor h = at::empty({T, hidden_}, opts.dtype(act_));
    at::Tensor mid = at::empty({T, inter_}, opts.dtype(act_));
    at::Tensor qkv = project(qkv_lins, a_in);
    rope_and_cache(qkv, q, kc, vc, pos, T, cosv, sinv);
    attend(q, kc, vc, att, pos, T);
    add_into(x, o(att));
    norm_into(x, ln2, h);
    at::Tensor gu = project(gate_up, h);
    silu_mul(gu, mid, T);
    add_into(x, down(mid));
  }

  // final norm + an LM head over residual rows (fp32)
  at::Tensor head_logits(const at::Tensor& x, const at::Tensor& norm, const Lin& lm) {
    at::Tensor hn = at::empty({x.size(0), hidden_}, x.options().dtype(act_));
    norm_into(x, norm, hn);
    return lm(hn);
  }

  at::Tensor project(const std::vector<Lin>& lins, const at::Tensor& h) {
    if (lins.size() == 1) return lins[0](h).contiguous();
    std::vector<at::Tensor> parts;
    for (const auto& l : lins) parts.push_back(l(h));
    return at::cat(parts, 1);
  }

  // rows of x (fp32 [R, hidden]) normalised into out (activation dtype), whose rows may be
  // wider than hidden (a draft head writes two halves of one input row)
  void norm_into(const at::Tensor& x, const at::Tensor& w, at::Tensor& out) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "rmsnorm", [&] {
      rmsnorm<scalar_t>(x.data_ptr<float>(), w.data_ptr<float>(), out.data_ptr<scalar_t>(),
                        x.size(0), hidden_, static_cast<float>(eps_), out.stride(0));
    });
  }

  void add_into(at::Tensor& x, const at::Tensor& y) {
    at::Tensor yc = y.contiguous();
    float* xp = x.data_ptr<float>();
    const int64_t n = x.numel();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, yc.scalar_type(), "add", [&] {
      const scalar_t* yp = yc.data_ptr<scalar_t>();
      for (int64_t i = 0; i < n; ++i) xp[i] += f32(yp[i]);
    });
  }

  void silu_mul(const at::Tensor& gu, at::Tensor& out, int64_t T) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gu.scalar_type(), "silu", [&] {
      const scalar_t* g = gu.data_ptr<scalar_t>();
      scalar_t* o = out.data_ptr<scalar_t>();
      for (int64_t t = 0; t < T; ++t) {
        const scalar_t* gr = g + t * 2 * inter_;
        const scalar_t* ur = gr + inter_;
        scalar_t* orow = o + t * inter_;
        _Pragma("omp simd")
        for (int64_t i = 0; i < inter_; ++i) {
          const float a = f32(gr[i]);
          orow[i] = static_cast<scalar_t>(a / (1.f + fexp(-a)) * f32(ur[i]));
        }
      }
    });
  }

  // q (fp32, rotated, pre-scaled by 1/sqrt(hd)) out of the fused projection; rotated k and
  // v written into the fp32 caches at positions pos..pos+T-1.
  void rope_and_cache(const at::Tensor& qkv, at::Tensor& q, const at::Tensor& kc,
                      const at::Tensor& vc, int64_t pos, int64_t T,
                      const std::vector<float>& cosv, const std::vector<float>& sinv) {
    const int64_t half = hd_ / 2, nq = heads_ * hd_, nk = kvh_ * hd_, width = qkv.size(1);
    const int64_t cap = vc.size(1);
    const float scale = 1.f / std::sqrt(static_cast<float>(hd_));
    float* qp = q.data_ptr<float>();
    float* kp = kc.data_ptr<float>();  // [kvh, cap / KB, hd, KB]
    float* vp = vc.data_ptr<float>();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rope", [&] {
      const scalar_t* src = qkv.data_ptr<scalar_t>();
      for (int64_t t = 0; t < T; ++t) {
        const float* c = cosv.data() + t * half;
        const float* s = sinv.data() + t * half;
        const scalar_t* row = src + t * width;
        for (int64_t h = 0; h < heads_; ++h) {
          const scalar_t* x = row + h * hd_;
          float* o = qp + t * nq + h * hd_;
          for (int64_t i = 0; i < half; ++i) {
            const float x1 = f32(x[i]), x2 = f32(x[i + half]);
            o[i] = (x1 * c[i] - x2 * s[i]) * scale;
            o[i + half] = (x2 * c[i] + x1 * s[i]) * scale;
          }
        }
        for (int64_t h = 0; h < kvh_; ++h) {
          const scalar_t* x = row + nq + h * hd_;
          const scalar_t* v = row + nq + nk + h * hd_;
          const int64_t l = pos + t;  // lane l % KB of key block l / KB
          float* ko = kp + ((h * (cap / KB) + l / KB) * hd_) * KB + l % KB;
          float* vo = vp + (h * cap + l) * hd_;
          for (int64_t i = 0; i < half; ++i) {
            const float x1 = f32(x[i]), x2 = f32(x[i + half]);
            ko[i * KB] = x1 * c[i] - x2 * s[i];
            ko[(i + half) * KB] = x2 * c[i] + x1 * s[i];
          }
          for (int64_t i = 0; i < hd_; ++i) vo[i] = f32(v[i]);
        }
      }
    });
  }

  // Scores of U queries against B consecutive K blocks of KB keys each, into their rows of
  // sc (row stride n_pad): U * B independent FMA chains hide the FMA latency, and every
  // key's score is its own chain over d in order, whatever U and B are.
  template <int64_t U, int64_t B>
  static void score_blocks(const float* const* q, const float* blk, int64_t hd, float* sc,
                           int64_t n_pad, int64_t l0) {
    float s[U][B * KB] = {};
    for (int64_t d = 0; d < hd; ++d) {
      for (int64_t u = 0; u < U; ++u) {
        const float qd = q[u][d];
        for (int64_t b = 0; b < B; ++b) {
          const float* k = blk + (b * hd + d) * KB;
#pragma omp simd
          for (int64_t i = 0; i < KB; ++i) s[u][b * KB + i] += qd * k[i];
        }
      }
    }
    for (int64_t u = 0; u < U; ++u) std::copy(s[u], s[u] + B * KB, sc + u * n_pad + l0);
  }

  // the g queries of one token against keys [0, n_pad): two blocks at a time, QR queries
  template <int64_t U>
  static void score_rows(const float* const* q, const float* kb, int64_t hd, float* sc,
                         int64_t n_pad) {
    int64_t l0 = 0;
    for (; l0 + 2 * KB <= n_pad; l0 += 2 * KB)
      score_blocks<U, 2>(q, kb + l0 * hd, hd, sc, n_pad, l0);
    for (; l0 < n_pad; l0 += KB) score_blocks<U, 1>(q, kb + l0 * hd, hd, sc, n_pad, l0);
  }

  // acc[u] = sum over keys l < n of p[u][l] * v[l], in key order per output; HD known at
  // compile time keeps the U accumulators in registers
  template <int64_t U, int64_t HD>
  static void weigh_values(const float* sc, int64_t n_pad, const float* vb, int64_t n,
                           float* acc, int64_t hd_stride) {
    float a[U][HD] = {};
    for (int64_t l = 0; l < n; ++l) {
      const float* vr = vb + l * HD;
      for (int64_t u = 0; u < U; ++u) {
        const float p = sc[u * n_pad + l];
#pragma omp simd
        for (int64_t d = 0; d < HD; ++d) a[u][d] += p * vr[d];
      }
    }
    for (int64_t u = 0; u < U; ++u) std::copy(a[u], a[u] + HD, acc + u * hd_stride);
  }

  static void weigh_values_any(const float* sc, int64_t n_pad, const float* vb, int64_t n,
                               float* a, int64_t hd) {
    std::fill(a, a + hd, 0.f);
    for (int64_t l = 0; l < n; ++l) {
      const float p = sc[l];
      const float* vr = vb + l * hd;
#pragma omp simd
      for (int64_t d = 0; d < hd; ++d) a[d] += p * vr[d];
    }
  }

  // Causal GQA attention over fp32 caches: K is stored in blocks of KB keys, each block
  // [hd, KB] contiguous, so scores for KB consecutive keys are KB lanes of one FMA chain
  // over 4 KB read in order (a plain [hd, capacity] layout strides by the capacity and
  // thrashes L1), and V row-major so the weighted sum is a broadcast FMA; neither needs a
  // horizontal reduction. Work is split into (KV head, token) pairs, so a verify of 5 tokens
  // keeps both cores busy (3 KV heads alone split 2:1), and each task scores its token's
  // queries of the group against the keys that token may see. Each query's own arithmetic
  // (dot products in d order, its softmax, its sum in key order) is the same whatever T is
  // and however the tasks fall on threads.
  void attend(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, at::Tensor& out,
              int64_t pos, int64_t T) {
    const int64_t g = heads_ / kvh_, cap = vc.size(1), hd = hd_, nq = heads_ * hd_;
    const int64_t n_pad_max = (pos + T + KB - 1) / KB * KB;
    const float* qp = q.data_ptr<float>();
    const float* kp = kc.data_ptr<float>();
    const float* vp = vc.data_ptr<float>();
    float* op = out.data_ptr<float>();
    memspec::parallel_chunks(kvh_ * T, 1, [&](int64_t a0, int64_t a1) {
      std::vector<float> sc(g * n_pad_max), acc(g * hd);
      std::vector<const float*> qr(g);
      for (int64_t task = a0; task < a1; ++task) {
        const int64_t j = task / T, t = task % T;
        const int64_t n = pos + t + 1, n_pad = (n + KB - 1) / KB * KB;
        for (int64_t i = 0; i < g; ++i) qr[i] = qp + t * nq + (j * g + i) * hd;
        const float* kb = kp + j * cap * hd;  // [cap / KB, hd, KB]
        const float* vb = vp + j * cap * hd;  // [cap, hd]
        int64_t r = 0;
        for (; r + QR <= g; r += QR) score_rows<QR>(&qr[r], kb, hd, &sc[r * n_pad], n_pad);
        for (; r < g; ++r) score_rows<1>(&qr[r], kb, hd, &sc[r * n_pad], n_pad);
        for (int64_t r = 0; r < g; ++r) {
          float* sr = sc.data() + r * n_pad;
          float mx = -INFINITY;  // a max is exact in any order
#pragma omp simd reduction(max : mx)
          for (int64_t l = 0; l < n; ++l) mx = sr[l] > mx ? sr[l] : mx;
#pragma omp simd
          for (int64_t l = 0; l < n; ++l) sr[l] = fexp(sr[l] - mx);
          float sum = 0.f;
#pragma omp simd reduction(+ : sum)
          for (int64_t l = 0; l < n; ++l) sum += sr[l];
          const float inv = 1.f / sum;
#pragma omp simd
          for (int64_t l = 0; l < n; ++l) sr[l] *= inv;
        }
        r = 0;
        if (hd == 64)
          for (; r + QR <= g; r += QR)
            weigh_values<QR, 64>(&sc[r * n_pad], n_pad, vb, n, &acc[r * hd], hd);
        for (; r < g; ++r) weigh_values_any(&sc[r * n_pad], n_pad, vb, n, &acc[r * hd], hd);
        for (int64_t i = 0; i < g; ++i)
          std::copy(acc.begin() + i * hd, acc.begin() + (i + 1) * hd,
                    op + t * nq + (j * g + i) * hd);
      }
    });
  }

  int64_t hidden_ = 0, heads_ = 0, kvh_ = 0, hd_ = 0, inter_ = 0;
  double eps_ = 1e-6;
  at::ScalarType act_ = at::kFloat;  // every kernel takes and gives fp32 rows
  std::vector<float> inv_freq_;
};

class Model : public Core {
 public:
  // `embed` None: the embedding is the LM head's own rows (tied, Q8_0 blocks), read from
  // the one packed copy the head's kernels read, not from a second plain copy
  Model(py::tuple dims, py::object embed, py::object embed_scale, py::list layers,
        at::Tensor norm, py::tuple head, double rope_theta, py::object arena)
      : Core(dims, rope_theta), norm_(norm.to(at::kFloat).contiguous()), head_(make_lin(head)) {
    if (!embed.is_none()) embed_ = embed.cast<at::Tensor>();
    if (!embed_scale.is_none()) embed_scale_ = embed_scale.cast<at::Tensor>().to(at::kFloat);
    for (auto item : layers) {
      auto t = item.cast<py::tuple>();
      Layer L;
      L.ln1 = t[0].cast<at::Tensor>().to(at::kFloat).contiguous();
      L.ln2 = t[1].cast<at::Tensor>().to(at::kFloat).contiguous();
      for (auto q : t[2].cast<py::list>()) L.qkv.push_back(make_lin(q.cast<py::tuple>()));
      L.o = make_lin(t[3].cast<py::tuple>());
      for (auto q : t[4].cast<py::list>()) L.gate_up.push_back(make_lin(q.cast<py::tuple>()));
      L.qkv = joined(std::move(L.qkv));
      L.gate_up = joined(std::move(L.gate_up));
      L.down = make_lin(t[5].cast<py::tuple>());
      layers_.push_back(std::move(L));
    }
    std::vector<Lin*> own{&head_};  // (a draft head's weights stay views of its slot)
    for (auto& L : layers_) {
      for (auto& l : L.qkv) own.push_back(&l);
      for (auto& l : L.gate_up) own.push_back(&l);
      own.push_back(&L.o);
      own.push_back(&L.down);
    }
    block_bytes_ = to_huge_pages(own, arena.is_none() ? at::Tensor() : arena.cast<at::Tensor>());
    if (embed.is_none()) {
      TORCH_CHECK(head_.kind == 4 && head_.q8.K == hidden_,
                  "an embedding read from the LM head needs its Q8_0 blocks");
      embed_ = head_.q8.w;  // int8 [N/16, K/4, 64]
      embed_scale_ = head_.q8.d;  // fp16 [N/16, K/32, 16]
      tiled_embed_ = true;
    }
  }

  // the size of the block its packed weights live in (forward/arena.py records it)
  int64_t block_bytes() const { return static_cast<int64_t>(block_bytes_); }

  // the LM head's packed arrays as the kernels hold them (w, d, c, s; Q8_0 heads only):
  // what reads its rows in Python (draft heads' vocabularies) reads this copy
  py::tuple head_parts() const {
    TORCH_CHECK(head_.kind == 4, "the LM head is not held as Q8_0 blocks");
    return py::make_tuple(head_.q8.w, head_.q8.d, head_.q8.c, head_.q8.s);
  }

  // logits [T or 1, vocab] for ids [T] at positions pos..pos+T-1. With `feat` defined
  // ([capacity, capture.size() * hidden] fp32), the residual stream after each layer in
  // `capture` is written to rows pos..pos+T-1: the features draft heads read.
  at::Tensor forward(const at::Tensor& ids, int64_t pos, const std::vector<at::Tensor>& kc,
                     const std::vector<at::Tensor>& vc, bool last_only,
                     const std::vector<int64_t>& capture, const c10::optional<at::Tensor>& feat) {
    at::NoGradGuard no_grad;
    const int64_t T = ids.numel();
    TORCH_CHECK(kc.size() == layers_.size() && vc.size() == layers_.size(),
                "one K and one V cache per layer");
    check_cache(vc[0], pos, T);
    at::Tensor x = embed(ids);  // fp32 [T, hidden]
    std::vector<float> cosv, sinv;
    rope_tables(pos, T, cosv, sinv);
    at::Tensor h = at::empty({T, hidden_}, x.options().dtype(act_));
    const bool want_feat = feat.has_value() && feat->defined() && !capture.empty();
    size_t next_cap = 0;
    for (size_t li = 0; li < layers_.size(); ++li) {
      const Layer& L = layers_[li];
      norm_into(x, L.ln1, h);
      layer_body(x, h, L.qkv, L.o, L.ln2, L.gate_up, L.down, kc[li], vc[li], pos, cosv, sinv);
      while (want_feat && next_cap < capture.size() &&
             capture[next_cap] == static_cast<int64_t>(li)) {
        feat->slice(0, pos, pos + T).slice(1, next_cap * hidden_, (next_cap + 1) * hidden_)
            .copy_(x);
        ++next_cap;
      }
    }
    return head_logits(last_only ? x.slice(0, T - 1, T).contiguous() : x, norm_, head_);
  }

  void set_pad_rows(int64_t n) {
    for (auto& L : layers_) {
      for (auto& l : L.qkv) l.pad_rows = n;
      for (auto& l : L.gate_up) l.pad_rows = n;
      L.o.pad_rows = L.down.pad_rows = n;
    }
    head_.pad_rows = n;
  }

  // token embeddings as fp32 rows (a draft head's token input)
  at::Tensor embed(const at::Tensor& ids) {
    at::NoGradGuard no_grad;
    if (tiled_embed_) return tiled_rows(ids);
    if (embed_scale_.defined() && embed_.scalar_type() == at::kChar && embed_.is_contiguous() &&
        embed_scale_.scalar_type() == at::kFloat && embed_scale_.is_contiguous() &&
        embed_scale_.size(1) * memspec::QGROUP == hidden_ && embed_.size(1) == hidden_ &&
        ids.scalar_type() == at::kLong && ids.is_contiguous()) {
      // Q8_0 rows as plain loops: the same one product per value as the tensor ops below
      // (so the same bits), without their ~7 dispatches (~25 us of a 0.2 ms head step)
      const int64_t T = ids.numel(), groups = hidden_ / memspec::QGROUP;
      at::Tensor rows = at::empty({T, hidden_}, at::TensorOptions().dtype(at::kFloat));
      const int64_t* ip = ids.data_ptr<int64_t>();
      const int8_t* wp = embed_.data_ptr<int8_t>();
      const float* sp = embed_scale_.data_ptr<float>();
      float* op = rows.data_ptr<float>();
      for (int64_t t = 0; t < T; ++t) {
        const int64_t id = ip[t];
        TORCH_CHECK(id >= 0 && id < embed_.size(0), "token id ", id, " out of range");
        const int8_t* w = wp + id * hidden_;
        const float* sc = sp + id * groups;
        float* o = op + t * hidden_;
        for (int64_t gi = 0; gi < groups; ++gi) {
          const float d = sc[gi];
#pragma omp simd
          for (int64_t i = 0; i < memspec::QGROUP; ++i)
            o[gi * memspec::QGROUP + i] = static_cast<float>(w[gi * memspec::QGROUP + i]) * d;
        }
      }
      return rows;
    }
    at::Tensor rows = embed_.index_select(0, ids).to(at::kFloat);
    if (embed_scale_.defined()) {  // Q8_0 rows: one scale per 32 values
      const int64_t T = rows.size(0);
      rows = (rows.view({T, -1, memspec::QGROUP}) *
              embed_scale_.index_select(0, ids).unsqueeze(2)).view({T, hidden_});
    }
    return rows.contiguous();
  }

 private:
  // rows `ids` of the packed LM head (value (n, k) at w[n/16][k/4][(n%16)*4 + k%4], its fp16
  // scale at d[n/16][k/32][n%16]): the same one product per value as the plain rows above
  at::Tensor tiled_rows(const at::Tensor& ids_in) const {
    const at::Tensor ids = ids_in.to(at::kLong).contiguous();
    const int64_t T = ids.numel(), groups = hidden_ / memspec::QGROUP, C = hidden_ / 4;
    const int64_t N = embed_.size(0) * memspec::QTILE;
    at::Tensor rows = at::empty({T, hidden_}, at::TensorOptions().dtype(at::kFloat));
    const int64_t* ip = ids.data_ptr<int64_t>();
    const int8_t* wp = embed_.data_ptr<int8_t>();
    const at::Half* sp = embed_scale_.data_ptr<at::Half>();
    float* op = rows.data_ptr<float>();
    for (int64_t t = 0; t < T; ++t) {
      const int64_t id = ip[t];
      TORCH_CHECK(id >= 0 && id < N, "token id ", id, " out of range");
      const int64_t tile = id / memspec::QTILE, j = id % memspec::QTILE;
      const int8_t* w = wp + tile * C * 4 * memspec::QTILE + j * 4;
      const at::Half* sc = sp + tile * groups * memspec::QTILE + j;
      float* o = op + t * hidden_;
      for (int64_t gi = 0; gi < groups; ++gi) {
        const float d = static_cast<float>(sc[gi * memspec::QTILE]);  // (exact)
        for (int64_t c = gi * (memspec::QGROUP / 4); c < (gi + 1) * (memspec::QGROUP / 4); ++c)
          for (int64_t i = 0; i < 4; ++i)
            o[c * 4 + i] = static_cast<float>(w[c * 4 * memspec::QTILE + i]) * d;
      }
    }
    return rows;
  }

  at::Tensor embed_, embed_scale_, norm_;
  bool tiled_embed_ = false;
  size_t block_bytes_ = 0;
  Lin head_;
  std::vector<Layer> layers_;
};

// An EAGLE-style draft head: one decoder layer over [norm(token embedding); norm(g)], where g
// is fc(target features) for positions the target has seen and the head's own previous
// output for its own proposals; the residual runs on g; logits come from the target's
// final norm and the target's LM-head rows of the draft vocabulary.
class Head : public Core {
 public:
  // `lm`: a weight spec tuple, or a `Linear` already built (heads of one target share its
  // packed LM-head rows: binding a head then packs nothing)
  Head(py::tuple dims, py::tuple fc, at::Tensor norm_e, at::Tensor norm_g, py::list qkv,
       py::tuple o, at::Tensor ln2, py::list gate_up, py::tuple down, at::Tensor final_norm,
       py::object lm, double rope_theta)
      : Core(dims, rope_theta), fc_(make_lin(fc)),
        norm_e_(norm_e.to(at::kFloat).contiguous()), norm_g_(norm_g.to(at::kFloat).contiguous()),
        o_(make_lin(o)), ln2_(ln2.to(at::kFloat).contiguous()), down_(make_lin(down)),
        final_norm_(final_norm.to(at::kFloat).contiguous()),
        lm_(py::isinstance<py::tuple>(lm) ? make_lin(lm.cast<py::tuple>()) : lm.cast<Lin>()) {
    for (auto q : qkv) qkv_.push_back(make_lin(q.cast<py::tuple>()));
    for (auto q : gate_up) gate_up_.push_back(make_lin(q.cast<py::tuple>()));
  }

  // forward() of the target's embeddings of `ids` (a proposal's token): one call from
  // Python per draft step
  std::tuple<at::Tensor, at::Tensor> step(Model& target, const at::Tensor& ids,
                                          const at::Tensor& g, int64_t pos,
                                          const at::Tensor& kc, const at::Tensor& vc) {
    return forward(target.embed(ids), g, pos, kc, vc, true);
  }

  at::Tensor fc(const at::Tensor& feats) {
    at::NoGradGuard no_grad;
    return fc_(feats.to(at::kFloat).contiguous()).to(at::kFloat).contiguous();
  }

  // emb, g: fp32 [T, hidden] for positions pos..pos+T-1 -> (logits of the last row or all
  // rows, the layer's output rows: the g of the next proposal)
  std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& emb, const at::Tensor& g,
                                             int64_t pos, const at::Tensor& kc,
                                             const at::Tensor& vc, bool last_only) {
    at::NoGradGuard no_grad;
    const int64_t T = emb.size(0);
    check_cache(vc, pos, T);
    std::vector<float> cosv, sinv;
    rope_tables(pos, T, cosv, sinv);
    at::Tensor e32 = emb.to(at::kFloat).contiguous();
    at::Tensor x = g.to(at::kFloat).contiguous().clone();
    at::Tensor a_in = at::empty({T, 2 * hidden_}, x.options().dtype(act_));
    at::Tensor left = a_in.slice(1, 0, hidden_), right = a_in.slice(1, hidden_, 2 * hidden_);
    norm_into(e32, norm_e_, left);
    norm_into(x, norm_g_, right);
    layer_body(x, a_in, qkv_, o_, ln2_, gate_up_, down_, kc, vc, pos, cosv, sinv);
    at::Tensor rows = last_only ? x.slice(0, T - 1, T).contiguous() : x;
    return {head_logits(rows, final_norm_, lm_), rows};
  }

 private:
  Lin fc_;
  at::Tensor norm_e_, norm_g_;
  std::vector<Lin> qkv_, gate_up_;
  Lin o_;
  at::Tensor ln2_;
  Lin down_;
  at::Tensor final_norm_;
  Lin lm_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<Model>(m, "Model")
      .def(py::init<py::tuple, py::object, py::object, py::list, at::Tensor, py::tuple, double,
                    py::object>(),
           py::arg("dims"), py::arg("embed"), py::arg("embed_scale"), py::arg("layers"),
           py::arg("norm"), py::arg("head"), py::arg("rope_theta"), py::arg("arena") = py::none())
      .def("forward", &Model::forward)
      .def("block_bytes", &Model::block_bytes)
      .def("set_pad_rows", &Model::set_pad_rows)
      .def("embed", &Model::embed)
      .def("head_parts", &Model::head_parts);
  py::class_<Head>(m, "Head")
      .def(py::init<py::tuple, py::tuple, at::Tensor, at::Tensor, py::list, py::tuple, at::Tensor,
                    py::list, py::tuple, at::Tensor, py::object, double>())
      .def("fc", &Head::fc)
      .def("forward", &Head::forward)
      .def("step", &Head::step);
  m.def("kernel_path", &memspec::k::kernel_path);
  // linears' packed weights into one huge-page block, as a Model's are (the bench's
  // bare-matmul floor times its layers the way the forward holds them)
  m.def("huge_pages", [](const py::list& lins) {
    std::vector<Lin*> v;
    for (auto o : lins) v.push_back(o.cast<Lin*>());
    to_huge_pages(v);
  });
  // every linear on its input, in order, in one call: the bare-matmul floor as the forward
  // runs its products, with no Python between them
  m.def("run_linears", [](const py::list& lins, const py::list& xs) {
    TORCH_CHECK(lins.size() == xs.size(), "run_linears: one input per linear");
    std::vector<const Lin*> ls;
    std::vector<at::Tensor> in;
    for (size_t i = 0; i < lins.size(); ++i) {
      ls.push_back(lins[i].cast<const Lin*>());
      in.push_back(xs[i].cast<at::Tensor>());
    }
    at::NoGradGuard no_grad;
    std::vector<at::Tensor> out(ls.size());
    {
      py::gil_scoped_release release;
      for (size_t i = 0; i < ls.size(); ++i) out[i] = (*ls[i])(in[i]);
    }
    return out;
  });
  m.def("bf16_native", &memspec::k::bf16_native);
  // the forward's worker pool (pool.h): its thread count (0 follows torch's), its workers'
  // thread ids for the controller's CPU accounting, and [jobs, joins, workers]
  m.def("set_threads", &memspec::pool::set_threads);
  m.def("threads", &memspec::pool::threads);
  m.def("worker_tids", &memspec::pool::worker_tids);
  m.def("pool_counters", &memspec::pool::counters);
  m.def("hold_workers", &memspec::pool::hold);
  m.def("use_openmp", &memspec::pool::set_openmp);
  // one linear layer on its own: the bare-matmul floor in `memspec bench engine`
  py::class_<Lin>(m, "Linear")
      .def(py::init([](py::tuple t) { return make_lin(t); }))
      .def("__call__", [](const Lin& l, const at::Tensor& x) {
        at::NoGradGuard no_grad;
        return l(x);
      });
}
