// Decode attention that reads K/V straight out of the paged cache: no gather, no padding, no mask.
//
// One query token per sequence (the cache in the model's dtype, or bf16 under an fp32 model); sequences run in parallel on torch's intra-op thread pool. Every query head is scored against the sequence's cached tokens block
// by block (a query head reads the K/V head it shares), softmaxed in fp32, and the values summed in fp32. Loops are plain C++ for the compiler to vectorize (built with -O3 -march=native on
// the machine that runs it, and OpenMP: the libgomp torch itself loads).
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

template <typename T, typename C>
static void attend_one(const T* q, const C* k_cache, const C* v_cache, const int64_t* table, int64_t ctx,
                       int64_t block_size, int64_t kv_heads, int64_t rep, int64_t dim, float scale, T* out,
                       float* scores, float* acc, float* qf) {
  // one sequence, every head; the cache is read in its own order (block, token, KV head), so each block's
  // K (then V) rows stream in once, contiguously. scores: [H, ctx]; acc, qf: [H, D]
  const int64_t heads = kv_heads * rep;
  for (int64_t i = 0; i < heads * dim; ++i) qf[i] = static_cast<float>(q[i]) * scale;
  const int64_t num_blocks = (ctx + block_size - 1) / block_size;
  for (int64_t blk = 0; blk < num_blocks; ++blk) {
    const int64_t first = blk * block_size;
    const int64_t n = std::min(block_size, ctx - first);
    const C* kb = k_cache + table[blk] * block_size * kv_heads * dim;
    for (int64_t j = 0; j < n; ++j) {
      for (int64_t h = 0; h < heads; ++h) {
        const C* kp = kb + (j * kv_heads + h / rep) * dim;
        const float* qp = qf + h * dim;
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (int64_t i = 0; i < dim; ++i) s += qp[i] * static_cast<float>(kp[i]);
        scores[h * ctx + first + j] = s;
      }
    }
  }
  std::vector<float> total(heads);
  for (int64_t h = 0; h < heads; ++h) {
    float* sr = scores + h * ctx;
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < ctx; ++t) mx = std::max(mx, sr[t]);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < ctx; ++t) {
      sr[t] = std::exp(sr[t] - mx);
      sum += sr[t];
    }
    total[h] = sum;
  }
  std::fill(acc, acc + heads * dim, 0.f);
  for (int64_t blk = 0; blk < num_blocks; ++blk) {
    const int64_t first = blk * block_size;
    const int64_t n = std::min(block_size, ctx - first);
    const C* vb = v_cache + table[blk] * block_size * kv_heads * dim;
    for (int64_t j = 0; j < n; ++j) {
      for (int64_t h = 0; h < heads; ++h) {
        const C* vp = vb + (j * kv_heads + h / rep) * dim;
        const float p = scores[h * ctx + first + j];
        float* ar = acc + h * dim;
#pragma omp simd
        for (int64_t i = 0; i < dim; ++i) ar[i] += p * static_cast<float>(vp[i]);
      }
    }
  }
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t i = 0; i < dim; ++i) out[h * dim + i] = static_cast<T>(acc[h * dim + i] / total[h]);
}

// q: [B, H, D]; k_cache, v_cache: [num_blocks, block_size, KV, D]; block_tables: [B, max_blocks] int64;
// context_lens: [B] int64 (the new token included). Returns [B, H, D].
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale) {
  TORCH_CHECK(q.device().is_cpu(), "paged_decode_attention runs on CPU tensors");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "unexpected shapes");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() &&
                  (q.scalar_type() == k_cache.scalar_type() ||
                   (q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kBFloat16)),
              "dtype mismatch: the cache must have q's dtype, or be bf16 under fp32 queries");
  TORCH_CHECK(block_tables.scalar_type() == torch::kLong && context_lens.scalar_type() == torch::kLong,
              "block tables and context lengths must be int64");
  q = q.contiguous();
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the KV cache must be contiguous");
  block_tables = block_tables.contiguous();
  context_lens = context_lens.contiguous();
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == dim && heads % kv_heads == 0, "head sizes do not match");
  TORCH_CHECK(block_tables.size(0) == batch && context_lens.size(0) == batch, "one table and length per sequence");
  const int64_t rep = heads / kv_heads, max_blocks = block_tables.size(1);
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  int64_t max_ctx = 0;
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= max_blocks * block_size, "context length out of range");
    max_ctx = std::max(max_ctx, lens[b]);
  }
  auto out = torch::empty_like(q);
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  // sequences are independent: torch's intra-op threads (torch.set_num_threads) share them
  auto run = [&](auto* qp, auto* kp, auto* vp, auto* op) {
    at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores(heads * max_ctx), acc(heads * dim), qf(heads * dim);
      for (int64_t b = begin; b < end; ++b)
        attend_one(qp + b * heads * dim, kp, vp, tables + b * max_blocks, lens[b], block_size, kv_heads, rep, dim,
                   static_cast<float>(scale), op + b * heads * dim, scores.data(), acc.data(), qf.data());
    });
  };
  if (q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kBFloat16) {  // fp32 model, bf16 KV cache
    run(q.data_ptr<float>(), k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>(),
        out.data_ptr<float>());
    return out;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    run(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(), out.data_ptr<scalar_t>());
  });
  return out;
}
