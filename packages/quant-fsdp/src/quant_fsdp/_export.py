"""export_state_dict: a trained model's weights as plain tensors for the model class before qt.convert.

[Note: export] torch's full state dict (`get_model_state_dict(model,
options=StateDictOptions(full_state_dict=True))`) of a quantized model is the state dict of the
unsharded quantized model: QuantizedTensor weights, qt.nn.Linear's quantizer states (amax
histories, stochastic-rounding counters) among the buffers ([Note: quantized full tensor] in
quant_tensors._collectives). It loads back into the quantized model, sharded or not. The export
is for the other destination, the original model class (inference, another framework): every
entry a plain tensor on the CPU, keyed like that model's state dict:
- a quantized weight is dequantized on each rank before it is gathered (a shard of a quantized
  weight holds whole blocks and the tensor's per-tensor values, so dequantizing the shard is the
  shard of the dequantized weight, bit for bit), so the gather is a plain tensor's, whatever the
  placement (FSDP2's dim-0 shards, tensor parallelism's dim-1 ones);
- with an optimizer, the fp32 master weights it keeps (`optimizer.state[p]["master"]`, as
  quant_optim.FusedAdam does) replace their weights: the values training converged to, before
  the last quantization. quant_fsdp does not import quant_optim (sibling packages), so the
  optimizer is read through torch's Optimizer interface (`param_groups`, `state`);
- qt.nn.Linear's `<role>_quantizer_state` buffers and the FP8 reduce-scatter's state buffers
  ([Note: reduce-scatter state] in quant_fsdp._reduce_scatter), which the original model does
  not have, are left out; every other entry is kept under the key the model's own state_dict gives it
  (FSDP2's state_dict pre-hooks register the sharded parameters first).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import quant_tensors as qt
from quant_fsdp._quantize_on_gather import QuantizeOnGatherTensor
from quant_fsdp._reduce_scatter import STATE_BUFFERS

MASTER_KEY = "master"


@torch.no_grad()
def export_state_dict(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, *, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """The model's weights as plain high-precision CPU tensors for the model class before qt.convert
    ([Note: export] in quant_fsdp._export).

    Quantized weights are dequantized, sharded (DTensor) entries gathered whole, and qt.nn.Linear's
    quantizer states and the FP8 reduce-scatter's state left out, so the result loads with
    `load_state_dict(strict=True)` into the unconverted model. A collective for sharded models:
    every rank calls it; rank 0 gets the dict and the other ranks an empty one (as with torch's
    `full_state_dict=True, cpu_offload=True`). Without torch.distributed the one process gets it.

    Args:
        model: the converted model (qt.convert), sharded with FSDP2 (quant_fsdp.fully_shard or
            torch's fully_shard) or tensor parallelism, or not sharded.
        optimizer: the optimizer training `model` (it must own every trainable parameter); the
            fp32 master weights it keeps (quant_optim.FusedAdam) are exported instead of the
            weights they belong to.
        dtype: a floating-point dtype for every floating-point tensor; default: each weight's
            own dtype (a quantized weight's nominal dtype), fp32 for masters.
    """
    if dtype is not None and not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point dtype (or None to keep each tensor's own), got {dtype}")
    masters = _masters(model, optimizer) if optimizer is not None else {}
    quantizer_states = {
        id(buffer)
        for module in model.modules()
        if isinstance(module, qt.nn.Linear)
        for role in qt.ROLES
        if (buffer := getattr(module, f"{role}_quantizer_state", None)) is not None
    }
    receives = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
    exported = {}
    for key, value in model.state_dict(keep_vars=True).items():
        if id(value) in quantizer_states or key.rpartition(".")[2] in STATE_BUFFERS:
            continue
        full = _full_plain(masters.get(id(value), value))
        if receives:
            cast = dtype if dtype is not None and full.is_floating_point() else full.dtype
            exported[key] = full.to("cpu", cast, copy=True)
    return exported


def _masters(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[int, torch.Tensor]:
    """The optimizer's master weight of each parameter that has one, by id of the parameter."""
    owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
    foreign = [name for name, p in model.named_parameters() if p.requires_grad and id(p) not in owned]
    if foreign:
        raise ValueError(
            f"the optimizer does not own {len(foreign)} trainable parameter(s) of the model ({', '.join(foreign[:3])}"
            f"{', ...' if len(foreign) > 3 else ''}): pass the optimizer built over this model's parameters (after "
            "sharding), or optimizer=None to export the weights themselves"
        )
    masters = {}
    for name, p in model.named_parameters():
        master = optimizer.state.get(p, {}).get(MASTER_KEY)
        if master is not None:
            masters[id(p)] = master
        elif p.requires_grad and qt.local_quantized(p) is not None:
            raise ValueError(
                f"{name} is a quantized weight, but {type(optimizer).__name__} keeps no fp32 master for it (state key "
                f"{MASTER_KEY!r}, as quant_optim.FusedAdam keeps): pass optimizer=None to export the dequantized weights"
            )
    return masters


def _full_plain(value: Any) -> torch.Tensor:
    """The whole tensor as a plain tensor: quantized shards dequantized, then gathered (a collective for DTensors)."""
    local = qt.local_shard(value)
    if isinstance(local, qt.QuantizedTensor):
        value = qt.shard_like(value, local.dequantize())
    elif isinstance(local, QuantizeOnGatherTensor):
        value = qt.shard_like(value, local._data)
    return value.full_tensor() if isinstance(value, DTensor) else value.detach()
