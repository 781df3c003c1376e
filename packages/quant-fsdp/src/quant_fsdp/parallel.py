"""Tensor-parallel styles for qt.nn.Linear, for torch's `parallelize_module`.

[Note: quantized tensor parallelism] On a 1-D TP mesh of `tp` ranks:

- `QuantColwiseParallel` shards the weight and bias along dim 0: each rank computes its
  out_features / tp columns of y. Without sequence parallelism the input is replicated and its
  gradient is summed over the group in the backward. With it, the input is this rank's slice of
  the sequence: it is gathered along the sequence *quantized* by the layer's input quantizer
  (`gather_along_first_dim`: rowwise data for the forward GEMM, columnwise for the wgrad GEMM, or
  the explicit high-precision fallback), and its gradient is reduce-scattered back to the slice.
- `QuantRowwiseParallel` shards the weight along dim 1 and replicates the bias: each rank
  multiplies its slice of the input's last dim, the partial products are summed over the group
  (all-reduce; with sequence parallelism a reduce-scatter along the sequence, whose backward
  gathers the gradient quantized by the layer's grad_output quantizer, for its dgrad and wgrad
  GEMMs), then the bias is added once.

Quantized primary weights (qt.convert(..., quantized_weights=True)) are split by quantizing
each rank's slice of their high-precision value (`_distribute_quantized`); FSDP2 on top of them
is refused by quant_fsdp.fully_shard.

Activations are local tensors in and out; DTensor inputs (e.g. from torch's `SequenceParallel`
on a norm) are accepted when their placement is the one expected. Parameters become DTensors on
the TP mesh, as with torch's styles, so FSDP2 on a 2-D mesh, DCP and optimizers see them as usual.
The sequence gather treats tokens as rows in (sequence, batch) order: an input [b, s, h] with
`sequence_dim=1` is moved to [s, b, h] and flattened, and the output moved back; the GEMMs do
not depend on the order of rows.

Per-tensor formats (FP8, NVFP4's global amax): the quantizers of tensors that are sharded over
the group (both weights, the column-parallel grad_output, the row-parallel input) get the TP
group as `amax_group`, so every rank scales with the whole tensor's amax, as one process does.
The gathered input agrees on its amax inside the gather. Hence the TP layers compute what one
process computes on the same tokens in (sequence, batch) order, apart from the order of fp32
sums (row-parallel partial products, GEMMs over slices). With batch-first activations one
process would order tokens (batch, sequence): the wgrad's token blocks (MXFP8, blockwise, NVFP4
columnwise data) then group other tokens, an equally valid but not identical quantization.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import warnings
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

import quant_tensors as qt
from quant_fsdp._sequence import gather_along_first_dim, reduce_scatter_along_first_dim
from quant_tensors import QuantizedTensor

__all__ = ["QuantColwiseParallel", "QuantRowwiseParallel"]

logger = logging.getLogger("quant_fsdp")


class _QuantParallel(ParallelStyle):
    _weight_dim: int

    def __init__(self, *, sequence_parallel: bool = False, sequence_dim: int = 1) -> None:
        super().__init__()
        self.sequence_parallel = sequence_parallel
        self.sequence_dim = sequence_dim

    def __repr__(self) -> str:
        return f"{type(self).__name__}(sequence_parallel={self.sequence_parallel}, sequence_dim={self.sequence_dim})"

    def _apply(self, module: torch.nn.Module, device_mesh: DeviceMesh) -> torch.nn.Module:
        sharded_quantizers = self._checked(module, device_mesh)  # a refused layer is left as it was
        group = device_mesh.get_group()
        for quantizer in sharded_quantizers:
            quantizer.bind(amax_group=group)
        placements = {"weight": Shard(self._weight_dim), "bias": Shard(0) if self._weight_dim == 0 else Replicate()}
        for name, placement in placements.items():
            param = getattr(module, name)
            if param is None:
                continue
            if isinstance(param, QuantizedTensor):
                sharded, init_value = _distribute_quantized(param, device_mesh, placement)
            else:
                sharded, init_value = distribute_tensor(param.detach(), device_mesh, [placement]), None
            module.register_parameter(name, torch.nn.Parameter(sharded, requires_grad=param.requires_grad))
            if init_value is not None:  # for the optimizer's fp32 master (qt.high_precision_init_value)
                qt.nn.attach_high_precision_init_value(getattr(module, name), init_value)
        _fall_back_if_unquantizable(module, type(self).__name__)
        module.forward = functools.partial(self._forward, module, group)
        return module

    def _checked(self, module: torch.nn.Module, mesh: DeviceMesh) -> list[qt.Quantizer]:
        """Every check of `_apply`, before it changes anything; returns the per-tensor quantizers
        whose tensors the TP group shards (they must agree on amax over it)."""
        style = type(self).__name__
        _check_layer(module, mesh, style)
        tp = mesh.size()
        features = module.weight.shape[self._weight_dim]
        if features % tp:
            name = ("out_features", "in_features")[self._weight_dim]
            raise ValueError(
                f"{style} splits {name}={features} of {module} over {tp} ranks, which does not divide it; choose a "
                f"TP size that divides {features}"
            )
        quantizers = list(self._sharded_quantizers(module))
        if isinstance(module.weight, QuantizedTensor):
            weight_quantizer = module.weight.quantizer
            quantizers.append(weight_quantizer)
            local_shape = _local_weight_shape(module.weight, self._weight_dim, tp)
            if not _fits(weight_quantizer, local_shape):
                raise ValueError(
                    f"{style} leaves {module} a local weight of {local_shape}, which its quantized "
                    f"{weight_quantizer.format_name} weight cannot hold (blocks of {weight_quantizer.dim_multiple}); "
                    "choose a TP size that keeps the local features at those multiples, or convert without "
                    "quantized_weights"
                )
        quantizers = [q for q in quantizers if q.per_tensor_amax]
        if any(q.amax_group is not None and q.amax_group is not mesh.get_group() for q in quantizers):
            raise ValueError(
                f"a quantizer of {module} already agrees on its amax over another group; tensor parallelism needs "
                "the TP group there: apply the TP style before fully_shard and before setting amax_group yourself"
            )
        return quantizers

    def _sharded_quantizers(self, module: qt.nn.Linear) -> tuple[qt.Quantizer, ...]:
        raise NotImplementedError

    def _forward(self, module: qt.nn.Linear, group: dist.ProcessGroup, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _sequence_dim(self, x: torch.Tensor) -> int:
        dim = self.sequence_dim % x.dim() if -x.dim() <= self.sequence_dim < x.dim() else None
        if dim is None or dim == x.dim() - 1:
            raise ValueError(
                f"{type(self).__name__}(sequence_dim={self.sequence_dim}) needs an input whose sequence dim is "
                f"one of its leading dims, got shape {tuple(x.shape)}"
            )
        return dim


class QuantColwiseParallel(_QuantParallel):
    """Column-parallel qt.nn.Linear: weight and bias sharded along out_features; the output is
    this rank's slice of the last dim. With `sequence_parallel=True` the input is this rank's
    slice of `sequence_dim` and is gathered quantized ([Note: quantized tensor parallelism])."""

    _weight_dim = 0

    def _sharded_quantizers(self, module: qt.nn.Linear) -> tuple[qt.Quantizer, ...]:
        return module.weight_quantizer, module.grad_output_quantizer

    def _forward(self, module: qt.nn.Linear, group: dist.ProcessGroup, x: torch.Tensor) -> torch.Tensor:
        weight, bias = _local(module.weight), _local(module.bias)
        if not self.sequence_parallel:
            x = _local_input(x, Replicate(), self)
            return module.linear(_SumGradients.apply(x, group), weight, bias)
        dim = self._sequence_dim(x)
        rows = _local_input(x, Shard(dim), self).movedim(dim, 0)
        quantizer = None
        if not module.high_precision_reason:
            quantizer = module.input_quantizer.with_usage(rowwise=True, columnwise=weight.requires_grad)
        y = module.linear(_gathered_input(x, rows, dim, group, quantizer), weight, bias)
        sequence = rows.shape[0] * dist.get_world_size(group)
        return y.view(sequence, *rows.shape[1:-1], y.shape[-1]).movedim(0, dim)


class QuantRowwiseParallel(_QuantParallel):
    """Row-parallel qt.nn.Linear: weight sharded along in_features, bias replicated; the input
    is this rank's slice of the last dim. The output is replicated, or with
    `sequence_parallel=True` this rank's slice of `sequence_dim` ([Note: quantized tensor parallelism])."""

    _weight_dim = 1

    def _sharded_quantizers(self, module: qt.nn.Linear) -> tuple[qt.Quantizer, ...]:
        return module.weight_quantizer, module.input_quantizer

    def _forward(self, module: qt.nn.Linear, group: dist.ProcessGroup, x: torch.Tensor) -> torch.Tensor:
        weight, bias = _local(module.weight), _local(module.bias)
        x = _local_input(x, Shard(x.dim() - 1), self)
        if not self.sequence_parallel:
            y = _SumPartials.apply(module.linear(x, weight, None), group)
            return y if bias is None else y + bias
        dim = self._sequence_dim(x)
        world_size = dist.get_world_size(group)
        if x.shape[dim] % world_size:
            raise ValueError(
                f"QuantRowwiseParallel(sequence_parallel=True) splits the sequence ({x.shape[dim]} along dim {dim}) "
                f"over {world_size} ranks, which does not divide it; pad the sequence to a multiple of {world_size}"
            )
        rows = x.movedim(dim, 0)  # tokens in (sequence, batch) order
        partial = module.linear(rows.reshape(-1, rows.shape[-1]), weight, None)
        quantizer = None
        if not module.high_precision_reason:
            quantizer = module.grad_output_quantizer.with_usage(
                rowwise=x.requires_grad, columnwise=weight.requires_grad
            )
        y = _ReduceScatterSequence.apply(partial, group, quantizer)
        y = y.view(rows.shape[0] // world_size, *rows.shape[1:-1], y.shape[-1]).movedim(0, dim)
        return y if bias is None else y + _SumGradients.apply(bias, group)


@dataclasses.dataclass(frozen=True)
class _SharedGather:
    version: int
    grad_enabled: bool
    sequence_dim: int
    group: dist.ProcessGroup
    quantizer: qt.Quantizer | None
    gathered: torch.Tensor


# The column-parallel layers reading one input object (q, k and v after one norm) share its
# sequence gather while that object lives, when their quantizers quantize alike: the input holds
# it, as this attribute.
_SHARED_GATHER = "_quant_fsdp_shared_gather"


def _gathered_input(
    x: torch.Tensor, rows: torch.Tensor, dim: int, group: dist.ProcessGroup, quantizer: qt.Quantizer | None
) -> torch.Tensor:
    """`rows` (x's local tokens, its sequence dim `dim` moved first) gathered along the sequence,
    quantized; reused when another layer already gathered the same, unmodified x alike. Once x is
    gone, so is every forward reader: the rowwise data (forward GEMM) is dropped, the columnwise
    (wgrad) kept."""
    shared = getattr(x, _SHARED_GATHER, None)
    if (
        shared is not None
        and shared.version == x._version
        and shared.grad_enabled == torch.is_grad_enabled()
        and shared.sequence_dim == dim
        and shared.group is group
        and (shared.quantizer is None if quantizer is None else quantizer.quantizes_like(shared.quantizer))
    ):
        return shared.gathered
    gathered = _GatherSequence.apply(rows.reshape(-1, rows.shape[-1]), group, quantizer)
    if quantizer is None or quantizer.stateless:
        setattr(x, _SHARED_GATHER, _SharedGather(x._version, torch.is_grad_enabled(), dim, group, quantizer, gathered))
    if isinstance(gathered, QuantizedTensor) and quantizer.columnwise:
        weakref.finalize(x, gathered.update_usage, rowwise=False)
    return gathered


def _distribute_quantized(weight: QuantizedTensor, mesh: DeviceMesh, placement: Shard) -> tuple[DTensor, DTensor]:
    """A quantized primary weight as this rank's slice, and the slice of its high-precision value.

    The slice is quantized from the high-precision value qt.convert kept (else the dequantized
    weight), rank 0's as with distribute_tensor, by the weight's quantizer, whose per-tensor amax
    the TP group already agrees on: since the slices fall on block boundaries, this is the slice
    of the whole weight's quantization, bit for bit.
    """
    value = qt.high_precision_init_value(weight)
    if value is None:
        logger.warning(
            "a %s weight of shape %s is split for tensor parallelism without its high-precision initial value: "
            "its slices start from the dequantized weight", weight.quantizer.format_name, tuple(weight.shape),
        )  # fmt: skip
        value = weight.dequantize()
    value = distribute_tensor(value.detach(), mesh, [placement])
    local = weight.quantizer.quantize(value.to_local().contiguous())
    sharded = DTensor.from_local(local, mesh, [placement], run_check=False, shape=weight.shape, stride=weight.stride())
    return sharded, value


def _check_layer(module: torch.nn.Module, mesh: DeviceMesh, style: str) -> None:
    if not isinstance(module, qt.nn.Linear):
        raise TypeError(
            f"{style} parallelizes qt.nn.Linear layers, got {type(module).__name__}; convert the model with "
            "qt.convert(model, recipe) first, or use torch's ColwiseParallel/RowwiseParallel for other modules"
        )
    if mesh.ndim != 1:
        raise ValueError(f"{style} takes a 1-D TP mesh, got {mesh.ndim} dims; pass mesh['tp'] of a 2-D mesh")
    for name, param in module.named_parameters(recurse=False):
        if isinstance(param, DTensor):
            raise ValueError(
                f"{style}: {name} of {module} is already a DTensor (sharded); apply the TP style once, before "
                "fully_shard"
            )


def _local_weight_shape(weight: torch.Tensor, dim: int, tp: int) -> tuple[int, ...]:
    shape = list(weight.shape)
    shape[dim] //= tp
    return tuple(shape)


def _fits(quantizer: qt.Quantizer, shape: tuple[int, ...]) -> bool:
    """Whether a weight of `shape` fits the quantizer's blocks (its own check, on a meta tensor)."""
    return quantizer.is_quantizable(torch.empty(shape, device="meta"))


def _fall_back_if_unquantizable(module: qt.nn.Linear, style: str) -> None:
    """The explicit fallback when the local high-precision weight does not fit the format's blocks."""
    local_shape = tuple(module.weight.to_local().shape)
    if module.high_precision_reason or _fits(module.weight_quantizer, local_shape):
        return
    module.high_precision_reason = (
        f"{style} leaves {module} a local weight of {local_shape[0]} x {local_shape[1]}, which "
        f"{module.weight_quantizer.format_name} cannot quantize (it needs multiples of "
        f"{module.weight_quantizer.dim_multiple}); the layer computes in high precision. Choose a TP size that keeps "
        "the local features at those multiples."
    )
    warnings.warn(module.high_precision_reason, stacklevel=4)


def _local(t: torch.Tensor | None) -> torch.Tensor | None:
    return t.to_local() if isinstance(t, DTensor) else t


def _local_input(x: Any, placement: Shard | Replicate, style: _QuantParallel) -> torch.Tensor:
    if not isinstance(x, DTensor):
        return x
    if tuple(x.placements) != (placement,):
        raise ValueError(
            f"{style!r} expects an input placed as {placement!r}, got a DTensor placed as {x.placements!r}; "
            "redistribute it first (or pass the local tensor)"
        )
    return x.to_local()


class _GatherSequence(torch.autograd.Function):
    """Gathers rows along dim 0 (quantized when a quantizer is given); the backward reduce-scatters."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, group: dist.ProcessGroup, quantizer: qt.Quantizer | None) -> torch.Tensor:
        ctx.group = group
        gathered, _ = gather_along_first_dim(rows, group, quantizer=quantizer)
        if gathered.shape[0] != rows.shape[0] * dist.get_world_size(group):
            raise ValueError(
                f"sequence parallelism needs the same sequence slice on every rank; this rank has {rows.shape[0]} "
                f"rows of {gathered.shape[0]} gathered"
            )
        return gathered

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        summed, _ = reduce_scatter_along_first_dim(grad, ctx.group)
        return summed, None, None


class _ReduceScatterSequence(torch.autograd.Function):
    """Sums partial rows over the group and keeps this rank's slice; the backward gathers the
    gradient, quantized for the layer's dgrad and wgrad GEMMs when a quantizer is given (the
    layer takes it as it is)."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, group: dist.ProcessGroup, quantizer: qt.Quantizer | None) -> torch.Tensor:
        ctx.group, ctx.quantizer = group, quantizer
        return reduce_scatter_along_first_dim(rows, group)[0]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return gather_along_first_dim(grad, ctx.group, quantizer=ctx.quantizer)[0], None, None


class _SumPartials(torch.autograd.Function):
    """All-reduces partial products in the forward; the gradient passes through."""

    @staticmethod
    def forward(ctx, partial: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        summed = partial.clone()
        dist.all_reduce(summed, group=group)
        return summed

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _SumGradients(torch.autograd.Function):
    """The identity whose backward all-reduces: for a replicated tensor used by every rank on
    different data (the column-parallel input, the sequence-parallel bias)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        summed = grad.clone()
        dist.all_reduce(summed, group=ctx.group)
        return summed, None
