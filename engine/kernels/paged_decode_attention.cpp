// Decode attention that reads K/V straight out of the paged cache: no gather, no padding, no mask.
//
// One query token per sequence (the cache in the model's dtype, or bf16 under an fp32 model); sequences run in
// parallel on torch's intra-op thread pool. Every query head is scored against the sequence's cached tokens block
// by block (a query head reads the K/V head it shares), softmaxed in fp32, and the values summed in fp32.
// With AVX2 and FMA (the build uses -march=native on the machine that runs it), head sizes that are a multiple of
// 32 and an fp32 or bf16 cache, the query heads sharing a K/V head read each cached row once, with independent
// accumulators; elsewhere plain loops that the compiler vectorizes. OpenMP: the libgomp torch itself loads.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TIERGATE_AVX2 1
#endif

namespace {

// Plain loops, for any dtype and head size: scores[h * ctx + t] = q_h . K[t, h / rep]
template <typename C>
void scores_plain(const float* qf, const C* k_cache, const int64_t* table, int64_t ctx, int64_t block_size,
                  int64_t kv_heads, int64_t rep, int64_t dim, float* scores) {
  const int64_t heads = kv_heads * rep;
  for (int64_t first = 0, blk = 0; first < ctx; first += block_size, ++blk) {
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
}

// acc[h * dim + i] = sum_t p[h * ctx + t] V[t, h / rep, i]
template <typename C>
void values_plain(const float* p, const C* v_cache, const int64_t* table, int64_t ctx, int64_t block_size,
                  int64_t kv_heads, int64_t rep, int64_t dim, float* acc) {
  const int64_t heads = kv_heads * rep;
  std::fill(acc, acc + heads * dim, 0.f);
  for (int64_t first = 0, blk = 0; first < ctx; first += block_size, ++blk) {
    const int64_t n = std::min(block_size, ctx - first);
    const C* vb = v_cache + table[blk] * block_size * kv_heads * dim;
    for (int64_t j = 0; j < n; ++j) {
      for (int64_t h = 0; h < heads; ++h) {
        const C* vp = vb + (j * kv_heads + h / rep) * dim;
        const float w = p[h * ctx + first + j];
        float* ar = acc + h * dim;
#pragma omp simd
        for (int64_t i = 0; i < dim; ++i) ar[i] += w * static_cast<float>(vp[i]);
      }
    }
  }
}

#ifdef TIERGATE_AVX2
// AVX2 with FMA, for head sizes that are a multiple of 32: the query heads that share a K/V head (up to 3 at a
// time) read each cached row once, with independent accumulators (no dependency chain through one sum).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {  // bf16 is the top half of an fp32
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

inline __m128 sum4(__m256 a, __m256 b, __m256 c, __m256 d) {  // the four vectors' horizontal sums
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// R query heads (q: R rows of dim) against 4 cached rows k[0..3] (each a K/V head's row of dim): 4 scores a head
template <int R, typename C>
inline void dots_4(const float* q, int64_t dim, const C* const* k, float* out, int64_t out_stride) {
  __m256 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < 4; ++t) acc[r][t] = _mm256_setzero_ps();
  for (int64_t i = 0; i < dim; i += 8) {
    const __m256 k0 = load8(k[0] + i), k1 = load8(k[1] + i), k2 = load8(k[2] + i), k3 = load8(k[3] + i);
    for (int r = 0; r < R; ++r) {
      const __m256 qv = _mm256_loadu_ps(q + r * dim + i);
      acc[r][0] = _mm256_fmadd_ps(qv, k0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(qv, k1, acc[r][1]);
      acc[r][2] = _mm256_fmadd_ps(qv, k2, acc[r][2]);
      acc[r][3] = _mm256_fmadd_ps(qv, k3, acc[r][3]);
    }
  }
  for (int r = 0; r < R; ++r) _mm_storeu_ps(out + r * out_stride, sum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]));
}

// the next block's rows, asked for while this block computes: the cache is read from memory, and its blocks
// are scattered, so the hardware prefetcher does not see them coming
template <typename C>
inline void prefetch_block(const C* cache, const int64_t* table, int64_t next, int64_t num_blocks, int64_t elements) {
  if (next >= num_blocks) return;
  const char* p = reinterpret_cast<const char*>(cache + table[next] * elements);
  for (int64_t off = 0; off < elements * static_cast<int64_t>(sizeof(C)); off += 64)
    _mm_prefetch(p + off, _MM_HINT_T0);
}

template <typename C>
void scores_avx2(const float* qf, const C* k_cache, const int64_t* table, int64_t ctx, int64_t block_size,
                 int64_t kv_heads, int64_t rep, int64_t dim, float* scores) {
  const int64_t row = kv_heads * dim;  // one token's K (all K/V heads) in the cache
  const int64_t num_blocks = (ctx + block_size - 1) / block_size;
  for (int64_t first = 0, blk = 0; first < ctx; first += block_size, ++blk) {
    prefetch_block(k_cache, table, blk + 1, num_blocks, block_size * row);
    const int64_t n = std::min(block_size, ctx - first);
    const C* kb = k_cache + table[blk] * block_size * row;
    const int64_t n4 = n / 4 * 4;
    for (int64_t j = 0; j < n4; j += 4) {  // four tokens at a time, in the cache's order
      for (int64_t g = 0; g < kv_heads; ++g) {
        const C* k[4] = {kb + j * row + g * dim, kb + (j + 1) * row + g * dim, kb + (j + 2) * row + g * dim,
                         kb + (j + 3) * row + g * dim};
        for (int64_t r = 0; r < rep; r += 3) {
          const int64_t h = g * rep + r;
          float* out = scores + h * ctx + first + j;
          const float* q = qf + h * dim;
          switch (std::min<int64_t>(3, rep - r)) {
            case 3: dots_4<3>(q, dim, k, out, ctx); break;
            case 2: dots_4<2>(q, dim, k, out, ctx); break;
            default: dots_4<1>(q, dim, k, out, ctx);
          }
        }
      }
    }
    for (int64_t g = 0; g < kv_heads; ++g) {
      for (int64_t j = n4; j < n; ++j)  // the block's last 1-3 tokens
        for (int64_t r = 0; r < rep; ++r) {
          const int64_t h = g * rep + r;
          const C* kp = kb + j * row + g * dim;
          float s = 0.f;
          for (int64_t i = 0; i < dim; ++i) s += qf[h * dim + i] * static_cast<float>(kp[i]);
          scores[h * ctx + first + j] = s;
        }
    }
  }
}

// R heads' accumulators for 32 of their dim values stay in registers over every token of a block
template <int R, typename C>
inline void values_32(const float* p, int64_t ctx, const C* vb, int64_t row, int64_t n, int64_t first, float* acc,
                      int64_t dim) {
  __m256 a[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) a[r][c] = _mm256_loadu_ps(acc + r * dim + 8 * c);
  for (int64_t j = 0; j < n; ++j) {
    const C* v = vb + j * row;
    const __m256 v0 = load8(v), v1 = load8(v + 8), v2 = load8(v + 16), v3 = load8(v + 24);
    for (int r = 0; r < R; ++r) {
      const __m256 w = _mm256_set1_ps(p[r * ctx + first + j]);
      a[r][0] = _mm256_fmadd_ps(w, v0, a[r][0]);
      a[r][1] = _mm256_fmadd_ps(w, v1, a[r][1]);
      a[r][2] = _mm256_fmadd_ps(w, v2, a[r][2]);
      a[r][3] = _mm256_fmadd_ps(w, v3, a[r][3]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) _mm256_storeu_ps(acc + r * dim + 8 * c, a[r][c]);
}

template <typename C>
void values_avx2(const float* p, const C* v_cache, const int64_t* table, int64_t ctx, int64_t block_size,
                 int64_t kv_heads, int64_t rep, int64_t dim, float* acc) {
  const int64_t row = kv_heads * dim;
  const int64_t num_blocks = (ctx + block_size - 1) / block_size;
  std::fill(acc, acc + kv_heads * rep * dim, 0.f);
  for (int64_t first = 0, blk = 0; first < ctx; first += block_size, ++blk) {
    prefetch_block(v_cache, table, blk + 1, num_blocks, block_size * row);
    const int64_t n = std::min(block_size, ctx - first);
    const C* vb = v_cache + table[blk] * block_size * row;
    for (int64_t g = 0; g < kv_heads; ++g)
      for (int64_t r = 0; r < rep; r += 3) {
        const int64_t h = g * rep + r;
        for (int64_t c = 0; c < dim; c += 32) {
          const C* v = vb + g * dim + c;
          float* a = acc + h * dim + c;
          switch (std::min<int64_t>(3, rep - r)) {
            case 3: values_32<3>(p + h * ctx, ctx, v, row, n, first, a, dim); break;
            case 2: values_32<2>(p + h * ctx, ctx, v, row, n, first, a, dim); break;
            default: values_32<1>(p + h * ctx, ctx, v, row, n, first, a, dim);
          }
        }
      }
  }
}
#endif

// The AVX2 kernels where they apply (an fp32 or bf16 cache, a head size that is a multiple of 32), the plain
// loops elsewhere
template <typename C>
constexpr bool kAvx2Cache = std::is_same_v<C, float> || std::is_same_v<C, at::BFloat16>;

template <typename C>
void scores(const float* qf, const C* k_cache, const int64_t* table, int64_t ctx, int64_t block_size,
            int64_t kv_heads, int64_t rep, int64_t dim, float* out) {
#ifdef TIERGATE_AVX2
  if constexpr (kAvx2Cache<C>)
    if (dim % 32 == 0) return scores_avx2(qf, k_cache, table, ctx, block_size, kv_heads, rep, dim, out);
#endif
  scores_plain(qf, k_cache, table, ctx, block_size, kv_heads, rep, dim, out);
}

template <typename C>
void values(const float* p, const C* v_cache, const int64_t* table, int64_t ctx, int64_t block_size,
            int64_t kv_heads, int64_t rep, int64_t dim, float* acc) {
#ifdef TIERGATE_AVX2
  if constexpr (kAvx2Cache<C>)
    if (dim % 32 == 0) return values_avx2(p, v_cache, table, ctx, block_size, kv_heads, rep, dim, acc);
#endif
  values_plain(p, v_cache, table, ctx, block_size, kv_heads, rep, dim, acc);
}

// out of line: the fp32 and the bf16-output callers below run the same instructions, so the same fp32 values
template <typename T, typename C>
__attribute__((noinline)) void attend_one(const T* q, const C* k_cache, const C* v_cache, const int64_t* table, int64_t ctx,
                int64_t block_size, int64_t kv_heads, int64_t rep, int64_t dim, float scale, T* out, float* probs,
                float* acc, float* qf) {
  // one sequence, every head: scores [H, ctx], softmax in fp32, then the values summed into acc [H, D] in fp32;
  // the cache is read block by block in its own order, so each block's K (then V) streams in once
  const int64_t heads = kv_heads * rep;
  for (int64_t i = 0; i < heads * dim; ++i) qf[i] = static_cast<float>(q[i]) * scale;
  scores(qf, k_cache, table, ctx, block_size, kv_heads, rep, dim, probs);
  std::vector<float> total(heads);
  for (int64_t h = 0; h < heads; ++h) {
    float* sr = probs + h * ctx;
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
  values(probs, v_cache, table, ctx, block_size, kv_heads, rep, dim, acc);
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t i = 0; i < dim; ++i) out[h * dim + i] = static_cast<T>(acc[h * dim + i] / total[h]);
}

}  // namespace

namespace {

// paged_decode_attention below; with narrow (fp32 q and a bf16 cache only) the result rounded to bf16 as torch's
// .to(torch.bfloat16) rounds it (layer_ops.cpp's narrow_row), for a bf16 matmul (decode_layers.cpp)
torch::Tensor paged_decode_attention_as(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                        torch::Tensor block_tables, torch::Tensor context_lens, double scale,
                                        bool narrow) {
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
  auto out = torch::empty_like(q, narrow ? q.options().dtype(at::kBFloat16) : q.options());
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
    if (!narrow) {
      run(q.data_ptr<float>(), k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>(),
          out.data_ptr<float>());
      return out;
    }
    const auto* qp = q.data_ptr<float>();
    const auto *kp = k_cache.data_ptr<at::BFloat16>(), *vp = v_cache.data_ptr<at::BFloat16>();
    auto* op = out.data_ptr<at::BFloat16>();
    at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores(heads * max_ctx), acc(heads * dim), qf(heads * dim), o(heads * dim);
      for (int64_t b = begin; b < end; ++b) {
        attend_one(qp + b * heads * dim, kp, vp, tables + b * max_blocks, lens[b], block_size, kv_heads, rep, dim,
                   static_cast<float>(scale), o.data(), scores.data(), acc.data(), qf.data());
        narrow_row(o.data(), heads * dim, op + b * heads * dim);
      }
    });
    return out;
  }
  TORCH_CHECK(!narrow, "a bf16 result is made for fp32 queries over a bf16 cache only");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    run(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(), out.data_ptr<scalar_t>());
  });
  return out;
}

}  // namespace

// q: [B, H, D]; k_cache, v_cache: [num_blocks, block_size, KV, D]; block_tables: [B, max_blocks] int64;
// context_lens: [B] int64 (the new token included). Returns [B, H, D].
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale) {
  return paged_decode_attention_as(q, k_cache, v_cache, block_tables, context_lens, scale, false);
}

// the same for fp32 q over a bf16 cache, the result rounded to bf16 (a bf16 matmul's input):
// paged_decode_attention(...).to(torch.bfloat16), bit for bit
torch::Tensor paged_decode_attention_bf16(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                          torch::Tensor block_tables, torch::Tensor context_lens, double scale) {
  return paged_decode_attention_as(q, k_cache, v_cache, block_tables, context_lens, scale, true);
}
