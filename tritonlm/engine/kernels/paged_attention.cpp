// Paged attention for the CPU: a decode step's attention, from the fused q/k/v projection's
// output to the attention output, reading each sequence's keys and values straight from
// the paged KV pool through its slot table, with no gathered copy.
//
// The torch path (layers.paged_attention) copies every row's K and V into a dense
// [B, Hkv, L, D] buffer per layer (index_select) and runs scaled_dot_product_attention
// on it: the pool is read once, the copy written once and read again, a large share of a
// float32 decode step at larger batches (docs/performance-notes.md). This kernel reads
// each key and value row once, for all the query rows that share it. It also
// does what the torch path spends ~15 small ops per layer on, which at batch 1 cost more
// than the attention itself: RoPE on q and k, and writing the new k and v into the pool.
//
//   qkv          [B, T, (H + 2 Hkv) D]  float32, contiguous: [q | k | v] of the new tokens
//   k/v_cache    [S, Hkv, D]   float32, contiguous (one layer of the pool), written in place
//   write_slots  [B, T]        int64: pool slot of new token t of row b (padding: scratch)
//   slot_table   [B, L]        int64: slot of position j of row b
//   positions    [B, T]        int64: absolute position of new token t of row b; it sees
//                              keys 0..positions[b, t] (causal; the key exists)
//   cos, sin     [B, T, D]     float32 RoPE factors (Llama family), or None (GPT-2)
//   window       int           > 0: only keys at positions p - window < j <= p (a sliding
//                              window, transformers' sliding_window_overlay); 0: none
//   softcap      float         > 0: scores s -> softcap * tanh(s / softcap) (Gemma 2), after
//                              the scale, before the mask; 0: none
//   sinks        [H]           float32 or None: a logit per query head that joins each row's
//                              softmax and weighs no value (gpt-oss's attention sinks):
//                              out = sum_j e^(s_j) v_j / (sum_j e^(s_j) + e^(sink))
//   out          [B, T, H * D] float32
// Query head h reads kv head h / (H / Hkv) (grouped-query attention). Work is split
// over (row, kv head) pairs with at::parallel_for: torch's own thread team. A row's keys
// are [first, n): first = 0 without a window; only those are read.
//
// Registered as torch.ops.tritonlm.paged_attention_qkv.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "simd_math.h"

namespace {

// N > 0: a head size known at compile time (fully unrolled); N == 0: n at run time.
// With AVX-512 (compiled for the host, see kernels/__init__.py) the hot loops are written
// with its intrinsics; elsewhere plain loops that the compiler vectorizes as it can.
template <int N>
inline float dot(const float* a, const float* b, int64_t n) {
  return tritonlm_simd::dot(a, b, N > 0 ? N : n);  // N known: the compiler unrolls it
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

// x[i] <- exp(x[i] - m) (every x[i] <= m); returns their sum.
inline float exp_shifted_sum(float* x, int64_t n, float m) {
  int64_t i = 0;
  float sum = 0.f;
#if defined(__AVX512F__)
  const __m512 mv = _mm512_set1_ps(m);
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    const __m512 e = tritonlm_simd::exp(_mm512_sub_ps(_mm512_loadu_ps(x + i), mv));
    _mm512_storeu_ps(x + i, e);
    acc = _mm512_add_ps(acc, e);
  }
  sum = _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__) && defined(__FMA__)
  const __m256 mv = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 e = tritonlm_simd::exp(_mm256_sub_ps(_mm256_loadu_ps(x + i), mv));
    _mm256_storeu_ps(x + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  for (float l : lanes) sum += l;
#endif
  for (; i < n; ++i) {
    x[i] = tritonlm_simd::exp(x[i] - m);
    sum += x[i];
  }
  return sum;
}

constexpr int64_t kRowBlock = 4;  // query rows handled together (their state fits in registers)

// scores[r, j - base] = q_r . k_j * scale for first[r] <= j < nkeys[r], r < nrows <= kRowBlock;
// k_j is the key of position j, kv head g. Each key row is read once for the block's rows
// (a row may get scores of keys before its first too: they are never read). With
// AVX-512 and a head size of 16k, 16 keys at a time: their dot products' horizontal sums
// taken together (reduce_add_16), the same bits as dot() (a row's tail of < 16 keys takes
// dot()). Both loops prefetch the key rows 16 positions ahead, as weigh_values does the
// value rows 8 ahead: a row's address comes through the slot table, which the hardware
// prefetcher cannot follow (docs/performance-notes.md).
template <int HD>
inline void score_rows(const float* const* q, const int64_t* first, const int64_t* nkeys, int64_t nrows,
                       const float* kp, const int64_t* slots, int64_t Hkv, int64_t g, int64_t D, float sc,
                       float* scores, int64_t stride, int64_t base) {
  const int64_t n_max = nkeys[nrows - 1];  // rows are in order of t: the last sees the most keys
  const int64_t j_lo = first[0];           // and the first the earliest (windows slide with t)
  int64_t j0 = j_lo;
#if defined(__AVX512F__)
  const int64_t hd = HD > 0 ? HD : D;  // the head size, known at compile time or not
  if (hd % 16 == 0) {
    const __m512 scv = _mm512_set1_ps(sc);
    for (; j0 + 16 <= n_max; j0 += 16) {  // the block's 16 key rows stay in L1 for its query rows
      const float* kj[16];
      for (int k = 0; k < 16; ++k) kj[k] = kp + (slots[j0 + k] * Hkv + g) * D;
      if (j0 + 32 <= n_max)
        for (int k = 0; k < 16; ++k) {
          const char* nx = reinterpret_cast<const char*>(kp + (slots[j0 + 16 + k] * Hkv + g) * D);
          for (int64_t c = 0; c < hd * 4; c += 64) _mm_prefetch(nx + c, _MM_HINT_T0);
        }
      for (int64_t r = 0; r < nrows; ++r) {
        float* s = scores + r * stride;    // s[j - base]: key j's score
        if (j0 + 16 <= first[r]) continue;  // keys before the row's window
        if (j0 + 16 <= nkeys[r]) {
          __m512 x[16];
#pragma GCC unroll 16
          for (int k = 0; k < 16; ++k) x[k] = tritonlm_simd::dot_lanes(q[r], kj[k], hd);
          _mm512_storeu_ps(s + j0 - base, _mm512_mul_ps(tritonlm_simd::reduce_add_16(x), scv));
        } else {
          for (int64_t j = j0; j < std::min(j0 + 16, nkeys[r]); ++j) s[j - base] = dot<HD>(q[r], kj[j - j0], D) * sc;
        }
      }
    }
  }
#endif
  for (int64_t j = j0; j < n_max; ++j) {
    const float* kj = kp + (slots[j] * Hkv + g) * D;
#if defined(__AVX512F__)
    if (j + 16 < n_max) {
      const char* nx = reinterpret_cast<const char*>(kp + (slots[j + 16] * Hkv + g) * D);
      for (int64_t c = 0; c < D * 4; c += 64) _mm_prefetch(nx + c, _MM_HINT_T0);
    }
#endif
    for (int64_t r = 0; r < nrows; ++r)
      if (j >= first[r] && j < nkeys[r]) scores[r * stride + j - base] = dot<HD>(q[r], kj, D) * sc;
  }
}

#if defined(__AVX512F__)
// weigh_values' work on the CB 16-float column chunks from c0 of every value row, their
// outputs accumulated in registers (kRowBlock x CB of them); each chunk's sums run over the
// keys in order, as the other paths' do.
template <int CB>
inline void weigh_columns(float* const* out, const int64_t* first, const int64_t* nkeys, int64_t nrows,
                          const float* vp, const int64_t* slots, int64_t Hkv, int64_t g, int64_t D, int64_t c0,
                          const float* p, int64_t stride, int64_t base) {
  const int64_t n_max = nkeys[nrows - 1];
  __m512 acc[kRowBlock][CB];
#pragma GCC unroll 4
  for (int r = 0; r < kRowBlock; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < CB; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t j = first[0]; j < n_max; ++j) {
    const float* vj = vp + (slots[j] * Hkv + g) * D + c0;
    if (j + 8 < n_max) {
      const char* nx = reinterpret_cast<const char*>(vp + (slots[j + 8] * Hkv + g) * D + c0);
#pragma GCC unroll 8
      for (int c = 0; c < CB; ++c) _mm_prefetch(nx + 64 * c, _MM_HINT_T0);
    }
    __m512 v[CB];
#pragma GCC unroll 8
    for (int c = 0; c < CB; ++c) v[c] = _mm512_loadu_ps(vj + 16 * c);
#pragma GCC unroll 4
    for (int r = 0; r < kRowBlock; ++r) {
      if (r < nrows && j >= first[r] && j < nkeys[r]) {
        const __m512 pr = _mm512_set1_ps(p[r * stride + j - base]);
#pragma GCC unroll 8
        for (int c = 0; c < CB; ++c) acc[r][c] = _mm512_fmadd_ps(pr, v[c], acc[r][c]);
      }
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < kRowBlock; ++r)
    if (r < nrows)
#pragma GCC unroll 8
      for (int c = 0; c < CB; ++c) _mm512_storeu_ps(out[r] + c0 + 16 * c, acc[r][c]);
}
#endif

// out_r = sum_j p[r, j - base] v_j over first[r] <= j < nkeys[r], for a block of rows; the
// block's outputs are accumulated in registers (AVX-512, a head size of 16k), each value row
// read once (once per 96 columns where the head size is known only at run time).
template <int HD>
inline void weigh_values(float* const* out, const int64_t* first, const int64_t* nkeys, int64_t nrows,
                         const float* vp, const int64_t* slots, int64_t Hkv, int64_t g, int64_t D, const float* p,
                         int64_t stride, int64_t base) {
  const int64_t n_max = nkeys[nrows - 1];
  const int64_t j_lo = first[0];
#if defined(__AVX512F__)
  if constexpr (HD > 0 && HD % 16 == 0 && HD <= 128) {  // the whole row in one pass
    weigh_columns<HD / 16>(out, first, nkeys, nrows, vp, slots, Hkv, g, D, 0, p, stride, base);
    return;
  }
  if (HD == 0 && D % 16 == 0) {  // 96 columns at a time (24 accumulators and 6 loads: 30 of 32
                                 // registers), then the rest
    int64_t c0 = 0;
    for (; c0 + 96 <= D; c0 += 96)
      weigh_columns<6>(out, first, nkeys, nrows, vp, slots, Hkv, g, D, c0, p, stride, base);
    switch ((D - c0) / 16) {
      case 5: weigh_columns<5>(out, first, nkeys, nrows, vp, slots, Hkv, g, D, c0, p, stride, base); break;
      case 4: weigh_columns<4>(out, first, nkeys, nrows, vp, slots, Hkv, g, D, c0, p, stride, base); break;
      case 3: weigh_columns<3>(out, first, nkeys, nrows, vp, slots, Hkv, g, D, c0, p, stride, base); break;
      case 2: weigh_columns<2>(out, first, nkeys, nrows, vp, slots, Hkv, g, D, c0, p, stride, base); break;
      case 1: weigh_columns<1>(out, first, nkeys, nrows, vp, slots, Hkv, g, D, c0, p, stride, base); break;
      default: break;
    }
    return;
  }
#endif
  for (int64_t r = 0; r < nrows; ++r) std::fill(out[r], out[r] + D, 0.f);
  for (int64_t j = j_lo; j < n_max; ++j) {
    const float* vj = vp + (slots[j] * Hkv + g) * D;
    for (int64_t r = 0; r < nrows; ++r)
      if (j >= first[r] && j < nkeys[r]) axpy<HD>(out[r], p[r * stride + j - base], vj, D);
  }
}

// What a call asks of the softmax beyond causal attention (each off at its zero / null).
struct Options {
  int64_t window;      // > 0: keys at positions p - window < j <= p only
  float softcap;       // > 0: s -> softcap * tanh(s / softcap)
  const float* sinks;  // [H] a logit per query head in each softmax's denominator, or null
};

template <int HD>
void attend(const float* qp, int64_t q_stride, const float* kp, const float* vp, const int64_t* st, const int64_t* pos,
            float* op, int64_t B, int64_t T, int64_t H, int64_t D, int64_t Hkv, int64_t L, float sc,
            const Options& opt) {
  const int64_t group = H / Hkv;
  const int64_t rows = T * group;  // query rows that read one kv head of one sequence

  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;  // [rows, n_max - base] for one (b, g): scores of keys base..n_max-1
    std::vector<const float*> qrow(rows);
    std::vector<float*> orow(rows);
    std::vector<int64_t> first(rows), nkeys(rows);
    std::vector<float> inv_sum(rows);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / Hkv, g = item % Hkv;
      int64_t n_max = 0, base = L;
      for (int64_t t = 0; t < T; ++t) {
        const int64_t n = pos[b * T + t] + 1;  // keys 0..positions[b, t]
        const int64_t lo = opt.window > 0 ? std::max<int64_t>(0, n - opt.window) : 0;  // the window's first key
        n_max = std::max(n_max, n);
        base = std::min(base, lo);
        for (int64_t i = 0; i < group; ++i) {
          const int64_t r = t * group + i, h = g * group + i;
          qrow[r] = qp + (b * T + t) * q_stride + h * D;
          orow[r] = op + ((b * T + t) * H + h) * D;
          first[r] = lo;
          nkeys[r] = n;
        }
      }
      const int64_t stride = n_max - base;
      scores.resize(rows * stride);
      const int64_t* slots = st + b * L;
      // scores: each key row is loaded once for every query row that reads it
      for (int64_t r0 = 0; r0 < rows; r0 += kRowBlock)
        score_rows<HD>(qrow.data() + r0, first.data() + r0, nkeys.data() + r0, std::min(kRowBlock, rows - r0), kp,
                       slots, Hkv, g, D, sc, scores.data() + r0 * stride, stride, base);
      // softmax over each row's own keys (and its head's sink)
      for (int64_t r = 0; r < rows; ++r) {
        float* s = scores.data() + r * stride + first[r] - base;  // s[0]: the row's first key
        const int64_t n = nkeys[r] - first[r];
        if (opt.softcap > 0.f) {
          const float c = opt.softcap, inv_c = 1.f / opt.softcap;
          for (int64_t j = 0; j < n; ++j) s[j] = c * std::tanh(s[j] * inv_c);
        }
        float m = s[0];
        for (int64_t j = 1; j < n; ++j) m = std::max(m, s[j]);
        if (opt.sinks == nullptr) {
          inv_sum[r] = 1.f / exp_shifted_sum(s, n, m);
        } else {
          const float sink = opt.sinks[g * group + r % group];
          m = std::max(m, sink);
          const float keys = exp_shifted_sum(s, n, m);
          inv_sum[r] = 1.f / (keys + tritonlm_simd::exp(sink - m));
        }
      }
      // out = p @ V: each value row loaded once
      for (int64_t r0 = 0; r0 < rows; r0 += kRowBlock)
        weigh_values<HD>(orow.data() + r0, first.data() + r0, nkeys.data() + r0, std::min(kRowBlock, rows - r0), vp,
                         slots, Hkv, g, D, scores.data() + r0 * stride, stride, base);
      for (int64_t r = 0; r < rows; ++r) {
        float* o = orow[r];
        const float f = inv_sum[r];
#pragma omp simd
        for (int64_t i = 0; i < D; ++i) o[i] *= f;
      }
    }
  });
}

// x rotated by half (RoPE, as transformers' rotate_half): out = x * cos + [-x2, x1] * sin.
inline void rope(const float* x, const float* cos, const float* sin, float* out, int64_t D) {
  const int64_t half = D / 2;
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) out[i] = x[i] * cos[i] + -x[i + half] * sin[i];
#pragma omp simd
  for (int64_t i = half; i < D; ++i) out[i] = x[i] * cos[i] + x[i - half] * sin[i];
}

at::Tensor paged_attention_qkv(const at::Tensor& qkv, const at::Tensor& k_cache, const at::Tensor& v_cache,
                               const at::Tensor& write_slots, const at::Tensor& slot_table,
                               const at::Tensor& positions, const std::optional<at::Tensor>& cos,
                               const std::optional<at::Tensor>& sin, int64_t heads, double scale, int64_t window,
                               double softcap, const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(qkv.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3, "paged_attention_qkv: qkv must be "
              "[B, T, (H + 2 Hkv) D], k_cache and v_cache [S, Hkv, D]");
  TORCH_CHECK(qkv.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(),
              "paged_attention_qkv: CPU tensors only");
  TORCH_CHECK(qkv.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat &&
              v_cache.scalar_type() == at::kFloat, "paged_attention_qkv: float32 only");
  TORCH_CHECK(write_slots.scalar_type() == at::kLong && slot_table.scalar_type() == at::kLong &&
              positions.scalar_type() == at::kLong, "paged_attention_qkv: write_slots, slot_table and positions "
              "must be int64");
  TORCH_CHECK(qkv.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
              write_slots.is_contiguous() && slot_table.is_contiguous() && positions.is_contiguous(),
              "paged_attention_qkv: contiguous tensors only");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "paged_attention_qkv: k_cache and v_cache differ in shape");
  const int64_t B = qkv.size(0), T = qkv.size(1), S = k_cache.size(0), Hkv = k_cache.size(1), D = k_cache.size(2);
  const int64_t H = heads, L = slot_table.size(1), W = (H + 2 * Hkv) * D;
  TORCH_CHECK(Hkv > 0 && H > 0 && H % Hkv == 0, "paged_attention_qkv: query heads (", H,
              ") must be a multiple of kv heads (", Hkv, ")");
  TORCH_CHECK(qkv.size(2) == W, "paged_attention_qkv: qkv's last dim is ", qkv.size(2), "; ", H, " query heads and ",
              Hkv, " kv heads of ", D, " need ", W);
  TORCH_CHECK(slot_table.size(0) == B && positions.sizes() == write_slots.sizes() && positions.dim() == 2 &&
              positions.size(0) == B && positions.size(1) == T,
              "paged_attention_qkv: slot_table [B, L], positions and write_slots [B, T] must match qkv");
  TORCH_CHECK(cos.has_value() == sin.has_value(), "paged_attention_qkv: cos and sin come together");
  TORCH_CHECK(window >= 0, "paged_attention_qkv: window must be >= 0 (0: no sliding window), not ", window);
  TORCH_CHECK(softcap >= 0.0 && std::isfinite(softcap), "paged_attention_qkv: softcap must be a finite value >= 0 "
              "(0: no soft-capping), not ", softcap);
  if (sinks.has_value())
    TORCH_CHECK(sinks->device().is_cpu() && sinks->scalar_type() == at::kFloat && sinks->is_contiguous() &&
                sinks->numel() == H, "paged_attention_qkv: sinks must be a contiguous float32 CPU tensor of the ",
                H, " query heads' logits, not ", sinks->scalar_type(), " ", sinks->sizes());
  const bool rotary = cos.has_value();
  if (rotary) {
    TORCH_CHECK(cos->scalar_type() == at::kFloat && sin->scalar_type() == at::kFloat && cos->is_contiguous() &&
                sin->is_contiguous() && cos->numel() == B * T * D && sin->numel() == B * T * D && D % 2 == 0,
                "paged_attention_qkv: cos and sin must be float32, contiguous, B * T * D values each");
  }
  const float* xp = qkv.data_ptr<float>();
  float* kp = k_cache.data_ptr<float>();
  float* vp = v_cache.data_ptr<float>();
  const int64_t* ws = write_slots.data_ptr<int64_t>();
  const int64_t* st = slot_table.data_ptr<int64_t>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t i = 0; i < B * T; ++i) {
    TORCH_CHECK(pos[i] >= 0 && pos[i] < L, "paged_attention_qkv: position ", pos[i], " outside the slot table [0, ",
                L, ")");
    TORCH_CHECK(ws[i] >= 0 && ws[i] < S, "paged_attention_qkv: write slot ", ws[i], " outside the pool [0, ", S, ")");
  }
  for (int64_t i = 0; i < B * L; ++i)
    TORCH_CHECK(st[i] >= 0 && st[i] < S, "paged_attention_qkv: slot ", st[i], " outside the pool [0, ", S, ")");

  // The new tokens: q (rotated) into its own buffer; k (rotated) and v into their pool
  // slots, before any row reads them (a token attends to itself). One thread: B * T rows
  // of a few hundred floats, and padding rows all write the scratch slot.
  at::Tensor q_rot;
  const float* qp = xp;  // without RoPE the queries are read where they are, in qkv
  int64_t q_stride = W;
  if (rotary) {
    q_rot = at::empty({B, T, H, D}, qkv.options());
    float* qr = q_rot.data_ptr<float>();
    const float* cp = cos->data_ptr<float>();
    const float* sp = sin->data_ptr<float>();
    for (int64_t i = 0; i < B * T; ++i) {
      const float* x = xp + i * W;
      for (int64_t h = 0; h < H; ++h) rope(x + h * D, cp + i * D, sp + i * D, qr + (i * H + h) * D, D);
      for (int64_t g = 0; g < Hkv; ++g) rope(x + (H + g) * D, cp + i * D, sp + i * D, kp + (ws[i] * Hkv + g) * D, D);
    }
    qp = qr;
    q_stride = H * D;
  } else {
    for (int64_t i = 0; i < B * T; ++i)
      std::memcpy(kp + ws[i] * Hkv * D, xp + i * W + H * D, sizeof(float) * Hkv * D);
  }
  for (int64_t i = 0; i < B * T; ++i)
    std::memcpy(vp + ws[i] * Hkv * D, xp + i * W + (H + Hkv) * D, sizeof(float) * Hkv * D);

  at::Tensor out = at::empty({B, T, H * D}, qkv.options());
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  const Options opt{window, static_cast<float>(softcap), sinks.has_value() ? sinks->data_ptr<float>() : nullptr};
  if (D == 64) attend<64>(qp, q_stride, kp, vp, st, pos, op, B, T, H, D, Hkv, L, sc, opt);
  else if (D == 128) attend<128>(qp, q_stride, kp, vp, st, pos, op, B, T, H, D, Hkv, L, sc, opt);
  else attend<0>(qp, q_stride, kp, vp, st, pos, op, B, T, H, D, Hkv, L, sc, opt);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tritonlm, m) {
  m.def("paged_attention_qkv(Tensor qkv, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor write_slots, "
        "Tensor slot_table, Tensor positions, Tensor? cos, Tensor? sin, int heads, float scale, int window=0, "
        "float softcap=0.0, Tensor? sinks=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(tritonlm, CPU, m) {
  m.impl("paged_attention_qkv", &paged_attention_qkv);
}
