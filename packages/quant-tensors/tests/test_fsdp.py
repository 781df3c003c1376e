"""QuantizedTensor's FSDP2 all-gather hooks and shard contexts in one process: FSDP2's gather is
simulated by concatenating the inputs of every shard along dim 0, as its all-gather + copy-out
does. Multi-process runs (torch's fully_shard without quant_fsdp) live in tests-integration."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import quant_tensors as qt
from quant_core.testing import raw_bits
from quant_tensors import _fsdp
from quant_tensors.testing import FakeMesh, assert_same, expected_gather, fsdp_gather

RECIPES = ("fp8", "fp8-delayed", "mxfp8", "fp8-block", "nvfp4")


@pytest.mark.parametrize("signature", [1, 5])
@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("recipe_name", RECIPES)
def test_quantized_shards_gather_into_the_unsharded_tensor(recipe_name, world_size, signature):
    full = qt.recipe_from_name(recipe_name).quantizer("weight").quantize(torch.randn(512, 256))
    shards = [s.clone() for s in full.chunk(world_size)]  # FSDP2 copies each shard into its own buffers
    unsharded, to_free = fsdp_gather(shards, world_size, signature, full.shape)
    assert_same(unsharded, expected_gather(full))
    assert unsharded.quantizer is full.quantizer  # no quantizer copies
    buffers_before = {n: b for n, b in unsharded.buffers().items() if b is not None}
    # A later unshard refills the same tensor: new shard values (requantized), same objects.
    new_full = full.quantizer.quantize(torch.randn(512, 256))
    for shard, new in zip(shards, new_full.chunk(world_size), strict=True):
        shard.copy_(new)
    assert fsdp_gather(shards, world_size, signature, full.shape, out=unsharded) is None
    assert_same(unsharded, expected_gather(new_full))
    for name, buffer in unsharded.buffers().items():
        if buffer is not None and buffer.dim() == 0:  # per-tensor values: the shard's own, never copied
            assert buffer is buffers_before[name] is getattr(shards[0], name)
    assert all(isinstance(t, torch.Tensor) for t in to_free)


def test_mxfp8_gathers_rowwise_forward_and_columnwise_backward_when_backward_regathers(monkeypatch):
    monkeypatch.setattr(_fsdp, "_reshards_after_forward", lambda module: True)
    full = qt.MXFP8BlockScaling().quantizer("weight").quantize(torch.randn(128, 64))
    shards = [s.clone() for s in full.chunk(2)]
    unsharded, to_free = fsdp_gather(shards, 2, 5, full.shape)
    assert [tuple(t.shape) for t in to_free] == [(64, 128), (64, 4)]  # the owned columnwise buffers
    # The forward's tensor holds them already, not yet filled: a compiled backward reads the
    # buffers the forward had ([Note: refilled unsharded buffers]).
    assert unsharded.columnwise_data is to_free[0]
    assert unsharded.columnwise_scale_inv is to_free[1]
    for name in ("rowwise_data", "rowwise_scale_inv"):
        assert torch.equal(raw_bits(getattr(unsharded, name)), raw_bits(getattr(full, name))), name
    assert shards[0].fsdp_pre_all_gather(FakeMesh(2))[1].names == ("rowwise_data", "rowwise_scale_inv")

    seen = {}

    def backward_gather(grad):
        seen["result"] = fsdp_gather(shards, 2, 5, full.shape, out=unsharded)
        return grad

    x = torch.ones(1, requires_grad=True)
    x.register_hook(backward_gather)
    (x * 2).sum().backward()
    assert seen["result"] is None
    assert unsharded.usages == (False, True)
    assert unsharded.columnwise_data is to_free[0]  # refilled in place
    assert unsharded.columnwise_scale_inv is to_free[1]
    assert torch.equal(raw_bits(unsharded.columnwise_data), raw_bits(full.columnwise_data))
    assert torch.equal(unsharded.columnwise_scale_inv, full.columnwise_scale_inv)


def test_mxfp8_gathers_both_usages_when_no_fsdp_module_is_found():
    full = qt.MXFP8BlockScaling().quantizer("weight").quantize(torch.randn(128, 64))
    shards = [s.clone() for s in full.chunk(2)]
    unsharded, _ = fsdp_gather(shards, 2, 5, full.shape)  # module None: no FSDP2 module, no backward gather known
    assert shards[0].fsdp_pre_all_gather(FakeMesh(2))[1].names == (
        "rowwise_data",
        "rowwise_scale_inv",
        "columnwise_data",
        "columnwise_scale_inv",
    )
    assert_same(unsharded, full)


class RecordingContext(qt.fsdp.ShardContext):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Any, ...]] = []

    def before_gather(self, shard, mesh):
        self.calls.append(("before_gather", shard, mesh))
        super().before_gather(shard, mesh)

    def after_gather(self, shard):
        self.calls.append(("after_gather", shard))

    def count_gather(self, format_name, inputs, world_size):
        self.calls.append(("count_gather", format_name, sum(t.numel() * t.element_size() for t in inputs), world_size))

    def tensor_shard_for_checkpoint(self, shard, index):
        self.calls.append(("tensor_shard_for_checkpoint", shard, index))
        return shard


def test_the_hooks_ask_the_context_bound_to_the_weights_quantizer():
    context = RecordingContext()
    quantizer = qt.Float8CurrentScaling().quantizer("weight").bind(shard_context=context)
    shard = quantizer.quantize(torch.randn(64, 32))
    mesh = FakeMesh(2)
    inputs, payload = shard.fsdp_pre_all_gather(mesh)
    assert context.calls == [("before_gather", shard, mesh), ("count_gather", "per-tensor FP8", 64 * 32, 2)]
    shard.fsdp_post_all_gather(tuple(torch.cat([t, t]) for t in inputs), payload, torch.float32)
    assert context.calls[-1] == ("after_gather", shard)
    detached = shard.detach()  # as a state dict holds it: another tensor, the same quantizer
    assert detached.__get_tensor_shard__("index") is detached
    assert context.calls[-1] == ("tensor_shard_for_checkpoint", detached, "index")
    # Another weight's quantizer, equal in value, has its own context.
    other = qt.Float8CurrentScaling().quantizer("weight").quantize(torch.randn(64, 32))
    other.fsdp_pre_all_gather(mesh)
    assert len(context.calls) == 4
    assert type(other.quantizer.shard_context) is qt.fsdp.ShardContext


def test_a_weight_without_a_context_gets_the_plain_one_at_its_first_gather():
    quantizer = qt.NVFP4BlockScaling().quantizer("weight")
    shard = quantizer.quantize(torch.randn(32, 32))
    assert shard.__get_tensor_shard__("index") is shard  # DCP reads the shard itself
    assert quantizer.shard_context is None
    shard.fsdp_pre_all_gather(FakeMesh(2))
    context = quantizer.shard_context
    assert type(context) is qt.fsdp.ShardContext
    shard.fsdp_pre_all_gather(FakeMesh(2))
    assert quantizer.shard_context is context


def test_copies_of_a_quantizer_leave_its_shard_context_behind():
    import copy
    import pickle

    quantizer = qt.Float8CurrentScaling().quantizer("weight").bind(shard_context=RecordingContext())
    assert copy.deepcopy(quantizer).shard_context is None
    assert pickle.loads(pickle.dumps(quantizer)).shard_context is None
    assert quantizer.with_usage(columnwise=False).shard_context is quantizer.shard_context  # a binding, shared
    assert copy.deepcopy(quantizer) == quantizer  # configuration only


@pytest.mark.parametrize("recipe_name", RECIPES)
def test_a_shard_refilled_in_place_sends_the_views_it_sent_before(recipe_name):
    # [Note: gathers prepared once] in quant_tensors._fsdp.
    quantizer = qt.recipe_from_name(recipe_name).quantizer("weight")
    shard = quantizer.quantize(torch.randn(256, 256))
    first, payload = _fsdp.all_gather_inputs(shard, 2)
    quantizer.quantize_(torch.randn(256, 256), shard)  # an optimizer's requantize: same buffers
    again, payload_again = _fsdp.all_gather_inputs(shard, 2)
    assert all(a is b for a, b in zip(again, first, strict=True))
    assert payload_again.names == payload.names
    assert payload_again.shard is shard
    for name, sent in zip(payload.names, again, strict=True):  # views: they carry the new bytes
        assert torch.equal(raw_bits(sent.reshape(-1)), raw_bits(getattr(shard, name).reshape(-1)))
    # A buffer replaced by another tensor (e.g. a checkpoint load) is sent from the new one.
    name = payload.names[0]
    setattr(shard, name, getattr(shard, name).clone())
    replaced, _ = _fsdp.all_gather_inputs(shard, 2)
    assert replaced[0] is not first[0]
    assert replaced[0].data_ptr() == getattr(shard, name).data_ptr()
    # One rank's inputs are kept too: one input travels as a view, several packed into one byte
    # tensor whose views the shard's sent buffers become ([Note: packed gathers]).
    (alone,), payload_alone = _fsdp.all_gather_inputs(shard, 1)
    assert _fsdp.all_gather_inputs(shard, 1)[0][0] is alone
    if len(payload.names) > 1:
        assert payload_alone.packed is not None
        for name in payload.names:
            assert getattr(shard, name).untyped_storage().data_ptr() == alone.untyped_storage().data_ptr()
    source = torch.randn(256, 256)
    expected = copy.deepcopy(quantizer).quantize(source)  # a delayed-scaling history as it is now
    quantizer.quantize_(source, shard)  # written in place: the packed tensor carries the new bytes
    (sent,), payload_sent = _fsdp.all_gather_inputs(shard, 1)
    assert sent is alone
    for name, view in zip(payload.names, _fsdp._unpacked((sent,), payload_sent), strict=True):
        assert torch.equal(raw_bits(view.reshape(-1)), raw_bits(getattr(expected, name).reshape(-1)))


def test_an_unsharded_tensor_holding_views_of_the_gathered_bytes_is_left_as_it_is():
    quantizer = qt.recipe_from_name("fp8").quantizer("weight")
    shards = [s.clone() for s in quantizer.quantize(torch.randn(512, 256)).chunk(2)]
    unsharded, _ = fsdp_gather(shards, 2, 5, (512, 256))
    inputs = [shard.fsdp_pre_all_gather(FakeMesh(2), None, None, None, None) for shard in shards]
    payload = inputs[0][1]
    outputs = tuple(torch.cat(parts) for parts in zip(*(i[0] for i in inputs), strict=True))
    assert shards[0].fsdp_post_all_gather(outputs, payload, torch.float32, out=unsharded) is None
    refilled = unsharded.rowwise_data
    assert refilled.data_ptr() == outputs[0].data_ptr()
    # FSDP2 hands views of the same storage again: nothing to set.
    views = tuple(o.view(o.shape) for o in outputs)
    assert shards[0].fsdp_post_all_gather(views, payload, torch.float32, out=unsharded) is None
    assert unsharded.rowwise_data is refilled
    # Other storage: refilled from it.
    elsewhere = tuple(o.clone() for o in outputs)
    assert shards[0].fsdp_post_all_gather(elsewhere, payload, torch.float32, out=unsharded) is None
    assert unsharded.rowwise_data.data_ptr() == elsewhere[0].data_ptr()
    assert unsharded.scale_inv is shards[0].scale_inv
