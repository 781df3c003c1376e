"""Quantizer: turns high-precision tensors into one format's QuantizedTensor.

A recipe makes one quantizer per role ("weight", "input", "grad_output").

[Note: quantizer configuration and bindings] A quantizer is a frozen dataclass: its configuration
(format, FP8 dtype, block shape, default usages) is immutable and compared by value, so equal
quantizers are equal constants to torch.compile (no recompilation per layer) and a quantizer is
never copied per call: `quantize(x, rowwise=..., columnwise=...)` takes the usages of one call.
Three things are *bindings*, not configuration, excluded from == and hash and set in place with
`bind(...)` so every holder (the module, the tensors it made) sees them:
- `amax_group`, the process group over which a per-tensor amax is all-reduced;
- `state`, the tensor a stateful quantizer updates in place on every quantize: delayed scaling's
  amax history (fp32 (amax_history_len,)), NVFP4 stochastic rounding's counter (int64 0-d).
  qt.nn.Linear registers each of its quantizers' state as a buffer (moved by `.to()`, saved in
  `state_dict`) and passes it explicitly as `quantize(..., state=...)`;
- `shard_context`, what FSDP2's hooks do with the sharded weight this quantizer quantizes
  ([Note: shard context] in quant_tensors._fsdp): one weight's, so a weight quantizer serves
  one weight.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

import quant_core
from quant_tensors._tensor import QuantizedTensor

# [Note: on-demand columnwise] Weights whose columnwise data is a lossless transpose of their
# rowwise data (per-tensor FP8, blockwise 128x128, NVFP4 16x16) can be kept rowwise-only, half
# the bytes, and get columnwise with `update_usage(columnwise=True)` right before the dgrad GEMM,
# dropped again after. The weight quantizer's `columnwise_on_demand` flag turns it on; recipes set
# it from their `weight_columnwise_on_demand` field, or from this environment variable where the
# field is None.
COLUMNWISE_ON_DEMAND_ENV_VAR = "QUANT_TENSORS_COLUMNWISE_ON_DEMAND"
_QUANTIZABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def columnwise_on_demand_default() -> bool:
    return os.environ.get(COLUMNWISE_ON_DEMAND_ENV_VAR, "0").strip().lower() in ("1", "true", "yes", "on")


@dataclass(frozen=True, kw_only=True)
class Quantizer:
    """Base of every format's quantizer ([Note: quantizer configuration and bindings])."""

    rowwise: bool = True
    """Produce rowwise data (the forward GEMM operand)."""
    columnwise: bool = True
    """Produce columnwise data (the backward GEMMs' operand)."""
    columnwise_on_demand: bool = False
    """Leave columnwise out of `quantize`; derive it with update_usage ([Note: on-demand columnwise])."""
    amax_group_name: str | None = field(default=None, repr=False, compare=False)
    """Binding: the name of `amax_group` (`ProcessGroup.group_name`), set by `bind`. A name rather
    than the group: torch.compile rebuilds a quantizer passed into a graph from its fields, and
    torch 2.11's dynamo cannot carry a ProcessGroup there (a graph break at every qt.nn.Linear of
    a sharded model). Not pickled."""
    state: torch.Tensor | None = field(default=None, repr=False, compare=False)
    """Binding: the per-step state of a stateful quantizer (None for stateless ones); made by
    `new_state` when not given."""

    tensor_class: ClassVar[type[QuantizedTensor]]
    format_name: ClassVar[str]
    per_tensor_amax: ClassVar[bool] = False
    """Whether one amax scales the whole tensor (then shards must agree on it: `amax_group`)."""
    _shard_context: ClassVar[Any] = None  # the binding, set per instance by `bind`: not a field (see `shard_context`)

    def __post_init__(self) -> None:
        if self.state is None:
            object.__setattr__(self, "state", self.new_state())
        if not (self.rowwise or self.columnwise):
            raise ValueError(f"{type(self).__name__} needs at least one usage: rowwise=True and/or columnwise=True")
        if self.columnwise_on_demand and not self.can_derive_columnwise:
            raise ValueError(
                f"columnwise_on_demand needs columnwise data that is a lossless transpose of rowwise; "
                f"{type(self).__name__} ({self.format_name}) quantizes columnwise separately"
            )

    @property
    def can_derive_columnwise(self) -> bool:
        """Whether this format's columnwise data is a lossless transpose of its rowwise data."""
        return False

    @property
    def row_alignment(self) -> int:
        """Rows of the (M, K) view that a dim-0 shard of this quantizer's tensors must start on.

        1 where every block lies within a row (per-tensor FP8, or 1-D blocks used rowwise only);
        the block size where blocks span rows (tiles, or columnwise 1-D blocks along M).
        """
        return 1

    @property
    def stateless(self) -> bool:
        """Whether `quantize(x)` depends only on x and this quantizer's configuration (no amax
        history, no random stream)."""
        return True

    def quantizes_like(self, other: Quantizer) -> bool:
        """Whether self and other quantize every tensor identically: the same class and
        configuration (==, bindings left out), neither keeping state."""
        return self.stateless and other.stateless and self == other

    def encodes_like(self, other: Quantizer) -> bool:
        """Whether tensors of the two share one byte layout (tensor class, block shape, FP8 dtype),
        so one's buffers read as the other's; their scales may still differ."""
        return (
            self.tensor_class is other.tensor_class
            and self._metadata() == other._metadata()
            and getattr(self, "fp8_dtype", None) == getattr(other, "fp8_dtype", None)
        )

    @property
    def produced_usages(self) -> tuple[bool, bool]:
        """(rowwise, columnwise) that `quantize` writes (on-demand columnwise left out)."""
        return self.usages_for()

    def usages_for(self, rowwise: bool | None = None, columnwise: bool | None = None) -> tuple[bool, bool]:
        """(rowwise, columnwise) that `quantize(x, rowwise=..., columnwise=...)` writes: the
        arguments, or the configured usages where None; on-demand columnwise left out."""
        rowwise = self.rowwise if rowwise is None else rowwise
        columnwise = self.columnwise if columnwise is None else columnwise
        return rowwise, columnwise and not (self.columnwise_on_demand and rowwise)

    # ---- public API --------------------------------------------------------------------------

    def quantize(
        self,
        x: torch.Tensor,
        *,
        amax: torch.Tensor | None = None,
        state: torch.Tensor | None = None,
        rowwise: bool | None = None,
        columnwise: bool | None = None,
    ) -> QuantizedTensor:
        """Quantizes x (fp32/bf16/fp16, at least one dim).

        Args:
            amax: for formats with a per-tensor scale, the amax to scale with instead of x's own
                (e.g. the all-reduced amax of a sharded tensor).
            state: a stateful quantizer's state to read and update in place instead of the bound
                one ([Note: quantizer configuration and bindings]).
            rowwise: make rowwise data in this call (default: the configured usage).
            columnwise: make columnwise data in this call (default: the configured usage).
        """
        self._check_input(x)
        rowwise, columnwise = self.usages_for(rowwise, columnwise)
        if not (rowwise or columnwise):
            raise ValueError(f"{type(self).__name__}.quantize needs at least one usage: rowwise or columnwise")
        return self._quantize(x, out=None, amax=amax, state=self._state_for(x, state), usages=(rowwise, columnwise))

    def quantize_(
        self,
        src: torch.Tensor,
        out: QuantizedTensor,
        *,
        amax: torch.Tensor | None = None,
        state: torch.Tensor | None = None,
    ) -> QuantizedTensor:
        """Requantizes `src` into `out`'s existing buffers (the usages `out` holds), in place."""
        self._check_input(src)
        self._check_out(src, out)
        return self._quantize(src, out=out, amax=amax, state=self._state_for(src, state), usages=out.usages)

    def quantize_many_(
        self,
        srcs: Sequence[torch.Tensor],
        outs: Sequence[QuantizedTensor],
        *,
        amaxes: Sequence[torch.Tensor] | torch.Tensor | None = None,
    ) -> None:
        """Requantizes every srcs[i] into outs[i]'s existing buffers, in place: the bytes of
        `quantize_(srcs[i], outs[i], amax=amaxes[i])`, bit for bit (without `amaxes`, each source's
        own amax, agreed over `amax_group` where one is bound; the bound state). MXFP8 and
        blockwise FP8 do it in one quant-core call (on CUDA one Triton launch per group of like
        tensors); per-tensor current-scaled FP8 with `amaxes` computes every scale in one call,
        then casts every source in one `cast_to_fp8_many` call where the outs hold rowwise data
        only (one cast each otherwise); other formats loop. `amaxes` (per-tensor formats): each source's
        amax, as `quantize_` takes it, or all of them in one 1-D tensor. Every pair is checked
        before anything is written; one device per call."""
        if isinstance(srcs, torch.Tensor) or isinstance(outs, torch.Tensor):
            raise TypeError("quantize_many_ takes a sequence of sources and one of outs; for one pair call quantize_")
        if len(srcs) != len(outs):
            raise ValueError(f"quantize_many_ got {len(srcs)} sources but {len(outs)} outs; pass one out per source")
        if isinstance(amaxes, torch.Tensor) and amaxes.dim() != 1:
            raise ValueError(
                f"quantize_many_ takes amaxes as a 1-D tensor or a sequence; got a {amaxes.dim()}-D tensor"
            )
        if amaxes is not None and (not self.per_tensor_amax or len(amaxes) != len(srcs)):
            raise ValueError(
                f"quantize_many_ takes amaxes for per-tensor formats, one per source; got {len(amaxes)} for "
                f"{len(srcs)} sources with a {type(self).__name__} (per_tensor_amax={self.per_tensor_amax})"
            )
        if not srcs:
            return
        device = srcs[0].device if isinstance(srcs[0], torch.Tensor) else None
        for i, (src, out) in enumerate(zip(srcs, outs, strict=True)):
            try:
                self._check_input(src)
                self._check_out(src, out)
            except (TypeError, ValueError) as error:
                raise type(error)(f"srcs[{i}], outs[{i}]: {error}") from None
            if src.device != device or out.device != device:
                raise ValueError(
                    f"srcs[{i}] is on {src.device} and outs[{i}] on {out.device}, but srcs[0] is on {device}; "
                    "quantize_many_ quantizes on one device per call: call it once per device"
                )
        self._quantize_many(srcs, outs, amaxes)

    # [Note: weights recast in backward] A Linear with a high-precision weight needs the weight's
    # columnwise data only in backward (dgrad). Saving it from the forward keeps a quantized copy
    # of every weight alive from forward to backward, which bf16's nn.Linear does not (it saves the
    # parameter itself, alive anyway); on the e2e models that copy put every FP8 recipe's peak
    # memory above bf16's. So the forward quantizes rowwise only and keeps a small key (a few 0-d
    # tensors), and the backward remakes the columnwise data from the saved parameter: the bytes
    # and scales quantizing both usages in the forward would have given (the parameter is unchanged
    # meanwhile; autograd's version check refuses it otherwise). Per-tensor FP8 casts with the
    # forward's scale (delayed scaling's history has moved on since), NVFP4 scales with the
    # forward's global amax (no second all-reduce for shards), the other formats quantize again
    # (their blocks depend on nothing else). Stateful quantizers other than FP8's (a stochastic
    # stream) cannot, and report it in `recasts_columnwise`.

    @property
    def recasts_columnwise(self) -> bool:
        """Whether `recast_columnwise` can remake what `quantize_recastable` left out, bit for bit."""
        return self.stateless

    def quantize_recastable(
        self, x: torch.Tensor, *, state: torch.Tensor | None = None
    ) -> tuple[QuantizedTensor, tuple[torch.Tensor, ...]]:
        """x quantized rowwise only, and the key with which `recast_columnwise(x, key)` later makes
        the columnwise data that `quantize(x, state=state, rowwise=True, columnwise=True)` would
        have made now ([Note: weights recast in backward])."""
        self._check_input(x)
        return self._quantize_recastable(x, self._state_for(x, state))

    def _quantize_recastable(
        self, x: torch.Tensor, state: torch.Tensor | None
    ) -> tuple[QuantizedTensor, tuple[torch.Tensor, ...]]:
        """`quantize_recastable` of checked input x with the state to use (`_state_for`'s); the key
        is empty here (formats whose recast needs the forward's amax or scale override this)."""
        return self._quantize(x, out=None, amax=None, state=state, usages=(True, False)), ()

    def recast_columnwise(self, x: torch.Tensor, key: tuple[torch.Tensor, ...]) -> QuantizedTensor:
        """x quantized columnwise only, with `key` from `quantize_recastable(x)`; reads and advances no state."""
        self._check_input(x)
        return self._recast_columnwise(x, key)

    def _recast_columnwise(self, x: torch.Tensor, key: tuple[torch.Tensor, ...]) -> QuantizedTensor:
        """`recast_columnwise` of checked input x."""
        return self._quantize(x, out=None, amax=key[0] if key else None, state=None, usages=(False, True))

    def new_state(self, device: torch.device | str | None = None) -> torch.Tensor | None:
        """A fresh state for this quantizer (None for stateless formats), on `device` (default cpu)."""
        return None

    @property
    def shard_context(self) -> Any:
        """Binding: the `quant_tensors.fsdp.ShardContext` of the sharded weight this quantizer
        quantizes, set by the layer that shards it (or a plain one at its first gather); None
        before. Not pickled nor deep-copied. Not a dataclass field: torch.compile guards on a
        quantizer's fields, and one object per weight there would compile every layer anew."""
        return self._shard_context

    @property
    def amax_group(self) -> dist.ProcessGroup | None:
        """Binding: process group over which formats with a per-tensor amax (per-tensor FP8, NVFP4)
        all-reduce (MAX) the amax they measure, so that the shards of one tensor share one scale.
        quant-fsdp binds it for sharded weights. An `amax=` passed to `quantize` is used as given."""
        name = self.amax_group_name
        return None if name is None else _resolve_process_group(name)

    def bind(
        self,
        *,
        amax_group: dist.ProcessGroup | None = None,
        state: torch.Tensor | None = None,
        shard_context: Any = None,
    ) -> Quantizer:
        """Sets the bindings given (not None) in place and returns self
        ([Note: quantizer configuration and bindings])."""
        if shard_context is not None:
            object.__setattr__(self, "_shard_context", shard_context)
        if amax_group is not None:
            object.__setattr__(self, "amax_group_name", amax_group.group_name)
        if state is not None:
            if self.state is None:
                raise ValueError(f"{type(self).__name__} keeps no state; there is nothing to bind")
            object.__setattr__(self, "state", state)
        return self

    def _state_for(self, x: torch.Tensor, state: torch.Tensor | None) -> torch.Tensor | None:
        """The state a quantize of x uses: the given one, else the bound one (moved to x's device
        in place the first time: the bound state follows the tensors it quantizes)."""
        if state is not None or self.state is None:
            return state
        if self.state.device != x.device:
            self.state.data = self.state.data.to(x.device)
        return self.state

    def is_quantizable(self, x: torch.Tensor) -> bool:
        """Whether x can take the quantized GEMM and all-gather paths (block-divisible dims)."""
        if not isinstance(x, torch.Tensor) or x.dim() == 0 or not x.dtype.is_floating_point:
            return False
        M, K = x.numel() // x.shape[-1] if x.shape[-1] else 0, x.shape[-1]
        return M > 0 and M % self.dim_multiple[0] == 0 and K % self.dim_multiple[1] == 0

    def make_empty(
        self,
        shape: tuple[int, ...] | torch.Size,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        requires_grad: bool = False,
    ) -> QuantizedTensor:
        """A QuantizedTensor of `shape` with this quantizer's usages whose values are all zero.

        Buffers are allocated, not computed, so this also works on the meta device.
        """
        device = torch.device("cpu") if device is None else torch.device(device)
        rowwise, columnwise = self.produced_usages
        buffers = self.tensor_class._allocate_buffers(tuple(shape), device, rowwise, columnwise, **self._allocation())
        return self.tensor_class(
            shape, dtype, requires_grad=requires_grad, quantizer=self, **buffers, **self._metadata()
        )

    def with_usage(self, *, rowwise: bool | None = None, columnwise: bool | None = None) -> Quantizer:
        """A quantizer configured with other usages, sharing this one's bindings (amax group, state).

        For one call, pass the usages to `quantize` instead: that copies nothing.
        """
        configured = dataclasses.replace(
            self,
            rowwise=self.rowwise if rowwise is None else rowwise,
            columnwise=self.columnwise if columnwise is None else columnwise,
        )
        return configured.bind(shard_context=self.shard_context)

    def local_amax(self, x: torch.Tensor) -> torch.Tensor:
        """x's own per-tensor amax (fp32, before any all-reduce), in the form `quantize(x, amax=...)`
        takes once agreed over a group: 0-d here; NVFP4 with the random Hadamard transform gives
        two values (quant_tensors.nvfp4)."""
        return quant_core.amax(x)

    def _measured_amax(self, x: torch.Tensor, amax: torch.Tensor | None) -> torch.Tensor:
        """`amax` if given, else x's amax all-reduced (MAX) over `amax_group` when one is set."""
        if amax is not None:
            return amax.reshape(()).float()
        measured = self.local_amax(x)
        if self.amax_group is not None:
            dist.all_reduce(measured, op=dist.ReduceOp.MAX, group=self.amax_group)
        return measured

    # ---- pickling and copies: a process group is neither picklable nor copyable, and a copy is
    # not the weight a shard context describes ------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "amax_group_name": None, "_shard_context": None}

    def __deepcopy__(self, memo: dict[int, Any]) -> Quantizer:
        clone = object.__new__(type(self))
        memo[id(self)] = clone
        for name, value in self.__dict__.items():  # the group is shared, the context left, the rest copied
            if name == "_shard_context":
                value = None
            elif name != "amax_group_name":
                value = copy.deepcopy(value, memo)
            object.__setattr__(clone, name, value)
        return clone

    # ---- what every format provides ----------------------------------------------------------

    @property
    def dim_multiple(self) -> tuple[int, int]:
        """(M, K) multiples a tensor needs for the quantized GEMM and all-gather."""
        raise NotImplementedError

    def _quantize_many(
        self,
        srcs: Sequence[torch.Tensor],
        outs: Sequence[QuantizedTensor],
        amaxes: Sequence[torch.Tensor] | torch.Tensor | None,
    ) -> None:
        """Requantizes checked (src, out) pairs as `quantize_` would (with amaxes[i] if given): here
        one `_quantize` per pair; formats with a multi-tensor path override it."""
        for i, (src, out) in enumerate(zip(srcs, outs, strict=True)):
            amax = None if amaxes is None else amaxes[i]
            self._quantize(src, out=out, amax=amax, state=self._state_for(src, None), usages=out.usages)

    def _quantize(
        self,
        x: torch.Tensor,
        *,
        out: QuantizedTensor | None,
        amax: torch.Tensor | None,
        state: torch.Tensor | None,
        usages: tuple[bool, bool],
    ) -> QuantizedTensor:
        """Quantizes checked input x for `usages` (into `out`'s buffers if given), with `state`."""
        raise NotImplementedError

    def _allocation(self) -> dict[str, object]:
        """Keyword arguments of tensor_class._allocate_buffers besides shape, device and usages."""
        return {}

    def _metadata(self) -> dict[str, object]:
        """Metadata of the tensors this quantizer makes, besides the quantizer (e.g. block_shape)."""
        return {}

    # ---- shared checks -------------------------------------------------------------------------

    def _check_out(self, src: torch.Tensor, out: QuantizedTensor) -> None:
        """Checks that `out` can take a requantize of src: this format's tensor, of src's shape."""
        if type(out) is not self.tensor_class or out.shape != src.shape:
            raise ValueError(
                f"quantize_ into {type(out).__name__}{tuple(getattr(out, 'shape', ()))} from a {tuple(src.shape)} "
                f"source with {type(self).__name__}: `out` must be a {self.tensor_class.__name__} of the source's shape"
            )

    def _check_input(self, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{self.format_name} quantizes torch.Tensors, got {type(x).__name__}")
        if isinstance(x, QuantizedTensor):
            raise TypeError(
                f"x is already a {type(x).__name__}; dequantize it first to requantize as {self.format_name}"
            )
        if x.dim() == 0:
            raise ValueError(
                f"{self.format_name} cannot quantize a 0-d tensor: blocks run along the last dim (reshape it to (1,))"
            )
        if x.dtype not in _QUANTIZABLE_DTYPES:
            raise TypeError(
                f"x has dtype {x.dtype}; quantization reads float32, bfloat16 or float16 ({self.format_name}): "
                "x.float() if the precision loss is intended"
            )
