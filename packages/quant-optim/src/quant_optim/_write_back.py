"""What FusedAdam's write-back shares between its steps: per-tensor amaxes agreed in one all-reduce."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import quant_tensors as qt


@dataclass(frozen=True)
class PendingAmax:
    """A local amax to be agreed over `groups` (MAX), then handed to `apply`."""

    groups: tuple[dist.ProcessGroup, ...]
    amax: torch.Tensor | None
    """None where nothing is agreed on (applied with None)."""
    apply: Callable[[torch.Tensor | None], None]


def agree_amaxes_and_apply(pending: list[PendingAmax]) -> None:
    """Agrees every local amax over its groups, one stacked all-reduce (MAX) per set of groups,
    then applies each; items without an amax are applied as they are."""
    by_groups: dict[tuple[int, ...], list[PendingAmax]] = {}
    for item in pending:
        if item.amax is None:
            item.apply(None)
        else:
            by_groups.setdefault(tuple(id(g) for g in item.groups), []).append(item)
    for items in by_groups.values():
        amaxes = torch.stack([item.amax for item in items])
        for group in items[0].groups:  # one group for FSDP; shard dims in turn on a 2-D mesh
            dist.all_reduce(amaxes, op=dist.ReduceOp.MAX, group=group)
        for item, amax in zip(items, amaxes, strict=True):
            item.apply(amax)


def requantize_into(
    quantizer: qt.Quantizer, master: torch.Tensor, local: qt.QuantizedTensor, amax: torch.Tensor
) -> None:
    quantizer.quantize_(master, local, amax=amax)


def shard_groups(p: torch.Tensor) -> tuple[dist.ProcessGroup, ...]:
    """The groups over whose ranks `p` is split: the mesh dims with a Shard placement."""
    if not isinstance(p, DTensor):
        return ()
    return tuple(p.device_mesh.get_group(dim) for dim, placement in enumerate(p.placements) if placement.is_shard())
