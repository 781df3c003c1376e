from __future__ import annotations

import numpy as np
import pytest
import torch

import quant_core
from quant_core import AdamScalars, adam_step_
from quant_core.shared._numerics import random16, round_to_bfloat16_stochastic, signed64
from quant_core.testing import BF16_STOCHASTIC_CASES, float32_from_bits, kernel_backends, no_host_syncs, raw_bits

# Hyperparameters and the step count each step is taken at.
CONFIGS = {
    "adamw": ({"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01, "adam_w_mode": True}, 3),
    "adam-l2": ({"lr": 2e-2, "beta1": 0.8, "beta2": 0.99, "eps": 1e-6, "weight_decay": 0.1, "adam_w_mode": False}, 1),
    "no-decay": (
        {"lr": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.0, "adam_w_mode": True},
        1000,
    ),
}
SCALARS = {mode: AdamScalars.of(**hyper, step=step) for mode, (hyper, step) in CONFIGS.items()}


def steps_at(step, count):
    """Step counts from which the next step is `step`."""
    return [torch.tensor(float(step - 1)) for _ in range(count)]


def adam(params, grads, exp_avgs, exp_avg_sqs, mode, **kwargs):
    """adam_step_ with the hyperparameters of CONFIGS[mode] at its step count."""
    hyper, step = CONFIGS[mode]
    return adam_step_(params, grads, exp_avgs, exp_avg_sqs, steps_at(step, len(params)), **hyper, **kwargs)


def make_states(numels, grad_dtype=torch.float32, moment_dtypes=(torch.float32, torch.float32), seed=0):
    """Params, grads and moments with values over many decades (all finite, some zero or subnormal)."""
    generator = torch.Generator().manual_seed(seed)

    def values(n, scale):
        x = (
            torch.randn(n, generator=generator)
            * torch.logspace(-6, 6, max(n, 1))[torch.randperm(max(n, 1), generator=generator)][:n]
        )
        x[: min(n, 3)] = torch.tensor([0.0, 1e-40, -3e-39])[: min(n, 3)]
        return x * scale

    params = [values(n, 1.0) for n in numels]
    grads = [values(n, 1e-2).to(grad_dtype) for n in numels]
    exp_avgs = [values(n, 1e-3).to(moment_dtypes[0]) for n in numels]
    exp_avg_sqs = [values(n, 1e-3).square().to(moment_dtypes[1]) for n in numels]
    return params, grads, exp_avgs, exp_avg_sqs


def clone(states):
    return tuple([t.clone() for t in tensors] for tensors in states)


def assert_bitwise_equal(a, b, nan_bits=True):
    """Lists of tensors equal bit for bit; without nan_bits, NaNs equal by position only (their
    bits differ between the backends: quant-core's NOTES, 'Known disagreement')."""
    for tensors_a, tensors_b in zip(a, b, strict=True):
        for x, y in zip(tensors_a, tensors_b, strict=True):
            x, y = x.reshape(-1), y.reshape(-1)
            if not nan_bits:
                nan = x.isnan()
                assert torch.equal(nan, y.isnan())
                x, y = x[~nan], y[~nan]
            assert torch.equal(raw_bits(x), raw_bits(y))


def test_states_are_drawn_from_their_seed_only():
    # The same data in every run and in any test order: comparisons that hold for some data only
    # (NaN bits, overflow) would otherwise pass or fail from run to run.
    assert_bitwise_equal(make_states([300, 7], seed=5), make_states([300, 7], seed=5))


def test_reference_is_the_ieee_fp32_spec():
    # numpy float32 arithmetic rounds every operation once, as [Note: Adam numerics] specifies.
    s = SCALARS["adamw"]
    states = make_states([4097])
    p, g, m, v = (t[0].numpy().copy() for t in states)
    f = np.float32
    p = p * f(s.decay)
    m = m * f(s.beta1) + g * f(s.one_minus_beta1)
    v = v * f(s.beta2) + (g * g) * f(s.one_minus_beta2)
    p = p - (m / (np.sqrt(v) * f(s.inv_bias_correction2_sqrt) + f(s.eps))) * f(s.step_size)
    with quant_core.use_backend("reference"):
        amax = adam(*states, "adamw", compute_amax=True)
    for got, expected in zip((states[0][0], states[2][0], states[3][0]), (p, m, v), strict=True):
        assert np.array_equal(got.numpy(), expected)
    assert amax.tolist() == [float(np.abs(p).max())]


def test_scalars_round_each_value_once_to_fp32():
    s = AdamScalars.of(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=2, adam_w_mode=True)
    assert s.step_size == float(np.float32(1e-3 / (1 - 0.9**2)))
    assert s.inv_bias_correction2_sqrt == float(np.float32(1 / (1 - 0.999**2) ** 0.5))
    assert s.decay == float(np.float32(1 - 1e-3 * 0.01))
    assert s.weight_decay == 0.0
    l2 = AdamScalars.of(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=2, adam_w_mode=False)
    assert l2.decay == 1.0
    assert l2.weight_decay == float(np.float32(0.01))
    with pytest.raises(ValueError, match="step counts from 1"):
        AdamScalars.of(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=0, adam_w_mode=True)


@pytest.mark.parametrize("mode", sorted(SCALARS))
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("moment_dtypes", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                           (torch.float32, torch.bfloat16)])  # fmt: skip
def test_kernel_equals_reference(backend, mode, grad_dtype, moment_dtypes):
    # Sizes cross the per-thread split inside and between tensors; an empty one sits in between.
    states = make_states([1, 7, 200_003, 0, 65_536, 131_071], grad_dtype, moment_dtypes, seed=len(mode))
    expected_states = clone(states)
    with quant_core.use_backend("reference"):
        expected_amax = adam(*expected_states, mode, compute_amax=True)
    amax = adam(*states, mode, compute_amax=True)
    assert_bitwise_equal(states, expected_states)
    assert torch.equal(amax, expected_amax)
    assert adam(*states, mode) is None


@pytest.mark.parametrize(("param_dtype", "out_dtype"), [(torch.float32, None), (torch.float32, torch.bfloat16),
                                                      (torch.float32, torch.float16), (torch.bfloat16, None),
                                                      (torch.float16, torch.float32), (torch.bfloat16, torch.float16)])  # fmt: skip
@pytest.mark.parametrize("mode", sorted(SCALARS))
@pytest.mark.parametrize("lr", ["float", torch.float32, torch.float64, torch.bfloat16])
def test_kernel_with_step_counts_params_and_outs_equals_reference(backend, param_dtype, out_dtype, mode, lr):
    # Step counts that differ per tensor, lr as a float or a tensor, low-precision params rounded to
    # nearest, outs, steps and skips in turn; sizes cross the kernel's blocks and thread splits.
    numels = [1, 7, 200_003, 0, 65_536, 2049]
    hyper, _ = CONFIGS[mode]
    hyper = {**hyper, "lr": hyper["lr"] if lr == "float" else torch.tensor(hyper["lr"], dtype=lr)}
    states = stepped_states(numels, param_dtype, seed=len(mode))
    # Non-finite and huge parameters (+-Inf only where Adam-L2 cannot carry them into NaN). Updates of
    # up to ~1e8 still overflow fp16 parameters to +-Inf, which Adam-L2 turns into NaN the step after:
    # those NaNs compare by position only (torch's fp16 -> fp32 in the reference gives -NaN as
    # 0x7FFFFFFF in its scalar loop, as 0xFFC00000 in its vector loop; C++ keeps 0xFFC00000).
    states[0][:] = [p.float().clamp(-6e4, 6e4).to(param_dtype) for p in states[0]]
    specials = (float("inf"), -float("inf"), -3e38) if mode != "adam-l2" else (6e4, -6e-8, 0.0)
    nan_bits = not (param_dtype == torch.float16 and mode == "adam-l2")
    states[0][1][:3] = torch.tensor(specials).to(param_dtype)
    outs = [torch.zeros(n, dtype=out_dtype) for n in numels] if out_dtype else None
    expected, expected_outs = clone(states), clone([outs])[0] if outs else None
    for found in (None, 0.0, 1.0, None):
        found_inf = None if found is None else torch.tensor([found])
        with quant_core.use_backend("reference"):
            expected_amax = adam_step_(*expected, **hyper, found_inf=found_inf, outs=expected_outs, compute_amax=True)
        amax = adam_step_(*states, **hyper, found_inf=found_inf, outs=outs, compute_amax=True)
        assert_bitwise_equal(states, expected, nan_bits)
        if outs:
            assert_bitwise_equal([outs], [expected_outs], nan_bits)
        assert torch.equal(amax, expected_amax)
    assert [float(s) for s in states[4]] == [3.0 * i + 3 for i in range(len(numels))]


def test_kernel_reads_non_contiguous_grads(backend):
    states = make_states([96 * 160])
    grads = [torch.randn(160, 96).t()]
    expected_states = clone((states[0], grads, states[2], states[3]))
    with quant_core.use_backend("reference"):
        adam(*expected_states, "adamw")
    adam(states[0], grads, states[2], states[3], "adamw")
    assert_bitwise_equal((states[0], states[2], states[3]), (expected_states[0], *expected_states[2:]))


def test_amax_ignores_non_finite_params(backend):
    params = [torch.tensor([1.0, float("inf"), -2.0]), torch.tensor([float("nan")])]
    grads = [torch.zeros(3), torch.zeros(1)]
    moments = [torch.zeros(3), torch.zeros(1)]
    amax = adam(params, grads, moments, [m.clone() for m in moments], "no-decay", compute_amax=True)
    assert amax.tolist() == [2.0, 0.0]


def test_empty_lists():
    assert adam([], [], [], [], "adamw") is None
    assert adam([], [], [], [], "adamw", compute_amax=True).shape == (0,)


def test_bad_inputs_name_the_problem():
    p, g, m, v = make_states([8, 8])
    with pytest.raises(ValueError, match="one grad, two moments, a step count .* per parameter"):
        adam(p, g[:1], m, v, "adamw")
    with pytest.raises(TypeError, match=r"params\[1\] has dtype torch.float32"):
        adam([p[0].bfloat16(), p[1]], g, m, v, "adamw")
    with pytest.raises(TypeError, match=r"grads\[1\] has dtype torch.bfloat16; every tensor of grads"):
        adam(p, [g[0], g[1].bfloat16()], m, v, "adamw")
    with pytest.raises(TypeError, match=r"exp_avgs\[0\] has dtype torch.float16"):
        adam(p, g, [t.half() for t in m], v, "adamw")
    with pytest.raises(ValueError, match=r"grads\[1\] has 4 elements but params\[1\] has 8"):
        adam(p, [g[0], g[1][:4]], m, v, "adamw")
    with pytest.raises(ValueError, match=r"exp_avg_sqs\[0\] must be contiguous"):
        adam(p, g, m, [torch.zeros(16)[::2], v[1]], "adamw")
    with pytest.raises(ValueError, match=r"grads\[0\] is on meta"):
        adam(p, [torch.empty(8, device="meta"), g[1]], m, v, "adamw")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("special", [float("nan"), float("inf"), -float("inf"), None])
@pytest.mark.parametrize("where", [0, 199_999])
def test_has_non_finite_equals_reference(backend, dtype, special, where):
    tensors = [torch.randn(1000), torch.randn(200_000).to(dtype), torch.empty(0), torch.randn(3, 5).t()]
    if special is not None:
        tensors[1][where] = special
    expected = quant_core.has_non_finite_reference(tensors)
    assert expected.item() == (special is not None)
    assert torch.equal(quant_core.has_non_finite(tensors), expected)


def test_has_non_finite_sees_every_tensor(backend):
    tensors = [torch.zeros(5) for _ in range(40)]
    assert quant_core.has_non_finite(tensors).item() == 0.0
    tensors[-1][-1] = float("nan")
    assert quant_core.has_non_finite(tensors).item() == 1.0
    assert quant_core.has_non_finite([]).item() == 0.0
    with pytest.raises(TypeError, match="tensors\\[0\\] has dtype torch.int64"):
        quant_core.has_non_finite([torch.zeros(2, dtype=torch.long)])


def test_kernel_bumps_the_version_of_what_it_writes(backend):
    # Caches keyed on a tensor's version (quant_fsdp's quantized shards) must see the update.
    states = make_states([64])
    before = [t._version for tensors in (states[0], states[2], states[3]) for t in tensors]
    adam(*states, "adamw")
    after = [t._version for tensors in (states[0], states[2], states[3]) for t in tensors]
    assert all(a > b for a, b in zip(after, before, strict=True))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (scripts/gpu-suite.sh)")
@pytest.mark.parametrize("special", [float("nan"), float("inf"), -float("inf"), None])
@pytest.mark.parametrize("where", [0, 16_384, 199_999])
def test_cuda_has_non_finite_equals_reference(special, where):
    assert quant_core.selected_backend("has_non_finite", torch.device("cuda")) == "triton"
    tensors = [torch.randn(1000), torch.randn(200_000).to(torch.bfloat16), torch.randn(300).half(), torch.empty(0)]
    if special is not None:
        tensors[1][where] = special
        tensors[2][where % 300] = special
    for checked in (tensors, tensors[1:2], tensors[2:3], tensors[:1]):
        expected = quant_core.has_non_finite_reference(checked)
        assert torch.equal(quant_core.has_non_finite([t.cuda() for t in checked]).cpu(), expected)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (scripts/gpu-suite.sh)")
def test_cuda_tensors_first_made_in_a_cuda_graph_are_checked_at_every_replay():
    # Gradients allocated inside the capture (zero_grad(set_to_none=True)) have addresses no eager
    # call saw (the graph allocates from its own pool): their pointer table is copied in the graph
    # ([Note: pointer tables]).
    source = torch.randn(70_000, device="cuda")

    def made(source):  # fresh tensors of two dtypes
        return [source[:5] * 2, (source * 2).bfloat16(), source.repeat(2)[:16_385] * 2]

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up: compiles the kernel, caches the chunk tables
        quant_core.has_non_finite(made(source))
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        found = quant_core.has_non_finite(made(source))
    verdicts = []
    for bad in (None, 3, 69_999, None, 5):  # 5: only the second and third tensors see it
        source.normal_()
        if bad is not None:
            source[bad] = float("nan")
        graph.replay()
        verdicts.append(float(found))
        assert torch.equal(found.cpu(), quant_core.has_non_finite_reference([t.cpu() for t in made(source)]))
    assert verdicts == [0.0, 1.0, 1.0, 0.0, 1.0]


# ---- step counts, lr and the verdict as tensors ([Note: Adam step in tensors]) -------------------

HYPER = {"beta1": 0.9, "beta2": 0.999, "eps": 1e-8}


def stepped_states(numels, param_dtype=torch.float32, moment_dtypes=(torch.float32, torch.float32), seed=0):
    params, grads, exp_avgs, exp_avg_sqs = make_states(numels, torch.float32, moment_dtypes, seed)
    steps = [torch.tensor(float(3 * i), dtype=torch.float32) for i in range(len(numels))]  # counts differ
    return [p.to(param_dtype) for p in params], grads, exp_avgs, exp_avg_sqs, steps


@pytest.mark.parametrize(("adam_w_mode", "weight_decay"), [(True, 0.01), (False, 0.1), (True, 0.0)])
@pytest.mark.parametrize("lr", [1e-3, torch.tensor(3e-3, dtype=torch.float64)])
def test_each_step_count_gives_its_tensor_the_scalars_of_adam_scalars_of(backend, adam_w_mode, weight_decay, lr):
    states = stepped_states([1, 7, 20_003, 0])
    expected = [[t.numpy().copy() for t in tensors] for tensors in states[:4]]
    f = np.float32
    for step in range(2):
        amax = adam_step_(
            *states, lr=lr, weight_decay=weight_decay, adam_w_mode=adam_w_mode, compute_amax=True, **HYPER
        )
        for i in range(4):  # numpy float32 arithmetic: each operation rounded once
            s = AdamScalars.of(
                lr=float(lr), step=3 * i + step + 1, weight_decay=weight_decay, adam_w_mode=adam_w_mode, **HYPER
            )
            p, g, m, v = (tensors[i] for tensors in expected)
            p = p * f(s.decay) if s.decay != 1.0 else p
            g = g + p * f(s.weight_decay) if s.weight_decay != 0.0 else g
            m = m * f(s.beta1) + g * f(s.one_minus_beta1)
            v = v * f(s.beta2) + (g * g) * f(s.one_minus_beta2)
            p = p - (m / (np.sqrt(v) * f(s.inv_bias_correction2_sqrt) + f(s.eps))) * f(s.step_size)
            expected[0][i], expected[2][i], expected[3][i] = p, m, v
            assert amax[i].item() == (float(np.abs(p).max()) if p.size else 0.0)
        for tensors, wanted in zip(states[:4], expected, strict=True):
            assert all(np.array_equal(t.numpy(), w) for t, w in zip(tensors, wanted, strict=True))
        assert [float(s) for s in states[4]] == [3.0 * i + step + 1 for i in range(4)]


@pytest.mark.parametrize("moment_dtypes", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32)])
def test_step_writes_nothing_when_found_inf_is_set(backend, moment_dtypes):
    states = stepped_states([5, 300], param_dtype=torch.bfloat16, moment_dtypes=moment_dtypes)
    outs = [torch.full((5,), 7.0), torch.full((300,), 7.0)]
    before = clone((*states, outs))
    amax = adam_step_(
        *states, lr=1e-2, weight_decay=0.1, adam_w_mode=True, found_inf=torch.ones(1), outs=outs, compute_amax=True,
        **HYPER,
    )  # fmt: skip
    assert_bitwise_equal((*states, outs), before)
    # The amaxes of the parameters as they are: what a requantize that does not know the verdict needs.
    assert torch.equal(amax, torch.stack([p.float().abs().max() for p in states[0]]))


def test_step_of_low_precision_params_and_outs_rounds_the_fp32_update(backend):
    numels = [9, 1000, 5000]
    fp32 = stepped_states(numels)
    fp32[0][:] = [p.bfloat16().float() for p in fp32[0]]  # an fp32 master of bf16 values
    bf16 = ([p.bfloat16() for p in fp32[0]], *clone(fp32[1:]))
    outs = [torch.empty(n, dtype=torch.bfloat16) for n in numels]
    adam_step_(*bf16, lr=1e-2, weight_decay=0.0, adam_w_mode=True, **HYPER)
    adam_step_(*fp32, lr=1e-2, weight_decay=0.0, adam_w_mode=True, outs=outs, **HYPER)
    for p, master, out in zip(bf16[0], fp32[0], outs, strict=True):
        assert torch.equal(raw_bits(p), raw_bits(master.bfloat16()))
        assert torch.equal(raw_bits(out), raw_bits(p))


def test_step_refuses_what_it_cannot_take():
    states = stepped_states([8, 8])
    with pytest.raises(ValueError, match="a step count .* per parameter"):
        adam_step_(*states[:4], states[4][:1], lr=1e-3, weight_decay=0.0, adam_w_mode=True, **HYPER)
    with pytest.raises(ValueError, match=r"steps\[0\] must be a 0-d tensor"):
        adam_step_(*states[:4], [torch.zeros(1), torch.zeros(())], lr=1e-3, weight_decay=0.0, adam_w_mode=True, **HYPER)
    with pytest.raises(TypeError, match=r"steps\[0\] has dtype torch.int64"):
        adam_step_(*states[:4], [torch.zeros((), dtype=torch.long)] * 2, lr=1e-3, weight_decay=0.0, adam_w_mode=True,
                   **HYPER)  # fmt: skip
    with pytest.raises(ValueError, match="found_inf must be a float32 tensor .* pass found_inf.float()"):
        adam_step_(
            *states, lr=1e-3, weight_decay=0.0, adam_w_mode=True, found_inf=torch.zeros(1, dtype=torch.bool), **HYPER
        )
    with pytest.raises(ValueError, match="lr must be a float or a one-element tensor .* pass lr.float()"):
        adam_step_(*states, lr=torch.tensor([1e-3, 1e-3]), weight_decay=0.0, adam_w_mode=True, **HYPER)
    outs = [torch.zeros(8), torch.zeros(8, dtype=torch.int32)]
    with pytest.raises(TypeError, match=r"outs\[1\] has dtype torch.int32"):
        adam_step_(*states, lr=1e-3, weight_decay=0.0, adam_w_mode=True, outs=outs, **HYPER)


def test_power_squares_in_float64():
    assert quant_core.power(0.999, 0) == 1.0
    assert quant_core.power(0.9, 1) == 0.9
    assert quant_core.power(0.999, 2) == 0.999 * 0.999
    base = 0.95
    squares = [base]  # 13 = 0b1101: base^1 * base^4 * base^8, the squares made in turn
    for _ in range(3):
        squares.append(squares[-1] * squares[-1])
    result = ((1.0 * squares[0]) * squares[2]) * squares[3]
    assert quant_core.power(base, 13) == result


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (scripts/gpu-suite.sh)")
@pytest.mark.parametrize(("param_dtype", "out_dtype"), [(torch.float32, None), (torch.float32, torch.bfloat16),
                                                      (torch.bfloat16, None), (torch.float16, None)])  # fmt: skip
@pytest.mark.parametrize("moment_dtypes", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("lr", [1e-3, "tensor"])
def test_cuda_kernel_equals_reference(param_dtype, out_dtype, moment_dtypes, lr):
    assert quant_core.selected_backend("adam_step", torch.device("cuda")) == "triton"
    numels = [1, 7, 200_003, 0, 65_536, 131_071]
    expected = stepped_states(numels, param_dtype, moment_dtypes)
    outs = [torch.zeros(n, dtype=out_dtype) for n in numels] if out_dtype else None
    on_cuda = tuple([t.cuda() for t in tensors] for tensors in expected)
    outs_cuda = [t.cuda() for t in outs] if outs else None
    for found in (0.0, 1.0, 0.0):  # steps, a skip, and a step after it (the tickets were reset)
        kwargs = {"weight_decay": 0.01, "adam_w_mode": True, "compute_amax": True, **HYPER}
        with quant_core.use_backend("reference"):
            expected_amax = adam_step_(
                *expected, lr=torch.tensor(2e-3) if lr == "tensor" else lr, found_inf=torch.tensor([found]), outs=outs,
                **kwargs,
            )  # fmt: skip
        amax = adam_step_(
            *on_cuda, lr=torch.tensor(2e-3, device="cuda") if lr == "tensor" else lr,
            found_inf=torch.tensor([found], device="cuda"), outs=outs_cuda, **kwargs,
        )  # fmt: skip
        assert_bitwise_equal(tuple([t.cpu() for t in tensors] for tensors in on_cuda), expected)
        if outs:
            assert_bitwise_equal([[t.cpu() for t in outs_cuda]], [outs])
        assert torch.equal(amax.cpu(), expected_amax)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (scripts/gpu-suite.sh)")
def test_cuda_step_replays_in_a_cuda_graph_without_host_syncs():
    numels = [5, 70_000, 16_384]
    states = tuple([t.cuda() for t in tensors] for tensors in stepped_states(numels))
    expected = clone(states)
    lr, found = torch.tensor(1e-3, device="cuda"), torch.zeros(1, device="cuda")
    kwargs = {"weight_decay": 0.01, "adam_w_mode": True, **HYPER}

    def step(tensors):
        adam_step_(*tensors, lr=lr, found_inf=found, **kwargs)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step(states)  # warm-up: compiles, caches the pointer and chunk tables
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(states)  # captured, not run
    step(expected)  # as the warm-up (its tensors' tables made here)
    with no_host_syncs():  # a host sync in an eager step would raise
        for lr_value, found_value in ((2e-3, 0.0), (2e-3, 1.0), (5e-4, 0.0)):
            lr.fill_(lr_value)
            found.fill_(found_value)
            graph.replay()
            step(expected)
    assert_bitwise_equal(states, expected)
    assert [float(s) for s in states[4]] == [3.0 * i + 3 for i in range(len(numels))]  # the skip counted nothing


# ---- bf16 masters rounded stochastically ([Note: Adam stochastic rounding]) --------------------

BACKENDS = ("reference", *kernel_backends())
# A step whose fp32 result from p = -0.0 is -exp_avg exactly (g = 0, v = 2^-52, eps = 0; zeros come
# out -0.0): beta1 = beta2 = 1 - 2^-53 round to 1 in fp32, their complements to 2^-53, and at step 2
# 1 - beta^2 is 2^-52 in float64, so step_size = lr / 2^-52 = 1 and inv_bias_correction2_sqrt =
# 2^26 = 1 / sqrt(v). It stores the rounding of any fp32 value chosen as -exp_avg, so rounding
# edges can be aimed at through the whole step.
PASS_THROUGH = {"lr": 2**-52, "beta1": 1 - 2**-53, "beta2": 1 - 2**-53, "eps": 0.0, "weight_decay": 0.0,
                "adam_w_mode": True}  # fmt: skip


def pass_through(params, exp_avgs, **kwargs):
    """The PASS_THROUGH step of params (from -0.0) with exp_avgs."""
    numels = [p.numel() for p in params]
    grads, exp_avg_sqs = [torch.zeros(n) for n in numels], [torch.full((n,), 2**-52) for n in numels]
    return adam_step_(params, grads, exp_avgs, exp_avg_sqs, steps_at(2, len(params)), **PASS_THROUGH, **kwargs)


def counters_for(numels, start=0):
    """One counter per parameter, 5 apart, as 0-d int64 tensors holding their uint64 bits."""
    return [torch.tensor(signed64(start + 5 * i), dtype=torch.int64) for i in range(len(numels))]


def bf16_states(numels, grad_dtype=torch.float32, moment_dtypes=(torch.float32, torch.float32), seed=0):
    params, grads, exp_avgs, exp_avg_sqs = make_states(numels, grad_dtype, moment_dtypes, seed)
    return [p.bfloat16() for p in params], grads, exp_avgs, exp_avg_sqs, counters_for(numels)


def adversarial_fp32(n: int) -> torch.Tensor:
    """fp32 values at and around bf16 rounding edges: bf16 values and their bit neighbours, the
    hand-worked edge cases, subnormals, huge values, +-0, +-Inf and NaNs of several payloads."""
    generator = torch.Generator().manual_seed(7)
    edges = torch.tensor([bits for bits, _, _ in BF16_STOCHASTIC_CASES], dtype=torch.int64)
    bf16_bits = torch.randint(0, 2**16, (n // 10,), generator=generator, dtype=torch.int64) << 16
    near = torch.cat([bf16_bits + low for low in (0, 1, 0x7FFF, 0x8000, 0xFFFF)])
    random = torch.randint(0, 2**32, (n - len(near) - len(edges),), generator=generator, dtype=torch.int64)
    return float32_from_bits(torch.cat([edges, near, random]))


@pytest.mark.parametrize("name", BACKENDS)
def test_stochastic_rounding_stores_the_rule_applied_to_the_fp32_update(name):
    many = adversarial_fp32(200_003)
    targets = [many, many[: len(BF16_STOCHASTIC_CASES)].clone(), torch.empty(0)]
    numels = [len(t) for t in targets]
    params = [torch.full((n,), -0.0, dtype=torch.bfloat16) for n in numels]
    counters = counters_for(numels, start=2**64 - 2)  # the first one wraps past 2^64 during the run
    exp_avgs = [-t for t in targets]
    updates = [torch.full((n,), -0.0) for n in numels]  # the fp32 update, by the fp32 spec
    with quant_core.use_backend("reference"):
        pass_through(updates, clone([exp_avgs])[0])
    for u, t in zip(updates, targets, strict=True):  # the edges reached: -0.0 - (-t) is t but for zeros and NaNs
        assert torch.equal(u[(t != 0) & ~t.isnan()], t[(t != 0) & ~t.isnan()])
        assert torch.equal(u.isnan(), t.isnan())
    for step in range(3):
        for p in params:
            p.fill_(-0.0)
        with quant_core.use_backend(name):
            pass_through(params, clone([exp_avgs])[0], stochastic_rounding_counters=counters, seed=-99)
        for i, (p, u) in enumerate(zip(params, updates, strict=True)):
            stream = torch.tensor(signed64(2**64 - 2 + 5 * i + step - 99))
            expected = round_to_bfloat16_stochastic(u, random16(stream, torch.arange(len(u))))
            assert torch.equal(raw_bits(p), raw_bits(expected)), (name, step, i)
        assert [int(c) for c in counters] == [signed64(2**64 - 2 + 5 * i + step + 1) for i in range(len(numels))]


@pytest.mark.parametrize("mode", sorted(SCALARS))
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("moment_dtypes", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)])
def test_stochastic_rounding_kernel_equals_reference(backend, mode, grad_dtype, moment_dtypes):
    states = bf16_states([1, 7, 200_003, 0, 65_536, 131_071], grad_dtype, moment_dtypes, seed=len(mode))
    # A NaN update, +-Inf, the largest bf16s and a subnormal. (Adam-L2 carries a non-finite parameter
    # into NaN moments, whose bf16 NaN bits the backends do not agree on: that mode keeps them finite.)
    non_finite = (float("nan"), float("inf"), -float("inf")) if mode != "adam-l2" else (0.0, 1.0, -1.0)
    for special, value in zip(states[0], (*non_finite, 0.0, 3e38, -1e-40), strict=True):
        if special.numel():
            special[-1] = value
    expected_states = clone(states)
    for _ in range(3):  # state across steps: the counters advance, the masters carry the rounding on
        with quant_core.use_backend("reference"):
            expected_amax = adam(*expected_states[:4], mode, compute_amax=True,
                                 stochastic_rounding_counters=expected_states[4], seed=2**63 + 11)  # fmt: skip
        amax = adam(*states[:4], mode, compute_amax=True, stochastic_rounding_counters=states[4], seed=2**63 + 11)
        assert_bitwise_equal(states, expected_states)
        assert torch.equal(amax, expected_amax)
    assert [int(c) for c in states[4]] == [5 * i + 3 for i in range(6)]


@pytest.mark.parametrize("name", BACKENDS)
def test_stochastic_rounding_streams_follow_seed_and_counter(name):
    def step(states, seed=5):
        with quant_core.use_backend(name):
            adam(*states[:4], "adamw", stochastic_rounding_counters=states[4], seed=seed)
        return states

    start = bf16_states([70_000, 300])
    once = step(clone(start))
    assert_bitwise_equal(step(clone(start)), once)  # same (seed, counter): same bits
    assert [int(c) for c in once[4]] == [1, 6]
    for changed in (step(clone(start), seed=6), step((*clone(start[:4]), counters_for([0, 0], start=1)))):
        rounded_differently = [
            not torch.equal(raw_bits(a), raw_bits(b)) for a, b in zip(changed[0], once[0], strict=True)
        ]
        assert all(rounded_differently)  # another seed or counter: other draws
        assert_bitwise_equal(changed[2:4], once[2:4])  # the same fp32 update
    # A run restored from its state after one step (counters included) continues bit for bit.
    run = step(step(step(clone(start))))
    resumed = step(step(clone(once)))
    assert_bitwise_equal(resumed, run)
    assert [int(c) for c in run[4]] == [3, 8]


@pytest.mark.parametrize("name", BACKENDS)
def test_stochastic_rounding_is_unbiased_through_the_step(name):
    # 1 + 0.3 ulp between bf16 neighbours 1 and 1 + 2^-7, rounded for 100_000 elements (each its
    # own draw): the mean is within 5 standard deviations (fixed seed) of the fp32 value.
    n, v = 100_000, torch.tensor(1.0 + 0.3 * 2**-7)
    params, counters = [torch.full((n,), -0.0, dtype=torch.bfloat16)], [torch.tensor(41)]
    with quant_core.use_backend(name):
        pass_through(params, [-v.expand(n).clone()], stochastic_rounding_counters=counters, seed=3)
    assert set(params[0].unique().tolist()) == {1.0, 1.0 + 2**-7}
    sigma = 2**-7 * (0.3 * 0.7 / n) ** 0.5
    assert abs(params[0].double().mean().item() - v.item()) < 5 * sigma


def test_stochastic_rounding_refuses_what_it_cannot_take():
    p, g, m, v, counters = bf16_states([8, 8])
    with pytest.raises(TypeError, match=r"params\[0\] has dtype torch.float32"):
        adam([t.float() for t in p], g, m, v, "adamw", stochastic_rounding_counters=counters)
    with pytest.raises(ValueError, match="one counter per parameter, got 1 counters for 2 params"):
        adam(p, g, m, v, "adamw", stochastic_rounding_counters=counters[:1])
    with pytest.raises(ValueError, match=r"stochastic_rounding_counters\[1\] must be a 0-d int64 tensor"):
        adam(p, g, m, v, "adamw", stochastic_rounding_counters=[counters[0], torch.zeros(())])
    with pytest.raises(ValueError, match=r"stochastic_rounding_counters\[0\] must be a 0-d int64 tensor"):
        adam(p, g, m, v, "adamw", stochastic_rounding_counters=[torch.zeros(1, dtype=torch.int64)] * 2)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_stochastic_rounding_with_outs_and_skips_equals_reference(backend, out_dtype):
    numels = [1, 7, 20_003, 0, 2049]
    states = stepped_states(numels, param_dtype=torch.bfloat16, moment_dtypes=(torch.bfloat16, torch.float32))
    counters = counters_for(numels, start=100)
    outs = [torch.empty(n, dtype=out_dtype) for n in numels]
    expected, expected_counters, expected_outs = clone(states), clone([counters])[0], clone([outs])[0]
    kwargs = {"lr": 2e-3, "weight_decay": 0.01, "adam_w_mode": True, "compute_amax": True, "seed": 77, **HYPER}
    for found in (0.0, 1.0, 0.0):  # a skip between two steps
        before = clone((*states, counters, outs))
        with quant_core.use_backend("reference"):
            expected_amax = adam_step_(*expected, found_inf=torch.tensor([found]), outs=expected_outs,
                                       stochastic_rounding_counters=expected_counters, **kwargs)  # fmt: skip
        amax = adam_step_(
            *states, found_inf=torch.tensor([found]), outs=outs, stochastic_rounding_counters=counters, **kwargs
        )
        assert_bitwise_equal((*states, counters, outs), (*expected, expected_counters, expected_outs))
        assert torch.equal(amax, expected_amax)
        if found:  # nothing written; the amaxes of the parameters as they are
            assert_bitwise_equal((*states, counters, outs), before)
            assert torch.equal(amax, torch.stack([amax_of(p) for p in states[0]]))
        else:
            assert_bitwise_equal([outs], [[p.to(out_dtype) for p in states[0]]])  # the rounded masters
    assert [int(c) for c in counters] == [100 + 5 * i + 2 for i in range(len(numels))]
    assert [float(s) for s in states[4]] == [3.0 * i + 2 for i in range(len(numels))]


def amax_of(p: torch.Tensor) -> torch.Tensor:
    return p.float().abs().max() if p.numel() else torch.tensor(0.0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (scripts/gpu-suite.sh)")
@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("moment_dtypes", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)])
def test_cuda_stochastic_rounding_equals_reference(out_dtype, moment_dtypes):
    assert quant_core.selected_backend("adam_step", torch.device("cuda")) == "triton"
    numels = [1, 7, 200_003, 0, 65_536, 131_071]
    expected = (*stepped_states(numels, torch.bfloat16, moment_dtypes), counters_for(numels, start=2**63 - 2))
    outs = [torch.zeros(n, dtype=out_dtype) for n in numels] if out_dtype else None
    on_cuda = tuple([t.cuda() for t in tensors] for tensors in expected)
    outs_cuda = [t.cuda() for t in outs] if outs else None
    for found in (0.0, 1.0, 0.0, 0.0):  # steps, a skip, and steps after it (the tickets were reset)
        kwargs = {"lr": 2e-3, "weight_decay": 0.01, "adam_w_mode": True, "compute_amax": True, "seed": -3, **HYPER}
        with quant_core.use_backend("reference"):
            expected_amax = adam_step_(
                *expected[:5], found_inf=torch.tensor([found]), outs=outs, stochastic_rounding_counters=expected[5],
                **kwargs,
            )  # fmt: skip
        amax = adam_step_(
            *on_cuda[:5], found_inf=torch.tensor([found], device="cuda"), outs=outs_cuda,
            stochastic_rounding_counters=on_cuda[5], **kwargs,
        )  # fmt: skip
        assert_bitwise_equal(tuple([t.cpu() for t in tensors] for tensors in on_cuda), expected)
        if outs:
            assert_bitwise_equal([[t.cpu() for t in outs_cuda]], [outs])
        assert torch.equal(amax.cpu(), expected_amax)
    assert [int(c) for c in expected[5]] == [signed64(2**63 - 2 + 5 * i + 3) for i in range(len(numels))]
