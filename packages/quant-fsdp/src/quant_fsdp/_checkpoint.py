"""Loading a quantized weight's model entry from a checkpoint saved in its other form (DCP).

A quantized primary weight has two forms ([Note: checkpoints across weight forms] in
quant_optim._adam): quantized (its shards hold whole blocks) or, where its shards would split
blocks, the fallback's high-precision shard. The model state dict holds each weight in the form
of the layout that saved it, so torch.distributed.checkpoint (DCP) reads chunks of one form into
a weight of the other. DCP narrows both to their overlap, and a quantized tensor cannot be cut
inside a block; so the local tensors of the weights `quant_fsdp.fully_shard` shards take part in
DCP's load protocol (DTensor hands `__create_chunk_list__` and `__get_tensor_shard__` to them):

- quantized weight (QuantizedTensor local): DCP reads into a `_LoadWindow` over it. A quantized
  chunk (whole blocks: it was quantized on its layout) is copied as bytes, bit for bit; chunks of
  the high-precision form are staged in a high-precision tensor of the shard's shape and, once
  every row has arrived, quantized into the weight. Formats with a per-tensor amax need the
  shard group's amax for that, a collective that cannot run inside DCP's reads (ranks read
  different chunks): those wait in the weight's context for `requantize_pending`, which
  `quant_fsdp.fully_shard`'s load_state_dict post-hook calls (set_state_dict, or
  model.load_state_dict after dcp.load), and else the weight's next all-gather. A write to the weight
  in between (FusedAdam requantizing it from its master) cancels the staged value.
- fallback weight (QuantizeOnGatherTensor local): its shard starts or ends inside a block, so
  DCP would cut a quantized chunk there. It asks DCP for the rows of the whole blocks around its
  shard instead (`__create_chunk_list__`), reads them into a high-precision staging tensor
  (quantized chunks dequantized, whole blocks), and copies its own rows into the shard once
  they have all arrived. Its value is then the dequantized weight; FusedAdam's load then writes
  the master in. A gather-only wrapper (a tensor-parallel weight's slice under FSDP2, never a
  quantized primary weight) loads its own rows, as a plain DTensor's local tensor would.

The weights' local tensors find their parameter's placement (global shape, mesh, placements)
through their quantizer's shard context (`quant_fsdp._context.ShardedWeight`; DCP hands over the
detached local of a state dict entry, a new object each time, never the parameter). The placement
is kept, not a weak reference to the parameter: `module.to_empty()` after meta-device init swaps
parameters with `torch.utils.swap_tensors`, which refuses a tensor that has a weak reference. A
load in progress is held by the local tensor DCP reads into (`_LOAD_TARGET`), a value staged for a
collective by the weight's context (`pending`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from quant_tensors import QuantizedTensor, Quantizer

aten = torch.ops.aten


@dataclass(frozen=True)
class Placement:
    """Where a sharded parameter's local tensor lies in the whole tensor."""

    shape: tuple[int, ...]
    mesh: Any
    placements: tuple[Any, ...]

    @classmethod
    def of(cls, param: torch.Tensor) -> Placement:
        """The placement of a DTensor parameter."""
        return cls(tuple(param.shape), param.device_mesh, tuple(param.placements))


# The attribute of a state dict entry's local tensor that holds its load target while DCP reads into it.
_LOAD_TARGET = "_quant_fsdp_load_target"


@dataclass(eq=False)
class Pending:
    """A quantized weight's high-precision value, staged from a checkpoint, waiting for a collective."""

    local: QuantizedTensor
    values: torch.Tensor
    versions: tuple[int, ...]
    """The weight's buffer versions when staged: a later write (a requantize from the master) wins."""


def _placement(local: torch.Tensor) -> Placement | None:
    context = local.quantizer.shard_context if local.quantizer is not None else None
    return getattr(context, "placement", None)


def _versions(t: QuantizedTensor) -> tuple[int, ...]:
    return tuple(b._version for b in t.buffers().values() if b is not None)


def requantize_pending(context: Any) -> None:
    """Quantizes the weight value `context` staged from a high-precision checkpoint entry, whose
    format needs the shard group's amax (a collective: every rank calls this for the same weights,
    in the same order), unless the weight was written since."""
    pending, context.pending = context.pending, None
    if pending is not None and _versions(pending.local) == pending.versions:
        pending.local.quantizer.quantize_(pending.values, pending.local)


class RequantizePendingHook:
    """load_state_dict post-hook of a module fully_shard shards: requantizes the staged values of
    the weights it sharded (`requantize_pending`), in the order of their names."""

    def __init__(self, contexts: list[Any]) -> None:
        self.contexts = sorted(contexts, key=lambda c: c.name)

    def __call__(self, module: torch.nn.Module, incompatible_keys: Any) -> None:
        for context in self.contexts:
            requantize_pending(context)


# ---- the protocol methods ---------------------------------------------------------------------


def quantized_local_for_checkpoint(self: QuantizedTensor, context: Any) -> torch.Tensor:
    """`__get_tensor_shard__` of a QuantizedTensor whose weight fully_shard shards (`context`: its
    ShardedWeight): a load window over the shard once it is placed; the tensor itself before."""
    if context.placement is None:
        return self
    target = getattr(self, _LOAD_TARGET, None)
    if target is None:
        target = _QuantizedTarget(self, context)
        setattr(self, _LOAD_TARGET, target)
    return _LoadWindow(target, 0, self.shape[0])


def high_precision_chunks_for_loading(local: torch.Tensor) -> list[ChunkStorageMetadata]:
    """`__create_chunk_list__` of a QuantizeOnGatherTensor (called when DCP plans a load): its
    chunk, widened to whole blocks when it starts or ends inside one (not for a gather-only one)."""
    placement = _placement(local)
    if placement is None:
        raise RuntimeError(
            f"a QuantizeOnGatherTensor of shape {tuple(local.shape)} is not a parameter sharded by "
            "quant_fsdp.fully_shard; torch.distributed.checkpoint cannot place it"
        )
    sizes, offsets = compute_local_shape_and_global_offset(placement.shape, placement.mesh, placement.placements)
    start, stop = offsets[0], offsets[0] + sizes[0]
    if local.quantize_after_gather:  # a gather-only TP slice reads DCP's own chunk, as a plain local does
        start, stop = _block_cover(local.quantizer, placement.shape, start, stop)
    if (start, stop) != (offsets[0], offsets[0] + sizes[0]):
        setattr(local, _LOAD_TARGET, _HighPrecisionTarget(local, start, stop - start, offsets[0] - start))
    return [ChunkStorageMetadata(torch.Size((start, *offsets[1:])), torch.Size((stop - start, *sizes[1:])))]


def high_precision_local_for_checkpoint(local: torch.Tensor, index: MetadataIndex) -> torch.Tensor:
    """`__get_tensor_shard__` of a QuantizeOnGatherTensor: the staging window of a load that reads
    whole blocks around the shard, else the shard itself."""
    target = getattr(local, _LOAD_TARGET, None)
    return local if target is None else _LoadWindow(target, 0, target.values.shape[0])


def _block_cover(quantizer: Quantizer, shape: tuple[int, ...], start: int, stop: int) -> tuple[int, int]:
    """Dim-0 indices [start, stop) widened to the format's block rows ([Note: alignment policy])."""
    if stop == start:
        return start, stop
    rows_per_index = math.prod(shape[1:-1]) if len(shape) > 1 else 1
    step = quantizer.row_alignment // math.gcd(quantizer.row_alignment, rows_per_index)
    return start // step * step, min(-(-stop // step) * step, shape[0])


# ---- load targets -----------------------------------------------------------------------------


class _QuantizedTarget:
    """A quantized weight's shard as DCP loads it: quantized chunks as bytes, others staged."""

    def __init__(self, local: QuantizedTensor, context: Any) -> None:
        self.local, self.context = local, context
        self.values: torch.Tensor | None = None
        self.rows_missing = local.shape[0]

    def write(self, start: int, source: torch.Tensor) -> None:
        rows = source.shape[0]
        if isinstance(source, QuantizedTensor):  # whole blocks, quantized on the layout that saved them
            self.local[start : start + rows].copy_(source)
            return
        if self.values is None:
            self.values = torch.empty(self.local.shape, dtype=self.local.dtype, device=self.local.device)
        self.values[start : start + rows].copy_(source)
        self.rows_missing -= rows
        if self.rows_missing == 0:
            delattr(self.local, _LOAD_TARGET)
            if self.local.quantizer.amax_group_name is None:  # no per-tensor amax to agree on: now
                self.local.quantizer.quantize_(self.values, self.local)
            else:
                self.context.pending = Pending(self.local, self.values, _versions(self.local))


class _HighPrecisionTarget:
    """Whole blocks around a fallback weight's shard, staged in high precision while DCP loads them."""

    def __init__(self, local: torch.Tensor, start: int, rows: int, shard_start: int) -> None:
        self.local = local
        self.values = torch.empty((rows, *local.shape[1:]), dtype=local.dtype, device=local.device)
        self.shard = (shard_start, shard_start + local.shape[0])
        self.rows_missing = rows  # DCP reads every row it was asked for, in any order

    def write(self, start: int, source: torch.Tensor) -> None:
        self.values[start : start + source.shape[0]].copy_(source)  # a quantized chunk is dequantized
        self.rows_missing -= source.shape[0]
        if self.rows_missing == 0:
            delattr(self.local, _LOAD_TARGET)
            self.local.copy_(self.values[self.shard[0] : self.shard[1]])


class _LoadWindow(torch.Tensor):
    """Rows [start, start + rows) of a load target: what DCP narrows and copies a saved chunk into.

    DCP asks for the same object when it saves (`__get_tensor_shard__` serves both): its writer
    copies the tensor (`clone`, or `_to_copy` to the CPU) before `torch.save`, and gets the
    weight's own local tensor then.
    """

    target: _QuantizedTarget | _HighPrecisionTarget
    start: int

    @staticmethod
    def __new__(cls, target: _QuantizedTarget | _HighPrecisionTarget, start: int, rows: int):
        like = target.local
        return torch.Tensor._make_wrapper_subclass(cls, (rows, *like.shape[1:]), dtype=like.dtype, device=like.device)

    def __init__(self, target: _QuantizedTarget | _HighPrecisionTarget, start: int, rows: int) -> None:
        self.target, self.start = target, start

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        window: _LoadWindow = args[0]
        if func in (aten.detach.default, aten.alias.default):
            return cls(window.target, window.start, window.shape[0])
        if func is aten.slice.Tensor:
            return window._rows(*args[1:], **kwargs)
        if func is aten.copy_.default:
            window.target.write(window.start, args[1])
            return window
        if func in (aten.clone.default, aten._to_copy.default) and window.shape == window.target.local.shape:
            return func(window.target.local, *args[1:], **kwargs)  # DCP's writer saving the weight
        raise NotImplementedError(f"{func} is not supported on a checkpoint load window (DCP narrows and copies)")

    def _rows(self, dim: int = 0, start: int | None = None, end: int | None = None, step: int = 1) -> _LoadWindow:
        size = self.shape[dim]
        start, end, _ = slice(start, end, step).indices(size)
        if (start, end) == (0, size):
            return self
        if dim != 0 or step != 1:
            raise NotImplementedError(
                f"a checkpoint chunk split along dim {dim} (step {step}) cannot be read into a quantized weight's "
                "shard: quant-fsdp loads chunks split along dim 0 (FSDP2's shards)"
            )
        return _LoadWindow(self.target, self.start + start, end - start)

    def untyped_storage(self) -> torch.UntypedStorage:  # type: ignore[override]
        """None of its own (DCP's writer then copies the tensor: see the class docstring)."""
        return torch.UntypedStorage(0, device=self.device)

    def __reduce_ex__(self, protocol: int):
        return self.target.local.__reduce_ex__(protocol)
