// LoRA adapters' updates of a decode step's projections, per row, on the CPU (lora_ops.cpp).
//
//   torch.classes.tritonlm.LoraWeights(num_layers)      one adapter's updates, built once per adapter
//     .set(layer, proj, a, b)      proj: 0 qkv, 1 o, 2 gate_up (or fc), 3 down (DecoderStack's order);
//                                  a [in, R], b [R, out] float32 (lora.adapter.LoraDelta: the scale
//                                  folded into b, each target's rows and columns, zeros elsewhere)
//   torch.classes.tritonlm.LoraBatch()                  one step's adapters and their rows
//     .add(weights, rows)          rows: int64 [n], which rows of a projection's input run under it
//   torch.ops.tritonlm.lora_apply(y, x, batch, layer, proj)
//                                  y [M, out] += (x[rows] @ a) @ b for each adapter's rows, in place
//
// The decoder stack (decoder_stack.cpp) calls add_lora right after each base projection, so a
// decode step with adapter rows stays one C++ call; the Python layer loop (lora.apply) calls
// lora_apply at the same place, so both give the same bits.
//
// Each adapter is applied at its own rank: nothing is padded to the largest rank in the batch.
// b is kept compact: each of its R rows only over the columns between its first and last
// non-zero (a target's own column block of a fused projection), so the zeros of the other
// targets are neither read nor added.

#pragma once

#include <ATen/core/Tensor.h>
#include <torch/custom_class.h>

#include <array>
#include <cstdint>
#include <optional>
#include <vector>

namespace tritonlm_lora {

constexpr int64_t kProjections = 4;  // qkv, o, gate_up / fc, down

struct LoraProjection {
  at::Tensor a;                 // [in, R] float32, contiguous
  at::Tensor b;                 // the compact rows of b, one after another (float32)
  std::vector<int64_t> lo;      // [R] each row's first column of y
  std::vector<int64_t> len;     // [R] its columns
  std::vector<int64_t> offset;  // [R] where it starts in b
  int64_t in = 0, out = 0, rank = 0;
};

struct LoraWeights : torch::CustomClassHolder {
  std::vector<std::array<std::optional<LoraProjection>, kProjections>> layers;

  explicit LoraWeights(int64_t num_layers);
  void set(int64_t layer, int64_t proj, at::Tensor a, at::Tensor b);
};

struct LoraBatch : torch::CustomClassHolder {
  std::vector<c10::intrusive_ptr<LoraWeights>> adapters;
  std::vector<at::Tensor> rows;  // per adapter: int64 [n_i], contiguous

  void add(c10::intrusive_ptr<LoraWeights> weights, at::Tensor adapter_rows);
  int64_t size() const { return static_cast<int64_t>(adapters.size()); }
};

// y [M, out] += each adapter's update of x [M, in] at its rows (layer `layer`, projection `proj`);
// y and x float32, contiguous. A row's result does not depend on the other rows.
void add_lora(const LoraBatch& batch, int64_t layer, int64_t proj, const at::Tensor& x, at::Tensor& y);

}  // namespace tritonlm_lora
