// A decode step's whole stack of layers (Llama family and GPT-2) in one call from Python.
//
// With the fused ops (decode_ops.cpp, paged_attention.cpp) a layer is ~8 ops, and a step of
// a 30-layer model ~250 op calls from Python, each a trip through the interpreter, torch's
// Python dispatch (slower still for ops that take a packed int8 weight: every argument is
// scanned for fake script objects) and a few small tensor views: a large share of a small
// batch's step (docs/performance-notes.md). DecoderStack holds one model's layer
// weights (referenced, not copied) and runs the same ops in the same order from C++: the
// same bits as Transformer.run_layers' Python loop (runners/model.py), with the GIL released for
// the whole stack.
//
//   torch.classes.tritonlm.DecoderStack(heads)
//     .add_float(blocked, bias)                     one projection, oneDNN's blocked float32 weight
//     .add_panel(panel, bias, out)                  one projection, float32 weights in 16-wide output
//                                                   panels (float_panel.cpp's panel_linear)
//     .add_int8(packed, smooth, bias, reduce_range) one projection, PyTorch's packed int8 weight
//     .add_i8(panel, wscale, smooth, bias, out, isa)  one projection, int8 weights in 16-wide output
//                                                   panels with 8-bit activations (int8_act8.cpp's
//                                                   i8_linear); smooth: x's multiplier first, or None
//     .add_w8(panel, scale, offset, bias, out)      one projection, int8 weights in 16-wide output panels
//                                                   (uint8 codes, float16 scales and offsets) with 16-bit
//                                                   activation codes (weight_only_int8.cpp's w8_linear)
//     .add_layer(ln_attn, ln_attn_b, attn_eps, ln_mlp, ln_mlp_b, mlp_eps, rms, act, attn_scale)
//                                                   closes a layer: the 4 projections added
//                                                   before it are its qkv, o, gate_up (fc), down;
//                                                   rms: RMSNorm (biases None), else LayerNorm;
//                                                   act: "silu_mul" (Llama: silu(gate) * up)
//                                                   or "gelu_tanh" (GPT-2: gelu(fc(h)), tanh form)
//     .set_attention(window, softcap, sinks)        the last layer's attention options, as
//                                                   paged_attention_qkv takes them (each off at
//                                                   0 / None, a layer's default): a sliding window,
//                                                   logit soft-capping, attention sinks [H]
//     .set_ends(wte, wpe, ln_f, ln_f_b, eps, rms, inv_freq, rope_scaling)
//                                                   the model's ends, for decode_step: the one
//                                                   projection added after the last layer is the
//                                                   LM head; wpe: GPT-2's positions, inv_freq:
//                                                   RoPE's (each None where the model has none)
//   torch.ops.tritonlm.decoder_stack(stack, x, k_caches, v_caches, write_slots, slot_table,
//                                    positions, cos, sin, padded_rows, lora=None) -> x after the layers
//   torch.ops.tritonlm.decode_step(stack, input_ids, past_len, block_table, block_size,
//                                  k_caches, v_caches, padded_rows, lora=None) -> logits [B, V] float32
//     a whole decode step (one new token per row) from the rows' block tables: the slots, the
//     embedding, RoPE's cos/sin, the layers, the final norm and the LM head, the same ops as
//     runners/base.py's plan_step and Transformer.forward run from Python, so the same bits
//     x [B, T, C] float32; k/v_caches: one [S, Hkv, D] per layer; the rest as
//     paged_attention_qkv's; padded_rows: the row bucket of float projections
//     (runners/layers.py's blocked_rows(B * T)), ignored by int8 ones; lora: a LoraBatch
//     (lora_ops.h), the LoRA adapters of the step's rows (into the B * T rows), each adapter's
//     update added right after the base projection (before o's and down's bias), as
//     lora/apply.py's LoraLinear adds it; None: the base model alone
//   torch.ops.tritonlm.lora_apply(y, x, batch, layer, proj)   that update alone (lora_ops.h),
//     for the Python layer loop
//
// Per layer, as run_layers: h = norm(x) (layer 0) or (x, h) = (x + delta, norm(x + delta))
// (RMSNorm: add_rms_norm, one op; LayerNorm: aten's add and layer_norm); qkv = proj(h) + b;
// attention; delta = proj(a) (+ b); (x, h) as before with the MLP's norm; m = silu_mul(
// proj(h) + b) or gelu_tanh(proj(h) + b); delta = proj(m) (+ b); at the end x + delta.
//
// A stack is one model's, run by one caller at a time (the engine thread): its pinned int8
// row buffers are shared by every call.
//
// decode_step exists because at one row a small model's step is short enough for the Python
// around the stack (a dozen index tensors, the embedding, RoPE, the head: each op a trip
// through the interpreter and the dispatcher) to be a visible share of it.

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/native/quantized/PackedParams.h>
#include <ATen/ops/add.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/cos.h>
#include <ATen/ops/sin.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/embedding.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/layer_norm.h>
#include <ATen/ops/zeros.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include "lora_ops.h"

#include <algorithm>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

namespace {

using Packed = c10::intrusive_ptr<LinearPackedParamsBase>;
using tritonlm_lora::LoraBatch;
using tritonlm_lora::LoraWeights;
using Lora = std::optional<c10::intrusive_ptr<LoraBatch>>;

// The ops a layer runs, looked up once in torch's dispatcher (decode_ops.cpp,
// paged_attention.cpp and oneDNN's linear register them).
struct Ops {
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, double)> rms_norm;
  c10::TypedOperatorHandle<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                              double)>
      add_rms_norm;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&)> silu_mul;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const std::optional<at::Tensor>&,
                                      const std::optional<at::Tensor>&, const Packed&, const at::Tensor&, bool)>
      int8_linear;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                      const std::optional<at::Tensor>&, int64_t, double, int64_t, double,
                                      const std::optional<at::Tensor>&)>
      attention;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                      std::string_view, c10::List<std::optional<at::Scalar>>,
                                      std::optional<std::string_view>)>
      linear;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      const std::optional<at::Tensor>&, int64_t, int64_t, std::string_view)>
      w8_linear;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, int64_t)>
      panel_linear;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      const std::optional<at::Tensor>&, int64_t, std::string_view)>
      i8_linear;

  static const Ops& get() {
    static const Ops ops = [] {
      auto& d = c10::Dispatcher::singleton();
      return Ops{
          d.findSchemaOrThrow("tritonlm::rms_norm", "").typed<at::Tensor(const at::Tensor&, const at::Tensor&, double)>(),
          d.findSchemaOrThrow("tritonlm::add_rms_norm", "")
              .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                        double)>(),
          d.findSchemaOrThrow("tritonlm::silu_mul", "").typed<at::Tensor(const at::Tensor&)>(),
          d.findSchemaOrThrow("tritonlm::int8_linear", "")
              .typed<at::Tensor(const at::Tensor&, const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                                const Packed&, const at::Tensor&, bool)>(),
          d.findSchemaOrThrow("tritonlm::paged_attention_qkv", "")
              .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                const std::optional<at::Tensor>&, int64_t, double, int64_t, double,
                                const std::optional<at::Tensor>&)>(),
          d.findSchemaOrThrow("mkldnn::_linear_pointwise", "")
              .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                std::string_view, c10::List<std::optional<at::Scalar>>,
                                std::optional<std::string_view>)>(),
          d.findSchemaOrThrow("tritonlm::w8_linear", "")
              .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const std::optional<at::Tensor>&, int64_t, int64_t, std::string_view)>(),
          d.findSchemaOrThrow("tritonlm::panel_linear", "")
              .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, int64_t)>(),
          d.findSchemaOrThrow("tritonlm::i8_linear", "")
              .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const std::optional<at::Tensor>&, int64_t, std::string_view)>(),
      };
    }();
    return ops;
  }
};

// int8 projections' input buffers (int8_linear's `buf`): [>= 1 + rows, in], row 0 pinned to
// (1, -1, 0, ...); one per input width, shared by every projection (they run one at a time)
struct PinnedRows {
  std::vector<at::Tensor> bufs;

  const at::Tensor& take(int64_t rows, int64_t in, const at::TensorOptions& options) {
    at::Tensor* found = nullptr;
    for (auto& b : bufs)
      if (b.size(1) == in) found = &b;
    if (found && found->size(0) >= rows + 1) return *found;
    const int64_t n = std::max(rows + 1, found ? found->size(0) * 3 / 2 : int64_t{0});
    at::Tensor buf = at::zeros({n, in}, options);
    buf[0][0].fill_(1.0);
    buf[0][1].fill_(-1.0);
    if (found) {
      *found = std::move(buf);
      return *found;
    }
    bufs.push_back(std::move(buf));
    return bufs.back();
  }
};

struct Projection {
  at::Tensor blocked;  // float: oneDNN's blocked [out, in]; undefined for int8
  at::Tensor panel;    // float: [P, in, 16] output panels (float_panel.cpp); undefined otherwise
  int64_t out = 0;     // the panel's output channels (float or int8 panels)
  Packed packed;       // int8: PyTorch's packed per-channel weights; null for float
  // weight-only int8: codes [P, groups * quads per group, 16, 4] uint8, scales and offsets [P, groups, 16]
  // float16; undefined otherwise
  at::Tensor w8, w8_scale, w8_offset;
  // int8 with 8-bit activations: codes [P, in4, 16, 4] int8, scales [P * 16] float32, i8_linear's path
  at::Tensor i8, i8_scale;
  std::string i8_isa;
  std::optional<at::Tensor> smooth, bias;
  bool reduce_range = false;

  // x [..., in] -> [..., out]; with_bias: the bias inside the op (Linear.__call__), else none (Linear.matmul)
  at::Tensor operator()(const at::Tensor& x, bool with_bias, int64_t padded, PinnedRows& pinned) const {
    const Ops& ops = Ops::get();
    const int64_t in = x.size(-1);
    at::Tensor flat = x.reshape({-1, in});
    const int64_t rows = flat.size(0);
    const std::optional<at::Tensor> b = with_bias ? bias : std::nullopt;
    at::Tensor y;
    if (panel.defined()) {
      y = ops.panel_linear.call(flat, panel, b, out);
    } else if (w8.defined()) {
      y = ops.w8_linear.call(flat, w8, w8_scale, w8_offset, b, in, out, "auto");
    } else if (i8.defined()) {
      const at::Tensor scaled = smooth ? at::mul(flat, *smooth) : flat.contiguous();
      y = ops.i8_linear.call(scaled, i8, i8_scale, b, out, i8_isa);
    } else if (packed) {
      y = ops.int8_linear.call(flat.contiguous(), smooth, b, packed, pinned.take(rows, in, flat.options()),
                               reduce_range);
    } else {
      if (padded > rows) flat = at::constant_pad_nd(flat, {0, 0, 0, padded - rows}, 0);
      y = ops.linear.call(flat, blocked, b, "none", c10::List<std::optional<at::Scalar>>(), std::string_view(""));
      y = y.narrow(0, 0, rows);
    }
    auto sizes = x.sizes().vec();
    sizes.back() = y.size(-1);
    return y.view(sizes);
  }
};

struct Norm {
  at::Tensor w;                  // [C]
  std::optional<at::Tensor> b;   // [C] LayerNorm; None for RMSNorm
  double eps;
};

struct Layer {
  Norm ln_attn, ln_mlp;
  bool rms;        // RMSNorm (fused ops), else LayerNorm (aten)
  bool silu_mul;   // Llama's silu(gate) * up over gate_up, else GPT-2's gelu (tanh) over fc
  double attn_scale;
  Projection qkv, o, mlp_in, down;  // mlp_in: gate_up or fc
  // paged_attention_qkv's options (set_attention): a sliding window, soft-capping, sinks [H]
  int64_t window = 0;
  double softcap = 0.0;
  std::optional<at::Tensor> sinks;
};

// What decode_step runs around the layers (Transformer.embed and .head)
struct Ends {
  at::Tensor wte;                      // [V, C]
  std::optional<at::Tensor> wpe;       // [P, C] GPT-2's learned positions; P is a hard limit
  std::optional<at::Tensor> inv_freq;  // [D/2] RoPE's frequencies (Llama family)
  double rope_scaling = 1.0;
  Norm ln_f;
  bool rms = false;
  Projection head;                     // [C] -> [V]
};

struct DecoderStack : torch::CustomClassHolder {
  int64_t heads;
  std::vector<Layer> layers;
  PinnedRows pinned;
  std::vector<Projection> pending;  // the next layer's projections, in order qkv, o, gate_up, down
  std::optional<Ends> ends;         // set_ends: decode_step can run

  explicit DecoderStack(int64_t heads) : heads(heads) {}

  void add_float(at::Tensor blocked, std::optional<at::Tensor> bias) {
    TORCH_CHECK(blocked.defined() && blocked.device().is_cpu() && blocked.scalar_type() == at::kFloat,
                "DecoderStack.add_float: blocked must be a float32 CPU weight (oneDNN's blocked layout)");
    Projection p;
    p.blocked = std::move(blocked);
    p.bias = std::move(bias);
    add(std::move(p));
  }

  void add_panel(at::Tensor panel, std::optional<at::Tensor> bias, int64_t out) {
    TORCH_CHECK(panel.device().is_cpu() && panel.scalar_type() == at::kFloat && panel.dim() == 3 &&
                    panel.size(2) == 16 && panel.is_contiguous(),
                "DecoderStack.add_panel: panel must be a contiguous float32 CPU tensor [P, in, 16]");
    Projection p;
    p.panel = std::move(panel);
    p.out = out;
    p.bias = std::move(bias);
    add(std::move(p));
  }

  void add_int8(Packed packed, std::optional<at::Tensor> smooth, std::optional<at::Tensor> bias, bool reduce_range) {
    TORCH_CHECK(packed, "DecoderStack.add_int8: packed must be PyTorch's packed int8 linear weights");
    Projection p;
    p.packed = std::move(packed);
    p.smooth = std::move(smooth);
    p.bias = std::move(bias);
    p.reduce_range = reduce_range;
    add(std::move(p));
  }

  void add_i8(at::Tensor panel, at::Tensor wscale, std::optional<at::Tensor> smooth, std::optional<at::Tensor> bias,
              int64_t out, std::string isa) {
    TORCH_CHECK(panel.device().is_cpu() && panel.scalar_type() == at::kChar && panel.dim() == 4 &&
                    panel.size(2) == 16 && panel.size(3) == 4 && panel.is_contiguous(),
                "DecoderStack.add_i8: panel must be a contiguous int8 CPU tensor [P, in4, 16, 4]");
    TORCH_CHECK(wscale.scalar_type() == at::kFloat && wscale.numel() == panel.size(0) * 16,
                "DecoderStack.add_i8: wscale must be float32 [", panel.size(0) * 16, "]");
    Projection p;
    p.i8 = std::move(panel);
    p.i8_scale = std::move(wscale);
    p.i8_isa = std::move(isa);
    p.out = out;
    p.smooth = std::move(smooth);
    p.bias = std::move(bias);
    add(std::move(p));
  }

  void add_w8(at::Tensor panel, at::Tensor scale, at::Tensor offset, std::optional<at::Tensor> bias, int64_t out) {
    TORCH_CHECK(panel.device().is_cpu() && panel.scalar_type() == at::kByte && panel.dim() == 4 &&
                    panel.size(2) == 16 && panel.size(3) == 4 && panel.is_contiguous(),
                "DecoderStack.add_w8: panel must be a contiguous uint8 CPU tensor [P, groups * quads per group, 16, 4]");
    TORCH_CHECK(scale.scalar_type() == at::kHalf && scale.dim() == 3 && scale.size(0) == panel.size(0) &&
                    offset.sizes() == scale.sizes() && offset.scalar_type() == at::kHalf,
                "DecoderStack.add_w8: scale and offset must be float16 [", panel.size(0), ", groups, 16]");
    Projection p;
    p.w8 = std::move(panel);
    p.out = out;
    p.w8_scale = std::move(scale);
    p.w8_offset = std::move(offset);
    p.bias = std::move(bias);
    add(std::move(p));
  }

  void add_layer(at::Tensor ln_attn, std::optional<at::Tensor> ln_attn_b, double attn_eps, at::Tensor ln_mlp,
                 std::optional<at::Tensor> ln_mlp_b, double mlp_eps, bool rms, std::string act, double attn_scale) {
    TORCH_CHECK(pending.size() == 4, "DecoderStack.add_layer: a layer takes 4 projections (qkv, o, gate_up or fc, ",
                "down); ", pending.size(), " were added");
    TORCH_CHECK(act == "silu_mul" || act == "gelu_tanh", "DecoderStack.add_layer: act must be 'silu_mul' or ",
                "'gelu_tanh', not '", act, "'");
    TORCH_CHECK(!rms || (!ln_attn_b.has_value() && !ln_mlp_b.has_value()),
                "DecoderStack.add_layer: an RMSNorm has no bias");
    for (const at::Tensor* w : {&ln_attn, &ln_mlp})
      TORCH_CHECK(w->device().is_cpu() && w->scalar_type() == at::kFloat && w->dim() == 1,
                  "DecoderStack.add_layer: norm weights must be float32 CPU vectors");
    layers.push_back(Layer{Norm{std::move(ln_attn), std::move(ln_attn_b), attn_eps},
                           Norm{std::move(ln_mlp), std::move(ln_mlp_b), mlp_eps}, rms, act == "silu_mul", attn_scale,
                           std::move(pending[0]), std::move(pending[1]), std::move(pending[2]),
                           std::move(pending[3])});
    pending.clear();
  }

  void set_ends(at::Tensor wte, std::optional<at::Tensor> wpe, at::Tensor ln_f, std::optional<at::Tensor> ln_f_b,
                double eps, bool rms, std::optional<at::Tensor> inv_freq, double rope_scaling) {
    TORCH_CHECK(pending.size() == 1, "DecoderStack.set_ends: add the LM head (one projection) after the last layer ",
                "first; ", pending.size(), " projections are pending");
    TORCH_CHECK(!layers.empty(), "DecoderStack.set_ends: the stack holds no layer");
    for (const at::Tensor* t : {&wte, &ln_f})
      TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat,
                  "DecoderStack.set_ends: wte and ln_f must be float32 CPU tensors");
    TORCH_CHECK(wte.dim() == 2 && ln_f.dim() == 1 && wte.size(1) == ln_f.size(0),
                "DecoderStack.set_ends: wte must be [V, C] and ln_f [C]");
    TORCH_CHECK(!rms || !ln_f_b.has_value(), "DecoderStack.set_ends: an RMSNorm has no bias");
    TORCH_CHECK(!wpe.has_value() || (wpe->dim() == 2 && wpe->size(1) == wte.size(1)),
                "DecoderStack.set_ends: wpe must be [P, C]");
    ends = Ends{std::move(wte), std::move(wpe), std::move(inv_freq), rope_scaling,
                Norm{std::move(ln_f), std::move(ln_f_b), eps}, rms, std::move(pending[0])};
    pending.clear();
  }

  void set_attention(int64_t window, double softcap, std::optional<at::Tensor> sinks) {
    TORCH_CHECK(!layers.empty() && pending.empty(), "DecoderStack.set_attention: it sets the last layer's ",
                "attention; add_layer closes a layer first");
    TORCH_CHECK(window >= 0 && softcap >= 0.0, "DecoderStack.set_attention: window and softcap must be >= 0 ",
                "(0: none), not ", window, " and ", softcap);
    TORCH_CHECK(!sinks.has_value() || (sinks->device().is_cpu() && sinks->scalar_type() == at::kFloat &&
                                       sinks->is_contiguous() && sinks->numel() == heads),
                "DecoderStack.set_attention: sinks must be a contiguous float32 CPU tensor of ", heads, " values");
    Layer& L = layers.back();
    L.window = window;
    L.softcap = softcap;
    L.sinks = std::move(sinks);
  }

  bool has_ends() const { return ends.has_value(); }

  int64_t num_layers() const { return static_cast<int64_t>(layers.size()); }

 private:
  void add(Projection p) {
    TORCH_CHECK(pending.size() < 4, "DecoderStack: 4 projections were added; close the layer with add_layer first");
    pending.push_back(std::move(p));
  }
};

at::Tensor decoder_stack(const c10::intrusive_ptr<DecoderStack>& stack, const at::Tensor& x_in,
                         at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& write_slots,
                         const at::Tensor& slot_table, const at::Tensor& positions,
                         const std::optional<at::Tensor>& cos, const std::optional<at::Tensor>& sin,
                         int64_t padded_rows, const Lora& lora) {
  const int64_t n = stack->num_layers();
  TORCH_CHECK(n > 0 && stack->pending.empty(), "decoder_stack: the stack must hold whole layers (", n,
              " layers, ", stack->pending.size(), " projections of an unfinished one)");
  TORCH_CHECK(static_cast<int64_t>(k_caches.size()) == n && static_cast<int64_t>(v_caches.size()) == n,
              "decoder_stack: ", n, " layers need ", n, " k and v caches; got ", k_caches.size(), " and ",
              v_caches.size());
  TORCH_CHECK(x_in.dim() == 3, "decoder_stack: x must be [B, T, C], not ", x_in.sizes());
  const Ops& ops = Ops::get();
  at::Tensor x = x_in.contiguous(), h, delta;
  const int64_t C = x.size(-1);
  auto norm = [&](const at::Tensor& t, const Norm& nm, bool rms) {
    return rms ? ops.rms_norm.call(t, nm.w, nm.eps) : at::layer_norm(t, {C}, nm.w, nm.b, nm.eps);
  };
  auto add_norm = [&](const Norm& nm, bool rms, at::Tensor& h) {  // x += delta; h = norm(x)
    if (rms) {
      std::tie(x, h) = ops.add_rms_norm.call(x, delta.contiguous(), nm.w, nm.eps);
    } else {
      x = at::add(x, delta);
      h = norm(x, nm, false);
    }
  };
  // each adapter's update of a projection's rows, right after the base projection (before a
  // row-parallel projection's bias, as lora.apply's LoraLinear.matmul)
  auto adapt = [&](at::Tensor y, const at::Tensor& in, int64_t li, int64_t proj) {
    if (!lora.has_value()) return y;
    y = y.contiguous();
    at::Tensor flat_y = y.view({-1, y.size(-1)});
    tritonlm_lora::add_lora(**lora, li, proj, in.reshape({-1, in.size(-1)}).contiguous(), flat_y);
    return y;
  };
  // world 1's row-parallel projection: the matmul, the adapters' updates, then the bias
  auto row_parallel = [&](const Projection& p, const at::Tensor& in, int64_t li, int64_t proj) {
    at::Tensor y = adapt(p(in, false, padded_rows, stack->pinned), in, li, proj);
    return p.bias.has_value() ? at::add(y, *p.bias) : y;
  };
  for (int64_t li = 0; li < n; ++li) {
    const Layer& L = stack->layers[li];
    if (!delta.defined()) {
      h = norm(x, L.ln_attn, L.rms);
    } else {
      add_norm(L.ln_attn, L.rms, h);
    }
    const at::Tensor qkv = adapt(L.qkv(h, true, padded_rows, stack->pinned), h, li, 0);
    const at::Tensor a = ops.attention.call(qkv.contiguous(), k_caches[li], v_caches[li], write_slots, slot_table,
                                            positions, cos, sin, stack->heads, L.attn_scale, L.window, L.softcap,
                                            L.sinks);
    delta = row_parallel(L.o, a, li, 1);
    add_norm(L.ln_mlp, L.rms, h);
    const at::Tensor inner = adapt(L.mlp_in(h, true, padded_rows, stack->pinned), h, li, 2);
    const at::Tensor m = L.silu_mul ? ops.silu_mul.call(inner.contiguous()) : at::gelu(inner, "tanh");
    delta = row_parallel(L.down, m, li, 3);
  }
  return at::add(x, delta);
}

constexpr int64_t kScratchSlot = 0;  // kv_cache.py's SCRATCH_SLOT

at::Tensor decode_step(const c10::intrusive_ptr<DecoderStack>& stack, const at::Tensor& input_ids,
                       const at::Tensor& past_len, const at::Tensor& block_table, int64_t block_size,
                       at::TensorList k_caches, at::TensorList v_caches, int64_t padded_rows, const Lora& lora) {
  TORCH_CHECK(stack->ends.has_value(), "decode_step: the stack has no ends (DecoderStack.set_ends)");
  const Ends& e = *stack->ends;
  TORCH_CHECK_VALUE(input_ids.dim() == 2 && input_ids.size(1) == 1 && input_ids.scalar_type() == at::kLong,
                    "decode_step: input_ids must be int64 [B, 1] (one new token per row), not ",
                    input_ids.scalar_type(), " ", input_ids.sizes());
  const int64_t B = input_ids.size(0);
  TORCH_CHECK_VALUE(B > 0, "decode_step: the batch is empty");
  TORCH_CHECK_VALUE(past_len.dim() == 1 && past_len.size(0) == B && past_len.scalar_type() == at::kLong,
                    "decode_step: past_len must be int64 [", B, "], not ", past_len.sizes());
  TORCH_CHECK_VALUE(block_table.dim() == 2 && block_table.size(0) == B && block_size > 0,
                    "decode_step: block_table must be [", B, ", M] with block_size > 0");
  const at::Tensor past = past_len.contiguous();
  const int64_t* pl = past.data_ptr<int64_t>();
  int64_t L = 0;  // keys of the longest row: its past and the new token
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK_VALUE(pl[b] >= 0, "decode_step: past_len must be >= 0, got ", pl[b], " in row ", b);
    L = std::max(L, pl[b] + 1);
  }
  if (e.wpe.has_value())
    TORCH_CHECK_VALUE(L <= e.wpe->size(0), "sequence length ", L, " exceeds the model's max_positions=",
                      e.wpe->size(0));
  const int64_t M = block_table.size(1);
  TORCH_CHECK_VALUE(M * block_size >= L, "decode_step: block_table holds ", M, " blocks; ", L,
                    " positions need more");
  // plan_step's slot_table (slots of positions < past + 1, the scratch slot past them) and
  // write_slots (the new token's slot), mapped row by row from the blocks
  const at::Tensor table = block_table.to(at::kLong).contiguous();
  const int64_t* blocks = table.data_ptr<int64_t>();
  at::Tensor slot_table = at::empty({B, L}, past.options());
  at::Tensor write_slots = at::empty({B, 1}, past.options());
  int64_t* st = slot_table.data_ptr<int64_t>();
  int64_t* ws = write_slots.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = pl[b] + 1;
    int64_t* row = st + b * L;
    for (int64_t p = 0; p < n; ++p) row[p] = blocks[b * M + p / block_size] * block_size + p % block_size;
    std::fill(row + n, row + L, kScratchSlot);
    ws[b] = row[n - 1];
  }
  const at::Tensor positions = past.view({B, 1});  // [B, 1]
  // Transformer.embed
  at::Tensor x = at::embedding(e.wte, input_ids);  // [B, 1, C]
  if (e.wpe.has_value()) x = at::add(x, at::embedding(*e.wpe, positions));
  // layers.rope_cos_sin
  std::optional<at::Tensor> cos, sin;
  if (e.inv_freq.has_value()) {
    const at::Tensor freqs = at::mul(positions.unsqueeze(-1).to(at::kFloat), *e.inv_freq);  // [B, 1, D/2]
    const at::Tensor emb = at::cat({freqs, freqs}, -1);                                     // [B, 1, D]
    cos = at::mul(at::cos(emb), e.rope_scaling).unsqueeze(2);                               // [B, 1, 1, D]
    sin = at::mul(at::sin(emb), e.rope_scaling).unsqueeze(2);
  }
  x = decoder_stack(stack, x, k_caches, v_caches, write_slots, slot_table, positions, cos, sin, padded_rows, lora);
  // Transformer.head: the final norm and the LM head on each row's one position
  const at::Tensor last = x.select(1, 0);  // [B, C]
  const Ops& ops = Ops::get();
  const at::Tensor h = e.rms ? ops.rms_norm.call(last.contiguous(), e.ln_f.w, e.ln_f.eps)
                             : at::layer_norm(last, {last.size(-1)}, e.ln_f.w, e.ln_f.b, e.ln_f.eps);
  return e.head(h, true, padded_rows, stack->pinned).to(at::kFloat);  // [B, V]
}

void lora_apply(at::Tensor y, const at::Tensor& x, const c10::intrusive_ptr<LoraBatch>& batch, int64_t layer,
                int64_t proj) {
  TORCH_CHECK_VALUE(proj >= 0 && proj < tritonlm_lora::kProjections, "lora_apply: proj must be 0 (qkv), 1 (o), ",
                    "2 (gate_up or fc) or 3 (down), not ", proj);
  tritonlm_lora::add_lora(*batch, layer, proj, x, y);
}

}  // namespace

// The adapters' classes are registered here, before the ops whose schemas name them (one
// library fragment: static initializers of two files run in no fixed order).
TORCH_LIBRARY_FRAGMENT(tritonlm, m) {
  m.class_<LoraWeights>("LoraWeights")
      .def(torch::init<int64_t>())
      .def("set", &LoraWeights::set);
  m.class_<LoraBatch>("LoraBatch")
      .def(torch::init<>())
      .def("add", &LoraBatch::add)
      .def("size", &LoraBatch::size);
  m.class_<DecoderStack>("DecoderStack")
      .def(torch::init<int64_t>())
      .def("add_float", &DecoderStack::add_float)
      .def("add_int8", &DecoderStack::add_int8)
      .def("add_i8", &DecoderStack::add_i8)
      .def("add_w8", &DecoderStack::add_w8)
      .def("add_panel", &DecoderStack::add_panel)
      .def("add_layer", &DecoderStack::add_layer)
      .def("set_attention", &DecoderStack::set_attention)
      .def("set_ends", &DecoderStack::set_ends)
      .def("has_ends", &DecoderStack::has_ends)
      .def("num_layers", &DecoderStack::num_layers);
  m.def("decoder_stack(__torch__.torch.classes.tritonlm.DecoderStack stack, Tensor x, Tensor(a!)[] k_caches, "
        "Tensor(b!)[] v_caches, Tensor write_slots, Tensor slot_table, Tensor positions, Tensor? cos, Tensor? sin, "
        "int padded_rows, __torch__.torch.classes.tritonlm.LoraBatch? lora=None) -> Tensor");
  m.def("decode_step(__torch__.torch.classes.tritonlm.DecoderStack stack, Tensor input_ids, Tensor past_len, "
        "Tensor block_table, int block_size, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, int padded_rows, "
        "__torch__.torch.classes.tritonlm.LoraBatch? lora=None) -> Tensor");
  m.def("lora_apply(Tensor(a!) y, Tensor x, __torch__.torch.classes.tritonlm.LoraBatch batch, int layer, "
        "int proj) -> ()");
}

TORCH_LIBRARY_IMPL(tritonlm, CPU, m) {
  m.impl("decoder_stack", &decoder_stack);
  m.impl("decode_step", &decode_step);
  m.impl("lora_apply", &lora_apply);
}
