"""Quantizers and tensors against quant-core's references, bit for bit, and their memory rules."""

from __future__ import annotations

import copy
import dataclasses
import io
import pickle
import types

import pytest
import torch

import quant_core
import quant_tensors as qt
import quant_tensors.quantizer

RECIPES = ("fp8", "fp8-delayed", "mxfp8", "fp8-block", "nvfp4")
CASES = [(name, role) for name in RECIPES for role in qt.ROLES]
TILED = {"fp8-block": (128, 128), "nvfp4": (16, 16)}


def sample(shape=(256, 384), seed=0, dtype=torch.bfloat16) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def bitwise(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return None
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def reference_buffers(name: str, role: str, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """quant-core's reference quantization of x as (name, role) of the default recipe prescribes (both usages)."""
    fp8_dtype = torch.float8_e5m2 if role == "grad_output" else torch.float8_e4m3fn
    if name == "fp8":
        q = quant_core.quantize_fp8_reference(x, fp8_dtype, columnwise=True)
        return {"rowwise_data": q.rowwise_data, "columnwise_data": q.columnwise_data, "scale_inv": q.scale_inv}
    if name == "fp8-delayed":  # the first step of delayed scaling: empty history, scale 1
        rowwise, columnwise = quant_core.cast_to_fp8_reference(x, torch.tensor(1.0), fp8_dtype, columnwise=True)
        return {"rowwise_data": rowwise, "columnwise_data": columnwise, "scale_inv": torch.tensor(1.0)}
    block_shape = TILED.get(name, (1, 128)) if role == "weight" else None
    if name == "mxfp8":
        q = quant_core.quantize_mxfp8_reference(x, columnwise=True)
    elif name == "fp8-block":
        q = quant_core.quantize_fp8_blockwise_reference(x, block_shape or (1, 128), fp8_dtype, columnwise=True)
    else:
        q = quant_core.quantize_nvfp4_reference(
            x, block_shape or (1, 16), columnwise=True, stochastic_rounding=role == "grad_output", seed=0
        )
    buffers = {
        "rowwise_data": q.rowwise_data,
        "rowwise_scale_inv": q.rowwise_scale_inv,
        "columnwise_data": q.columnwise_data,
        "columnwise_scale_inv": q.columnwise_scale_inv,
    }
    return buffers | ({"amax": q.amax, "columnwise_amax": q.columnwise_amax} if name == "nvfp4" else {})


def assert_same_buffers(t: qt.QuantizedTensor, expected: dict[str, torch.Tensor | None]) -> None:
    assert set(t.buffers()) == set(expected)
    for name, want in expected.items():
        got = t.buffers()[name]
        assert (got is None) == (want is None), name
        if got is not None:
            assert (got.dtype, got.shape) == (want.dtype, want.shape), name
            assert torch.equal(bitwise(got), bitwise(want)), name


TENSOR_CLASSES = {
    "fp8": qt.Float8Tensor,
    "fp8-delayed": qt.Float8Tensor,
    "mxfp8": qt.MXFP8Tensor,
    "fp8-block": qt.Float8BlockwiseTensor,
    "nvfp4": qt.NVFP4Tensor,
}


@pytest.mark.parametrize(("name", "role"), CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_quantize_equals_the_quant_core_reference(name, role, dtype):
    x = sample(dtype=dtype)
    t = qt.recipe_from_name(name).quantizer(role).quantize(x)
    assert type(t) is TENSOR_CLASSES[name]
    assert isinstance(t, qt.QuantizedTensor)
    assert (t.shape, t.dtype, t.device) == (x.shape, dtype, x.device)
    expected = reference_buffers(name, role, x)
    assert_same_buffers(t, expected)
    # dequantize() is quant-core's reference dequantization of each usage's buffers, in the nominal
    # dtype or the one asked for; from columnwise alone it is x^T's values transposed back.
    for out_dtype in (dtype, torch.float32):
        rowwise_values, columnwise_values = reference_values(name, t, expected, out_dtype)
        assert torch.equal(bitwise(t.dequantize(None if out_dtype == dtype else out_dtype)), bitwise(rowwise_values))
        columnwise_only = qt.recipe_from_name(name).quantizer(role).quantize(x)
        columnwise_only.update_usage(rowwise=False)
        assert torch.equal(bitwise(columnwise_only.dequantize(out_dtype)), bitwise(columnwise_values.t()))


def reference_values(name: str, t: qt.QuantizedTensor, b: dict[str, torch.Tensor], dtype: torch.dtype):
    """(rowwise values, columnwise values) of reference buffers `b`, by quant-core's reference dequantize."""
    if name in ("fp8", "fp8-delayed"):
        return tuple(
            quant_core.dequantize_fp8_reference(b[k], b["scale_inv"], dtype)
            for k in ("rowwise_data", "columnwise_data")
        )
    usages = (("rowwise_data", "rowwise_scale_inv"), ("columnwise_data", "columnwise_scale_inv"))
    if name == "mxfp8":
        return tuple(quant_core.dequantize_mxfp8_reference(b[d], b[s], dtype) for d, s in usages)
    if name == "fp8-block":
        return tuple(quant_core.dequantize_fp8_blockwise_reference(b[d], b[s], t.block_shape, dtype) for d, s in usages)
    return tuple(quant_core.dequantize_nvfp4_reference(b[d], b[s], b["amax"], t.block_shape, dtype) for d, s in usages)


@pytest.mark.parametrize(("name", "role"), CASES)
def test_save_and_load_weights_only_round_trip_bitwise(name, role, tmp_path):
    t = qt.recipe_from_name(name).quantizer(role).quantize(sample())
    t.requires_grad_(True)
    path = tmp_path / "t.pt"
    torch.save({"weight": t}, path)
    loaded = torch.load(path, weights_only=True)["weight"]
    assert type(loaded) is type(t)
    assert (loaded.shape, loaded.dtype, loaded.requires_grad) == (t.shape, t.dtype, True)
    assert_same_buffers(loaded, t.buffers())
    assert type(loaded.quantizer) is type(t.quantizer)


@pytest.mark.parametrize(("name", "role"), CASES)
def test_deepcopy_copies_buffers_and_quantizer(name, role):
    t = qt.recipe_from_name(name).quantizer(role).quantize(sample())
    clone = copy.deepcopy(t)
    assert type(clone) is type(t)
    assert_same_buffers(clone, t.buffers())
    assert clone.rowwise_data.data_ptr() != t.rowwise_data.data_ptr()
    assert clone.quantizer is not t.quantizer


def test_delayed_scaling_uses_the_history_of_earlier_steps():
    quantizer = qt.Float8DelayedScaling(amax_history_len=3).quantizer("input")
    first, second = sample(seed=1) * 4, sample(seed=2)
    quantizer.quantize(first)  # scale 1 (empty history); pushes amax(first)
    t = quantizer.quantize(second)
    # Step 2 scales with step 1's amax: fmax / amax(first).
    scale, scale_inv = quant_core.fp8_scale(quant_core.amax(first), torch.float8_e4m3fn)
    rowwise, _ = quant_core.cast_to_fp8_reference(second, scale, torch.float8_e4m3fn)
    assert torch.equal(bitwise(t.rowwise_data), bitwise(rowwise))
    assert torch.equal(t.scale_inv, scale_inv)
    assert quantizer.amax_history.tolist() == [quant_core.amax(second).item(), quant_core.amax(first).item(), 0.0]


def test_delayed_scaling_state_round_trips_with_the_tensor(tmp_path):
    quantizer = qt.Float8DelayedScaling().quantizer("weight")
    quantizer.quantize(sample())
    t = quantizer.quantize(sample(seed=3))
    torch.save(t, tmp_path / "t.pt")
    loaded = torch.load(tmp_path / "t.pt", weights_only=True)
    assert torch.equal(loaded.quantizer.amax_history, quantizer.amax_history)


def test_shared_amax_overrides_the_tensors_own():
    # A shard quantized with its group's amax equals the slice of the whole tensor's quantization.
    x = sample((256, 128))
    whole = qt.Float8CurrentScaling().quantizer("weight").quantize(x)
    shard = qt.Float8CurrentScaling().quantizer("weight").quantize(x[128:], amax=quant_core.amax(x))
    assert torch.equal(bitwise(shard.rowwise_data), bitwise(whole.rowwise_data[128:]))
    nvfp4 = qt.NVFP4BlockScaling().quantizer("weight")
    whole, shard = nvfp4.quantize(x), nvfp4.quantize(x[128:], amax=quant_core.amax(x))
    assert torch.equal(shard.rowwise_data, whole.rowwise_data[128:])
    assert torch.equal(shard.amax, whole.amax)


def test_stochastic_rounding_draws_a_new_stream_per_call():
    quantizer = qt.NVFP4BlockScaling().quantizer("grad_output")
    x = sample()
    first, second = quantizer.quantize(x), quantizer.quantize(x)
    assert not torch.equal(first.rowwise_data, second.rowwise_data)
    assert quantizer.calls == 2


# ---- usages and on-demand columnwise ----------------------------------------------------------


def _data_bytes(t: qt.QuantizedTensor) -> int:
    return sum(b.numel() * b.element_size() for b in t.buffers().values() if b is not None)


@pytest.mark.parametrize("name", ["fp8", "fp8-block", "nvfp4"])
def test_on_demand_columnwise_halves_weight_memory_and_derives_it_losslessly(name, monkeypatch):
    x = torch.randn(4096, 4096, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    both = qt.recipe_from_name(name).quantizer("weight").quantize(x)
    monkeypatch.setenv(qt.COLUMNWISE_ON_DEMAND_ENV_VAR, "1")
    weight = qt.recipe_from_name(name).quantizer("weight").quantize(x)
    assert weight.usages == (True, False)
    assert 2 * _data_bytes(weight) - _data_bytes(both) <= 2 * (
        weight.numel() // 16**2 + 8
    )  # scales aside: exactly half
    assert _data_bytes(weight) <= 0.51 * _data_bytes(both)
    weight.update_usage(columnwise=True)  # before the dgrad GEMM
    assert torch.equal(bitwise(weight.columnwise_data), bitwise(both.columnwise_data))
    scale_name = "scale_inv" if name == "fp8" else "columnwise_scale_inv"
    assert torch.equal(bitwise(getattr(weight, scale_name)), bitwise(getattr(both, scale_name)))
    weight.update_usage(columnwise=False)  # after it
    assert weight.columnwise_data is None
    assert _data_bytes(weight) <= 0.51 * _data_bytes(both)


@pytest.mark.parametrize(("name", "role"), [("mxfp8", "weight"), ("fp8-block", "input"), ("nvfp4", "input")])
def test_one_dimensional_blocks_cannot_derive_a_usage(name, role):
    t = qt.recipe_from_name(name).quantizer(role).with_usage(columnwise=False).quantize(sample())
    with pytest.raises(ValueError, match="cannot derive columnwise data from the other usage"):
        t.update_usage(columnwise=True)
    assert t.usages == (True, False)


@pytest.mark.parametrize("name", RECIPES)
def test_dropping_the_last_usage_is_refused(name):
    t = qt.recipe_from_name(name).quantizer("weight").with_usage(columnwise=False).quantize(sample())
    with pytest.raises(ValueError, match="must keep at least one usage"):
        t.update_usage(rowwise=False)
    assert t.usages == (True, False)


# ---- quantize_, make_empty, is_quantizable ------------------------------------------------------


@pytest.mark.parametrize(("name", "role"), CASES)
def test_quantize_in_place_refills_the_buffers(name, role):
    recipe = qt.recipe_from_name(name)
    out = recipe.quantizer(role).quantize(sample(seed=1))
    before = {k: id(v) for k, v in out.buffers().items()}
    x = sample(seed=2)
    result = recipe.quantizer(role).quantize_(x, out)
    assert result is out
    assert {k: id(v) for k, v in out.buffers().items()} == before
    assert_same_buffers(out, reference_buffers(name, role, x))


@pytest.mark.parametrize(("name", "role"), CASES)
@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_make_empty_allocates_every_buffer_without_computing(name, role, device):
    quantizer = qt.recipe_from_name(name).quantizer(role)
    t = quantizer.make_empty((256, 384), dtype=torch.bfloat16, device=device, requires_grad=True)
    assert type(t) is TENSOR_CLASSES[name]
    assert (t.shape, t.dtype, t.device.type, t.requires_grad) == ((256, 384), torch.bfloat16, device, True)
    reference = quantizer.quantize(sample())
    for buffer_name, buffer in t.buffers().items():
        want = reference.buffers()[buffer_name]
        assert (buffer is None) == (want is None), buffer_name  # e.g. NVFP4's columnwise_amax without the transform
        if buffer is not None:
            assert (buffer.shape, buffer.dtype) == (want.shape, want.dtype), buffer_name
    if device == "cpu":
        assert torch.equal(t.dequantize(), torch.zeros(256, 384, dtype=torch.bfloat16))


@pytest.mark.parametrize(
    ("name", "good", "bad"),
    [
        ("fp8", (32, 48), (32, 40)),
        ("mxfp8", (64, 96), (64, 80)),
        ("fp8-block", (256, 384), (256, 200)),
        ("nvfp4", (32, 48), (24, 40)),
    ],
)
def test_is_quantizable_follows_block_sizes(name, good, bad):
    quantizer = qt.recipe_from_name(name).quantizer("input")
    assert quantizer.is_quantizable(torch.zeros(good))
    assert not quantizer.is_quantizable(torch.zeros(bad))
    assert not quantizer.is_quantizable(torch.zeros(good, dtype=torch.int32))
    assert not quantizer.is_quantizable(torch.tensor(1.0))


# ---- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "role"), CASES)
def test_bad_inputs_raise_with_the_rule(name, role):
    quantizer = qt.recipe_from_name(name).quantizer(role)
    for dtype in (torch.int64, torch.float64):
        with pytest.raises(TypeError, match=f"x has dtype {dtype}; quantization reads float32, bfloat16 or float16"):
            quantizer.quantize(torch.ones(32, 32, dtype=dtype))
    with pytest.raises(ValueError, match="cannot quantize a 0-d tensor"):
        quantizer.quantize(torch.tensor(1.0))
    with pytest.raises(TypeError, match="already a"):
        quantizer.quantize(quantizer.quantize(sample()))
    with pytest.raises(ValueError, match="must be a .* of the source's shape"):
        quantizer.quantize_(sample((128, 128)), quantizer.quantize(sample()))


def test_nvfp4_odd_dims_are_refused_with_the_packing_rule():
    with pytest.raises(ValueError, match="must be even; got K=33"):
        qt.NVFP4BlockScaling().quantizer("input").quantize(torch.ones(4, 33))


def test_nvfp4_odd_rows_with_columnwise_data_are_refused_with_the_packing_rule():
    with pytest.raises(ValueError, match="must be even; got M=33"):
        qt.NVFP4BlockScaling().quantizer("input").quantize(torch.ones(33, 32), columnwise=True)
    assert qt.NVFP4BlockScaling().quantizer("input").quantize(torch.ones(33, 32), columnwise=False).usages == (
        True,
        False,
    )


@pytest.mark.parametrize(
    ("state", "match"),
    [
        (torch.zeros(2, 4), "amax_history must be a non-empty 1-D float32 tensor"),
        (torch.zeros(4, dtype=torch.float64), "amax_history must be a non-empty 1-D float32 tensor"),
        (torch.zeros(8)[::2], "amax_history must be contiguous"),
        (torch.zeros(4, device="meta"), "amax_history is on meta but x is on cpu"),
    ],
)
def test_delayed_scaling_refuses_a_bad_state_with_the_rule(state, match):
    quantizer = qt.Float8DelayedScaling().quantizer("input")
    with pytest.raises(ValueError, match=match):
        quantizer.quantize(sample((64, 32)), state=state)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (
            lambda: qt.Float8DelayedQuantizer(amax_compute_algo="mean"),
            "amax_compute_algo must be 'max' or 'most_recent'",
        ),
        (lambda: qt.Float8DelayedQuantizer(margin=1.5), r"margin must be an int in \[0, 127\]"),
        (lambda: qt.Float8BlockQuantizer(fp8_dtype=torch.bfloat16), "fp8_dtype must be torch.float8_e4m3fn or"),
    ],
)
def test_quantizers_refuse_a_bad_configuration_when_made(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_nvfp4_takes_a_given_amax_in_each_form_quantize_accepts():
    quantizer, x = qt.NVFP4BlockScaling().quantizer("input"), sample((64, 32))
    want = quantizer.quantize(x, amax=torch.tensor(8.0))
    for amax in (torch.tensor([8.0]), torch.tensor(8.0, dtype=torch.bfloat16)):
        got = quantizer.quantize(x, amax=amax)
        assert torch.equal(got.amax, want.amax)
        for name, buffer in want.buffers().items():
            if buffer is None:
                assert getattr(got, name) is None
            else:
                assert torch.equal(bitwise(getattr(got, name)), bitwise(buffer))


def test_serialized_bytes_hold_only_the_raw_buffers():
    t = qt.MXFP8BlockScaling().quantizer("input").quantize(sample())
    buffer = io.BytesIO()
    torch.save(t, buffer)
    raw = sum(b.numel() * b.element_size() for b in t.buffers().values() if b is not None)
    assert raw < buffer.getbuffer().nbytes < raw + 16 * 1024  # buffers plus a few KiB of structure


# ---- hooks for higher layers: shard alignment, process groups ------------------------------


@pytest.mark.parametrize(
    ("name", "role", "alignment"),
    [
        ("fp8", "weight", 1),
        ("fp8-delayed", "weight", 1),
        ("mxfp8", "weight", 32),
        ("fp8-block", "weight", 128),
        ("fp8-block", "input", 128),
        ("nvfp4", "weight", 16),
        ("nvfp4", "input", 16),
    ],
)
def test_row_alignment_is_the_block_rows_a_shard_must_start_on(name, role, alignment):
    quantizer = qt.recipe_from_name(name).quantizer(role)
    assert quantizer.row_alignment == alignment
    if alignment > 1 and quantizer.block_shape[0] == 1:  # 1-D blocks used rowwise only span no rows
        assert quantizer.with_usage(columnwise=False).row_alignment == 1


def test_quantizer_pickles_and_copies_without_its_process_group(monkeypatch):
    group = types.SimpleNamespace(group_name="7")  # stands in for a ProcessGroup, which neither pickles nor deep-copies
    monkeypatch.setattr(quant_tensors.quantizer, "_resolve_process_group", {"7": group}.__getitem__)
    quantizer = qt.Float8DelayedScaling().quantizer("weight")
    quantizer.bind(amax_group=group)
    assert quantizer.amax_group is group
    # Its fields hold the group's name, not the group: torch.compile rebuilds a quantizer passed
    # into a graph from its fields, and torch 2.11 cannot carry a ProcessGroup there.
    assert [f.name for f in dataclasses.fields(quantizer) if getattr(quantizer, f.name) is group] == []
    quantizer.quantize(torch.randn(16, 16), amax=torch.tensor(3.0))  # a given amax needs no group
    restored = pickle.loads(pickle.dumps(quantizer))
    assert restored.amax_group is None
    assert torch.equal(restored.amax_history, quantizer.amax_history)
    clone = copy.deepcopy(quantizer)
    assert clone.amax_group is group
    assert clone.amax_history is not quantizer.amax_history
    assert torch.equal(clone.amax_history, quantizer.amax_history)


@pytest.mark.parametrize("name", RECIPES)
def test_from_buffers_builds_what_the_constructor_builds(name):
    q = qt.recipe_from_name(name).quantizer("input").quantize(sample((4, 32, 64)))
    cls = type(q)
    fields = {**q.buffers(), **q.metadata()}
    fast = cls.from_buffers(q.shape, q.dtype, q.device, **fields)
    slow = cls(q.shape, q.dtype, **fields)
    assert (type(fast), fast.shape, fast.dtype, fast.device, fast.requires_grad) == (
        cls,
        slow.shape,
        slow.dtype,
        slow.device,
        slow.requires_grad,
    )
    assert all(getattr(fast, field) is getattr(slow, field) for field in fields)
    # Fields left out are None, as the constructor leaves them
    columnwise = {k: v for k, v in fields.items() if not k.startswith("rowwise_")}
    fast = cls.from_buffers(q.shape, q.dtype, q.device, **columnwise)
    assert fast.rowwise_data is None
    assert fast.usages == (False, True)
    assert torch.equal(fast.dequantize(), cls(q.shape, q.dtype, **columnwise).dequantize())
