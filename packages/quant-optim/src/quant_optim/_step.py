"""FusedAdam's step: one executor of the plan (quant_optim._plan), reading the skip verdict on the
host or leaving it on the device.

[Note: FusedAdam step] For every parameter with a gradient the step works on local tensors (a
DTensor's shard), through the plan built from the parameters, their states and their gradients'
dtypes (buckets by kind, the tensors of each, which write-backs need the verdict; kept until
`add_param_group` or `load_state_dict`):
1. the verdict: quant_core.has_non_finite of every gradient (one pass), or the caller's
   `found_inf` instead; one all-reduce (MAX) makes it every rank's. A skipped step leaves
   parameters, masters, moments, step counts and quantized bytes as they were;
2. where buckets hold fp8 moments: one `adam_moment_amaxes` call per such bucket, then one
   agreement of all their amaxes (an all-reduce, MAX, per set of process groups): [Note: FusedAdam
   fp8 moments];
3. per bucket (group, dtypes, device): one Adam kernel call updates the masters (fp32, or bf16
   rounded stochastically with their counters: [Note: FusedAdam bf16 masters] in
   quant_optim._plan; the parameter itself when it is fp32 or its own bf16 master, or a bf16/fp16
   parameter without a master, updated in fp32 and stored rounded to nearest), their moments (fp8
   ones encoded with the scales of the agreed amaxes) and step counts, writes bf16/fp16
   parameters from their masters, and returns max |master| where a per-tensor format
   requantizes from it ([Note: Adam numerics] in quant_core.adam._adam: fp32 results are within a
   few ulp of torch.optim.AdamW, not bitwise: torch's rounding differs between its own kernels);
4. the write-back (quant_optim._write_back): quantized weights are requantized from their
   masters (alike ones with one `quantize_many_` per quantizer configuration and device); those
   scaled by a per-tensor amax take it from one all-reduce (MAX) per process group per step, not
   one per parameter.

[Note: FusedAdam fp8 moments] An fp8 moment (codes plus one 0-d scale_inv, equal on every
shard) is stored with the scale of the amax of its updated values over the whole moment, so the
step reads the moments twice ([Note: fp8 moments in the Adam pass] in quant-core): a pre-pass
(`adam_moment_amaxes`, one call per bucket holding fp8 moments) computes the amaxes of the
updated moments and writes nothing; the amaxes of every bucket are agreed over each parameter's
shard groups in one all-reduce per set of groups (`agree_moment_amaxes`); then each bucket's one
Adam call decodes the moments, updates them with the master and encodes them with the scales of
the agreed amaxes, setting the scale_invs. No fp32 copy of a moment exists (1 byte per element
read twice, written once), and the step makes one small all-reduce for all fp8 moments together.
The pre-pass reads the gradients (and, for Adam's L2 weight decay, the masters) once more.

The verdict is read in one of two places, and that is the only difference between CPU and CUDA
steps; every bucket steps through one operator, `torch.ops.quant_core.adam_step` (the C++ kernel
on CPU, Triton on CUDA), which computes the bias corrections from the step counts (tensors it
increments) and lr, and writes bf16/fp16 parameters and outs in its pass:
- on the host (CPU tensors, `capturable=False`: reading a CPU tensor costs no sync): a skipped
  step returns after step 1; otherwise the operator runs without a verdict to read;
- on the device (CUDA tensors, or `capturable=True` on any device): [Note: FusedAdam
  tensor-driven step].
Both give the same bits (tests/test_step.py runs both on the CPU; test_fused_adam_cuda.py
compares CUDA with the CPU). Parameters that are tensor subclasses wrapping a plain tensor
(quant_fsdp's QuantizeOnGatherTensor) step through the same operators: the dispatcher hands them
to the subclass's `__torch_dispatch__`, which runs the kernels on the wrapped tensors and records
the write in the subclass's version counters.

[Note: FusedAdam tensor-driven step] The step without reading the device from the host, so a
training loop never waits for the optimizer and a CUDA graph can capture it:
- the verdict stays a device tensor; `torch.ops.quant_core.adam_step` reads it and writes
  nothing when it is set, step counts included ([Note: Adam step in tensors] in quant-core; a
  tensor lr is read by the kernel too). `last_step_skipped` and `skipped_steps` read the verdict
  when asked (a host sync then, not in the step);
- a quantized weight is requantized from its master every step, skipped or not. When the step was
  skipped, the master is unchanged and the kernel still returns its amax, so the requantize writes
  the bytes it wrote last time: a stateless quantizer's bytes are a function of the master and
  the agreed amax. That holds only where the bytes are the master's quantization already: after
  this optimizer wrote them (their buffers' version counters as it left them). Where it does not
  hold (the first step, bytes written by a load or by hand), and for what would change on a
  skipped step however it is computed (delayed scaling's amax history, NVFP4's stochastic
  rounding counter), the step reads the verdict on the host after the Adam pass (one sync) and
  writes back only when it was not set;
- fp8 moments: the pre-pass and the agreement run whatever the verdict, and the Adam kernel
  writes neither codes nor scale_invs when the step is skipped ([Note: fp8 moments on a skipped
  step]);
- the kernels' pointer tables are cached by content in quant_core ([Note: pointer tables]), so
  gradients kept in the same memory cost no host-to-device copy and fresh ones (FSDP2) one
  non-blocking copy per step.

capturable=True (CUDA graphs) takes this route and refuses, when the optimizer is built, what needs
the verdict on the host every step (stateful weight quantizers); fp8 moments need none (their
pre-pass, agreement and encoding run on the device whatever the verdict). A captured step must
follow at least one eager step with the same parameters (the warm-up that torch.cuda.graphs needs
anyway: it compiles the kernels, moves step counts to the device, builds the plan and the pointer
tables and writes the quantized bytes from the masters once);
capturing otherwise raises, naming that fix. A Python float lr is captured as a constant: pass lr
as a CUDA tensor to change it between replays. Collectives (the verdict's all-reduce, the
per-tensor amax all-reduce of quantized weights) are captured as NCCL allows; per-tensor quantize
kernels run as they would eagerly.

[Note: fp8 moments on a skipped step] A skipped step leaves an fp8 moment's codes and scale_inv
as they were. On the host route the step returns before the pre-pass. On the device route the
pre-pass and the agreement run on the skipped step's gradients (an amax ignores non-finite
values; these amaxes are not used) and the Adam kernel, reading the verdict, writes nothing.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

import quant_core
from quant_optim._plan import MASTER_ROUNDING_SEED, Bucket, Plan, buffer_versions
from quant_optim._write_back import agree_moment_amaxes, write_back


def run(
    plan: Plan, grads: list[torch.Tensor], found_inf: torch.Tensor | None, *, verdict_on_host: bool
) -> torch.Tensor:
    """One step of the plan ([Note: FusedAdam step]); returns the verdict (fp32 0-d on the plan's
    device, 1.0: skipped).

    Args:
        plan: built for these gradients' parameters and dtypes.
        grads: the local gradients, in the plan's order.
        found_inf: the caller's verdict (nonzero: skip), or None to check the gradients.
        verdict_on_host: read the verdict before updating (CPU tensors), or leave it on the
            device ([Note: FusedAdam tensor-driven step]).
    """
    found = _verdict(plan, grads, found_inf)
    skipped = bool(found) if verdict_on_host else None  # None: known on the device only
    if skipped:
        return found
    bucket_grads = [[grads[i] for i in bucket.indices] for bucket in plan.buckets]
    moment_amaxes = _moment_amaxes(plan, bucket_grads)  # [Note: FusedAdam fp8 moments]
    verdict = None if verdict_on_host else found  # known not skipped: nothing for the kernel to read
    amaxes = [
        _adam_step(bucket, g, verdict, a)
        for bucket, g, a in zip(plan.buckets, bucket_grads, moment_amaxes, strict=True)
    ]
    if skipped is None and not _bytes_are_the_masters(plan):
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "FusedAdam(capturable=True) cannot capture this step: quantized weights whose bytes this optimizer "
                "has not written yet (or that were written since, e.g. by a load) need the skip verdict on the host. "
                "Run one eager step before capturing, and load checkpoints outside the captured region"
            )
        skipped = bool(found)
    if not skipped:  # False, or None: a skipped step rewrites what the masters' quantization was
        write_back(plan, amaxes)
    return found


def _moment_amaxes(plan: Plan, grads: list[list[torch.Tensor]]) -> list[torch.Tensor | None]:
    """Per bucket, the agreed amaxes of its updated fp8 moments ((rows, len(params)): [Note:
    FusedAdam fp8 moments]), or None where it has none."""
    fp8 = [b for b, bucket in enumerate(plan.buckets) if bucket.moment_scale_invs]
    local = []
    for b in fp8:
        bucket, group = plan.buckets[b], plan.buckets[b].group
        beta1, beta2 = group["betas"]
        scalars = quant_core.AdamScalars.for_moments(
            beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"], adam_w_mode=group["adam_w_mode"]
        )
        args = (bucket.params, grads[b], bucket.exp_avgs, bucket.exp_avg_sqs, bucket.moment_scale_invs)
        # The operator without the public function's checks: FusedAdam made these states.
        local.append(torch.ops.quant_core.adam_moment_amaxes(*args, list(dataclasses.astuple(scalars))))
    agreed = agree_moment_amaxes([plan.buckets[b] for b in fp8], local) if fp8 else []
    moment_amaxes: list[torch.Tensor | None] = [None] * len(plan.buckets)
    for b, amaxes in zip(fp8, agreed, strict=True):
        moment_amaxes[b] = amaxes
    return moment_amaxes


def _verdict(plan: Plan, grads: list[torch.Tensor], found_inf: torch.Tensor | None) -> torch.Tensor:
    """fp32 0-d on the plan's device: 1.0 when some rank found a non-finite gradient (one all-reduce)."""
    if found_inf is not None:
        # any() of a float tensor is (found_inf != 0).any(): NaN counts as nonzero, -0.0 as zero.
        bad = found_inf.any().to(device=plan.device, dtype=torch.float32)
    elif plan.one_device:
        # The operator without the public function's checks: FusedAdam checked the gradients' dtypes
        # and shapes, and a gradient lives on its parameter's device.
        bad = torch.ops.quant_core.has_non_finite(grads)
    else:
        bad = quant_core.has_non_finite(grads)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return bad


def _bytes_are_the_masters(plan: Plan) -> bool:
    """Whether every quantized weight's bytes are what its stateless quantizer wrote from its
    master at this optimizer's last write-back, so a skipped step may rewrite them unknowing."""
    return all(r.local.quantizer.stateless and r.written[0] == buffer_versions(r.local) for r in plan.requantize)


def _adam_step(
    bucket: Bucket, grads: list[torch.Tensor], found: torch.Tensor | None, moment_amaxes: torch.Tensor | None
) -> torch.Tensor:
    """The bucket's update by `torch.ops.quant_core.adam_step`, gated by the verdict `found` on the
    device (None: known not skipped); fp8 moments encoded with the scales of `moment_amaxes`.
    Returns the amaxes with `compute_amax` (else an empty tensor)."""
    group = bucket.group
    lr = group["lr"]
    if isinstance(lr, torch.Tensor) and lr.device != bucket.device:
        lr = lr.item()  # a CPU tensor: no device sync
    lr_tensor = lr if isinstance(lr, torch.Tensor) else None
    beta1, beta2 = group["betas"]
    hyperparameters = [0.0 if lr_tensor is not None else float(lr), beta1, beta2, group["eps"], group["weight_decay"]]
    fp8 = (bucket.moment_scale_invs, moment_amaxes) if moment_amaxes is not None else (None, None)
    # The operator without the public function's checks: FusedAdam made these states itself.
    return torch.ops.quant_core.adam_step(
        bucket.params,
        grads,
        bucket.exp_avgs,
        bucket.exp_avg_sqs,
        bucket.steps,
        bucket.outs,
        found if found is None or found.device == bucket.device else found.to(bucket.device),
        lr_tensor,
        hyperparameters,
        group["adam_w_mode"],
        bucket.compute_amax,
        MASTER_ROUNDING_SEED,
        bucket.counters or None,
        *fp8,
    )
