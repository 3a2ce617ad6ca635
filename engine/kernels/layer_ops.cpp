// The small per-layer steps between a Llama layer's matmuls, each fused into one pass over the step's rows.
//
// Unfused, torch runs about 40 tiny ops per layer (casts, pow, mean, rsqrt, rope's cat/neg/mul/add, two
// index_copy calls, silu, mul, residual adds), each with its own dispatch and allocation, which at the few rows
// of a decode step is a visible share of the step (bench/engine_ablations.py). These do the same arithmetic as
// engine/layer_ops.py's torch versions (transformers' Llama numerics, fp32), row by row. Rows are split over
// torch's intra-op threads only when there are enough of them to pay for waking a thread (prompt chunks).
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cmath>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kGrainElements = 1 << 16;  // fewer elements than this run on the calling thread

void check_fp32(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(), name,
              " must be a contiguous fp32 CPU tensor");
}

int64_t grain(int64_t row_elements) { return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, row_elements)); }

inline void norm_row(const float* x, const float* w, float eps, int64_t d, float* out) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < d; ++i) ss += x[i] * x[i];
  const float r = 1.f / std::sqrt(ss / static_cast<float>(d) + eps);
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) out[i] = w[i] * (x[i] * r);
}

// rotate-half rope of one head: out = x * cos + rotate_half(x) * sin (O: float, or bf16 for a bf16 KV cache)
template <typename O>
inline void rope_head(const float* x, const float* c, const float* s, int64_t d, O* out) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < half; ++i) out[i] = static_cast<O>(x[i] * c[i] - x[i + half] * s[i]);
  for (int64_t i = half; i < d; ++i) out[i] = static_cast<O>(x[i] * c[i] + x[i - half] * s[i]);
}

}  // namespace

// x: [N, d] -> RMSNorm(x) * weight
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_fp32(x, "x");
  check_fp32(weight, "weight");
  const int64_t n = x.size(0), d = x.size(1);
  TORCH_CHECK(x.dim() == 2 && weight.numel() == d, "rms_norm: x must be [N, d] and weight [d]");
  auto out = torch::empty_like(x);
  const float *xp = x.data_ptr<float>(), *wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n, grain(d), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) norm_row(xp + r * d, wp, static_cast<float>(eps), d, op + r * d);
  });
  return out;
}

// residual += delta (in place); returns [RMSNorm(residual) * weight, residual]
std::vector<torch::Tensor> add_rms_norm(torch::Tensor residual, torch::Tensor delta, torch::Tensor weight,
                                        double eps) {
  check_fp32(residual, "residual");
  check_fp32(delta, "delta");
  check_fp32(weight, "weight");
  const int64_t n = residual.size(0), d = residual.size(1);
  TORCH_CHECK(residual.dim() == 2 && delta.sizes() == residual.sizes() && weight.numel() == d,
              "add_rms_norm: residual and delta must be [N, d] and weight [d]");
  auto out = torch::empty_like(residual);
  float* rp = residual.data_ptr<float>();
  const float *dp = delta.data_ptr<float>(), *wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n, grain(d), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* row = rp + r * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) row[i] += dp[r * d + i];
      norm_row(row, wp, static_cast<float>(eps), d, op + r * d);
    }
  });
  return {out, residual};
}

// qkv: [N, (H + 2 KV) * D] (q, k, v side by side); cos, sin: [N, D]; k_cache, v_cache: [num_blocks, block_size,
// KV, D], fp32 or bf16; slots: [N] int64. Writes each token's rotated K and its V to its slot (rounded to the
// cache's dtype); returns rotated q [N, H, D].
torch::Tensor rope_write_kv(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache,
                            torch::Tensor v_cache, torch::Tensor slots, int64_t heads, int64_t kv_heads,
                            int64_t dim) {
  check_fp32(qkv, "qkv");
  check_fp32(cos, "cos");
  check_fp32(sin, "sin");
  TORCH_CHECK(k_cache.device().is_cpu() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.scalar_type() == v_cache.scalar_type() &&
                  (k_cache.scalar_type() == at::kFloat || k_cache.scalar_type() == at::kBFloat16),
              "k_cache and v_cache must be contiguous CPU tensors, both fp32 or both bf16");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous(), "slots must be contiguous int64");
  const int64_t n = qkv.size(0), width = (heads + 2 * kv_heads) * dim;
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == width, "rope_write_kv: qkv must be [N, (H + 2 KV) * D]");
  TORCH_CHECK(cos.size(0) == n && cos.size(1) == dim && sin.sizes() == cos.sizes() && slots.numel() == n,
              "rope_write_kv: cos and sin must be [N, D], slots [N]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.size(2) == kv_heads && k_cache.size(3) == dim &&
                  v_cache.sizes() == k_cache.sizes() && dim % 2 == 0,
              "rope_write_kv: the cache must be [blocks, block_size, KV, D]");
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < n; ++t) TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, "slot out of range");
  auto q = torch::empty({n, heads, dim}, qkv.options());
  const float *xp = qkv.data_ptr<float>(), *cp = cos.data_ptr<float>(), *snp = sin.data_ptr<float>();
  float* qp = q.data_ptr<float>();
  auto run = [&](auto* kp, auto* vp) {
    using C = std::remove_pointer_t<decltype(kp)>;
    at::parallel_for(0, n, grain(width), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const float* row = xp + t * width;
        const float *c = cp + t * dim, *s = snp + t * dim;
        for (int64_t h = 0; h < heads; ++h) rope_head(row + h * dim, c, s, dim, qp + (t * heads + h) * dim);
        C* k_slot = kp + sp[t] * kv_heads * dim;
        C* v_slot = vp + sp[t] * kv_heads * dim;
        const float* k_row = row + heads * dim;
        const float* v_row = k_row + kv_heads * dim;
        for (int64_t h = 0; h < kv_heads; ++h) rope_head(k_row + h * dim, c, s, dim, k_slot + h * dim);
        for (int64_t i = 0; i < kv_heads * dim; ++i) v_slot[i] = static_cast<C>(v_row[i]);
      }
    });
  };
  if (k_cache.scalar_type() == at::kBFloat16)
    run(k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>());
  else
    run(k_cache.data_ptr<float>(), v_cache.data_ptr<float>());
  return q;
}

// gate_up: [N, 2 I] (gate then up) -> silu(gate) * up: [N, I]
torch::Tensor silu_mul(torch::Tensor gate_up) {
  check_fp32(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "silu_mul: gate_up must be [N, 2 I]");
  const int64_t n = gate_up.size(0), inter = gate_up.size(1) / 2;
  auto out = torch::empty({n, inter}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n, grain(2 * inter), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float *g = gp + r * 2 * inter, *u = g + inter;
      float* o = op + r * inter;
#pragma omp simd
      for (int64_t i = 0; i < inter; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
    }
  });
  return out;
}
