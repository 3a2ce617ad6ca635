// Rows between fp32 and bf16, as torch converts them, for the kernels that take a bf16 matmul's result or make a bf16
// matmul's input themselves (layer_ops.cpp, paged_decode_attention.cpp, decode_layers.cpp): the first source of
// the kernels' one translation unit (engine/kernels/native.py), so every later one can call these.
#include <torch/extension.h>

#include <cstdint>

namespace {

using u32_alias = uint32_t __attribute__((may_alias));
using u16_alias = uint16_t __attribute__((may_alias));

// n fp32 values rounded to bf16 as torch's CPU `.to(torch.bfloat16)` rounds them (its vectorized kernel, which every
// length takes): to nearest, ties to even, and any NaN to 0xffff. Integer arithmetic, untouched by -ffast-math.
inline void narrow_row(const float* x, int64_t n, at::BFloat16* out) {
  const u32_alias* u = reinterpret_cast<const u32_alias*>(x);
  u16_alias* o = reinterpret_cast<u16_alias*>(out);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t v = u[i];
    const uint32_t rounded = (v + 0x7fffu + ((v >> 16) & 1u)) >> 16;
    o[i] = static_cast<uint16_t>((v & 0x7fffffffu) > 0x7f800000u ? 0xffffu : rounded);
  }
}

// n bf16 values widened to fp32 (exact: a bf16 is the top half of an fp32)
inline void widen_row(const at::BFloat16* x, int64_t n, float* out) {
  const u16_alias* u = reinterpret_cast<const u16_alias*>(x);
  u32_alias* o = reinterpret_cast<u32_alias*>(out);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) o[i] = static_cast<uint32_t>(u[i]) << 16;
}

// A row of `n` fp32 values from a float or bf16 tensor's row: the row itself, or widened into `buf`
inline const float* fp32_row(const float* x, int64_t, float*) { return x; }
inline const float* fp32_row(const at::BFloat16* x, int64_t n, float* buf) {
  widen_row(x, n, buf);
  return buf;
}

}  // namespace
