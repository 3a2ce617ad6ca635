// The small per-layer steps between a Llama layer's matmuls, each fused into one pass over the step's rows.
//
// Unfused, torch runs about 40 tiny ops per layer (casts, pow, mean, rsqrt, rope's cat/neg/mul/add, two
// index_copy calls, silu, mul, residual adds), each with its own dispatch and allocation, which at the few rows
// of a decode step is a visible share of the step (bench/engine_ablations.py). These do the same arithmetic as
// engine/layer_ops.py's torch versions (transformers' Llama numerics, fp32), row by row. Rows are split over
// torch's intra-op threads only when there are enough of them to pay for waking a thread (prompt chunks).
//
// The `_bf16` variants serve the native decode step of bf16 weights under fp32 activations (decode_layers.cpp):
// they take a bf16 matmul's result as it comes (widened exactly, in registers) and return the next matmul's input
// already rounded to bf16, so the step makes no separate conversion pass (two torch calls, two tensors) around each
// of its matmuls. Each computes a row's fp32 values with the same function the fp32 step uses (kept out of line, so
// the same instructions) and rounds them as torch's `.to(torch.bfloat16)` does: the same bits as the Python
// layers, which convert with torch (tests/engine/test_layer_ops.py, tests/engine/test_decode_step.py).
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

void check_fp32_or_bf16(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && (t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16) &&
                  t.is_contiguous(),
              name, " must be a contiguous fp32 or bf16 CPU tensor");
}

// Out of line (as are the other row functions below): the fp32 and bf16 variants run the same instructions, so their
// fp32 values are the same bits whatever the compiler would have made of each inlined copy under -ffast-math.
__attribute__((noinline)) void norm_row(const float* x, const float* w, float eps, int64_t d, float* out) {
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

__attribute__((noinline)) void add_row(float* row, const float* delta, int64_t d) {
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) row[i] += delta[i];
}

__attribute__((noinline)) void silu_mul_row(const float* g, int64_t inter, float* o) {
  const float* u = g + inter;
#pragma omp simd
  for (int64_t i = 0; i < inter; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
}

// One token's q, K and V: rotated q into qp [H, D], rotated K and V (rounded to the cache's dtype) into their slots
template <typename C>
__attribute__((noinline)) void rope_row(const float* row, const float* c, const float* s, int64_t heads,
                                        int64_t kv_heads, int64_t dim, float* qp, C* k_slot, C* v_slot) {
  for (int64_t h = 0; h < heads; ++h) rope_head(row + h * dim, c, s, dim, qp + h * dim);
  const float* k_row = row + heads * dim;
  const float* v_row = k_row + kv_heads * dim;
  for (int64_t h = 0; h < kv_heads; ++h) rope_head(k_row + h * dim, c, s, dim, k_slot + h * dim);
  for (int64_t i = 0; i < kv_heads * dim; ++i) v_slot[i] = static_cast<C>(v_row[i]);
}

// residual += delta (fp32, or bf16 widened) in place; out = RMSNorm(residual) * weight (fp32, or rounded to bf16)
template <typename D, typename O>
void add_rms_norm_rows(float* rp, const D* dp, const float* wp, float eps, int64_t n, int64_t d, O* op) {
  at::parallel_for(0, n, grain(d), [&](int64_t begin, int64_t end) {
    std::vector<float> buf(std::is_same_v<D, float> && std::is_same_v<O, float> ? 0 : 2 * d);
    for (int64_t r = begin; r < end; ++r) {
      float* row = rp + r * d;
      add_row(row, fp32_row(dp + r * d, d, buf.data()), d);
      if constexpr (std::is_same_v<O, float>) {
        norm_row(row, wp, eps, d, op + r * d);
      } else {
        norm_row(row, wp, eps, d, buf.data() + d);
        narrow_row(buf.data() + d, d, op + r * d);
      }
    }
  });
}

}  // namespace

namespace {

// x: [N, d] -> RMSNorm(x) * weight, fp32 or rounded to bf16
torch::Tensor rms_norm_as(const torch::Tensor& x, const torch::Tensor& weight, double eps, at::ScalarType out_dtype) {
  check_fp32(x, "x");
  check_fp32(weight, "weight");
  const int64_t n = x.size(0), d = x.size(1);
  TORCH_CHECK(x.dim() == 2 && weight.numel() == d, "rms_norm: x must be [N, d] and weight [d]");
  auto out = torch::empty(x.sizes(), x.options().dtype(out_dtype));
  const float *xp = x.data_ptr<float>(), *wp = weight.data_ptr<float>();
  const bool narrow = out_dtype == at::kBFloat16;
  at::parallel_for(0, n, grain(d), [&](int64_t begin, int64_t end) {
    std::vector<float> buf(narrow ? d : 0);
    for (int64_t r = begin; r < end; ++r) {
      if (!narrow) {
        norm_row(xp + r * d, wp, static_cast<float>(eps), d, out.data_ptr<float>() + r * d);
      } else {
        norm_row(xp + r * d, wp, static_cast<float>(eps), d, buf.data());
        narrow_row(buf.data(), d, out.data_ptr<at::BFloat16>() + r * d);
      }
    }
  });
  return out;
}

// residual += delta (fp32 or bf16; in place); returns [RMSNorm(residual) * weight (fp32 or bf16), residual]
std::vector<torch::Tensor> add_rms_norm_as(torch::Tensor residual, const torch::Tensor& delta,
                                           const torch::Tensor& weight, double eps, at::ScalarType out_dtype) {
  check_fp32(residual, "residual");
  check_fp32_or_bf16(delta, "delta");
  check_fp32(weight, "weight");
  const int64_t n = residual.size(0), d = residual.size(1);
  TORCH_CHECK(residual.dim() == 2 && delta.sizes() == residual.sizes() && weight.numel() == d,
              "add_rms_norm: residual and delta must be [N, d] and weight [d]");
  auto out = torch::empty(residual.sizes(), residual.options().dtype(out_dtype));
  float* rp = residual.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  const float e = static_cast<float>(eps);
  const bool bf16_delta = delta.scalar_type() == at::kBFloat16, narrow = out_dtype == at::kBFloat16;
  if (!bf16_delta && !narrow)
    add_rms_norm_rows(rp, delta.data_ptr<float>(), wp, e, n, d, out.data_ptr<float>());
  else if (!bf16_delta)
    add_rms_norm_rows(rp, delta.data_ptr<float>(), wp, e, n, d, out.data_ptr<at::BFloat16>());
  else if (!narrow)
    add_rms_norm_rows(rp, delta.data_ptr<at::BFloat16>(), wp, e, n, d, out.data_ptr<float>());
  else
    add_rms_norm_rows(rp, delta.data_ptr<at::BFloat16>(), wp, e, n, d, out.data_ptr<at::BFloat16>());
  return {out, residual};
}

// gate_up: [N, 2 I] (gate then up; fp32 or bf16) -> silu(gate) * up: [N, I], fp32 or rounded to bf16
torch::Tensor silu_mul_as(const torch::Tensor& gate_up, at::ScalarType out_dtype) {
  check_fp32_or_bf16(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "silu_mul: gate_up must be [N, 2 I]");
  const int64_t n = gate_up.size(0), inter = gate_up.size(1) / 2;
  auto out = torch::empty({n, inter}, gate_up.options().dtype(out_dtype));
  const bool widen = gate_up.scalar_type() == at::kBFloat16, narrow = out_dtype == at::kBFloat16;
  at::parallel_for(0, n, grain(2 * inter), [&](int64_t begin, int64_t end) {
    std::vector<float> in(widen ? 2 * inter : 0), res(narrow ? inter : 0);
    for (int64_t r = begin; r < end; ++r) {
      const float* g = widen ? fp32_row(gate_up.data_ptr<at::BFloat16>() + r * 2 * inter, 2 * inter, in.data())
                             : gate_up.data_ptr<float>() + r * 2 * inter;
      float* o = narrow ? res.data() : out.data_ptr<float>() + r * inter;
      silu_mul_row(g, inter, o);
      if (narrow) narrow_row(o, inter, out.data_ptr<at::BFloat16>() + r * inter);
    }
  });
  return out;
}

}  // namespace

// x: [N, d] -> RMSNorm(x) * weight
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  return rms_norm_as(x, weight, eps, at::kFloat);
}

// the same, rounded to bf16 (the input of a bf16 matmul): rms_norm(...).to(torch.bfloat16), bit for bit
torch::Tensor rms_norm_bf16(torch::Tensor x, torch::Tensor weight, double eps) {
  return rms_norm_as(x, weight, eps, at::kBFloat16);
}

// residual += delta (in place); returns [RMSNorm(residual) * weight, residual]
std::vector<torch::Tensor> add_rms_norm(torch::Tensor residual, torch::Tensor delta, torch::Tensor weight,
                                        double eps) {
  check_fp32(delta, "delta");
  return add_rms_norm_as(residual, delta, weight, eps, at::kFloat);
}

// the same with delta fp32 or bf16 (a bf16 matmul's result) and the norm rounded to bf16: add_rms_norm(residual,
// delta.float(), ...) with its first result .to(torch.bfloat16), bit for bit
std::vector<torch::Tensor> add_rms_norm_bf16(torch::Tensor residual, torch::Tensor delta, torch::Tensor weight,
                                             double eps) {
  return add_rms_norm_as(residual, delta, weight, eps, at::kBFloat16);
}

// qkv: [N, (H + 2 KV) * D] (q, k, v side by side; fp32, or bf16 from a bf16 matmul, widened exactly); cos, sin:
// [N, D]; k_cache, v_cache: [num_blocks, block_size, KV, D], fp32 or bf16; slots: [N] int64. Writes each token's
// rotated K and its V to its slot (rounded to the cache's dtype); returns rotated q [N, H, D] (fp32).
torch::Tensor rope_write_kv(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache,
                            torch::Tensor v_cache, torch::Tensor slots, int64_t heads, int64_t kv_heads,
                            int64_t dim) {
  check_fp32_or_bf16(qkv, "qkv");
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
  auto q = torch::empty({n, heads, dim}, qkv.options().dtype(at::kFloat));
  const float *cp = cos.data_ptr<float>(), *snp = sin.data_ptr<float>();
  float* qp = q.data_ptr<float>();
  auto run = [&](auto* xp, auto* kp, auto* vp) {
    at::parallel_for(0, n, grain(width), [&](int64_t begin, int64_t end) {
      std::vector<float> buf(std::is_same_v<std::remove_pointer_t<decltype(xp)>, float> ? 0 : width);
      for (int64_t t = begin; t < end; ++t)
        rope_row(fp32_row(xp + t * width, width, buf.data()), cp + t * dim, snp + t * dim, heads, kv_heads, dim,
                 qp + t * heads * dim, kp + sp[t] * kv_heads * dim, vp + sp[t] * kv_heads * dim);
    });
  };
  auto with_cache = [&](auto* xp) {
    if (k_cache.scalar_type() == at::kBFloat16)
      run(xp, k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>());
    else
      run(xp, k_cache.data_ptr<float>(), v_cache.data_ptr<float>());
  };
  if (qkv.scalar_type() == at::kBFloat16)
    with_cache(qkv.data_ptr<at::BFloat16>());
  else
    with_cache(qkv.data_ptr<float>());
  return q;
}

// gate_up: [N, 2 I] (gate then up) -> silu(gate) * up: [N, I]
torch::Tensor silu_mul(torch::Tensor gate_up) {
  check_fp32(gate_up, "gate_up");
  return silu_mul_as(gate_up, at::kFloat);
}

// the same with gate_up fp32 or bf16 (a bf16 matmul's result) and the result rounded to bf16: silu_mul(
// gate_up.float()).to(torch.bfloat16), bit for bit
torch::Tensor silu_mul_bf16(torch::Tensor gate_up) { return silu_mul_as(gate_up, at::kBFloat16); }
