// LoRA updates of a projection's rows, grouped by adapter (lora_ops.h says what each part takes).
//
// A step's rows under one adapter are few (a decode step has one per sequence), so an update
// is two thin products per row: h = x @ a ([in] -> [R]) and y += h @ b ([R] -> [out]). The
// work is split into (adapter, up to kChunk rows) items, over torch's threads when there is
// enough of it (a wide prefill; a decode step's runs on the calling thread): an item reads
// its adapter's a and b once for all its rows, and writes only its own rows of y, so items
// never share an output and the order of the sums within a row is fixed (k over `in` in
// order, then r over R in order): a row's bits do not depend on the batch around it.

#include "lora_ops.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <string>

namespace tritonlm_lora {

namespace {

constexpr int64_t kChunk = 4;  // rows per work item: a and b read once for them
constexpr int64_t kParallelWork = int64_t{1} << 22;  // multiply-adds below which one thread does all

struct Item {
  int64_t group, first, count;  // adapter, its first row (into its rows), rows
};

}  // namespace

LoraWeights::LoraWeights(int64_t num_layers) {
  TORCH_CHECK_VALUE(num_layers > 0, "LoraWeights: num_layers must be > 0, not ", num_layers);
  layers.resize(num_layers);
}

void LoraWeights::set(int64_t layer, int64_t proj, at::Tensor a, at::Tensor b) {
  TORCH_CHECK_VALUE(layer >= 0 && layer < static_cast<int64_t>(layers.size()), "LoraWeights.set: layer ", layer,
                    " is outside [0, ", layers.size(), ")");
  TORCH_CHECK_VALUE(proj >= 0 && proj < kProjections, "LoraWeights.set: proj must be 0 (qkv), 1 (o), 2 (gate_up ",
                    "or fc) or 3 (down), not ", proj);
  TORCH_CHECK_VALUE(a.device().is_cpu() && b.device().is_cpu() && a.scalar_type() == at::kFloat &&
                        b.scalar_type() == at::kFloat && a.dim() == 2 && b.dim() == 2 && a.size(1) == b.size(0),
                    "LoraWeights.set: a must be float32 CPU [in, R] and b float32 CPU [R, out]; got a ",
                    a.scalar_type(), " ", a.sizes(), ", b ", b.scalar_type(), " ", b.sizes());
  LoraProjection p;
  p.a = a.contiguous();
  p.in = a.size(0);
  p.rank = a.size(1);
  p.out = b.size(1);
  const at::Tensor full = b.contiguous();
  const float* src = full.data_ptr<float>();
  std::vector<float> packed;
  for (int64_t r = 0; r < p.rank; ++r) {
    const float* row = src + r * p.out;
    int64_t lo = 0, hi = p.out;
    while (lo < hi && row[lo] == 0.0f) ++lo;
    while (hi > lo && row[hi - 1] == 0.0f) --hi;
    p.lo.push_back(lo);
    p.len.push_back(hi - lo);
    p.offset.push_back(static_cast<int64_t>(packed.size()));
    packed.insert(packed.end(), row + lo, row + hi);
  }
  p.b = at::empty({static_cast<int64_t>(packed.size())}, full.options());
  std::copy(packed.begin(), packed.end(), p.b.data_ptr<float>());
  layers[layer][proj] = std::move(p);
}

void LoraBatch::add(c10::intrusive_ptr<LoraWeights> weights, at::Tensor adapter_rows) {
  TORCH_CHECK_VALUE(weights, "LoraBatch.add: weights must be a LoraWeights");
  TORCH_CHECK_VALUE(adapter_rows.device().is_cpu() && adapter_rows.scalar_type() == at::kLong &&
                        adapter_rows.dim() == 1,
                    "LoraBatch.add: rows must be an int64 CPU vector, not ", adapter_rows.scalar_type(), " ",
                    adapter_rows.sizes());
  at::Tensor r = adapter_rows.contiguous();
  const int64_t* p = r.data_ptr<int64_t>();
  for (int64_t i = 0; i < r.numel(); ++i)
    TORCH_CHECK_VALUE(p[i] >= 0, "LoraBatch.add: rows must be >= 0, got ", p[i]);
  adapters.push_back(std::move(weights));
  rows.push_back(std::move(r));
}

void add_lora(const LoraBatch& batch, int64_t layer, int64_t proj, const at::Tensor& x, at::Tensor& y) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && y.scalar_type() == at::kFloat && x.is_contiguous() &&
                  y.is_contiguous() && x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0),
              "lora_apply: x [M, in] and y [M, out] must be contiguous float32; got ", x.sizes(), " and ",
              y.sizes());
  const int64_t M = x.size(0), in = x.size(1), out = y.size(1);
  std::vector<Item> items;
  std::vector<char> taken(M, 0);  // a row under two adapters would be written by two threads
  int64_t widest = 0;  // the largest rank among the items: the size of a thread's h
  int64_t work = 0;    // multiply-adds in all
  for (int64_t g = 0; g < batch.size(); ++g) {
    const auto& layers = batch.adapters[g]->layers;
    TORCH_CHECK(layer >= 0 && layer < static_cast<int64_t>(layers.size()), "lora_apply: layer ", layer,
                " is outside the adapter's ", layers.size(), " layers");
    const auto& p = layers[layer][proj];
    const int64_t n = batch.rows[g].numel();
    if (!p.has_value() || n == 0) continue;
    TORCH_CHECK(p->in == in && p->out == out, "lora_apply: layer ", layer, " projection ", proj, " is [", in,
                ", ", out, "]; the adapter's update is [", p->in, ", ", p->out, "]");
    const int64_t* rows = batch.rows[g].data_ptr<int64_t>();
    for (int64_t i = 0; i < n; ++i) {
      TORCH_CHECK(rows[i] < M, "lora_apply: row ", rows[i], " of the batch is outside the projection's ", M, " rows");
      TORCH_CHECK(!taken[rows[i]], "lora_apply: row ", rows[i], " is named twice in the batch");
      taken[rows[i]] = 1;
    }
    widest = std::max(widest, p->rank);
    int64_t b_len = 0;
    for (const int64_t len : p->len) b_len += len;
    work += n * (in * p->rank + b_len);
    for (int64_t first = 0; first < n; first += kChunk) items.push_back({g, first, std::min(kChunk, n - first)});
  }
  if (items.empty()) return;
  // a decode step's update is a few hundred thousand multiply-adds: this thread alone does it
  // sooner than a team would wake up and meet at the barrier (twice per adapted layer)
  const int64_t count = static_cast<int64_t>(items.size());
  const int64_t grain = work < kParallelWork ? count : 1;
  const float* xs = x.data_ptr<float>();
  float* ys = y.data_ptr<float>();
  at::parallel_for(0, count, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> h(kChunk * widest);
    for (int64_t it = begin; it < end; ++it) {
      const Item& item = items[it];
      const LoraProjection& p = *batch.adapters[item.group]->layers[layer][proj];
      const int64_t* rows = batch.rows[item.group].data_ptr<int64_t>() + item.first;
      const int64_t R = p.rank, count = item.count;
      const float* a = p.a.data_ptr<float>();
      std::fill(h.begin(), h.begin() + count * R, 0.0f);
      // h[j] = x[rows[j]] @ a: a's rows in order, each read once for every row of the item
      for (int64_t k = 0; k < in; ++k) {
        const float* __restrict ak = a + k * R;
        for (int64_t j = 0; j < count; ++j) {
          const float xv = xs[rows[j] * in + k];
          float* __restrict hj = h.data() + j * R;
#pragma omp simd
          for (int64_t r = 0; r < R; ++r) hj[r] += xv * ak[r];
        }
      }
      // y[rows[j]] += h[j] @ b: each of b's rows over its own columns only
      const float* b = p.b.data_ptr<float>();
      for (int64_t r = 0; r < R; ++r) {
        const float* __restrict br = b + p.offset[r];
        const int64_t lo = p.lo[r], len = p.len[r];
        for (int64_t j = 0; j < count; ++j) {
          const float hv = h[j * R + r];
          float* __restrict yj = ys + rows[j] * out + lo;
#pragma omp simd
          for (int64_t c = 0; c < len; ++c) yj[c] += hv * br[c];
        }
      }
    }
  });
}

}  // namespace tritonlm_lora
