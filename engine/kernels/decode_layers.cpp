// A decode-only step through every layer of an fp32 Llama in one call, for CPU models whose linear layers are
// oneDNN-packed (engine/onednn_linear.py).
//
// The same calls, in the same order, as the Python layers (engine/models/llama.py with NativeLayerOps), so the
// result is bit for bit the same: add_rms_norm, the packed q/k/v matmul, rope_write_kv, paged_decode_attention,
// o_proj, add_rms_norm, gate_up, silu_mul, down_proj. What it removes is Python: about 25 interpreter-level
// calls, module lookups and tensor wrappers per layer, which at a decode step's few rows is a few ms a step.
// Built after layer_ops.cpp and paged_decode_attention.cpp in one translation unit (engine/kernels/native.py).
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/extension.h>

#include <optional>
#include <string_view>
#include <vector>

namespace {

constexpr int64_t kTensorsPerLayer = 9;  // norm1, qkv, qkv bias, o, norm2, gate_up, gate_up bias, down, down bias

// mkldnn::_linear_pointwise on a weight from torch.ops.mkldnn._reorder_linear_weight, as OneDnnLinear calls it
torch::Tensor packed_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& bias) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                         std::string_view, c10::List<std::optional<at::Scalar>>,
                                         std::optional<std::string_view>)>();
  std::optional<at::Tensor> b;
  if (bias.defined() && bias.numel() > 0) b = bias;
  return op.call(x, packed, b, "none", c10::List<std::optional<at::Scalar>>(), std::nullopt);
}

}  // namespace

// x: [N, hidden] fp32 embeddings of the step's tokens, one per decoding sequence; weights: kTensorsPerLayer per
// layer (an empty tensor for a missing bias); cos, sin: [N, D]; kv_caches: [layers, 2, blocks, block_size, KV, D]
// (fp32, or bf16); slots [N], block_tables [N, max_blocks], context_lens [N]: int64, as the runner builds them.
// Returns the last layer's hidden state [N, hidden] (before the final norm).
torch::Tensor decode_layers(torch::Tensor x, std::vector<torch::Tensor> weights, torch::Tensor cos, torch::Tensor sin,
                            torch::Tensor kv_caches, torch::Tensor slots, torch::Tensor block_tables,
                            torch::Tensor context_lens, double eps, int64_t heads, int64_t kv_heads, int64_t dim,
                            double scale) {
  const int64_t layers = kv_caches.size(0);
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == layers * kTensorsPerLayer,
              "decode_layers: expected ", kTensorsPerLayer, " tensors per layer");
  TORCH_CHECK(kv_caches.dim() == 6 && kv_caches.size(1) == 2 && kv_caches.is_contiguous(),
              "decode_layers: kv_caches must be a contiguous [layers, 2, blocks, block_size, KV, D] tensor");
  TORCH_CHECK(x.dim() == 2 && block_tables.size(0) == x.size(0), "decode_layers: one decode per row of x");
  const int64_t n = x.size(0);
  torch::Tensor residual;
  for (int64_t l = 0; l < layers; ++l) {
    const torch::Tensor* w = weights.data() + l * kTensorsPerLayer;
    torch::Tensor h;
    if (l == 0) {
      h = rms_norm(x, w[0], eps);
      residual = x;
    } else {
      auto normed = add_rms_norm(residual, x, w[0], eps);
      h = normed[0];
      residual = normed[1];
    }
    torch::Tensor kv = kv_caches[l];
    torch::Tensor k_cache = kv[0], v_cache = kv[1];
    auto q = rope_write_kv(packed_linear(h, w[1], w[2]), cos, sin, k_cache, v_cache, slots, heads, kv_heads, dim);
    auto o = paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale);
    auto normed = add_rms_norm(residual, packed_linear(o.reshape({n, heads * dim}), w[3], torch::Tensor()), w[4], eps);
    residual = normed[1];
    x = packed_linear(silu_mul(packed_linear(normed[0], w[5], w[6])), w[7], w[8]);
  }
  return residual + x;
}
