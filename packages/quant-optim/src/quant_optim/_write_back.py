"""FusedAdam's write-back after the update: quantized weights requantized from their masters
(per-tensor amaxes agreed in one all-reduce per process group), fp8 moments stored from their
fp32 values after each bucket's update ([Note: FusedAdam step] in quant_optim._step)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

import quant_core
import quant_tensors as qt
from quant_optim._plan import Fp8Slot, Plan, Requantize, buffer_versions


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


def store_fp8_moments(slots: list[Fp8Slot], keep: torch.Tensor | None) -> None:
    """Stores fp8 moments from the fp32 values their bucket's update wrote, each with the scale of
    its amax agreed over its parameter's shard groups (one `amax_many` per (shard groups, fp8
    dtype), one all-reduce per shard groups); where `keep` (the step's device verdict, None when the step is
    known to have run) is set, with the scale it was stored with ([Note: fp8 moments on a skipped
    step])."""
    alike: dict[tuple[Any, ...], list[Fp8Slot]] = {}
    for slot in slots:
        alike.setdefault((*map(id, slot.groups), slot.codes.dtype), []).append(slot)
    pending = []
    for same in alike.values():
        values = [slot.values[slot.position] for slot in same]
        store = functools.partial(_store_fp8_moments, same, values, keep)
        pending.append(PendingAmax(same[0].groups, quant_core.amax_many(values), store))
    agree_amaxes_and_apply(pending)


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


def _store_fp8_moments(
    slots: list[Fp8Slot], values: list[torch.Tensor], keep: torch.Tensor | None, amaxes: torch.Tensor
) -> None:
    """Stores fp8 moments of one fp8 dtype from their values with the scales of their agreed
    `amaxes` (1-D, one per slot), or, where `keep` (a device verdict) is set, with the scales
    they were stored with ([Note: fp8 moments on a skipped step]): the scales in a few launches
    for all of them, then one `cast_to_fp8_many` call."""
    dtype = slots[0].codes.dtype
    scales, scales_inv = quant_core.fp8_scale(amaxes, dtype)
    if keep is not None:
        stored_inv = torch.stack([slot.scale_inv for slot in slots])
        kept = torch.reciprocal(stored_inv).clamp_(max=_FLOAT32_MAX)  # 1 / (1 / FLT_MAX) may round up to inf
        scales = torch.where(keep, kept, scales)
        scales_inv = torch.where(keep, stored_inv, scales_inv)
    quant_core.cast_to_fp8_many(values, scales, dtype, [slot.codes for slot in slots])
    torch._foreach_copy_([slot.scale_inv for slot in slots], list(scales_inv.unbind()))


_FLOAT32_MAX = torch.finfo(torch.float32).max

# [Note: fp8 moments on a skipped step] When the skip verdict stays on the device, every step
# stores the fp8 moments, and a skipped step must store the codes it read. Its values are the
# decoded codes, v = fl(c * s_inv) (the Adam kernel wrote nothing), and they are encoded again
# with s = fl(1 / s_inv) (clamped to the largest float, as fp8_scale clamps): fl(v * s) = c (1 + e)
# with |e| <= 3 * 2^-24 for normal s_inv (a few 2^-10 at most for the subnormal s_inv of the
# largest scale), which rounds to c in either fp8 format (neighbouring codes lie 2^-3 (E4M3) or 2^-2
# (E5M2) apart relatively, or, below the normal range, a fixed step apart) and saturates to c at the
# largest code. The state keeps s_inv as it was. tests/test_write_back.py checks this for every
# finite code over the range of scales.
