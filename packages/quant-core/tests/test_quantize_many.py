"""quantize_mxfp8_many and quantize_fp8_blockwise_many: every tensor of a mixed list gets the bytes
the single-tensor quantize writes into the same buffers, bit for bit, on every CPU backend (the
Triton kernel: test_triton_quantize_many.py); bad lists raise naming the fix and write nothing."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import pytest
import torch

import quant_core
from quant_core.testing import adversarial, quantize_many_inputs

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FIELDS = ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv")
CPU_BACKENDS = quant_core.available_backends("cpu")


class Config(NamedTuple):
    """One format configuration: its single-tensor quantize and its multi-tensor one."""

    single: Callable[..., quant_core.BlockQuantized]
    many: Callable[[list[torch.Tensor], list[quant_core.BlockQuantized]], None]


def _blockwise(block_shape: tuple[int, int], fp8_dtype: torch.dtype, power_2_scales: bool) -> Config:
    kwargs = dict(block_shape=block_shape, fp8_dtype=fp8_dtype, power_2_scales=power_2_scales)
    return Config(
        lambda x, **usage: quant_core.quantize_fp8_blockwise(x, **kwargs, **usage),
        lambda xs, outs: quant_core.quantize_fp8_blockwise_many(xs, outs, **kwargs),
    )


CONFIGS = {
    "mxfp8": Config(quant_core.quantize_mxfp8, quant_core.quantize_mxfp8_many),
    "blockwise-1x128-pow2-e4m3": _blockwise((1, 128), E4M3, True),
    "blockwise-1x128-e5m2": _blockwise((1, 128), E5M2, False),
    "blockwise-128x128-pow2-e4m3": _blockwise((128, 128), E4M3, True),
    "blockwise-128x128-e5m2": _blockwise((128, 128), E5M2, False),
}


def sentinel_like(q: quant_core.BlockQuantized) -> quant_core.BlockQuantized:
    """Buffers shaped like q's, filled with a byte no correct kernel leaves everywhere."""

    def fill(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        return torch.full((*t.shape, t.element_size()), 0xA5, dtype=torch.uint8).view(t.dtype).reshape(t.shape)

    return quant_core.BlockQuantized(*(fill(getattr(q, f)) for f in FIELDS))


def assert_bitwise(got: quant_core.BlockQuantized, want: quant_core.BlockQuantized, what: str) -> None:
    for field in FIELDS:
        a, b = getattr(got, field), getattr(want, field)
        assert (a is None) == (b is None), (what, field)
        if a is not None:
            assert (a.dtype, a.shape) == (b.dtype, b.shape), (what, field)
            assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), (what, field)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_tensor_gets_the_single_quantize_bytes(backend, config, dtype):
    single, many = CONFIGS[config]
    pairs = quantize_many_inputs(dtype, seed=len(config))
    with quant_core.use_backend(backend):
        wants = [single(x, **usage) for x, usage in pairs]
        outs = [sentinel_like(want) for want in wants]
        many([x for x, _ in pairs], outs)
    for (x, usage), got, want in zip(pairs, outs, wants, strict=True):
        assert_bitwise(got, want, f"{tuple(x.shape)} {usage}")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_every_buffer_written_has_its_version_bumped(backend):
    # quant-fsdp and FusedAdam cache by version: a write the counter misses would be read stale.
    pairs = quantize_many_inputs()
    xs = [x for x, _ in pairs]
    outs = [quant_core.quantize_mxfp8(x, **usage) for x, usage in pairs]
    before = [[None if getattr(q, f) is None else getattr(q, f)._version for f in FIELDS] for q in outs]
    inputs_before = [x._version for x in xs]
    with quant_core.use_backend(backend):
        quant_core.quantize_mxfp8_many(xs, outs)
    for q, versions in zip(outs, before, strict=True):
        for field, version in zip(FIELDS, versions, strict=True):
            if version is not None:
                assert getattr(q, field)._version > version, field
    assert [x._version for x in xs] == inputs_before


def test_an_empty_list_is_a_no_op():
    assert quant_core.quantize_mxfp8_many([], []) is None
    assert quant_core.quantize_fp8_blockwise_many((), (), (128, 128)) is None


def _outs(shapes: list[tuple[int, ...]]) -> tuple[list[torch.Tensor], list[quant_core.BlockQuantized]]:
    xs = [adversarial(shape, seed=i) for i, shape in enumerate(shapes)]
    return xs, [sentinel_like(quant_core.quantize_mxfp8(x, columnwise=True)) for x in xs]


@pytest.mark.parametrize(
    ("mutate", "error", "message"),
    [
        (lambda xs, outs: (xs, outs[:2]), ValueError, r"got 3 tensors but 2 outs; pass one out \(BlockQuantized\) per"),
        (lambda xs, outs: (xs[0], outs[0]), TypeError, "takes a sequence of tensors .* wrap a single pair in lists"),
        (
            lambda xs, outs: (xs, [*outs[:2], quant_core.quantize_mxfp8(torch.ones(4, 33))]),
            ValueError,
            r"outs\[2\]\.rowwise_data must be a torch\.float8_e4m3fn tensor of shape \(3, 33\) on cpu, got .* \(4, 33\)",
        ),
        (
            lambda xs, outs: (xs, [*outs[:2], outs[2].rowwise_data]),
            TypeError,
            r"outs\[2\] must be a BlockQuantized \(a previous quantize's result\), got Tensor",
        ),
        (
            lambda xs, outs: (xs, [*outs[:2], quant_core.BlockQuantized(outs[2].rowwise_data, None, None, None)]),
            ValueError,
            r"outs\[2\] holds rowwise_data or rowwise_scale_inv but not both; .* pass both buffers, or neither",
        ),
        (
            lambda xs, outs: (xs, [*outs[:2], quant_core.BlockQuantized(None, None, None, None)]),
            ValueError,
            r"outs\[2\] holds no usage",
        ),
        (
            lambda xs, outs: ([*xs[:2], xs[2].to(torch.int32)], outs),
            TypeError,
            r"xs\[2\] has dtype torch\.int32; quantization reads float32, bfloat16 or float16",
        ),
        (lambda xs, outs: ([*xs[:2], torch.tensor(1.0)], outs), ValueError, r"xs\[2\] is 0-d; MXFP8 needs a last dim"),
        (
            lambda xs, outs: ([*xs[:2], xs[2].to("meta")], outs),
            ValueError,
            r"xs\[2\] is on meta but xs\[0\] is on cpu; quantize_mxfp8_many quantizes on one device per call: call "
            "it once per device",
        ),
    ],
    ids=[
        "lengths",
        "not-lists",
        "wrong-shape",
        "not-block-quantized",
        "data-without-scales",
        "no-usage",
        "int",
        "0-d",
        "devices",
    ],
)
def test_bad_lists_raise_naming_the_fix_and_write_nothing(mutate, error, message):
    xs, outs = _outs([(40, 64), (1, 33), (3, 33)])
    before = [getattr(q, f).clone() for q in outs for f in FIELDS]
    bad_xs, bad_outs = mutate(xs, outs)
    with pytest.raises(error, match=message):
        quant_core.quantize_mxfp8_many(bad_xs, bad_outs)
    # Every pair is checked before any kernel runs: the valid ones are untouched too.
    after = [getattr(q, f) for q in outs for f in FIELDS]
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(before, after, strict=True))


def test_blockwise_refuses_a_buffer_of_the_other_fp8_dtype_and_bad_formats():
    x = adversarial((4, 128))
    out = quant_core.quantize_fp8_blockwise(x, fp8_dtype=E4M3)
    with pytest.raises(ValueError, match=r"outs\[0\]\.rowwise_data must be a torch\.float8_e5m2 tensor"):
        quant_core.quantize_fp8_blockwise_many([x], [out], fp8_dtype=E5M2)
    with pytest.raises(ValueError, match="block_shape must be one of"):
        quant_core.quantize_fp8_blockwise_many([x], [out], (1, 32))
    with pytest.raises(ValueError, match="fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2"):
        quant_core.quantize_fp8_blockwise_many([x], [out], fp8_dtype=torch.float16)
