"""amax_many: entry t is `amax` of tensor t, bit for bit, on every CPU backend (the Triton kernel is
in test_triton_amax_many.py)."""

from __future__ import annotations

import pytest
import torch

import quant_core
from quant_core.testing import FLOAT_DTYPES, adversarial

CPU_BACKENDS = [b for b in quant_core.available_backends("cpu") if b != "reference"]
NAN, INF = float("nan"), float("inf")


def bits(t: torch.Tensor) -> list[int]:
    return t.view(torch.int32).tolist()


def special_tensors() -> list[torch.Tensor]:
    """Tensors whose amax is an edge case: zeros, subnormal maxima, all non-finite, the fp32 max."""
    specials = [
        torch.zeros(5),
        torch.tensor([-0.0, 0.0, -0.0]),
        torch.tensor([1e-45, -1e-44, NAN]),
        torch.tensor([NAN, -NAN, INF, -INF]),
        torch.tensor([-3.4028234663852886e38, INF, 1.0]),
        torch.tensor(-7.0),
    ]
    low_precision = [
        torch.tensor([9.2e-41, -NAN, 0.0], dtype=torch.bfloat16),  # bf16 subnormal max
        torch.tensor([-6e-8, INF, 0.0], dtype=torch.float16),  # fp16 subnormal max
        torch.tensor([65504.0, -INF], dtype=torch.float16),
        torch.tensor([NAN, INF], dtype=torch.bfloat16),
    ]
    return specials + low_precision


def mixed_tensors() -> list[torch.Tensor]:
    """Every dtype, shapes with empty and 0-d ones, non-contiguous views, and the specials."""
    tensors = []
    for d, dtype in enumerate(FLOAT_DTYPES):
        for s, shape in enumerate([(1,), (7,), (33, 65), (3, 5, 129), (0,), (0, 4), (4, 0), ()]):
            tensors.append(adversarial(shape, dtype, seed=10 * d + s))
        base = adversarial((96, 160), dtype, seed=d)
        tensors += [base.t(), base[::3, 5::2], base.reshape(8, 12, 160).transpose(0, 1), base.expand(2, 96, 160)]
    tensors.append(adversarial((300_001,), torch.float32, seed=7))  # split across threads
    return tensors + special_tensors()


def test_reference_known_answers():
    tensors = [torch.tensor([1.0, -3.0, NAN, -INF]), torch.empty(0, 5), torch.tensor([NAN]), torch.tensor([-2.5])]
    got = quant_core.amax_many_reference([*tensors, torch.tensor([-0.5, 4.0], dtype=torch.bfloat16)])
    assert got.dtype == torch.float32
    assert got.tolist() == [3.0, 0.0, 0.0, 2.5, 4.0]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_kernel_equals_reference_and_amax_of_each(backend):
    tensors = mixed_tensors()
    with quant_core.use_backend(backend):
        got = quant_core.amax_many(tensors)
        each = torch.stack([quant_core.amax(t) for t in tensors])
    assert (got.dtype, got.shape) == (torch.float32, (len(tensors),))
    assert bits(got) == bits(quant_core.amax_many_reference(tensors))
    assert bits(got) == bits(each)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_many_tensors_each_keep_their_own_amax(backend):
    # Tensor t holds t + 1 and smaller values: an amax written to another index, or merged across
    # tensors, shows. Some are empty (amax 0).
    generator = torch.Generator().manual_seed(0)
    tensors, expected = [], []
    for t, n in enumerate(torch.randint(0, 700, (300,), generator=generator).tolist()):
        x = torch.rand(n, generator=generator) * (t + 1)
        x[n // 2 :] *= -1
        if n:
            x[torch.randint(0, n, (), generator=generator)] = -(t + 1.0)
        x = x.to(FLOAT_DTYPES[t % 3])
        tensors.append(x)
        expected.append(torch.tensor(t + 1.0).to(x.dtype).item() if n else 0.0)
    with quant_core.use_backend(backend):
        got = quant_core.amax_many(tensors)
    assert got.tolist() == expected
    assert bits(got) == bits(quant_core.amax_many_reference(tensors))


def test_operator_has_one_entry_per_tensor_when_all_are_empty():
    assert torch.ops.quant_core.amax_many([torch.empty(0), torch.empty(3, 0, dtype=torch.float16)]).tolist() == [0, 0]


def test_empty_list_raises_with_fix():
    with pytest.raises(ValueError, match=r"at least one tensor.*skip the call"):
        quant_core.amax_many([])


def test_one_tensor_instead_of_a_list_raises():
    with pytest.raises(TypeError, match=r"amax_many\(\[x\]\)"):
        quant_core.amax_many(torch.ones(3))


def test_unsupported_dtype_raises_naming_the_tensor():
    with pytest.raises(TypeError, match=r"tensors\[1\] has dtype torch\.int32.*tensors\[1\]\.float\(\)"):
        quant_core.amax_many([torch.ones(3), torch.ones(3, dtype=torch.int32)])
