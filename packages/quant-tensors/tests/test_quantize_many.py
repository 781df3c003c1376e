"""Quantizer.quantize_many_: every format requantizes many (source, out) pairs as a loop of
quantize_ would, bit for bit (buffers, per-tensor amaxes and stateful quantizers' state); MXFP8 and
blockwise FP8 in one quant-core call; bad pairs raise naming the pair and the fix, writing nothing."""

from __future__ import annotations

import copy

import pytest
import torch

import quant_core
import quant_tensors as qt
from quant_core.testing import adversarial

RECIPES = ("fp8", "fp8-delayed", "mxfp8", "fp8-block", "nvfp4")
CASES = [(name, role) for name in RECIPES for role in qt.ROLES]
# Shapes with partial blocks of every format, one row, 3-D; a transposed (non-contiguous) source.
SHAPES = [(256, 384), (130, 96), (2, 64), (4, 6, 160)]


def sources(seed: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    xs = [adversarial(shape, dtype, seed=seed + i) for i, shape in enumerate(SHAPES)]
    return [*xs, adversarial((96, 130), dtype, seed=seed + len(SHAPES)).t()]


def outs_for(quantizer: qt.Quantizer, xs: list[torch.Tensor]) -> list[qt.QuantizedTensor]:
    """Each source quantized once; one of them rowwise only (usages differ within the list)."""
    outs = [quantizer.quantize(x) for x in xs]
    outs[1] = quantizer.quantize(xs[1], rowwise=True, columnwise=False)
    return outs


def raw(t: qt.QuantizedTensor) -> list[torch.Tensor]:
    return [b.reshape(-1).view(torch.uint8).clone() for b in t.buffers().values() if b is not None]


@pytest.mark.parametrize(("name", "role"), CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_many_equals_a_loop_of_quantize_(name, role, dtype):
    # Two equal quantizers (their state too): one loops, the other requantizes all pairs at once.
    looping = qt.recipe_from_name(name).quantizer(role)
    batched = copy.deepcopy(looping)
    start = sources(seed=1, dtype=dtype)
    looped_outs, batched_outs = outs_for(looping, start), outs_for(batched, start)
    for step in range(2):  # stateful quantizers: the state advances the same way
        xs = sources(seed=10 * (step + 1), dtype=dtype)
        for x, out in zip(xs, looped_outs, strict=True):
            looping.quantize_(x, out)
        assert batched.quantize_many_(xs, batched_outs) is None
        for x, a, b in zip(xs, looped_outs, batched_outs, strict=True):
            assert all(torch.equal(u, v) for u, v in zip(raw(a), raw(b), strict=True)), (step, tuple(x.shape))
        assert (looping.state is None) == (batched.state is None)
        if looping.state is not None:
            assert torch.equal(looping.state, batched.state)


PER_TENSOR = [(name, role) for name in ("fp8", "fp8-delayed", "nvfp4") for role in qt.ROLES]


@pytest.mark.parametrize("rowwise_only", [False, True], ids=["usages-mixed", "rowwise-only"])
@pytest.mark.parametrize("as_tensor", [False, True], ids=["amax-list", "amax-tensor"])
@pytest.mark.parametrize(("name", "role"), PER_TENSOR)
@pytest.mark.parametrize("backend", quant_core.available_backends("cpu"))
def test_many_with_given_amaxes_equals_a_loop_of_quantize_with_each(
    name, role, backend, as_tensor, rowwise_only, monkeypatch
):
    # Amaxes as an optimizer hands them over (agreed elsewhere): tiny, zero, huge and ordinary ones.
    # Current-scaled FP8 computes all the scales in one call, then casts rowwise-only outs (sharded
    # weights) in one cast_to_fp8_many call; the other formats loop.
    scale_calls, many_calls = [], []
    real_scale, real_many = quant_core.fp8_scale, quant_core.cast_to_fp8_many
    monkeypatch.setattr(quant_core, "fp8_scale", lambda *a, **k: scale_calls.append(1) or real_scale(*a, **k))
    monkeypatch.setattr(quant_core, "cast_to_fp8_many", lambda *a, **k: many_calls.append(1) or real_many(*a, **k))
    looping = qt.recipe_from_name(name).quantizer(role)
    batched = copy.deepcopy(looping)
    xs = sources(seed=5)
    if rowwise_only:
        looped_outs, batched_outs = (
            [q.quantize(x, rowwise=True, columnwise=False) for x in xs] for q in (looping, batched)
        )
    else:
        looped_outs, batched_outs = outs_for(looping, xs), outs_for(batched, xs)
    amaxes = [torch.tensor(v) for v in (3.5, 0.0, 1e-41, 3e38, 0.75)]
    with quant_core.use_backend(backend):
        for x, out, amax in zip(xs, looped_outs, amaxes, strict=True):
            looping.quantize_(x, out, amax=amax)
        scale_calls.clear()
        batched.quantize_many_(xs, batched_outs, amaxes=torch.stack(amaxes) if as_tensor else amaxes)
    assert len(scale_calls) == (1 if name == "fp8" else 0)
    assert len(many_calls) == (1 if name == "fp8" and rowwise_only else 0)
    for x, a, b in zip(xs, looped_outs, batched_outs, strict=True):
        assert all(torch.equal(u, v) for u, v in zip(raw(a), raw(b), strict=True)), tuple(x.shape)
    if looping.state is not None:
        assert torch.equal(looping.state, batched.state)


def test_amaxes_are_refused_for_block_formats_and_in_the_wrong_number():
    xs = sources(seed=6)[:2]
    mxfp8 = qt.recipe_from_name("mxfp8").quantizer("weight")
    with pytest.raises(ValueError, match="amaxes for per-tensor formats, one per source; got 2 for 2 sources"):
        mxfp8.quantize_many_(xs, [mxfp8.quantize(x) for x in xs], amaxes=[torch.tensor(1.0)] * 2)
    fp8 = qt.recipe_from_name("fp8").quantizer("weight")
    with pytest.raises(ValueError, match="got 1 for 2 sources"):
        fp8.quantize_many_(xs, [fp8.quantize(x) for x in xs], amaxes=[torch.tensor(1.0)])
    with pytest.raises(ValueError, match="amaxes as a 1-D tensor or a sequence; got a 0-D tensor"):
        fp8.quantize_many_(xs, [fp8.quantize(x) for x in xs], amaxes=torch.tensor(1.0))


@pytest.mark.parametrize("name", ["mxfp8", "fp8-block"])
def test_block_formats_take_one_quant_core_call(name, monkeypatch):
    function = {"mxfp8": "quantize_mxfp8_many", "fp8-block": "quantize_fp8_blockwise_many"}[name]
    calls = []
    real = getattr(quant_core, function)
    monkeypatch.setattr(quant_core, function, lambda *args, **kwargs: calls.append(real(*args, **kwargs)))
    quantizer = qt.recipe_from_name(name).quantizer("weight")
    xs = sources(seed=3)
    outs = [quantizer.quantize(x) for x in xs]
    versions = [[b._version for b in out.buffers().values() if b is not None] for out in outs]
    quantizer.quantize_many_(sources(seed=4), outs)
    assert len(calls) == 1
    # Written buffers move their version counters (quant_fsdp caches quantized shards by version).
    for out, before in zip(outs, versions, strict=True):
        after = [b._version for b in out.buffers().values() if b is not None]
        assert all(a > b for a, b in zip(after, before, strict=True))


def test_an_empty_list_is_a_no_op():
    assert qt.recipe_from_name("mxfp8").quantizer("weight").quantize_many_([], []) is None


@pytest.mark.parametrize("name", RECIPES)
def test_bad_pairs_raise_naming_the_pair_and_write_nothing(name):
    recipe = qt.recipe_from_name(name)
    quantizer = recipe.quantizer("weight")
    xs = [adversarial((128, 128), seed=i) for i in range(3)]
    outs = [quantizer.quantize(x) for x in xs]
    before = [raw(out) for out in outs]
    other = "mxfp8" if name != "mxfp8" else "fp8"  # another tensor class
    bad = [
        (xs, outs[:2], ValueError, "quantize_many_ got 3 sources but 2 outs; pass one out per source"),
        (xs[0], outs[0], TypeError, "takes a sequence of sources and one of outs; for one pair call quantize_"),
        (
            [*xs[:2], adversarial((64, 128))],
            outs,
            ValueError,
            r"srcs\[2\], outs\[2\]: quantize_ into \w+\(128, 128\) from a \(64, 128\) source .* of the source's shape",
        ),
        (
            xs,
            [*outs[:2], qt.recipe_from_name(other).quantizer("weight").quantize(xs[2])],
            ValueError,
            r"srcs\[2\], outs\[2\]: quantize_ into",
        ),
        (
            [*xs[:2], xs[2].to(torch.int32)],
            outs,
            TypeError,
            r"srcs\[2\], outs\[2\]: x has dtype torch\.int32; quantization reads float32",
        ),
        (
            [*xs[:2], xs[2].to("meta")],
            outs,
            ValueError,
            r"srcs\[2\] is on meta and outs\[2\] on cpu, but srcs\[0\] is on cpu; .* call it once per device",
        ),
    ]
    for bad_xs, bad_outs, error, message in bad:
        with pytest.raises(error, match=message):
            quantizer.quantize_many_(bad_xs, bad_outs)
    assert all(
        torch.equal(u, v) for out, old in zip(outs, before, strict=True) for u, v in zip(raw(out), old, strict=True)
    )


def test_blockwise_refuses_outs_of_another_block_shape():
    tiled = qt.Float8BlockScaling().quantizer("weight")  # 128 x 128
    rows = qt.Float8BlockScaling().quantizer("input")  # 1 x 128
    x = adversarial((128, 128))
    with pytest.raises(ValueError, match=r"srcs\[0\], outs\[0\]: quantize_ into \(1, 128\) blocks with a \(128, 128\)"):
        tiled.quantize_many_([x], [rows.quantize(x)])
