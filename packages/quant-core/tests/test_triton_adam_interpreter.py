"""The Triton Adam kernel ([Note: Adam numerics], [Note: capturable Adam step]) in Triton's CPU interpreter.

Checks on every machine what the interpreter can: the per-tensor step counts and their ticket
counters (across two calls), the skip, lr as a tensor, the float64 scalars, fp16 parameters and
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

from quant_core.testing import run_in_triton_interpreter

pytest.importorskip("triton")

_SCRIPT = """
import torch

import quant_core
from quant_core.adam import _triton
from quant_core.adam._capturable import AdamStepCapturableArgs
from quant_core.testing import raw_bits

generator = torch.Generator().manual_seed(0)
numels = [1, 7, 40_000, 0, 16_384]


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
]
for param_dtype, out_dtype, found, lr, weight_decay, adam_w_mode in cases:
    ours = states(param_dtype)
    expected = tuple([t.clone() for t in tensors] for tensors in ours)
    outs = [torch.zeros(n, dtype=out_dtype) for n in numels] if out_dtype else []
    expected_outs = [t.clone() for t in outs]
    lr_tensor = lr if isinstance(lr, torch.Tensor) else None
    hyperparameters = [0.0 if lr_tensor is not None else lr, 0.9, 0.999, 1e-8, weight_decay]
    for _ in range(2):  # the second call needs the tickets reset by the first
        args = (torch.tensor([found]), lr_tensor, hyperparameters, adam_w_mode)
        amax = _triton._adam_step_capturable(AdamStepCapturableArgs(*ours, outs, *args, True))
        expected_amax = quant_core.adam_step_capturable_reference(*expected, expected_outs, *args)
        for got, want in zip((*ours, outs), (*expected, expected_outs), strict=True):
            for a, b in zip(got, want, strict=True):
                assert torch.equal(raw_bits(a.reshape(-1)), raw_bits(b.reshape(-1))), (param_dtype, out_dtype, found, lr)
        assert torch.equal(amax, expected_amax), (amax, expected_amax)
    assert [float(s) for s in ours[4]] == [7.0 * i + (found == 0.0) * 2 for i in range(len(numels))]

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
        amax = _triton._adam_step_capturable(AdamStepCapturableArgs(*ours, outs, *args, True, seed, counters))
        expected_amax = quant_core.adam_step_capturable_reference(*expected, expected_outs, *args, True, seed,
                                                                  expected_counters)  # fmt: skip
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


def test_adam_kernels_equal_reference_in_the_interpreter():
    run_in_triton_interpreter(_SCRIPT)
