// Per-tensor FP8 scales (quant_core._fp8_scale): current scaling from an amax, delayed scaling
// from an amax history that is then updated in place. A handful of scalars per call, one thread.
#include "common.h"
#include "kernels.h"

namespace quant_core {

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
