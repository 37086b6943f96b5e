// Weight-only int8 projections (`dtype: int8_weight_only`): int8 weights with float32 scales
// (one per output channel, or one per group of consecutive inputs of a channel), float32
// activations.
//
//   w8_linear(x [..., in] f32, w [out, in] int8, scale [out, G] f32, bias [out] f32 or None, isa)
//       -> y [..., out] f32, y = x @ (w * scale)^T + bias, each scale covering in / G inputs:
//       G = 1 per output channel; G > 1 groups of in / G inputs, a multiple of 16
//   w8_isas() -> the instruction sets w8_linear can run here, best first ("avx512", "avx2", "scalar")
//
// isa: "auto" (the best this CPU has, read from its flags at run time) or one of w8_isas(),
// so tests can run every path the CPU allows; one it lacks is refused by name.
//
// Why not int8 x int8 (decode_ops.cpp's int8_linear): quantizing activations per token is
// where int8's disagreement with float32 comes from; a decode step is bound by streaming
// the weights from memory, so reading them as int8 (a quarter of float32's bytes) and
// widening each to float in registers keeps most of int8's speed with float activations.
//
// Rows (M = x's rows):
//   M <= kDirectRows  each weight vector is loaded and widened in registers once per group of
//                     rows (AVX-512: 16 lanes, 4 rows, 2 with group scales; AVX2: 8 lanes,
//                     2 rows, 1 with group scales), a group's sum scaled once, 4 output
//                     channels at a time, every row against a tile of 32 channels before the
//                     next (the weights are read from memory once), over torch's
//                     thread team by blocks of output channels; each dot product is summed in
//                     an order that depends on `in` only, so a row's bits do not depend on the
//                     other rows of its batch
//   M >  kDirectRows  (prefill chunks) compute-bound: the weight is widened once per call into
//                     a reused float buffer and multiplied by a GEMM (at::linear)

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace {

constexpr int64_t kDirectRows = 64;       // above this, dequantize once and run a GEMM
constexpr int64_t kChannelBlock = 4;      // output channels per inner loop (shares each x load)
constexpr int64_t kChannelTile = 32;      // channels whose weights stay in cache while every row passes
constexpr int64_t kGrainWeights = 65536;  // int8 weights per task: below this, one thread

enum class Isa { kScalar, kAvx2, kAvx512 };

bool cpu_has(Isa isa) {
  switch (isa) {
    case Isa::kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
    case Isa::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    default:
      return true;
  }
}

const char* isa_name(Isa isa) {
  return isa == Isa::kAvx512 ? "avx512" : isa == Isa::kAvx2 ? "avx2" : "scalar";
}

Isa pick_isa(std::string_view asked) {
  if (asked == "auto") {
    for (Isa isa : {Isa::kAvx512, Isa::kAvx2})
      if (cpu_has(isa)) return isa;
    return Isa::kScalar;
  }
  for (Isa isa : {Isa::kAvx512, Isa::kAvx2, Isa::kScalar}) {
    if (asked == isa_name(isa)) {
      TORCH_CHECK(cpu_has(isa), "w8_linear: isa '", asked, "' is not supported by this CPU; it runs ",
                  isa_name(pick_isa("auto")), " (see w8_isas())");
      return isa;
    }
  }
  TORCH_CHECK(false, "w8_linear: isa '", asked, "' is not one of auto, avx512, avx2, scalar");
}

// Each kernel: channels [n0, n1) of y's first `rows` rows, y = x . w_n * s_n + b_n.
// x rows are `in` apart, y rows `out` apart.
struct Args {
  const float* x;
  const int8_t* w;
  const float* scale;  // [out, groups]
  const float* bias;
  float* y;
  int64_t in, out;
  int64_t groups;  // 1: the scale applies to the whole dot product; else inside it, per group
  int64_t group;   // in / groups
};

inline void finish(const Args& a, int64_t m, int64_t n, float dot) {
  float v = a.groups == 1 ? dot * a.scale[n] : dot;
  if (a.bias) v += a.bias[n];
  a.y[m * a.out + n] = v;
}

// The portable path (no intrinsics; the compiler may still vectorize it for the host).
void rows_scalar(const Args& a, int64_t rows, int64_t n0, int64_t n1) {
  for (int64_t m = 0; m < rows; ++m) {
    const float* xr = a.x + m * a.in;
    for (int64_t n = n0; n < n1; ++n) {
      const int8_t* wr = a.w + n * a.in;
      const float* sr = a.scale + n * a.groups;
      float lanes[8] = {};  // 8 partial sums: independent chains a compiler can also vectorize
      const int64_t body = a.in - a.in % 8;
      const int64_t span = a.groups == 1 ? std::max<int64_t>(body, 1) : a.group;  // a multiple of 16 when grouped
      for (int64_t g0 = 0; g0 < body; g0 += span) {
        const float gs = a.groups == 1 ? 1.f : sr[g0 / a.group];
        for (int64_t i = g0; i < std::min(body, g0 + span); i += 8)
          for (int k = 0; k < 8; ++k) lanes[k] += xr[i + k] * (static_cast<float>(wr[i + k]) * gs);
      }
      float s = ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
      for (int64_t i = body; i < a.in; ++i) s += xr[i] * static_cast<float>(wr[i]);
      finish(a, m, n, s);
    }
  }
}

__attribute__((target("avx2,fma"))) inline float hsum256(__m256 v) {
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 h2 = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h2, _mm_shuffle_ps(h2, h2, 1)));
}

__attribute__((target("avx2,fma"))) inline __m256 widen8(const int8_t* p) {  // 8 int8 -> 8 float
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// R rows of x (1, 2 or 4) against kChannelBlock channels at a time: each weight vector is
// widened once and multiplied into R accumulators. Sums over `in` run in one order for every
// R, so a row's result does not depend on how many rows share its call.
template <int R>
__attribute__((target("avx2,fma"))) void block_avx2(const Args& a, int64_t m0, int64_t n0, int64_t n1) {
  const int64_t in = a.in, body = in - in % 8;
  const float* x[R];
  for (int r = 0; r < R; ++r) x[r] = a.x + (m0 + r) * in;
  for (int64_t n = n0; n < n1; n += kChannelBlock) {
    const int64_t nb = std::min(kChannelBlock, n1 - n);
    const int8_t* w[kChannelBlock];
    for (int64_t c = 0; c < kChannelBlock; ++c) w[c] = a.w + (n + std::min(c, nb - 1)) * in;
    __m256 acc[R][kChannelBlock];
    for (int r = 0; r < R; ++r)
      for (int64_t c = 0; c < kChannelBlock; ++c) acc[r][c] = _mm256_setzero_ps();
    const float* sc[kChannelBlock];
    for (int64_t c = 0; c < kChannelBlock; ++c) sc[c] = a.scale + (n + std::min(c, nb - 1)) * a.groups;
    if (a.groups == 1) {  // one scale per channel: applied to the whole sum (finish)
      for (int64_t i = 0; i < body; i += 8) {
        __m256 xv[R];
        for (int r = 0; r < R; ++r) xv[r] = _mm256_loadu_ps(x[r] + i);
        for (int64_t c = 0; c < kChannelBlock; ++c) {
          const __m256 wv = widen8(w[c] + i);
          for (int r = 0; r < R; ++r) acc[r][c] = _mm256_fmadd_ps(wv, xv[r], acc[r][c]);
        }
      }
    } else {  // a group's sum, then times its scale: one multiply-add per group, not a multiply per vector
      for (int64_t g0 = 0; g0 < body; g0 += a.group) {  // a group is a multiple of 16 wide
        __m256 part[R][kChannelBlock];
        for (int r = 0; r < R; ++r)
          for (int64_t c = 0; c < kChannelBlock; ++c) part[r][c] = _mm256_setzero_ps();
        for (int64_t i = g0; i < g0 + a.group; i += 8) {
          __m256 xv[R];
          for (int r = 0; r < R; ++r) xv[r] = _mm256_loadu_ps(x[r] + i);
          for (int64_t c = 0; c < kChannelBlock; ++c) {
            const __m256 wv = widen8(w[c] + i);
            for (int r = 0; r < R; ++r) part[r][c] = _mm256_fmadd_ps(wv, xv[r], part[r][c]);
          }
        }
        for (int64_t c = 0; c < kChannelBlock; ++c) {
          const __m256 sv = _mm256_set1_ps(sc[c][g0 / a.group]);
          for (int r = 0; r < R; ++r) acc[r][c] = _mm256_fmadd_ps(part[r][c], sv, acc[r][c]);
        }
      }
    }
    for (int64_t c = 0; c < nb; ++c) {
      for (int r = 0; r < R; ++r) {
        float s = hsum256(acc[r][c]);
        for (int64_t i = body; i < in; ++i) s += x[r][i] * static_cast<float>(w[c][i]);
        finish(a, m0 + r, n + c, s);
      }
    }
  }
}

void rows_avx2(const Args& a, int64_t rows, int64_t n0, int64_t n1) {
  for (int64_t c0 = n0; c0 < n1; c0 += kChannelTile) {
    const int64_t c1 = std::min(n1, c0 + kChannelTile);
    int64_t m = 0;
    if (a.groups == 1)  // 16 ymm registers: 2 rows x 4 channels (grouped: 1 row, with its group sums)
      for (; m + 2 <= rows; m += 2) block_avx2<2>(a, m, c0, c1);
    for (; m < rows; ++m) block_avx2<1>(a, m, c0, c1);
  }
}

__attribute__((target("avx512f,avx512bw"))) inline __m512 widen16(const int8_t* p) {  // 16 int8 -> 16 float
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

template <int R>
__attribute__((target("avx512f,avx512bw"))) void block_avx512(const Args& a, int64_t m0, int64_t n0, int64_t n1) {
  const int64_t in = a.in, body = in - in % 16;
  const float* x[R];
  for (int r = 0; r < R; ++r) x[r] = a.x + (m0 + r) * in;
  for (int64_t n = n0; n < n1; n += kChannelBlock) {
    const int64_t nb = std::min(kChannelBlock, n1 - n);
    const int8_t* w[kChannelBlock];
    for (int64_t c = 0; c < kChannelBlock; ++c) w[c] = a.w + (n + std::min(c, nb - 1)) * in;
    __m512 acc[R][kChannelBlock];
    for (int r = 0; r < R; ++r)
      for (int64_t c = 0; c < kChannelBlock; ++c) acc[r][c] = _mm512_setzero_ps();
    const float* sc[kChannelBlock];
    for (int64_t c = 0; c < kChannelBlock; ++c) sc[c] = a.scale + (n + std::min(c, nb - 1)) * a.groups;
    if (a.groups == 1) {  // one scale per channel: applied to the whole sum (finish)
      for (int64_t i = 0; i < body; i += 16) {
        __m512 xv[R];
        for (int r = 0; r < R; ++r) xv[r] = _mm512_loadu_ps(x[r] + i);
        for (int64_t c = 0; c < kChannelBlock; ++c) {
          const __m512 wv = widen16(w[c] + i);
          for (int r = 0; r < R; ++r) acc[r][c] = _mm512_fmadd_ps(wv, xv[r], acc[r][c]);
        }
      }
    } else {  // a group's sum, then times its scale: one multiply-add per group, not a multiply per vector
      for (int64_t g0 = 0; g0 < body; g0 += a.group) {  // a group is a multiple of 16 wide
        __m512 part[R][kChannelBlock];
        for (int r = 0; r < R; ++r)
          for (int64_t c = 0; c < kChannelBlock; ++c) part[r][c] = _mm512_setzero_ps();
        for (int64_t i = g0; i < g0 + a.group; i += 16) {
          __m512 xv[R];
          for (int r = 0; r < R; ++r) xv[r] = _mm512_loadu_ps(x[r] + i);
          for (int64_t c = 0; c < kChannelBlock; ++c) {
            const __m512 wv = widen16(w[c] + i);
            for (int r = 0; r < R; ++r) part[r][c] = _mm512_fmadd_ps(wv, xv[r], part[r][c]);
          }
        }
        for (int64_t c = 0; c < kChannelBlock; ++c) {
          const __m512 sv = _mm512_set1_ps(sc[c][g0 / a.group]);
          for (int r = 0; r < R; ++r) acc[r][c] = _mm512_fmadd_ps(part[r][c], sv, acc[r][c]);
        }
      }
    }
    for (int64_t c = 0; c < nb; ++c) {
      for (int r = 0; r < R; ++r) {
        float s = _mm512_reduce_add_ps(acc[r][c]);
        for (int64_t i = body; i < in; ++i) s += x[r][i] * static_cast<float>(w[c][i]);
        finish(a, m0 + r, n + c, s);
      }
    }
  }
}

void rows_avx512(const Args& a, int64_t rows, int64_t n0, int64_t n1) {
  for (int64_t c0 = n0; c0 < n1; c0 += kChannelTile) {
    const int64_t c1 = std::min(n1, c0 + kChannelTile);
    int64_t m = 0;
    if (a.groups == 1)  // 32 zmm registers: 4 rows x 4 channels (grouped: 2 rows, with their group sums)
      for (; m + 4 <= rows; m += 4) block_avx512<4>(a, m, c0, c1);
    for (; m + 2 <= rows; m += 2) block_avx512<2>(a, m, c0, c1);
    if (m < rows) block_avx512<1>(a, m, c0, c1);
  }
}

// w [out, in] int8 * scale [out, groups] -> buf [out, in] float32, over torch's thread team
void dequantize(const int8_t* w, const float* scale, float* buf, int64_t out, int64_t in, int64_t groups) {
  at::parallel_for(0, out, std::max<int64_t>(1, kGrainWeights / std::max<int64_t>(in, 1)), [&](int64_t lo, int64_t hi) {
    for (int64_t n = lo; n < hi; ++n) {
      const int8_t* wr = w + n * in;
      float* br = buf + n * in;
      const int64_t group = in / groups;
      for (int64_t g = 0; g < groups; ++g) {
        const float s = scale[n * groups + g];
#pragma omp simd
        for (int64_t i = g * group; i < (g + 1) * group; ++i) br[i] = static_cast<float>(wr[i]) * s;
      }
    }
  });
}

void check(bool ok, const char* what) { TORCH_CHECK(ok, "w8_linear: ", what); }

at::Tensor w8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                     const std::optional<at::Tensor>& bias, std::string_view isa_asked) {
  const Isa isa = pick_isa(isa_asked);
  check(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() >= 1,
        "x must be a contiguous float32 CPU tensor [..., in]");
  check(w.device().is_cpu() && w.scalar_type() == at::kChar && w.is_contiguous() && w.dim() == 2,
        "w must be a contiguous int8 CPU tensor [out, in]");
  const int64_t out = w.size(0), in = w.size(1);
  TORCH_CHECK(x.size(-1) == in, "w8_linear: x's rows have ", x.size(-1), " values; w takes ", in);
  TORCH_CHECK(scale.device().is_cpu() && scale.scalar_type() == at::kFloat && scale.is_contiguous() &&
                  scale.dim() == 2 && scale.size(0) == out,
              "w8_linear: scale must be a contiguous float32 CPU tensor [", out, ", groups], not ", scale.sizes());
  const int64_t groups = scale.size(1);
  TORCH_CHECK(groups == 1 || (groups > 0 && in % groups == 0 && (in / groups) % 16 == 0), "w8_linear: scale has ",
              groups, " groups per output; the ", in, " inputs must split into groups of a multiple of 16 (or use 1)");
  const float* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->device().is_cpu() && bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                    bias->numel() == out,
                "w8_linear: bias must be a contiguous float32 CPU tensor of ", out, " values (one per output)");
    bp = bias->data_ptr<float>();
  }
  const int64_t rows = in ? x.numel() / in : 0;
  auto sizes = x.sizes().vec();
  sizes.back() = out;
  if (rows > kDirectRows) {
    // widened once per call; the buffer is kept (per thread) so a prefill does not map and
    // fault in fresh pages for every projection
    static thread_local at::Tensor buf;
    if (!buf.defined() || buf.numel() < out * in) buf = at::empty({out * in}, x.options());
    dequantize(w.data_ptr<int8_t>(), scale.data_ptr<float>(), buf.data_ptr<float>(), out, in, groups);
    const at::Tensor wf = buf.narrow(0, 0, out * in).view({out, in});
    return at::linear(x.view({rows, in}), wf, bias).view(sizes);
  }
  at::Tensor y = at::empty(sizes, x.options());
  const Args a{x.data_ptr<float>(), w.data_ptr<int8_t>(), scale.data_ptr<float>(), bp, y.data_ptr<float>(),
               in, out, groups, in / groups};
  auto kernel = isa == Isa::kAvx512 ? rows_avx512 : isa == Isa::kAvx2 ? rows_avx2 : rows_scalar;
  // tasks: blocks of output channels, a multiple of kChannelBlock, each >= kGrainWeights weights
  const int64_t grain = std::max<int64_t>(1, kGrainWeights / std::max<int64_t>(in * kChannelBlock, 1));
  const int64_t blocks = (out + kChannelBlock - 1) / kChannelBlock;
  at::parallel_for(0, blocks, grain, [&](int64_t lo, int64_t hi) {
    const int64_t n0 = lo * kChannelBlock, n1 = std::min(out, hi * kChannelBlock);
    kernel(a, rows, n0, n1);
  });
  return y;
}

std::vector<std::string> w8_isas() {
  std::vector<std::string> found;
  for (Isa isa : {Isa::kAvx512, Isa::kAvx2, Isa::kScalar})
    if (cpu_has(isa)) found.emplace_back(isa_name(isa));
  return found;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tritonlm, m) {
  m.def("w8_linear(Tensor x, Tensor w, Tensor scale, Tensor? bias, str isa) -> Tensor");
  m.def("w8_isas() -> str[]", &w8_isas);
}

TORCH_LIBRARY_IMPL(tritonlm, CPU, m) { m.impl("w8_linear", &w8_linear); }
