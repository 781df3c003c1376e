"""QuantizeOnGatherTensor: a high-precision weight shard that FSDP2 gathers quantized.

Mode 2 (quantize on gather) and the fallback of both modes keep a weight's shard in high
precision, so any torch optimizer steps it. The shard is wrapped in this subclass so FSDP2 finds
the all-gather hooks on it:

- quantized gather: the pre-all-gather hook quantizes the shard (with the shard group's amax for
  per-tensor formats) and sends its bytes like a quantized primary weight ([Note: quantized
  all-gather] in quant_tensors._fsdp). The quantized shard is kept, once per change
  of the shard (its version counter), from the forward's gather to the backward's: the backward
  re-gather sends the same bytes; stateless formats then free its codes (the tensor is refilled
  at the next change), delayed scaling keeps them (refilled in place) so that it records one amax
  per step, as without FSDP;
- fallback ([Note: alignment policy] in quant_fsdp._plan): the shard is gathered in high precision
  and the post-all-gather hook quantizes the unsharded tensor;
- gather only (`quantize_after_gather=False`, tensor-parallel weights under FSDP2): the fallback's
  high-precision gather, counted as such, and the unsharded tensor stays high precision: it is
  the TP layer's local weight, which the layer quantizes in its forward ([Note: quantized tensor
  parallelism] in quant_fsdp.parallel).

Every op runs on the wrapped tensor. The ops FSDP2 uses to shard, pad and move parameters keep
the wrapper; in-place ops return it; everything else returns plain tensors (optimizer states).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_map, tree_map_only

import quant_tensors as qt
from quant_fsdp import _checkpoint, _watch
from quant_fsdp._context import context_of
from quant_fsdp._stats import count_gather
from quant_tensors import QuantizedTensor, Quantizer

aten = torch.ops.aten

# [Note: versions through views] A view made inside __torch_dispatch__ (below autograd's
# ADInplaceOrView key) gets a version counter of its own, not its base's. So a write through a
# view of the wrapper (quant_core's Adam reference, which FusedAdam runs on this subclass, writes
# through `param.view(-1)`) would leave the shard's version as it was, and the quantized shard
# cached for that version stale: the gather would send the weight of before the step. Wrappers
# made by these ops remember the tensor whose version counter stands for the shard's value
# (`_version_source`), and every in-place write bumps it.
_VIEW_OPS = frozenset(
    {
        aten.detach.default,
        aten.alias.default,
        aten.view.default,
        aten._unsafe_view.default,
        aten.as_strided.default,
        aten.slice.Tensor,
        aten.split.Tensor,
        aten.split_with_sizes.default,
    }
)
_WRAPPER_PRESERVING_OPS = _VIEW_OPS | {
    aten.new_zeros.default,
    aten.new_empty.default,
    aten.empty_like.default,
    aten.clone.default,
    aten._to_copy.default,
    aten._pin_memory.default,
}


class QuantizeOnGatherTensor(torch.Tensor):
    """A high-precision weight (shard) that FSDP2 all-gathers quantized; see quant_fsdp._quantize_on_gather."""

    _data: torch.Tensor
    quantizer: Quantizer
    fallback: bool
    quantize_after_gather: bool

    @staticmethod
    def __new__(
        cls,
        data: torch.Tensor,
        quantizer: Quantizer,
        *,
        fallback: bool = False,
        quantize_after_gather: bool = True,
        requires_grad: bool = False,
    ):
        return torch.Tensor._make_wrapper_subclass(
            cls,
            data.shape,
            strides=data.stride(),
            storage_offset=data.storage_offset(),
            dtype=data.dtype,
            device=data.device,
            requires_grad=requires_grad,
        )

    def __init__(
        self,
        data: torch.Tensor,
        quantizer: Quantizer,
        *,
        fallback: bool = False,
        quantize_after_gather: bool = True,
        requires_grad: bool = False,
    ):
        """`fallback`: gather the high-precision shard; `quantize_after_gather=False` (fallback only):
        leave the gathered tensor high precision (a tensor-parallel weight's local slice)."""
        if isinstance(data, (QuantizedTensor, QuantizeOnGatherTensor)):
            raise TypeError(f"QuantizeOnGatherTensor wraps a high-precision tensor, got {type(data).__name__}")
        if not (fallback or quantize_after_gather):
            raise ValueError("quantize_after_gather=False needs fallback=True: a quantized gather is quantized")
        self._data = data
        self._version_source = data  # [Note: versions through views]
        self.quantizer = quantizer
        self.fallback = fallback
        self.quantize_after_gather = quantize_after_gather
        self._quantized_shard: QuantizedTensor | None = None
        self._quantized_version = -1
        self._synced_amax: tuple[int, torch.Tensor] | None = None  # (shard version, amax) from sync_amax_
        self._history_before: tuple[int, torch.Tensor] | None = None  # fallback + delayed scaling

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        unwrap = lambda t: t._data if isinstance(t, cls) else t  # noqa: E731
        result = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
        first = args[0] if args else None
        if func._schema.is_mutable:
            _count_writes(func, args, kwargs)
            if isinstance(first, cls):
                return first  # in place on the wrapped tensor: the wrapper is the result
        if func in _WRAPPER_PRESERVING_OPS and isinstance(first, cls):
            return tree_map_only(torch.Tensor, lambda t: first._wrap(t, view=func in _VIEW_OPS), result)
        return result

    def _wrap(self, t: torch.Tensor, *, view: bool) -> QuantizeOnGatherTensor:
        wrapped = QuantizeOnGatherTensor(
            t, self.quantizer, fallback=self.fallback, quantize_after_gather=self.quantize_after_gather
        )
        if view:
            wrapped._version_source = self._version_source  # [Note: versions through views]
        return wrapped

    def shard_version(self) -> int:
        """The version of the shard's value: advanced by every in-place write to this wrapper or
        to a view of it ([Note: versions through views])."""
        return self._version_source._version

    def __tensor_flatten__(self) -> tuple[list[str], dict[str, Any]]:
        context = {
            "quantizer": self.quantizer,
            "fallback": self.fallback,
            "quantize_after_gather": self.quantize_after_gather,
        }
        return ["_data"], context

    @staticmethod
    def __tensor_unflatten__(inner_tensors, context, outer_size, outer_stride):
        return QuantizeOnGatherTensor(inner_tensors["_data"], **context)

    def __reduce_ex__(self, protocol: int):
        """Pickles (torch.save, torch.distributed.checkpoint) as the plain high-precision shard: a
        checkpoint needs no quant_fsdp to load, and a destination of any kind takes it by copy_."""
        return self._data.detach().__reduce_ex__(protocol)

    # torch.distributed.checkpoint's load protocol (DTensor hands it to its local tensor): a
    # fallback shard that starts or ends inside a block reads the whole blocks around it, so a
    # checkpoint holding the weight quantized loads ([Note: checkpoints across weight forms]).

    def __create_chunk_list__(self):
        return _checkpoint.high_precision_chunks_for_loading(self)

    def __get_tensor_shard__(self, index):
        return _checkpoint.high_precision_local_for_checkpoint(self, index)

    def __repr__(self) -> str:  # type: ignore[override]
        path = "quantized"
        if self.fallback:
            path = "high precision, then quantize" if self.quantize_after_gather else "high precision"
        return f"QuantizeOnGatherTensor({self._data}, format={self.quantizer.format_name}, gather={path})"

    # ---- FSDP2 all-gather hooks (both signatures: (mesh) and the 5-argument one) -----------------

    def fsdp_pre_all_gather(self, mesh, outer_size=None, outer_stride=None, module=None, mp_policy=None):
        world_size = mesh.size()
        context = context_of(self.quantizer)
        if context is not None:
            _watch.gather_began(context)
        if not self.fallback:
            return qt.fsdp.all_gather_inputs(self._quantize_shard(), world_size, module=module)
        param_dtype = getattr(mp_policy, "param_dtype", None) or self.dtype
        full_shape = tuple(outer_size) if outer_size is not None else (world_size * self.shape[0], *self.shape[1:])
        padded = (math.ceil(full_shape[0] / world_size), *full_shape[1:])  # FSDP2's padded shard (torch.chunk)
        shard = _padded_shard(self._data, padded).to(param_dtype)
        count_gather(self.quantizer.format_name, (shard,), world_size, quantized=False)
        return (shard,), full_shape

    # FSDP2 reads the pre-all-gather hook's signature at every gather (to pick the call form).
    fsdp_pre_all_gather.__signature__ = inspect.signature(fsdp_pre_all_gather)  # type: ignore[attr-defined]

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        context = context_of(self.quantizer)
        if context is not None:
            _watch.gather_ended(context, self.device)
        if not self.fallback:
            unsharded = qt.fsdp.unsharded_from_gather(self, all_gather_outputs, metadata, param_dtype, out)
            if torch._C._current_graph_task_id() != -1 and self.quantizer.stateless:  # in a backward
                # The backward's gather was the step's last: the optimizer changes the shard before
                # the next, so the quantized shard's codes would only hold memory until then (a
                # byte per element for FP8): freed, the tensor kept to be refilled. A stateful
                # quantizer keeps them: quantizing the same shard again (the next micro-batch)
                # would record its amax twice.
                _free_storage(self._quantized_shard)
                self._quantized_version = -1
            return unsharded
        (gathered,) = all_gather_outputs
        full = gathered[: metadata[0]]  # metadata: the unsharded shape; FSDP2 pads after its last row
        if not self.quantize_after_gather:
            # A view of the all-gather output, whose storage FSDP2 frees on reshard and reallocates
            # (the same storage object) before the next gather: `out` then already holds the result.
            return None if out is not None else (full, ())
        self._restore_history_for_a_repeat()
        if out is not None:
            # As FSDP2 refills its own all-gather outputs: [Note: refilled unsharded buffers] in quant_tensors._fsdp.
            buffers = tuple(b for b in out.buffers().values() if b is not None)
            with torch.autograd._unsafe_preserve_version_counter(buffers):
                self.quantizer.quantize_(full, out)
            return None
        unsharded = self.quantizer.quantize(full)
        return unsharded, tuple(b for b in unsharded.buffers().values() if b is not None)

    # ---- helpers ---------------------------------------------------------------------------------

    def _quantize_shard(self) -> QuantizedTensor:
        """The quantized shard for the current value of the high-precision shard (refilled on change)."""
        version = self.shard_version()
        if self._quantized_shard is not None and version == self._quantized_version:
            return self._quantized_shard
        synced = self._synced_amax
        amax = synced[1] if synced is not None and synced[0] == version else None
        if self._quantized_shard is None:
            # Only what the gathers send: a columnwise copy that the unsharded tensor derives would
            # hold a byte per element from the forward's gather to the backward's for nothing.
            rowwise, columnwise = self.quantizer.usages_for()
            columnwise = columnwise and not (rowwise and self.quantizer.can_derive_columnwise)
            self._quantized_shard = self.quantizer.quantize(
                self._data, amax=amax, rowwise=rowwise, columnwise=columnwise
            )
        else:
            _allocate_storage(self._quantized_shard)
            self.quantizer.quantize_(self._data, self._quantized_shard, amax=amax)
        self._quantized_version = version
        return self._quantized_shard

    def _restore_history_for_a_repeat(self) -> None:
        """Fallback with delayed scaling: quantizing the same shard again (the backward re-gather)
        must not record its amax twice, so the amax history is rewound to before the first time."""
        history = getattr(self.quantizer, "amax_history", None)
        if history is None:
            return
        version = self.shard_version()
        if self._history_before is not None and self._history_before[0] == version:
            history.copy_(self._history_before[1])
        else:
            self._history_before = (version, history.clone())


# [Note: shards quantized ahead] Quantizing a shard in its pre-all-gather hook puts a quantize per
# weight on the host's critical path, between the layers' forwards: on the 2.2B Llama under FSDP2
# (2 x H200, profiled), the forward's FSDP2 hooks of high-precision FP8 weights took ~16 ms per
# step more than those of quantized primary weights, whose bytes are ready. `sync_amax_`, which
# runs after the optimizer step and knows every shard's amax, quantizes the shards of stateless
# quantizers there instead: per-tensor FP8 computes every scale in one call, then casts each
# shard. The bytes are the ones the hook would have made (the same amax, the same quantizer
# settings); the hook then finds them current. Delayed scaling stays in the hook: its quantize
# records the amax in its history, once per step at the forward's gather, as without FSDP.
def quantize_synced_shards(shards: Sequence[QuantizeOnGatherTensor]) -> None:
    """Quantizes each stateless shard whose synced amax is current now rather than in its first
    gather ([Note: shards quantized ahead]): alike quantizers in one `quantize_many_` call."""
    groups: list[list[QuantizeOnGatherTensor]] = []
    for shard in shards:
        version = shard.shard_version()
        synced = shard._synced_amax
        if not shard.quantizer.stateless or synced is None or synced[0] != version:
            continue
        if shard._quantized_shard is None:  # the first time: allocated by one quantize
            shard._quantize_shard()
        elif shard._quantized_version != version:
            group = next((g for g in groups if _alike(g[0], shard)), None)
            if group is None:
                groups.append([shard])
            else:
                group.append(shard)
    for group in groups:
        outs = [shard._quantized_shard for shard in group]
        for out in outs:
            _allocate_storage(out)
        group[0].quantizer.quantize_many_(
            [shard._data for shard in group], outs, amaxes=[shard._synced_amax[1] for shard in group]
        )
        for shard in group:
            shard._quantized_version = shard.shard_version()


def _alike(a: QuantizeOnGatherTensor, b: QuantizeOnGatherTensor) -> bool:
    return a.device == b.device and a.quantizer.quantizes_like(b.quantizer)


def _free_storage(quantized: QuantizedTensor) -> None:
    """Frees the storage of `quantized`'s buffers other than 0-d ones (the per-tensor values,
    which the unsharded tensor shares: [Note: shared per-tensor values] in quant_tensors._fsdp)."""
    for buffer in quantized.buffers().values():
        if buffer is not None and buffer.dim() > 0:
            buffer.untyped_storage().resize_(0)


def _allocate_storage(quantized: QuantizedTensor) -> None:
    """Gives the buffers `_free_storage` freed their storage back (uninitialized). Buffers may
    share one storage (a packed gather's: [Note: packed gathers] in quant_tensors._fsdp): it grows
    until it holds each of them."""
    for buffer in quantized.buffers().values():
        if buffer is None or buffer.dim() == 0:
            continue
        end = (buffer.storage_offset() + buffer.numel()) * buffer.element_size()
        if buffer.untyped_storage().nbytes() < end:  # only a freed storage is smaller than a view of it
            buffer.untyped_storage().resize_(end)


def _count_writes(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Bumps the version counter of each wrapped tensor `func` writes to (a foreach op writes a
    list of them), and of the tensor it is a view of ([Note: versions through views]). Inside
    __torch_dispatch__ autograd's version bump has already happened, on the wrapper only; the
    quantized-shard cache keys on the shard's version."""
    for position, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[position] if position < len(args) else kwargs.get(argument.name)
        # One tensor, or a list of them: the foreach ops torch's optimizers run on CUDA by default.
        for written in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(written, QuantizeOnGatherTensor):
                torch.autograd.graph.increment_version(written._data)
                if written._version_source is not written._data:
                    torch.autograd.graph.increment_version(written._version_source)


def _padded_shard(shard: torch.Tensor, padded_shape: tuple[int, ...]) -> torch.Tensor:
    """The shard with FSDP2's zero padding rows after it (FSDP2 requires the padded shape of
    uneven shards). FSDP2 allocates shards padded, so this is a view wherever it can be."""
    if tuple(shard.shape) == padded_shape:
        return shard
    end = (shard.storage_offset() + math.prod(padded_shape)) * shard.element_size()
    if shard.is_contiguous() and end <= shard.untyped_storage().nbytes():
        strides = [math.prod(padded_shape[i + 1 :]) for i in range(len(padded_shape))]
        return shard.as_strided(padded_shape, strides)
    padded = shard.new_zeros(padded_shape)
    padded[: shard.shape[0]].copy_(shard)
    return padded
