"""Per-tensor FP8 over gloo: quantize shards with the all-reduced amax, all-gather the bytes.

This is the invariant FSDP2's quantized all-gather stands on (docs/design.md, 'FSDP2'): the gathered
codes must equal the quantization of the unsharded tensor bit for bit, at every world size.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import quant_core
from quant_core.testing import adversarial
from quant_lab.testing import SharedWorld, run_shared_world


def _gather_quantized_shards(rank: int, world_size: int, fp8_dtype: torch.dtype, power_2_scales: bool) -> None:
    full = adversarial((96, 80), torch.bfloat16, seed=7)  # every rank builds the same tensor
    shard = full.chunk(world_size, dim=0)[rank]
    amax = quant_core.amax(shard)
    dist.all_reduce(amax, op=dist.ReduceOp.MAX)
    scale, scale_inv = quant_core.fp8_scale(amax, fp8_dtype, power_2_scales=power_2_scales)
    rowwise, columnwise = quant_core.cast_to_fp8(shard, scale, fp8_dtype, columnwise=True)
    gathered_rows = torch.empty(full.shape, dtype=torch.uint8)
    dist.all_gather_into_tensor(gathered_rows, rowwise.view(torch.uint8))
    # Columnwise shards are (K, rows / world_size): gather them as a list and join along dim 1.
    columnwise_parts = [torch.empty_like(columnwise.view(torch.uint8)) for _ in range(world_size)]
    dist.all_gather(columnwise_parts, columnwise.view(torch.uint8))

    expected = quant_core.quantize_fp8(full, fp8_dtype, power_2_scales=power_2_scales, columnwise=True)
    assert torch.equal(amax, expected.amax)
    assert torch.equal(scale_inv, expected.scale_inv)
    assert torch.equal(gathered_rows, expected.rowwise_data.view(torch.uint8))
    assert torch.equal(torch.cat(columnwise_parts, dim=1), expected.columnwise_data.view(torch.uint8))


CASES = [(torch.float8_e4m3fn, False), (torch.float8_e5m2, True)]


@pytest.fixture(scope="module", params=[1, 2, 4])
def world_size(request: pytest.FixtureRequest) -> SharedWorld:
    """One world per world size runs every case ([Note: shared worlds] in quant_lab.testing)."""
    return run_shared_world(request.param, {str(case): (_gather_quantized_shards, case) for case in CASES})


@pytest.mark.parametrize(("fp8_dtype", "power_2_scales"), CASES)
def test_sharded_quantize_then_gather_equals_unsharded(world_size, fp8_dtype, power_2_scales):
    world_size.check(str((fp8_dtype, power_2_scales)))
