"""The Triton Adam kernel ([Note: Adam numerics], [Note: Adam step in tensors]) in Triton's CPU interpreter.

Checks on every machine what the interpreter can: the per-tensor step counts and their ticket
counters (across two calls), the skip and its absence (no found_inf), lr as a tensor, the float64 scalars, fp16 parameters and
outs, sizes across chunk edges and an empty tensor, against the reference bit for bit. The
interpreter truncates fp32 -> bf16 (Triton 3.9's `_convert_float` without a rounding mode) and
has no libdevice, so bf16 outputs rounded to nearest and the GPU's float64 division and sqrt are
checked by the `cuda` tests (test_adam.py). Stochastic rounding of bf16 masters ([Note: Adam
stochastic rounding]) is integer arithmetic on the bits, which the interpreter runs exactly: its
rounding rule on the hand-worked edges and random bit patterns, and whole steps (counters, the
skip, outs and amaxes, non-finite values) are checked here bit for bit.
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

_SCRIPT = """
import torch

import quant_core
from quant_core.adam import _triton
from quant_core.adam._adam import AdamStepArgs
from quant_core.shared import _triton_tables
from quant_core.testing import raw_bits

# Chunks of 512 elements in steps of 128 (the kernels' constexprs; 16384 and 1024 on the GPU): the
# sizes below cross chunk edges as 40,000 and 16,384 elements cross those of the GPU's launches,
# at a 32nd of the interpreter's time.
_triton_tables.CHUNK = _triton.CHUNK = 512
_triton.CHUNK_BLOCK = 128

generator = torch.Generator().manual_seed(0)
numels = [1, 7, 1_250, 0, 512]


def states(param_dtype):
    return (
        [torch.randn(n, generator=generator).to(param_dtype) for n in numels],
        [torch.randn(n, generator=generator) * 1e-2 for n in numels],
        [torch.randn(n, generator=generator) * 1e-3 for n in numels],
        [(torch.randn(n, generator=generator) * 1e-3).square() for n in numels],
        [torch.tensor(float(7 * i)) for i in range(len(numels))],
    )


cases = [
    # param dtype, out dtype, found_inf, lr, weight_decay, adam_w_mode
    (torch.float32, None, 0.0, 1e-3, 0.01, True),
    (torch.float32, None, 0.0, torch.tensor(3e-3, dtype=torch.float64), 0.1, False),
    (torch.float32, None, 1.0, 1e-3, 0.01, True),
    (torch.float32, torch.float16, 0.0, torch.tensor(2e-3), 0.0, True),
    (torch.float16, None, 0.0, 1e-2, 0.01, True),
    (torch.float16, torch.float32, None, 1e-2, 0.1, False),
]
for param_dtype, out_dtype, found, lr, weight_decay, adam_w_mode in cases:
    ours = states(param_dtype)
    expected = tuple([t.clone() for t in tensors] for tensors in ours)
    outs = [torch.zeros(n, dtype=out_dtype) for n in numels] if out_dtype else []
    expected_outs = [t.clone() for t in outs]
    lr_tensor = lr if isinstance(lr, torch.Tensor) else None
    hyperparameters = [0.0 if lr_tensor is not None else lr, 0.9, 0.999, 1e-8, weight_decay]
    for _ in range(2):  # the second call needs the tickets reset by the first
        args = (None if found is None else torch.tensor([found]), lr_tensor, hyperparameters, adam_w_mode, True)
        amax = _triton._adam_step(AdamStepArgs(*ours, outs, *args))
        expected_amax = quant_core.adam_step_reference(*expected, expected_outs, *args)
        for got, want in zip((*ours, outs), (*expected, expected_outs), strict=True):
            for a, b in zip(got, want, strict=True):
                assert torch.equal(raw_bits(a.reshape(-1)), raw_bits(b.reshape(-1))), (param_dtype, out_dtype, found, lr)
        assert torch.equal(amax, expected_amax), (amax, expected_amax)
    assert [float(s) for s in ours[4]] == [7.0 * i + (not found) * 2 for i in range(len(numels))]

# Stochastic rounding: bf16 masters (fp32 moments: bf16 ones would be truncated), outs of the
# rounded values, non-finite updates, seeds of either int width, counters read and advanced by the
# ticket's last program, none on a skip.
for seed, found, out_dtype in [(0, 0.0, None), (2**63 - 5, 0.0, torch.float32), (-3, 1.0, torch.bfloat16)]:
    ours = states(torch.bfloat16)
    ours[0][2][:3] = torch.tensor([float("nan"), float("inf"), 3e38])
    counters = [torch.tensor(11 * i - (i == 2) * 2**62) for i in range(len(numels))]
    expected, expected_counters = tuple([t.clone() for t in tensors] for tensors in ours), [c.clone() for c in counters]
    outs = [torch.zeros(n, dtype=out_dtype) for n in numels] if out_dtype else []
    expected_outs = [t.clone() for t in outs]
    args = (torch.tensor([found]), None, [1e-2, 0.9, 0.999, 1e-8, 0.01], True)
    for _ in range(2):
        amax = _triton._adam_step(AdamStepArgs(*ours, outs, *args, True, seed, counters))
        expected_amax = quant_core.adam_step_reference(*expected, expected_outs, *args, True, seed, expected_counters)
        for got, want in zip((*ours, outs, counters), (*expected, expected_outs, expected_counters), strict=True):
            for a, b in zip(got, want, strict=True):
                assert torch.equal(raw_bits(a.reshape(-1)), raw_bits(b.reshape(-1))), (seed, found, out_dtype)
        assert torch.equal(amax, expected_amax), (amax, expected_amax)
    assert [int(c) for c in counters] == [11 * i - (i == 2) * 2**62 + (found == 0.0) * 2 for i in range(len(numels))]

# The rounding rule itself, in a kernel of its own.
import triton
import triton.language as tl

from quant_core.shared import _numerics
from quant_core.shared._triton_numerics import round_to_bfloat16_stochastic
from quant_core.testing import BF16_STOCHASTIC_CASES, float32_from_bits


@triton.jit
def _round(v_ptr, r_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    v = tl.load(v_ptr + offsets, mask=mask)
    r = tl.load(r_ptr + offsets, mask=mask).to(tl.uint32)
    tl.store(out_ptr + offsets, round_to_bfloat16_stochastic(v, r), mask=mask)


bits, draws, _ = (torch.tensor(column, dtype=torch.int64) for column in zip(*BF16_STOCHASTIC_CASES, strict=True))
bits = torch.cat([bits, torch.randint(0, 2**32, (5000,), generator=generator, dtype=torch.int64)])
draws = torch.cat([draws, torch.randint(0, 2**16, (5000,), generator=generator, dtype=torch.int64)])
v = float32_from_bits(bits)
out = torch.empty(len(v), dtype=torch.bfloat16)
_round[(triton.cdiv(len(v), 1024),)](v, draws.to(torch.int32), out, len(v), BLOCK=1024)
assert torch.equal(raw_bits(out), raw_bits(_numerics.round_to_bfloat16_stochastic(v, draws)))
"""


@pytest.mark.triton_interpreter(_SCRIPT)
def test_adam_kernels_equal_reference_in_the_interpreter(triton_interpreter):
    triton_interpreter.check()


# fp8 moments ([Note: fp8 moments in the Adam pass]): the amaxes pass and the step with
# codes and scale_invs, against the references bit for bit (the interpreter encodes and decodes FP8
# on the bits, [Note: Triton FP8 casts]); bf16 moments stay out (the interpreter truncates them).
_FP8_SCRIPT = """
import torch

import quant_core
from quant_core import AdamScalars
from quant_core.adam import _triton
from quant_core.adam._adam import AdamStepArgs
from quant_core.adam._moment_amaxes import AdamMomentAmaxesArgs
from quant_core.shared import _triton_tables
from quant_core.testing import raw_bits

# Chunks of 512 elements in steps of 128 (the kernels' constexprs; 16384 and 1024 on the GPU): the
# sizes below cross chunk edges as 40,000 and 16,384 elements cross those of the GPU's launches,
# at a 32nd of the interpreter's time.
_triton_tables.CHUNK = _triton.CHUNK = 512
_triton.CHUNK_BLOCK = 128

generator = torch.Generator().manual_seed(1)
numels = [1, 7, 1_250, 0, 512]
E4M3, E5M2, FP32 = torch.float8_e4m3fn, torch.float8_e5m2, torch.float32


def moment(dtype, square):
    values = [torch.randn(n, generator=generator) * 1e-3 for n in numels]
    values = [v.square() for v in values] if square else values
    if dtype == FP32:
        return values, []
    states = []
    for v in values:
        scale, scale_inv = quant_core.fp8_scale_reference(quant_core.amax_reference(v), dtype)
        codes = quant_core.cast_to_fp8_reference(v, scale, dtype)[0]
        codes.view(torch.uint8)[1:3] = torch.tensor([0x7F, 0x80], dtype=torch.uint8)[: max(v.numel() - 1, 0)]
        states.append((codes, scale_inv))
    return [c for c, _ in states], [s for _, s in states]


def same(a, b):
    return all(torch.equal(raw_bits(x.reshape(-1)), raw_bits(y.reshape(-1))) for x, y in zip(a, b, strict=True))


for moments, found, adam_w_mode in [((E4M3, E5M2), 0.0, True), ((FP32, E4M3), 0.0, False),
                                    ((E5M2, FP32), 1.0, False), ((E4M3, E5M2), 1.0, True)]:
    params = [torch.randn(n, generator=generator) for n in numels]
    grads = [torch.randn(n, generator=generator) * 1e-2 for n in numels]
    exp_avgs, m_scale_invs = moment(moments[0], False)
    exp_avg_sqs, v_scale_invs = moment(moments[1], True)
    scale_invs = m_scale_invs + v_scale_invs
    hyper = {"beta1": 0.9, "beta2": 0.999, "weight_decay": 0.1, "adam_w_mode": adam_w_mode}
    scalars = AdamScalars.for_moments(**hyper)
    lists = (params, grads, exp_avgs, exp_avg_sqs)
    amaxes = _triton._adam_moment_amaxes(AdamMomentAmaxesArgs(*lists, scale_invs, []), scalars)
    expected_amaxes = quant_core.adam_moment_amaxes_reference(*lists, scale_invs, scalars)
    assert torch.equal(raw_bits(amaxes), raw_bits(expected_amaxes)), (moments, amaxes, expected_amaxes)
    ours = [[t.clone() for t in tensors] for tensors in (*lists, [torch.tensor(3.0) for _ in numels], scale_invs)]
    expected = [[t.clone() for t in tensors] for tensors in ours]
    args = (torch.tensor([found]), None, [1e-3, 0.9, 0.999, 1e-8, 0.1], adam_w_mode, True, 0, None)
    for _ in range(2):  # the second call needs the tickets reset by the first
        amax = _triton._adam_step(AdamStepArgs(*ours[:5], [], *args, ours[5], amaxes))
        expected_amax = quant_core.adam_step_reference(*expected[:5], [], *args, expected[5], amaxes)
        assert torch.equal(amax, expected_amax), (moments, found)
        assert all(same(a, b) for a, b in zip(ours, expected, strict=True)), (moments, found)
    assert same(ours[5], scale_invs) == (found != 0.0), (moments, found)  # a skip keeps the scale_invs
"""


@pytest.mark.triton_interpreter(_FP8_SCRIPT)
def test_fp8_moment_kernels_equal_reference_in_the_interpreter(triton_interpreter):
    triton_interpreter.check()
