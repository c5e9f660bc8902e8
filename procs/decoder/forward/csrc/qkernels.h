// The block kernels themselves, in plain C++ over raw pointers (no PyTorch), so that the
// same file is built into the extension (qgemm.cpp wraps it) and into a small standalone
// check (qkernels_check.cpp) that the test suite compiles per kernel path and for aarch64.
//
// Weights times a few activation rows, for batch-1 decoding on CPUs. A decode step (1 row)
// or a verify (gamma+1 rows) reads every weight once; what it costs is the bytes read plus
// the work of turning them into numbers. These kernels decode each weight block once and
// apply it to all rows (up to 8), with integer dot products on activations quantised per
// 32-value group to int8, the scheme llama.cpp uses for its Q4_1 / Q8_0 formats:
//   q4: w = d * q + m, q in [0, 15], d and m per 32 inputs (GGUF Q4_1 blocks, exactly)
//   q8: w = d * q,     q in [-127, 127], d per 32 inputs (GGUF Q8_0 blocks, exactly)
//
// One source, one kernel path per build (the -m flags pick it, see memspec.common.isa):
//   avx512-bf16 / avx512-vnni: vpdpbusd on 16 outputs (+ vdpbf16ps for bf16 weights);
//   avx2-vnni: vpdpbusd on 8 outputs (AVX-VNNI); avx2: vpmaddubsw + vpmaddwd;
//   generic: portable C++ without intrinsics (any x86-64, aarch64, ...).
// Every path adds the same exact integers per 32-input group and then does the same float
// operations in the same order per output, so all paths give the same bits for q4 and q8.
// Every row is computed on its own in a fixed order, so results do not depend on how many
// rows were passed either: a 5-row verify agrees bit for bit with five 1-row steps.
#pragma once

#include <cstdint>
#include <vector>

namespace memspec {
namespace k {

constexpr int64_t QGROUP = 32;  // inputs per scale
constexpr int64_t QTILE = 16;   // outputs per tile (one AVX-512 register of fp32, two AVX2)
constexpr int64_t QMAXROWS = 8;

// "avx512-bf16", "avx512-vnni", "avx2-vnni", "avx2" or "generic": what this build runs
const char* kernel_path();
bool bf16_native();  // bf16 dot products in hardware: bf16 weights take bf16-rounded rows

float half_to_float(uint16_t h);

// Packed layouts (T = N / 16 tiles, G = K / 32 groups, C = K / 4):
//   q4 nib uint8 [T, K/8, 64]: byte 4j+i of pair e holds output j's input 8e+i (low
//      nibble) and 8e+4+i (high nibble): one 64-byte load feeds two 4-input steps of 16
//      outputs on AVX-512, 32 bytes two steps of 8 on AVX2;  d, m fp16 bits [T, G, 16]
//   q8 w int8 [T, C, 64]: 16 outputs x 4 inputs;  d fp16 bits [T, G, 16];
//      c fp32 [T, G, 16] = (d * sum(q)) * 128;  s int32 [T, G, 16] = 128 * sum(q)
struct Q4 {
  const uint8_t* nib;
  const uint16_t* d;
  const uint16_t* m;
  int64_t N, K;
};
struct Q8 {
  const int8_t* w;
  const uint16_t* d;
  const float* c;
  const int32_t* s;
  int64_t N, K;
};

// q [N, K] in [0, 15] -> nib; d, m [N, K/32] -> tiled [T, G, 16]
void pack_q4(const uint8_t* q, const uint16_t* d, const uint16_t* m, int64_t N, int64_t K,
             uint8_t* nib, uint16_t* d_out, uint16_t* m_out);
// q [N, K] in [-127, 127], d [N, K/32] fp16 bits -> w, d, c, s tiled
void pack_q8(const int8_t* q, const uint16_t* d, int64_t N, int64_t K, int8_t* w,
             uint16_t* d_out, float* c_out, int32_t* s_out);

// Each row, each group of 32: xq = round(x / s) in [-127, 127] with s = max|x| / 127.
struct QuantRows {
  std::vector<int8_t> q;     // [M, K]
  std::vector<uint8_t> u;    // [M, K]: q + 128 (the unsigned operand of vpdpbusd for q8)
  std::vector<float> scale;  // [M, K/32]
  std::vector<float> qsum;   // [M, K/32]: scale * sum(xq), for the q4 offset term
};
QuantRows quantize_rows(const float* x, int64_t M, int64_t K, bool for_q8);
// the portable reference of the same (q, scale, qsum), for the checks
QuantRows quantize_rows_scalar(const float* x, int64_t M, int64_t K);

// y[row0 + r, t*16 .. t*16+15] for r < rows (<= 8) and tiles t in [t0, t1); ldy = N
void q4_tiles(const QuantRows& xr, const Q4& w, float* y, int64_t row0, int64_t rows,
              int64_t t0, int64_t t1);
void q8_tiles(const QuantRows& xr, const Q8& w, float* y, int64_t row0, int64_t rows,
              int64_t t0, int64_t t1);

// fp32 rows x [M, K] times 16-bit weights w [N, K] (bf16 or fp16 bits), K % 32 == 0: y for
// rows row0.. (<= 8) and outputs [n0, n1). Widened to fp32 in registers (never emulated
// bf16 arithmetic); with native bf16, bf16 weights use vdpbf16ps on bf16-rounded rows
// (xb: x rounded to bf16, needed only then).
void f16w_rows(const float* x, const uint16_t* xb, const uint16_t* w, bool bf16, float* y,
               int64_t row0, int64_t rows, int64_t K, int64_t N, int64_t n0, int64_t n1);

}  // namespace k
}  // namespace memspec
