"""FusedAdam's amax agreements: quantized weights requantized from their masters after the update
(per-tensor amaxes agreed in one all-reduce per process group), and the amaxes of the fp8 moments
agreed before it ([Note: FusedAdam step] in quant_optim._step)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

import quant_core
import quant_tensors as qt
from quant_optim._plan import Bucket, Plan, Requantize, buffer_versions


@dataclass(frozen=True)
class PendingAmax:
    """Local amaxes (a 0-d tensor, or a 1-D one of several) to be agreed over `groups` (MAX),
    then handed to `apply`."""

    groups: tuple[dist.ProcessGroup, ...]
    amax: torch.Tensor | None
    """None where nothing is agreed on (applied with None)."""
    apply: Callable[[torch.Tensor | None], None]


def agree_amaxes_and_apply(pending: list[PendingAmax]) -> None:
    """Agrees every local amax over its groups, one all-reduce (MAX) of them all per set of
    groups, then applies each (with the shape it came with); items without an amax are applied
    as they are."""
    by_groups: dict[tuple[int, ...], list[PendingAmax]] = {}
    for item in pending:
        if item.amax is None:
            item.apply(None)
        else:
            by_groups.setdefault(tuple(id(g) for g in item.groups), []).append(item)
    for items in by_groups.values():
        amaxes = torch.cat([item.amax.reshape(-1) for item in items])
        for group in items[0].groups:  # one group for FSDP; shard dims in turn on a 2-D mesh
            dist.all_reduce(amaxes, op=dist.ReduceOp.MAX, group=group)
        agreed = amaxes.split([item.amax.numel() for item in items])
        for item, amax in zip(items, agreed, strict=True):
            item.apply(amax.view(item.amax.shape))


def write_back(plan: Plan, amaxes: list[torch.Tensor | None]) -> None:
    """Requantizes the plan's quantized weights from their masters, then records their buffer
    versions (`Requantize.written`).

    Per-tensor weights take their amax from `amaxes` (the Adam pass's, one tensor per bucket),
    agreed over their amax group when they have one, alike ones in one `quantize_many_`; block
    formats requantize with one `quantize_many_` per (quantizer configuration, device).
    """
    rows = [a.unbind() if b.compute_amax else None for a, b in zip(amaxes, plan.buckets, strict=True)]
    pending = []
    blocks: dict[int | None, list[Requantize]] = {}
    per_tensor: dict[tuple[int | None, ...], list[Requantize]] = {}
    for r in plan.requantize:
        quantizer = r.local.quantizer
        if not quantizer.per_tensor_amax:  # a block-scaled format: its own scales, alike ones in one call below
            blocks.setdefault(r.like, []).append(r)
        elif r.like is None:  # stateful: one at a time, agreed over the shard group in the all-reduce below
            pending.append(PendingAmax(r.groups, rows[r.bucket][r.position], _requantizer(r.local, r.master)))
        else:  # alike weights of one amax group: their amaxes agreed together, then one quantize_many_
            per_tensor.setdefault((*map(id, r.groups), r.like), []).append(r)
    for same in blocks.values():
        same[0].local.quantizer.quantize_many_([r.master for r in same], [r.local for r in same])
    for same in per_tensor.values():
        local_amaxes = torch.stack([rows[r.bucket][r.position] for r in same])
        pending.append(PendingAmax(same[0].groups, local_amaxes, functools.partial(_requantize_many, same)))
    if pending:
        agree_amaxes_and_apply(pending)
    for r in plan.requantize:
        r.written[0] = buffer_versions(r.local)


def agree_moment_amaxes(buckets: list[Bucket], local: list[torch.Tensor]) -> list[torch.Tensor]:
    """The fp8 moments' amaxes of every bucket (`local[b]`: the (rows, len(params)) amaxes of
    `adam_moment_amaxes`), each agreed over its parameter's shard groups: one all-reduce (MAX) per
    set of groups and device for all buckets together. Returns the agreed amaxes, one contiguous
    (rows, len(params)) tensor per bucket."""
    agreed = list(local)
    by_device: dict[torch.device, list[PendingAmax]] = {}
    for b, (bucket, amaxes) in enumerate(zip(buckets, local, strict=True)):
        columns: dict[tuple[int, ...], tuple[tuple[dist.ProcessGroup, ...], list[int]]] = {}
        for i, groups in enumerate(bucket.shard_groups):
            columns.setdefault(tuple(map(id, groups)), (groups, []))[1].append(i)
        pending = by_device.setdefault(bucket.device, [])
        for groups, chosen in columns.values():
            if not groups:  # parameters that are not sharded: their amaxes are the whole moments' already
                continue
            if len(chosen) == len(bucket.shard_groups):  # the usual case: one set of groups per bucket
                pending.append(PendingAmax(groups, amaxes, functools.partial(agreed.__setitem__, b)))
                continue
            if agreed[b] is amaxes:
                agreed[b] = amaxes.clone()
            index = torch.tensor(chosen, device=amaxes.device)
            pending.append(PendingAmax(groups, amaxes[:, index], functools.partial(_put_columns, agreed[b], index)))
    for pending in by_device.values():
        agree_amaxes_and_apply(pending)
    return agreed


def _put_columns(out: torch.Tensor, index: torch.Tensor, amaxes: torch.Tensor) -> None:
    out[:, index] = amaxes


def requantize_from_master(local: qt.QuantizedTensor, master: torch.Tensor) -> PendingAmax:
    """The requantization of a loaded quantized weight from its master (an amax to agree on for
    per-tensor formats, over the group the weight's shards share it in)."""
    quantizer = local.quantizer
    if not quantizer.per_tensor_amax:
        return PendingAmax((), None, lambda amax: quantizer.quantize_(master, local))
    groups = () if quantizer.amax_group is None else (quantizer.amax_group,)
    return PendingAmax(groups, quant_core.amax_many([master])[0], _requantizer(local, master))


def _requantize_many(same: list[Requantize], amaxes: torch.Tensor) -> None:
    same[0].local.quantizer.quantize_many_([r.master for r in same], [r.local for r in same], amaxes=amaxes)


def _requantizer(local: qt.QuantizedTensor, master: torch.Tensor) -> Callable[[torch.Tensor | None], None]:
    return functools.partial(_requantize_into, local.quantizer, master, local)


def _requantize_into(
    quantizer: qt.Quantizer, master: torch.Tensor, local: qt.QuantizedTensor, amax: torch.Tensor
) -> None:
    quantizer.quantize_(master, local, amax=amax)
