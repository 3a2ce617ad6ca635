// A decode-only step through every layer of a Llama in one call, for fp32 CPU models whose linear layers are
// oneDNN-packed (engine/onednn_linear.py; fp32 weights, or bf16 ones fed bf16-rounded inputs) or the int8 tier's
// (engine/int8_dynamic.py).
//
// The same calls, in the same order, as the Python layers (engine/models/llama.py with NativeLayerOps), so the
// result is bit for bit the same: add_rms_norm, the q/k/v matmul, rope_write_kv, paged_decode_attention, o_proj,
// add_rms_norm, gate_up, silu_mul, down_proj. What it removes is Python: about 25 interpreter-level calls, module
// lookups and tensor wrappers per layer, which at a decode step's few rows is a few ms a step.
// Built after the other sources in one translation unit (engine/kernels/native.py), so it calls them directly.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/extension.h>

#include <optional>
#include <string_view>
#include <vector>

namespace {

// mkldnn::_linear_pointwise on a weight from torch.ops.mkldnn._reorder_linear_weight, as OneDnnLinear calls it
torch::Tensor onednn_linear(const torch::Tensor& x, const torch::Tensor& packed,
                            const std::optional<torch::Tensor>& bias) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                         std::string_view, c10::List<std::optional<at::Scalar>>,
                                         std::optional<std::string_view>)>();
  return op.call(x, packed, bias, "none", c10::List<std::optional<at::Scalar>>(), std::nullopt);
}

// quantized::linear_dynamic on fbgemm's packed weight, called as torch.ops.quantized.linear_dynamic calls it
torch::Tensor fbgemm_linear(const torch::Tensor& x, const c10::IValue& packed, bool reduce_range) {
  static const auto& op = c10::Dispatcher::singleton().findSchemaOrThrow("quantized::linear_dynamic", "");
  torch::jit::Stack stack{x, packed, reduce_range};
  op.callBoxed(stack);
  return stack.back().toTensor();
}

// One linear layer as the engine runs it: oneDNN fp32 or bf16 weights, or the int8 tier's
// (OneDnnLinear.forward, Int8DynamicLinear.forward).
struct Linear {
  torch::Tensor onednn;  // the oneDNN-packed weight, or undefined for int8
  bool bf16 = false;  // the packed weight is bf16: the fp32 input is rounded to bf16, the result widened back
  c10::IValue int8;  // fbgemm's packed int8 weight
  bool reduce_range = false;
  torch::Tensor outliers, w_outliers;  // the int8 tier's fp32 input channels and their weights
  torch::Tensor w_rowsum;  // the int8 weights' sums over their inputs (undoes the rows' map onto [0, 1])
  std::optional<torch::Tensor> bias;

  // the oneDNN matmul on x as it is (fp32 for fp32 weights, bf16 for bf16 ones); its result in x's dtype
  torch::Tensor matmul(const torch::Tensor& x) const {
    // oneDNN runs a single row on another kernel whose sums can differ in the last bit from the same row's among
    // others (SmolLM2's down projection, K = 1536): one row runs as two, so a sequence decodes the same alone or
    // batched (OneDnnLinear.forward does the same)
    const bool single = x.size(0) == 1;
    auto y = onednn_linear(single ? at::cat({x, x}) : x, onednn, bias);
    return single ? y.narrow(0, 0, 1) : y;
  }

  torch::Tensor operator()(const torch::Tensor& x) const {
    if (onednn.defined())  // bf16 weights: the fp32 input rounded to bf16, the result widened back
      return bf16 ? matmul(x.to(at::kBFloat16)).to(at::kFloat) : matmul(x);
    auto rows = int8_rows_prepare(x, outliers);  // [scaled rows, per-row scales, the kept channels]
    auto y = int8_rows_finish_(fbgemm_linear(rows[0], int8, reduce_range), rows[1], rows[2], w_outliers, w_rowsum);
    return bias ? y + *bias : y;
  }
};

}  // namespace

class DecodeLayers {
 public:
  DecodeLayers(double eps, int64_t heads, int64_t kv_heads, int64_t dim, double scale)
      : eps_(eps), heads_(heads), kv_heads_(kv_heads), dim_(dim), scale_(scale) {}

  // a layer's two RMSNorm weights; its four linears (qkv, o, gate_up, down) follow
  void add_layer(torch::Tensor input_norm, torch::Tensor post_attention_norm) {
    TORCH_CHECK(linears_.size() == 2 * norms_.size(), "add four linear layers to each layer first");
    norms_.push_back(input_norm);
    norms_.push_back(post_attention_norm);
  }

  void add_onednn_linear(torch::Tensor packed, std::optional<torch::Tensor> bias, bool bf16) {
    bf16_ = (linears_.empty() || bf16_) && bf16;
    linears_.push_back(Linear{packed, bf16, {}, false, {}, {}, {}, bias});
  }

  void add_int8_linear(py::object packed, bool reduce_range, torch::Tensor outliers, torch::Tensor w_outliers,
                       torch::Tensor w_rowsum, std::optional<torch::Tensor> bias) {
    bf16_ = false;
    linears_.push_back(Linear{{}, false, torch::jit::toIValue(packed, c10::AnyType::get()), reduce_range, outliers,
                              w_outliers, w_rowsum, bias});
  }

  // x: [N, hidden] fp32 embeddings, one token per decoding sequence; cos, sin: [N, D]; kv_caches: [layers, 2,
  // blocks, block_size, KV, D] (fp32 or bf16); slots [N], block_tables [N, max_blocks], context_lens [N]: int64,
  // as the runner builds them. Returns the last layer's hidden state [N, hidden] (before the final norm).
  torch::Tensor run(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, torch::Tensor kv_caches,
                    torch::Tensor slots, torch::Tensor block_tables, torch::Tensor context_lens) const {
    const int64_t layers = static_cast<int64_t>(norms_.size()) / 2;
    TORCH_CHECK(static_cast<int64_t>(linears_.size()) == 4 * layers, "every layer needs its four linear layers");
    TORCH_CHECK(kv_caches.dim() == 6 && kv_caches.size(0) == layers && kv_caches.size(1) == 2 &&
                    kv_caches.is_contiguous(),
                "kv_caches must be a contiguous [layers, 2, blocks, block_size, KV, D] tensor");
    TORCH_CHECK(x.dim() == 2 && block_tables.size(0) == x.size(0), "one decode per row of x");
    const int64_t n = x.size(0);
    if (bf16_) return run_bf16(x, cos, sin, kv_caches, slots, block_tables, context_lens);
    torch::Tensor residual;
    for (int64_t l = 0; l < layers; ++l) {
      const Linear* lin = linears_.data() + 4 * l;
      torch::Tensor h;
      if (l == 0) {
        h = rms_norm(x, norms_[0], eps_);
        residual = x;
      } else {
        auto normed = add_rms_norm(residual, x, norms_[2 * l], eps_);
        h = normed[0];
        residual = normed[1];
      }
      torch::Tensor k_cache = kv_caches[l][0], v_cache = kv_caches[l][1];
      auto q = rope_write_kv(lin[0](h), cos, sin, k_cache, v_cache, slots, heads_, kv_heads_, dim_);
      auto o = paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale_);
      auto normed = add_rms_norm(residual, lin[1](o.reshape({n, heads_ * dim_})), norms_[2 * l + 1], eps_);
      residual = normed[1];
      x = lin[3](silu_mul(lin[2](normed[0])));
    }
    return residual + x;
  }

  // the layers' linear layers alone, each on its own input, with no Python between them: the ceiling that
  // bench/engine.py compares a step with
  // (every layer's bf16 matmuls, as run_bf16 calls them, take bf16 inputs: given bf16 inputs, the matmuls alone)
  void run_linears(const std::vector<torch::Tensor>& inputs) const {
    TORCH_CHECK(inputs.size() == linears_.size(), "one input per linear layer");
    for (size_t i = 0; i < inputs.size(); ++i)
      if (bf16_ && inputs[i].scalar_type() == at::kBFloat16)
        linears_[i].matmul(inputs[i]);
      else
        linears_[i](inputs[i]);
  }

 private:
  // Every linear layer bf16 (the runner's bf16 on CPU): the same arithmetic as run's, with each bf16 matmul's
  // result handed on as bf16 and its input made in bf16 by the step before it (layer_ops.cpp's and
  // paged_decode_attention.cpp's _bf16 variants), not converted by a torch call of its own on each side (two
  // passes and two tensors around each of 120 matmuls a step); the values are the same bits.
  torch::Tensor run_bf16(torch::Tensor x, const torch::Tensor& cos, const torch::Tensor& sin,
                         const torch::Tensor& kv_caches, const torch::Tensor& slots, const torch::Tensor& block_tables,
                         const torch::Tensor& context_lens) const {
    const int64_t layers = static_cast<int64_t>(norms_.size()) / 2, n = x.size(0);
    torch::Tensor residual = x, delta;  // delta: the last down projection's result, bf16
    for (int64_t l = 0; l < layers; ++l) {
      const Linear* lin = linears_.data() + 4 * l;
      torch::Tensor h;
      if (l == 0) {
        h = rms_norm_bf16(x, norms_[0], eps_);
      } else {
        auto normed = add_rms_norm_bf16(residual, delta, norms_[2 * l], eps_);
        h = normed[0];
        residual = normed[1];
      }
      torch::Tensor k_cache = kv_caches[l][0], v_cache = kv_caches[l][1];
      auto q = rope_write_kv(lin[0].matmul(h), cos, sin, k_cache, v_cache, slots, heads_, kv_heads_, dim_);
      auto o = k_cache.scalar_type() == at::kBFloat16
                   ? paged_decode_attention_bf16(q, k_cache, v_cache, block_tables, context_lens, scale_)
                   : paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale_)
                         .to(at::kBFloat16);
      auto normed = add_rms_norm_bf16(residual, lin[1].matmul(o.reshape({n, heads_ * dim_})), norms_[2 * l + 1],
                                      eps_);
      residual = normed[1];
      delta = lin[3].matmul(silu_mul_bf16(lin[2].matmul(normed[0])));
    }
    return residual + delta.to(at::kFloat);
  }

  double eps_;
  int64_t heads_, kv_heads_, dim_;
  double scale_;
  std::vector<torch::Tensor> norms_;  // two per layer
  std::vector<Linear> linears_;  // four per layer
  bool bf16_ = false;  // every linear layer's weights bf16 (under fp32 activations): run_bf16
};
