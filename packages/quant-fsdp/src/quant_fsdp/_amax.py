"""sync_amax_: one all-reduce for the per-tensor amaxes of many quantize-on-gather shards."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

import quant_core
import quant_tensors as qt
from quant_fsdp._weight import QuantizeOnGatherTensor


def sync_amax_(params: Iterable[torch.Tensor], group: dist.ProcessGroup | None = None) -> int:
    """All-reduces (MAX) the amaxes of every per-tensor-scaled quantize-on-gather shard in one collective.

    Without it, each such shard's pre-all-gather hook all-reduces its own amax (one collective per
    weight per step). Call it after `optimizer.step()`: the next gathers then quantize with the
    synced amaxes, as long as the shards are unchanged (a later in-place change makes a shard
    all-reduce on its own again). `group` defaults to the shard group fully_shard gave the
    quantizers. Parameters of other kinds are skipped: quantized primary weights agree on their
    scales whenever they are quantized (their quantizers all-reduce), fallback weights are quantized
    after the gather. Returns the number of amaxes synced. Every rank of the group must call it.
    """
    shards = [
        local
        for p in params
        if isinstance(local := qt.local_shard(p), QuantizeOnGatherTensor)
        and not local.fallback
        and local.quantizer.per_tensor_amax
    ]
    if not shards:
        return 0
    if group is None:
        groups = {id(s.quantizer.amax_group): s.quantizer.amax_group for s in shards}
        if len(groups) != 1:
            raise ValueError("sync_amax_ got shards of different process groups; pass group= or call it once per group")
        (group,) = groups.values()
    amaxes = torch.stack([quant_core.amax(s._data) for s in shards])
    dist.all_reduce(amaxes, op=dist.ReduceOp.MAX, group=group)
    for shard, amax in zip(shards, amaxes, strict=True):
        shard._synced_amax = (shard._data._version, amax)
    return len(shards)
