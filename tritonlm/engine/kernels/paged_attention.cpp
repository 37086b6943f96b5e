// Paged attention for the CPU: attention that reads each sequence's keys and values
// straight from the paged KV pool through its slot table, with no gathered copy.
//
// The torch path (transformer.paged_attention) copies every row's K and V into a dense
// [B, Hkv, L, D] buffer per layer (index_select) and runs scaled_dot_product_attention
// on it: the pool is read once, the copy written once and read again. On the 2-core
// test host that copy and SDPA were a third of a float32 decode step at batch 32. This
// kernel reads each key and value row once, for all the query rows that share it.
//
//   q            [B, T, H, D]  float32, contiguous (the new tokens' queries)
//   k/v_cache    [S, Hkv, D]   float32, contiguous (one layer of the pool)
//   slot_table   [B, L]        int64: slot of position j of row b
//   positions    [B, T]        int64: absolute position of new token t of row b; it sees
//                              keys 0..positions[b, t] (causal; the key exists)
//   out          [B, T, H, D]  float32
// Query head h reads kv head h / (H / Hkv) (grouped-query attention). Work is split
// over (row, kv head) pairs with at::parallel_for: torch's own thread team.
//
// Registered as torch.ops.tritonlm.paged_attention.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// N > 0: a head size known at compile time (fully unrolled); N == 0: n at run time.
// With AVX-512 (compiled for the host, see kernels/__init__.py) the hot loops are written
// with its intrinsics; elsewhere plain loops that the compiler vectorizes as it can.
template <int N>
inline float dot(const float* a, const float* b, int64_t n) {
#if defined(__AVX512F__)
  if constexpr (N > 0 && N % 32 == 0) {
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    for (int i = 0; i < N; i += 32) {
      acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc0);
      acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), acc1);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
  }
#endif
  const int64_t len = N > 0 ? N : n;
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < len; ++i) s += a[i] * b[i];
  return s;
}

template <int N>
inline void axpy(float* y, float a, const float* x, int64_t n) {
#if defined(__AVX512F__)
  if constexpr (N > 0 && N % 16 == 0) {
    const __m512 av = _mm512_set1_ps(a);
    for (int i = 0; i < N; i += 16)
      _mm512_storeu_ps(y + i, _mm512_fmadd_ps(av, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
    return;
  }
#endif
  const int64_t len = N > 0 ? N : n;
#pragma omp simd
  for (int64_t i = 0; i < len; ++i) y[i] += a * x[i];
}

// x[i] <- exp(x[i] - m) (every x[i] <= m); returns their sum. exp(x - m) = 2^v with
// v = (x - m) log2 e = k + f, k = round(v), f in [-0.5, 0.5]; 2^f by its degree-6 Taylor
// polynomial (relative error ~1e-7, about float32's own rounding). v is clamped at -126:
// terms below 2^-126 (~1e-38) come out as ~1e-38, far below what a sum that includes
// exp(0) = 1 can register.
constexpr float kExpC[7] = {1.0f, 6.9314718055994531e-1f, 2.4022650695910071e-1f, 5.5504108664821580e-2f,
                            9.6181291076284772e-3f, 1.3333558146428443e-3f, 1.5403530393381606e-4f};

inline float exp_shifted(float x, float m) {
  const float v = std::max((x - m) * 1.44269504088896341f, -126.f);
  const float k = std::nearbyint(v), f = v - k;
  float p = kExpC[6];
  for (int c = 5; c >= 0; --c) p = p * f + kExpC[c];
  const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;  // 2^k
  float two_k;
  std::memcpy(&two_k, &bits, sizeof(two_k));
  return p * two_k;
}

inline float exp_shifted_sum(float* x, int64_t n, float m) {
  int64_t i = 0;
  float sum = 0.f;
#if defined(__AVX512F__)
  const __m512 mv = _mm512_set1_ps(m), log2e = _mm512_set1_ps(1.44269504088896341f), lo = _mm512_set1_ps(-126.f);
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_max_ps(_mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(x + i), mv), log2e), lo);
    const __m512 k = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(v, k);
    __m512 p = _mm512_set1_ps(kExpC[6]);
    for (int c = 5; c >= 0; --c) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExpC[c]));
    const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(k), _mm512_set1_epi32(127)), 23);
    const __m512 e = _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
    _mm512_storeu_ps(x + i, e);
    acc = _mm512_add_ps(acc, e);
  }
  sum = _mm512_reduce_add_ps(acc);
#endif
  for (; i < n; ++i) {
    x[i] = exp_shifted(x[i], m);
    sum += x[i];
  }
  return sum;
}

constexpr int64_t kRowBlock = 4;  // query rows handled together (their state fits in registers)

// scores[r, j] = q_r . k_j * scale for j < nkeys[r], r < nrows <= kRowBlock; k_j is the
// key of position j, kv head g. Each key row is read once for the block's rows.
template <int HD>
inline void score_rows(const float* const* q, const int64_t* nkeys, int64_t nrows, const float* kp,
                       const int64_t* slots, int64_t Hkv, int64_t g, int64_t D, float sc, float* scores,
                       int64_t stride) {
  const int64_t n_max = nkeys[nrows - 1];  // rows are in order of t: the last sees the most keys
  for (int64_t j = 0; j < n_max; ++j) {
    const float* kj = kp + (slots[j] * Hkv + g) * D;
    for (int64_t r = 0; r < nrows; ++r)
      if (j < nkeys[r]) scores[r * stride + j] = dot<HD>(q[r], kj, D) * sc;
  }
}

// out_r = sum_j p[r, j] v_j over j < nkeys[r], for a block of rows; the block's outputs
// are accumulated in registers when the head size is known (AVX-512), each value row read once.
template <int HD>
inline void weigh_values(float* const* out, const int64_t* nkeys, int64_t nrows, const float* vp,
                         const int64_t* slots, int64_t Hkv, int64_t g, int64_t D, const float* p, int64_t stride) {
  const int64_t n_max = nkeys[nrows - 1];
#if defined(__AVX512F__)
  if constexpr (HD > 0 && HD % 16 == 0 && HD <= 128) {
    constexpr int V = HD / 16;
    __m512 acc[kRowBlock][V];
#pragma GCC unroll 4
    for (int r = 0; r < kRowBlock; ++r)
#pragma GCC unroll 8
      for (int c = 0; c < V; ++c) acc[r][c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < n_max; ++j) {
      const float* vj = vp + (slots[j] * Hkv + g) * D;
      __m512 v[V];
#pragma GCC unroll 8
      for (int c = 0; c < V; ++c) v[c] = _mm512_loadu_ps(vj + 16 * c);
#pragma GCC unroll 4
      for (int r = 0; r < kRowBlock; ++r) {
        if (r < nrows && j < nkeys[r]) {
          const __m512 pr = _mm512_set1_ps(p[r * stride + j]);
#pragma GCC unroll 8
          for (int c = 0; c < V; ++c) acc[r][c] = _mm512_fmadd_ps(pr, v[c], acc[r][c]);
        }
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < kRowBlock; ++r)
      if (r < nrows)
#pragma GCC unroll 8
        for (int c = 0; c < V; ++c) _mm512_storeu_ps(out[r] + 16 * c, acc[r][c]);
    return;
  }
#endif
  for (int64_t r = 0; r < nrows; ++r) std::fill(out[r], out[r] + D, 0.f);
  for (int64_t j = 0; j < n_max; ++j) {
    const float* vj = vp + (slots[j] * Hkv + g) * D;
    for (int64_t r = 0; r < nrows; ++r)
      if (j < nkeys[r]) axpy<HD>(out[r], p[r * stride + j], vj, D);
  }
}

template <int HD>
void attend(const float* qp, const float* kp, const float* vp, const int64_t* st, const int64_t* pos, float* op,
            int64_t B, int64_t T, int64_t H, int64_t D, int64_t Hkv, int64_t L, float sc) {
  const int64_t group = H / Hkv;
  const int64_t rows = T * group;  // query rows that read one kv head of one sequence

  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;  // [rows, n_max] for one (b, g)
    std::vector<const float*> qrow(rows);
    std::vector<float*> orow(rows);
    std::vector<int64_t> nkeys(rows);
    std::vector<float> inv_sum(rows);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / Hkv, g = item % Hkv;
      int64_t n_max = 0;
      for (int64_t t = 0; t < T; ++t) {
        const int64_t n = pos[b * T + t] + 1;  // keys 0..positions[b, t]
        n_max = std::max(n_max, n);
        for (int64_t i = 0; i < group; ++i) {
          const int64_t r = t * group + i, h = g * group + i;
          qrow[r] = qp + ((b * T + t) * H + h) * D;
          orow[r] = op + ((b * T + t) * H + h) * D;
          nkeys[r] = n;
        }
      }
      scores.resize(rows * n_max);
      const int64_t* slots = st + b * L;
      // scores: each key row is loaded once for every query row that reads it
      for (int64_t r0 = 0; r0 < rows; r0 += kRowBlock)
        score_rows<HD>(qrow.data() + r0, nkeys.data() + r0, std::min(kRowBlock, rows - r0), kp, slots, Hkv, g, D,
                       sc, scores.data() + r0 * n_max, n_max);
      // softmax over each row's own keys
      for (int64_t r = 0; r < rows; ++r) {
        float* s = scores.data() + r * n_max;
        const int64_t n = nkeys[r];
        float m = s[0];
        for (int64_t j = 1; j < n; ++j) m = std::max(m, s[j]);
        inv_sum[r] = 1.f / exp_shifted_sum(s, n, m);
      }
      // out = p @ V: each value row loaded once
      for (int64_t r0 = 0; r0 < rows; r0 += kRowBlock)
        weigh_values<HD>(orow.data() + r0, nkeys.data() + r0, std::min(kRowBlock, rows - r0), vp, slots, Hkv, g, D,
                         scores.data() + r0 * n_max, n_max);
      for (int64_t r = 0; r < rows; ++r) {
        float* o = orow[r];
        const float f = inv_sum[r];
#pragma omp simd
        for (int64_t i = 0; i < D; ++i) o[i] *= f;
      }
    }
  });
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& slot_table, const at::Tensor& positions, double scale) {
  TORCH_CHECK(q.dim() == 4 && k_cache.dim() == 3 && v_cache.dim() == 3, "paged_attention: q must be [B, T, H, D], "
              "k_cache and v_cache [S, Hkv, D]");
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(),
              "paged_attention: CPU tensors only");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat &&
              v_cache.scalar_type() == at::kFloat, "paged_attention: float32 only");
  TORCH_CHECK(slot_table.scalar_type() == at::kLong && positions.scalar_type() == at::kLong,
              "paged_attention: slot_table and positions must be int64");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
              slot_table.is_contiguous() && positions.is_contiguous(), "paged_attention: contiguous tensors only");
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), D = q.size(3);
  const int64_t S = k_cache.size(0), Hkv = k_cache.size(1), L = slot_table.size(1);
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.size(2) == D, "paged_attention: cache shape mismatch");
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, "paged_attention: query heads must be a multiple of kv heads");
  TORCH_CHECK(slot_table.size(0) == B && positions.size(0) == B && positions.size(1) == T,
              "paged_attention: slot_table [B, L] and positions [B, T] must match q");
  const int64_t group = H / Hkv;
  const float sc = static_cast<float>(scale);

  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int64_t* st = slot_table.data_ptr<int64_t>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t i = 0; i < B * T; ++i)
    TORCH_CHECK(pos[i] >= 0 && pos[i] < L, "paged_attention: position ", pos[i], " outside the slot table [0, ", L, ")");
  for (int64_t i = 0; i < B * L; ++i)
    TORCH_CHECK(st[i] >= 0 && st[i] < S, "paged_attention: slot ", st[i], " outside the pool [0, ", S, ")");

  at::Tensor out = at::empty_like(q);
  float* op = out.data_ptr<float>();
  if (D == 64) attend<64>(qp, kp, vp, st, pos, op, B, T, H, D, Hkv, L, sc);
  else if (D == 128) attend<128>(qp, kp, vp, st, pos, op, B, T, H, D, Hkv, L, sc);
  else attend<0>(qp, kp, vp, st, pos, op, B, T, H, D, Hkv, L, sc);
  return out;
}

}  // namespace

TORCH_LIBRARY(tritonlm, m) {
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slot_table, Tensor positions, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(tritonlm, CPU, m) {
  m.impl("paged_attention", &paged_attention);
}
