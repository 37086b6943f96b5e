// Weight-only int8 projections (`dtype: int8_weight_only`): 8-bit codes in 16-wide output
// panels with a float16 scale and offset per group of consecutive inputs of each output
// channel, float32 activations.
//
//   w8_linear(x [..., in] f32, panel [P, in, 16] uint8, scale [P, G, 16] f16, offset [P, G, 16] f16,
//             bias [out] f32 or None, out, isa) -> y [..., out] f32,
//       y = x @ (q * s + o)^T + bias, where panel[p, k, j] = q[16 p + j, k], scale[p, g, j] =
//       s[16 p + j, g] and offset[p, g, j] = o[16 p + j, g], each covering in / G consecutive
//       inputs (G = 1: one per output channel); zero beyond `out`. Codes are unsigned, so one
//       format holds both grids runners/weight_only.py rounds to (a symmetric group has
//       o = -128 s); float16 keeps the scales and offsets of a GGUF file's blocks exact.
//   w8_isas() -> the paths w8_linear can run here, best first ("avx512", "avx2", "scalar")
//
// isa: "auto" (the best this CPU has) or one of w8_isas(), so tests can run every path the
// CPU allows; one it lacks is refused by name.
//
// Why not int8 x int8 (decode_ops.cpp's int8_linear): quantizing activations per token is
// where int8's disagreement with float32 comes from; a decode step is bound by streaming
// the weights from memory, so reading them as int8 (a quarter of float32's bytes) and
// widening each to float in registers keeps int8's speed with float activations.
//
// Why panels (as float_panel.cpp): a panel is one contiguous stream of in x 16 bytes, one
// 16-byte load per k feeds 16 output channels of every row in the tile, and the hardware
// prefetcher sees a plain sequence; rows of [out, in] would need a horizontal sum per
// channel and four streams per block of channels.
//
// Rows (M = x's rows):
//   M <= kDirectRows  tiles of a few rows x a few panels keep their sums in registers over
//                     the whole k loop: per group, part = sum over its inputs of x[k] * q[k]
//                     (fused multiply-adds in k order), then acc = part * s + acc and
//                     acc = xsum * o + acc (xsum: the row's inputs of the group summed in k
//                     order, once per call), groups in order, then + bias. Every tile shape sums in that order, so a row's bits
//                     do not depend on the other rows of its batch. Threads: torch's team, by
//                     groups of panels; each panel is read from memory once per call.
//   M >  kDirectRows  (prefill chunks) compute-bound: the weight is widened once per call into
//                     a reused float buffer [in, out] and multiplied by a GEMM (at::addmm)

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
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace {

constexpr int64_t kLanes = 16;            // output channels in a panel
constexpr int64_t kDirectRows = 64;       // above this, dequantize once and run a GEMM
constexpr int64_t kGrainWeights = 65536;  // int8 weights per task: below this, one thread
constexpr int64_t kPrefetchAhead = 1024;  // bytes ahead in its panel that a tile asks for (64 k steps)

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

struct Args {
  const float* x;         // [rows, in]
  const uint8_t* w;       // [P, in, 16]
  const at::Half* scale;  // [P, G, 16]
  const at::Half* offset; // [P, G, 16]
  const float* xsum;      // [rows, G] each row's inputs summed per group
  const float* bias;    // [out] or null
  float* y;             // [rows, out]
  int64_t in, out, groups, group;  // group = in / groups inputs per scale
};

// A vector type's operations over one panel's 16 lanes: V::kVecs registers of V::kWidth lanes.
#if defined(__AVX512F__) && defined(__AVX512BW__)
struct Avx512 {
  using Reg = __m512;
  static constexpr int kVecs = 1;
  static Reg zero() { return _mm512_setzero_ps(); }
  static Reg set1(float v) { return _mm512_set1_ps(v); }
  static Reg widen(const uint8_t* p, int) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
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
  static constexpr int kVecs = 2;
  static Reg zero() { return _mm256_setzero_ps(); }
  static Reg set1(float v) { return _mm256_set1_ps(v); }
  static Reg widen(const uint8_t* p, int h) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * h))));
  }
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

// rows [MB] x panels [NP] of y, starting at row m0 and panel p0
template <class V, int MB, int NP>
inline void tile(const Args& a, int64_t m0, int64_t p0) {
  using Reg = typename V::Reg;
  constexpr int W = V::kVecs;
  Reg acc[MB][NP][W];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NP; ++j)
      for (int h = 0; h < W; ++h) acc[i][j][h] = V::zero();
  const int64_t in = a.in, stride = in * kLanes;
  const float* x = a.x + m0 * in;
  const uint8_t* w = a.w + p0 * stride;
  const at::Half* sc = a.scale + p0 * a.groups * kLanes;
  const at::Half* off = a.offset + p0 * a.groups * kLanes;
  for (int64_t g = 0; g < a.groups; ++g) {
    Reg part[MB][NP][W];
    for (int i = 0; i < MB; ++i)
      for (int j = 0; j < NP; ++j)
        for (int h = 0; h < W; ++h) part[i][j][h] = V::zero();
    for (int64_t k = g * a.group; k < (g + 1) * a.group; ++k) {
      Reg wk[NP][W];
      for (int j = 0; j < NP; ++j) {
        const uint8_t* codes = w + j * stride + k * kLanes;
        __builtin_prefetch(codes + kPrefetchAhead, 0, 3);  // past the end: a no-op
        for (int h = 0; h < W; ++h) wk[j][h] = V::widen(codes, h);
      }
      for (int i = 0; i < MB; ++i) {
        const Reg xb = V::set1(x[i * in + k]);
        for (int j = 0; j < NP; ++j)
          for (int h = 0; h < W; ++h) part[i][j][h] = V::fma(xb, wk[j][h], part[i][j][h]);
      }
    }
    for (int j = 0; j < NP; ++j)
      for (int h = 0; h < W; ++h) {
        const Reg s = V::load_half(sc + (j * a.groups + g) * kLanes, h);
        const Reg o = V::load_half(off + (j * a.groups + g) * kLanes, h);
        for (int i = 0; i < MB; ++i) {
          acc[i][j][h] = V::fma(part[i][j][h], s, acc[i][j][h]);
          acc[i][j][h] = V::fma(V::set1(a.xsum[(m0 + i) * a.groups + g]), o, acc[i][j][h]);
        }
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

// Panels [p0, p1): at one or two rows each accumulator is a chain of dependent FMAs, so four
// panels at a time give the core more chains; with more rows, two panels leave registers for
// more rows, which share each widened weight.
template <class V, int NP_FEW, int NP_MANY, int MB_MANY>
void panels(const Args& a, int64_t rows, int64_t p0, int64_t p1) {
  const int np = rows <= 2 ? NP_FEW : NP_MANY;
  int64_t p = p0;
  for (; p + np <= p1; p += np) {
    if (np == NP_FEW)
      all_rows<V, NP_FEW, 2>(a, rows, p);
    else
      all_rows<V, NP_MANY, MB_MANY>(a, rows, p);
  }
  for (; p < p1; ++p) all_rows<V, 1, MB_MANY>(a, rows, p);
}

// The portable path: the same sums, the same order per output, in plain C++.
void panels_scalar(const Args& a, int64_t rows, int64_t p0, int64_t p1) {
  for (int64_t p = p0; p < p1; ++p) {
    const uint8_t* w = a.w + p * a.in * kLanes;
    const at::Half* sc = a.scale + p * a.groups * kLanes;
    const at::Half* off = a.offset + p * a.groups * kLanes;
    for (int64_t m = 0; m < rows; ++m) {
      const float* x = a.x + m * a.in;
      float acc[kLanes] = {};
      for (int64_t g = 0; g < a.groups; ++g) {
        float part[kLanes] = {};
        for (int64_t k = g * a.group; k < (g + 1) * a.group; ++k)
          for (int64_t j = 0; j < kLanes; ++j) part[j] += x[k] * static_cast<float>(w[k * kLanes + j]);
        for (int64_t j = 0; j < kLanes; ++j) {
          acc[j] += part[j] * static_cast<float>(sc[g * kLanes + j]);
          acc[j] += a.xsum[m * a.groups + g] * static_cast<float>(off[g * kLanes + j]);
        }
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
    case Isa::kAvx512:  // 32 zmm: 2 rows x 4 panels x (sum + group sum), or 6 rows x 2 panels
      return panels<Avx512, 4, 2, 6>;
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    case Isa::kAvx2:  // 16 ymm, two per panel: 1 row x 2 panels, or 2 rows x 1 panel
      return panels<Avx2, 2, 1, 2>;
#endif
    default:
      return panels_scalar;
  }
}

// panel [P, in, 16] uint8 * scale [P, G, 16] + offset -> buf [in, out] float32 (x @ buf is the GEMM: each
// panel's k-th 16 bytes widen to 16 consecutive floats of buf's row k), over torch's thread team
void dequantize(const Args& a, float* buf) {
  const int64_t P = (a.out + kLanes - 1) / kLanes;
  at::parallel_for(0, a.in, std::max<int64_t>(1, kGrainWeights / std::max<int64_t>(a.out, 1)), [&](int64_t lo, int64_t hi) {
    for (int64_t k = lo; k < hi; ++k) {
      float* row = buf + k * a.out;
      for (int64_t p = 0; p < P; ++p) {
        const uint8_t* w = a.w + (p * a.in + k) * kLanes;
        const int64_t group_at = (p * a.groups + k / a.group) * kLanes;
        const at::Half* s = a.scale + group_at;
        const at::Half* o = a.offset + group_at;
        const int64_t lanes = std::min(kLanes, a.out - p * kLanes);
        float* dst = row + p * kLanes;
        for (int64_t j = 0; j < lanes; ++j)
          dst[j] = static_cast<float>(w[j]) * static_cast<float>(s[j]) + static_cast<float>(o[j]);
      }
    }
  });
}

at::Tensor w8_linear(const at::Tensor& x, const at::Tensor& panel, const at::Tensor& scale,
                     const at::Tensor& offset, const std::optional<at::Tensor>& bias, int64_t out,
                     std::string_view isa_asked) {
  const Isa isa = pick_isa(isa_asked);
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() >= 1,
              "w8_linear: x must be a float32 CPU tensor [..., in]");
  TORCH_CHECK(panel.device().is_cpu() && panel.scalar_type() == at::kByte && panel.is_contiguous() &&
                  panel.dim() == 3 && panel.size(2) == kLanes,
              "w8_linear: panel must be a contiguous uint8 CPU tensor [P, in, 16], not ", panel.scalar_type(), " ",
              panel.sizes());
  const int64_t P = panel.size(0), in = panel.size(1);
  TORCH_CHECK(x.size(-1) == in, "w8_linear: x's rows have ", x.size(-1), " values; the panel takes ", in);
  TORCH_CHECK(out > (P - 1) * kLanes && out <= P * kLanes, "w8_linear: ", P, " panels cannot hold out=", out);
  TORCH_CHECK(scale.device().is_cpu() && scale.scalar_type() == at::kHalf && scale.is_contiguous() &&
                  scale.dim() == 3 && scale.size(0) == P && scale.size(2) == kLanes,
              "w8_linear: scale must be a contiguous float16 CPU tensor [", P, ", groups, 16], not ",
              scale.scalar_type(), " ", scale.sizes());
  const int64_t groups = scale.size(1);
  TORCH_CHECK(groups > 0 && in % groups == 0, "w8_linear: scale has ", groups, " groups per output; the ", in,
              " inputs do not split into that many equal groups");
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
         offset.data_ptr<at::Half>(), nullptr, bp, y.data_ptr<float>(), in, out, groups, in / groups};
  if (rows > kDirectRows) {
    // widened once per call; the buffer is kept (per thread) so a prefill does not map and
    // fault in fresh pages for every projection
    static thread_local at::Tensor buf;
    if (!buf.defined() || buf.numel() < out * in) buf = at::empty({out * in}, x.options());
    dequantize(a, buf.data_ptr<float>());
    const at::Tensor wf = buf.narrow(0, 0, in * out).view({in, out});
    return (bias ? at::addmm(*bias, flat, wf) : at::mm(flat, wf)).view(sizes);
  }
  // sum_k x[k] * (q[k] * s + o) = s * sum_k x[k] q[k] + o * sum_k x[k], per group
  at::Tensor xsum = at::empty({rows, groups}, x.options());
  float* xs = xsum.data_ptr<float>();
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t g = 0; g < groups; ++g) {
      const float* xg = a.x + m * in + g * a.group;
      float t = 0.0f;
      for (int64_t k = 0; k < a.group; ++k) t += xg[k];
      xs[m * groups + g] = t;
    }
  a.xsum = xs;
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
  m.def("w8_linear(Tensor x, Tensor panel, Tensor scale, Tensor offset, Tensor? bias, int out, str isa) -> Tensor");
  m.def("w8_isas() -> str[]", &w8_isas);
}

TORCH_LIBRARY_IMPL(tritonlm, CPU, m) { m.impl("w8_linear", &w8_linear); }
