// The multi-tensor Adam step of quant_core._adam ([Note: Adam numerics]): one pass over every
// parameter, its gradient and moments, optionally recording max |p| of each updated parameter.
#include "common.h"
#include "kernels.h"

namespace quant_core {
namespace {

// How weight decay enters the update: none, AdamW's decoupled p * decay, or Adam's L2 g + p * wd.
enum class Decay { kNone, kDecoupled, kL2 };

// Stores an updated moment: fp32 as is, bf16 rounded to nearest even (canonical NaN).
template <DType D>
inline void store_moment(void* base, int64_t index, float value) {
  if constexpr (D == DType::kFloat32) {
    static_cast<float*>(base)[index] = value;
  } else {
    static_cast<uint16_t*>(base)[index] = float_to_bfloat16(value);
  }
}

// Elements [begin, end) of one tensor; returns the largest magnitude key of the updated params
// ([Note: magnitude keys]), or 0 when kAmax is off. Out of line so the loop vectorizes alone.
// kStochastic: p holds bf16 masters, stored rounded stochastically with the counter RNG's stream
// `stream` ([Note: Adam stochastic rounding]); else fp32 masters.
template <Decay kDecay, DType G, DType M, DType V, bool kAmax, bool kStochastic>
__attribute__((noinline, target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default"))) int32_t adam_range(
    void* __restrict p_base, const void* __restrict g, void* __restrict m, void* __restrict v, int64_t begin,
    int64_t end, const AdamScalars& s, uint64_t stream) {
  using Key = MagnitudeKey<DType::kFloat32>;
  using Param = std::conditional_t<kStochastic, uint16_t, float>;
  Param* __restrict p = static_cast<Param*>(p_base);
  int32_t key = 0;
  for (int64_t i = begin; i < end; ++i) {
    float param;
    if constexpr (kStochastic) {
      param = bfloat16_to_float(p[i]);
    } else {
      param = p[i];
    }
    float grad = load<G>(g, i);
    if constexpr (kDecay == Decay::kDecoupled) param = param * s.decay;
    if constexpr (kDecay == Decay::kL2) grad = grad + param * s.weight_decay;
    const float exp_avg = load<M>(m, i) * s.beta1 + grad * s.one_minus_beta1;
    const float exp_avg_sq = load<V>(v, i) * s.beta2 + (grad * grad) * s.one_minus_beta2;
    const float denom = std::sqrt(exp_avg_sq) * s.inv_bias_correction2_sqrt + s.eps;
    param = param - (exp_avg / denom) * s.step_size;
    if constexpr (kStochastic) {
      p[i] = float_to_bfloat16_stochastic(param, uint32_t(splitmix64(stream, uint64_t(i)) >> 48));
      param = bfloat16_to_float(p[i]);  // the amax of the value stored
    } else {
      p[i] = param;
    }
    store_moment<M>(m, i, exp_avg);
    store_moment<V>(v, i, exp_avg_sq);
    if constexpr (kAmax) {
      const int32_t k = Key::of(float_to_bits(param));
      key = k > key ? k : key;
    }
  }
  return key;
}

template <class Fn>
inline void dispatch_moment_dtype(int dtype, Fn&& fn) {
  if (static_cast<DType>(dtype) == DType::kBFloat16) {
    fn(std::integral_constant<DType, DType::kBFloat16>{});
  } else {
    fn(std::integral_constant<DType, DType::kFloat32>{});
  }
}

}  // namespace

void adam_step(const std::vector<uintptr_t>& params, const std::vector<uintptr_t>& grads,
               const std::vector<uintptr_t>& exp_avgs, const std::vector<uintptr_t>& exp_avg_sqs,
               const std::vector<int64_t>& numels, int grad_dtype, int exp_avg_dtype, int exp_avg_sq_dtype,
               const AdamScalars& scalars, uintptr_t amax_out, const std::vector<uintptr_t>& counters,
               int64_t seed, int num_threads) {
  const size_t count = numels.size();
  // Tensor t's stream: seed + its counter, modulo 2^64 ([Note: Adam stochastic rounding]).
  std::vector<uint64_t> streams(counters.size());
  for (size_t t = 0; t < counters.size(); ++t) {
    streams[t] = uint64_t(seed) + *reinterpret_cast<const uint64_t*>(counters[t]);
  }
  // Tensor t covers [offsets[t], offsets[t + 1]) of one index space that threads split evenly,
  // so many small tensors cost one thread launch, not one each.
  std::vector<int64_t> offsets(count + 1, 0);
  for (size_t t = 0; t < count; ++t) offsets[t + 1] = offsets[t] + numels[t];
  const int chunks = std::max(num_threads, 1);
  // keys[chunk * count + t]: the chunk's largest magnitude key within tensor t.
  std::vector<int32_t> keys(amax_out ? size_t(chunks) * count : 0, 0);
  const Decay decay = scalars.decay != 1.0f ? Decay::kDecoupled : scalars.weight_decay != 0.0f ? Decay::kL2 : Decay::kNone;

  auto run = [&](auto decay_c, auto g_c, auto m_c, auto v_c, auto amax_c, auto stochastic_c) {
    constexpr Decay kDecay = decltype(decay_c)::value;
    constexpr DType G = decltype(g_c)::value, M = decltype(m_c)::value, V = decltype(v_c)::value;
    constexpr bool kAmax = decltype(amax_c)::value, kStochastic = decltype(stochastic_c)::value;
    parallel_for(offsets[count], kMinElementsPerThread, chunks, [&](int64_t chunk, int64_t begin, int64_t end) {
      // The first tensor that holds index `begin`, then every tensor this chunk overlaps.
      size_t t = size_t(std::upper_bound(offsets.begin(), offsets.end(), begin) - offsets.begin()) - 1;
      for (; t < count && offsets[t] < end; ++t) {
        const int64_t lo = std::max(begin, offsets[t]) - offsets[t], hi = std::min(end, offsets[t + 1]) - offsets[t];
        if (lo >= hi) continue;
        const int32_t key = adam_range<kDecay, G, M, V, kAmax, kStochastic>(
            reinterpret_cast<void*>(params[t]), reinterpret_cast<const void*>(grads[t]),
            reinterpret_cast<void*>(exp_avgs[t]), reinterpret_cast<void*>(exp_avg_sqs[t]), lo, hi, scalars,
            kStochastic ? streams[t] : 0);
        if constexpr (kAmax) keys[size_t(chunk) * count + t] = key;
      }
    });
  };
  auto with_stochastic = [&](auto... c) {
    if (!counters.empty()) {
      run(c..., std::true_type{});
    } else {
      run(c..., std::false_type{});
    }
  };
  auto with_amax = [&](auto... c) {
    if (amax_out) {
      with_stochastic(c..., std::true_type{});
    } else {
      with_stochastic(c..., std::false_type{});
    }
  };
  auto with_moments = [&](auto decay_c, auto g_c) {
    dispatch_moment_dtype(exp_avg_dtype, [&](auto m_c) {
      dispatch_moment_dtype(exp_avg_sq_dtype, [&](auto v_c) { with_amax(decay_c, g_c, m_c, v_c); });
    });
  };
  dispatch_dtype(grad_dtype, [&](auto g_c) {
    switch (decay) {
      case Decay::kNone: with_moments(std::integral_constant<Decay, Decay::kNone>{}, g_c); break;
      case Decay::kDecoupled: with_moments(std::integral_constant<Decay, Decay::kDecoupled>{}, g_c); break;
      case Decay::kL2: with_moments(std::integral_constant<Decay, Decay::kL2>{}, g_c); break;
    }
  });

  for (size_t t = 0; t < counters.size(); ++t) *reinterpret_cast<uint64_t*>(counters[t]) += 1;
  if (amax_out) {
    float* out = reinterpret_cast<float*>(amax_out);
    for (size_t t = 0; t < count; ++t) {
      int32_t key = 0;
      for (int chunk = 0; chunk < chunks; ++chunk) key = std::max(key, keys[size_t(chunk) * count + t]);
      out[t] = MagnitudeKey<DType::kFloat32>::to_float(key);
    }
  }
}

}  // namespace quant_core
