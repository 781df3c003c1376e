"""FusedAdam's step plan: the parameters with gradients bucketed by kind, with every tensor each
kernel call reads and every write-back after it ([Note: FusedAdam step] in quant_optim._step).

A plan is built once per list of parameters with gradients (and their gradients' dtypes) and
kept until `add_param_group` or `load_state_dict`; it holds local tensors (a DTensor's shard),
never DTensors, and no gradient (those are fresh each step).

[Note: FusedAdam bf16 masters] With `master_weight_dtype=torch.bfloat16` the master of a
parameter is kept in bf16 and stored rounded stochastically after each update ([Note: Adam
stochastic rounding] in quant_core.adam._adam): 2 bytes per parameter instead of 4, and each
update kept in expectation (round to nearest would drop every update below half a bf16 ulp).
A master is a quantized weight's (in either form: a high-precision fallback of another dtype
keeps a bf16 master and takes its value after each step), or a bf16 parameter's with
master_weights=True, which is its own bf16 master (no copy); fp32 parameters stay fp32, bf16 ones
without master_weights are rounded to nearest, fp16 ones need fp32 masters. The master starts
as the initial value rounded to nearest.
Every bf16 master has a counter, `state["master_rounding_counter"]` (0-d int64 on the parameter's
device), advanced by one per step that updates it (not by a skipped step): element j of the
master draws `random16(MASTER_ROUNDING_SEED + counter, j)`, j counted from its shard's first
element. Counters start at the parameter's position among the optimizer's parameters << 32, so
two parameters never draw one stream (for 2^32 steps); the seed is a constant, so a run is
reproducible. Counters are saved and loaded with the state, so a resumed run continues bit for
bit on the same layout (on another layout, shards count their elements from other starts: the
same statistics, other bits).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils.weak import WeakIdKeyDictionary

import quant_tensors as qt

FP8_MOMENT_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
MASTER_ROUNDING_SEED = 0x6D6173746572  # "master": apart from other users of the counter RNG at seed 0

WrittenRecord = list[tuple[int | None, ...] | None]
"""[a quantized weight's buffer versions when this optimizer last wrote them from its master, or None]."""


@dataclass(eq=False)
class Bucket:
    """Parameters stepped by one Adam kernel call: one group, one dtype per list, one device."""

    group: dict[str, Any]
    device: torch.device
    indices: list[int] = field(default_factory=list)
    """Positions of its parameters in the step's list of parameters with gradients."""
    params: list[torch.Tensor] = field(default_factory=list)
    """fp32 masters, or the parameters themselves (fp32, or bf16/fp16 without a master)."""
    exp_avgs: list[torch.Tensor] = field(default_factory=list)
    """Stored moments (fp8 ones as their codes)."""
    exp_avg_sqs: list[torch.Tensor] = field(default_factory=list)
    steps: list[torch.Tensor] = field(default_factory=list)
    """fp32 0-d step counts, on the parameters' device."""
    counters: list[torch.Tensor] = field(default_factory=list)
    """bf16 masters' stochastic-rounding counters (empty, or one per parameter: [Note: FusedAdam bf16 masters])."""
    outs: list[torch.Tensor] = field(default_factory=list)
    """Low-precision parameters written from their fp32 masters (empty, or one per parameter)."""
    compute_amax: bool = False
    """Whether a parameter of it is requantized with a per-tensor amax (the Adam pass returns it)."""
    moment_scale_invs: list[torch.Tensor] = field(default_factory=list)
    """The 0-d scale_invs of its fp8 moments (the state's `*_scale_inv`), a row of one per parameter
    for each fp8 moment list, exp_avgs' first ([Note: fp8 moments in the Adam pass] in quant-core);
    empty without fp8 moments."""
    shard_groups: list[tuple[dist.ProcessGroup, ...]] = field(default_factory=list)
    """Per parameter, the groups it is sharded over: its fp8 moments' amaxes are agreed over them."""


@dataclass(eq=False)
class Requantize:
    """A quantized weight written from its master after the update."""

    local: qt.QuantizedTensor
    master: torch.Tensor
    bucket: int
    """Its bucket's index in the plan."""
    position: int
    """Its index in that bucket (the row of the bucket's amaxes)."""
    groups: tuple[dist.ProcessGroup, ...]
    """The process groups its per-tensor amax is agreed over (none for block formats)."""
    written: WrittenRecord
    """The optimizer's record for this weight (`written_record`), shared with every plan holding it."""
    like: int | None = None
    """Stateless quantizers: the number of its (quantizer configuration, device) among the plan's;
    the weights of one number (and amax groups) are requantized by one `quantize_many_` call
    (`number_alike_weights`)."""


@dataclass(eq=False)
class Plan:
    buckets: list[Bucket]
    requantize: list[Requantize]
    device: torch.device
    """The device of the skip verdict (the first bucket's)."""
    one_device: bool
    """Whether every parameter (so every gradient) is on `device`."""


def build_plan(
    work: list[tuple[torch.Tensor, dict[str, Any]]],
    states: list[dict[str, Any]],
    grads: list[torch.Tensor],
    records: WeakIdKeyDictionary,
) -> Plan:
    """Buckets the parameters with gradients by kind and names every tensor each kernel reads.

    Args:
        work: (parameter, its group) for every parameter with a gradient, in the groups' order.
        states: the optimizer state of each (made already); step counts are moved to the
            parameter's device here, once.
        grads: their local gradients (only the dtypes are read).
        records: the optimizer's `written_record`s, by local quantized weight.
    """
    buckets: dict[tuple[Any, ...], Bucket] = {}
    fp8_scale_invs: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}  # bucket id -> per moment
    requantize = []
    for index, ((p, group), state, grad) in enumerate(zip(work, states, grads, strict=True)):
        local = qt.local_shard(p)
        if state["step"].device != local.device:  # counted where the parameter is
            state["step"] = state["step"].to(local.device)
        master = qt.local_shard(state["master"]) if "master" in state else local
        moments = [qt.local_shard(state[key]) for key in ("exp_avg", "exp_avg_sq")]
        out = local if master is not local and not isinstance(local, qt.QuantizedTensor) else None
        counter = state.get("master_rounding_counter")
        key = (
            id(group),
            counter is not None,
            grad.dtype,
            master.dtype,
            *(m.dtype for m in moments),
            None if out is None else out.dtype,
            local.device,
        )
        bucket = buckets.setdefault(key, Bucket(group, local.device))
        bucket_index = list(buckets).index(key)
        position = len(bucket.params)
        bucket.indices.append(index)
        bucket.params.append(master)
        bucket.steps.append(state["step"])
        if counter is not None:
            bucket.counters.append(counter)
        if out is not None:
            bucket.outs.append(out)
        bucket.exp_avgs.append(moments[0])
        bucket.exp_avg_sqs.append(moments[1])
        bucket.shard_groups.append(shard_groups(p))
        scale_invs = fp8_scale_invs.setdefault(id(bucket), ([], []))
        for name, moment, row in zip(("exp_avg", "exp_avg_sq"), moments, scale_invs, strict=True):
            if moment.dtype in FP8_MOMENT_DTYPES:
                row.append(state[f"{name}_scale_inv"])
        if isinstance(local, qt.QuantizedTensor):
            quantizer = local.quantizer
            groups = () if quantizer.amax_group is None or not quantizer.per_tensor_amax else (quantizer.amax_group,)
            bucket.compute_amax = bucket.compute_amax or quantizer.per_tensor_amax
            requantize.append(Requantize(local, master, bucket_index, position, groups, written_record(records, local)))
    for bucket in buckets.values():
        exp_avg_scale_invs, exp_avg_sq_scale_invs = fp8_scale_invs[id(bucket)]
        bucket.moment_scale_invs = exp_avg_scale_invs + exp_avg_sq_scale_invs
    number_alike_weights(requantize)
    devices = {bucket.device for bucket in buckets.values()}
    first = next(iter(buckets.values())).device if buckets else torch.device("cpu")
    return Plan(list(buckets.values()), requantize, first, len(devices) == 1)


def number_alike_weights(requantize: list[Requantize]) -> None:
    """Sets `like` of every weight with a stateless quantizer: equal for weights on one device
    whose quantizers quantize alike (`Quantizer.quantizes_like`: the same configuration), so that
    one `quantize_many_` call requantizes them all (block formats: on CUDA one Triton launch, not
    one per weight; per-tensor FP8: one scale computation, then a cast per weight)."""
    firsts: list[Requantize] = []  # the first weight of each number
    for r in requantize:
        if not r.local.quantizer.stateless:
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


def written_record(records: WeakIdKeyDictionary, local: qt.QuantizedTensor) -> WrittenRecord:
    """The optimizer's record of the buffer versions it left in `local` (made empty: [None]); plans
    keep it, so a step updates it without a weak-dictionary lookup per weight."""
    record = records.get(local)
    if record is None:
        record = records[local] = [None]
    return record


def buffer_versions(local: qt.QuantizedTensor) -> tuple[int | None, ...]:
    return tuple(None if b is None else b._version for b in local.buffers().values())


def shard_groups(p: torch.Tensor) -> tuple[dist.ProcessGroup, ...]:
    """The groups over whose ranks `p` is split: the mesh dims with a Shard placement."""
    if not isinstance(p, DTensor):
        return ()
    return tuple(p.device_mesh.get_group(dim) for dim, placement in enumerate(p.placements) if placement.is_shard())
