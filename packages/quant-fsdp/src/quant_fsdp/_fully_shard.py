"""quant_fsdp.fully_shard: torch's fully_shard, plus the gather plan of every quantized weight.

QuantizedTensors carry FSDP2's all-gather hooks themselves (quant_tensors), so torch's fully_shard
gathers quantized primary weights (mode 1) as they are. `fully_shard`, for the parameters the call
manages:
1. decides each quantized weight's gather ([Note: alignment policy] in quant_fsdp._plan);
2. mode 1: aligned QuantizedTensor weights stay quantized (rowwise only where columnwise is a
   lossless transpose), and their quantizers get the shard group as `amax_group` (per-tensor
   scales agree across shards); misaligned ones become
   high-precision QuantizeOnGatherTensor weights (the fallback), from their high-precision
   initial value where qt.convert kept one;
3. mode 2 (`quantize_on_gather=True`): the high-precision weights of qt.nn.Linear layers become
   QuantizeOnGatherTensor weights that gather quantized (or take the fallback); tensor-parallel
   weights (quant_fsdp.parallel) keep their DTensor, whose local slice becomes a gather-only
   QuantizeOnGatherTensor: the fallback's high-precision gather, not quantized after (the TP layer
   quantizes its slice in the forward), so that comm_stats() and gather_plan() show it;
4. calls torch's fully_shard, and shards the kept high-precision initial values alongside;
5. binds each quantized weight's quantizer a context (quant_fsdp._context.ShardedWeight) that the
   gather hooks and DCP consult: its plan, FSDP module, placement and byte counts;
6. lets checkpoints load each quantized weight from either of its forms ([Note: checkpoints
   across weight forms] in quant_optim._adam, quant_fsdp._checkpoint): the fallback weights of
   mode 1 are marked as quantized weights (`qt.nn.mark_quantized_weight`), and staged loads that
   need a collective are requantized by a load_state_dict post-hook.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

import quant_tensors as qt
from quant_fsdp import _checkpoint, _plan
from quant_fsdp._amax import HistorySyncHook, amax_histories
from quant_fsdp._context import ShardedWeight
from quant_fsdp._quantize_on_gather import QuantizeOnGatherTensor
from quant_fsdp._reduce_scatter import QuantizedReduceScatter
from quant_fsdp._reduce_scatter import install as install_reduce_scatter
from quant_tensors import QuantizedTensor

logger = logging.getLogger("quant_fsdp")


def fully_shard(
    module: torch.nn.Module,
    *,
    quantize_on_gather: bool = False,
    print_plan: bool = False,
    reduce_scatter: str | QuantizedReduceScatter | None = None,
    **kwargs: Any,
) -> torch.nn.Module:
    """torch.distributed.fsdp.fully_shard for models with quantized weights (a drop-in replacement).

    `quantize_on_gather=True` keeps qt.nn.Linear weights in high precision (mode 2: any torch
    optimizer steps them) and quantizes each shard when FSDP2 gathers it. Quantized primary
    weights (qt.convert(..., quantized_weights=True)) gather their bytes either way. Weights whose
    shards cannot be quantized on their own take the explicit fallback; see `gather_plan(module)`,
    the "quant_fsdp" logger and `comm_stats()`. `print_plan=True` prints, on rank 0, the plan of
    `module` and of the submodules sharded before it. `reduce_scatter="fp8"` (or a
    `QuantizedReduceScatter`) reduce-scatters the gradients of the parameters this call manages in
    FP8 (`module.set_custom_reduce_scatter`); give it to each fully_shard call whose gradients
    should travel in FP8. A comm with stochastic rounding or error feedback is bound to `module`:
    its state becomes buffers of the module, saved with its state dict ([Note: reduce-scatter
    state] in quant_fsdp._reduce_scatter). Other keyword arguments go to torch's fully_shard (mesh,
    reshard_after_forward, mp_policy, ...).
    """
    reduce_scatter_comm = _reduce_scatter_comm(reduce_scatter)
    reshard = kwargs.get("reshard_after_forward", True)
    mesh = kwargs.get("mesh") or _default_mesh(module)
    shard_group = mesh.get_group(mesh.ndim - 1)
    world_size = mesh.size(mesh.ndim - 1)
    # Plan every quantized weight first; change nothing until every check has passed.
    entries = []
    managed = list(_managed_parameters(module, kwargs.get("ignored_params")))
    for name, owner, attribute, param in managed:
        quantizer, mode = _quantizer_and_mode(owner, attribute, param, quantize_on_gather)
        if quantizer is not None:
            tensor_parallel = isinstance(param, DTensor)
            reason = _plan.fallback_reason(quantizer, tuple(param.shape), world_size, tensor_parallel=tensor_parallel)
            entries.append(
                (
                    _plan.GatherPlan(name, quantizer.format_name, tuple(param.shape), mode, reason),
                    owner,
                    attribute,
                    param,
                    quantizer,
                )
            )
    _plan.check_ranks_agree([entry[0] for entry in entries], mesh)
    if entries and isinstance(reshard, int) and not isinstance(reshard, bool):
        raise ValueError(
            f"reshard_after_forward={reshard} (reshard to a smaller mesh) is not supported for quantized weights "
            f"({entries[0][0].name}, ...): FSDP2 does not call the all-gather hooks on that path. Use True or False."
        )
    init_values: dict[str, torch.Tensor] = {}
    contexts = []
    for plan, owner, attribute, param, quantizer in entries:
        context = ShardedWeight(plan.format, plan, module)
        quantizer.bind(shard_context=context)
        contexts.append(context)
        if plan.fallback_reason:
            logger.warning(
                "%s (%s, %s): gathers in high precision, then quantizes: %s",
                plan.name,
                plan.format,
                plan.mode,
                plan.fallback_reason,
            )
        elif quantizer.per_tensor_amax:
            quantizer.bind(amax_group=shard_group)
        if plan.mode == _plan.QUANTIZED_WEIGHTS and plan.quantized_gather:
            init_value = qt.high_precision_init_value(param)
            if init_value is not None:
                init_values[plan.name] = init_value
            _drop_derivable_columnwise(qt.local_quantized(param))
        else:
            value = _high_precision_value(param) if plan.mode == _plan.QUANTIZED_WEIGHTS else param.detach()
            local = QuantizeOnGatherTensor(
                qt.local_shard(value),
                quantizer,
                fallback=not plan.quantized_gather,
                quantize_after_gather=not isinstance(value, DTensor),  # a TP slice: its layer quantizes it
            )
            wrapped = qt.shard_like(value, local)
            owner.register_parameter(attribute, torch.nn.Parameter(wrapped, requires_grad=param.requires_grad))
    torch_fully_shard(module, **{**kwargs, "mesh": mesh})
    if reduce_scatter_comm is not None:
        install_reduce_scatter(module, reduce_scatter_comm)
    if amax_histories(module):  # [Note: shared amax histories]
        HistorySyncHook(tuple(mesh.get_group(d) for d in range(mesh.ndim))).register(module)
    _attach_init_value_shards(module, init_values, mesh)
    for (plan, *_), context in zip(entries, contexts, strict=True):
        param = module.get_parameter(plan.name)
        context.placement = _checkpoint.Placement.of(param)
        if plan.mode == _plan.QUANTIZED_WEIGHTS and not plan.quantized_gather:
            qt.nn.mark_quantized_weight(param)
    if entries:
        module.register_load_state_dict_post_hook(_checkpoint.RequantizePendingHook(contexts))
    _plan.record(module, tuple(entry[0] for entry in entries))
    if print_plan:
        _plan.print_plan(module)
    return module


def _reduce_scatter_comm(option: Any) -> QuantizedReduceScatter | None:
    if option is None or isinstance(option, QuantizedReduceScatter):
        return option
    if isinstance(option, str) and option == "fp8":
        return QuantizedReduceScatter()
    raise ValueError(
        f'reduce_scatter={option!r}: use None (FSDP2\'s own reduce-scatter), "fp8" or a '
        "quant_fsdp.QuantizedReduceScatter(...); another torch ReduceScatter goes to module.set_custom_reduce_scatter"
    )


def _drop_derivable_columnwise(weight: QuantizedTensor) -> None:
    """A sharded quantized weight keeps rowwise data only where columnwise is its lossless
    transpose (per-tensor FP8, 128x128 and 16x16 tiles): the GEMMs use the gathered tensor, which
    gets columnwise data from rowwise for the dgrad alone ([Note: quantized all-gather]), so a
    columnwise copy of the shard would be memory that nothing reads (a byte per element for FP8),
    and the optimizer's requantization then writes rowwise data only."""
    if (
        weight.columnwise_data is not None
        and weight.rowwise_data is not None
        and weight.quantizer.can_derive_columnwise
    ):
        weight.update_usage(columnwise=False)


def _default_mesh(module: torch.nn.Module) -> DeviceMesh:
    """The mesh torch's fully_shard would make: every rank, on the device of the module's parameters."""
    device = next((p.device for p in module.parameters() if p.device.type != "meta"), None)
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return init_device_mesh(device.type, (dist.get_world_size(),))


def _managed_parameters(
    module: torch.nn.Module, ignored: Any
) -> Iterator[tuple[str, torch.nn.Module, str, torch.nn.Parameter]]:
    """(name, owner module, attribute, parameter) for each parameter a fully_shard(module) call
    manages: those not already managed by an FSDP module below it, nor ignored."""
    ignored_ids = {id(p) for p in (ignored or ())}
    seen: set[int] = set()
    stack: list[tuple[str, torch.nn.Module]] = [("", module)]
    while stack:
        prefix, current = stack.pop()
        for attribute, param in current.named_parameters(recurse=False):
            if id(param) not in seen and id(param) not in ignored_ids:
                seen.add(id(param))
                yield prefix + attribute, current, attribute, param
        for child_name, child in current.named_children():
            if not isinstance(child, FSDPModule):
                stack.append((f"{prefix}{child_name}.", child))


def _quantizer_and_mode(
    owner: torch.nn.Module, attribute: str, param: torch.Tensor, quantize_on_gather: bool
) -> tuple[Any, str]:
    local = qt.local_quantized(param)
    if isinstance(param, DTensor) and local is not None:  # tensor parallel (quant_fsdp.parallel)
        raise NotImplementedError(
            f"{type(owner).__name__}.{attribute} is a quantized primary weight split for tensor parallelism; "
            "sharding it with FSDP2 as well is not built (its per-tensor scale would have to agree over TP x "
            "FSDP and its FSDP shards fall on block rows). Use high-precision weights for TP x FSDP2, or TP alone."
        )
    if local is not None:
        if local.quantizer is None:
            raise ValueError(f"quantized parameter {attribute} of {type(owner).__name__} has no quantizer")
        return local.quantizer, _plan.QUANTIZED_WEIGHTS
    if isinstance(qt.local_shard(param), QuantizeOnGatherTensor):
        raise ValueError(f"{type(owner).__name__}.{attribute} is already prepared by quant_fsdp.fully_shard")
    if (
        quantize_on_gather
        and isinstance(owner, qt.nn.Linear)
        and attribute == "weight"
        and not owner.high_precision_reason
    ):
        return owner.weight_quantizer, _plan.QUANTIZE_ON_GATHER
    return None, ""


def _high_precision_value(param: QuantizedTensor) -> torch.Tensor:
    """The value a fallback weight starts from: qt.convert's high-precision value, else the dequantized one."""
    value = qt.high_precision_init_value(param)
    if value is None:
        logger.warning(
            "a %s weight of shape %s takes the fallback without its high-precision initial value: it starts "
            "from the dequantized weight",
            param.quantizer.format_name,
            tuple(param.shape),
        )
        value = param.dequantize()
    return value.detach()


def _attach_init_value_shards(module: torch.nn.Module, init_values: dict[str, torch.Tensor], mesh: DeviceMesh) -> None:
    """Gives each sharded quantized weight the matching shard of its high-precision initial value."""
    for name, value in init_values.items():
        param = module.get_parameter(name)
        local = qt.local_shard(param)
        start = mesh.get_local_rank(mesh.ndim - 1) * local.shape[0]
        shard = value.narrow(0, start, local.shape[0])
        qt.nn.attach_high_precision_init_value(param, qt.shard_like(param, shard.contiguous()))
