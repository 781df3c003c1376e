"""quant_fsdp._checkpoint without torch.distributed: the load windows DCP narrows and copies into,
as its reader and writer use them (the multi-rank loads: tests-integration/test_fused_adam_checkpoint.py)."""

from __future__ import annotations

import types

import pytest
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

import quant_tensors as qt
from quant_core.testing import raw_bits
from quant_fsdp import _checkpoint
from quant_fsdp._context import ShardedWeight


def weight(recipe_name: str, seed: int = 0) -> qt.QuantizedTensor:
    """A fresh 256x128 quantized weight with the context fully_shard binds to the weights it shards."""
    quantizer = qt.recipe_from_name(recipe_name).quantizer("weight")
    local = quantizer.quantize(torch.randn(256, 128, generator=torch.Generator().manual_seed(seed)))
    context = ShardedWeight(quantizer.format_name)
    context.placement = _checkpoint.Placement((256, 128), None, ())  # placement unused by these loads
    quantizer.bind(shard_context=context)
    return local


def bits(t: qt.QuantizedTensor) -> list[torch.Tensor]:
    return [raw_bits(b.reshape(-1)).clone() for b in t.buffers().values() if b is not None]


def test_a_weight_fully_shard_does_not_manage_is_its_own_shard():
    local = qt.recipe_from_name("fp8-block").quantizer("weight").quantize(torch.randn(128, 128))
    assert local.__get_tensor_shard__(MetadataIndex("w")) is local


@pytest.mark.parametrize("recipe_name", ["fp8-block", "mxfp8"])
def test_quantized_chunks_load_as_bytes_and_high_precision_ones_are_quantized_when_complete(recipe_name):
    local, saved = weight(recipe_name), weight(recipe_name, seed=1)
    window = local.__get_tensor_shard__(MetadataIndex("w"))
    window.narrow(0, 128, 128).detach().copy_(saved[128:256])  # as DCP's reader does
    assert all(torch.equal(a, b) for a, b in zip(bits(local[128:256]), bits(saved[128:256]), strict=True))

    values = torch.randn(256, 128)  # the other form: chunks that split blocks
    local = weight(recipe_name)
    window = local.__get_tensor_shard__(MetadataIndex("w"))
    window.narrow(0, 0, 192).detach().copy_(values[:192])
    window.narrow(0, 192, 64).detach().copy_(values[192:])
    expected = local.quantizer.quantize(values)
    assert all(torch.equal(a, b) for a, b in zip(bits(local), bits(expected), strict=True))


def test_dcp_writer_saves_the_weight_itself():
    local = weight("fp8-block")
    window = local.__get_tensor_shard__(MetadataIndex("w"))
    saved = window.detach().cpu()
    assert saved.untyped_storage().size() != saved.nbytes  # so the writer copies it ...
    copy = saved.clone()
    assert type(copy) is type(local)  # ... into the quantized tensor it saves
    assert all(torch.equal(a, b) for a, b in zip(bits(copy), bits(local), strict=True))


def test_a_staged_per_tensor_weight_waits_and_a_later_write_wins():
    local = weight("fp8")  # per-tensor: quantizing the staged value needs the shards' amax
    local.quantizer.bind(
        amax_group=types.SimpleNamespace(group_name="7")
    )  # as fully_shard binds it (never reached here)
    values = torch.randn(256, 128)
    before = bits(local)
    local.__get_tensor_shard__(MetadataIndex("w")).copy_(values)
    context = local.quantizer.shard_context
    assert context.pending is not None
    assert all(torch.equal(a, b) for a, b in zip(bits(local), before, strict=True))  # nothing written yet
    object.__setattr__(local.quantizer, "amax_group_name", None)
    _checkpoint.RequantizePendingHook([context])(torch.nn.Module(), None)  # load_state_dict's post-hook
    assert context.pending is None
    expected = local.quantizer.quantize(values)
    assert all(torch.equal(a, b) for a, b in zip(bits(local), bits(expected), strict=True))

    object.__setattr__(local.quantizer, "amax_group_name", "7")
    local.__get_tensor_shard__(MetadataIndex("w")).copy_(values)  # a second load, staged again
    assert context.pending is not None
    requantized = torch.randn(256, 128)
    object.__setattr__(local.quantizer, "amax_group_name", None)
    local.quantizer.quantize_(requantized, local)  # FusedAdam's requantize from the master
    _checkpoint.requantize_pending(context)
    assert context.pending is None
    expected = local.quantizer.quantize(requantized)
    assert all(torch.equal(a, b) for a, b in zip(bits(local), bits(expected), strict=True))


@pytest.mark.parametrize(
    ("recipe_name", "shape", "rows", "cover"),
    [
        ("fp8-block", (384, 128), (192, 384), (128, 384)),
        ("fp8-block", (384, 128), (0, 96), (0, 128)),
        ("fp8-block", (128, 128), (43, 86), (0, 128)),
        ("nvfp4", (128, 128), (43, 86), (32, 96)),
        ("fp8", (128, 128), (43, 86), (43, 86)),
        ("fp8-block", (4, 64, 128), (1, 3), (0, 4)),  # 64 rows of (M, K) per index: 2 indices a block
    ],
)
def test_a_fallback_shard_reads_the_whole_blocks_around_it(recipe_name, shape, rows, cover):
    quantizer = qt.recipe_from_name(recipe_name).quantizer("weight")
    assert _checkpoint._block_cover(quantizer, shape, *rows) == cover
