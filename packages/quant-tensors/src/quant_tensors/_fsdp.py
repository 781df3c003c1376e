"""FSDP2's all-gather of quantized shards: what each format sends, how the unsharded tensor is
rebuilt, and the per-weight context a sharding layer binds.

[Note: quantized all-gather] FSDP2 calls `fsdp_pre_all_gather` on each parameter's local shard
and all-gathers the tensors it returns (concatenated along dim 0 across ranks), then calls
`fsdp_post_all_gather` with the gathered tensors to build the unsharded parameter; from the second
unshard on it passes that parameter back as `out=` to be refilled in place. Both are methods of
QuantizedTensor, so torch's own `fully_shard` gathers quantized weights whatever else is imported.
Shards taking this path are equal (even shards) and start on the format's block rows
(`Quantizer.row_alignment`), so gathering along dim 0 rebuilds the unsharded buffers exactly:

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
reads them; `usages` says which buffers a tensor holds), and (2) refills keep the buffers' version
counters, as FSDP2 does for its own all-gather outputs: autograd checks them on saved tensors, and
a refill writes the same weight.

[Note: shared per-tensor values] The unsharded tensor holds its shard's 0-d per-tensor values
(the FP8 scale, the NVFP4 global amax) themselves, not copies: they are the unsharded tensor's
already, so a gather launches nothing for them, and the tensor objects never change, as the
compiled backward needs. An optimizer requantizing the shard writes them in place after the
backward, and the next gather refills the codes to match.

FSDP2 sizes its gather buffers on the first unshard, so every later gather of a parameter must
send the same number of tensors with the same sizes: the forward and backward payloads of 1-D
block formats do (rows * K codes and rows * K / block scales either way).

[Note: shard context] What the protocol methods need beyond the format is asked of the weight's
`ShardContext`, a binding of its quantizer (`Quantizer.bind(shard_context=...)`), so it reaches
the shard, every detached copy of it a state dict makes and the unsharded tensor alike: what to
do before each gather (bind a per-tensor quantizer's `amax_group`), which FSDP2 module gathers the
weight (whether the backward gathers again), what to record of each gather (communication
statistics) and what torch.distributed.checkpoint reads a shard through (`__get_tensor_shard__`).
A weight whose quantizer has none gets a plain `ShardContext` at its first gather: it binds the
shard mesh's group, finds the module in FSDP2's state, records nothing and lets DCP read the
shard itself, so every gather is bit-exact without any sharding layer and nothing imported
changes that. quant_fsdp's `fully_shard` binds its own to the weights it shards (plans, the
explicit fallback, comm_stats(), checkpoint loads across weight forms).
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

if TYPE_CHECKING:
    from quant_tensors._tensor import QuantizedTensor

_USAGES = ("rowwise", "columnwise")


class ShardContext:
    """What FSDP2's all-gather and DCP's shard protocol do with one sharded quantized weight beyond
    its format's bytes ([Note: shard context] in quant_tensors._fsdp). This class is the plain
    behaviour; a sharding layer subclasses it and binds an instance to each weight's quantizer."""

    def __init__(self) -> None:
        self.splits_usages: bool | None = None
        """Whether FSDP2's forward gathers rowwise and its backward columnwise (formats that gather
        their usages apart), decided at the first gather (`_splits_usages`)."""

    def before_gather(self, shard: QuantizedTensor, mesh: Any) -> None:
        """Runs first in every `fsdp_pre_all_gather` of `shard` (FSDP2's shard mesh `mesh`).

        Plain: a per-tensor-scaled quantizer that has no `amax_group` gets the mesh's group, so
        that every later quantization of the shard (an optimizer's requantize) agrees on the scale
        of the unsharded tensor.
        """
        quantizer = shard.quantizer
        if quantizer.per_tensor_amax and quantizer.amax_group_name is None:
            quantizer.bind(amax_group=mesh.get_group())

    def fsdp_module(self, owner: torch.nn.Module | None) -> torch.nn.Module | None:
        """The FSDP2 module that gathers the weight, a parameter of `owner` (the module FSDP2 hands
        the hook; None in the 1-argument hook signature), or None if unknown. Asked once, at the
        first gather, by formats that can gather their usages apart (whether that module gathers
        again in the backward decides it).

        Plain: the FSDP2 module whose parameter group holds a parameter of `owner`, found in
        FSDP2's state (private: if it moves, None, and both usages travel in every gather:
        correct, more bytes).
        """
        return _find_fsdp_module(owner)

    def after_gather(self, shard: QuantizedTensor) -> None:
        """Runs first in every `fsdp_post_all_gather` of `shard`, which FSDP2 calls once the
        collective has completed. Plain: nothing."""

    def count_gather(self, format_name: str, inputs: Sequence[torch.Tensor], world_size: int) -> None:
        """Called with the all-gather inputs of every quantized gather of the weight. Plain: nothing."""

    def tensor_shard_for_checkpoint(self, shard: QuantizedTensor, index: Any) -> torch.Tensor:
        """`__get_tensor_shard__`: what torch.distributed.checkpoint writes from and reads into for
        `shard` (`index`: DCP's MetadataIndex). Plain: the shard itself, as for a plain tensor."""
        return shard


def shard_context(quantizer: Any) -> ShardContext:
    """The `ShardContext` bound to `quantizer`; a plain one is bound first where there is none."""
    context = quantizer.shard_context
    if context is None:
        context = ShardContext()
        quantizer.bind(shard_context=context)
    return context


# ---- the FSDP2 hooks --------------------------------------------------------------------------


@dataclass(frozen=True)
class GatherPayload:
    """What the pre-all-gather hook tells the post-all-gather hook (FSDP2's all-gather metadata)."""

    shard: QuantizedTensor
    """The local shard: class, metadata and per-tensor values of the unsharded tensor."""
    names: tuple[str, ...]
    """The buffer each all-gather input holds, in order."""
    world_size: int
    packed: tuple[tuple[torch.dtype, torch.Size], ...] | None = None
    """Dtype and shape of each input when they travel as one byte tensor (world size 1)."""


def pre_all_gather(shard: QuantizedTensor, mesh: Any, module: torch.nn.Module | None) -> tuple[Any, GatherPayload]:
    """`fsdp_pre_all_gather` of a QuantizedTensor: its context's preparation, then the shard's bytes."""
    quantizer = shard.quantizer
    context = quantizer._shard_context or shard_context(quantizer)
    context.before_gather(shard, mesh)
    # its mesh's size, asked once ([Note: gathers prepared once])
    prepared = next(iter(shard.__dict__.get("_prepared_gathers", {}).values()), None)
    world_size = prepared.world_size if prepared is not None and prepared.mesh is mesh else mesh.size()
    return all_gather_inputs(shard, world_size, module=module, context=context, mesh=mesh)


def post_all_gather(
    shard: QuantizedTensor,
    outputs: tuple[torch.Tensor, ...],
    payload: GatherPayload,
    param_dtype: torch.dtype,
    out: QuantizedTensor | None,
) -> tuple[QuantizedTensor, tuple[torch.Tensor, ...]] | None:
    """`fsdp_post_all_gather` of a QuantizedTensor: its context's `after_gather`, then the
    unsharded tensor (`unsharded_from_gather`)."""
    quantizer = shard.quantizer
    (quantizer._shard_context or shard_context(quantizer)).after_gather(shard)
    return unsharded_from_gather(shard, outputs, payload, param_dtype, out)


def all_gather_inputs(
    shard: QuantizedTensor,
    world_size: int,
    *,
    usages: tuple[bool, bool] | None = None,
    module: torch.nn.Module | None = None,
    context: ShardContext | None = None,
    mesh: Any = None,
) -> tuple[tuple[torch.Tensor, ...], GatherPayload]:
    """The all-gather inputs of a quantized shard and the metadata that rebuilds the unsharded
    tensor from their gathered outputs (`unsharded_from_gather`).

    `usages`: (rowwise, columnwise) to send; default what FSDP2's gather of a parameter of `module`
    sends ([Note: quantized all-gather]). With one rank several inputs travel as one byte tensor.
    `context`: the shard's (`shard_context`), told of the bytes sent. `mesh`: the device mesh of
    `world_size` ranks, if known (kept with the inputs: [Note: gathers prepared once]).
    """
    if context is None:
        context = shard_context(shard.quantizer)
    if usages is None:
        usages = _gathered_usages(shard, module, context)
    # [Note: gathers prepared once]
    prepared_gathers: dict[tuple[bool, bool], _PreparedGather] = shard.__dict__.setdefault("_prepared_gathers", {})
    prepared = prepared_gathers.get(usages)
    if (
        prepared is not None
        and prepared.world_size == world_size
        # the shard's sent buffers are the tensors sent then (builtins only: no Python call per buffer)
        and all(map(operator.is_, map(getattr, itertools.repeat(shard), prepared.names), prepared.buffers))
    ):
        context.count_gather(shard.quantizer.format_name, prepared.inputs, world_size)
        return prepared.inputs, GatherPayload(shard, prepared.names, world_size, prepared.packed)
    inputs, names = _payload_of(shard, usages)
    context.count_gather(shard.quantizer.format_name, inputs, world_size)
    sent = tuple(getattr(shard, name) for name in names)
    if world_size > 1 or len(inputs) == 1:
        if all(b.is_contiguous() for b in sent):  # the inputs are views of the buffers
            prepared_gathers[usages] = _PreparedGather(world_size, mesh, sent, tuple(inputs), tuple(names))
        return tuple(inputs), GatherPayload(shard, tuple(names), world_size)
    # FSDP2 (torch 2.11 to 2.13) copies only the first input when its shard group has one rank:
    # the inputs travel as one byte tensor ([Note: packed gathers]).
    packed = tuple((t.dtype, t.shape) for t in inputs)
    pieces = []
    for t in inputs:  # each piece starts 16-byte aligned, so every dtype can view its bytes
        pieces += [
            t.new_zeros(-sum(p.numel() for p in pieces) % 16, dtype=torch.uint8),
            t.reshape(-1).view(torch.uint8),
        ]
    flat = torch.cat(pieces)  # ends with the last input's bytes: its storage holds exactly the inputs
    if all(b.is_contiguous() for b in sent):
        for name, view in zip(names, _unpack(flat, packed), strict=True):
            setattr(shard, name, view.view(getattr(shard, name).dtype))
        rehomed = tuple(getattr(shard, name) for name in names)
        prepared_gathers[usages] = _PreparedGather(world_size, mesh, rehomed, (flat,), tuple(names), packed)
    return (flat,), GatherPayload(shard, tuple(names), world_size, packed)


class _PreparedGather(NamedTuple):
    """What a shard sent at its last gather of some usages ([Note: gathers prepared once])."""

    world_size: int
    mesh: Any
    """The device mesh FSDP2 gathered over (None where the caller gave only a world size)."""
    buffers: tuple[torch.Tensor, ...]
    """The buffers sent, the shard's then."""
    inputs: tuple[torch.Tensor, ...]
    names: tuple[str, ...]
    """The names of the buffers sent."""
    packed: tuple[tuple[torch.dtype, torch.Size], ...] | None = None
    """As GatherPayload's."""


# [Note: gathers prepared once] A weight is gathered twice a step, each time by hooks of a few
# dozen Python calls and tensor views per parameter, on the host's critical path between the
# layers. A shard whose sent buffers are the same tensors as at its last gather of the same
# usages (quantized primary weights and quantize-on-gather shards are refilled in place) sends the
# same inputs: they, their buffer names and the size of the mesh FSDP2 gathers it over are kept
# on the shard, per usages sent (where the buffers are contiguous and the inputs views of them or
# their packed tensor; not the payload, which refers to the shard and would make a reference
# cycle of it). After the gather, an unsharded tensor that already holds views of the storage
# FSDP2 refilled, and its shard's per-tensor values, needs nothing ([Note: refilled unsharded
# buffers]). `benchmarks/step_host.py` counts what a training step calls.
#
# [Note: packed gathers] FSDP2 (torch 2.11 to 2.13) copies only the first all-gather input of a
# parameter whose shard group has one rank, so a shard that sends several buffers (block formats:
# codes and scales) sends one byte tensor holding them all, each 16-byte aligned. Packing copies
# every byte sent; so the first packing makes the sent buffers views of the packed tensor, and
# later gathers send that tensor as it is, kept current by the in-place writes of the optimizer,
# a quantize-on-gather refill or a checkpoint load. A buffer replaced by another tensor ends this:
# the next gather packs again.


def _already_refilled(
    out: QuantizedTensor, shard: QuantizedTensor, payload: GatherPayload, outputs: Sequence[torch.Tensor]
) -> bool:
    """Whether `out` holds what refilling it from `outputs` would give it ([Note: gathers
    prepared once]): gathered rowwise buffers viewing the same bytes, the shard's per-tensor values
    themselves, nothing else."""
    if payload.packed is not None:
        return False
    names = payload.names
    for name, output in zip(names, outputs, strict=True):
        current = getattr(out, name)
        if not name.startswith("rowwise") or current is None or current.data_ptr() != output.data_ptr():
            return False
        if current.nbytes != output.nbytes:
            return False
    for name in type(shard)._buffer_names:
        if name in names:
            continue
        local, current = getattr(shard, name), getattr(out, name)
        if local is not None and local.dim() == 0:
            if current is not local:
                return False
        elif current is not None:
            return False
    return True


def in_backward() -> bool:
    """Whether autograd is running a backward pass (FSDP2 unshards for the backward from its hooks)."""
    return torch._C._current_graph_task_id() != -1


def _gathered_usages(
    shard: QuantizedTensor, module: torch.nn.Module | None, context: ShardContext
) -> tuple[bool, bool]:
    """(rowwise, columnwise) FSDP2's gather sends ([Note: quantized all-gather])."""
    if shard.columnwise_data is None or shard.quantizer.can_derive_columnwise:
        return True, False
    if shard.rowwise_data is None:
        return False, True
    if not _splits_usages(shard, module, context):
        return True, True
    return (False, True) if in_backward() else (True, False)


def _splits_usages(shard: QuantizedTensor, module: torch.nn.Module | None, context: ShardContext) -> bool:
    """Whether the forward gathers rowwise and the backward columnwise (else every gather sends
    both). Decided at the first gather and kept on the weight's context: FSDP2 sizes its buffers
    then, so the two payloads must have equal sizes, and the backward must gather again."""
    if context.splits_usages is None:
        sizes = [tuple(t.numel() for t in shard.usage_buffers(usage)) for usage in _USAGES]
        fsdp_module = context.fsdp_module(module)
        context.splits_usages = (
            sizes[0] == sizes[1] and _reshards_after_forward(fsdp_module) and not _recomputes_forward(fsdp_module)
        )
    return context.splits_usages


def _find_fsdp_module(owner: torch.nn.Module | None) -> torch.nn.Module | None:
    """The FSDP2 module that manages `owner`'s parameters (see `ShardContext.fsdp_module`).
    FSDP2 hands the hooks the owner (e.g. the Linear), not the FSDP module, and keeps no link
    back; so this searches the FSDP modules' parameter groups."""
    if owner is None:
        return None
    try:
        from torch.distributed._composable_state import _module_state_mapping
        from torch.distributed.fsdp import FSDPModule

        for module in list(_module_state_mapping):
            if isinstance(module, FSDPModule):
                group = module._get_fsdp_state()._fsdp_param_group
                if group is not None and any(p._module_info.module is owner for p in group.fsdp_params):
                    return module
    except (ImportError, AttributeError):
        pass
    return None


def _reshards_after_forward(module: torch.nn.Module | None) -> bool:
    """Whether FSDP2 frees the weights of `module` after the forward, so that the backward gathers
    them again: `reshard_after_forward` as FSDP2 resolved it (the root module never reshards after
    forward). FSDP2 has no public getter; if its internals move, this answers False and 1-D block
    formats gather both usages at once (correct, more bytes), never fewer than the backward needs.
    """
    try:
        group = module._get_fsdp_state()._fsdp_param_group  # type: ignore[union-attr]
        return group is not None and group.post_forward_mesh_info is not None
    except AttributeError:
        return False


def _recomputes_forward(module: torch.nn.Module | None) -> bool:
    """Whether activation checkpointing (torch's `checkpoint_wrapper`, as torchtitan applies it) re-runs
    the forward of `module` or of a module inside it in the backward: that recomputed forward needs the
    rowwise data from the backward's gather too, so every gather must send both usages."""
    if module is None:
        return False
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    return any(isinstance(m, CheckpointWrapper) for m in module.modules())


def _payload_of(shard: QuantizedTensor, usages: tuple[bool, bool]) -> tuple[list[torch.Tensor], list[str]]:
    """The all-gather inputs of a shard's wanted (rowwise, columnwise) usages: data and non-scalar
    scales as bytes (a 0-d scale is per-tensor: it stays local), with their buffer names."""
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
    return inputs, names


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """FP8 codes travel as uint8: collectives (gloo, older NCCL) have no FP8 types."""
    return t.view(torch.uint8) if t.dtype.itemsize == 1 else t


def _unpacked(outputs: tuple[torch.Tensor, ...], payload: GatherPayload) -> tuple[torch.Tensor, ...]:
    """The inputs of a packed (world size 1) gather, as views of the gathered bytes."""
    if payload.packed is None:
        return outputs
    (flat,) = outputs
    return _unpack(flat, payload.packed)


def _unpack(flat: torch.Tensor, packed: tuple[tuple[torch.dtype, torch.Size], ...]) -> tuple[torch.Tensor, ...]:
    """Views of the tensors of dtypes and shapes `packed` that `flat` holds, each 16-byte aligned."""
    views, offset = [], 0
    for dtype, shape in packed:
        nbytes = _nbytes(dtype, shape)
        views.append(flat[offset : offset + nbytes].view(dtype).view(shape))
        offset += nbytes + -nbytes % 16
    return tuple(views)


def _nbytes(dtype: torch.dtype, shape: torch.Size) -> int:
    return math.prod(shape) * dtype.itemsize


def unsharded_from_gather(
    owner: Any,
    outputs: tuple[torch.Tensor, ...],
    payload: GatherPayload,
    param_dtype: torch.dtype,
    out: QuantizedTensor | None = None,
) -> tuple[QuantizedTensor, tuple[torch.Tensor, ...]] | None:
    """Builds (or, with `out`, refills) the unsharded tensor from the gathered outputs of
    `all_gather_inputs` ([Note: refilled unsharded buffers]).

    `owner` is the object FSDP2 calls the hooks on (the sharded local tensor); it keeps the
    unsharded columnwise buffers between unshards. Returns (tensor, buffers FSDP2 frees on
    reshard) the first time, None when `out` was refilled.
    """
    shard, world_size = payload.shard, payload.world_size
    if out is not None and _already_refilled(out, shard, payload, outputs):
        return None
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
        elif local is not None and local.dim() == 0:  # per-tensor: [Note: shared per-tensor values]
            buffers[name] = local
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


def _columnwise_buffers(owner: Any, shard: QuantizedTensor, world_size: int) -> dict[str, torch.Tensor]:
    """The unsharded columnwise buffers `owner` keeps for formats that gather columnwise (else {})."""
    buffers = getattr(owner, "_unsharded_columnwise", None)
    if buffers is None:
        buffers = {}
        if shard.columnwise_data is not None and not shard.quantizer.can_derive_columnwise:
            for name in ("columnwise_data", "columnwise_scale_inv"):
                local = getattr(shard, name)
                buffers[name] = local.new_empty((local.shape[0], world_size * local.shape[1]))
        owner._unsharded_columnwise = buffers
    return buffers


def _join_columns(gathered: torch.Tensor, target: torch.Tensor, world_size: int) -> torch.Tensor:
    """Writes the world's (C, n) shards, gathered along dim 0, side by side into target (C, world * n)."""
    columns, n = target.shape[0], gathered.shape[-1]
    with keeping_versions(target):
        target.view(columns, world_size, n).copy_(gathered.reshape(world_size, columns, n).transpose(0, 1))
    return target
