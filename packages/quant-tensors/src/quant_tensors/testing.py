"""Helpers for tests of FSDP2's all-gather of quantized tensors in one process: FSDP2's gather is
simulated by concatenating the all-gather inputs of every shard along dim 0, as its all-gather +
copy-out does ([Note: quantized all-gather] in quant_tensors._fsdp)."""

from __future__ import annotations

from typing import Any

import torch

from quant_tensors._tensor import QuantizedTensor


class FakeMesh:
    """The part of a DeviceMesh the all-gather hooks use (no process group)."""

    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size

    def get_group(self) -> None:
        return None


def fsdp_gather(shards: list[Any], world_size: int, signature: int, full_shape: Any, out: Any = None) -> Any:
    """What FSDP2's unshard makes of `shards` (one per rank, each with the all-gather hooks):
    `fsdp_post_all_gather`'s result, calling `fsdp_pre_all_gather` with its 1- or 5-argument
    `signature` and refilling `out` when given."""
    mesh = FakeMesh(world_size)
    results = [
        s.fsdp_pre_all_gather(mesh) if signature == 1 else s.fsdp_pre_all_gather(mesh, full_shape, None, None, None)
        for s in shards
    ]
    inputs = [r[0] for r in results]
    outputs = tuple(torch.cat([i[k] for i in inputs]) for k in range(len(inputs[0])))
    return shards[0].fsdp_post_all_gather(outputs, results[0][1], torch.float32, out=out)


def assert_same(a: QuantizedTensor, b: QuantizedTensor) -> None:
    """a and b are of one class and shape and hold the same buffers, bit for bit."""
    assert type(a) is type(b)
    assert a.shape == b.shape
    for name, buffer in b.buffers().items():
        got = getattr(a, name)
        assert (got is None) == (buffer is None), name
        if buffer is not None:
            assert torch.equal(got.reshape(-1).view(torch.uint8), buffer.reshape(-1).view(torch.uint8)), name


def expected_gather(full: QuantizedTensor) -> QuantizedTensor:
    """What a gather rebuilds of `full`: formats that derive columnwise locally gather rowwise only."""
    if full.quantizer.can_derive_columnwise:
        full = full._rebuilt()
        full.update_usage(columnwise=False)
    return full
