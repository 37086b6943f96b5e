// exp and a dot product for tritonlm's CPU kernels (paged_attention.cpp, decode_ops.cpp),
// in float32.
//
// e^x = 2^v with v = x log2 e = k + f, k = round(v), f in [-0.5, 0.5]; 2^f by its degree-6
// Taylor polynomial (relative error ~1e-7, about float32's own rounding). v is clamped to
// [-126, 127]: below, terms are ~1e-38 (nothing a sum or a ratio with 1 registers); above,
// 2^127 stands for infinity (silu's x / (1 + e^-x) is then ~0 either way).
// With AVX-512 (in the builds of the AVX-512 levels: kernels/isa.py) 16 at a time,
// with AVX2 and FMA 8.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace tritonlm_simd {

constexpr float kLog2e = 1.44269504088896341f;
constexpr float kExpC[7] = {1.0f, 6.9314718055994531e-1f, 2.4022650695910071e-1f, 5.5504108664821580e-2f,
                            9.6181291076284772e-3f, 1.3333558146428443e-3f, 1.5403530393381606e-4f};

inline float exp2_clamped(float v) {  // 2^v, v clamped to [-126, 127]
  v = std::min(std::max(v, -126.f), 127.f);
  const float k = std::nearbyint(v), f = v - k;
  float p = kExpC[6];
  for (int c = 5; c >= 0; --c) p = p * f + kExpC[c];
  const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;  // 2^k
  float two_k;
  std::memcpy(&two_k, &bits, sizeof(two_k));
  return p * two_k;
}

inline float exp(float x) { return exp2_clamped(x * kLog2e); }

#if defined(__AVX512F__)
inline __m512 exp2_clamped(__m512 v) {
  v = _mm512_min_ps(_mm512_max_ps(v, _mm512_set1_ps(-126.f)), _mm512_set1_ps(127.f));
  const __m512 k = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(v, k);
  __m512 p = _mm512_set1_ps(kExpC[6]);
  for (int c = 5; c >= 0; --c) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExpC[c]));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(k), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

inline __m512 exp(__m512 x) { return exp2_clamped(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e))); }
#endif

#if defined(__AVX2__) && defined(__FMA__)
inline __m256 exp2_clamped(__m256 v) {  // the same, 8 at a time (CPUs without AVX-512)
  v = _mm256_min_ps(_mm256_max_ps(v, _mm256_set1_ps(-126.f)), _mm256_set1_ps(127.f));
  const __m256 k = _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(v, k);
  __m256 p = _mm256_set1_ps(kExpC[6]);
  for (int c = 5; c >= 0; --c) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExpC[c]));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

inline __m256 exp(__m256 x) { return exp2_clamped(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e))); }
#endif

#if defined(__AVX512F__)
// dot()'s 16 partial sums before their horizontal sum, over the first n - n % 16 floats.
inline __m512 dot_lanes(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  for (; i + 32 <= n; i += 32) {
    acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc0);
    acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), acc1);
  }
  for (; i + 16 <= n; i += 16) acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc0);
  return _mm512_add_ps(acc0, acc1);
}

// Lane k: the sum of x[k]'s 16 lanes, paired as _mm512_reduce_add_ps pairs them (lane i with
// i + 8, then i + 4, i + 2, i + 1), so each is the same bits as reduce_add of x[k] alone; 16
// sums for ~45 shuffles and adds instead of ~160.
inline __m512 reduce_add_16(const __m512* x) {
  __m512 y[8], z[4], w[2];
  for (int m = 0; m < 8; ++m)  // lanes 0-7: x[2m]'s i + (i + 8); lanes 8-15: x[2m + 1]'s
    y[m] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * m], x[2 * m + 1], _MM_SHUFFLE(3, 2, 3, 2)),
                         _mm512_shuffle_f32x4(x[2 * m], x[2 * m + 1], _MM_SHUFFLE(1, 0, 1, 0)));
  for (int m = 0; m < 4; ++m)  // 128-bit block q: x[4m + q]'s 4 partial sums
    z[m] = _mm512_add_ps(_mm512_shuffle_f32x4(y[2 * m], y[2 * m + 1], _MM_SHUFFLE(3, 1, 3, 1)),
                         _mm512_shuffle_f32x4(y[2 * m], y[2 * m + 1], _MM_SHUFFLE(2, 0, 2, 0)));
  for (int m = 0; m < 2; ++m)  // block q: x[8m + q]'s 2 partial sums, then x[8m + 4 + q]'s
    w[m] = _mm512_add_ps(_mm512_shuffle_ps(z[2 * m], z[2 * m + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(z[2 * m], z[2 * m + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // lane 4q + s: the sum of x[4s + q]; back in order
  const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, r);
}
#endif

// a . b over n floats, summed in an order that depends on n only (never on the pointers'
// alignment, as a compiler's vectorized reduction may): a row's result is the same bits
// wherever it sits, alone or in a batch.
inline float dot(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float s = 0.f;
#if defined(__AVX512F__)
  i = n - n % 16;
  s = _mm512_reduce_add_ps(dot_lanes(a, b, n));
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
  }
  for (; i + 8 <= n; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
  const __m256 acc = _mm256_add_ps(acc0, acc1);
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));  // 4 lanes
  const __m128 h2 = _mm_add_ps(h, _mm_movehl_ps(h, h));                                       // 2 lanes
  s = _mm_cvtss_f32(_mm_add_ss(h2, _mm_shuffle_ps(h2, h2, 1)));
#endif
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

}  // namespace tritonlm_simd
