"""fp8 moments in the Adam pass ([Note: fp8 moments in the Adam pass]): `adam_moment_amaxes` and
the Adam operators taking fp8 moments equal, bit for bit on every backend, the composition they
replace: each moment dequantized into fp32 values, the Adam step on those, `amax_many` of the
updated values, `fp8_scale` of the amaxes, `cast_to_fp8` with the scales."""

from __future__ import annotations

import pytest
import torch

import quant_core
from quant_core import AdamScalars, adam_moment_amaxes, adam_step_
from quant_core.testing import kernel_backends, raw_bits

E4M3, E5M2, BF16, FP32 = torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16, torch.float32
# Hyperparameters and the step count each step is taken at.
CONFIGS = {
    "adamw": ({"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01, "adam_w_mode": True}, 3),
    "adam-l2": ({"lr": 2e-2, "beta1": 0.8, "beta2": 0.99, "eps": 1e-6, "weight_decay": 0.1, "adam_w_mode": False}, 1),
}
SCALARS = {mode: AdamScalars.of(**hyper, step=step) for mode, (hyper, step) in CONFIGS.items()}
MOMENTS = [(E4M3, E5M2), (E4M3, BF16), (FP32, E4M3), (E5M2, FP32), (E5M2, E5M2)]
NUMELS = [1, 7, 200_003, 0, 65_536]
BACKENDS = ["reference", *kernel_backends()]


def fp8_state(values: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scale_inv) of values as a step stores them; the codes of the first elements replaced
    by adversarial ones (NaN, the largest code, -0, subnormal codes; E5M2 Inf)."""
    scale, scale_inv = quant_core.fp8_scale(quant_core.amax(values) if values.numel() else torch.zeros(()), dtype)
    codes = torch.empty(values.shape, dtype=dtype)
    if values.numel():
        quant_core.cast_to_fp8(values, scale, dtype, rowwise_out=codes)
        special = [0x7F, 0x7E, 0x80, 0x01, 0x83] if dtype == E4M3 else [0x7C, 0x7B, 0x80, 0x01, 0xFE]
        codes.view(torch.uint8)[1 : 1 + len(special)] = torch.tensor(special, dtype=torch.uint8)[: values.numel() - 1]
    return codes, scale_inv


def make_states(moments: tuple[torch.dtype, torch.dtype], grad_dtype: torch.dtype, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    params = [torch.randn(n, generator=generator) for n in NUMELS]
    grads = [(torch.randn(n, generator=generator) * 1e-2).to(grad_dtype) for n in NUMELS]
    lists, scale_invs = [], []
    for which, dtype in enumerate(moments):
        values = [torch.randn(n, generator=generator) * 1e-3 for n in NUMELS]
        values = [v.square() for v in values] if which else values
        if dtype in (E4M3, E5M2):
            states = [fp8_state(v, dtype) for v in values]
            lists.append([codes for codes, _ in states])
            scale_invs += [scale_inv for _, scale_inv in states]
        else:
            lists.append([v.to(dtype) for v in values])
    return params, grads, *lists, scale_invs


def clone(tensors):
    return [t.clone() for t in tensors]


def adam(params, grads, exp_avgs, exp_avg_sqs, mode, **kwargs):
    """adam_step_ with the hyperparameters of CONFIGS[mode] at its step count."""
    hyper, step = CONFIGS[mode]
    steps = [torch.tensor(step - 1.0) for _ in params]
    return adam_step_(params, grads, exp_avgs, exp_avg_sqs, steps, **hyper, **kwargs)


def decoded_step(params, grads, exp_avgs, exp_avg_sqs, scale_invs, mode):
    """The composition the fp8 moments' operators replace, in references: returns the master
    amaxes and the moments' amaxes; updates params, codes and scale_invs in place."""
    rows = [m for m in (exp_avgs, exp_avg_sqs) if m[0].dtype in (E4M3, E5M2)]
    count = len(params)
    values = {}
    for row, moments in enumerate(rows):
        values[id(moments)] = [
            quant_core.dequantize_fp8_reference(codes, scale_invs[row * count + i]) for i, codes in enumerate(moments)
        ]
    fp32 = [values.get(id(m), m) for m in (exp_avgs, exp_avg_sqs)]
    with quant_core.use_backend("reference"):
        master_amaxes = adam(params, grads, *fp32, mode, compute_amax=True)
    moment_amaxes = []
    for row, moments in enumerate(rows):
        updated = values[id(moments)]
        amaxes = quant_core.amax_many_reference(updated)
        scales, new_scale_invs = quant_core.fp8_scale_reference(amaxes, moments[0].dtype)
        for i, (codes, value) in enumerate(zip(moments, updated, strict=True)):
            encoded, _ = quant_core.cast_to_fp8_reference(value, scales[i], codes.dtype)
            codes.view(torch.uint8).copy_(encoded.view(torch.uint8))
            scale_invs[row * count + i].copy_(new_scale_invs[i])
        moment_amaxes.append(amaxes)
    return master_amaxes, torch.stack(moment_amaxes)


def assert_bitwise_equal(a, b):
    """Tensors, or lists of tensors, equal bit for bit."""
    for x, y in zip(a, b, strict=True):
        if isinstance(x, list):
            assert_bitwise_equal(x, y)
        else:
            assert torch.equal(raw_bits(x.reshape(-1)), raw_bits(y.reshape(-1)))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", sorted(SCALARS))
@pytest.mark.parametrize("grad_dtype", [FP32, BF16])
@pytest.mark.parametrize("moments", MOMENTS, ids=str)
def test_two_passes_equal_the_decoded_fp32_step(backend, mode, grad_dtype, moments):
    scalars = SCALARS[mode]
    params, grads, exp_avgs, exp_avg_sqs, scale_invs = make_states(moments, grad_dtype, seed=len(mode))
    expected = [clone(params), grads, clone(exp_avgs), clone(exp_avg_sqs), clone(scale_invs)]
    expected_master_amaxes, expected_moment_amaxes = decoded_step(*expected, mode)
    before = [clone(exp_avgs), clone(exp_avg_sqs), clone(scale_invs)]
    with quant_core.use_backend(backend):
        moment_amaxes = adam_moment_amaxes(params, grads, exp_avgs, exp_avg_sqs, scale_invs, scalars)
        assert_bitwise_equal(before, [exp_avgs, exp_avg_sqs, scale_invs])  # the pre-pass writes nothing
        assert torch.equal(raw_bits(moment_amaxes), raw_bits(expected_moment_amaxes))
        master_amaxes = adam(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            mode,
            compute_amax=True,
            moment_scale_invs=scale_invs,
            moment_amaxes=moment_amaxes,
        )
    assert torch.equal(master_amaxes, expected_master_amaxes)
    for got, want in zip((params, exp_avgs, exp_avg_sqs, scale_invs), expected[:1] + expected[2:], strict=True):
        assert_bitwise_equal(got, want)
    changed = [not torch.equal(a, b) for a, b in zip(before[2], scale_invs, strict=True)]
    assert any(changed)  # the step set new scale_invs


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_pre_pass_reads_params_for_l2_weight_decay_only(backend):
    # With Adam's L2 decay the moments see g + p * wd, so the amaxes move with p; with AdamW they do not.
    params, grads, exp_avgs, exp_avg_sqs, scale_invs = make_states((E4M3, E5M2), FP32)
    doubled = [p * 2.0 for p in params]
    with quant_core.use_backend(backend):
        for mode, moves in (("adam-l2", True), ("adamw", False)):
            a = adam_moment_amaxes(params, grads, exp_avgs, exp_avg_sqs, scale_invs, SCALARS[mode])
            b = adam_moment_amaxes(doubled, grads, exp_avgs, exp_avg_sqs, scale_invs, SCALARS[mode])
            assert (not torch.equal(a, b)) == moves, mode


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_step_with_fp8_moments_equals_reference_and_a_skip_writes_none_of_them(backend, adam_w_mode):
    # Each backend equals the reference with a verdict to read; with found_inf set nothing changes,
    # scale_invs included.
    moments = (E4M3, E5M2)
    params, grads, exp_avgs, exp_avg_sqs, scale_invs = make_states(moments, FP32, seed=3)
    hyper = {"beta1": 0.9, "beta2": 0.999, "weight_decay": 0.1, "adam_w_mode": adam_w_mode}
    scalars = AdamScalars.of(lr=1e-3, eps=1e-8, step=5, **hyper)
    amaxes = adam_moment_amaxes(params, grads, exp_avgs, exp_avg_sqs, scale_invs, AdamScalars.for_moments(**hyper))
    assert torch.equal(amaxes, adam_moment_amaxes(params, grads, exp_avgs, exp_avg_sqs, scale_invs, scalars))
    expected = [clone(params), grads, clone(exp_avgs), clone(exp_avg_sqs), [torch.tensor(4.0) for _ in params]]
    expected_scale_invs = clone(scale_invs)
    with quant_core.use_backend("reference"):
        adam_step_(*expected, lr=1e-3, eps=1e-8, moment_scale_invs=expected_scale_invs, moment_amaxes=amaxes, **hyper)
    steps = [torch.tensor(4.0) for _ in params]
    for found, want in ((1.0, (clone(params), clone(exp_avgs), clone(exp_avg_sqs), clone(scale_invs))), (0.0, None)):
        with quant_core.use_backend(backend):
            adam_step_(
                params,
                grads,
                exp_avgs,
                exp_avg_sqs,
                steps,
                lr=1e-3,
                eps=1e-8,
                found_inf=torch.tensor([found]),
                moment_scale_invs=scale_invs,
                moment_amaxes=amaxes,
                **hyper,
            )
        if want is not None:
            for got, kept in zip((params, exp_avgs, exp_avg_sqs, scale_invs), want, strict=True):
                assert_bitwise_equal(got, kept)
    for got, want in zip(
        (params, exp_avgs, exp_avg_sqs, scale_invs), (expected[0], *expected[2:4], expected_scale_invs), strict=True
    ):
        assert_bitwise_equal(got, want)


def test_fp8_moments_refuse_missing_scales():
    params, grads, exp_avgs, exp_avg_sqs, scale_invs = make_states((E4M3, FP32), FP32)
    scalars = SCALARS["adamw"]
    with pytest.raises(ValueError, match="moment_scale_invs"):
        adam(params, grads, exp_avgs, exp_avg_sqs, "adamw")
    with pytest.raises(ValueError, match=r"moment_amaxes: a contiguous float32 \(1, 5\)"):
        adam(params, grads, exp_avgs, exp_avg_sqs, "adamw", moment_scale_invs=scale_invs)
    with pytest.raises(ValueError, match="neither exp_avgs nor exp_avg_sqs is fp8"):
        adam_moment_amaxes(params, grads, exp_avg_sqs, exp_avg_sqs, [], scalars)
    with pytest.raises(ValueError, match="adam_moment_amaxes needs one grad and two moments per parameter"):
        adam_moment_amaxes(params, grads[:-1], exp_avgs, exp_avg_sqs, scale_invs, scalars)
    with pytest.raises(TypeError, match=r"grads\[0\] has dtype torch.int64"):
        adam_moment_amaxes(params, [g.long() for g in grads], exp_avgs, exp_avg_sqs, scale_invs, scalars)
    strided = [m if i != 2 else m.new_zeros(2 * m.numel())[::2] for i, m in enumerate(exp_avg_sqs)]
    with pytest.raises(ValueError, match=r"exp_avg_sqs\[2\] must be contiguous"):
        adam_moment_amaxes(params, grads, exp_avgs, strided, scale_invs, scalars)
    with pytest.raises(ValueError, match="these moments are not fp8"):
        adam(params, grads, exp_avg_sqs, exp_avg_sqs, "adamw", moment_scale_invs=scale_invs)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (scripts/gpu-suite.sh)")
@pytest.mark.parametrize("mode", sorted(SCALARS))
@pytest.mark.parametrize("moments", MOMENTS, ids=str)
@pytest.mark.parametrize("found", [0.0, 1.0])
def test_cuda_fp8_moment_kernels_equal_reference(mode, moments, found):
    # The Triton pre-pass and step on the GPU against the references on the CPU.
    scalars = SCALARS[mode]
    hyper = {"beta1": 0.9 if mode == "adamw" else 0.8, "beta2": 0.999 if mode == "adamw" else 0.99}
    hyper |= {"weight_decay": 0.01 if mode == "adamw" else 0.1, "adam_w_mode": mode == "adamw"}
    lr, eps = (1e-3, 1e-8) if mode == "adamw" else (2e-2, 1e-6)
    cpu = make_states(moments, FP32, seed=7)
    cuda = [[t.cuda() for t in tensors] for tensors in cpu]
    amaxes = adam_moment_amaxes(*cuda, scalars)
    with quant_core.use_backend("reference"):
        expected_amaxes = adam_moment_amaxes(*cpu, scalars)
    assert torch.equal(raw_bits(amaxes.cpu()), raw_bits(expected_amaxes))
    found_inf = torch.tensor([found])
    steps = [torch.tensor(2.0) for _ in NUMELS]
    args = {"lr": lr, "eps": eps, "compute_amax": True, **hyper}
    params, grads, exp_avgs, exp_avg_sqs, scale_invs = cuda
    got = adam_step_(
        params, grads, exp_avgs, exp_avg_sqs, [s.cuda() for s in steps], found_inf=found_inf.cuda(),
        moment_scale_invs=scale_invs, moment_amaxes=amaxes, **args,
    )  # fmt: skip
    params_c, grads_c, exp_avgs_c, exp_avg_sqs_c, scale_invs_c = cpu
    with quant_core.use_backend("reference"):
        want = adam_step_(
            params_c, grads_c, exp_avgs_c, exp_avg_sqs_c, steps, found_inf=found_inf,
            moment_scale_invs=scale_invs_c, moment_amaxes=expected_amaxes, **args,
        )  # fmt: skip
    assert torch.equal(got.cpu(), want)
    for a, b in zip((exp_avgs, exp_avg_sqs, scale_invs), (exp_avgs_c, exp_avg_sqs_c, scale_invs_c), strict=True):
        assert_bitwise_equal([t.cpu() for t in a], b)
    # The NaN codes make NaN masters, whose payload the processors choose (x86 0x7FC00000, NVIDIA
    # 0x7FFFFFFF): the same elements are NaN, every other bit is equal.
    for p, p_c in zip(params, params_c, strict=True):
        p, nan = p.cpu(), p_c.isnan()
        assert torch.equal(p.isnan(), nan)
        assert torch.equal(raw_bits(p[~nan]), raw_bits(p_c[~nan]))
    assert any(p.isnan().any() for p in params_c) == (found == 0.0)
