"""FSDP2 all-gather of quantized shards: what each format sends, and how the unsharded tensor is rebuilt.

[Note: quantized all-gather] FSDP2 calls `fsdp_pre_all_gather` on each parameter's local shard
and all-gathers the tensors it returns (concatenated along dim 0 across ranks), then calls
`fsdp_post_all_gather` with the gathered tensors to build the unsharded parameter; from the second
unshard on it passes that parameter back as `out=` to be refilled in place. Shards taking this
path are equal (even shards) and start on the format's block rows (`Quantizer.row_alignment`),
so gathering along dim 0 rebuilds the unsharded buffers exactly:

- rowwise data and rowwise block scales (both follow the (M, K) view) concatenate along dim 0:
  the gathered tensors *are* the unsharded buffers (views, no copy);
- per-tensor values (the FP8 scale, the NVFP4 global amax) are not gathered: quantizers with an
  `amax_group` make them equal on every shard, so the local one is the unsharded one;
- columnwise buffers hold x^T, whose shards concatenate along dim 1: they are gathered as they
  are and transposed blockwise into buffers the unsharded tensor owns (one copy);
- formats whose columnwise data is a lossless transpose of rowwise (per-tensor FP8, 128x128 and
  16x16 tiles) gather rowwise only; qt.nn.Linear derives columnwise for dgrad and drops it.
  Formats with 1-D blocks (MXFP8) gather rowwise for the forward and columnwise for the backward
  when FSDP2 gathers again in the backward (reshard_after_forward), both at once otherwise.

[Note: refilled unsharded buffers] From the second unshard on, every buffer of the unsharded
tensor is refilled in place (FSDP2 frees and re-allocates the storage in between), and the backward
reads the buffers the forward had: under torch.compile, AOTAutograd saves the forward's inner
tensors of the unsharded weight for the compiled backward, which cannot see buffers swapped in by
the backward's gather. So (1) the unsharded tensor of a split gather (MXFP8) holds its columnwise
buffers from the forward on (stale until the backward's gather refills them; only the backward
reads them; `usages` says which buffers a tensor holds), and (2) refills keep the buffers' version counters, as FSDP2 does for its own
all-gather outputs: autograd checks them on saved tensors, and a refill writes the same weight.

FSDP2 sizes its gather buffers on the first unshard, so every later gather of a parameter must
send the same number of tensors with the same sizes: the forward and backward payloads of 1-D
block formats do (rows * K codes and rows * K / block scales either way).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from quant_fsdp import _plan
from quant_fsdp._stats import count_gather
from quant_tensors import QuantizedTensor

_USAGES = ("rowwise", "columnwise")


@dataclass(frozen=True)
class Payload:
    """What the pre-all-gather hook tells the post-all-gather hook (FSDP2's all-gather metadata)."""

    shard: QuantizedTensor
    """The local shard: class, metadata and per-tensor values of the unsharded tensor."""
    names: tuple[str, ...]
    """The buffer each all-gather input holds, in order."""
    world_size: int
    packed: tuple[tuple[torch.dtype, torch.Size], ...] | None = None
    """Dtype and shape of each input when they travel as one byte tensor (world size 1)."""


def in_backward() -> bool:
    """Whether autograd is running a backward pass (FSDP2 unshards for the backward from its hooks)."""
    return torch._C._current_graph_task_id() != -1


def gathered_usages(shard: QuantizedTensor) -> tuple[bool, bool]:
    """(rowwise, columnwise) this gather sends ([Note: quantized all-gather])."""
    if shard.columnwise_data is None or shard.quantizer.can_derive_columnwise:
        return True, False
    if shard.rowwise_data is None:
        return False, True
    if _plan.mode_of_backward_gathers(shard.quantizer, _usage_payloads_match(shard)) == "both":
        return True, True
    return (False, True) if in_backward() else (True, False)


def _usage_payloads_match(shard: QuantizedTensor) -> bool:
    """Whether the rowwise and columnwise payloads have equal sizes (so they can share FSDP2's buffers)."""
    sizes = [tuple(t.numel() for t in shard.usage_buffers(usage)) for usage in _USAGES]
    return sizes[0] == sizes[1]


def pre_all_gather(shard: QuantizedTensor, world_size: int) -> tuple[tuple[torch.Tensor, ...], Payload]:
    """The all-gather inputs of a quantized shard and the metadata to rebuild it."""
    inputs, names = payload_of(shard, gathered_usages(shard), world_size)
    if world_size == 1 and len(inputs) > 1:
        # FSDP2 (torch 2.11 to 2.13) copies only the first input when its shard group has one rank.
        packed = tuple((t.dtype, t.shape) for t in inputs)
        pieces = []
        for t in inputs:  # each piece starts 16-byte aligned, so every dtype can view its bytes
            pieces += [t.reshape(-1).view(torch.uint8), t.new_zeros(-_nbytes(t.dtype, t.shape) % 16, dtype=torch.uint8)]
        return (torch.cat(pieces),), Payload(shard, tuple(names), world_size, packed)
    return tuple(inputs), Payload(shard, tuple(names), world_size)


def payload_of(
    shard: QuantizedTensor, usages: tuple[bool, bool], world_size: int
) -> tuple[list[torch.Tensor], list[str]]:
    """The all-gather inputs of a shard's wanted (rowwise, columnwise) usages: data and non-scalar
    scales as bytes (a 0-d scale is per-tensor: it stays local), with their buffer names; counted
    in comm_stats as quantized bytes."""
    inputs: list[torch.Tensor] = []
    names: list[str] = []
    for usage, wanted in zip(_USAGES, usages, strict=True):
        if not wanted:
            continue
        data, scale_inv = shard.usage_buffers(usage)
        for name, buffer in ((f"{usage}_data", data), (f"{usage}_scale_inv", scale_inv)):
            if buffer.dim() > 0:
                inputs.append(_as_bytes(buffer.contiguous()))
                names.append(name)
    count_gather(shard.quantizer.format_name, inputs, world_size, quantized=True)
    return inputs, names


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """FP8 codes travel as uint8: collectives (gloo, older NCCL) have no FP8 types."""
    return t.view(torch.uint8) if t.dtype.itemsize == 1 else t


def _unpacked(outputs: tuple[torch.Tensor, ...], payload: Payload) -> tuple[torch.Tensor, ...]:
    """The inputs of a packed (world size 1) gather, as views of the gathered bytes."""
    if payload.packed is None:
        return outputs
    (flat,) = outputs
    views, offset = [], 0
    for dtype, shape in payload.packed:
        nbytes = _nbytes(dtype, shape)
        views.append(flat[offset : offset + nbytes].view(dtype).view(shape))
        offset += nbytes + -nbytes % 16
    return tuple(views)


def _nbytes(dtype: torch.dtype, shape: torch.Size) -> int:
    return math.prod(shape) * dtype.itemsize


def post_all_gather(
    owner: Any,
    outputs: tuple[torch.Tensor, ...],
    payload: Payload,
    param_dtype: torch.dtype,
    out: QuantizedTensor | None,
) -> tuple[QuantizedTensor, tuple[torch.Tensor, ...]] | None:
    """Builds (or, with `out`, refills) the unsharded tensor from the gathered buffers.

    `owner` is the object FSDP2 calls the hooks on (the sharded local tensor); it keeps the
    unsharded columnwise buffers between unshards. Returns (tensor, buffers FSDP2 frees on
    reshard) the first time, None when `out` was refilled.
    """
    shard, world_size = payload.shard, payload.world_size
    gathered = {
        name: output.view(getattr(shard, name).dtype)
        for name, output in zip(payload.names, _unpacked(outputs, payload), strict=True)
    }
    columnwise = _columnwise_buffers(owner, shard, world_size)
    buffers: dict[str, torch.Tensor | None] = {}
    for name, local in shard.buffers().items():
        if name in gathered and name.startswith("rowwise"):
            buffers[name] = gathered[name]  # already the unsharded buffer ([Note: quantized all-gather])
        elif name in gathered:
            buffers[name] = _join_columns(gathered[name], columnwise[name], world_size)
        elif name in columnwise:  # split gathers: [Note: refilled unsharded buffers]
            buffers[name] = columnwise[name]
        elif local is not None and local.dim() == 0:  # per-tensor: equal on every shard
            buffers[name] = local.clone() if out is None else _refill(getattr(out, name), local)
        else:
            buffers[name] = None
    if out is not None:
        for name, buffer in buffers.items():
            setattr(out, name, buffer)
        return None
    shape = (world_size * shard.shape[0], *shard.shape[1:])
    unsharded = type(shard)(shape, param_dtype, **buffers, **shard.metadata())
    return unsharded, tuple(columnwise.values())


def keeping_versions(*tensors: torch.Tensor) -> torch.autograd._unsafe_preserve_version_counter:
    """A context that hides its in-place writes to `tensors` from autograd's version counters:
    refills of an unsharded tensor's buffers ([Note: refilled unsharded buffers])."""
    return torch.autograd._unsafe_preserve_version_counter(tensors)


def _refill(target: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    with keeping_versions(target):
        return target.copy_(value)


def _columnwise_buffers(owner: Any, shard: QuantizedTensor, world_size: int) -> dict[str, torch.Tensor]:
    """The unsharded columnwise buffers `owner` keeps for formats that gather columnwise (else {})."""
    buffers = getattr(owner, "_quant_fsdp_columnwise", None)
    if buffers is None:
        buffers = {}
        if shard.columnwise_data is not None and not shard.quantizer.can_derive_columnwise:
            for name in ("columnwise_data", "columnwise_scale_inv"):
                local = getattr(shard, name)
                buffers[name] = local.new_empty((local.shape[0], world_size * local.shape[1]))
        owner._quant_fsdp_columnwise = buffers
    return buffers


def _join_columns(gathered: torch.Tensor, target: torch.Tensor, world_size: int) -> torch.Tensor:
    """Writes the world's (C, n) shards, gathered along dim 0, side by side into target (C, world * n)."""
    columns, n = target.shape[0], gathered.shape[-1]
    with keeping_versions(target):
        target.view(columns, world_size, n).copy_(gathered.reshape(world_size, columns, n).transpose(0, 1))
    return target


def padded_rows(shape: tuple[int, ...] | torch.Size, world_size: int) -> int:
    """FSDP2's padded shard length along dim 0 (`torch.chunk` sizes)."""
    return math.ceil(shape[0] / world_size) if shape else 0
