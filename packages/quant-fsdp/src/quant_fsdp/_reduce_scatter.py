"""FSDP2's gradient reduce-scatter in FP8: `QuantizedReduceScatter`, a torch ReduceScatter comm.

[Note: FP8 reduce-scatter] FSDP2 hands its reduce-scatter comm (`FSDPModule.set_custom_reduce_scatter`)
the flat gradient of a parameter group, padded to `world_size` equal chunks along dim 0 (chunk i
is rank i's shard of every parameter), an output of one chunk, the shard group and an op. Each
rank:
1. quantizes its input once: each chunk, zero-padded to a multiple of `block_size`, in 1 x
   block_size blocks with one power-of-two fp32 scale each (quant-core's blockwise FP8 quantizer,
   1 x 128 blocks: a row of `block_size` <= 128 elements is one block);
2. packs, per destination rank j, chunk j's codes then its scales into one row of bytes, and
   exchanges the rows in one `all_to_all_single`: row i of what it receives is its own chunk as
   rank i quantized it. Nothing is requantized on the way;
3. dequantizes the received rows in fp32, sums them in rank order ((g0 + g1) + g2 ...), divides
   by the world size for AVG, and writes the output in its own dtype.
Ops: FSDP2 passes AVG (fp32/bf16 reduce dtypes), SUM (fp16, or `set_force_sum_reduction_for_comms`;
it divides before and after itself) or PREMUL_SUM (`set_gradient_divide_factor` with a factor
other than the shard group size). PREMUL_SUM carries its factor inside a C++ object, out of reach
here: refused, naming `set_force_sum_reduction_for_comms(True)`, under which FSDP2 applies the
factor around a SUM. `simulate` runs steps 1 to 3 for every rank in one process, through the same
code. Under HSDP the comm gets the shard group: gradients are quantized within it, and FSDP2's
all-reduce across replicas stays in the reduce dtype.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

# torch.distributed.fsdp does not export it (2.11 to 2.13); FSDPModule.set_custom_reduce_scatter takes one.
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

import quant_core
from quant_fsdp._stats import count_reduce_scatter

_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_KERNEL_BLOCK = (1, 128)  # quant-core's blockwise FP8 blocks; a row of block_size elements is one block
_SCALE_BYTES = 4  # fp32


class QuantizedReduceScatter(ReduceScatter):
    """FSDP2's gradient reduce-scatter in FP8 ([Note: FP8 reduce-scatter] in quant_fsdp._reduce_scatter).

    Each rank quantizes its gradient chunks once (E4M3 or E5M2, one power-of-two fp32 scale per
    1 x `block_size` block), exchanges codes and scales in one all-to-all, then dequantizes the
    chunks it owns in fp32, sums them in rank order and applies the op (SUM or AVG). Install it
    with `quant_fsdp.fully_shard(..., reduce_scatter="fp8")` or `module.set_custom_reduce_scatter`.
    The bytes it moves are counted in `quant_fsdp.comm_stats()` under "FP8 reduce-scatter".
    """

    def __init__(
        self,
        dtype: torch.dtype = torch.float8_e4m3fn,
        *,
        block_size: int = 128,
        stochastic_rounding: bool = False,
        error_feedback: bool = False,
    ) -> None:
        if dtype not in _FP8_DTYPES:
            raise ValueError(
                f"QuantizedReduceScatter dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}"
            )
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0 or block_size % 16:
            raise ValueError(f"block_size must be a positive multiple of 16 (e.g. 128), got {block_size!r}")
        if block_size > _KERNEL_BLOCK[1]:
            raise ValueError(
                f"block_size {block_size} is larger than quant-core's blockwise FP8 blocks ({_KERNEL_BLOCK[1]} "
                f"elements): use a block_size of at most {_KERNEL_BLOCK[1]}"
            )
        if stochastic_rounding or error_feedback:
            unbuilt = [
                name
                for name, on in (("stochastic_rounding", stochastic_rounding), ("error_feedback", error_feedback))
                if on
            ]
            raise NotImplementedError(
                f"QuantizedReduceScatter({', '.join(f'{name}=True' for name in unbuilt)}): not built yet; "
                "the FP8 reduce-scatter rounds to nearest without error feedback (leave them False)"
            )
        self.dtype = dtype
        self.block_size = block_size
        self.stochastic_rounding = stochastic_rounding
        self.error_feedback = error_feedback

    def __repr__(self) -> str:
        return f"QuantizedReduceScatter({self.dtype}, block_size={self.block_size})"

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """FSDP2's reduce-scatter input and output buffers: plain tensors in its reduce dtype."""
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp | dist.ReduceOp.RedOpType,
        async_op: bool = False,
    ) -> None:
        if async_op:
            raise ValueError(
                "QuantizedReduceScatter runs synchronously (it sums after its all-to-all): call it with async_op=False"
            )
        average = _is_average(op)
        world_size = dist.get_world_size(group)
        chunk = _check_buffers(input_tensor, world_size)
        if output_tensor.numel() != chunk or output_tensor.device != input_tensor.device:
            raise ValueError(
                f"the reduce-scatter output must hold one chunk ({chunk} elements on {input_tensor.device}), "
                f"got {output_tensor.numel()} on {output_tensor.device}"
            )
        send = self._encode(input_tensor, world_size)
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send, group=group)
        count_reduce_scatter(send.numel())
        self._decode_sum(received, chunk, average, output_tensor)
        return None

    def simulate(
        self,
        inputs: Sequence[torch.Tensor],
        op: dist.ReduceOp | dist.ReduceOp.RedOpType = dist.ReduceOp.AVG,
        *,
        dtype: torch.dtype | None = None,
    ) -> list[torch.Tensor]:
        """What the reduce-scatter gives each of `len(inputs)` ranks, computed in one process.

        `inputs[i]` is rank i's flat input (world_size equal chunks); returns rank i's output
        (one chunk, in `dtype`, default the inputs' dtype). Uses the collective's own encode and
        reduce steps, so a rank's output equals the real collective's bit for bit."""
        world_size = len(inputs)
        if world_size == 0:
            raise ValueError("simulate needs the input of at least one rank")
        average = _is_average(op)
        chunks = {_check_buffers(x, world_size) for x in inputs}
        if len(chunks) != 1 or len({(x.dtype, x.device) for x in inputs}) != 1:
            raise ValueError("every rank's input must have the same numel, dtype and device")
        chunk = chunks.pop()
        sends = [self._encode(x, world_size) for x in inputs]
        outputs = []
        for rank in range(world_size):
            received = torch.stack([send[rank] for send in sends])  # what all_to_all_single delivers
            out = torch.empty(chunk, dtype=dtype or inputs[0].dtype, device=inputs[0].device)
            self._decode_sum(received, chunk, average, out)
            outputs.append(out)
        return outputs

    def _layout(self, chunk: int) -> tuple[int, int]:
        """(padded chunk, blocks per chunk)."""
        padded = math.ceil(chunk / self.block_size) * self.block_size
        return padded, padded // self.block_size

    def _encode(self, x: torch.Tensor, world_size: int) -> torch.Tensor:
        """(world_size, padded + 4 * blocks) bytes: row j = chunk j's codes, then its fp32 scales."""
        chunk = x.numel() // world_size
        padded, blocks = self._layout(chunk)
        rows = F.pad(x.reshape(world_size, chunk), (0, padded - chunk))
        quantized = quant_core.quantize_fp8_blockwise(rows.reshape(-1, self.block_size), _KERNEL_BLOCK, self.dtype)
        send = torch.empty(world_size, padded + _SCALE_BYTES * blocks, dtype=torch.uint8, device=x.device)
        send[:, :padded] = quantized.rowwise_data.view(torch.uint8).reshape(world_size, padded)
        send[:, padded:] = quantized.rowwise_scale_inv.reshape(world_size, blocks).view(torch.uint8)
        return send

    def _decode_sum(self, received: torch.Tensor, chunk: int, average: bool, out: torch.Tensor) -> None:
        """out = the sum over ranks, in rank order, of the fp32 values in `received` (divided by
        the world size for AVG), in out's dtype."""
        world_size = received.shape[0]
        if not chunk:
            return
        padded, _ = self._layout(chunk)
        codes = received[:, :padded].reshape(-1, self.block_size).view(self.dtype)
        scale_inv = received[:, padded:].contiguous().view(torch.float32).reshape(-1, 1)
        values = quant_core.dequantize_fp8_blockwise(codes, scale_inv, _KERNEL_BLOCK, torch.float32)
        values = values.reshape(world_size, padded)[:, :chunk]
        total = values[0].clone()
        for rank in range(1, world_size):
            total += values[rank]
        if average:
            total /= world_size
        out.view(-1).copy_(total)


def _is_average(op: dist.ReduceOp | dist.ReduceOp.RedOpType) -> bool:
    if op == dist.ReduceOp.AVG:
        return True
    if op == dist.ReduceOp.SUM:
        return False
    raise ValueError(
        f"QuantizedReduceScatter reduces with SUM or AVG, got {op}. FSDP2 passes PREMUL_SUM when a gradient "
        "divide factor other than the shard group size is set (set_gradient_divide_factor): call "
        "module.set_force_sum_reduction_for_comms(True) as well, and FSDP2 applies the factor around a SUM."
    )


def _check_buffers(x: torch.Tensor, world_size: int) -> int:
    """The chunk size of a reduce-scatter input of `world_size` chunks."""
    if x.dtype not in _INPUT_DTYPES:
        raise ValueError(f"the FP8 reduce-scatter quantizes fp32, bf16 or fp16 gradients, got {x.dtype}")
    if x.numel() % world_size:
        raise ValueError(
            f"a reduce-scatter input holds world_size ({world_size}) equal chunks, got {x.numel()} elements"
        )
    return x.numel() // world_size
