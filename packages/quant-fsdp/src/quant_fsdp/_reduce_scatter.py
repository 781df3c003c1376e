"""FSDP2's gradient reduce-scatter in FP8: `QuantizedReduceScatter`, a torch ReduceScatter comm.

[Note: FP8 reduce-scatter] FSDP2 hands its reduce-scatter comm (`FSDPModule.set_custom_reduce_scatter`)
the flat gradient of a parameter group, padded to `world_size` equal chunks along dim 0 (chunk i
is rank i's shard of every parameter), an output of one chunk, the shard group and an op. Each
rank:
1. quantizes its input once into one row of bytes per destination rank, `quant_core.
   quantize_fp8_chunks` ([Note: FP8 chunk rows] in quant_core.blocks._chunks): row j = chunk j,
   zero-padded to a multiple of `block_size`, as FP8 codes in 1 x block_size blocks with one
   power-of-two fp32 scale each (blockwise FP8's numerics), then the scales' bytes;
2. exchanges the rows in one `all_to_all_single`: row i of what it receives is its own chunk as
   rank i quantized it. Nothing is requantized on the way;
3. dequantizes the received rows in fp32, sums them in rank order ((g0 + g1) + g2 ...), divides
   by the world size for AVG, and writes the output in its own dtype, rounded once
   (`quant_core.dequantize_sum_fp8_chunks`).
Ops: FSDP2 passes AVG (fp32/bf16 reduce dtypes), SUM (fp16, or `set_force_sum_reduction_for_comms`;
it divides before and after itself) or PREMUL_SUM (`set_gradient_divide_factor` with a factor
other than the shard group size). PREMUL_SUM carries its factor inside a C++ object, out of reach
here: refused, naming `set_force_sum_reduction_for_comms(True)`, under which FSDP2 applies the
factor around a SUM. `simulate` runs steps 1 to 3 for every rank in one process, through the same
code. Under HSDP the comm gets the shard group: gradients are quantized within it, and FSDP2's
all-reduce across replicas stays in the reduce dtype.

[Note: reduce-scatter state] Two options keep state per rank:
- `stochastic_rounding=True` rounds the codes stochastically ([Note: FP8 stochastic rounding] in
  quant_core.shared._numerics): rank r draws from the counter-RNG stream seed + r * 2^32 + step,
  `step` a 0-d int64 tensor the comm adds one to after each call (on the device: no sync), the
  same on every rank. So ranks and calls draw distinct streams for 2^32 calls; comms with equal
  seeds (separate parameter groups) draw alike: give each its own `seed` to decorrelate them.
- `error_feedback=True` keeps, per rank, the residual of its whole input (fp32, the
  reduce-scatter input's numel: an unsharded gradient of the group): what the codes it sent did
  not carry. The next call adds it to its input before quantizing, so no part of a gradient is
  lost for good, only delayed.
`quant_fsdp.fully_shard(module, reduce_scatter=comm)` binds the comm to the module (`bind`): the
step and the residual become buffers of the module (`fp8_reduce_scatter_step`, replicated, and
`fp8_reduce_scatter_residual`, a DTensor sharded along dim 0 over the module's mesh, every rank's
residual one shard), so the module's state dict, and DCP (get_model_state_dict / dcp.save /
dcp.load / set_model_state_dict) save and restore them: a resumed run continues bit for bit. The
residual's global size is the world size times the rank's padded input, so a checkpoint loads
only at the world size it was saved with (dcp.load refuses another with "Size mismatch ... for
<module>.fp8_reduce_scatter_residual"): a residual holds whole gradients in one world size's
chunk layout and cannot be resharded. To resume at another world size, leave the residual keys
out of the state dict given to dcp.load: the residuals start from zero. A comm installed
without `fully_shard` keeps its step itself (not saved) and refuses error feedback. A comm
with error feedback serves one parameter group: the residual has that group's layout, and a call
with an input of another size is refused (FSDP2 leaves out parameters without a gradient, which
changes the layout: keep every parameter of the group in the backward).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

# torch.distributed.fsdp does not export it (2.11 to 2.13); FSDPModule.set_custom_reduce_scatter takes one.
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
from torch.distributed.tensor import DTensor, Shard

import quant_core
from quant_fsdp._stats import count_reduce_scatter

_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_MAX_BLOCK = 128  # quant-core's chunk blocks divide 128 elements
STEP_BUFFER = "fp8_reduce_scatter_step"
RESIDUAL_BUFFER = "fp8_reduce_scatter_residual"
STATE_BUFFERS = (STEP_BUFFER, RESIDUAL_BUFFER)
_RANK_STREAMS = 1 << 32  # rank r's streams start at seed + r * 2^32 ([Note: reduce-scatter state])


class QuantizedReduceScatter(ReduceScatter):
    """FSDP2's gradient reduce-scatter in FP8 ([Note: FP8 reduce-scatter] in quant_fsdp._reduce_scatter).

    Each rank quantizes its gradient chunks once (E4M3 or E5M2, one power-of-two fp32 scale per
    1 x `block_size` block), exchanges codes and scales in one all-to-all, then dequantizes the
    chunks it owns in fp32, sums them in rank order and applies the op (SUM or AVG). Install it
    with `quant_fsdp.fully_shard(..., reduce_scatter="fp8")` or `module.set_custom_reduce_scatter`.
    The bytes it moves are counted in `quant_fsdp.comm_stats()` under "FP8 reduce-scatter".

    `stochastic_rounding=True` rounds the codes stochastically (on rank r, the k-th
    call draws the counter-RNG stream `seed + r * 2^32 + k`); `error_feedback=True` adds to each rank's input the residual
    its previous call did not send (fp32, one unsharded gradient of the group per rank). Both
    keep state that `quant_fsdp.fully_shard` registers as buffers of the module, saved with its
    state dict ([Note: reduce-scatter state]).
    """

    def __init__(
        self,
        dtype: torch.dtype = torch.float8_e4m3fn,
        *,
        block_size: int = 128,
        stochastic_rounding: bool = False,
        error_feedback: bool = False,
        seed: int = 0,
    ) -> None:
        if dtype not in _FP8_DTYPES:
            raise ValueError(
                f"QuantizedReduceScatter dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}"
            )
        if isinstance(block_size, int) and not isinstance(block_size, bool) and block_size > _MAX_BLOCK:
            raise ValueError(
                f"block_size {block_size} is larger than quant-core's chunk blocks ({_MAX_BLOCK} elements): use a "
                f"block_size of at most {_MAX_BLOCK}"
            )
        if (
            isinstance(block_size, bool)
            or not isinstance(block_size, int)
            or block_size not in quant_core.CHUNK_BLOCK_SIZES
        ):
            raise ValueError(
                f"block_size must be a positive multiple of 16 dividing 128 (16, 32, 64 or 128), got {block_size!r}"
            )
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ValueError(f"seed must be an int (its low 64 bits count), got {seed!r}")
        self.dtype = dtype
        self.block_size = block_size
        self.stochastic_rounding = stochastic_rounding
        self.error_feedback = error_feedback
        self.seed = seed
        self._step: torch.Tensor | None = None  # the stochastic-rounding step of an unbound comm
        self._module: torch.nn.Module | None = None  # the module whose buffers hold the state (`bind`)

    def __repr__(self) -> str:
        options = "".join(f", {name}=True" for name in ("stochastic_rounding", "error_feedback") if getattr(self, name))
        return f"QuantizedReduceScatter({self.dtype}, block_size={self.block_size}{options})"

    def bind(self, module: torch.nn.Module, mesh: DeviceMesh, input_numel: int, device: torch.device) -> None:
        """Registers the comm's state as buffers of `module` ([Note: reduce-scatter state]): the
        stochastic-rounding step, and the residual of each rank's `input_numel` elements (FSDP2's
        reduce-scatter input: the group's gradients, each padded to a multiple of the shard group
        size along dim 0) as a DTensor sharded over `mesh`. `quant_fsdp.fully_shard` calls it."""
        if self._module is not None and self._module is not module:
            raise ValueError(
                f"{self!r} is bound to another module already: its state belongs to one parameter group; give "
                "each fully_shard call its own QuantizedReduceScatter"
            )
        self._module = module
        if self.stochastic_rounding:
            module.register_buffer(STEP_BUFFER, torch.zeros((), dtype=torch.int64, device=device))
        if self.error_feedback:
            local = torch.zeros(input_numel, dtype=torch.float32, device=device)
            global_numel = input_numel * mesh.size()
            residual = DTensor.from_local(
                local, mesh, [Shard(0)] * mesh.ndim, run_check=False, shape=(global_numel,), stride=(1,)
            )
            module.register_buffer(RESIDUAL_BUFFER, residual)

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
        step = self._current_step(input_tensor.device)
        send = self._encode(input_tensor, world_size, dist.get_rank(group), step, self._residual(input_tensor))
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send, group=group)
        count_reduce_scatter(send.numel())
        self._decode_sum(received, chunk, average, output_tensor)
        if step is not None:
            step.add_(1)
        return None

    def simulate(
        self,
        inputs: Sequence[torch.Tensor],
        op: dist.ReduceOp | dist.ReduceOp.RedOpType = dist.ReduceOp.AVG,
        *,
        dtype: torch.dtype | None = None,
        residuals: Sequence[torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        """What the reduce-scatter gives each of `len(inputs)` ranks, computed in one process.

        `inputs[i]` is rank i's flat input (world_size equal chunks); returns rank i's output
        (one chunk, in `dtype`, default the inputs' dtype). Uses the collective's own encode and
        reduce steps, so a rank's output equals the real collective's bit for bit. With
        stochastic rounding it is one call of the collective: every rank draws from the current
        step, which then advances. With error feedback, `residuals[i]` is rank i's residual
        (fp32, its input's numel), read and updated in place as the collective updates its own."""
        world_size = len(inputs)
        if world_size == 0:
            raise ValueError("simulate needs the input of at least one rank")
        average = _is_average(op)
        chunks = {_check_buffers(x, world_size) for x in inputs}
        if len(chunks) != 1 or len({(x.dtype, x.device) for x in inputs}) != 1:
            raise ValueError("every rank's input must have the same numel, dtype and device")
        if self.error_feedback != (residuals is not None):
            raise ValueError(
                "simulate with error_feedback=True takes residuals=[one fp32 tensor per rank, of its input's numel] "
                "(zeros at the start), and without error feedback none"
            )
        if residuals is not None and len(residuals) != world_size:
            raise ValueError(f"residuals must hold one tensor per rank ({world_size}), got {len(residuals)}")
        chunk = chunks.pop()
        step = self._current_step(inputs[0].device)
        sends = [
            self._encode(x, world_size, rank, step, None if residuals is None else residuals[rank])
            for rank, x in enumerate(inputs)
        ]
        outputs = []
        for rank in range(world_size):
            received = torch.stack([send[rank] for send in sends])  # what all_to_all_single delivers
            out = torch.empty(chunk, dtype=dtype or inputs[0].dtype, device=inputs[0].device)
            self._decode_sum(received, chunk, average, out)
            outputs.append(out)
        if step is not None:
            step.add_(1)
        return outputs

    def _current_step(self, device: torch.device) -> torch.Tensor | None:
        """The stochastic-rounding step (None without stochastic rounding): the module's buffer
        when bound, else the comm's own."""
        if not self.stochastic_rounding:
            return None
        if self._module is not None:
            return self._module.get_buffer(STEP_BUFFER)
        if self._step is None or self._step.device != device:
            self._step = torch.zeros((), dtype=torch.int64, device=device)
        return self._step

    def _residual(self, input_tensor: torch.Tensor) -> torch.Tensor | None:
        """This rank's residual (None without error feedback): the local shard of the module's buffer."""
        if not self.error_feedback:
            return None
        if self._module is None:
            raise ValueError(
                "QuantizedReduceScatter(error_feedback=True) keeps each rank's residual as a buffer of the module it "
                "reduces for, saved with its state dict: install it with quant_fsdp.fully_shard(module, "
                "reduce_scatter=QuantizedReduceScatter(error_feedback=True)), not set_custom_reduce_scatter"
            )
        residual = self._module.get_buffer(RESIDUAL_BUFFER)
        local = residual.to_local() if isinstance(residual, DTensor) else residual
        if local.numel() != input_tensor.numel():
            raise ValueError(
                f"this rank's error-feedback residual holds {local.numel()} elements, but the reduce-scatter input has "
                f"{input_tensor.numel()}: a comm with error feedback serves one parameter group, and every parameter "
                "of the group must have a gradient in each backward (FSDP2 leaves out those without one)"
            )
        return local

    def _encode(
        self,
        x: torch.Tensor,
        world_size: int,
        rank: int,
        step: torch.Tensor | None,
        residual: torch.Tensor | None,
    ) -> torch.Tensor:
        """(world_size, row bytes): row j = chunk j's codes, then its fp32 scales ([Note: FP8 chunk rows])."""
        return quant_core.quantize_fp8_chunks(
            x,
            world_size,
            self.block_size,
            self.dtype,
            stochastic_rounding=self.stochastic_rounding,
            seed=self.seed + rank * _RANK_STREAMS,
            counter=step,
            residual=residual,
        )

    def _decode_sum(self, received: torch.Tensor, chunk: int, average: bool, out: torch.Tensor) -> None:
        """out = the sum over ranks, in rank order, of the fp32 values in `received` (divided by
        the world size for AVG), in out's dtype."""
        quant_core.dequantize_sum_fp8_chunks(
            received, chunk, self.block_size, self.dtype, average=average, out=out.view(-1)
        )


def install(module: FSDPModule, comm: QuantizedReduceScatter) -> None:
    """Makes `comm` the gradient reduce-scatter of `module`, which torch's or quant_fsdp's
    fully_shard has sharded, and binds a comm that keeps state to it (`bind`). The residual's size
    comes from FSDP2's record of the parameters it manages: the reduce-scatter input holds each
    trained parameter's shard, padded along dim 0, once per rank of the shard group."""
    module.set_custom_reduce_scatter(comm)
    if not (comm.stochastic_rounding or comm.error_feedback):
        return
    group = module._get_fsdp_state()._fsdp_param_group  # torch 2.11 to 2.13
    if group is None:  # no parameters of its own: FSDP2 never calls its reduce-scatter
        return
    trained = [p for p in group.fsdp_params if p.sharded_param.requires_grad]
    shard_size = sum(p.padded_sharded_param_size.numel() for p in trained)
    device = group.fsdp_params[0].sharded_param.device
    # The state goes into the module a wrapper wraps (activation checkpointing's CheckpointWrapper,
    # torch.compile's OptimizedModule): DCP's state-dict names skip the wrappers, so a buffer of
    # the wrapper itself would not load back.
    while isinstance(
        inner := getattr(module, "_checkpoint_wrapped_module", getattr(module, "_orig_mod", None)), torch.nn.Module
    ):
        module = inner
    comm.bind(module, group.mesh_info.mesh, shard_size * group.mesh_info.shard_mesh_size, device)


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
