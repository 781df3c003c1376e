"""FusedAdam's step on CUDA (and with capturable=True): every decision in tensors, no host sync.

[Note: FusedAdam tensor-driven step] The step of [Note: FusedAdam step] without reading the device
from the host, so a training loop never waits for the optimizer and a CUDA graph can capture it:
- the verdict (quant_core.has_non_finite of the gradients, or the caller's `found_inf`, after the
  one all-reduce) stays a device tensor; quant_core.adam_step_capturable_ reads it and writes
  nothing when it is set, step counts included (they are device tensors, incremented by the
  kernel), and computes the bias corrections from them and lr (a tensor lr is read by the kernel).
  `last_step_skipped` and `skipped_steps` read the verdict when asked (a host sync then, not in
  the step);
- bf16/fp16 parameters are written from their fp32 master in the same pass (the kernel's `outs`);
  without a master the kernel updates them itself (in fp32, stored rounded);
- a quantized parameter is requantized from its master every step, skipped or not (block formats
  with one `quantize_many_` per quantizer configuration and device: one launch for all those
  weights rather than ~90 us of host time per weight on an H100 VM). When the step was skipped,
  the master is unchanged and the kernel still returns its amax, so the requantize writes the
  bytes it wrote last time: a stateless quantizer's bytes are a function of the master
  and the agreed amax. That holds only where the bytes are the master's quantization already:
  after this optimizer wrote them (their buffers' version counters as it left them). Where it
  does not hold (the first step, bytes written by a load or by hand), and for what would change
  on a skipped step however it is computed (delayed scaling's amax history, NVFP4's stochastic
  rounding counter, fp8 moments, whose stored codes are not a function of their values), the
  step reads the verdict on the host (one sync) and writes those only when it was not set;
- the plan (buckets by kind, the tensors of each, which write-backs need the verdict) is built
  once per list of parameters with gradients and kept until `add_param_group` or
  `load_state_dict`; the kernels' pointer tables are cached by content in quant_core ([Note:
  pointer tables]), so gradients kept in the same memory cost no host-to-device copy and fresh
  ones (FSDP2) one non-blocking copy per step.

capturable=True (CUDA graphs) takes this step and refuses, when the optimizer is built, what needs
the verdict on the host every step: fp8 moments and stateful weight quantizers. A captured step
must follow at least one eager step with the same parameters and gradient storages (the warm-up
that torch.cuda.graphs needs anyway: it compiles the kernels, moves step counts to the device,
builds the pointer tables and writes the quantized bytes from the masters once); capturing
otherwise raises, naming that fix. A Python float lr is captured as a constant: pass lr as a CUDA
tensor to change it between replays. Collectives (the verdict's all-reduce, the per-tensor amax
all-reduce of quantized weights) are captured as NCCL allows; per-tensor quantize kernels run as
they would eagerly.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.utils.weak import WeakIdKeyDictionary

import quant_core
import quant_tensors as qt
from quant_optim._write_back import PendingAmax, agree_amaxes_and_apply, requantize_into, shard_groups

if TYPE_CHECKING:
    from quant_optim._adam import FusedAdam

_FP8_MOMENT_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass(eq=False)
class _Bucket:
    """Parameters stepped by one kernel call: one group, one dtype per list."""

    group: dict[str, Any]
    indices: list[int] = field(default_factory=list)
    """Positions of its parameters in the step's list of parameters with gradients."""
    params: list[torch.Tensor] = field(default_factory=list)
    """fp32 masters, or the parameters themselves (fp32, or bf16/fp16 without a master)."""
    exp_avgs: list[torch.Tensor] = field(default_factory=list)
    exp_avg_sqs: list[torch.Tensor] = field(default_factory=list)
    steps: list[torch.Tensor] = field(default_factory=list)
    outs: list[torch.Tensor] = field(default_factory=list)
    """Low-precision parameters written from their masters in the kernel's pass."""
    compute_amax: bool = False
    """Whether a parameter of it is requantized with a per-tensor amax (which the kernel returns)."""
    plain: bool = True
    """Whether every tensor owns its memory (else the reference runs: quant_core.adam._adam's _is_plain)."""


@dataclass(eq=False)
class _Requantize:
    local: qt.QuantizedTensor
    master: torch.Tensor
    bucket: int
    """Its bucket's index in the plan."""
    position: int
    groups: tuple[dist.ProcessGroup, ...]
    """The process groups its per-tensor amax is agreed over (none for block formats)."""
    written: list[tuple[int | None, ...] | None]
    """[its buffers' versions when this optimizer last wrote them from the master, or None]: the
    optimizer's record for this weight (`written_record`), shared with every plan that holds it."""
    like: int | None = None
    """Block formats: the number of its (quantizer configuration, device) among the plan's; the
    weights of one number are requantized by one `quantize_many_` call (`number_block_weights`)."""


@dataclass(eq=False)
class _Fp8Slot:
    """A moment kept in fp8: dequantized into the bucket's list before the kernel, stored after."""

    bucket: _Bucket
    position: int
    key: str
    codes: torch.Tensor
    scale_inv: torch.Tensor
    groups: tuple[dist.ProcessGroup, ...]


@dataclass(eq=False)
class _Plan:
    buckets: list[_Bucket]
    requantize: list[_Requantize]
    fp8_slots: list[_Fp8Slot]
    device: torch.device
    """The device of the verdict (the first bucket's)."""
    one_device: bool
    """Whether every parameter (so every gradient) is on `device`: the non-finite check then calls
    quant-core's operator without the public function's per-tensor checks."""


def build_plan(
    optimizer: FusedAdam, work: list[tuple[torch.Tensor, dict[str, Any]]], grads: list[torch.Tensor]
) -> _Plan:
    """Buckets the parameters with gradients by kind and names every tensor each kernel reads."""
    buckets: dict[tuple[Any, ...], _Bucket] = {}
    requantize, fp8_slots = [], []
    for index, ((p, group), grad) in enumerate(zip(work, grads, strict=True)):
        state = optimizer._state_of(p, group)
        local = qt.local_shard(p)
        if state["step"].device != local.device:  # the kernel counts on the device
            state["step"] = state["step"].to(local.device)
        master = qt.local_shard(state["master"]) if "master" in state else local
        moments = [qt.local_shard(state[key]) for key in ("exp_avg", "exp_avg_sq")]
        out = local if master is not local and not isinstance(local, qt.QuantizedTensor) else None
        key = (
            id(group),
            grad.dtype,
            master.dtype,
            *(torch.float32 if m.dtype in _FP8_MOMENT_DTYPES else m.dtype for m in moments),
            None if out is None else out.dtype,
            local.device,
        )
        bucket = buckets.setdefault(key, _Bucket(group))
        bucket_index = list(buckets).index(key)
        position = len(bucket.params)
        bucket.indices.append(index)
        bucket.params.append(master)
        bucket.steps.append(state["step"])
        if out is not None:
            bucket.outs.append(out)
        for name, moment, values in zip(
            ("exp_avg", "exp_avg_sq"), moments, (bucket.exp_avgs, bucket.exp_avg_sqs), strict=True
        ):
            values.append(moment)
            if moment.dtype in _FP8_MOMENT_DTYPES:
                fp8_slots.append(_Fp8Slot(bucket, position, name, moment, state[f"{name}_scale_inv"], shard_groups(p)))
        bucket.plain = bucket.plain and all(_is_plain(t) for t in (master, *moments, *(() if out is None else (out,))))
        if isinstance(local, qt.QuantizedTensor):
            quantizer = local.quantizer
            groups = () if quantizer.amax_group is None else (quantizer.amax_group,)
            bucket.compute_amax = bucket.compute_amax or quantizer.per_tensor_amax
            requantize.append(
                _Requantize(
                    local,
                    master,
                    bucket_index,
                    position,
                    groups if quantizer.per_tensor_amax else (),
                    written_record(optimizer._requantized_bytes, local),
                )
            )
    number_block_weights(requantize)
    devices = {key[-1] for key in buckets}
    first = next(iter(buckets))[-1] if buckets else torch.device("cpu")
    return _Plan(list(buckets.values()), requantize, fp8_slots, first, len(devices) == 1)


def number_block_weights(requantize: list[_Requantize]) -> None:
    """Sets `like` of every block-format weight: equal for weights on one device whose quantizers
    quantize alike (`Quantizer.quantizes_like`: the same configuration, stateless), so that one
    `quantize_many_` call requantizes them all (on CUDA one Triton launch, not one per weight)."""
    firsts: list[_Requantize] = []  # the first weight of each number
    for r in requantize:
        if r.local.quantizer.per_tensor_amax:
            continue
        r.like = next(
            (
                number
                for number, first in enumerate(firsts)
                if first.local.device == r.local.device and first.local.quantizer.quantizes_like(r.local.quantizer)
            ),
            len(firsts),
        )
        if r.like == len(firsts):
            firsts.append(r)


def written_record(records: WeakIdKeyDictionary, local: qt.QuantizedTensor) -> list[tuple[int | None, ...] | None]:
    """The optimizer's record of the buffer versions it left in `local` (made empty: [None]); plans
    keep it, so a step updates it without a weak-dictionary lookup per weight."""
    record = records.get(local)
    if record is None:
        record = records[local] = [None]
    return record


def step(optimizer: FusedAdam, plan: _Plan, grads: list[torch.Tensor], found_inf: torch.Tensor | None) -> torch.Tensor:
    """One step of [Note: FusedAdam tensor-driven step]; returns the verdict (fp32 0-d, 1.0: skipped)."""
    found = _verdict(grads, found_inf, plan)
    for slot in plan.fp8_slots:  # the kernel updates fp32 values
        values = quant_core.dequantize_fp8(slot.codes, slot.scale_inv, torch.float32)
        getattr(slot.bucket, f"{slot.key}s")[slot.position] = values
    amaxes = [_step_bucket(bucket, grads, found) for bucket in plan.buckets]
    versions = [buffer_versions(r.local) for r in plan.requantize]
    unsure = [
        not r.local.quantizer.stateless or r.written[0] != v for r, v in zip(plan.requantize, versions, strict=True)
    ]
    proceed = True
    if any(unsure) or plan.fp8_slots:  # writes a skipped step must not make: the verdict on the host
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "FusedAdam(capturable=True) cannot capture this step: quantized weights whose bytes this optimizer has "
                "not written yet (or that were written since, e.g. by a load) need the skip verdict on the host. Run "
                "one eager step before capturing, and load checkpoints outside the captured region"
            )
        proceed = not bool(found)
    written = [r for r, u in zip(plan.requantize, unsure, strict=True) if proceed or not u]
    # One view op per bucket that returned amaxes, not one per weight.
    rows = [a.unbind() if b.compute_amax else None for a, b in zip(amaxes, plan.buckets, strict=True)]
    pending = []
    alike: dict[int, list[_Requantize]] = {}
    for r in written:
        quantizer = r.local.quantizer
        if not quantizer.per_tensor_amax:  # a block-scaled format: its own scales, alike ones in one call below
            alike.setdefault(r.like, []).append(r)
        elif r.groups:  # agreed over the shard group first, in one all-reduce for all of them
            apply = functools.partial(requantize_into, quantizer, r.master, r.local)
            pending.append(PendingAmax(r.groups, rows[r.bucket][r.position], apply))
        else:
            quantizer.quantize_(r.master, r.local, amax=rows[r.bucket][r.position])
    for same in alike.values():
        same[0].local.quantizer.quantize_many_([r.master for r in same], [r.local for r in same])
    if proceed and plan.fp8_slots:
        values = [getattr(s.bucket, f"{s.key}s")[s.position] for s in plan.fp8_slots]
        for slot, value, amax in zip(plan.fp8_slots, values, quant_core.amax_many(values), strict=True):
            pending.append(PendingAmax(slot.groups, amax, functools.partial(_store_fp8, slot, value)))
    if pending:
        agree_amaxes_and_apply(pending)
    for r in written:
        r.written[0] = buffer_versions(r.local)
    return found


def _step_bucket(bucket: _Bucket, grads: list[torch.Tensor], found: torch.Tensor) -> torch.Tensor:
    group = bucket.group
    lr = group["lr"]
    if isinstance(lr, torch.Tensor) and lr.device != bucket.params[0].device:
        lr = lr.item()  # a CPU tensor: no device sync
    lr_tensor = lr if isinstance(lr, torch.Tensor) else None
    beta1, beta2 = group["betas"]
    hyperparameters = [0.0 if lr_tensor is not None else float(lr), beta1, beta2, group["eps"], group["weight_decay"]]
    args = (
        bucket.params,
        [grads[i] for i in bucket.indices],
        bucket.exp_avgs,
        bucket.exp_avg_sqs,
        bucket.steps,
        bucket.outs,
        found,
        lr_tensor,
        hyperparameters,
        group["adam_w_mode"],
    )
    if not bucket.plain:  # wrapper subclasses: torch ops reach their __torch_dispatch__
        return quant_core.adam_step_capturable_reference(*args, bucket.compute_amax)
    # The operator without the public function's checks: FusedAdam made these states itself.
    return torch.ops.quant_core.adam_step_capturable(*args, bucket.compute_amax)


def _verdict(grads: list[torch.Tensor], found_inf: torch.Tensor | None, plan: _Plan) -> torch.Tensor:
    """fp32 0-d on the plan's device: 1.0 when some rank found a non-finite gradient (one all-reduce)."""
    if found_inf is not None:
        # any() of a float tensor is (found_inf != 0).any(): NaN counts as nonzero, -0.0 as zero.
        bad = found_inf.any().to(device=plan.device, dtype=torch.float32)
    elif plan.one_device and all(map(_is_plain, grads)):
        # The operator without the public function's checks: FusedAdam checked the gradients' dtypes
        # and shapes, and a gradient lives on its parameter's device.
        bad = torch.ops.quant_core.has_non_finite(grads)
    else:
        bad = quant_core.has_non_finite(grads)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return bad


def buffer_versions(local: qt.QuantizedTensor) -> tuple[int | None, ...]:
    return tuple(None if b is None else b._version for b in local.buffers().values())


def _is_plain(t: torch.Tensor) -> bool:
    return type(t) in (torch.Tensor, torch.nn.Parameter)


def _store_fp8(slot: _Fp8Slot, values: torch.Tensor, amax: torch.Tensor) -> None:
    scale, scale_inv = quant_core.fp8_scale(amax, slot.codes.dtype)
    quant_core.cast_to_fp8(values, scale, slot.codes.dtype, rowwise_out=slot.codes)
    slot.scale_inv.copy_(scale_inv)
