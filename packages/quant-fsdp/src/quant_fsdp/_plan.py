"""The gather plan: which parameters FSDP2 gathers quantized, which take the explicit fallback, and why.

[Note: alignment policy] A quantized shard can be gathered as bytes only if it is a quantized
tensor on its own: FSDP2's shards must be equal (FSDP2 pads unequal ones, and then insists every
all-gather input has the padded parameter shape, which scales cannot have), at least one row of
dim 0 each, and start on the format's block rows (`Quantizer.row_alignment`: 1 for per-tensor FP8,
32 for MXFP8, 128 for blockwise 128x128, 16 for NVFP4 16x16). Any other parameter takes the
fallback: its shard stays high precision, FSDP2 gathers it in high precision (or the
MixedPrecisionPolicy's param_dtype) and the hook quantizes the unsharded tensor. Tensor-parallel
weights (DTensors of quant_fsdp.parallel) in quantize-on-gather mode take the fallback too:
FSDP2 gathers their high-precision TP slices and the TP layer quantizes its slice in the forward
(quantized gathers of TP slices are not built). The decision is made once, in
`quant_fsdp.fully_shard`, logged once per parameter, shown by `gather_plan` and counted in
`comm_stats()`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

QUANTIZED_WEIGHTS = "quantized weights"
QUANTIZE_ON_GATHER = "quantize on gather"


@dataclass(frozen=True)
class GatherPlan:
    """How FSDP2 gathers one quantized parameter."""

    name: str
    """Fully qualified parameter name under the module passed to fully_shard."""
    format: str
    """The weight quantizer's format."""
    shape: tuple[int, ...]
    """The unsharded shape."""
    mode: str
    """"quantized weights" (the shard is a QuantizedTensor) or "quantize on gather" (high precision)."""
    fallback_reason: str
    """Why the parameter gathers in high precision and is quantized after; "" when it gathers quantized bytes."""

    @property
    def quantized_gather(self) -> bool:
        return not self.fallback_reason


def check_ranks_agree(plans: Sequence[GatherPlan], mesh: Any) -> None:
    """Raises the same ValueError on every rank of `mesh` if its ranks would gather differently.

    FSDP2 sizes each all-gather from the local shard, so ranks whose weights differ in format,
    shape or weight mode would hang in the collective or rebuild garbage from each other's bytes.
    One all_gather_object of the plans per mesh dim, when fully_shard is called, finds that first.
    """
    mine = [(p.name, p.format, p.shape, p.mode) for p in plans]
    for dim in range(mesh.ndim):
        group = mesh.get_group(dim)
        every: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(every, mine, group=group)
        for rank, theirs in enumerate(every[1:], start=1):
            if theirs != every[0]:
                raise ValueError(
                    _disagreement(every[0], theirs, dist.get_global_rank(group, 0), dist.get_global_rank(group, rank))
                )


def _disagreement(first: list[tuple], other: list[tuple], first_rank: int, other_rank: int) -> str:
    def describe(entry: tuple | None) -> str:
        return "not a quantized weight" if entry is None else f"{entry[1]}, shape {entry[2]}, {entry[3]}"

    by_name = [dict((e[0], e) for e in plan) for plan in (first, other)]
    names = [e[0] for e in first] + [e[0] for e in other if e[0] not in by_name[0]]
    name = next(n for n in names if by_name[0].get(n) != by_name[1].get(n))
    return (
        f"quant_fsdp.fully_shard: ranks {first_rank} and {other_rank} would gather {name} differently "
        f"(rank {first_rank}: {describe(by_name[0].get(name))}; rank {other_rank}: {describe(by_name[1].get(name))}), "
        "which would hang the all-gather or mix their bytes. Build and qt.convert the model the same way on every "
        "rank (same recipe, quantized_weights, module_filter_fn) before sharding; nothing was sharded."
    )


TENSOR_PARALLEL_REASON = (
    "it is a tensor-parallel slice, which its TP layer quantizes after the gather (quantized gathers of TP "
    "slices are not built)"
)


def fallback_reason(quantizer: Any, shape: tuple[int, ...], world_size: int, *, tensor_parallel: bool = False) -> str:
    """Why a parameter of `shape` sharded over `world_size` cannot gather quantized ("" if it can);
    `tensor_parallel`: the parameter is a TP DTensor, which always takes the fallback."""
    if tensor_parallel:
        return TENSOR_PARALLEL_REASON
    if not shape:
        return "it is 0-d"
    rows = shape[0]
    if rows < world_size:
        return f"dim 0 ({rows}) is smaller than the {world_size} shards"
    if rows % world_size:
        return f"dim 0 ({rows}) does not split into {world_size} equal shards"
    shard_rows = rows // world_size * math.prod(shape[1:-1])
    alignment = quantizer.row_alignment
    if shard_rows % alignment:
        return f"shards of {shard_rows} rows would split {quantizer.format_name}'s {alignment}-row blocks"
    return ""


# ---- reporting --------------------------------------------------------------------------------------

_PLAN_ATTRIBUTE = "_quant_fsdp_gather_plan"


def record(module: torch.nn.Module, plans: tuple[GatherPlan, ...]) -> None:
    setattr(module, _PLAN_ATTRIBUTE, plans)


def gather_plan(module: torch.nn.Module) -> tuple[GatherPlan, ...]:
    """The gather plan `quant_fsdp.fully_shard` made for `module` and every submodule it sharded
    (blocks first sharded on their own, then the root), parameter names relative to `module`."""
    plans: list[GatherPlan] = []
    sharded = False
    for prefix, submodule in module.named_modules():
        recorded = getattr(submodule, _PLAN_ATTRIBUTE, None)
        if recorded is not None:
            sharded = True
            plans += [replace(plan, name=f"{prefix}.{plan.name}" if prefix else plan.name) for plan in recorded]
    if not sharded:
        raise ValueError(
            f"neither {type(module).__name__} nor any of its submodules was sharded by quant_fsdp.fully_shard; "
            "it has no gather plan"
        )
    return tuple(plans)


def print_plan(module: torch.nn.Module) -> None:
    """Prints `gather_plan(module)` as a plain-text table, on rank 0 only: one row per line with whole
    names and reasons, however narrow the terminal or log."""
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    rows = [("parameter", "format", "shape", "mode", "all-gather")]
    for plan in gather_plan(module):
        gather = (
            "quantized bytes" if plan.quantized_gather else f"high precision, then quantize: {plan.fallback_reason}"
        )
        rows.append((plan.name, plan.format, str(plan.shape), plan.mode, gather))
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * width for width in widths))
    print(f"quant_fsdp gather plan: {type(module).__name__}", *lines, sep="\n")
