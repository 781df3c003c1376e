"""The FSDP2 all-gather hooks of QuantizeOnGatherTensor and the gather plan in one process: FSDP2's
gather is simulated by concatenating the inputs of every shard along dim 0, as its all-gather +
copy-out does (QuantizedTensor's own hooks: quant-tensors' test_fsdp.py). Multi-process runs live
in tests-integration."""

from __future__ import annotations

import pytest
import torch

import quant_fsdp
import quant_tensors as qt
from quant_fsdp import _plan
from quant_tensors.testing import assert_same, expected_gather, fsdp_gather

RECIPES = ("fp8", "fp8-delayed", "mxfp8", "fp8-block", "nvfp4")


def test_quantize_on_gather_wrapper_ops():
    quantizer = qt.Float8CurrentScaling().quantizer("weight")
    w = quant_fsdp.QuantizeOnGatherTensor(torch.randn(64, 32), quantizer)
    for op in (
        lambda t: t.detach(),
        lambda t: t.view(-1),
        lambda t: t[:16],
        lambda t: t.new_zeros(4, 32),
        torch.empty_like,
    ):
        result = op(w)
        assert isinstance(result, quant_fsdp.QuantizeOnGatherTensor)
        assert result.quantizer is quantizer
    assert all(isinstance(c, quant_fsdp.QuantizeOnGatherTensor) for c in w.chunk(4))
    version = w._data._version
    assert w.add_(1.0) is w
    assert w._data._version > version  # in-place writes reach the wrapped tensor's version
    assert type(w * 2) is torch.Tensor  # other results are plain tensors (e.g. optimizer states)
    assert type(torch.zeros_like(w)) is torch.Tensor
    with pytest.raises(TypeError, match="high-precision"):
        quant_fsdp.QuantizeOnGatherTensor(quantizer.quantize(torch.randn(16, 16)), quantizer)


def test_writes_through_views_requantize_the_shard():
    # [Note: versions through views]: FusedAdam's reference update writes through param.view(-1).
    quantizer = qt.recipe_from_name("mxfp8").quantizer("weight")
    w = quant_fsdp.QuantizeOnGatherTensor(torch.randn(64, 32), quantizer)
    before = w._quantize_shard().dequantize()
    with torch.no_grad():
        w.detach()[32:].view(-1).mul_(2.0)
    after = w._quantize_shard().dequantize()
    assert torch.equal(after, quantizer.quantize(w._data.clone()).dequantize())
    assert torch.equal(after[32:], 2 * before[32:])
    assert torch.equal(after[:32], before[:32])


def test_foreach_writes_requantize_every_shard():
    # torch's optimizers step CUDA parameters with foreach ops (a list of tensors written at once);
    # each shard written must quantize again at its next gather, not send the bytes of before.
    quantizer = qt.Float8CurrentScaling().quantizer("weight")
    shards = [quant_fsdp.QuantizeOnGatherTensor(torch.randn(64, 32), quantizer) for _ in range(3)]
    before = [s._quantize_shard().dequantize() for s in shards]
    with torch.no_grad():
        torch._foreach_mul_(shards[:2], 2.0)
    for shard, old in zip(shards[:2], before[:2], strict=True):
        assert torch.equal(shard._quantize_shard().dequantize(), quantizer.quantize(shard._data.clone()).dequantize())
        assert not torch.equal(shard._quantize_shard().dequantize(), old)
    assert torch.equal(shards[2]._quantize_shard().dequantize(), before[2])  # not written: not requantized


# Not "fp8-delayed" here: in one process the shards share one quantizer, whose amax history each
# shard's quantization advances (each rank has its own; tests-integration covers it).
@pytest.mark.parametrize("recipe_name", ["fp8", "mxfp8", "fp8-block", "nvfp4"])
def test_quantize_on_gather_equals_quantizing_the_unsharded_weight(recipe_name):
    quantizer = qt.recipe_from_name(recipe_name).quantizer("weight")
    value = torch.randn(256, 128)
    shards = [quant_fsdp.QuantizeOnGatherTensor(c.clone(), quantizer) for c in value.chunk(2)]
    if quantizer.per_tensor_amax:
        # One shard's amax is not the tensor's: per-tensor formats quantize with the group amax
        # (sync_amax_, or the quantizer's amax_group); here it is given as sync_amax_ leaves it.
        for s in shards:
            s._synced_amax = (s._data._version, value.abs().max())
    unsharded, _ = fsdp_gather(shards, 2, 5, value.shape)
    reference = qt.recipe_from_name(recipe_name).quantizer("weight").quantize(value)
    assert_same(unsharded, expected_gather(reference))
    # The shard kept for the backward's gather holds what the gathers send: no columnwise copy
    # where the unsharded tensor derives it (per-tensor FP8, 128 x 128 tiles).
    kept = shards[0]._quantize_shard()
    assert (kept.columnwise_data is None) == quantizer.can_derive_columnwise


@pytest.mark.parametrize("recipe_name", RECIPES)
def test_fallback_gathers_padded_high_precision_and_quantizes_after(recipe_name):
    value = torch.randn(160, 128)  # 4 ranks: shards of 40, 40, 40, 40; and 3 ranks: 54, 54, 52
    for world_size in (3, 4):
        quantizer = qt.recipe_from_name(recipe_name).quantizer("weight")
        padded_rows = -(-160 // world_size)
        shards = []
        for chunk in value.chunk(world_size):
            padded = quant_fsdp.QuantizeOnGatherTensor(torch.zeros(padded_rows, 128), quantizer, fallback=True)
            padded[: chunk.shape[0]].copy_(chunk)
            shards.append(padded[: chunk.shape[0]])  # FSDP2's narrow of the padded shard
        stats_before = quant_fsdp.comm_stats().get(quantizer.format_name, {}).get("fallback", 0)
        unsharded, _ = fsdp_gather(shards, world_size, 5, value.shape)
        reference = qt.recipe_from_name(recipe_name).quantizer("weight").quantize(value)
        assert_same(unsharded, reference)
        stats = quant_fsdp.comm_stats()[quantizer.format_name]["fallback"] - stats_before
        assert (
            stats == world_size * padded_rows * 128 * 4 * world_size
        )  # every rank's padded fp32 shard, counted per rank


def test_gather_only_fallback_hands_over_the_high_precision_weight():
    # A tensor-parallel weight's slice under FSDP2 (fully_shard with quantize_on_gather=True): the
    # TP layer quantizes the gathered slice in its forward, so the hook leaves it high precision.
    quantizer = qt.recipe_from_name("mxfp8").quantizer("weight")
    value = torch.randn(96, 64)
    shards = [
        quant_fsdp.QuantizeOnGatherTensor(c.clone(), quantizer, fallback=True, quantize_after_gather=False)
        for c in value.chunk(2)
    ]
    assert not shards[0].detach()[:8].quantize_after_gather  # FSDP2's views of the shard keep it
    before = quant_fsdp.comm_stats().get(quantizer.format_name, {}).get("fallback", 0)
    unsharded, inner_tensors = fsdp_gather(shards, 2, 5, value.shape)
    assert type(unsharded) is torch.Tensor
    assert inner_tensors == ()
    assert torch.equal(unsharded, value)
    assert quant_fsdp.comm_stats()[quantizer.format_name]["fallback"] - before == 2 * 48 * 64 * 4 * 2
    assert fsdp_gather(shards, 2, 5, value.shape, out=unsharded) is None  # FSDP2 refilled the gathered storage
    with pytest.raises(ValueError, match="quantize_after_gather=False needs fallback=True"):
        quant_fsdp.QuantizeOnGatherTensor(torch.randn(64, 32), quantizer, quantize_after_gather=False)


@pytest.mark.parametrize(
    ("recipe_name", "shape", "world_size", "reason"),
    [
        ("fp8", (64, 32), 4, ""),
        ("fp8", (66, 32), 4, "dim 0 (66) does not split into 4 equal shards"),
        ("fp8", (2, 16, 32), 4, "dim 0 (2) is smaller than the 4 shards"),
        ("mxfp8", (128, 64), 4, ""),
        ("mxfp8", (160, 64), 4, "shards of 40 rows would split MXFP8's 32-row blocks"),
        ("fp8-block", (512, 128), 4, ""),
        ("fp8-block", (384, 128), 4, "shards of 96 rows would split blockwise FP8's 128-row blocks"),
        ("nvfp4", (64, 64), 4, ""),
        ("nvfp4", (96, 64), 4, "shards of 24 rows would split NVFP4's 16-row blocks"),
        ("nvfp4", (4, 8, 64), 2, ""),
    ],
)
def test_fallback_reason(recipe_name, shape, world_size, reason):
    quantizer = qt.recipe_from_name(recipe_name).quantizer("weight")
    assert _plan.fallback_reason(quantizer, shape, world_size) == reason
