// Float32 projections over weights in 16-wide output panels (runners/layers.py, PanelLinear).
//
//   panel_linear(x [..., in] f32, panel [P, in, 16] f32, bias [out] f32 or None, out)
//       -> y [..., out] f32, y = x @ w^T + bias, where panel[p, k, j] = w[16 p + j, k]
//          (zero beyond out)
//   panel_supported() -> whether this build has a vector kernel, AVX-512 or AVX2 (else the
//       caller keeps oneDNN's blocked layout)
//
// Why a layout of our own: a decode step's projections are bound by streaming the weights
// from memory, and at a handful of rows oneDNN's blocked kernel streams them well below
// the memory's rate on the CPUs measured (docs/performance-notes.md, "The decode step"). A
// panel is one contiguous stream of in x 16 floats: one 64-byte load per k feeds 16 output
// channels of every row in the tile, and the hardware prefetcher sees a plain sequence.
//
// Tiles: a few rows (MB) x a few panels (NP) of accumulators stay in registers over the
// whole k loop (a panel is one zmm, or two ymm on AVX2); one row's output channel is always the sum over k = 0, 1, ..., in - 1 of
// x[k] * w[k] by fused multiply-adds in that order, whatever the tile, so a row's bits do not
// depend on the other rows of its batch (a single row and the same row in a batch agree
// exactly), and AVX2's lanes compute what AVX-512's do, so both levels give the same bits.
// The bias is added last, as at::linear's does.
// Threads: torch's team, by groups of panels; rows loop inside a panel group, so each
// panel is read from memory once per call and the rows' inputs come from cache.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <optional>

#include "float_panel.h"

namespace {

using tritonlm_panel::kLanes;
// how far ahead in its panel a tile asks for weights, in floats (64 k steps): with many rows
// a tile computes long enough per load that the hardware prefetcher alone falls behind
constexpr int64_t kPrefetchAhead = 1024;

#if defined(__AVX512F__)

// rows [MB] x panels [NP] of y from x [MB, in] (row stride in) and NP panels (stride in * 16)
template <int MB, int NP>
inline void tile(const float* __restrict x, int64_t in, const float* __restrict w, const float* bias, float* __restrict y,
                 int64_t out, int64_t n0) {
  __m512 acc[MB][NP];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NP; ++j) acc[i][j] = _mm512_setzero_ps();
  const int64_t stride = in * kLanes;
  for (int64_t k = 0; k < in; ++k) {
    __m512 wk[NP];
    for (int j = 0; j < NP; ++j) {
      const float* at = w + j * stride + k * kLanes;
      _mm_prefetch(reinterpret_cast<const char*>(at + kPrefetchAhead), _MM_HINT_T0);  // past the end: a no-op
      wk[j] = _mm512_loadu_ps(at);
    }
    for (int i = 0; i < MB; ++i) {
      const __m512 xb = _mm512_set1_ps(x[i * in + k]);
      for (int j = 0; j < NP; ++j) acc[i][j] = _mm512_fmadd_ps(xb, wk[j], acc[i][j]);
    }
  }
  for (int j = 0; j < NP; ++j) {
    const int64_t n = n0 + j * kLanes, left = out - n;
    const __mmask16 mask = left >= kLanes ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + n) : _mm512_setzero_ps();
    for (int i = 0; i < MB; ++i) _mm512_mask_storeu_ps(y + i * out + n, mask, _mm512_add_ps(acc[i][j], b));
  }
}

#elif defined(__AVX2__)

// AVX2's tile: each panel's 16 lanes are two ymm (lo: channels 0-7, hi: 8-15)
template <int MB, int NP>
inline void tile(const float* __restrict x, int64_t in, const float* __restrict w, const float* bias, float* __restrict y,
                 int64_t out, int64_t n0) {
  __m256 acc[MB][NP][2];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NP; ++j) acc[i][j][0] = acc[i][j][1] = _mm256_setzero_ps();
  const int64_t stride = in * kLanes;
  for (int64_t k = 0; k < in; ++k) {
    __m256 lo[NP], hi[NP];
    for (int j = 0; j < NP; ++j) {
      const float* at = w + j * stride + k * kLanes;
      _mm_prefetch(reinterpret_cast<const char*>(at + kPrefetchAhead), _MM_HINT_T0);  // past the end: a no-op
      lo[j] = _mm256_loadu_ps(at);
      hi[j] = _mm256_loadu_ps(at + 8);
    }
    for (int i = 0; i < MB; ++i) {
      const __m256 xb = _mm256_broadcast_ss(x + i * in + k);
      for (int j = 0; j < NP; ++j) {
        acc[i][j][0] = _mm256_fmadd_ps(xb, lo[j], acc[i][j][0]);
        acc[i][j][1] = _mm256_fmadd_ps(xb, hi[j], acc[i][j][1]);
      }
    }
  }
  // the halves by constant index: a runtime one would keep acc in memory through the k loop
  const auto store = [&](int64_t n, int64_t lanes, const __m256 (&sums)[MB]) {  // channels n.. n + lanes - 1
    if (lanes <= 0) return;
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::min<int64_t>(lanes, 8))),
                                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const __m256 b = bias ? _mm256_maskload_ps(bias + n, mask) : _mm256_setzero_ps();
    for (int i = 0; i < MB; ++i) _mm256_maskstore_ps(y + i * out + n, mask, _mm256_add_ps(sums[i], b));
  };
  for (int j = 0; j < NP; ++j) {
    const int64_t n = n0 + j * kLanes, left = out - n;
    __m256 lo[MB], hi[MB];
    for (int i = 0; i < MB; ++i) {
      lo[i] = acc[i][j][0];
      hi[i] = acc[i][j][1];
    }
    store(n, left, lo);
    store(n + 8, left - 8, hi);
  }
}

#endif

#if defined(__AVX512F__) || defined(__AVX2__)

// every row of x against NP panels starting at output channel n0: tiles of MBMAX rows, then the rest
template <int NP, int MBMAX>
void all_rows(const float* x, int64_t rows, int64_t in, const float* w, const float* bias, float* y, int64_t out,
              int64_t n0) {
  int64_t m = 0;
  for (; m + MBMAX <= rows; m += MBMAX) tile<MBMAX, NP>(x + m * in, in, w, bias, y + m * out, out, n0);
  const int64_t r = rows - m;
  const float* xm = x + m * in;
  float* ym = y + m * out;
  switch (r) {
#define TRITONLM_TAIL(R) \
  case R:                \
    if constexpr (R < MBMAX) tile<R, NP>(xm, in, w, bias, ym, out, n0); \
    break;
    TRITONLM_TAIL(1) TRITONLM_TAIL(2) TRITONLM_TAIL(3) TRITONLM_TAIL(4) TRITONLM_TAIL(5) TRITONLM_TAIL(6)
    TRITONLM_TAIL(7) TRITONLM_TAIL(8) TRITONLM_TAIL(9) TRITONLM_TAIL(10) TRITONLM_TAIL(11)
#undef TRITONLM_TAIL
    default:
      break;
  }
}

// at one or two rows the k loop is a chain of dependent FMAs per accumulator: more panels
// at a time give the core more chains; more rows bring their own, and fewer panels halve
// the broadcasts per FMA. AVX2 has half the registers (16 ymm) for half-width vectors.
constexpr int64_t kFewRows = 2;  // rows that take the wide tile
#if defined(__AVX512F__)
constexpr int64_t kFewRowsPanels = 4, kFewRowsTile = 2, kManyRowsPanels = 2, kManyRowsTile = 12;
#else
constexpr int64_t kFewRowsPanels = 2, kFewRowsTile = 2, kManyRowsPanels = 1, kManyRowsTile = 6;
#endif

#endif

}  // namespace

namespace tritonlm_panel {

bool panel_vectors() {
#if defined(__AVX512F__) || defined(__AVX2__)
  return true;
#else
  return false;
#endif
}

void panel_rows(const float* x, int64_t rows, int64_t in, const float* w, int64_t np, const float* bias, float* y,
                int64_t out, int64_t n0) {
#if defined(__AVX512F__) || defined(__AVX2__)
  int64_t p = 0;
  if (rows <= kFewRows)
    for (; p + kFewRowsPanels <= np; p += kFewRowsPanels)
      all_rows<kFewRowsPanels, kFewRowsTile>(x, rows, in, w + p * in * kLanes, bias, y, out, n0 + p * kLanes);
  for (; p + kManyRowsPanels <= np; p += kManyRowsPanels)
    all_rows<kManyRowsPanels, kManyRowsTile>(x, rows, in, w + p * in * kLanes, bias, y, out, n0 + p * kLanes);
  for (; p < np; ++p) all_rows<1, kManyRowsTile>(x, rows, in, w + p * in * kLanes, bias, y, out, n0 + p * kLanes);
#endif
}

int64_t panels_per_task(int64_t rows) {
#if defined(__AVX512F__) || defined(__AVX2__)
  return rows <= kFewRows ? kFewRowsPanels : kManyRowsPanels;
#else
  return 1;
#endif
}

}  // namespace tritonlm_panel

namespace {

at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panel, const std::optional<at::Tensor>& bias,
                        int64_t out) {
  TORCH_CHECK(tritonlm_panel::panel_vectors(),
              "panel_linear: this build has no vector kernel (panel_supported() is false)");
  TORCH_CHECK(x.scalar_type() == at::kFloat && panel.scalar_type() == at::kFloat,
              "panel_linear: x and panel must be float32");
  TORCH_CHECK(panel.dim() == 3 && panel.size(2) == kLanes && panel.is_contiguous(),
              "panel_linear: panel must be a contiguous [P, in, 16] tensor");
  const int64_t in = x.size(-1), P = panel.size(0);
  TORCH_CHECK(panel.size(1) == in, "panel_linear: x has ", in, " features, the panel ", panel.size(1));
  TORCH_CHECK(out > (P - 1) * kLanes && out <= P * kLanes, "panel_linear: ", P, " panels cannot hold out=", out);
  if (bias) TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == out,
                        "panel_linear: bias must be a contiguous float32 [", out, "]");
  const at::Tensor flat = x.reshape({-1, in}).contiguous();
  const int64_t rows = flat.size(0);
  auto sizes = x.sizes().vec();
  sizes.back() = out;
  at::Tensor y = at::empty({rows, out}, x.options());
  const float* xp = flat.data_ptr<float>();
  const float* wp = panel.data_ptr<float>();
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t np = tritonlm_panel::panels_per_task(rows);
  at::parallel_for(0, (P + np - 1) / np, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t p = g * np;
      tritonlm_panel::panel_rows(xp, rows, in, wp + p * in * kLanes, std::min(np, P - p), bp, yp, out, p * kLanes);
    }
  });
  return y.view(sizes);
}

bool panel_supported() { return tritonlm_panel::panel_vectors(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(tritonlm, m) {
  m.def("panel_linear(Tensor x, Tensor panel, Tensor? bias, int out) -> Tensor");
  m.def("panel_supported() -> bool", &panel_supported);
}

TORCH_LIBRARY_IMPL(tritonlm, CPU, m) {
  m.impl("panel_linear", &panel_linear);
}
