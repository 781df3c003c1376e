"""qt.nn.Linear: nn.Linear whose three GEMMs run on quantized operands.

fprop  y  = x W^T      : input rowwise      x weight rowwise
dgrad  dx = dy W       : grad_output rowwise x weight columnwise
wgrad  dW = dy^T x     : grad_output columnwise x input columnwise
([Note: GEMM operands] in quant_tensors.ops). The bias stays in high precision. The weight may be
a high-precision parameter (quantized rowwise every forward, saved as itself, and its dgrad
operand recast in backward: [Note: weights recast in backward] in quant_tensors.quantizer) or a
QuantizedTensor parameter (quantized primary weights, see `qt.convert(..., quantized_weights=True)`).
With gradient accumulation, `weight_cache(model)` quantizes each high-precision weight once per
step rather than once per micro-batch ([Note: weight cache across micro-batches]).
A 2-D-scaled quantized weight kept rowwise-only gets its columnwise data just for the dgrad GEMM
and drops it again.

Fallback policy: a weight shape the recipe cannot quantize (`quantizer.is_quantizable` false,
e.g. in_features=100 for 128 x 128 blocks) makes the layer compute in high precision, with one
warning when the layer is built. Token counts need no alignment: kernels take partial blocks.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from quant_tensors import ops
from quant_tensors._fsdp import in_backward
from quant_tensors._tensor import QuantizedTensor, bind_shard_amax_group, local_quantized, local_shard, shard_like
from quant_tensors.ops import scaled_mm, scaled_mm_unchecked
from quant_tensors.quantizer import Quantizer
from quant_tensors.recipes import ROLES, Recipe

_HIGH_PRECISION_INIT = "_quant_tensors_high_precision_init_value"


def high_precision_init_value(param: torch.Tensor) -> torch.Tensor | None:
    """The high-precision value a quantized parameter was made from, or None; freed once taken.

    Optimizers call this once to initialise their fp32 master copy exactly, not from the
    (lossy) dequantized parameter.
    """
    value = getattr(param, _HIGH_PRECISION_INIT, None)
    if value is not None:
        delattr(param, _HIGH_PRECISION_INIT)
    return value


def attach_high_precision_init_value(param: torch.Tensor, value: torch.Tensor) -> None:
    """Remembers `value` as the high-precision value `param` was quantized from (see above)."""
    setattr(param, _HIGH_PRECISION_INIT, value)


_HIGH_PRECISION_FORM = "_quant_tensors_quantized_weight_in_high_precision"


def mark_quantized_weight(param: torch.Tensor) -> None:
    """Marks a high-precision parameter as a quantized weight held in high precision on this
    layout (quant-fsdp's alignment fallback: its shards would split blocks), quantized on another.

    Its value is then its master: FusedAdam checkpoints it as one, so that a layout holding the
    weight quantized can load it ([Note: checkpoints across weight forms] in quant_optim._adam).
    """
    setattr(param, _HIGH_PRECISION_FORM, True)


def is_quantized_weight(param: torch.Tensor) -> bool:
    """Whether `param` is a quantized weight in either form: a QuantizedTensor (or a DTensor of
    one), or a high-precision parameter marked by `mark_quantized_weight`."""
    return local_quantized(param) is not None or getattr(param, _HIGH_PRECISION_FORM, False)


def quantized_parameter(value: torch.Tensor, quantizer: Any, *, requires_grad: bool = True) -> torch.nn.Parameter:
    """A Parameter holding `quantizer.quantize(value)`, remembering `value` for the master copy."""
    param = torch.nn.Parameter(quantizer.quantize(value.detach()), requires_grad=requires_grad)
    attach_high_precision_init_value(param, value.detach().clone())
    return param


@dataclass(frozen=True)
class LayerArguments:
    """The constant arguments of one qt.nn.Linear's quantized GEMMs, made once per layer (and again
    when its recipe or a quantizer is replaced): hashable and compared by value, so torch.compile
    treats them as one constant and equal layers share compiled code."""

    input_quantizer: Quantizer
    weight_quantizer: Quantizer
    grad_output_quantizer: Quantizer
    fprop_fast_accumulation: bool
    """The recipe's `fprop_fast_accumulation` ([Note: fast accumulation] in quant_tensors.ops)."""
    weight_recast: bool
    """`weight_quantizer.recasts_columnwise` ([Note: weights recast in backward])."""

    @classmethod
    def of(
        cls, recipe: Recipe, input_quantizer: Quantizer, weight_quantizer: Quantizer, grad_output_quantizer: Quantizer
    ):
        return cls(
            input_quantizer,
            weight_quantizer,
            grad_output_quantizer,
            recipe.fprop_fast_accumulation,
            weight_quantizer.recasts_columnwise,
        )


# Input dtypes the quantized GEMMs take (quant-core's quantize kernels read these).
_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# [Note: qt.nn.Linear under torch.compile] The autograd Function below is `allow_in_graph`:
# dynamo records one call to it and AOTAutograd traces its forward and backward, quantized
# tensors included, into aten ops and quant-core custom ops. Its arguments are therefore tensors
# (the per-step quantizer states among them, updated in place, so compiled and eager runs advance
# the same histories and counters) and constants: the layer's LayerArguments, a frozen dataclass
# of frozen quantizers compared by value ([Note: quantizer configuration and bindings]), so equal
# layers share compiled code.
@torch._dynamo.allow_in_graph
class _QuantizedLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        cached_weight: QuantizedTensor | None,
        input_state: torch.Tensor | None,
        weight_state: torch.Tensor | None,
        grad_output_state: torch.Tensor | None,
        args: LayerArguments,
        grad_enabled: bool,
    ) -> torch.Tensor:
        # x and weight were checked by Linear.linear: below it the quantizers' unchecked entries run.
        # Only operands a gradient needs get columnwise data: none under no_grad (inference).
        needs_dgrad, needs_wgrad = grad_enabled and ctx.needs_input_grad[0], grad_enabled and ctx.needs_input_grad[1]
        weight_quantizer = args.weight_quantizer
        if isinstance(x, QuantizedTensor):
            qx = _prequantized(x, "input", rowwise=True, columnwise=needs_wgrad)
        else:
            qx = _quantize_input(x, args.input_quantizer, input_state, columnwise=needs_wgrad)
        # dgrad's weight operand: a quantized parameter as it is (or the quantization of a
        # high-precision one that `weight_cache` holds); a high-precision one saved as itself and
        # recast in backward ([Note: weights recast in backward]) where its quantizer can, else its
        # columnwise data saved from here.
        recast, recast_key = False, ()
        if isinstance(weight, QuantizedTensor):
            qw = saved_w = weight
        elif cached_weight is not None:
            qw = saved_w = cached_weight
        elif needs_dgrad and args.weight_recast:
            if weight_state is None and weight_quantizer.state is not None:  # `_state_for`, inline
                weight_state = weight_quantizer._state_for(weight, None)
            qw, recast_key = weight_quantizer._quantize_recastable(weight, weight_state)
            saved_w, recast = weight, True
        else:
            qw = weight_quantizer.quantize(weight, state=weight_state, rowwise=True, columnwise=needs_dgrad)
            saved_w = _columnwise_only(qw)
        if isinstance(x, QuantizedTensor):  # quantized by the caller: checked against the weight
            y = scaled_mm(qx, qw, x.dtype, bias=bias, fast_accumulation=args.fprop_fast_accumulation)
        else:
            path = ops.scaled_mm_path(qx, qw)
            y = scaled_mm_unchecked(qx, qw, x.dtype, "rowwise", "rowwise", bias, args.fprop_fast_accumulation, path)
        # Saved for backward: columnwise data only (wgrad's input), as a new wrapper: a shared
        # input keeps its usages ([Note: sibling layers share one quantized input]).
        saved_x = _columnwise_only(qx) if needs_wgrad else None
        ctx.save_for_backward(saved_x, saved_w if needs_dgrad else None, *recast_key)
        ctx.weight_recast, ctx.weight_quantizer = recast, weight_quantizer
        # Not saved for backward: the state is meant to change in place (other layers sharing a
        # quantizer's state, e.g. tensor-parallel gathers, advance it before this backward runs).
        ctx.grad_output_state = grad_output_state
        ctx.grad_output_quantizer, ctx.x_shape = args.grad_output_quantizer, x.shape
        ctx.has_bias, ctx.weight_dtype = bias is not None, weight.dtype
        ctx.x_prequantized = isinstance(x, QuantizedTensor)
        # _unsafe_view, as torch.matmul does: the output is not a view of a temporary (FSDP2 warns on views)
        return torch.ops.aten._unsafe_view(y, (*x.shape[:-1], y.shape[-1]))

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        qx, qw, *recast_key = ctx.saved_tensors
        needs_dgrad, needs_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if ctx.weight_recast:
            qw = ctx.weight_quantizer._recast_columnwise(qw, tuple(recast_key))  # qw: the weight checked in forward
        if isinstance(dy, QuantizedTensor):  # e.g. gathered quantized by a row-parallel sequence-parallel layer
            qdy = _prequantized(dy, "gradient", rowwise=needs_dgrad, columnwise=needs_wgrad)
        elif needs_dgrad or needs_wgrad:
            # `quantize(dy_MK, state=..., rowwise=needs_dgrad, columnwise=needs_wgrad)`: autograd gives dy
            # the output's dtype and shape, so the forward's check of x holds for it.
            quantizer, state, dy_MK = ctx.grad_output_quantizer, ctx.grad_output_state, dy.reshape(-1, dy.shape[-1])
            if state is None and quantizer.state is not None:  # `_state_for`, inline
                state = quantizer._state_for(dy_MK, None)
            usages = (needs_dgrad, needs_wgrad and not (quantizer.columnwise_on_demand and needs_dgrad))
            qdy = quantizer._quantize(dy_MK, out=None, amax=None, state=state, usages=usages)
        else:  # only the bias needs a gradient
            qdy = None
        dx = dw = db = None
        if needs_dgrad:
            derived = qw.columnwise_data is None
            if derived:
                qw.update_usage(columnwise=True)  # lossless transpose, only for this GEMM
            if qdy is dy:  # quantized by the caller: checked against the weight
                dx = scaled_mm(qdy, qw, dy.dtype, b_usage="columnwise")
            else:
                path = ops.scaled_mm_path(qdy, qw, b_usage="columnwise")
                dx = scaled_mm_unchecked(qdy, qw, dy.dtype, "rowwise", "columnwise", None, False, path)
            dx = dx.reshape(ctx.x_shape)
            if derived:
                qw.update_usage(columnwise=False)
        if needs_wgrad:
            if qdy is dy or ctx.x_prequantized:
                dw = scaled_mm(qdy, qx, ctx.weight_dtype, a_usage="columnwise", b_usage="columnwise")
            else:
                path = ops.scaled_mm_path(qdy, qx, a_usage="columnwise", b_usage="columnwise")
                dw = scaled_mm_unchecked(qdy, qx, ctx.weight_dtype, "columnwise", "columnwise", None, False, path)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            if qdy is dy:
                raise ValueError(
                    "the bias gradient is the sum of the high-precision gradient, which a quantized gradient no longer "
                    "holds; add the bias outside the layer (as QuantRowwiseParallel does) or pass a plain gradient"
                )
            db = dy.reshape(-1, dy.shape[-1]).sum(dim=0)
        return dx, dw, db, None, None, None, None, None, None


class Linear(torch.nn.Linear):
    """nn.Linear with quantized fprop, dgrad and wgrad GEMMs under `recipe`."""

    _weight_cache: dict[str, Any] | None = None
    """While `weight_cache` is active: its entry for this layer ({} until the first forward)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        recipe: Recipe,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        if not isinstance(recipe, Recipe):
            raise TypeError(
                f"recipe must be a quant_tensors recipe (e.g. qt.Float8CurrentScaling()), got {type(recipe).__name__}"
            )
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self._recipe = recipe
        self.arguments = LayerArguments.of(
            recipe, recipe.quantizer("input"), recipe.quantizer("weight"), recipe.quantizer("grad_output")
        )
        self.make_quantizer_states(device)
        self.high_precision_reason = _unquantizable_reason(self.weight_quantizer, in_features, out_features, recipe)
        if self.high_precision_reason:
            warnings.warn(self.high_precision_reason, stacklevel=2)

    # The recipe and quantizers are the layer's `arguments`; replacing one makes them again.
    @property
    def recipe(self) -> Recipe:
        return self._recipe

    @recipe.setter
    def recipe(self, recipe: Recipe) -> None:
        self._recipe = recipe
        args = self.arguments
        self.arguments = LayerArguments.of(
            recipe, args.input_quantizer, args.weight_quantizer, args.grad_output_quantizer
        )

    @property
    def input_quantizer(self) -> Quantizer:
        return self.arguments.input_quantizer

    @input_quantizer.setter
    def input_quantizer(self, quantizer: Quantizer) -> None:
        args = self.arguments
        self.arguments = LayerArguments.of(self._recipe, quantizer, args.weight_quantizer, args.grad_output_quantizer)

    @property
    def weight_quantizer(self) -> Quantizer:
        return self.arguments.weight_quantizer

    @weight_quantizer.setter
    def weight_quantizer(self, quantizer: Quantizer) -> None:
        args = self.arguments
        self.arguments = LayerArguments.of(self._recipe, args.input_quantizer, quantizer, args.grad_output_quantizer)

    @property
    def grad_output_quantizer(self) -> Quantizer:
        return self.arguments.grad_output_quantizer

    @grad_output_quantizer.setter
    def grad_output_quantizer(self, quantizer: Quantizer) -> None:
        args = self.arguments
        self.arguments = LayerArguments.of(self._recipe, args.input_quantizer, args.weight_quantizer, quantizer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x, self.weight, self.bias)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """`x @ weight^T + bias` under this layer's recipe, for a given (local) weight and bias.

        `forward` passes the layer's own parameters; tensor-parallel styles (quant_fsdp.parallel)
        pass their local shards and communicate around the call. `x` may already be quantized by
        `input_quantizer` (2-D, e.g. gathered quantized along the sequence): it is used as it is,
        and needs rowwise data, plus columnwise when the weight needs a gradient.
        """
        if self.high_precision_reason:
            x = x.dequantize() if isinstance(x, QuantizedTensor) else x
            weight = weight.dequantize(x.dtype) if isinstance(weight, QuantizedTensor) else weight
            return torch.nn.functional.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))
        # The one check of x and weight: below this the quantizers' and GEMM's unchecked entries run.
        if x.dtype not in _INPUT_DTYPES or weight.dtype not in _INPUT_DTYPES or x.dim() == 0:
            raise TypeError(
                f"qt.nn.Linear quantizes float32, bfloat16 or float16 inputs and weights of at least one dim; got an "
                f"input {x.dtype} of shape {tuple(x.shape)} and a weight {weight.dtype}: convert them (e.g. x.float())"
            )
        if x.shape[-1] != weight.shape[-1]:
            raise ValueError(
                f"qt.nn.Linear: the input's last dim is {x.shape[-1]} but the weight's in_features are "
                f"{weight.shape[-1]}; pass an input of shape (..., {weight.shape[-1]})"
            )
        if (
            isinstance(weight, QuantizedTensor)
            and weight.rowwise_data is None
            and not torch.compiler.is_compiling()
            and in_backward()
        ):
            raise ValueError(
                f"qt.nn.Linear: a forward recomputed in the backward (activation checkpointing) got a "
                f"{type(weight).__name__} weight without the rowwise data it needs: FSDP2's backward gather brings "
                "only columnwise data of 1-D block formats (MXFP8) unless the FSDP2 module holds a checkpoint_wrapper. "
                "Apply activation checkpointing with torch's checkpoint_wrapper to the module fully_shard wraps (or to "
                "modules inside it) instead of torch.utils.checkpoint calls, or fully_shard that module with "
                "reshard_after_forward=False."
            )
        states = self._buffers
        # is_compiling first: dynamo folds it, so compiled code never reads the cache (its graph quantizes)
        cached = None
        if (
            not torch.compiler.is_compiling()
            and self._weight_cache is not None
            and weight is self.weight
            and not isinstance(weight, QuantizedTensor)  # a quantized parameter is used as it is
        ):
            columnwise = torch.is_grad_enabled() and x.requires_grad  # dgrad's operand
            cached = _cached_quantization(self._weight_cache, weight, self.weight_quantizer, states, columnwise)
        return _QuantizedLinearFunction.apply(
            x,
            weight,
            bias,
            cached,
            states.get("input_quantizer_state"),
            states.get("weight_quantizer_state"),
            states.get("grad_output_quantizer_state"),
            self.arguments,
            torch.is_grad_enabled(),  # needs_input_grad ignores no_grad
        )

    # ---- quantizer states ([Note: quantizer configuration and bindings]) -----------------------

    def make_quantizer_states(self, device: torch.device | str | None = None) -> None:
        """Registers a fresh state buffer `<role>_quantizer_state` on `device` for each stateful
        quantizer (delayed scaling's amax histories, NVFP4's stochastic-rounding counter) and binds
        it to the quantizer. Buffers move with `.to()` and are saved in the state dict."""
        for role in ROLES:
            state = getattr(self, f"{role}_quantizer").new_state(device)
            if state is not None:
                self.register_buffer(f"{role}_quantizer_state", state)
        self._bind_quantizer_states()

    def _bind_quantizer_states(self) -> None:
        """Binds each state buffer to its quantizer, in place, so the quantizer's other holders (a
        quantized weight's `.quantizer`, quant-fsdp's hooks, FusedAdam) use the module's state."""
        for role in ROLES:
            state = self._buffers.get(f"{role}_quantizer_state")
            if state is not None:
                getattr(self, f"{role}_quantizer").bind(state=state)
        weight = local_quantized(self._parameters.get("weight"))
        if weight is not None and weight.quantizer is not None and weight.quantizer == self.weight_quantizer:
            weight.quantizer = self.weight_quantizer

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        """nn.Module._apply, keeping each state buffer's dtype (`.half()` moves, never rounds, an
        amax history) and binding the moved states."""
        before = {name: t for name, t in self._buffers.items() if name.endswith("_quantizer_state")}
        super()._apply(fn, recurse)
        for name, state in before.items():
            if self._buffers[name].dtype != state.dtype:
                self._buffers[name] = state.to(self._buffers[name].device)
        self._bind_quantizer_states()
        return self

    def _load_from_state_dict(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super()._load_from_state_dict(*args, **kwargs)
        self._bind_quantizer_states()  # load_state_dict(assign=True) replaces buffers

    def reset_parameters(self, init: Mapping[str, Callable[[torch.Tensor], object]] | None = None) -> None:
        """nn.Linear's initialisation, or `init[name](parameter)` for "weight" and "bias" (in place, as
        torch.nn.init's functions and torchtitan's `param_init` do); a quantized weight is initialised
        in high precision, then requantized.

        Under FSDP2 (a DTensor weight after meta-device init) only the local shard is initialised
        and quantized; its quantizer's `amax_group` keeps per-tensor scales equal across shards
        (the shard group, bound here where torch's `fully_shard` sharded the weight and no gather
        has bound it yet: `quant_tensors.fsdp.bind_shard_amax_group`).
        """
        for role in ROLES:  # absent while nn.Linear.__init__ runs
            state = self._buffers.get(f"{role}_quantizer_state")
            if state is not None:
                state.zero_()
        bind_shard_amax_group(getattr(self, "weight", None))
        if init is not None:
            for name, param in self.named_parameters(recurse=False):
                if name == "weight" and local_quantized(param) is not None:
                    value = _high_precision_like(param)
                    init[name](value)
                    with torch.no_grad():
                        param.copy_(value)
                    attach_high_precision_init_value(param, value)
                else:
                    init[name](param)
            return
        if local_quantized(getattr(self, "weight", None)) is None:
            super().reset_parameters()
            return
        value = _high_precision_like(self.weight)
        torch.nn.init.kaiming_uniform_(value, a=math.sqrt(5))
        with torch.no_grad():
            self.weight.copy_(value)
        attach_high_precision_init_value(self.weight, value)
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0
            torch.nn.init.uniform_(self.bias, -bound, bound)

    def extra_repr(self) -> str:
        mode = f", high precision: {self.high_precision_reason}" if self.high_precision_reason else ""
        return f"{super().extra_repr()}, recipe={type(self.recipe).__name__}{mode}"


# [Note: weight cache across micro-batches] With gradient accumulation every micro-batch's
# forward would quantize each high-precision weight again and its backward recast the dgrad
# operand, though the weights only change at the optimizer step: for per-tensor FP8 three passes
# over every weight (~8 bytes of traffic per element) and two quantize calls per Linear per
# micro-batch. Inside `weight_cache(module)` each qt.nn.Linear of the module quantizes its weight
# at the first forward (with columnwise data when a dgrad will need it, else rowwise only, made
# again with both if a later forward needs them) and reuses that while the weight's version
# counter stays the same: an optimizer step or any in-place write makes the next forward quantize
# again. dgrad then uses that quantization, not a recast. Consequences, all deliberate:
# - Memory: the block holds each weight's quantization (FP8: 2 bytes per element, both usages)
#   from the first forward to the block's exit, which the recast saves otherwise; so the cache is
#   opt-in and scoped, and it drops everything on exit.
# - A stateful weight quantizer (delayed scaling) records one amax per weight version, not one per
#   forward. Stateless quantizers give the same bytes as quantizing every time.
# - Eager code only: under torch.compile the graph quantizes (the cache is never read, no guard).
# - DTensor weights (FSDP2, tensor parallel) are refused at entry: the forward sees a gathered or
#   local tensor the layer does not own, which the version counter cannot vouch for.


@contextlib.contextmanager
def weight_cache(module: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Quantize each high-precision weight of `module`'s qt.nn.Linear layers once per weight
    version inside the block ([Note: weight cache across micro-batches]):

        with qt.nn.weight_cache(model):
            for inputs, targets in micro_batches:
                loss_fn(model(inputs), targets).backward()
        optimizer.step()
    """
    layers = [(name, m) for name, m in module.named_modules() if isinstance(m, Linear)]
    for name, layer in layers:
        where = f"qt.nn.weight_cache: layer {name!r}" if name else "qt.nn.weight_cache: the layer"
        if layer._weight_cache is not None:
            raise RuntimeError(f"{where} is already inside a weight_cache block; enter one block per module")
        if isinstance(layer.weight, DTensor):
            raise ValueError(
                f"{where} has a DTensor weight (FSDP2 or tensor parallel), which its forward sees gathered or as a "
                "local shard; use the cache on unsharded models (FSDP2 can gather quantized weights instead: "
                "quant_fsdp.fully_shard(..., quantize_on_gather=True))"
            )
    for _, layer in layers:
        layer._weight_cache = {}
    try:
        yield module
    finally:
        for _, layer in layers:
            layer._weight_cache = None


def _cached_quantization(
    entry: dict[str, Any],
    weight: torch.Tensor,
    quantizer: Quantizer,
    states: dict[str, torch.Tensor | None],
    columnwise: bool,
) -> QuantizedTensor:
    """The layer's high-precision weight quantized for this forward (with columnwise data if
    asked), from `entry` (the layer's cache) or made and kept there."""
    kept = entry.get("weight")
    if kept is not None and entry["version"] == weight._version and kept.usages[1] >= columnwise:
        return kept
    entry.clear()  # frees the stale quantization before the new one is made
    with torch.no_grad():
        kept = quantizer.quantize(
            weight, state=states.get("weight_quantizer_state"), rowwise=True, columnwise=columnwise
        )
    entry.update(weight=kept, version=weight._version)
    return kept


# [Note: sibling layers share one quantized input] A transformer block feeds one tensor to
# several Linears (the q/k/v projections, gate/up). Each layer quantizing it again would cost a
# quantize (kernels, host time) and a saved copy of its columnwise data (peak memory) per extra
# layer. So the first layer's quantized input is remembered, keyed weakly by the tensor, and a
# later layer reuses it while the tensor is alive and unmodified (same version counter) if its
# quantizer quantizes like the first one (same configuration, stateless) and all-reduces over the
# same group, and it holds the usages needed. Stateful quantizers (delayed scaling records every
# layer's amax in its own history) never share; neither do inference-mode tensors (no version
# counter). The entry (rowwise data included) is an attribute of the tensor: it lives as long as
# the tensor does.
_QUANTIZED_INPUT = "_quant_tensors_quantized_input"


def _quantize_input(
    x: torch.Tensor, quantizer: Quantizer, state: torch.Tensor | None, *, columnwise: bool
) -> QuantizedTensor:
    """x quantized with rowwise (and, if asked, columnwise) data, shared between sibling layers."""
    shareable = state is None and quantizer.stateless and not x.is_inference()
    if shareable:
        entry = getattr(x, _QUANTIZED_INPUT, None)
        if entry is not None:
            version, maker, qx = entry
            if (
                version == x._version
                and maker.quantizes_like(quantizer)
                and maker.amax_group_name == quantizer.amax_group_name
                and qx.usages[1] >= columnwise
            ):
                return qx
    x_MK = x.reshape(-1, x.shape[-1])
    # `quantizer.quantize(x_MK, state=state, rowwise=True, columnwise=columnwise)` of an input `linear` checked
    usages = (True, columnwise and not quantizer.columnwise_on_demand)
    if state is None and quantizer.state is not None:  # `_state_for`, inline
        state = quantizer._state_for(x, None)
    qx = quantizer._quantize(x_MK, out=None, amax=None, state=state, usages=usages)
    if shareable:
        setattr(x, _QUANTIZED_INPUT, (x._version, quantizer, qx))
    return qx


def _columnwise_only(t: QuantizedTensor) -> QuantizedTensor:
    """A new wrapper of t's columnwise data (t itself keeps its rowwise data), or t if it has no columnwise data."""
    if t.columnwise_data is None:
        return t
    # `t._rebuilt()` then `update_usage(rowwise=False)`, which drops the rowwise buffers, in one step
    fields = {}
    for name in t._buffer_names:
        if not name.startswith("rowwise_"):
            fields[name] = getattr(t, name)
    for name in t._metadata_names:
        fields[name] = getattr(t, name)
    return type(t).from_buffers(t.shape, t.dtype, t.device, **fields)


def _prequantized(t: QuantizedTensor, what: str, *, rowwise: bool, columnwise: bool) -> QuantizedTensor:
    """An input or gradient the caller quantized for the GEMMs: checked, given derivable
    columnwise data if it lacks it, and otherwise used as it is."""
    role, name = ("input_quantizer", "x") if what == "input" else ("grad_output_quantizer", "dy")
    if t.dim() != 2 or (rowwise and not t.usages[0]):
        raise ValueError(
            f"qt.nn.Linear takes a quantized {what} of 2 dims with rowwise data, got shape {tuple(t.shape)} with "
            f"usages (rowwise, columnwise) = {t.usages}; quantize {name}.reshape(-1, {name}.shape[-1]) with "
            f"{role}.with_usage(rowwise=True, columnwise=...)"
        )
    if columnwise and not t.usages[1]:
        if not t.quantizer.can_derive_columnwise:
            raise ValueError(
                f"the wgrad GEMM needs the quantized {what}'s columnwise data, which this {t.quantizer.format_name} "
                f"{what} lacks; quantize it with {role}.with_usage(rowwise=True, columnwise=True)"
            )
        t.update_usage(columnwise=True)
    return t


def _high_precision_like(weight: torch.Tensor) -> torch.Tensor:
    """An uninitialised high-precision tensor shaped (and, for a DTensor, sharded) like `weight`."""
    local = local_shard(weight)
    return shard_like(weight, torch.empty(local.shape, dtype=weight.dtype, device=local.device))


def _unquantizable_reason(quantizer: Any, in_features: int, out_features: int, recipe: Recipe) -> str:
    rows_multiple, k_multiple = quantizer.dim_multiple
    problems = []
    if in_features % k_multiple:
        problems.append(f"in_features={in_features} is not a multiple of {k_multiple}")
    if out_features % rows_multiple:
        problems.append(f"out_features={out_features} is not a multiple of {rows_multiple}")
    if not problems:
        return ""
    return (
        f"qt.nn.Linear({in_features}, {out_features}) with {type(recipe).__name__}: {' and '.join(problems)}, "
        "so the quantized GEMMs cannot take this weight; the layer computes in high precision. Pad the "
        "features to those multiples to quantize it."
    )
