"""quant_fsdp's gather policy: what QuantizedTensor's FSDP2 hooks do beyond the format's bytes
while quant_fsdp is imported ([Note: gather policy] in quant_tensors._fsdp)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

import quant_tensors as qt
from quant_fsdp import _checkpoint, _plan, _watch
from quant_fsdp._stats import count_gather


class FullyShardGatherPolicy(qt.fsdp.GatherPolicy):
    """The default policy (the shard group as a per-tensor quantizer's `amax_group`, FSDP2's own
    backward-gather decision), plus: checkpoints staged for a collective are requantized before
    the first gather, the FSDP module `quant_fsdp.fully_shard` recorded decides the backward's
    gathers, quantized gathers count in `comm_stats()` (and are watched while `watch_gathers` is
    on: [Note: gather watch] in quant_fsdp._watch), and DCP loads a weight `fully_shard`
    sharded across its forms ([Note: checkpoints across weight forms] in quant_fsdp._checkpoint)."""

    def before_gather(self, shard: qt.QuantizedTensor, mesh: Any) -> None:
        if _checkpoint.pending():  # a checkpoint loaded without load_state_dict after dcp.load
            _checkpoint.requantize_pending()
        super().before_gather(shard, mesh)  # binds the shard group where fully_shard did not (torch's own)
        _watch.gather_began(shard.quantizer)

    def after_gather(self, shard: qt.QuantizedTensor) -> None:
        _watch.gather_ended(shard.quantizer, shard.device)

    def fsdp_module(self, quantizer: Any, owner: torch.nn.Module | None) -> torch.nn.Module | None:
        return _plan.fsdp_module_of(quantizer) or super().fsdp_module(quantizer, owner)

    def count_gather(self, format_name: str, inputs: Sequence[torch.Tensor], world_size: int) -> None:
        count_gather(format_name, inputs, world_size, quantized=True)

    def tensor_shard_for_checkpoint(self, shard: qt.QuantizedTensor, index: Any) -> torch.Tensor:
        return _checkpoint.quantized_local_for_checkpoint(shard, index)
