// Per-tensor FP8 scales (quant_core._fp8_scale): current scaling from an amax, delayed scaling
// from an amax history that is then updated in place. A handful of scalars per call, one thread.
#include "common.h"
#include "kernels.h"

namespace quant_core {
namespace {

// DESIGN section 3, the mirror of _fp8_scale.fp8_scale_reference: scale = fmax / amax / 2^margin
// (1 unless amax > 0; a NaN amax gives 1), each division one IEEE fp32 division; clamped to the
// largest finite fp32 (NaN would pass, but none can arise); with power_2_scales only the exponent
// bits are kept. `divisor` is 2^margin, exact for margin in [-126, 127].
inline void scale_of(float amax, float fmax, float divisor, bool power_2_scales, float* scale, float* scale_inv) {
  const float quotient = (fmax / amax) / divisor;
  float s = amax > 0.0f ? quotient : 1.0f;
  s = s > kFloat32Max ? kFloat32Max : s;
  if (power_2_scales) s = bits_to_float(float_to_bits(s) & 0x7F800000u);
  *scale = s;
  *scale_inv = 1.0f / s;
}

}  // namespace

void fp8_scale(uintptr_t amax, int64_t n, float fmax, int margin, bool power_2_scales, uintptr_t scale,
               uintptr_t scale_inv) {
  const auto* a = reinterpret_cast<const float*>(amax);
  auto* s = reinterpret_cast<float*>(scale);
  auto* s_inv = reinterpret_cast<float*>(scale_inv);
  const float divisor = std::ldexp(1.0f, margin);
  for (int64_t i = 0; i < n; ++i) scale_of(a[i], fmax, divisor, power_2_scales, s + i, s_inv + i);
}

void delayed_fp8_scale(uintptr_t amax_history, int64_t length, uintptr_t amax, float fmax, int margin,
                       bool power_2_scales, bool most_recent, uintptr_t scale, uintptr_t scale_inv) {
  auto* history = reinterpret_cast<float*>(amax_history);
  const float pushed = *reinterpret_cast<const float*>(amax);  // read before the history moves
  // torch's max: NaN if any entry is NaN (then the scale is 1), else the largest entry.
  float used = history[0];
  for (int64_t i = 1; i < length && !most_recent && !std::isnan(used); ++i) {
    used = std::isnan(history[i]) || history[i] > used ? history[i] : used;
  }
  scale_of(used, fmax, std::ldexp(1.0f, margin), power_2_scales, reinterpret_cast<float*>(scale),
           reinterpret_cast<float*>(scale_inv));
  std::memmove(history + 1, history, size_t(length - 1) * sizeof(float));
  history[0] = pushed;
}

}  // namespace quant_core
