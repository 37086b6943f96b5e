// int8 x int8 projections with full 8-bit activations on every x86 level, VNNI or not.
//
//   i8_linear(x [..., in] f32, panel [P, in4, 16, 4] int8, wscale [P * 16] f32, bias [out] f32 or None,
//             out, isa) -> y [..., out] f32
//       each row of x quantized on its own, symmetric: s = max|x| / 127, q = round(x / s) in
//       [-127, 127]; y[j] = fma(sum_k q[k] w[j, k], s * wscale[j], bias[j]), where
//       panel[p, k / 4, j', k % 4] = w[16 p + j', k], codes in [-127, 127] (a -128 could saturate a
//       pair: Int8Linear.use_act8 clamps it), zero beyond `in` (in4 = ceil(in / 4)) and beyond `out`.
//   i8_isas() -> the paths i8_linear can run here, best first ("amx", "avx512_vnni", "avx512", "avx2",
//       "scalar"); "auto" takes amx for calls of at least kAmxMinRows rows, the best of the others below
//   i8_amx_refusal() -> why the amx path does not run here (the build, the CPU, Linux), "" where it does
//
// Why not fbgemm's u8 x s8 (decode_ops.cpp's int8_linear): without VNNI its AVX2 kernel adds
// pairs of u8 x s8 products in int16 (vpmaddubsw), which 8-bit codes can saturate, so
// activations get 7 bits there and int8's output moves further from float32 than with VNNI.
// Here the unsigned operand is |q| and the signed one w * sign(q) (vpsignb): each product is
// at most 127 x 127, a pair at most 32258 < 32767, so nothing saturates and 8 bits stay.
// On AVX2 a panel's weights serve up to kTileRows rows at once (each weight vector loaded once
// for all of them), and the sign is applied by an xor plus a per-row sum instead (panel_avx2).
// VNNI's vpdpbusd adds in int32, so there the unsigned operand is q + 128 and one sum per
// output channel takes the 128 back out (panel_vnni), again kTileRows rows a weight load.
// The int32 sums are exact on every path (scalar, AVX2, AVX-512BW, VNNI), so every path
// gives the same integers, and the epilogue's one explicit fma rounds the same everywhere:
// the same bits on every CPU, and a row's bits do not depend on its batch.
// AMX (Intel Sapphire Rapids and later) multiplies s8 x s8 tiles into int32 (tdpbssd): no
// sign trick at all, and the panel's layout is already a B tile's (16 consecutive quads of
// a panel are 16 rows of 64 bytes), so its weights are read in place. Its sums are the same
// exact integers, so its bits are the others'. It is compiled, with a target attribute, into
// every build for AVX-512 VNNI (the avx512_vnni level, a -march=native build on such a CPU)
// and runs only where CPUID shows amx_int8 and Linux grants this process the tile state
// (arch_prctl ARCH_REQ_XCOMP_PERM), so that build still runs on every CPU of its level. A tile
// holds 16 rows however few a call has, so a call of fewer than kAmxMinRows rows (one stream's
// decode step) stays on the vector paths.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__x86_64__) && \
    defined(__linux__) && ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11))
#define TRITONLM_AMX 1
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace {

constexpr int64_t kLanes = 16;            // output channels in a panel
constexpr int64_t kGrainWeights = 65536;  // int8 weights x row tiles per task: below this, one thread

enum class Isa { kScalar, kAvx2, kAvx512, kAvx512Vnni, kAmx };

// Why the AMX path does not run here, or "" where it does: the build, then CPUID.(7,0):EDX
// bit 24 (AMX-TILE) and 25 (AMX-INT8), then Linux's permission for the tile data
// (XFEATURE_XTILEDATA, 18), which it grants per process and only when asked
const std::string& amx_refusal() {
  static const std::string why = []() -> std::string {
#if defined(TRITONLM_AMX)
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((d >> 24) & 1) || !((d >> 25) & 1))
      return "this CPU has no AMX-INT8";
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    if (syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) != 0) {
      const int err = errno;  // before anything else can set it
      return "Linux refused this process the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM: errno " +
             std::to_string(err) + ")";
    }
    return "";
#else
    return "this build has no AMX path (an AVX-512 VNNI build by GCC 11+ or clang 12+ carries it)";
#endif
  }();
  return why;
}

bool amx_granted() { return amx_refusal().empty(); }

// the path runs here: compiled into this build and, for AMX, allowed on this CPU and kernel
bool compiled(Isa isa) {
  switch (isa) {
    case Isa::kAmx:
      return amx_granted();
    case Isa::kAvx512Vnni:
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
      return true;
#else
      return false;
#endif
    case Isa::kAvx512:
#if defined(__AVX512F__) && defined(__AVX512BW__)
      return true;
#else
      return false;
#endif
    case Isa::kAvx2:
#if defined(__AVX2__)
      return true;
#else
      return false;
#endif
    default:
      return true;
  }
}

constexpr Isa kAll[] = {Isa::kAmx, Isa::kAvx512Vnni, Isa::kAvx512, Isa::kAvx2, Isa::kScalar};
constexpr int64_t kAmxMinRows = 4;  // "auto" below this: the vector paths, where a tile padded from a
                                    // few rows to 16 costs about what it saves (perf/bench_int8_gemm.py)

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAmx: return "amx";
    case Isa::kAvx512Vnni: return "avx512_vnni";
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    default: return "scalar";
  }
}

// the path for a call of `rows` rows: the one asked, or for "auto" the best that runs here
// (AMX only from kAmxMinRows rows)
Isa pick_isa(std::string_view asked, int64_t rows) {
  if (asked == "auto") {
    for (Isa isa : kAll)
      if (compiled(isa) && (isa != Isa::kAmx || rows >= kAmxMinRows)) return isa;
  }
  for (Isa isa : kAll) {
    if (asked == isa_name(isa)) {
      TORCH_CHECK(compiled(isa), "i8_linear: isa '", asked, "' is not in this build or not allowed on this CPU; ",
                  "it runs ", isa_name(pick_isa("auto", kAmxMinRows)), " (see i8_isas())");
      return isa;
    }
  }
  TORCH_CHECK(false, "i8_linear: isa '", asked, "' is not one of auto, amx, avx512_vnni, avx512, avx2, scalar");
}

// acc[16] += sum over k4 groups of q[4 k4 + t] * w[k4][j][t], for one panel (in4 x 16 x 4 bytes)
void panel_scalar(const int8_t* q, const int8_t* w, int64_t in4, int32_t* acc) {
  for (int64_t k = 0; k < in4; ++k) {
    const int8_t* wk = w + k * kLanes * 4;
    const int8_t* qk = q + 4 * k;
    for (int64_t j = 0; j < kLanes; ++j) {
      int32_t s = 0;
      for (int t = 0; t < 4; ++t) s += int32_t(qk[t]) * int32_t(wk[j * 4 + t]);
      acc[j] += s;
    }
  }
}

// A call's activation codes, each row's alike: q [rows, stride] int8, |q| as u8, the sign
// masks (0xff where q < 0, else 0) and per row the sum of |q| over its negative codes
struct Codes {
  const int8_t* q;
  const uint8_t* biased;  // q + 128 as u8 (q ^ 0x80), for the VNNI path
  const uint8_t* abs;
  const int8_t* neg_mask;
  const int32_t* neg_sum;
  int64_t stride;
};

#if defined(__AVX2__)
// acc[r][16] += the panel's sums for kRows rows (from row r0) at once: each weight vector
// loaded once and used for every row, so a batch costs each row only its own products.
// vpmaddubsw needs an unsigned operand, |q|, and q * w = |q| * (w * sign(q)); where q < 0,
// -w = ~w + 1 = (w ^ 0xff) + 1, so sum_k q_k w_k = sum_k |q_k| (w_k ^ mask_k) + (the sum of
// |q_k| over q_k < 0). The xor runs on any vector port, where vpsignb competes with the
// multiplies; |~w| <= 128, so a pair is at most 2 x 127 x 128 = 32512 and still does not
// saturate; the last sum is one per row, added once.
template <int kRows>
void panel_avx2(const Codes& c, int64_t r0, const int8_t* w, int64_t in4, int32_t* acc) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i lo[kRows], hi[kRows];  // per row: outputs 0-7, 8-15
  for (int r = 0; r < kRows; ++r) lo[r] = hi[r] = _mm256_set1_epi32(c.neg_sum[r0 + r]);
  const uint8_t* abs = c.abs + r0 * c.stride;
  const int8_t* neg = c.neg_mask + r0 * c.stride;
  for (int64_t k = 0; k < in4; ++k) {
    const __m256i* wk = reinterpret_cast<const __m256i*>(w + k * kLanes * 4);
    const __m256i w0 = _mm256_loadu_si256(wk), w1 = _mm256_loadu_si256(wk + 1);
    for (int r = 0; r < kRows; ++r) {
      int32_t four_abs, four_mask;
      std::memcpy(&four_abs, abs + r * c.stride + 4 * k, 4);
      std::memcpy(&four_mask, neg + r * c.stride + 4 * k, 4);
      const __m256i ax = _mm256_set1_epi32(four_abs);  // |q[4k .. 4k+3]| in every lane
      const __m256i m = _mm256_set1_epi32(four_mask);
      lo[r] = _mm256_add_epi32(lo[r], _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_xor_si256(w0, m)), ones));
      hi[r] = _mm256_add_epi32(hi[r], _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_xor_si256(w1, m)), ones));
    }
  }
  for (int r = 0; r < kRows; ++r) {
    __m256i* out = reinterpret_cast<__m256i*>(acc + r * kLanes);
    _mm256_storeu_si256(out, _mm256_add_epi32(_mm256_loadu_si256(out), lo[r]));
    _mm256_storeu_si256(out + 1, _mm256_add_epi32(_mm256_loadu_si256(out + 1), hi[r]));
  }
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
void panel_avx512(const int8_t* q, const int8_t* w, int64_t in4, int32_t* acc) {
  __m512i sum = _mm512_setzero_si512();
  const __m512i ones = _mm512_set1_epi16(1);
  for (int64_t k = 0; k < in4; ++k) {
    int32_t four;
    std::memcpy(&four, q + 4 * k, 4);
    const __m512i xq = _mm512_set1_epi32(four);
    const __m512i ax = _mm512_abs_epi8(xq);
    // w * sign(q): AVX-512 has no vpsignb, so w is negated where q < 0; where q == 0, |q| is
    // 0 and so is the product, whatever w's sign
    const __m512i wk = _mm512_loadu_si512(w + k * kLanes * 4);
    const __m512i sw = _mm512_mask_sub_epi8(wk, _mm512_movepi8_mask(xq), _mm512_setzero_si512(), wk);
    sum = _mm512_add_epi32(sum, _mm512_madd_epi16(_mm512_maddubs_epi16(ax, sw), ones));
  }
  _mm512_storeu_si512(acc, _mm512_add_epi32(_mm512_loadu_si512(acc), sum));
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
// acc[r][16] += the panel's sums for kRows rows at once, with VNNI's u8 x s8 dot product of 4
// (vpdpbusd, which adds in int32 and so cannot saturate). Its unsigned operand is q + 128
// (in [1, 255]), and sum_k (q_k + 128) w_k - sum_k 128 w_k = sum_k q_k w_k: the second sum,
// one per output channel (`comp`), is a dot product of the same weights with 128 in every
// byte, computed with the panel's first row tile (kFirst) and reused by the others. No sign
// fix-up per weight: a load and one vpdpbusd per row, each weight vector loaded once for
// all rows. With one or two rows, two sets of sums (even and odd k) keep more vpdpbusd
// chains in flight. vpdpbusd wraps in int32 rather than saturating, so the difference is
// exact wherever sum_k q_k w_k itself fits int32, as on the other paths: the integers are theirs.
template <int kRows, bool kFirst>
void panel_vnni(const Codes& c, int64_t r0, const int8_t* w, int64_t in4, int32_t* acc, int32_t* comp) {
  constexpr int kChains = kRows >= 3 ? 1 : 2;
  const __m512i b128 = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512i sums[kChains][kRows], comps[kChains];
  for (int h = 0; h < kChains; ++h) {
    comps[h] = _mm512_setzero_si512();
    for (int r = 0; r < kRows; ++r) sums[h][r] = _mm512_setzero_si512();
  }
  const uint8_t* u = c.biased + r0 * c.stride;
  const auto step = [&](int h, int64_t k) {  // k4 group k into chain h
    const __m512i wk = _mm512_loadu_si512(w + k * kLanes * 4);
    if constexpr (kFirst) comps[h] = _mm512_dpbusd_epi32(comps[h], b128, wk);
    for (int r = 0; r < kRows; ++r) {
      int32_t four;  // row r's 4 biased codes, in every lane
      std::memcpy(&four, u + r * c.stride + 4 * k, 4);
      sums[h][r] = _mm512_dpbusd_epi32(sums[h][r], _mm512_set1_epi32(four), wk);
    }
  };
  int64_t k = 0;
  for (; k + kChains <= in4; k += kChains)
    for (int h = 0; h < kChains; ++h) step(h, k + h);
  for (; k < in4; ++k) step(0, k);
  __m512i total;
  if constexpr (kFirst) {
    total = comps[0];
    for (int h = 1; h < kChains; ++h) total = _mm512_add_epi32(total, comps[h]);
    _mm512_storeu_si512(comp, total);
  } else {
    total = _mm512_loadu_si512(comp);
  }
  for (int r = 0; r < kRows; ++r) {
    __m512i sum = sums[0][r];
    for (int h = 1; h < kChains; ++h) sum = _mm512_add_epi32(sum, sums[h][r]);
    int32_t* out = acc + r * kLanes;
    _mm512_storeu_si512(out, _mm512_add_epi32(_mm512_loadu_si512(out), _mm512_sub_epi32(sum, total)));
  }
}

template <bool kFirst>
void tile_vnni(const Codes& c, int64_t r0, int64_t rows, const int8_t* w, int64_t in4, int32_t* acc, int32_t* comp) {
  switch (rows) {
    case 4: return panel_vnni<4, kFirst>(c, r0, w, in4, acc, comp);
    case 3: return panel_vnni<3, kFirst>(c, r0, w, in4, acc, comp);
    case 2: return panel_vnni<2, kFirst>(c, r0, w, in4, acc, comp);
    default: return panel_vnni<1, kFirst>(c, r0, w, in4, acc, comp);
  }
}

void rows_vnni(const Codes& c, int64_t r0, int64_t rows, const int8_t* w, int64_t in4, int32_t* acc, int32_t* comp) {
  return r0 == 0 ? tile_vnni<true>(c, r0, rows, w, in4, acc, comp) : tile_vnni<false>(c, r0, rows, w, in4, acc, comp);
}
#endif

constexpr int64_t kTileRows = 4;  // rows that share each loaded weight vector (AVX2, VNNI)

// acc [rows][16] += the panel's sums for `rows` (at most kTileRows) rows of q (|q| in aq),
// `stride` codes apart
// comp [16]: scratch that a path may keep per panel across its row tiles (r0 = 0 comes first)
using RowsKernel = void (*)(const Codes& c, int64_t r0, int64_t rows, const int8_t* w, int64_t in4, int32_t* acc,
                            int32_t* comp);

template <void (*kOne)(const int8_t*, const int8_t*, int64_t, int32_t*)>
void row_by_row(const Codes& c, int64_t r0, int64_t rows, const int8_t* w, int64_t in4, int32_t* acc, int32_t*) {
  for (int64_t r = 0; r < rows; ++r) kOne(c.q + (r0 + r) * c.stride, w, in4, acc + r * kLanes);
}

#if defined(__AVX2__)
void rows_avx2(const Codes& c, int64_t r0, int64_t rows, const int8_t* w, int64_t in4, int32_t* acc, int32_t*) {
  switch (rows) {
    case 4: return panel_avx2<4>(c, r0, w, in4, acc);
    case 3: return panel_avx2<3>(c, r0, w, in4, acc);
    case 2: return panel_avx2<2>(c, r0, w, in4, acc);
    default: return panel_avx2<1>(c, r0, w, in4, acc);
  }
}
#endif

RowsKernel kernel_for(Isa isa) {
  switch (isa) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
#if defined(__AVX512VNNI__)
    case Isa::kAvx512Vnni:
      return rows_vnni;
#endif
    case Isa::kAvx512:
      return row_by_row<panel_avx512>;
#endif
#if defined(__AVX2__)
    case Isa::kAvx2:
      return rows_avx2;
#endif
    default:
      return row_by_row<panel_scalar>;
  }
}

// y [rows, out] from the int32 sums of rows [r0, r0 + n) and channels [c0, c0 + lanes):
// acc[r - r0][j] (`ld` apart), every path's one epilogue
// (lanes <= 16). The vector loop rounds as the scalar one: one product s * ws, then one fma.
void rescale(const int32_t* acc, int64_t ld, int64_t r0, int64_t n, int64_t c0, int64_t lanes, const float* s,
             const float* ws, const float* bias, int64_t out, float* y) {
#if defined(__AVX512F__)
  const __mmask16 keep = static_cast<__mmask16>((1u << lanes) - 1);
  const __m512 wv = _mm512_maskz_loadu_ps(keep, ws + c0);
  const __m512 bv = bias ? _mm512_maskz_loadu_ps(keep, bias + c0) : _mm512_setzero_ps();
  for (int64_t r = r0; r < r0 + n; ++r) {
    const __m512 sum = _mm512_cvtepi32_ps(_mm512_maskz_loadu_epi32(keep, acc + (r - r0) * ld));
    const __m512 sw = _mm512_mul_ps(_mm512_set1_ps(s[r]), wv);
    _mm512_mask_storeu_ps(y + r * out + c0, keep, _mm512_fmadd_ps(sum, sw, bv));
  }
#else
  for (int64_t r = r0; r < r0 + n; ++r) {
    const int32_t* ar = acc + (r - r0) * ld;
    for (int64_t j = 0; j < lanes; ++j) {
      const float sw = s[r] * ws[c0 + j];
      y[r * out + c0 + j] = std::fma(static_cast<float>(ar[j]), sw, bias ? bias[c0 + j] : 0.f);
    }
  }
#endif
}

#if defined(TRITONLM_AMX)
constexpr int64_t kTileQuads = 16;  // quads of a tile's K: 64 codes, a row of 64 bytes

struct alignas(64) TileConfig {  // ldtilecfg's palette 1 layout
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// One K step: C tiles += the A tile(s) at ak x the B tile(s) at b0 (and b1). Tiles: C 0-3
// (2 r + j: row tile r, panel j), A 4-5, B 6-7. A free function rather than a lambda: a
// lambda does not take its enclosing function's target attribute (clang's builtins need it).
template <int kRowTiles, int kPanels>
__attribute__((target("amx-tile,amx-int8"), always_inline)) inline void amx_step(const int8_t* ak, int64_t lda,
                                                                               const int8_t* b0, const int8_t* b1) {
  _tile_loadd(4, ak, lda);
  _tile_loadd(6, b0, 64);
  _tile_dpbssd(0, 4, 6);
  if constexpr (kPanels == 2) {
    _tile_loadd(7, b1, 64);
    _tile_dpbssd(1, 4, 7);
  }
  if constexpr (kRowTiles == 2) {
    _tile_loadd(5, ak + 16 * lda, lda);
    _tile_dpbssd(2, 5, 6);
    if constexpr (kPanels == 2) _tile_dpbssd(3, 5, 7);
  }
}

// c [16 kRowTiles][16 kPanels] int32 = sum over the K steps of a [16 kRowTiles rows, lda
// bytes apart] x each panel's B tiles. b[j] holds `full` whole tiles (1024 bytes each);
// tail[j], where not null, one more (the panel's last quads, zero-padded); a has zeros past
// `in` in every row.
template <int kRowTiles, int kPanels>
__attribute__((target("amx-tile,amx-int8"))) void amx_block(const int8_t* a, int64_t lda, const int8_t* const* b,
                                                          const int8_t* const* tail, int64_t full, int32_t* c) {
  constexpr int64_t kTileBytes = kTileQuads * kLanes * 4, ldc = 4 * kLanes * kPanels;
  // GCC's tile loads and stores are asm that names no memory: without this barrier the
  // compiler could drop or delay the stores that fill `tail`, or read `c` before the tiles
  // are stored into it
  asm volatile("" ::: "memory");
  _tile_zero(0);
  if constexpr (kPanels == 2) _tile_zero(1);
  if constexpr (kRowTiles == 2) _tile_zero(2);
  if constexpr (kRowTiles == 2 && kPanels == 2) _tile_zero(3);
  for (int64_t k = 0; k < full; ++k)
    amx_step<kRowTiles, kPanels>(a + 4 * kTileQuads * k, lda, b[0] + k * kTileBytes,
                                 kPanels == 2 ? b[1] + k * kTileBytes : nullptr);
  if (tail[0]) amx_step<kRowTiles, kPanels>(a + 4 * kTileQuads * full, lda, tail[0], kPanels == 2 ? tail[1] : nullptr);
  _tile_stored(0, c, ldc);
  if constexpr (kPanels == 2) _tile_stored(1, c + kLanes, ldc);
  if constexpr (kRowTiles == 2) _tile_stored(2, c + 16 * kLanes * kPanels, ldc);
  if constexpr (kRowTiles == 2 && kPanels == 2) _tile_stored(3, c + 16 * kLanes * kPanels + kLanes, ldc);
  asm volatile("" ::: "memory");
}

// y for panel pairs [lo, hi): each pair's weights stay in cache while every 32-row block of
// the codes q ([rows rounded up to 16, lda] int8, zero-padded) passes over them
__attribute__((target("amx-tile,amx-int8"))) void amx_pairs(const int8_t* q, int64_t lda, int64_t rows,
                                                          const int8_t* wp, int64_t P, int64_t in4, int64_t lo,
                                                          int64_t hi, const float* s, const float* ws,
                                                          const float* bias, int64_t out, float* y) {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = 16;
    config.colsb[t] = 64;
  }
  _tile_loadconfig(&config);
  const int64_t full = in4 / kTileQuads, left = in4 % kTileQuads;
  alignas(64) int8_t tails[2][kTileQuads * kLanes * 4];
  alignas(64) int32_t c[32 * 2 * kLanes];
  for (int64_t pair = lo; pair < hi; ++pair) {
    const int64_t p0 = 2 * pair, panels = std::min<int64_t>(2, P - p0);
    const int8_t* b[2] = {wp + p0 * in4 * kLanes * 4, wp + (p0 + panels - 1) * in4 * kLanes * 4};
    const int8_t* tail[2] = {nullptr, nullptr};
    if (left) {  // the panels' last quads, zero-padded to a whole tile: a read past them could leave the tensor
      for (int64_t j = 0; j < panels; ++j) {
        std::memset(tails[j], 0, sizeof(tails[j]));
        std::memcpy(tails[j], b[j] + full * kTileQuads * kLanes * 4, left * kLanes * 4);
        tail[j] = tails[j];
      }
    }
    for (int64_t r0 = 0; r0 < rows; r0 += 32) {
      const int8_t* a = q + r0 * lda;
      const bool two_rows = rows - r0 > 16;
      if (panels == 2) {
        two_rows ? amx_block<2, 2>(a, lda, b, tail, full, c) : amx_block<1, 2>(a, lda, b, tail, full, c);
      } else {
        two_rows ? amx_block<2, 1>(a, lda, b, tail, full, c) : amx_block<1, 1>(a, lda, b, tail, full, c);
      }
      const int64_t n = std::min<int64_t>(32, rows - r0);
      for (int64_t j = 0; j < panels; ++j) {
        const int64_t c0 = (p0 + j) * kLanes;
        rescale(c + j * kLanes, kLanes * panels, r0, n, c0, std::min(kLanes, out - c0), s, ws, bias, out, y);
      }
    }
  }
  _tile_release();
}
#endif

// max |x[i]|: exact in any order, so the vector and scalar loops agree
float max_abs(const float* x, int64_t n) {
  int64_t i = 0;
  float m = 0.f;
#if defined(__AVX2__)
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 v = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) v = _mm256_max_ps(v, _mm256_and_ps(_mm256_loadu_ps(x + i), magnitude));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, v);
  for (float lane : lanes) m = std::max(m, lane);
#endif
  for (; i < n; ++i) m = std::max(m, std::fabs(x[i]));
  return m;
}

// q[i] = clamp(round-half-even(x[i] * inv), -127, 127): the vector loop rounds as nearbyint
// does in the default rounding mode, so both give the same codes
void quantize(const float* x, int64_t n, float inv, int8_t* q) {
  int64_t i = 0;
#if defined(__AVX2__)
  const __m256 scale = _mm256_set1_ps(inv), lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
  const auto codes = [&](int64_t j) {  // 8 codes as int32
    const __m256 v = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + j), scale),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(v, lo), hi));
  };
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undo the packs' 128-bit lanes
  for (; i + 32 <= n; i += 32) {
    const __m256i ab = _mm256_packs_epi32(codes(i), codes(i + 8));
    const __m256i cd = _mm256_packs_epi32(codes(i + 16), codes(i + 24));
    const __m256i packed = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(ab, cd), order);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i), packed);
  }
#endif
  for (; i < n; ++i) q[i] = static_cast<int8_t>(std::clamp(std::nearbyint(x[i] * inv), -127.f, 127.f));
}

void check_cpu_tensor(const at::Tensor& t, at::ScalarType type, const char* name, const char* shape) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == type && t.is_contiguous(), "i8_linear: ", name,
              " must be a contiguous ", c10::toString(type), " CPU tensor ", shape, ", not ", t.scalar_type(), " ",
              t.sizes(), t.device().is_cpu() ? "" : " on another device");
}

at::Tensor i8_linear(const at::Tensor& x, const at::Tensor& panel, const at::Tensor& wscale,
                     const std::optional<at::Tensor>& bias, int64_t out, std::string_view isa) {
  check_cpu_tensor(x, at::kFloat, "x", "[..., in]");
  check_cpu_tensor(panel, at::kChar, "panel", "[P, in4, 16, 4]");
  check_cpu_tensor(wscale, at::kFloat, "wscale", "[P * 16]");
  TORCH_CHECK(panel.dim() == 4 && panel.size(2) == kLanes && panel.size(3) == 4,
              "i8_linear: panel must be [P, in4, 16, 4], not ", panel.sizes());
  const int64_t P = panel.size(0), in4 = panel.size(1), in = x.size(-1);
  TORCH_CHECK((in + 3) / 4 == in4, "i8_linear: x's rows have ", in, " values; the panel takes ", 4 * in4,
              " (in4 = ", in4, ")");
  TORCH_CHECK(out > 0 && (out + kLanes - 1) / kLanes == P, "i8_linear: ", P, " panels cannot hold out=", out);
  TORCH_CHECK(wscale.numel() == P * kLanes, "i8_linear: wscale has ", wscale.numel(), " values; ", P,
              " panels need ", P * kLanes);
  const float* bp = nullptr;
  if (bias.has_value()) {
    check_cpu_tensor(*bias, at::kFloat, "bias", "[out]");
    TORCH_CHECK(bias->numel() == out, "i8_linear: bias has ", bias->numel(), " values; out is ", out);
    bp = bias->data_ptr<float>();
  }
  const int64_t rows = in ? x.numel() / in : 0;
  const Isa path = pick_isa(isa, rows);
  const bool tiles = path == Isa::kAmx;
  // each row quantized alone: q [rows, stride] (zero-padded), s [rows]; for AMX, rows rounded
  // up to a whole tile and a stride of whole tiles, all zero past the codes
  const int64_t stride = tiles ? (in4 + 15) / 16 * 64 : 4 * in4, padded = tiles ? (rows + 15) / 16 * 16 : rows;
  std::vector<int8_t> q(padded * stride, 0);
  std::vector<float> s(rows);
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, rows, std::max<int64_t>(1, kGrainWeights / std::max<int64_t>(in, 1)), [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      const float* xr = xp + r * in;
      const float m = max_abs(xr, in);
      s[r] = m > 0.f ? m / 127.f : 1.f;
      quantize(xr, in, 1.f / s[r], q.data() + r * stride);
    }
  });
  auto sizes = x.sizes().vec();
  sizes.back() = out;
  at::Tensor y = at::empty(sizes, x.options());
  float* yp = y.data_ptr<float>();
  const int8_t* wp = panel.data_ptr<int8_t>();
  const float* ws = wscale.data_ptr<float>();
  // panels per task: a task's work is its weights times the row tiles that pass over them, so
  // a call of many rows (a prefill chunk) splits into as many tasks as a many-core CPU has
  const int64_t row_tiles = tiles ? padded / 16 : (rows + kTileRows - 1) / kTileRows;
  const int64_t grain =
      std::max<int64_t>(1, kGrainWeights / std::max<int64_t>(in4 * 4 * kLanes * std::max<int64_t>(row_tiles, 1), 1));
#if defined(TRITONLM_AMX)
  if (tiles) {
    at::parallel_for(0, (P + 1) / 2, (grain + 1) / 2, [&](int64_t lo, int64_t hi) {
      amx_pairs(q.data(), stride, rows, wp, P, in4, lo, hi, s.data(), ws, bp, out, yp);
    });
    return y;
  }
#endif
  // the vector paths' operands besides q: |q|, the sign masks (0xff where q < 0), q + 128,
  // and per row the sum of |q| over its negative codes
  std::vector<int8_t> neg_mask(rows * stride, 0);
  std::vector<uint8_t> aq(rows * stride, 0), biased(rows * stride, 0x80);
  std::vector<int32_t> neg_sum(rows, 0);
  for (int64_t r = 0; r < rows; ++r) {
    const int8_t* qr = q.data() + r * stride;
    uint8_t* ar = aq.data() + r * stride;
    int8_t* mr = neg_mask.data() + r * stride;
    uint8_t* br = biased.data() + r * stride;
    int32_t negative = 0;  // separate loops: each one vectorizes
    for (int64_t i = 0; i < in; ++i) {
      const int8_t code = qr[i];
      ar[i] = static_cast<uint8_t>(code < 0 ? -code : code);
      mr[i] = static_cast<int8_t>(code >> 7);  // 0xff where negative: an arithmetic shift of the sign
      br[i] = static_cast<uint8_t>(code) ^ 0x80;  // code + 128
    }
    for (int64_t i = 0; i < in; ++i) negative += ar[i] & static_cast<uint8_t>(mr[i]);
    neg_sum[r] = negative;
  }
  const Codes codes{q.data(), biased.data(), aq.data(), neg_mask.data(), neg_sum.data(), stride};
  const RowsKernel kernel = kernel_for(path);
  at::parallel_for(0, P, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t p = lo; p < hi; ++p) {
      const int8_t* w = wp + p * in4 * kLanes * 4;
      const int64_t n = p * kLanes, lanes = std::min(kLanes, out - n);
      alignas(64) int32_t comp[kLanes];
      for (int64_t r0 = 0; r0 < rows; r0 += kTileRows) {
        const int64_t tile = std::min(kTileRows, rows - r0);
        alignas(64) int32_t acc[kTileRows * kLanes] = {};
        kernel(codes, r0, tile, w, in4, acc, comp);
        rescale(acc, kLanes, r0, tile, n, lanes, s.data(), ws, bp, out, yp);
      }
    }
  });
  return y;
}

std::string i8_amx_refusal() { return amx_refusal(); }

std::vector<std::string> i8_isas() {
  std::vector<std::string> out;
  for (Isa isa : kAll)
    if (compiled(isa)) out.emplace_back(isa_name(isa));
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tritonlm, m) {
  m.def("i8_linear(Tensor x, Tensor panel, Tensor wscale, Tensor? bias, int out, str isa) -> Tensor");
  m.def("i8_isas() -> str[]");
  m.def("i8_amx_refusal() -> str");
}

TORCH_LIBRARY_IMPL(tritonlm, CPU, m) { m.impl("i8_linear", &i8_linear); }

TORCH_LIBRARY_IMPL(tritonlm, CompositeExplicitAutograd, m) {
  m.impl("i8_isas", &i8_isas);
  m.impl("i8_amx_refusal", &i8_amx_refusal);
}
