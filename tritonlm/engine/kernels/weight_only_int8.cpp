// Weight-only int8 projections (`dtype: int8_weight_only`): 8-bit codes in 16-wide output
// panels with a float16 scale and offset per group of consecutive inputs of each output
// channel; float32 activations, rounded to 16-bit codes for decode-sized batches.
//
//   w8_linear(x [..., in] f32, panel [P, G * Q, 16, 4] uint8, scale [P, G, 16] f16, offset [P, G, 16] f16,
//             bias [out] f32 or None, in, out, isa) -> y [..., out] f32,
//       y = x @ (q * s + o)^T + bias, where each group covers in / G consecutive inputs (G = 1:
//       one per output channel) in Q = ceil(in / G / 4) quads, panel[p, g Q + t, j, r] =
//       q[16 p + j, g in / G + 4 t + r] (zero past the group's end and beyond `out`),
//       scale[p, g, j] = s[16 p + j, g] and offset[p, g, j] = o[16 p + j, g]. Codes are
//       unsigned, so one format holds both grids runners/weight_only.py rounds to (a symmetric
//       group has o = -128 s); float16 keeps the scales and offsets of a GGUF file's blocks exact.
//   w8_isas() -> the paths w8_linear can run here, best first ("avx512", "avx2", "scalar")
//
// isa: "auto" (the best this CPU has) or one of w8_isas(), so tests can run every path the
// CPU allows; one it lacks is refused by name.
//
// Why not int8 x int8 (int8_act8.cpp's i8_linear): 8-bit activations are where int8's
// disagreement with float32 comes from. A decode step is bound by streaming the weights
// from memory, so the codes are read as bytes (a quarter of float32's) and the arithmetic
// must stay well under the stream's time.
//
// Why 16-bit activation codes: widening every byte to float costs a shuffle and a conversion
// per 16 weights, and shuffles are a scarce port; as 16-bit integers, a quad's 64 bytes split
// into (q[4t], q[4t + 2]) and (q[4t + 1], q[4t + 3]) pairs per channel by a mask and a shift,
// and two pair dot products (vpdpwssd, or vpmaddwd + vpaddd without VNNI) add its 64
// products. Each row's inputs are rounded per chunk of at most 256 inputs of a group
// (chunk_codes): code = round(x / max|x| * 32767), scale = max|x| / 32767, so half a step is
// 2^-16 of the chunk's largest input (float16 activations keep 2^-11 of each value), and
// every integer sum is exact (kChunkQuads). y = sum over chunks of (float(int sum) * scale) * s
// + the group's sum of scale * code * o: x rounded, then the dequantized weights exactly.
//
// Why panels of quads (the layout of i8_linear's int8 panels): a panel is one contiguous
// stream, one 64-byte load feeds 16 output channels x 4 inputs of every row in the tile,
// and the hardware prefetcher sees a plain sequence.
//
// Rows (M = x's rows):
//   M <= kDirectRows  tiles of a few rows x a few panels keep their sums in registers: per
//                     chunk the integer sums, then acc = (float(sum) * chunk scale) * s + acc,
//                     per group acc = group sum * o + acc, groups in order, then + bias. The
//                     integers are exact and every path and tile shape makes the same float
//                     steps, so a row's bits depend on neither its batch nor the ISA path.
//                     Threads: torch's team, by groups of panels; each panel is read once per call.
//   M >  kDirectRows  (prefill chunks) compute-bound: x is rounded to the same codes
//                     (round_rows) and multiplied by the weights widened to float, one function
//                     on both paths, so a row's result differs between them by float summation
//                     order only. Each task widens one or two panels into a float panel buffer
//                     of at most kWidenedBytes, which stays in the core's cache, and runs the
//                     float32 panel kernel's tiles over its rows (float_panel.h): the widened
//                     weights are never written to memory, and a row's bits do not depend on
//                     its batch. This is the build's own vector level whichever vector isa is
//                     asked for (an AVX-512 build's "avx2" runs AVX-512 here; the levels give
//                     the same bits). The scalar path (and a build without vector kernels)
//                     widens the whole weight into [in, out] for a GEMM (at::addmm) instead.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Half.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/mm.h>
#include <torch/library.h>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "float_panel.h"

namespace {

constexpr int64_t kLanes = 16;            // output channels in a panel
constexpr int64_t kQuad = 4;              // consecutive inputs of one channel side by side in a panel
constexpr int64_t kDirectRows = 64;       // above this, widen the weights to float (the panel kernel or a GEMM)
constexpr int64_t kGrainWeights = 65536;  // int8 weights per task: below this, one thread
constexpr int64_t kPrefetchAhead = 1024;  // bytes ahead in its panel that a tile asks for (16 quads)
// the most a prefill task widens at once: its float panels stay in a core's L2 (1-2 MiB on
// the CPUs this serves) while the panel kernel's row tiles read them again and again
constexpr int64_t kWidenedBytes = 256 << 10;
// The largest activation code. A quad's four products are at most 4 x 255 x 32767 in
// magnitude, so kChunkQuads quads sum within int32: every integer sum the kernel makes is exact.
constexpr float kActMax = 32767.0f;
constexpr int64_t kChunkQuads = 64;  // quads of a group under one activation scale, at most (256 inputs)
static_assert(kChunkQuads * kQuad * 255.0 * kActMax <= 2147483647.0, "a chunk's integer sums must fit int32");

enum class Isa { kScalar, kAvx2, kAvx512 };

// a build is loaded only on a CPU that runs its ISA level (kernels/isa.py; or -march=native),
// so a path compiled in is one this CPU runs
bool compiled(Isa isa) {
  switch (isa) {
    case Isa::kAvx512:
#if defined(__AVX512F__) && defined(__AVX512BW__)
      return true;
#else
      return false;
#endif
    case Isa::kAvx2:
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
      return true;
#else
      return false;
#endif
    default:
      return true;
  }
}

const char* isa_name(Isa isa) { return isa == Isa::kAvx512 ? "avx512" : isa == Isa::kAvx2 ? "avx2" : "scalar"; }

Isa pick_isa(std::string_view asked) {
  if (asked == "auto") {
    for (Isa isa : {Isa::kAvx512, Isa::kAvx2})
      if (compiled(isa)) return isa;
    return Isa::kScalar;
  }
  for (Isa isa : {Isa::kAvx512, Isa::kAvx2, Isa::kScalar}) {
    if (asked == isa_name(isa)) {
      TORCH_CHECK(compiled(isa), "w8_linear: isa '", asked, "' is not supported by this CPU; it runs ",
                  isa_name(pick_isa("auto")), " (see w8_isas())");
      return isa;
    }
  }
  TORCH_CHECK(false, "w8_linear: isa '", asked, "' is not one of auto, avx512, avx2, scalar");
}

int64_t quads_of(int64_t group) { return (group + kQuad - 1) / kQuad; }

// One chunk of a row, n inputs, to 16-bit codes: scale = max|x| / 32767, code = round(x / max|x|
// * 32767) (the ratio first, so a tiny max|x| cannot overflow a multiplier). Returns the scale:
// 0 for an all-zero chunk, NaN where the chunk holds an inf or a NaN (its codes 0), so that
// row's outputs are NaN rather than a finite guess.
float chunk_codes(const float* x, int64_t n, int32_t* code) {
  float top = 0.0f;
  bool finite = true;
  for (int64_t k = 0; k < n; ++k) {
    const float v = std::fabs(x[k]);
    finite &= v <= std::numeric_limits<float>::max();  // false for inf and NaN
    top = std::max(top, v);
  }
  if (!finite || top == 0.0f) {
    std::fill(code, code + n, 0);
    return finite ? 0.0f : std::numeric_limits<float>::quiet_NaN();
  }
  for (int64_t k = 0; k < n; ++k)
    code[k] = static_cast<int32_t>(std::nearbyint(std::min(std::max(x[k] / top * kActMax, -kActMax), kActMax)));
  return top / kActMax;
}

// The chunks of every group: f(g, c, k0, k1) for inputs [k0, k1), at most kChunkQuads quads
// each, from the group's first input
template <class F>
void for_each_chunk(int64_t in, int64_t groups, F&& f) {
  const int64_t group = in / groups, chunks = (quads_of(group) + kChunkQuads - 1) / kChunkQuads;
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t k0 = g * group + kQuad * kChunkQuads * c;
      f(g, c, k0, std::min(k0 + kQuad * kChunkQuads, (g + 1) * group));
    }
}

// A call's rows as 16-bit activation codes, for the direct path, laid out as the panel's
// quads: per quad of a group two words, code[4t] | code[4t + 2] << 16 and code[4t + 1] |
// code[4t + 3] << 16 (0 past the group's end), a scale per chunk (chunk_codes), and per group
// the sum of scale * code, chunk by chunk.
struct Acts {
  std::vector<int32_t> words;  // [rows, G * group_quads * 2]
  std::vector<float> scale;    // [rows, G * group_chunks]
  std::vector<float> sum;      // [rows, G]
  int64_t group_quads = 0, group_chunks = 0;
};

int32_t two_codes(int32_t lo, int32_t hi) {
  return static_cast<int32_t>(static_cast<uint32_t>(static_cast<uint16_t>(lo)) |
                              (static_cast<uint32_t>(static_cast<uint16_t>(hi)) << 16));
}

Acts quantize_rows(const float* x, int64_t rows, int64_t in, int64_t groups) {
  Acts q;
  q.group_quads = quads_of(in / groups);
  q.group_chunks = (q.group_quads + kChunkQuads - 1) / kChunkQuads;
  q.words.assign(rows * groups * q.group_quads * 2, 0);
  q.scale.assign(rows * groups * q.group_chunks, 0.0f);
  q.sum.assign(rows * groups, 0.0f);
  std::vector<int32_t> code(kQuad * kChunkQuads);
  for (int64_t m = 0; m < rows; ++m)
    for_each_chunk(in, groups, [&](int64_t g, int64_t c, int64_t k0, int64_t k1) {
      const float scale = chunk_codes(x + m * in + k0, k1 - k0, code.data());
      int32_t total = 0;  // |total| <= 256 x 32767 < 2^24: exact in float
      int32_t* out = q.words.data() + ((m * groups + g) * q.group_quads + c * kChunkQuads) * 2;
      for (int64_t t = 0; t < k1 - k0; t += kQuad, out += 2) {
        int32_t quad[kQuad] = {};
        for (int64_t r = 0; r < kQuad && t + r < k1 - k0; ++r) total += quad[r] = code[t + r];
        out[0] = two_codes(quad[0], quad[2]);
        out[1] = two_codes(quad[1], quad[3]);
      }
      q.scale[(m * groups + g) * q.group_chunks + c] = scale;
      float& sum = q.sum[m * groups + g];
      sum = std::fma(scale, static_cast<float>(total), sum);
    });
  return q;
}

// x's rows with every input replaced by its code times its chunk's scale (chunk_codes), for
// the GEMM path: the activations the direct path multiplies, so both paths compute one
// function and differ only in float summation order
void round_rows(const float* x, int64_t rows, int64_t in, int64_t groups, float* out) {
  at::parallel_for(0, rows, std::max<int64_t>(1, kGrainWeights / std::max<int64_t>(in, 1)), [&](int64_t lo, int64_t hi) {
    std::vector<int32_t> code(kQuad * kChunkQuads);
    for (int64_t m = lo; m < hi; ++m)
      for_each_chunk(in, groups, [&](int64_t, int64_t, int64_t k0, int64_t k1) {
        const float scale = chunk_codes(x + m * in + k0, k1 - k0, code.data());
        for (int64_t k = k0; k < k1; ++k) out[m * in + k] = static_cast<float>(code[k - k0]) * scale;
      });
  });
}

struct Args {
  const float* x;         // [rows, in] (the GEMM path)
  const uint8_t* w;       // [P, G * group_quads, 16, 4]
  const at::Half* scale;  // [P, G, 16]
  const at::Half* offset; // [P, G, 16]
  const int32_t* xword;   // [rows, G * group_quads * 2] (Acts, the direct path)
  const float* xscale;    // [rows, G * group_chunks]
  const float* xsum;      // [rows, G]
  const float* bias;    // [out] or null
  float* y;             // [rows, out]
  int64_t in, out, groups, group;  // group = in / groups inputs per scale
  int64_t group_quads, group_chunks;
  int64_t panel_bytes() const { return groups * group_quads * kLanes * kQuad; }
};

// A vector type's operations over one panel's 16 lanes: V::kVecs registers of V::kWidth lanes.
// split(codes, h, even, odd): a quad of one panel (64 bytes: 16 channels x 4 inputs) as two
// vectors of 16-bit pairs, even = (q[4t], q[4t + 2]) and odd = (q[4t + 1], q[4t + 3]) per channel
// and int32 lane, by a mask and a shift (no shuffle), so that dot(acc, even, word 0) +
// dot(acc, odd, word 1) adds the quad's four products to each channel's sum.
#if defined(__AVX512F__) && defined(__AVX512BW__)
struct Avx512 {
  using Reg = __m512;
  using IReg = __m512i;
  static constexpr int kVecs = 1;
  static constexpr int kFewRows = 2;  // rows that take the wide tile (NP_FEW panels)
#if defined(__AVX512VNNI__)
  static constexpr bool kAccumulatingDot = true;
#else
  static constexpr bool kAccumulatingDot = false;
#endif
  static Reg zero() { return _mm512_setzero_ps(); }
  static IReg izero() { return _mm512_setzero_si512(); }
  static Reg set1(float v) { return _mm512_set1_ps(v); }
  static IReg word(int32_t v) { return _mm512_set1_epi32(v); }
  static void split(const uint8_t* p, int, IReg& even, IReg& odd) {
    const IReg v = _mm512_loadu_si512(p);
    even = _mm512_and_si512(v, _mm512_set1_epi16(0x00FF));
    odd = _mm512_srli_epi16(v, 8);
  }
  static IReg dot(IReg acc, IReg w, IReg x) { return _mm512_add_epi32(acc, _mm512_madd_epi16(w, x)); }
#if defined(__AVX512VNNI__)
  // acc + the pair products of w with *x in every lane: VNNI's dot reads x straight from
  // memory as an embedded broadcast, so a tile holds no row's x in registers. In place, by
  // hand: GCC's _mm512_dpwssd_epi32 copies the accumulator in and out around every dot,
  // which lengthens each chain of dependent dots
  static IReg dot_at(IReg acc, IReg w, const int32_t* x) {
    asm("vpdpwssd {%2%{1to16%}, %1, %0|%0, %1, %2%{1to16%}}" : "+v"(acc) : "v"(w), "m"(*x));
    return acc;
  }
#endif
  static Reg to_float(IReg v) { return _mm512_cvtepi32_ps(v); }
  static IReg iadd(IReg a, IReg b) { return _mm512_add_epi32(a, b); }
  static Reg mul(Reg a, Reg b) { return _mm512_mul_ps(a, b); }
  static Reg load_half(const at::Half* p, int) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static Reg fma(Reg a, Reg b, Reg c) { return _mm512_fmadd_ps(a, b, c); }
  static void store_panel(float* y, const Reg* acc, const float* bias, int64_t left) {  // y, bias at the panel's first lane
    const __mmask16 mask = left >= kLanes ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
    const Reg b = bias ? _mm512_maskz_loadu_ps(mask, bias) : _mm512_setzero_ps();
    _mm512_mask_storeu_ps(y, mask, _mm512_add_ps(acc[0], b));
  }
};
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
struct Avx2 {
  using Reg = __m256;
  using IReg = __m256i;
  static constexpr int kVecs = 2;
  static constexpr int kFewRows = 1;
  static constexpr bool kAccumulatingDot = false;
  static Reg zero() { return _mm256_setzero_ps(); }
  static IReg izero() { return _mm256_setzero_si256(); }
  static Reg set1(float v) { return _mm256_set1_ps(v); }
  static IReg word(int32_t v) { return _mm256_set1_epi32(v); }
  static void split(const uint8_t* p, int h, IReg& even, IReg& odd) {  // h: channels 0-7, then 8-15
    const IReg v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * h));
    even = _mm256_and_si256(v, _mm256_set1_epi16(0x00FF));
    odd = _mm256_srli_epi16(v, 8);
  }
  static IReg dot(IReg acc, IReg w, IReg x) { return _mm256_add_epi32(acc, _mm256_madd_epi16(w, x)); }
  static Reg to_float(IReg v) { return _mm256_cvtepi32_ps(v); }
  static IReg iadd(IReg a, IReg b) { return _mm256_add_epi32(a, b); }
  static Reg mul(Reg a, Reg b) { return _mm256_mul_ps(a, b); }
  static Reg load_half(const at::Half* p, int h) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8 * h)));
  }
  static Reg fma(Reg a, Reg b, Reg c) { return _mm256_fmadd_ps(a, b, c); }
  static void store_panel(float* y, const Reg* acc, const float* bias, int64_t left) {
    alignas(32) float lanes[kLanes];
    _mm256_store_ps(lanes, acc[0]);
    _mm256_store_ps(lanes + 8, acc[1]);
    for (int64_t j = 0; j < std::min(left, kLanes); ++j) y[j] = bias ? lanes[j] + bias[j] : lanes[j];
  }
};
#endif

// rows [MB] x panels [NP] of y, starting at row m0 and panel p0. Per chunk of a group the
// integer sums are exact; then acc = (float(sum) * chunk scale) * s + acc per chunk and
// acc = group sum * o + acc per group, in order, then + bias: every tile shape, and the
// scalar path, round the same way, so a row's bits depend on neither its batch nor the path.
template <class V, int MB, int NP>
inline void tile(const Args& a, int64_t m0, int64_t p0) {
  using Reg = typename V::Reg;
  using IReg = typename V::IReg;
  constexpr int W = V::kVecs;
  // with few sums in flight and a dot whose latency is the chain's (VNNI's accumulating dot),
  // the odd products go to sums of their own, doubling the chains (integer adds: the same sums)
  constexpr bool kTwoChains = V::kAccumulatingDot && MB * NP * W <= 4;
  Reg acc[MB][NP][W];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NP; ++j)
      for (int h = 0; h < W; ++h) acc[i][j][h] = V::zero();
  const int64_t stride = a.panel_bytes(), row_words = a.groups * a.group_quads * 2;
  const int64_t row_chunks = a.groups * a.group_chunks;
  const uint8_t* w = a.w + p0 * stride;
  const at::Half* sc = a.scale + p0 * a.groups * kLanes;
  const at::Half* off = a.offset + p0 * a.groups * kLanes;
  const int32_t* xw = a.xword + m0 * row_words;
  for (int64_t g = 0; g < a.groups; ++g) {
    for (int64_t c = 0; c < a.group_chunks; ++c) {
      const int64_t q0 = g * a.group_quads + c * kChunkQuads;
      const int64_t q1 = g * a.group_quads + std::min((c + 1) * kChunkQuads, a.group_quads);
      IReg part[MB][NP][W], part_odd[MB][NP][W];  // part_odd: the odd products, where registers allow
      for (int i = 0; i < MB; ++i)
        for (int j = 0; j < NP; ++j)
          for (int h = 0; h < W; ++h) part[i][j][h] = part_odd[i][j][h] = V::izero();
      for (int64_t q = q0; q < q1; ++q) {
        IReg x_even[MB], x_odd[MB];  // each row's two words of the quad, in every lane (without dot_at)
        if constexpr (!V::kAccumulatingDot)
          for (int i = 0; i < MB; ++i) {
            x_even[i] = V::word(xw[i * row_words + 2 * q]);
            x_odd[i] = V::word(xw[i * row_words + 2 * q + 1]);
          }
        for (int j = 0; j < NP; ++j) {
          const uint8_t* codes = w + j * stride + q * kLanes * kQuad;
          __builtin_prefetch(codes + kPrefetchAhead, 0, 3);  // past the end: a no-op
          for (int h = 0; h < W; ++h) {
            IReg even, odd;
            V::split(codes, h, even, odd);
            for (int i = 0; i < MB; ++i) {
              IReg& into = kTwoChains ? part_odd[i][j][h] : part[i][j][h];
              if constexpr (V::kAccumulatingDot) {
                part[i][j][h] = V::dot_at(part[i][j][h], even, xw + i * row_words + 2 * q);
                into = V::dot_at(into, odd, xw + i * row_words + 2 * q + 1);
              } else {
                part[i][j][h] = V::dot(part[i][j][h], even, x_even[i]);
                into = V::dot(into, odd, x_odd[i]);
              }
            }
          }
        }
      }
      for (int j = 0; j < NP; ++j)
        for (int h = 0; h < W; ++h) {
          const Reg s = V::load_half(sc + (j * a.groups + g) * kLanes, h);
          for (int i = 0; i < MB; ++i) {
            const Reg xs = V::set1(a.xscale[(m0 + i) * row_chunks + g * a.group_chunks + c]);
            const IReg sum = kTwoChains ? V::iadd(part[i][j][h], part_odd[i][j][h]) : part[i][j][h];
            acc[i][j][h] = V::fma(V::mul(V::to_float(sum), xs), s, acc[i][j][h]);
          }
        }
    }
    for (int j = 0; j < NP; ++j)
      for (int h = 0; h < W; ++h) {
        const Reg o = V::load_half(off + (j * a.groups + g) * kLanes, h);
        for (int i = 0; i < MB; ++i) acc[i][j][h] = V::fma(V::set1(a.xsum[(m0 + i) * a.groups + g]), o, acc[i][j][h]);
      }
  }
  for (int j = 0; j < NP; ++j) {
    const int64_t n = (p0 + j) * kLanes;
    for (int i = 0; i < MB; ++i)
      V::store_panel(a.y + (m0 + i) * a.out + n, acc[i][j], a.bias ? a.bias + n : nullptr, a.out - n);
  }
}

// every row against NP panels from p0: tiles of MBMAX rows, then the rest
template <class V, int NP, int MBMAX>
void all_rows(const Args& a, int64_t rows, int64_t p0) {
  int64_t m = 0;
  for (; m + MBMAX <= rows; m += MBMAX) tile<V, MBMAX, NP>(a, m, p0);
  switch (rows - m) {
#define TRITONLM_TAIL(R) \
  case R:                \
    if constexpr (R < MBMAX) tile<V, R, NP>(a, m, p0); \
    break;
    TRITONLM_TAIL(1) TRITONLM_TAIL(2) TRITONLM_TAIL(3) TRITONLM_TAIL(4) TRITONLM_TAIL(5)
#undef TRITONLM_TAIL
    default:
      break;
  }
}

// Panels [p0, p1): at up to V::kFewRows rows each sum is a chain of dependent adds, so more
// panels at a time give the core more chains; with more rows, fewer panels leave registers
// for more rows, which share each loaded quad.
template <class V, int NP_FEW, int NP_MANY, int MB_MANY>
void panels(const Args& a, int64_t rows, int64_t p0, int64_t p1) {
  const int np = rows <= V::kFewRows ? NP_FEW : NP_MANY;
  int64_t p = p0;
  for (; p + np <= p1; p += np) {
    if (np == NP_FEW)
      all_rows<V, NP_FEW, V::kFewRows>(a, rows, p);
    else
      all_rows<V, NP_MANY, MB_MANY>(a, rows, p);
  }
  for (; p < p1; ++p) all_rows<V, 1, MB_MANY>(a, rows, p);
}

// The portable path: the same integer sums and the same float steps per output, in plain C++.
void panels_scalar(const Args& a, int64_t rows, int64_t p0, int64_t p1) {
  const int64_t row_words = a.groups * a.group_quads * 2, row_chunks = a.groups * a.group_chunks;
  for (int64_t p = p0; p < p1; ++p) {
    const uint8_t* w = a.w + p * a.panel_bytes();
    const at::Half* sc = a.scale + p * a.groups * kLanes;
    const at::Half* off = a.offset + p * a.groups * kLanes;
    for (int64_t m = 0; m < rows; ++m) {
      float acc[kLanes] = {};
      for (int64_t g = 0; g < a.groups; ++g) {
        for (int64_t c = 0; c < a.group_chunks; ++c) {
          int32_t part[kLanes] = {};
          const int64_t q0 = g * a.group_quads + c * kChunkQuads;
          const int64_t q1 = g * a.group_quads + std::min((c + 1) * kChunkQuads, a.group_quads);
          for (int64_t q = q0; q < q1; ++q) {
            const uint32_t w0 = static_cast<uint32_t>(a.xword[m * row_words + 2 * q]);
            const uint32_t w1 = static_cast<uint32_t>(a.xword[m * row_words + 2 * q + 1]);
            const int32_t code[kQuad] = {static_cast<int16_t>(w0 & 0xFFFF), static_cast<int16_t>(w1 & 0xFFFF),
                                         static_cast<int16_t>(w0 >> 16), static_cast<int16_t>(w1 >> 16)};
            const uint8_t* quad = w + q * kLanes * kQuad;
            for (int64_t j = 0; j < kLanes; ++j)
              for (int64_t r = 0; r < kQuad; ++r) part[j] += code[r] * quad[j * kQuad + r];
          }
          const float xs = a.xscale[m * row_chunks + g * a.group_chunks + c];
          for (int64_t j = 0; j < kLanes; ++j)
            acc[j] = std::fma(static_cast<float>(part[j]) * xs, static_cast<float>(sc[g * kLanes + j]), acc[j]);
        }
        for (int64_t j = 0; j < kLanes; ++j)
          acc[j] = std::fma(a.xsum[m * a.groups + g], static_cast<float>(off[g * kLanes + j]), acc[j]);
      }
      const int64_t n = p * kLanes;
      for (int64_t j = 0; j < std::min(kLanes, a.out - n); ++j)
        a.y[m * a.out + n + j] = a.bias ? acc[j] + a.bias[n + j] : acc[j];
    }
  }
}

using PanelKernel = void (*)(const Args&, int64_t, int64_t, int64_t);

PanelKernel kernel_for(Isa isa) {
  switch (isa) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    case Isa::kAvx512:  // 32 zmm: 2 rows x 4 panels (sums and integer sums), or 4 rows x 2 panels
      return panels<Avx512, 4, 2, 4>;
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    case Isa::kAvx2:  // 16 ymm, two per panel: 1 row x 2 panels, or 2 rows x 1 panel
      return panels<Avx2, 2, 1, 2>;
#endif
    default:
      return panels_scalar;
  }
}

// Panels [p0, p0 + np) widened to float panels [np, in, 16] (float_panel.h's layout) at dst:
// w[k][j] = q * s + o, by one fused multiply-add in the vector loops and the scalar tail
// alike, so the AVX-512 and AVX2 builds widen to the same floats. Each quad's 64 bytes hold
// 16 channels x 4 inputs: input r of channel j is byte r of the quad's 32-bit lane j.
void widen_panels(const Args& a, int64_t p0, int64_t np, float* dst) {
  for (int64_t p = p0; p < p0 + np; ++p) {
    for (int64_t g = 0; g < a.groups; ++g) {
      const int64_t group_at = (p * a.groups + g) * kLanes;
      const uint8_t* quad = a.w + p * a.panel_bytes() + g * a.group_quads * kLanes * kQuad;
      float* row = dst + g * a.group * kLanes;  // input g * group of this panel
      int64_t t = 0;
#if defined(__AVX512F__)
      const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.scale + group_at)));
      const __m512 o = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.offset + group_at)));
      const __m512i byte = _mm512_set1_epi32(0xFF);
      for (; kQuad * (t + 1) <= a.group; ++t, quad += kLanes * kQuad, row += kQuad * kLanes) {
        const __m512i v = _mm512_loadu_si512(quad);
        const auto put = [&](__m512i codes, int r) {
          _mm512_storeu_ps(row + r * kLanes, _mm512_fmadd_ps(_mm512_cvtepi32_ps(codes), s, o));
        };
        put(_mm512_and_si512(v, byte), 0);
        put(_mm512_and_si512(_mm512_srli_epi32(v, 8), byte), 1);
        put(_mm512_and_si512(_mm512_srli_epi32(v, 16), byte), 2);
        put(_mm512_srli_epi32(v, 24), 3);
      }
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
      const __m256 s_lo = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a.scale + group_at)));
      const __m256 s_hi = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a.scale + group_at + 8)));
      const __m256 o_lo = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a.offset + group_at)));
      const __m256 o_hi = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a.offset + group_at + 8)));
      const __m256i byte = _mm256_set1_epi32(0xFF);
      for (; kQuad * (t + 1) <= a.group; ++t, quad += kLanes * kQuad, row += kQuad * kLanes) {
        const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(quad));
        const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(quad + 32));
        const auto put = [&](__m256i codes_lo, __m256i codes_hi, int r) {
          _mm256_storeu_ps(row + r * kLanes, _mm256_fmadd_ps(_mm256_cvtepi32_ps(codes_lo), s_lo, o_lo));
          _mm256_storeu_ps(row + r * kLanes + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(codes_hi), s_hi, o_hi));
        };
        put(_mm256_and_si256(lo, byte), _mm256_and_si256(hi, byte), 0);
        put(_mm256_and_si256(_mm256_srli_epi32(lo, 8), byte), _mm256_and_si256(_mm256_srli_epi32(hi, 8), byte), 1);
        put(_mm256_and_si256(_mm256_srli_epi32(lo, 16), byte), _mm256_and_si256(_mm256_srli_epi32(hi, 16), byte), 2);
        put(_mm256_srli_epi32(lo, 24), _mm256_srli_epi32(hi, 24), 3);
      }
#endif
      // a group whose inputs do not fill its last quad (and builds without vectors)
      for (; kQuad * t < a.group; ++t, quad += kLanes * kQuad, row += kQuad * kLanes)
        for (int64_t r = 0; r < std::min(kQuad, a.group - kQuad * t); ++r)
          for (int64_t j = 0; j < kLanes; ++j)
            row[r * kLanes + j] = std::fma(static_cast<float>(quad[j * kQuad + r]),
                                           static_cast<float>(a.scale[group_at + j]),
                                           static_cast<float>(a.offset[group_at + j]));
    }
    dst += a.in * kLanes;
  }
}

// panel codes * scale + offset -> buf [in, out] float32 (x @ buf is the GEMM: input k of
// output channel 16 p + j is byte (k's quad, j, k % 4) of panel p), over torch's thread team
void dequantize(const Args& a, float* buf) {
  const int64_t P = (a.out + kLanes - 1) / kLanes;
  at::parallel_for(0, a.in, std::max<int64_t>(1, kGrainWeights / std::max<int64_t>(a.out, 1)), [&](int64_t lo, int64_t hi) {
    for (int64_t k = lo; k < hi; ++k) {
      float* row = buf + k * a.out;
      const int64_t g = k / a.group, quad = g * a.group_quads + (k % a.group) / kQuad, r = (k % a.group) % kQuad;
      for (int64_t p = 0; p < P; ++p) {
        const uint8_t* w = a.w + p * a.panel_bytes() + quad * kLanes * kQuad + r;
        const int64_t group_at = (p * a.groups + g) * kLanes;
        const at::Half* s = a.scale + group_at;
        const at::Half* o = a.offset + group_at;
        const int64_t lanes = std::min(kLanes, a.out - p * kLanes);
        float* dst = row + p * kLanes;
        for (int64_t j = 0; j < lanes; ++j)
          dst[j] = static_cast<float>(w[j * kQuad]) * static_cast<float>(s[j]) + static_cast<float>(o[j]);
      }
    }
  });
}

at::Tensor w8_linear(const at::Tensor& x, const at::Tensor& panel, const at::Tensor& scale,
                     const at::Tensor& offset, const std::optional<at::Tensor>& bias, int64_t in, int64_t out,
                     std::string_view isa_asked) {
  const Isa isa = pick_isa(isa_asked);
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() >= 1,
              "w8_linear: x must be a float32 CPU tensor [..., in]");
  TORCH_CHECK(x.size(-1) == in, "w8_linear: x's rows have ", x.size(-1), " values; the weights take ", in);
  TORCH_CHECK(panel.device().is_cpu() && panel.scalar_type() == at::kByte && panel.is_contiguous() &&
                  panel.dim() == 4 && panel.size(2) == kLanes && panel.size(3) == kQuad,
              "w8_linear: panel must be a contiguous uint8 CPU tensor [P, groups * quads per group, 16, 4], not ",
              panel.scalar_type(), " ", panel.sizes());
  const int64_t P = panel.size(0);
  TORCH_CHECK(out > (P - 1) * kLanes && out <= P * kLanes, "w8_linear: ", P, " panels cannot hold out=", out);
  TORCH_CHECK(scale.device().is_cpu() && scale.scalar_type() == at::kHalf && scale.is_contiguous() &&
                  scale.dim() == 3 && scale.size(0) == P && scale.size(2) == kLanes,
              "w8_linear: scale must be a contiguous float16 CPU tensor [", P, ", groups, 16], not ",
              scale.scalar_type(), " ", scale.sizes());
  const int64_t groups = scale.size(1);
  TORCH_CHECK(groups > 0 && in % groups == 0, "w8_linear: scale has ", groups, " groups per output; the ", in,
              " inputs do not split into that many equal groups");
  TORCH_CHECK(panel.size(1) == groups * quads_of(in / groups), "w8_linear: the panel holds ", panel.size(1),
              " quads of inputs; ", groups, " groups of ", in / groups, " inputs take ", groups * quads_of(in / groups));
  TORCH_CHECK(offset.device().is_cpu() && offset.scalar_type() == at::kHalf && offset.is_contiguous() &&
                  offset.sizes() == scale.sizes(),
              "w8_linear: offset must be a contiguous float16 CPU tensor shaped as scale ", scale.sizes(), ", not ",
              offset.scalar_type(), " ", offset.sizes());
  const float* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->device().is_cpu() && bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                    bias->numel() == out,
                "w8_linear: bias must be a contiguous float32 CPU tensor of ", out, " values (one per output)");
    bp = bias->data_ptr<float>();
  }
  const at::Tensor flat = x.reshape({-1, in}).contiguous();
  const int64_t rows = flat.size(0);
  auto sizes = x.sizes().vec();
  sizes.back() = out;
  at::Tensor y = at::empty({rows, out}, x.options());
  Args a{flat.data_ptr<float>(), panel.data_ptr<uint8_t>(), scale.data_ptr<at::Half>(),
         offset.data_ptr<at::Half>(), nullptr, nullptr, nullptr, bp, y.data_ptr<float>(), in, out, groups, in / groups,
         quads_of(in / groups), 0};
  if (rows > kDirectRows) {
    at::Tensor rounded = at::empty({rows, in}, x.options());
    round_rows(a.x, rows, in, groups, rounded.data_ptr<float>());
    if (isa != Isa::kScalar && tritonlm_panel::panel_vectors()) {
      const float* xr = rounded.data_ptr<float>();
      // one panel a task where the panel kernel's widest tile would pass kWidenedBytes
      const int64_t np = std::max<int64_t>(
          1, std::min(tritonlm_panel::panels_per_task(rows), kWidenedBytes / (in * kLanes * int64_t(sizeof(float)))));
      const int64_t panel_tasks = (P + np - 1) / np;
      // a narrow projection (few panels) splits its rows too, so that every thread has work;
      // each block of rows widens its panels again, which kDirectRows rows at least pay for
      const int64_t row_blocks = std::clamp<int64_t>((2 * at::get_num_threads() + panel_tasks - 1) / panel_tasks, 1,
                                                     rows / kDirectRows);
      const int64_t block = (rows + row_blocks - 1) / row_blocks;
      at::parallel_for(0, panel_tasks * row_blocks, 1, [&](int64_t lo, int64_t hi) {
        static thread_local std::vector<float> widened;  // np x in x 16, kept per thread
        widened.resize(np * in * kLanes);
        for (int64_t task = lo; task < hi; ++task) {
          const int64_t p = task / row_blocks * np, have = std::min(np, P - p);
          const int64_t m0 = task % row_blocks * block, m1 = std::min(rows, m0 + block);
          if (m0 >= m1) continue;
          widen_panels(a, p, have, widened.data());
          tritonlm_panel::panel_rows(xr + m0 * in, m1 - m0, in, widened.data(), have, bp, a.y + m0 * out, out,
                                     p * kLanes);
        }
      });
      return y.view(sizes);
    }
    // widened once per call; the buffer is kept (per thread) so a prefill does not map and
    // fault in fresh pages for every projection
    static thread_local at::Tensor buf;
    if (!buf.defined() || buf.numel() < out * in) buf = at::empty({out * in}, x.options());
    dequantize(a, buf.data_ptr<float>());
    const at::Tensor wf = buf.narrow(0, 0, in * out).view({in, out});
    return (bias ? at::addmm(*bias, rounded, wf) : at::mm(rounded, wf)).view(sizes);
  }
  // sum_k x[k] * (q[k] * s + o) = s * sum_k x[k] q[k] + o * sum_k x[k], per group, with x's
  // 16-bit codes in both sums
  const Acts acts = quantize_rows(a.x, rows, in, groups);
  a.xword = acts.words.data();
  a.xscale = acts.scale.data();
  a.xsum = acts.sum.data();
  a.group_chunks = acts.group_chunks;
  const PanelKernel kernel = kernel_for(isa);
  const int64_t grain = std::max<int64_t>(1, kGrainWeights / std::max<int64_t>(in * kLanes, 1));  // panels per task
  at::parallel_for(0, P, grain, [&](int64_t lo, int64_t hi) { kernel(a, rows, lo, hi); });
  return y.view(sizes);
}

std::vector<std::string> w8_isas() {
  std::vector<std::string> found;
  for (Isa isa : {Isa::kAvx512, Isa::kAvx2, Isa::kScalar})
    if (compiled(isa)) found.emplace_back(isa_name(isa));
  return found;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tritonlm, m) {
  m.def("w8_linear(Tensor x, Tensor panel, Tensor scale, Tensor offset, Tensor? bias, int in_features, int out, str isa) -> Tensor");
  m.def("w8_isas() -> str[]", &w8_isas);
}

TORCH_LIBRARY_IMPL(tritonlm, CPU, m) { m.impl("w8_linear", &w8_linear); }
