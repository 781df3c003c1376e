"""The torch.distributed ops DTensor runs on a sharded QuantizedTensor: gather and scatter every buffer.

[Note: quantized full tensor] torch's full state dict (`get_model_state_dict(model,
options=StateDictOptions(full_state_dict=True))`) turns each DTensor parameter into its full
tensor with `redistribute` to Replicate: the functional `all_gather_into_tensor` on the local
shard, `wait_tensor`, and `_wrap_tensor_autograd` (the AsyncCollectiveTensor) on the result.
Loading one (`set_model_state_dict(..., full_state_dict=True)`) runs `distribute_tensor`: a
`torch.chunk` of the full tensor and a c10d `scatter_` from rank 0 of the shard group. These ops
live here, in the tensor's own op table, and not as a wrapper around torch's state-dict
functions in quant-fsdp, because
- they are what DTensor calls for every sharded QuantizedTensor, whoever sharded it
  (quant_fsdp.fully_shard, torch's own fully_shard, distribute_tensor): `DTensor.full_tensor()`,
  `redistribute` and torch's state-dict API then work as they do for plain tensors, with nothing
  to call first and nothing in torch's API to patch;
- the op sees the quantized layout, so it can move every buffer exactly. A shard that takes a
  quantized gather is the slice of the whole tensor's quantization (rows on block boundaries,
  per-tensor values agreed over the shard group), so the full tensor equals quantizing the
  unsharded tensor bit for bit: a full state dict is the state dict of the unsharded quantized
  model, it loads back bitwise, and `.dequantize()` makes plain tensors of it.

Layout rule (the one FSDP2's all-gather hooks use): buffers named `rowwise_*` follow the (M, K)
view and concatenate along dim 0; `columnwise_*` hold x^T and concatenate along dim 1; every other
buffer (per-tensor FP8's `scale_inv`, NVFP4's `amax`) is one value per tensor, gathered to check
that every rank holds the same bytes, then kept. Only dim-0 shards exist for quantized tensors
(`split` and `slice` refuse other dims), so the functional gather's dim 0 is the sharded dim.
Buffers travel as raw bytes (FP8 codes as uint8: gloo has no FP8 dtypes). Each gather is waited
for at once, so the result is a complete tensor and `wait_tensor` and `_wrap_tensor_autograd`
return it as it is: a state dict waits for every tensor anyway.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed._functional_collectives  # registers _c10d_functional._wrap_tensor_autograd

from quant_tensors._tensor import QuantizedTensor

implements = QuantizedTensor.implements
functional = torch.ops._c10d_functional
c10d = torch.ops.c10d


def _on_wire(buffer: torch.Tensor) -> torch.Tensor:
    """The buffer as a contiguous tensor of a dtype every backend moves (FP8 codes as uint8)."""
    buffer = buffer.contiguous()
    return buffer.view(torch.uint8) if buffer.element_size() == 1 else buffer


def _all_gather(buffer: torch.Tensor, group_size: int, group_name: Any) -> torch.Tensor:
    """Every rank's `buffer` concatenated along dim 0, in the buffer's dtype (sent as raw bytes)."""
    gathered = functional.all_gather_into_tensor(_on_wire(buffer), group_size, group_name)
    return functional.wait_tensor(gathered).view(buffer.dtype)


def _gathered_buffer(t: QuantizedTensor, name: str, buffer: torch.Tensor, group_size: int, group_name: Any):
    """The whole tensor's buffer `name` from every rank's ([Note: quantized full tensor])."""
    if name.startswith("rowwise_"):
        return _all_gather(buffer, group_size, group_name)  # (world * rows, ...): the rows in rank order
    if name.startswith("columnwise_"):  # x^T: (world * K, M_shard) -> (K, world * M_shard)
        gathered = _all_gather(buffer, group_size, group_name)
        return gathered.reshape(group_size, *buffer.shape).transpose(0, 1).reshape(buffer.shape[0], -1)
    assert buffer.numel() == 1, f"{type(t).__name__}.{name} is neither a usage's buffer nor a per-tensor value"
    values = _all_gather(buffer.reshape(1), group_size, group_name)
    raw = values.view(torch.uint8).reshape(group_size, -1)
    if not bool((raw == raw[0]).all()):
        raise ValueError(
            f"cannot gather {type(t).__name__} shards of shape {tuple(t.shape)} whose per-tensor {name} differs "
            f"between ranks ({values.tolist()}): no single quantized tensor holds them all. Quantize the shards with "
            "the shard group as the quantizer's amax_group (quant_fsdp.fully_shard binds it), or dequantize them first."
        )
    return buffer.clone()


@implements(functional.all_gather_into_tensor.default)
def _all_gather_into_tensor(func, args, kwargs):
    t: QuantizedTensor = args[0]
    group_size, group_name = args[1], args[2]
    if t.dim() == 0:
        raise NotImplementedError(f"all_gather of a 0-d {type(t).__name__}: gather its dequantized value instead")
    buffers = {
        name: None if buffer is None else _gathered_buffer(t, name, buffer, group_size, group_name)
        for name, buffer in t.buffers().items()
    }
    return t._rebuilt(shape=(group_size * t.shape[0], *t.shape[1:]), **buffers)


@implements(functional.wait_tensor.default, functional._wrap_tensor_autograd.default)
def _completed(func, args, kwargs):
    return args[0]._rebuilt()  # gathered synchronously ([Note: quantized full tensor])


@implements(c10d.scatter_.default)
def _scatter(func, args, kwargs):
    """c10d scatter of equal QuantizedTensor chunks (distribute_tensor's Shard path): one scatter per
    buffer into the output's buffers; every rank's output holds the chunks' usages
    ([Note: quantized full tensor])."""
    (output,), inputs, *options = args  # options: process group, root rank, async_op, timeout
    chunks = inputs[0] if inputs else []
    work = None
    for name, buffer in output.buffers().items():
        if buffer is None:
            continue
        if not buffer.is_contiguous():
            raise ValueError(f"scatter into a {type(output).__name__} needs contiguous buffers; {name} is a view")
        pieces = [[_on_wire(getattr(chunk, name)).reshape(-1) for chunk in chunks]] if chunks else []
        if work is not None:
            work.wait()
        _, work = c10d.scatter_.default([_on_wire(buffer).view(-1)], pieces, *options, **kwargs)
    return [output], work
