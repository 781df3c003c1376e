"""DTensor's collectives on QuantizedTensor shards (quant_tensors._collectives), on 2 gloo ranks.

`DTensor.full_tensor()` (functional all_gather_into_tensor, _wrap_tensor_autograd, wait_tensor)
rebuilds the whole tensor from its dim-0 shards bit for bit, every buffer; `distribute_tensor`
(c10d scatter_ from rank 0) gives each rank its chunk bit for bit; shards whose per-tensor values
differ refuse to gather. Every case runs in one 2-rank world ([Note: shared worlds] in
quant_core.testing); each test reads its case's outcome. Models sharded by FSDP2: tests-integration.
"""

from __future__ import annotations

import pytest
import torch
from quant_tensors_op_test_helpers import CASE_IDS, CASES, SHAPE_2D, SHAPE_3D, present_buffers, quantized, raw
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import quant_tensors as qt
from quant_lab.testing import SharedWorld, run_shared_world

SHAPES = {"2d": SHAPE_2D, "3d": SHAPE_3D}  # every format's blocks split whole between 2 shards


def assert_same_buffers(got: qt.QuantizedTensor, want: qt.QuantizedTensor) -> None:
    assert type(got) is type(want)
    assert (got.shape, got.dtype) == (want.shape, want.dtype)
    got_buffers, want_buffers = present_buffers(got), present_buffers(want)
    assert got_buffers.keys() == want_buffers.keys()
    for name, buffer in want_buffers.items():
        assert got_buffers[name].shape == buffer.shape, name
        assert torch.equal(raw(got_buffers[name]), raw(buffer)), name


def _gather_and_scatter(rank: int, world_size: int, name: str, role: str, shape: tuple[int, ...]) -> None:
    mesh = init_device_mesh("cpu", (world_size,))
    _, whole = quantized(name, role, shape)  # the same seed on every rank
    shard = whole.chunk(world_size)[rank]
    gathered = DTensor.from_local(shard, mesh, [Shard(0)], run_check=False).full_tensor()
    assert_same_buffers(gathered, whole)
    assert torch.equal(gathered.dequantize(), whole.dequantize())
    assert_same_buffers(distribute_tensor(whole, mesh, [Shard(0)]).to_local(), shard)


def _different_per_tensor_values_refuse_to_gather(rank: int, world_size: int) -> None:
    """Shards quantized each with its own amax (no amax_group) are not slices of one tensor."""
    shard = qt.recipe_from_name("nvfp4").quantizer("weight").quantize(torch.randn(32, 64) * (rank + 1))
    weight = DTensor.from_local(shard, init_device_mesh("cpu", (world_size,)), [Shard(0)], run_check=False)
    with pytest.raises(
        ValueError, match=r"cannot gather NVFP4Tensor shards of shape \(32, 64\) whose per-tensor amax differs"
    ):
        weight.full_tensor()


@pytest.fixture(scope="module")
def world_2() -> SharedWorld:
    scenarios = {
        f"{case_id}-{shape_id}": (_gather_and_scatter, (name, role, shape))
        for (name, role), case_id in zip(CASES, CASE_IDS, strict=True)
        for shape_id, shape in SHAPES.items()
    }
    return run_shared_world(2, {**scenarios, "different values": (_different_per_tensor_values_refuse_to_gather, ())})


@pytest.mark.parametrize("shape_id", list(SHAPES))
@pytest.mark.parametrize(("name", "role"), CASES, ids=CASE_IDS)
def test_full_tensor_and_distribute_tensor_move_every_buffer_exactly(world_2, name, role, shape_id):
    world_2.check(f"{name}-{role}-{shape_id}")


def test_shards_with_different_per_tensor_values_refuse_to_gather(world_2):
    world_2.check("different values")
