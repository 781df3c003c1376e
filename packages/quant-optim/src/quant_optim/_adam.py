"""FusedAdam: Adam/AdamW over fp32, bf16 and quantized parameters, plain or FSDP2 DTensors.

[Note: FusedAdam step] For every parameter the step works on local tensors (a DTensor's shard):
1. all gradients are checked for non-finite values first; if any rank finds one, the whole step is
   skipped (parameters, masters, moments and the step count stay as they were);
2. the update runs on the fp32 master (the parameter itself when it is fp32), with the same
   elementwise operations as torch.optim.AdamW's single-tensor path, so fp32 results equal
   torch's bit for bit;
3. low-precision parameters are written back from the master: bf16/fp16 by a cast, quantized
   parameters by requantizing into their buffers (`quantizer.quantize_`; per-tensor formats use
   the shard group's amax through the quantizer's `amax_group`).

Per-tensor formats (per-tensor FP8, NVFP4) take their amax from one all-reduce per step over all
such parameters of a process group (`_write_back`). States of DTensor parameters are DTensors.
This version is the plain-torch path; still to come (issue #7): the C++/Triton fused kernels,
fp8 moments, DCP tests (save, reload, reshard).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

import quant_core
import quant_tensors as qt

_MOMENT_DTYPES = (torch.float32, torch.bfloat16)


class FusedAdam(torch.optim.Optimizer):
    """Adam / AdamW keeping fp32 master weights; see [Note: FusedAdam step] in quant_optim._adam."""

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        adam_w_mode: bool = True,
        master_weights: bool = True,
        master_weight_dtype: torch.dtype = torch.float32,
        exp_avg_dtype: torch.dtype = torch.float32,
        exp_avg_sq_dtype: torch.dtype = torch.float32,
        capturable: bool = False,
    ) -> None:
        if not (isinstance(lr, torch.Tensor) or lr >= 0.0):
            raise ValueError(f"lr must be >= 0, got {lr}")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas must lie in [0, 1), got {betas}")
        if eps < 0.0 or weight_decay < 0.0:
            raise ValueError(f"eps and weight_decay must be >= 0, got {eps} and {weight_decay}")
        if master_weight_dtype != torch.float32:
            raise ValueError(f"master_weight_dtype must be torch.float32, got {master_weight_dtype}")
        for name, dtype in (("exp_avg_dtype", exp_avg_dtype), ("exp_avg_sq_dtype", exp_avg_sq_dtype)):
            if dtype not in _MOMENT_DTYPES:
                raise ValueError(
                    f"{name} must be torch.float32 or torch.bfloat16 (fp8 moments are not built yet), got {dtype}"
                )
        if capturable:
            raise NotImplementedError("capturable=True (CUDA graphs) is not built yet")
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "adam_w_mode": adam_w_mode,
            "master_weights": master_weights,
            "exp_avg_dtype": exp_avg_dtype,
            "exp_avg_sq_dtype": exp_avg_sq_dtype,
        }
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if qt.local_quantized(p) is not None and not group["master_weights"]:
                    raise ValueError("quantized parameters need master_weights=True (an fp32 master to update)")
        self.skipped_steps = 0
        """Steps skipped because some gradient was not finite."""
        self.last_step_skipped = False

    # ---- state -------------------------------------------------------------------------------

    def _state_of(self, p: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        """The parameter's state; for a DTensor parameter every tensor in it is a DTensor like it
        (mesh, placements, shape, stride), so torch.distributed.checkpoint can save and reshard it."""
        state = self.state[p]
        if not state:
            local = qt.local_shard(p)
            master = self._initial_master(p, local) if self._needs_master(local, group) else None
            reference = local if master is None else master
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = qt.shard_like(
                p, torch.zeros(reference.shape, dtype=group["exp_avg_dtype"], device=reference.device)
            )
            state["exp_avg_sq"] = qt.shard_like(
                p, torch.zeros(reference.shape, dtype=group["exp_avg_sq_dtype"], device=reference.device)
            )
            if master is not None:
                state["master"] = qt.shard_like(p, master)
        return state

    @staticmethod
    def _needs_master(local: torch.Tensor, group: dict[str, Any]) -> bool:
        return isinstance(local, qt.QuantizedTensor) or (group["master_weights"] and local.dtype != torch.float32)

    @staticmethod
    def _initial_master(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        if isinstance(local, qt.QuantizedTensor):
            value = qt.high_precision_init_value(p)
            value = local.dequantize(torch.float32) if value is None else qt.local_shard(value)
            return value.detach().to(torch.float32, copy=True)
        return local.detach().to(torch.float32, copy=True)

    # ---- step --------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = [(p, group) for group in self.param_groups for p in group["params"] if p.grad is not None]
        self.last_step_skipped = not self._grads_finite([qt.local_shard(p.grad) for p, _ in work])
        if self.last_step_skipped:
            self.skipped_steps += 1
            return loss
        write_backs = [(p, master) for p, group in work if (master := self._update(p, group)) is not None]
        self._write_back(write_backs)
        return loss

    @staticmethod
    def _write_back(write_backs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Writes low-precision parameters from their masters. Formats with a per-tensor amax get
        theirs from one all-reduce per process group for all parameters (not one per parameter)."""
        per_group: dict[int, list[tuple[qt.QuantizedTensor, torch.Tensor]]] = {}
        for p, master in write_backs:
            local = qt.local_shard(p)
            if isinstance(local, qt.QuantizedTensor) and local.quantizer.per_tensor_amax:
                per_group.setdefault(id(local.quantizer.amax_group), []).append((local, master))
            else:
                local.copy_(master)  # a bf16 cast, or a requantize of a block-scaled format
        for pairs in per_group.values():
            amaxes = torch.stack([quant_core.amax(master) for _, master in pairs])
            group = pairs[0][0].quantizer.amax_group
            if group is not None:
                dist.all_reduce(amaxes, op=dist.ReduceOp.MAX, group=group)
            for (local, master), amax in zip(pairs, amaxes, strict=True):
                local.quantizer.quantize_(master, local, amax=amax)

    @staticmethod
    def _grads_finite(grads: list[torch.Tensor]) -> bool:
        """One check over every local gradient, agreed by all ranks (a non-finite one anywhere skips)."""
        device = grads[0].device if grads else torch.device("cpu")
        bad = torch.zeros((), device=device)
        for g in grads:
            if g.numel():
                bad = torch.maximum(bad, (~torch.isfinite(g)).any().to(bad.dtype))
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        return not bool(bad)

    def _update(self, p: torch.Tensor, group: dict[str, Any]) -> torch.Tensor | None:
        """Steps one parameter's master; returns the master if the parameter needs a write-back."""
        state = self._state_of(p, group)
        local = qt.local_shard(p)
        grad = qt.local_shard(p.grad)
        master = qt.local_shard(state["master"]) if "master" in state else local
        beta1, beta2 = group["betas"]
        lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
        lr = lr.item() if isinstance(lr, torch.Tensor) else lr
        state["step"] += 1
        step = float(state["step"])
        grad = grad.to(torch.float32) if grad.dtype != torch.float32 else grad
        if weight_decay != 0.0:
            if group["adam_w_mode"]:
                master.mul_(1 - lr * weight_decay)
            else:
                grad = grad.add(master, alpha=weight_decay)
        exp_avg, exp_avg_sq = qt.local_shard(state["exp_avg"]), qt.local_shard(state["exp_avg_sq"])
        m = exp_avg if exp_avg.dtype == torch.float32 else exp_avg.float()
        v = exp_avg_sq if exp_avg_sq.dtype == torch.float32 else exp_avg_sq.float()
        m.lerp_(grad, 1 - beta1)
        v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        bias_correction1 = 1 - beta1**step
        bias_correction2_sqrt = (1 - beta2**step) ** 0.5  # as torch writes it (not math.sqrt)
        denom = (v.sqrt() / bias_correction2_sqrt).add_(eps)
        master.addcdiv_(m, denom, value=-(lr / bias_correction1))
        if m is not exp_avg:
            exp_avg.copy_(m)
        if v is not exp_avg_sq:
            exp_avg_sq.copy_(v)
        return None if master is local else master
