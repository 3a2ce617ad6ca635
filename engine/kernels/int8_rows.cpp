// The per-token steps around the int8 tier's fbgemm matmul (engine/int8_dynamic.py), one pass each.
//
// Before: zero the fp32 outlier channels, find each row's largest |activation| and divide the row by it (so
// fbgemm's one scale per tensor acts per token), and gather the outlier channels for their fp32 side matmul.
// After: multiply each row of the int8 result back by its scale and add the outlier channels' part.
// Unfused these are eight torch ops per projection.
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

// x: [N, in]; outliers: [k] int64 channel indexes. Returns [x with outliers zeroed, divided per row by its
// largest |value| (at least 1e-12)], [N, 1] those scales, [N, k] the outlier channels as they were.
std::vector<torch::Tensor> int8_rows_prepare(torch::Tensor x, torch::Tensor outliers) {
  check_rows_fp32(x, "x");
  TORCH_CHECK(outliers.scalar_type() == at::kLong && outliers.is_contiguous() && outliers.dim() == 1,
              "outliers must be a contiguous int64 vector");
  const int64_t n = x.size(0), d = x.size(1), k = outliers.numel();
  const int64_t* op = outliers.data_ptr<int64_t>();
  for (int64_t j = 0; j < k; ++j) TORCH_CHECK(op[j] >= 0 && op[j] < d, "outlier channel out of range");
  auto normed = torch::empty_like(x);
  auto scales = torch::empty({n, 1}, x.options());
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
      float mx = 0.f;
      for (int64_t i = 0; i < d; ++i) mx = std::max(mx, std::fabs(out[i]));
      mx = std::max(mx, 1e-12f);
      sp[r] = mx;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) out[i] = out[i] / mx;
    }
  });
  return {normed, scales, kept};
}

// y = y * scales + kept @ w_outliers, in place (y: [N, out]; scales: [N, 1]; kept: [N, k]; w_outliers: [k, out]).
// The outlier part is a matmul with a tiny inner size (32 or 64), which BLAS libraries run far below their
// speed (output-bound); here it is accumulated into y's row while the row is in cache, four channels a pass.
torch::Tensor int8_rows_finish_(torch::Tensor y, torch::Tensor scales, torch::Tensor kept, torch::Tensor w_outliers) {
  check_rows_fp32(y, "y");
  check_rows_fp32(kept, "kept");
  check_rows_fp32(w_outliers, "w_outliers");
  const int64_t n = y.size(0), d = y.size(1), k = kept.size(1);
  TORCH_CHECK(kept.size(0) == n && w_outliers.size(0) == k && w_outliers.size(1) == d && scales.numel() == n &&
                  scales.scalar_type() == at::kFloat && scales.is_contiguous(),
              "int8_rows_finish_: expected y [N, out], scales [N, 1], kept [N, k], w_outliers [k, out]");
  float* yp = y.data_ptr<float>();
  const float *sp = scales.data_ptr<float>(), *kp = kept.data_ptr<float>(), *wp = w_outliers.data_ptr<float>();
  at::parallel_for(0, n, row_grain(d * std::max<int64_t>(k, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* row = yp + r * d;
      const float s = sp[r];
      const float* kr = kp + r * k;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) row[i] *= s;
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
