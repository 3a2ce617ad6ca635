// The per-token steps around the int8 tier's fbgemm matmul (engine/int8_dynamic.py), one pass each.
//
// Before: zero the fp32 outlier channels, map each row affinely onto exactly [0, 1] (its smallest value to 0, its
// largest to 1), and gather the outlier channels for their fp32 side matmul. fbgemm picks one quantization range
// for the whole tensor from its min and max; with every row spanning [0, 1] exactly that range is [0, 1] whatever
// rows are batched together, so each token is quantized over its own range and independently of the others.
// After: undo the map on the int8 result (y * span + min * the weights' row sums) and add the outlier part.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

void check_rows_fp32(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous() && t.dim() == 2, name,
              " must be a contiguous [N, d] fp32 CPU tensor");
}

int64_t row_grain(int64_t row_elements) { return std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, row_elements)); }

}  // namespace

// x: [N, in]; outliers: [k] int64 channel indexes. Returns [x with outliers zeroed, each row mapped onto [0, 1]:
// (x - min) / span, span = max - min (at least 1e-12), its extremes exactly 0 and 1], [N, 2] (span, min) per
// row, [N, k] the outlier channels as they were.
std::vector<torch::Tensor> int8_rows_prepare(torch::Tensor x, torch::Tensor outliers) {
  check_rows_fp32(x, "x");
  TORCH_CHECK(outliers.scalar_type() == at::kLong && outliers.is_contiguous() && outliers.dim() == 1,
              "outliers must be a contiguous int64 vector");
  const int64_t n = x.size(0), d = x.size(1), k = outliers.numel();
  const int64_t* op = outliers.data_ptr<int64_t>();
  for (int64_t j = 0; j < k; ++j) TORCH_CHECK(op[j] >= 0 && op[j] < d, "outlier channel out of range");
  auto normed = torch::empty_like(x);
  auto scales = torch::empty({n, 2}, x.options());
  auto kept = torch::empty({n, k}, x.options());
  const float* xp = x.data_ptr<float>();
  float *np = normed.data_ptr<float>(), *sp = scales.data_ptr<float>(), *kp = kept.data_ptr<float>();
  at::parallel_for(0, n, row_grain(d), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xp + r * d;
      float* out = np + r * d;
      std::copy(row, row + d, out);
      for (int64_t j = 0; j < k; ++j) {
        kp[r * k + j] = row[op[j]];
        out[op[j]] = 0.f;
      }
      int64_t lo = 0, hi = 0;
      for (int64_t i = 1; i < d; ++i) {
        if (out[i] < out[lo]) lo = i;
        if (out[i] > out[hi]) hi = i;
      }
      const float mn = out[lo], width = out[hi] - mn, span = std::max(width, 1e-12f), inv = 1.f / span;
      sp[2 * r] = span;
      sp[2 * r + 1] = mn;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) out[i] = std::min(std::max((out[i] - mn) * inv, 0.f), 1.f);
      out[lo] = 0.f;  // exact, whatever -ffast-math made of the division: the tensor's range must be [0, 1]
      if (width > 1e-12f) out[hi] = 1.f;  // (a flat row stays all 0: min * the row sums is its whole product)
    }
  });
  return {normed, scales, kept};
}

// y = y * span + min * w_rowsum + kept @ w_outliers, in place (y: [N, out]; scales: [N, 2] (span, min); kept:
// [N, k]; w_outliers: [k, out]; w_rowsum: [out], the int8 weights' (dequantized) sums over their inputs).
// The outlier part is a matmul with a tiny inner size (32 or 64), which BLAS libraries run far below their
// speed (output-bound); here it is accumulated into y's row while the row is in cache, four channels a pass.
torch::Tensor int8_rows_finish_(torch::Tensor y, torch::Tensor scales, torch::Tensor kept, torch::Tensor w_outliers,
                                torch::Tensor w_rowsum) {
  check_rows_fp32(y, "y");
  check_rows_fp32(kept, "kept");
  check_rows_fp32(w_outliers, "w_outliers");
  const int64_t n = y.size(0), d = y.size(1), k = kept.size(1);
  TORCH_CHECK(kept.size(0) == n && w_outliers.size(0) == k && w_outliers.size(1) == d && scales.numel() == 2 * n &&
                  scales.scalar_type() == at::kFloat && scales.is_contiguous() && w_rowsum.numel() == d &&
                  w_rowsum.scalar_type() == at::kFloat && w_rowsum.is_contiguous(),
              "int8_rows_finish_: expected y [N, out], scales [N, 2], kept [N, k], w_outliers [k, out], "
              "w_rowsum [out]");
  float* yp = y.data_ptr<float>();
  const float *sp = scales.data_ptr<float>(), *kp = kept.data_ptr<float>(), *wp = w_outliers.data_ptr<float>();
  const float* rs = w_rowsum.data_ptr<float>();
  at::parallel_for(0, n, row_grain(d * std::max<int64_t>(k, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* row = yp + r * d;
      const float s = sp[2 * r], m = sp[2 * r + 1];
      const float* kr = kp + r * k;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) row[i] = row[i] * s + m * rs[i];
      int64_t j = 0;
      for (; j + 4 <= k; j += 4) {
        const float a0 = kr[j], a1 = kr[j + 1], a2 = kr[j + 2], a3 = kr[j + 3];
        const float *w0 = wp + j * d, *w1 = w0 + d, *w2 = w1 + d, *w3 = w2 + d;
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) row[i] += a0 * w0[i] + a1 * w1[i] + a2 * w2[i] + a3 * w3[i];
      }
      for (; j < k; ++j) {
        const float a = kr[j];
        const float* w = wp + j * d;
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) row[i] += a * w[i];
      }
    }
  });
  return y;
}
