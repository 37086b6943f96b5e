// The small element-wise steps of a decoder layer, each one op instead of several.
//
// At small batches a small model's decode step spends about as long on its many small
// torch ops (each a dispatch, an allocation and a pass over a few hundred floats) as on
// its matmuls (docs/performance-notes.md). These fuse the ones every layer runs:
//
//   rms_norm(x, w, eps)                  x [..., C] -> w * x / sqrt(mean(x^2) + eps)
//   add_rms_norm(x, delta, w, eps)       -> (s = x + delta, rms_norm(s, w, eps)): the
//                                        residual add and the next layer's norm in one pass
//   silu_mul(gate_up)                    [..., 2F] -> silu(gate) * up: Llama's MLP activation
//   greedy_argmax(logits)                [n, V] -> [n] int64: each row's first largest index, -1
//                                        where that value is not finite (greedy sampling)
//   int8_linear(x, smooth, bias, packed, buf, reduce_range)
//                                        x [..., in] -> [..., out] through PyTorch's dynamic int8
//                                        linear (fbgemm), each row quantized alone: the row
//                                        scaling, the kernel and the rescale (+ bias) in one op
//
// float32, CPU, contiguous; the same math as transformers' float32 modules up to the
// order of a sum and exp's last bit (simd_math.h). Rows are split over torch's thread team
// only when there are enough of them to pay for waking it.
// Registered as torch.ops.tritonlm.<name>.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/native/quantized/PackedParams.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

#include "simd_math.h"

namespace {

constexpr int64_t kGrainFloats = 32768;  // floats per task: below this, one thread does it all

void check_float_rows(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous() && t.dim() >= 1, op, ": ",
              name, " must be a contiguous float32 CPU tensor");
}

// y = w * (x * inv_rms), inv_rms = 1 / sqrt(mean(x^2) + eps), for one row of C
inline void rms_row(const float* x, const float* w, float eps, float* y, int64_t C) {
  const float ss = tritonlm_simd::dot(x, x, C);  // fixed order: a row's bits do not depend on its batch
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(C) + eps);
#pragma omp simd
  for (int64_t i = 0; i < C; ++i) y[i] = w[i] * (x[i] * inv);
}

void check_norm(const at::Tensor& x, const at::Tensor& w, const char* op) {
  check_float_rows(x, op, "x");
  check_float_rows(w, op, "w");
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(-1), op, ": w has ", w.numel(), " values; x's rows have ",
              x.size(-1));
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_norm(x, w, "rms_norm");
  const int64_t C = x.size(-1), rows = C ? x.numel() / C : 0;
  at::Tensor y = at::empty_like(x);
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, rows, std::max<int64_t>(1, kGrainFloats / std::max<int64_t>(C, 1)), [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) rms_row(xp + r * C, wp, static_cast<float>(eps), yp + r * C, C);
  });
  return y;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& w,
                                                double eps) {
  check_norm(x, w, "add_rms_norm");
  check_float_rows(delta, "add_rms_norm", "delta");
  TORCH_CHECK(delta.sizes() == x.sizes(), "add_rms_norm: delta ", delta.sizes(), " must have x's shape ", x.sizes());
  const int64_t C = x.size(-1), rows = C ? x.numel() / C : 0;
  at::Tensor s = at::empty_like(x), y = at::empty_like(x);
  const float *xp = x.data_ptr<float>(), *dp = delta.data_ptr<float>(), *wp = w.data_ptr<float>();
  float *sp = s.data_ptr<float>(), *yp = y.data_ptr<float>();
  at::parallel_for(0, rows, std::max<int64_t>(1, kGrainFloats / std::max<int64_t>(C, 1)), [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      const float *xr = xp + r * C, *dr = dp + r * C;
      float* sr = sp + r * C;
#pragma omp simd
      for (int64_t i = 0; i < C; ++i) sr[i] = xr[i] + dr[i];
      rms_row(sr, wp, static_cast<float>(eps), yp + r * C, C);
    }
  });
  return {s, y};
}

// silu(g) * u = g / (1 + e^-g) * u
at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_float_rows(gate_up, "silu_mul", "gate_up");
  const int64_t F2 = gate_up.size(-1);
  TORCH_CHECK(F2 % 2 == 0, "silu_mul: gate_up's last dim (", F2, ") must be even: [gate | up]");
  const int64_t F = F2 / 2, rows = F ? gate_up.numel() / F2 : 0;
  auto sizes = gate_up.sizes().vec();
  sizes.back() = F;
  at::Tensor out = at::empty(sizes, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, std::max<int64_t>(1, kGrainFloats / std::max<int64_t>(F, 1)), [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      const float *g = gp + r * F2, *u = g + F;
      float* o = op + r * F;
      int64_t i = 0;
#if defined(__AVX512F__)
      const __m512 one = _mm512_set1_ps(1.f);
      for (; i + 16 <= F; i += 16) {
        const __m512 gv = _mm512_loadu_ps(g + i);
        const __m512 e = tritonlm_simd::exp(_mm512_sub_ps(_mm512_setzero_ps(), gv));
        _mm512_storeu_ps(o + i, _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(one, e)), _mm512_loadu_ps(u + i)));
      }
#elif defined(__AVX2__) && defined(__FMA__)
      const __m256 one = _mm256_set1_ps(1.f);
      for (; i + 8 <= F; i += 8) {
        const __m256 gv = _mm256_loadu_ps(g + i);
        const __m256 e = tritonlm_simd::exp(_mm256_sub_ps(_mm256_setzero_ps(), gv));
        _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
      }
#endif
      for (; i < F; ++i) o[i] = g[i] / (1.f + tritonlm_simd::exp(-g[i])) * u[i];
    }
  });
  return out;
}

// y = (x * smooth) @ W^T + bias through the packed int8 weights, each row of x quantized on
// its own (Int8Linear.apply says why): row r is scaled to max |.| = 1 into buf[1 + r]
// (buf's row 0 is the pinned (1, -1, 0, ...) that fixes the kernel's range to [-1, 1]), the
// kernel runs on buf[:1 + rows], and its row 1 + r is multiplied back by the scale. The
// float steps round as the torch ops they replace (x * smooth, then / scale; y * scale,
// then + bias): the same bits as Int8Linear's torch path. Returns a view of the kernel's output.
at::Tensor int8_linear(const at::Tensor& x, const std::optional<at::Tensor>& smooth,
                       const std::optional<at::Tensor>& bias,
                       const c10::intrusive_ptr<LinearPackedParamsBase>& packed, const at::Tensor& buf,
                       bool reduce_range) {
  check_float_rows(x, "int8_linear", "x");
  check_float_rows(buf, "int8_linear", "buf");
  const int64_t C = x.size(-1), rows = C ? x.numel() / C : 0;
  TORCH_CHECK(buf.dim() == 2 && buf.size(1) == C && buf.size(0) >= rows + 1, "int8_linear: buf must be [>= ", rows + 1,
              ", ", C, "] (the pinned row and x's rows), not ", buf.sizes());
  const float* sp = nullptr;
  if (smooth.has_value()) {
    check_float_rows(*smooth, "int8_linear", "smooth");
    TORCH_CHECK(smooth->numel() == C, "int8_linear: smooth has ", smooth->numel(), " values; x's rows have ", C);
    sp = smooth->data_ptr<float>();
  }
  std::vector<float> scale(rows);
  const float* xp = x.data_ptr<float>();
  float* in = buf.data_ptr<float>() + C;  // row 1
  at::parallel_for(0, rows, std::max<int64_t>(1, kGrainFloats / std::max<int64_t>(C, 1)), [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      const float* xr = xp + r * C;
      float* o = in + r * C;
      float m = 0.f;
      if (sp) {
#pragma omp simd
        for (int64_t i = 0; i < C; ++i) o[i] = xr[i] * sp[i];
      } else {
        std::memcpy(o, xr, sizeof(float) * C);
      }
#pragma omp simd reduction(max : m)
      for (int64_t i = 0; i < C; ++i) m = std::max(m, std::fabs(o[i]));  // max is exact in any order
      m = std::max(m, 1e-30f);
#pragma omp simd
      for (int64_t i = 0; i < C; ++i) o[i] = o[i] / m;
      scale[r] = m;
    }
  });
  at::Tensor y = packed->apply_dynamic(buf.narrow(0, 0, rows + 1), reduce_range);  // [1 + rows, out]
  TORCH_CHECK(y.scalar_type() == at::kFloat && y.is_contiguous() && y.dim() == 2, "int8_linear: the kernel returned ",
              y.scalar_type(), " ", y.sizes());
  const int64_t N = y.size(1);
  const float* bp = nullptr;
  if (bias.has_value()) {
    check_float_rows(*bias, "int8_linear", "bias");
    TORCH_CHECK(bias->numel() == N, "int8_linear: bias has ", bias->numel(), " values; the weights have ", N,
                " outputs");
    bp = bias->data_ptr<float>();
  }
  float* yp = y.data_ptr<float>() + N;  // row 1
  at::parallel_for(0, rows, std::max<int64_t>(1, kGrainFloats / std::max<int64_t>(N, 1)), [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      float* yr = yp + r * N;
      const float m = scale[r];
#pragma omp simd
      for (int64_t j = 0; j < N; ++j) yr[j] *= m;
      if (bp) {  // a second pass: y * m + b in one would compile to an fma, one rounding fewer than torch's
#pragma omp simd
        for (int64_t j = 0; j < N; ++j) yr[j] += bp[j];
      }
    }
  });
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  return y.narrow(0, 1, rows).view(sizes);
}

// The first index of the row's largest value, or -1 where that value is not finite (the row
// holds a NaN, or its largest is +-inf). Two passes over the row: its maximum (NaN seen
// apart: the vector max does not order it), then the first position equal to it. torch.max
// over a dim reduces value and index together, element by element: slower than these two
// vector passes (docs/performance-notes.md).
inline int64_t argmax_row(const float* x, int64_t V) {
  int64_t i = 0;
  float m = -std::numeric_limits<float>::infinity();
  bool nan = false;
#if defined(__AVX512F__)
  __m512 acc = _mm512_set1_ps(m);
  __mmask16 unordered = 0;
  for (; i + 16 <= V; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    acc = _mm512_max_ps(acc, v);
  }
  m = _mm512_reduce_max_ps(acc);
  nan = unordered != 0;
#elif defined(__AVX2__)
  __m256 acc = _mm256_set1_ps(m);
  __m256 unordered = _mm256_setzero_ps();
  for (; i + 8 <= V; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    acc = _mm256_max_ps(acc, v);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  for (float l : lanes) m = std::max(m, l);
  nan = _mm256_movemask_ps(unordered) != 0;
#endif
  for (; i < V; ++i) {
    nan |= std::isnan(x[i]);
    m = std::max(m, x[i]);
  }
  if (nan || !std::isfinite(m)) return -1;
  i = 0;
#if defined(__AVX512F__)
  const __m512 mv = _mm512_set1_ps(m);
  for (; i + 16 <= V; i += 16) {
    const __mmask16 eq = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), mv, _CMP_EQ_OQ);
    if (eq) return i + __builtin_ctz(eq);
  }
#elif defined(__AVX2__)
  const __m256 mv = _mm256_set1_ps(m);
  for (; i + 8 <= V; i += 8) {
    const int eq = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), mv, _CMP_EQ_OQ));
    if (eq) return i + __builtin_ctz(eq);
  }
#endif
  for (; i < V; ++i)
    if (x[i] == m) return i;
  return -1;  // not reached: m is one of the row's values
}

// logits [n, V] float32 -> [n] int64: each row's argmax as argmax_row gives it (-1: not finite).
at::Tensor greedy_argmax(const at::Tensor& logits) {
  check_float_rows(logits, "greedy_argmax", "logits");
  TORCH_CHECK(logits.dim() == 2, "greedy_argmax: logits must be [n, V], not ", logits.sizes());
  const int64_t n = logits.size(0), V = logits.size(1);
  at::Tensor out = at::empty({n}, logits.options().dtype(at::kLong));
  const float* xp = logits.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  if (V == 0) {
    std::fill(op, op + n, -1);
    return out;
  }
  at::parallel_for(0, n, std::max<int64_t>(1, kGrainFloats / V), [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) op[r] = argmax_row(xp + r * V, V);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tritonlm, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor delta, Tensor w, float eps) -> (Tensor, Tensor)");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("greedy_argmax(Tensor logits) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor? smooth, Tensor? bias, "
        "__torch__.torch.classes.quantized.LinearPackedParamsBase packed, Tensor(a!) buf, bool reduce_range) -> Tensor");
}

TORCH_LIBRARY_IMPL(tritonlm, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_mul", &silu_mul);
  m.impl("greedy_argmax", &greedy_argmax);
  m.impl("int8_linear", &int8_linear);
}
