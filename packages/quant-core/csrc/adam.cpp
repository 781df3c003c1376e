// The multi-tensor Adam step of quant_core._adam ([Note: Adam numerics]): one pass over every
// parameter, its gradient and moments, optionally recording max |p| of each updated parameter.
#include <array>

#include "common.h"
#include "kernels.h"

namespace quant_core {
namespace {

// How weight decay enters the update: none, AdamW's decoupled p * decay, or Adam's L2 g + p * wd.
enum class Decay { kNone, kDecoupled, kL2 };

// How a moment is stored, numbered as quant_core.adam._fp8_moments passes it: fp32, bf16, or FP8
// codes with one scale per tensor ([Note: fp8 moments in the Adam pass]).
enum class Moment : int { kFloat32 = 0, kBFloat16 = 1, kE4M3 = 3, kE5M2 = 4 };

template <Moment M>
constexpr bool kIsFp8 = M == Moment::kE4M3 || M == Moment::kE5M2;
template <Moment M>
constexpr Fp8Format kFormat = M == Moment::kE4M3 ? Fp8Format::kE4M3 : Fp8Format::kE5M2;

inline bool is_fp8(int moment) {
  return static_cast<Moment>(moment) == Moment::kE4M3 || static_cast<Moment>(moment) == Moment::kE5M2;
}
inline float fp8_max(int moment) { return static_cast<Moment>(moment) == Moment::kE4M3 ? 448.0f : 57344.0f; }

// The scales of one tensor's fp8 moments: the stored scale_inv they are decoded with, the new
// scale they are encoded with (1 for moments that are not fp8).
struct MomentScales {
  float exp_avg_scale_inv = 1.0f, exp_avg_scale = 1.0f, exp_avg_sq_scale_inv = 1.0f, exp_avg_sq_scale = 1.0f;
};

// decode_fp8 through a table of its 256 values. The lookup keeps GCC's vectorizer off the fp8-moment
// variants of the Adam loop, which would otherwise multiply this file's compile time; their loops
// stay scalar, compiled once each (adam_range_scalar).
template <Fp8Format F>
float decode_fp8_by_table(uint8_t code) {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> values{};
    for (int c = 0; c < 256; ++c) values[size_t(c)] = decode_fp8<F>(uint8_t(c));
    return values;
  }();
  return table[code];
}

// Reads a moment as fp32: fp8 codes decoded as dequantize_fp8 decodes them (code * scale_inv,
// canonical NaN).
template <Moment M>
inline float load_moment(const void* base, int64_t index, float scale_inv) {
  if constexpr (M == Moment::kFloat32) {
    return static_cast<const float*>(base)[index];
  } else if constexpr (M == Moment::kBFloat16) {
    return bfloat16_to_float(static_cast<const uint16_t*>(base)[index]);
  } else {
    const float value = decode_fp8_by_table<kFormat<M>>(static_cast<const uint8_t*>(base)[index]) * scale_inv;
    return std::isnan(value) ? std::numeric_limits<float>::quiet_NaN() : value;
  }
}

// Stores an updated moment: fp32 as is, bf16 rounded to nearest even (canonical NaN), fp8 as
// cast_to_fp8 encodes value * scale.
template <Moment M>
inline void store_moment(void* base, int64_t index, float value, float scale) {
  if constexpr (M == Moment::kFloat32) {
    static_cast<float*>(base)[index] = value;
  } else if constexpr (M == Moment::kBFloat16) {
    static_cast<uint16_t*>(base)[index] = float_to_bfloat16(value);
  } else {
    static_cast<uint8_t*>(base)[index] = encode_fp8<kFormat<M>>(value * scale);
  }
}

// How the loop learns the decay and whether to record the amax: a compile-time constant
// (std::integral_constant, whose call the compiler folds) for the vectorized variants, or a value
// read at run time (Runtime) for the fp8-moment ones, so that those are not multiplied by them.
template <class T>
struct Runtime {
  T value;
  T operator()() const { return value; }
};

// Elements [begin, end) of one tensor; returns the largest magnitude key of the updated params
// ([Note: magnitude keys]), or 0 when the amax is off. Inlined into adam_range's out-of-line entries.
// The parameter of element i is p[i - p_offset]: fp32 (a master, or the fp32 copy of a block of a
// bf16/fp16 parameter that adam_step rounds to nearest after), or with kStochastic a bf16 master
// stored rounded stochastically with the counter RNG's stream `stream` ([Note: Adam stochastic
// rounding]), drawing at its element index i.
template <DType G, Moment M, Moment V, bool kStochastic, class DecayOf, class AmaxOf>
QUANT_CORE_INLINE int32_t adam_loop(
    void* __restrict p_base, int64_t p_offset, const void* __restrict g, void* __restrict m, void* __restrict v,
    int64_t begin, int64_t end, const AdamScalars& s, const MomentScales& scales, uint64_t stream, DecayOf decay_of,
    AmaxOf amax_of) {
  using Key = MagnitudeKey<DType::kFloat32>;
  using Param = std::conditional_t<kStochastic, uint16_t, float>;
  Param* __restrict p = static_cast<Param*>(p_base) - p_offset;
  const Decay decay = decay_of();
  const bool record_amax = amax_of();
  int32_t key = 0;
  for (int64_t i = begin; i < end; ++i) {
    float param;
    if constexpr (kStochastic) {
      param = bfloat16_to_float(p[i]);
    } else {
      param = p[i];
    }
    float grad = load<G>(g, i);
    if (decay == Decay::kDecoupled) param = param * s.decay;
    if (decay == Decay::kL2) grad = grad + param * s.weight_decay;
    const float exp_avg = load_moment<M>(m, i, scales.exp_avg_scale_inv) * s.beta1 + grad * s.one_minus_beta1;
    const float exp_avg_sq =
        load_moment<V>(v, i, scales.exp_avg_sq_scale_inv) * s.beta2 + (grad * grad) * s.one_minus_beta2;
    const float denom = std::sqrt(exp_avg_sq) * s.inv_bias_correction2_sqrt + s.eps;
    param = param - (exp_avg / denom) * s.step_size;
    if constexpr (kStochastic) {
      p[i] = float_to_bfloat16_stochastic(param, uint32_t(splitmix64(stream, uint64_t(i)) >> 48));
      param = bfloat16_to_float(p[i]);  // the amax of the value stored
    } else {
      p[i] = param;
    }
    store_moment<M>(m, i, exp_avg, scales.exp_avg_scale);
    store_moment<V>(v, i, exp_avg_sq, scales.exp_avg_sq_scale);
    if (record_amax) {
      const int32_t k = Key::of(float_to_bits(param));
      key = k > key ? k : key;
    }
  }
  return key;
}

// adam_loop out of line: multiversioned where both moments are fp32 or bf16 (the loop vectorizes),
// every decay and amax choice a variant of its own; one copy per moment pair, gradient dtype and
// rounding where a moment is fp8 (its table decode keeps the loop scalar in every ISA), the decay
// and amax read at run time, so that this file compiles in a fraction of the time.
template <Decay kDecay, DType G, Moment M, Moment V, bool kAmax, bool kStochastic>
QUANT_CORE_CLONES int32_t adam_range_vectorized(
    void* __restrict p, int64_t p_offset, const void* __restrict g, void* __restrict m, void* __restrict v,
    int64_t begin, int64_t end, const AdamScalars& s, const MomentScales& scales, uint64_t stream) {
  return adam_loop<G, M, V, kStochastic>(p, p_offset, g, m, v, begin, end, s, scales, stream,
                                         std::integral_constant<Decay, kDecay>{}, std::bool_constant<kAmax>{});
}
template <DType G, Moment M, Moment V, bool kStochastic>
QUANT_CORE_SCALAR_LOOP int32_t adam_range_scalar(
    void* __restrict p, int64_t p_offset, const void* __restrict g, void* __restrict m, void* __restrict v,
    int64_t begin, int64_t end, const AdamScalars& s, const MomentScales& scales, uint64_t stream, Decay decay,
    bool amax) {
  return adam_loop<G, M, V, kStochastic>(p, p_offset, g, m, v, begin, end, s, scales, stream, Runtime<Decay>{decay},
                                         Runtime<bool>{amax});
}
// adam_loop's variant for these moments: decay_of and amax_of are compile-time constants where
// both moments are fp32 or bf16, values read at run time where one is fp8.
template <DType G, Moment M, Moment V, bool kStochastic, class DecayOf, class AmaxOf>
inline int32_t adam_range(void* p, int64_t p_offset, const void* g, void* m, void* v, int64_t begin, int64_t end,
                          const AdamScalars& s, const MomentScales& scales, uint64_t stream, DecayOf decay_of,
                          AmaxOf amax_of) {
  if constexpr (kIsFp8<M> || kIsFp8<V>) {
    return adam_range_scalar<G, M, V, kStochastic>(p, p_offset, g, m, v, begin, end, s, scales, stream, decay_of(),
                                                   amax_of());
  } else {
    return adam_range_vectorized<DecayOf::value, G, M, V, AmaxOf::value, kStochastic>(p, p_offset, g, m, v, begin,
                                                                                      end, s, scales, stream);
  }
}

// fp32 -> D as torch's copy_ rounds it: fp32 as is, bf16 and fp16 to nearest even (bf16's NaN
// canonical, fp16's the sign with the canonical 0x7E00).
template <DType D>
QUANT_CORE_INLINE void store_rounded(void* base, int64_t index, float value) {
  if constexpr (D == DType::kFloat32) {
    static_cast<float*>(base)[index] = value;
  } else if constexpr (D == DType::kBFloat16) {
    static_cast<uint16_t*>(base)[index] = float_to_bfloat16(value);
  } else {
    const uint16_t sign = uint16_t((float_to_bits(value) >> 16) & 0x8000u);
    static_cast<uint16_t*>(base)[index] = std::isnan(value) ? uint16_t(sign | 0x7E00u) : float_to_float16(value);
  }
}

// dst[i - dst_offset] = src[i - src_offset] rounded to D (store_rounded) for i in [begin, end).
template <DType S, DType D>
QUANT_CORE_CLONES void convert_range(const void* __restrict src, int64_t src_offset, void* __restrict dst,
                                     int64_t dst_offset, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) store_rounded<D>(dst, i - dst_offset, load<S>(src, i - src_offset));
}

inline void convert(int src_dtype, const void* src, int64_t src_offset, int dst_dtype, void* dst, int64_t dst_offset,
                    int64_t begin, int64_t end) {
  dispatch_dtype(src_dtype, [&](auto s_c) {
    dispatch_dtype(dst_dtype, [&](auto d_c) {
      convert_range<decltype(s_c)::value, decltype(d_c)::value>(src, src_offset, dst, dst_offset, begin, end);
    });
  });
}

// The largest magnitude key of elements [begin, end) of a P tensor ([Note: magnitude keys]).
template <DType P>
QUANT_CORE_CLONES int32_t max_key_range(const void* __restrict p, int64_t begin, int64_t end) {
  int32_t key = 0;
  for (int64_t i = begin; i < end; ++i) {
    const int32_t k = MagnitudeKey<DType::kFloat32>::of(float_to_bits(load<P>(p, i)));
    key = k > key ? k : key;
  }
  return key;
}

// base ** exponent in float64 by squaring, the multiplications of quant_core.adam._adam.power.
double power(double base, int64_t exponent) {
  double result = 1.0;
  while (exponent > 0) {
    if (exponent & 1) result *= base;
    base *= base;
    exponent >>= 1;
  }
  return result;
}

// AdamScalars.of (quant_core.adam._adam): each scalar in float64, rounded once to fp32.
AdamScalars scalars_of(double lr, double beta1, double beta2, double eps, double weight_decay, bool adam_w_mode,
                       int64_t step) {
  const double decoupled = adam_w_mode ? weight_decay : 0.0;
  AdamScalars s;
  s.decay = float(1.0 - lr * decoupled);
  s.weight_decay = float(adam_w_mode ? 0.0 : weight_decay);
  s.beta1 = float(beta1);
  s.one_minus_beta1 = float(1.0 - beta1);
  s.beta2 = float(beta2);
  s.one_minus_beta2 = float(1.0 - beta2);
  s.inv_bias_correction2_sqrt = float(1.0 / std::sqrt(1.0 - power(beta2, step)));
  s.eps = float(eps);
  s.step_size = float(lr / (1.0 - power(beta1, step)));
  return s;
}

// A scalar tensor's first element as float64 (codes: DType's, 3 for float64).
double read_scalar(uintptr_t pointer, int dtype) {
  if (dtype == 3) return *reinterpret_cast<const double*>(pointer);
  double value = 0.0;
  dispatch_dtype(dtype, [&](auto d_c) { value = load<decltype(d_c)::value>(reinterpret_cast<const void*>(pointer), 0); });
  return value;
}

template <class Fn>
inline void dispatch_moment(int moment, Fn&& fn) {
  switch (static_cast<Moment>(moment)) {
    case Moment::kFloat32: fn(std::integral_constant<Moment, Moment::kFloat32>{}); break;
    case Moment::kBFloat16: fn(std::integral_constant<Moment, Moment::kBFloat16>{}); break;
    case Moment::kE4M3: fn(std::integral_constant<Moment, Moment::kE4M3>{}); break;
    case Moment::kE5M2: fn(std::integral_constant<Moment, Moment::kE5M2>{}); break;
  }
}

// The fp8 moments' scales of every tensor: rows of `scale_invs` (0-d fp32 each) and of the (rows,
// count) `amaxes` (none: 0), exp_avgs' row first when they are fp8 ([Note: fp8 moments in the
// Adam pass]). The new scale is fp8_scale's of the amax (margin 0, no power of two).
std::vector<MomentScales> moment_scales(int exp_avg_moment, int exp_avg_sq_moment, size_t count,
                                        const std::vector<uintptr_t>& scale_invs, uintptr_t amaxes) {
  std::vector<MomentScales> scales(count);
  int row = 0;
  for (const bool exp_avg : {true, false}) {
    const int moment = exp_avg ? exp_avg_moment : exp_avg_sq_moment;
    if (!is_fp8(moment)) continue;
    for (size_t t = 0; t < count; ++t) {
      const size_t at = size_t(row) * count + t;
      float scale = 1.0f, unused = 1.0f;
      if (amaxes) scale_of(reinterpret_cast<const float*>(amaxes)[at], fp8_max(moment), 1.0f, false, &scale, &unused);
      const float scale_inv = *reinterpret_cast<const float*>(scale_invs[at]);
      (exp_avg ? scales[t].exp_avg_scale_inv : scales[t].exp_avg_sq_scale_inv) = scale_inv;
      (exp_avg ? scales[t].exp_avg_scale : scales[t].exp_avg_sq_scale) = scale;
    }
    ++row;
  }
  return scales;
}

// Elements [begin, end) of one tensor: the largest magnitude keys ([Note: magnitude keys]) of
// its updated fp8 moments (a moment that is not fp8 is not computed; its key stays 0), exactly
// as adam_range updates them. kL2: the gradient takes Adam's L2 weight decay from the param (P).
template <bool kL2, DType P, DType G, Moment M, Moment V>
QUANT_CORE_SCALAR_LOOP void moment_amax_range(
    const void* __restrict p, const void* __restrict g, const void* __restrict m, const void* __restrict v,
    int64_t begin, int64_t end, const AdamScalars& s, const MomentScales& scales, int32_t* exp_avg_key,
    int32_t* exp_avg_sq_key) {
  using Key = MagnitudeKey<DType::kFloat32>;
  int32_t m_key = 0, v_key = 0;
  for (int64_t i = begin; i < end; ++i) {
    float grad = load<G>(g, i);
    if constexpr (kL2) grad = grad + load<P>(p, i) * s.weight_decay;
    if constexpr (kIsFp8<M>) {
      const float exp_avg = load_moment<M>(m, i, scales.exp_avg_scale_inv) * s.beta1 + grad * s.one_minus_beta1;
      const int32_t k = Key::of(float_to_bits(exp_avg));
      m_key = k > m_key ? k : m_key;
    }
    if constexpr (kIsFp8<V>) {
      const float exp_avg_sq =
          load_moment<V>(v, i, scales.exp_avg_sq_scale_inv) * s.beta2 + (grad * grad) * s.one_minus_beta2;
      const int32_t k = Key::of(float_to_bits(exp_avg_sq));
      v_key = k > v_key ? k : v_key;
    }
  }
  *exp_avg_key = m_key;
  *exp_avg_sq_key = v_key;
}

// Calls fn(Moment-constant) for an fp8 moment, fn(kFloat32) (not computed) for any other.
template <class Fn>
inline void dispatch_fp8_moment(int moment, Fn&& fn) {
  switch (static_cast<Moment>(moment)) {
    case Moment::kE4M3: fn(std::integral_constant<Moment, Moment::kE4M3>{}); break;
    case Moment::kE5M2: fn(std::integral_constant<Moment, Moment::kE5M2>{}); break;
    default: fn(std::integral_constant<Moment, Moment::kFloat32>{}); break;
  }
}

// Tensor t covers [offsets[t], offsets[t + 1]) of one index space that threads split evenly, so
// many small tensors cost one thread launch, not one each.
std::vector<int64_t> offsets_of(const std::vector<int64_t>& numels) {
  std::vector<int64_t> offsets(numels.size() + 1, 0);
  for (size_t t = 0; t < numels.size(); ++t) offsets[t + 1] = offsets[t] + numels[t];
  return offsets;
}

// Calls fn(t, lo, hi) for every tensor t that [begin, end) of the index space overlaps, with the
// overlap [lo, hi) counted within t.
template <class Fn>
inline void for_each_overlap(const std::vector<int64_t>& offsets, int64_t begin, int64_t end, Fn&& fn) {
  const size_t count = offsets.size() - 1;
  size_t t = size_t(std::upper_bound(offsets.begin(), offsets.end(), begin) - offsets.begin()) - 1;
  for (; t < count && offsets[t] < end; ++t) {
    const int64_t lo = std::max(begin, offsets[t]) - offsets[t], hi = std::min(end, offsets[t + 1]) - offsets[t];
    if (lo < hi) fn(t, lo, hi);
  }
}

}  // namespace

void adam_step(const std::vector<uintptr_t>& params, const std::vector<uintptr_t>& grads,
               const std::vector<uintptr_t>& exp_avgs, const std::vector<uintptr_t>& exp_avg_sqs,
               const std::vector<uintptr_t>& steps, const std::vector<uintptr_t>& outs,
               const std::vector<int64_t>& numels, int param_dtype, int grad_dtype, int exp_avg_dtype,
               int exp_avg_sq_dtype, int out_dtype, uintptr_t found_inf, uintptr_t lr, int lr_dtype,
               const std::vector<double>& hyperparameters, bool adam_w_mode, uintptr_t amax_out,
               const std::vector<uintptr_t>& counters, int64_t seed, const std::vector<uintptr_t>& scale_invs,
               uintptr_t moment_amaxes, int num_threads) {
  const size_t count = numels.size();
  const std::vector<int64_t> offsets = offsets_of(numels);
  const int chunks = std::max(num_threads, 1);
  // keys[chunk * count + t]: the chunk's largest magnitude key within tensor t.
  std::vector<int32_t> keys(amax_out ? size_t(chunks) * count : 0, 0);
  auto write_amaxes = [&] {
    if (!amax_out) return;
    float* out = reinterpret_cast<float*>(amax_out);
    for (size_t t = 0; t < count; ++t) {
      int32_t key = 0;
      for (int chunk = 0; chunk < chunks; ++chunk) key = std::max(key, keys[size_t(chunk) * count + t]);
      out[t] = MagnitudeKey<DType::kFloat32>::to_float(key);
    }
  };
  if (found_inf && *reinterpret_cast<const float*>(found_inf) != 0.0f) {  // skipped: nothing is written
    if (amax_out) {  // the amaxes of the parameters as they are
      dispatch_dtype(param_dtype, [&](auto p_c) {
        parallel_for(offsets[count], kMinElementsPerThread, chunks, [&](int64_t chunk, int64_t begin, int64_t end) {
          for_each_overlap(offsets, begin, end, [&](size_t t, int64_t lo, int64_t hi) {
            keys[size_t(chunk) * count + t] =
                max_key_range<decltype(p_c)::value>(reinterpret_cast<const void*>(params[t]), lo, hi);
          });
        });
      });
    }
    write_amaxes();
    return;
  }
  // The scalars of each tensor, from its step count and lr ([Note: Adam numerics]).
  const double lr_value = lr ? read_scalar(lr, lr_dtype) : hyperparameters[0];
  std::vector<AdamScalars> scalars(count);
  for (size_t t = 0; t < count; ++t) {
    const int64_t step = int64_t(*reinterpret_cast<const float*>(steps[t])) + 1;
    scalars[t] = scalars_of(lr_value, hyperparameters[1], hyperparameters[2], hyperparameters[3], hyperparameters[4],
                            adam_w_mode, step);
  }
  const std::vector<MomentScales> scales =
      moment_scales(exp_avg_dtype, exp_avg_sq_dtype, count, scale_invs, moment_amaxes);
  // Tensor t's stream: seed + its counter, modulo 2^64 ([Note: Adam stochastic rounding]).
  std::vector<uint64_t> streams(counters.size());
  for (size_t t = 0; t < counters.size(); ++t) {
    streams[t] = uint64_t(seed) + *reinterpret_cast<const uint64_t*>(counters[t]);
  }
  // decay and weight_decay do not depend on the step count: one variant for every tensor.
  const AdamScalars& first = scalars[0];
  const Decay decay = first.decay != 1.0f ? Decay::kDecoupled : first.weight_decay != 0.0f ? Decay::kL2 : Decay::kNone;
  const bool stochastic = !counters.empty();
  // bf16/fp16 params rounded to nearest step an fp32 copy of a block at a time; with outs every
  // block is written to them while in cache. fp32 params without outs go in one range.
  const bool rounded = !stochastic && param_dtype != int(DType::kFloat32);
  const bool blocks = rounded || !outs.empty();
  constexpr int64_t kBlock = 2048;

  // decay_of and amax_of: compile-time constants, or Runtime values for fp8 moments (adam_range).
  auto run = [&](auto decay_of, auto g_c, auto m_c, auto v_c, auto amax_of, auto stochastic_c) {
    constexpr DType G = decltype(g_c)::value;
    constexpr Moment M = decltype(m_c)::value, V = decltype(v_c)::value;
    constexpr bool kStochastic = decltype(stochastic_c)::value;
    const bool record_amax = amax_of();
    parallel_for(offsets[count], kMinElementsPerThread, chunks, [&](int64_t chunk, int64_t begin, int64_t end) {
      std::array<float, kBlock> scratch;
      for_each_overlap(offsets, begin, end, [&](size_t t, int64_t lo, int64_t hi) {
        void* p = reinterpret_cast<void*>(params[t]);
        const void* g = reinterpret_cast<const void*>(grads[t]);
        void* m = reinterpret_cast<void*>(exp_avgs[t]);
        void* v = reinterpret_cast<void*>(exp_avg_sqs[t]);
        const uint64_t stream = kStochastic ? streams[t] : 0;
        int32_t key = 0;
        if (!blocks) {
          key = adam_range<G, M, V, kStochastic>(p, 0, g, m, v, lo, hi, scalars[t], scales[t], stream, decay_of,
                                                 amax_of);
        }
        for (int64_t b = lo; blocks && b < hi; b += kBlock) {
          const int64_t e = std::min(hi, b + kBlock);
          int32_t k;
          if (rounded) {  // the fp32 value is the update's; param and out take its rounding
            convert(param_dtype, p, 0, int(DType::kFloat32), scratch.data(), b, b, e);
            k = adam_range<G, M, V, false>(scratch.data(), b, g, m, v, b, e, scalars[t], scales[t], 0, decay_of,
                                           amax_of);
            convert(int(DType::kFloat32), scratch.data(), b, param_dtype, p, 0, b, e);
            if (!outs.empty()) convert(int(DType::kFloat32), scratch.data(), b, out_dtype, reinterpret_cast<void*>(outs[t]), 0, b, e);
          } else {  // the param holds the value: fp32, or bf16 rounded stochastically
            k = adam_range<G, M, V, kStochastic>(p, 0, g, m, v, b, e, scalars[t], scales[t], stream, decay_of,
                                                 amax_of);
            convert(param_dtype, p, 0, out_dtype, reinterpret_cast<void*>(outs[t]), 0, b, e);
          }
          key = std::max(key, k);
        }
        if (record_amax) keys[size_t(chunk) * count + t] = key;
      });
    });
  };
  auto with_stochastic = [&](auto... c) {
    if (stochastic) {
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
  dispatch_dtype(grad_dtype, [&](auto g_c) {
    dispatch_moment(exp_avg_dtype, [&](auto m_c) {
      dispatch_moment(exp_avg_sq_dtype, [&](auto v_c) {
        if constexpr (kIsFp8<std::decay_t<decltype(m_c)>::value> || kIsFp8<decltype(v_c)::value>) {
          // One variant for every decay and amax choice: the fp8-moment loops are scalar anyway.
          with_stochastic(Runtime<Decay>{decay}, g_c, m_c, v_c, Runtime<bool>{amax_out != 0});
        } else {
          switch (decay) {
            case Decay::kNone: with_amax(std::integral_constant<Decay, Decay::kNone>{}, g_c, m_c, v_c); break;
            case Decay::kDecoupled: with_amax(std::integral_constant<Decay, Decay::kDecoupled>{}, g_c, m_c, v_c); break;
            case Decay::kL2: with_amax(std::integral_constant<Decay, Decay::kL2>{}, g_c, m_c, v_c); break;
          }
        }
      });
    });
  });

  for (size_t t = 0; t < count; ++t) {
    float* step = reinterpret_cast<float*>(steps[t]);
    *step = *step + 1.0f;
  }
  for (size_t t = 0; t < counters.size(); ++t) *reinterpret_cast<uint64_t*>(counters[t]) += 1;
  // Every element was decoded with the stored scale_inv: now the new one (1 / the new scale).
  int row = 0;
  for (const int moment : {exp_avg_dtype, exp_avg_sq_dtype}) {
    if (!is_fp8(moment)) continue;
    for (size_t t = 0; t < count; ++t) {
      const size_t at = size_t(row) * count + t;
      float scale = 1.0f;
      scale_of(reinterpret_cast<const float*>(moment_amaxes)[at], fp8_max(moment), 1.0f, false, &scale,
               reinterpret_cast<float*>(scale_invs[at]));
    }
    ++row;
  }
  write_amaxes();
}

void adam_moment_amaxes(const std::vector<uintptr_t>& params, const std::vector<uintptr_t>& grads,
                        const std::vector<uintptr_t>& exp_avgs, const std::vector<uintptr_t>& exp_avg_sqs,
                        const std::vector<int64_t>& numels, int param_dtype, int grad_dtype, int exp_avg_dtype,
                        int exp_avg_sq_dtype, const AdamScalars& scalars, const std::vector<uintptr_t>& scale_invs,
                        uintptr_t amax_out, int num_threads) {
  const size_t count = numels.size();
  const std::vector<MomentScales> scales = moment_scales(exp_avg_dtype, exp_avg_sq_dtype, count, scale_invs, 0);
  const std::vector<int64_t> offsets = offsets_of(numels);
  const int chunks = std::max(num_threads, 1);
  // keys[(chunk * count + t) * 2 + moment]: the chunk's largest magnitude key of tensor t's moment.
  std::vector<int32_t> keys(size_t(chunks) * count * 2, 0);
  // As adam_step decides: L2 unless decoupled decay applies ([Note: Adam numerics]).
  const bool l2 = scalars.decay == 1.0f && scalars.weight_decay != 0.0f;

  auto run = [&](auto l2_c, auto p_c, auto g_c, auto m_c, auto v_c) {
    constexpr bool kL2 = decltype(l2_c)::value;
    constexpr DType P = decltype(p_c)::value, G = decltype(g_c)::value;
    constexpr Moment M = decltype(m_c)::value, V = decltype(v_c)::value;
    parallel_for(offsets[count], kMinElementsPerThread, chunks, [&](int64_t chunk, int64_t begin, int64_t end) {
      for_each_overlap(offsets, begin, end, [&](size_t t, int64_t lo, int64_t hi) {
        int32_t* key = &keys[(size_t(chunk) * count + t) * 2];
        moment_amax_range<kL2, P, G, M, V>(
            reinterpret_cast<const void*>(params[t]), reinterpret_cast<const void*>(grads[t]),
            reinterpret_cast<const void*>(exp_avgs[t]), reinterpret_cast<const void*>(exp_avg_sqs[t]), lo, hi,
            scalars, scales[t], key, key + 1);
      });
    });
  };
  auto with_moments = [&](auto l2_c, auto p_c, auto g_c) {
    dispatch_fp8_moment(exp_avg_dtype, [&](auto m_c) {
      dispatch_fp8_moment(exp_avg_sq_dtype, [&](auto v_c) { run(l2_c, p_c, g_c, m_c, v_c); });
    });
  };
  dispatch_dtype(grad_dtype, [&](auto g_c) {
    if (l2) {
      dispatch_dtype(param_dtype, [&](auto p_c) { with_moments(std::true_type{}, p_c, g_c); });
    } else {  // the param is not read
      with_moments(std::false_type{}, std::integral_constant<DType, DType::kFloat32>{}, g_c);
    }
  });

  float* out = reinterpret_cast<float*>(amax_out);
  const int moments[2] = {exp_avg_dtype, exp_avg_sq_dtype};
  int row = 0;
  for (int which = 0; which < 2; ++which) {
    if (!is_fp8(moments[which])) continue;
    for (size_t t = 0; t < count; ++t) {
      int32_t key = 0;
      for (int chunk = 0; chunk < chunks; ++chunk) key = std::max(key, keys[(size_t(chunk) * count + t) * 2 + which]);
      out[size_t(row) * count + t] = MagnitudeKey<DType::kFloat32>::to_float(key);
    }
    ++row;
  }
}

}  // namespace quant_core
