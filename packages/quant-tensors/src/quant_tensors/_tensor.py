"""QuantizedTensor: the wrapper-subclass base every format derives from, and its op table.

[Note: quantized tensor] A QuantizedTensor is a `_make_wrapper_subclass` tensor whose `.dtype`
is the nominal high-precision dtype and whose `.shape` is the logical shape; its values live in
plain tensors ("buffers", declared per class in `_buffer_names`, each possibly None when that
usage is absent) plus non-tensor metadata (`_metadata_names`). The rowwise/columnwise layouts are
quant-core's ([Note: block layouts] in quant_core.blocks._layout): rowwise buffers follow the (M, K)
view of the tensor (M = product of the leading dims), columnwise buffers hold x^T.

Ops reach `__torch_dispatch__`, which looks them up in the op tables along the class's MRO (each
class registers its own with `implements`; registering an op twice in one class raises). An op not in the table raises
NotImplementedError, except those in `DEQUANTIZE_FALLBACK_OPS`, which run on the dequantized
tensor with a one-time warning per (class, op): no silent slow paths.
"""

from __future__ import annotations

import copy
import inspect
import math
import warnings
from collections.abc import Callable, Sequence
from itertools import compress, repeat
from operator import is_not
from typing import Any, ClassVar

import torch
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map

from quant_tensors import _fsdp

aten = torch.ops.aten

# Ops that may run on the dequantized tensor (one warning per class and op): reductions and
# comparisons people use to inspect weights. Everything else raises.
DEQUANTIZE_FALLBACK_OPS = frozenset(
    {
        aten.abs.default,
        aten.sum.default,
        aten.sum.dim_IntList,
        aten.mean.default,
        aten.mean.dim,
        aten.max.default,
        aten.min.default,
        aten.linalg_vector_norm.default,
        aten.isnan.default,
        aten.isfinite.default,
        aten.eq.Tensor,
        aten.allclose.default,
        aten.equal.default,
    }
)


class QuantizedTensor(torch.Tensor):
    """Base of every quantized format; see [Note: quantized tensor] in quant_tensors._tensor."""

    _buffer_names: ClassVar[tuple[str, ...]] = ()
    _metadata_names: ClassVar[tuple[str, ...]] = ()
    _warned_fallbacks: ClassVar[set[tuple[type, Any]]] = set()
    _flat_shape: tuple[int, ...] | None = None  # set on flat views only ([Note: flat view])

    quantizer: Any  # the Quantizer that produced it (requantization, FSDP, copy_ from high precision)

    @staticmethod
    def __new__(cls, shape: Sequence[int], dtype: torch.dtype, *, requires_grad: bool = False, **fields: Any):
        device = next(fields[name].device for name in cls._buffer_names if fields.get(name) is not None)
        return torch.Tensor._make_wrapper_subclass(
            cls, tuple(shape), dtype=dtype, device=device, requires_grad=requires_grad
        )

    def __init__(self, shape: Sequence[int], dtype: torch.dtype, *, requires_grad: bool = False, **fields: Any):
        unknown = set(fields) - set(self._buffer_names) - set(self._metadata_names)
        if unknown:
            raise TypeError(f"{type(self).__name__} has no field(s) {sorted(unknown)}")
        for name in self._buffer_names + self._metadata_names:
            setattr(self, name, fields.get(name))

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._absent_fields = dict.fromkeys(cls._buffer_names + cls._metadata_names)

    _absent_fields: ClassVar[dict[str, None]] = {}  # every field None: what `from_buffers` starts from

    @classmethod
    def from_buffers(cls, shape: Sequence[int], dtype: torch.dtype, device: torch.device, **fields: Any) -> Any:
        """A tensor of this class holding `fields` (buffers and metadata by name; those left out are
        None), without the constructor's checks: for callers that made the buffers themselves, on
        `device`, and name only fields of this class (quantizers, the Linear's hot path). One
        wrapper and two dict updates, no per-field setattr."""
        tensor = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device)
        attributes = tensor.__dict__
        attributes.update(cls._absent_fields)
        attributes.update(fields)
        return tensor

    __torch_function__ = torch._C._disabled_torch_function_impl

    # ---- construction helpers ----------------------------------------------------------------

    # buffers(), metadata() and __tensor_flatten__ run in every FSDP2 gather and every guard check
    # of a compiled graph taking the tensor: built by C iterators, without a Python call per field.

    def buffers(self) -> dict[str, torch.Tensor | None]:
        """The buffers by name (None for an absent usage)."""
        names = self._buffer_names
        return dict(zip(names, map(getattr, repeat(self), names), strict=True))

    def metadata(self) -> dict[str, Any]:
        names = self._metadata_names
        return dict(zip(names, map(getattr, repeat(self), names), strict=True))

    def data_ptr(self) -> int:
        """The address of the first buffer present (the codes): a wrapper has no storage of its own,
        and torch's answer for one, 0, is the same for every quantized tensor, while callers that
        match tensors by address (Accelerate maps an optimizer's parameters to their sharded
        replacements by `data_ptr()`) need one per tensor."""
        return next((b.data_ptr() for b in self.buffers().values() if b is not None), 0)

    def _rebuilt(
        self,
        *,
        shape: Sequence[int] | None = None,
        dtype: torch.dtype | None = None,
        fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
        **changes: Any,
    ) -> QuantizedTensor:
        """A new wrapper of the same class: buffers mapped through `fn`, then `changes` applied."""
        fields: dict[str, Any] = {**self.buffers(), **self.metadata()}
        if fn is not None:
            fields.update({k: (None if v is None else fn(v)) for k, v in self.buffers().items()})
        fields.update(changes)
        return type(self)(self.shape if shape is None else shape, self.dtype if dtype is None else dtype, **fields)

    # ---- what every format provides ----------------------------------------------------------

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The high-precision values, as `dtype` (default: the nominal dtype); from columnwise data if
        rowwise is absent (x^T's values, transposed back)."""
        dtype = dtype or self.dtype
        self._check_not_flat("dequantize")
        if self.rowwise_data is not None:
            return self._usage_values("rowwise", dtype)
        return self._usage_values("columnwise", dtype).t().reshape(self.shape)

    def _usage_values(self, usage: str, dtype: torch.dtype) -> torch.Tensor:
        """The values a usage's codes stand for (the GEMM operand: rowwise data's shape, or (K, M))."""
        return self._dequantize_buffers(*self.usage_buffers(usage), dtype)

    def _transform_of(self, usage: str) -> int | None:
        """What a usage holds besides x or x^T: None, or the seed of NVFP4's random Hadamard transform
        of the columnwise usage (quant_tensors.nvfp4). GEMM operands must agree on it."""
        return None

    def usage_buffers(self, usage: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(data, scale_inv) of the "rowwise" or "columnwise" usage; raises if that usage is absent."""
        if usage not in ("rowwise", "columnwise"):
            raise ValueError(f"usage must be 'rowwise' or 'columnwise', got {usage!r}")
        self._check_not_flat("usage_buffers")
        data = getattr(self, f"{usage}_data")
        if data is None:
            raise ValueError(
                f"{type(self).__name__} holds no {usage} data; call update_usage({usage}=True) first where the "
                "format derives it losslessly, or quantize with that usage"
            )
        return data, self._scale_inv_of(usage)

    def _check_not_flat(self, what: str) -> None:
        if self._flat_shape is not None:
            raise NotImplementedError(
                f"{what} of a flat view of a {type(self).__name__}{self._flat_shape}: flat views exist for FSDP2's "
                f"bookkeeping only; view it back to {self._flat_shape} first"
            )

    def _scale_inv_of(self, usage: str) -> torch.Tensor:
        """The dequantization scales of a usage (one per block, or one per tensor)."""
        return getattr(self, f"{usage}_scale_inv")

    def _dequantize_buffers(self, data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """quant-core's dequantize of one usage's buffers (the format's hook)."""
        raise NotImplementedError

    @property
    def usages(self) -> tuple[bool, bool]:
        """(has rowwise data, has columnwise data)."""
        return self.rowwise_data is not None, self.columnwise_data is not None

    def update_usage(self, rowwise: bool | None = None, columnwise: bool | None = None) -> None:
        """Adds a usage (by lossless transpose where the format allows it) or drops one, in place."""
        raise NotImplementedError

    def _drop_usages(self, rowwise: bool | None, columnwise: bool | None) -> None:
        """Drops the usages set to False (their data and scale buffers), refusing to drop the last one."""
        keep = {
            "rowwise": self.usages[0] if rowwise is None else rowwise,
            "columnwise": self.usages[1] if columnwise is None else columnwise,
        }
        if not any(keep.values()):
            raise ValueError(f"a {type(self).__name__} must keep at least one usage (rowwise or columnwise)")
        for usage, kept in keep.items():
            if not kept:
                for name in self._buffer_names:
                    if name.startswith(f"{usage}_"):
                        setattr(self, name, None)

    def _row_alignment(self) -> int:
        """Rows of the (M, K) view a dim-0 slice must start and end on (block boundaries)."""
        raise NotImplementedError

    def _slice_rows(self, start: int, stop: int) -> dict[str, torch.Tensor | None]:
        """Buffers of rows [start, stop) of the (M, K) view (aligned as `_row_alignment` says)."""
        raise NotImplementedError

    @classmethod
    def _allocate_buffers(
        cls, shape: tuple[int, ...], device: torch.device, rowwise: bool, columnwise: bool, **layout: Any
    ) -> dict[str, torch.Tensor | None]:
        """Buffers of a tensor of `shape` with the given usages whose values are all zero."""
        raise NotImplementedError

    def _allocation(self) -> dict[str, Any]:
        """Keyword arguments of `_allocate_buffers` that reproduce this tensor's layout."""
        return {k: v for k, v in self.metadata().items() if k != "quantizer"}

    def _zeros_like_buffers(
        self, shape: Sequence[int], device: torch.device | None = None
    ) -> dict[str, torch.Tensor | None]:
        """Buffers of an all-zero tensor of `shape` (on `device`, default ours) with our usages and layout."""
        return self._allocate_buffers(tuple(shape), device or self.device, *self.usages, **self._allocation())

    # ---- dispatch ----------------------------------------------------------------------------

    @classmethod
    def implements(cls, *ops: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Registers the decorated function for `ops` in this class's own table; twice raises."""
        table = cls.__dict__.get("_ops")
        if table is None:
            table = {}
            cls._ops = table  # type: ignore[attr-defined]

        def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
            for op in ops:
                if op in table:
                    raise RuntimeError(f"{op} is registered twice for {cls.__name__}")
                table[op] = fn
            return fn

        return decorate

    @classmethod
    def _handler(cls, func: Any) -> Callable[..., Any] | None:
        for klass in cls.__mro__:
            table = klass.__dict__.get("_ops", {})
            handler = table.get(func) or table.get(func.overloadpacket)
            if handler is not None:
                return handler
        return None

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        if args and isinstance(args[0], QuantizedTensor) and args[0]._flat_shape is not None:
            return _flat_view_op(func, args)
        handler = cls._handler(func)
        if handler is not None:
            return handler(func, args, kwargs)
        if func in DEQUANTIZE_FALLBACK_OPS:
            if (cls, func) not in QuantizedTensor._warned_fallbacks:
                QuantizedTensor._warned_fallbacks.add((cls, func))
                warnings.warn(
                    f"{func} is not implemented for {cls.__name__}: it runs on the dequantized tensor "
                    "(a high-precision copy). This warning is shown once per op.",
                    stacklevel=2,
                )
            unwrap = lambda t: t.dequantize() if isinstance(t, QuantizedTensor) else t  # noqa: E731
            return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
        if func is torch.ops.c10d.broadcast_.default:
            raise ValueError(
                f"cannot broadcast a {cls.__name__}: the receiving ranks allocate a plain tensor of its size and "
                "dtype, which cannot hold its codes and scales. Load a full state dict that every rank holds "
                "(set_model_state_dict with full_state_dict=True, without broadcast_from_rank0=True); with "
                "Accelerate's FSDP2, set cpu_ram_efficient_loading=False"
            )
        if func._schema.is_mutable:
            raise NotImplementedError(
                f"{func} would update a {cls.__name__} in place, which its op table (quant_tensors README) does not "
                "allow: torch optimizers and in-place math cannot step quantized weights. Train them with "
                "quant_optim.FusedAdam (fp32 master weights, requantized after every step), or convert with "
                "quantized_weights=False to keep high-precision weights for any optimizer."
            )
        raise NotImplementedError(
            f"{func} is not supported on {cls.__name__}: its op table (quant_tensors README) has no entry for it. "
            "Call .dequantize() first if a high-precision result is what you want."
        )

    # ---- FSDP2's all-gather and DCP's shard protocol ([Note: quantized all-gather], [Note: shard
    # context] in quant_tensors._fsdp); both hook signatures: (mesh) and the 5-argument one --------

    def fsdp_pre_all_gather(
        self,
        mesh: Any,
        outer_size: torch.Size | None = None,
        outer_stride: tuple[int, ...] | None = None,
        module: torch.nn.Module | None = None,
        mp_policy: Any = None,
    ) -> tuple[tuple[torch.Tensor, ...], _fsdp.GatherPayload]:
        """FSDP2's hook: this shard's quantized bytes to all-gather, and the metadata that rebuilds the
        unsharded tensor (its context's `before_gather` runs first)."""
        return _fsdp.pre_all_gather(self, mesh, module)

    # FSDP2 reads this hook's signature at every gather (to pick the call form); computed once here.
    fsdp_pre_all_gather.__signature__ = inspect.signature(fsdp_pre_all_gather)  # type: ignore[attr-defined]

    def fsdp_post_all_gather(
        self,
        all_gather_outputs: tuple[torch.Tensor, ...],
        metadata: _fsdp.GatherPayload,
        param_dtype: torch.dtype,
        *,
        out: QuantizedTensor | None = None,
    ) -> tuple[QuantizedTensor, tuple[torch.Tensor, ...]] | None:
        """FSDP2's hook: the unsharded tensor built from the gathered bytes, or `out` refilled in place
        (its context's `after_gather` runs first)."""
        return _fsdp.post_all_gather(self, all_gather_outputs, metadata, param_dtype, out)

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
        """torch.distributed.checkpoint's protocol (DTensor hands it to its local tensor): what DCP
        reads into and writes from, as its context says (plain: the tensor itself)."""
        if self.quantizer is None or self.quantizer.shard_context is None:
            return self
        return self.quantizer.shard_context.tensor_shard_for_checkpoint(self, index)

    # ---- serialization (torch.save / torch.load(weights_only=True), deepcopy) ----------------

    def __tensor_flatten__(self) -> tuple[list[str], dict[str, Any]]:
        names, metadata_names = self._buffer_names, self._metadata_names
        present = list(compress(names, map(is_not, map(getattr, repeat(self), names), repeat(None))))
        metadata = dict(zip(metadata_names, map(getattr, repeat(self), metadata_names), strict=True))
        return present, {"metadata": metadata, "dtype": self.dtype}

    @classmethod
    def __tensor_unflatten__(cls, inner_tensors, context, outer_size, outer_stride):
        buffers = {name: inner_tensors.get(name) for name in cls._buffer_names}
        return cls(outer_size, context["dtype"], **buffers, **context["metadata"])

    def __reduce_ex__(self, protocol: int):
        return _rebuild_quantized_tensor, (
            type(self),
            tuple(self.shape),
            self.dtype,
            self.requires_grad,
            self.buffers(),
            self.metadata(),
        )

    def __deepcopy__(self, memo: dict[int, Any]) -> QuantizedTensor:
        result = self._rebuilt(fn=lambda t: t.clone(), **copy.deepcopy(self.metadata(), memo))
        result.requires_grad_(self.requires_grad)
        memo[id(self)] = result
        return result

    def untyped_storage(self) -> torch.UntypedStorage:  # type: ignore[override]
        """The storage of the first present data buffer (a wrapper has none of its own).

        Lets code that sizes, frees or compares storages (FSDP2's bookkeeping) see real bytes.
        While torch.compile fakes tensors (a fake mode is active) the wrapper's own empty storage
        is returned: the buffers are faked separately, and sharing their storage with the
        wrapper would make the fake wrapper alias them.
        """
        if torch._guards.detect_fake_mode() is not None:
            return super().untyped_storage()
        for name in ("rowwise_data", "columnwise_data"):
            buffer = getattr(self, name, None)
            if buffer is not None:
                return buffer.untyped_storage()
        raise RuntimeError(f"{type(self).__name__} holds no data buffer")

    def __repr__(self) -> str:  # type: ignore[override]
        present = ", ".join(
            f"{name}={tuple(t.shape)}:{str(t.dtype).removeprefix('torch.')}"
            for name, t in self.buffers().items()
            if t is not None
        )
        return f"{type(self).__name__}(shape={tuple(self.shape)}, dtype={self.dtype}, {present})"


# [Note: flat view] FSDP2 keeps `padded_shard.view(-1)` of every parameter for bookkeeping; with
# the all-gather hooks in place it never computes with it. A QuantizedTensor's layout follows its
# (M, K) view, so `view(-1)` returns a *flat view*: same buffers, shape (numel,), remembering the
# shape it came from. It can only be viewed back to that shape, detached or aliased; every other
# op raises instead of misreading the buffers.
_FLAT_VIEW_OPS = frozenset({aten.view.default, aten._unsafe_view.default, aten.reshape.default})


def flat_view(t: QuantizedTensor) -> QuantizedTensor:
    """The flat (numel,) view of t ([Note: flat view])."""
    flat = t._rebuilt(shape=(t.numel(),))
    flat._flat_shape = tuple(t.shape)
    return flat


def _flat_view_op(func: Any, args: tuple[Any, ...]) -> QuantizedTensor:
    t: QuantizedTensor = args[0]
    unflat = t._rebuilt(shape=t._flat_shape)
    target = list(args[1]) if func in _FLAT_VIEW_OPS else None
    if func in (aten.detach.default, aten.alias.default) or target in ([-1], [t.numel()]):
        return flat_view(unflat)
    if target is not None and tuple(target) == t._flat_shape:
        return unflat
    t._check_not_flat(str(func))
    raise AssertionError("unreachable")


def matrix_shape(shape: Sequence[int]) -> tuple[int, int]:
    """(M, K) of the 2-D view every format quantizes: the leading dims flattened, the last kept (0-d: (1, 1))."""
    return (math.prod(shape[:-1]), shape[-1]) if shape else (1, 1)


def local_shard(t: Any) -> Any:
    """A DTensor's local tensor (its shard under FSDP2), or t itself."""
    return t._local_tensor if isinstance(t, DTensor) else t


def shard_like(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` as a DTensor sharded like `p` (mesh, placements, shape, stride); `local` if p is plain."""
    if not isinstance(p, DTensor):
        return local
    return DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(), run_check=False)


def local_quantized(t: Any) -> QuantizedTensor | None:
    """The QuantizedTensor that t holds: t itself, or a DTensor's local shard (FSDP2); else None."""
    local = local_shard(t)
    return local if isinstance(local, QuantizedTensor) else None


def bind_shard_amax_group(p: torch.Tensor | None) -> None:
    """Binds the group over which a sharded quantized weight's shards split it as the `amax_group`
    of its per-tensor quantizer, where none is bound yet.

    A DTensor parameter `p` holding a QuantizedTensor shard whose quantizer scales per tensor (FP8
    current or delayed scaling, NVFP4) and has no `amax_group`, sharded along exactly one mesh dim
    (FSDP2's shard dim; the Shard dim of HSDP's 2-D mesh), gets that dim's process group: the group
    FSDP2's first gather binds ([Note: shard context] in quant_tensors._fsdp). Quantizations of the
    shard before that gather (an initialisation after `fully_shard`, an optimizer requantizing
    loaded masters) then use the whole tensor's amax, as every later one does. Anything else is
    left as it is.
    """
    local = local_quantized(p)
    if not isinstance(p, DTensor) or local is None or local.quantizer is None:
        return
    quantizer = local.quantizer
    if not quantizer.per_tensor_amax or quantizer.amax_group_name is not None:
        return
    shard_dims = [dim for dim, placement in enumerate(p.placements) if placement.is_shard()]
    if len(shard_dims) == 1:
        quantizer.bind(amax_group=p.device_mesh.get_group(shard_dims[0]))


def _rebuild_quantized_tensor(
    cls: type[QuantizedTensor],
    shape: tuple[int, ...],
    dtype: torch.dtype,
    requires_grad: bool,
    buffers: dict[str, torch.Tensor | None],
    metadata: dict[str, Any],
) -> QuantizedTensor:
    """Unpickles a QuantizedTensor from its raw buffers (registered as a safe global)."""
    tensor = cls(shape, dtype, **buffers, **metadata)
    tensor.requires_grad_(requires_grad)
    return tensor
