"""What quant_fsdp knows of each weight it shards: its `ShardedWeight`, bound to the weight's
quantizer ([Note: shard context] in quant_tensors._fsdp).

`quant_fsdp.fully_shard` binds one to every quantized weight it shards (the torchtitan converter
to every layer it converts), before FSDP2 first gathers it. FSDP2's hooks and DCP's shard protocol
then ask it what to do beyond the format's bytes: the weight's gather plan and the FSDP module
that gathers it (whether the backward gathers again, what the gather watch names), where its
shard lies in the whole tensor (checkpoint loads across weight forms), a checkpoint value staged
for a collective, and the byte counts of `comm_stats()`. A weight sharded by torch's own
`fully_shard` has none of this whatever is imported: its quantizer gets a plain context at its
first gather.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

import quant_tensors as qt
from quant_fsdp import _checkpoint, _watch
from quant_fsdp._stats import count_gather

if TYPE_CHECKING:
    from quant_fsdp._plan import GatherPlan


class ShardedWeight(qt.fsdp.ShardContext):
    """One weight's context: see the module docstring."""

    def __init__(self, format_name: str, plan: GatherPlan | None = None, module: torch.nn.Module | None = None):
        super().__init__()
        self.format_name = format_name
        self.plan = plan
        """Its gather plan (`quant_fsdp.gather_plan`); None where the torchtitan converter binds it."""
        self._module = None if module is None else weakref.ref(module)  # never a weak reference to a parameter
        self.placement: _checkpoint.Placement | None = None
        """Where its shard lies (set once `fully_shard` has made the parameter a DTensor)."""
        self.pending: _checkpoint.Pending | None = None
        """A checkpoint value staged for a collective (requantized before the next gather)."""
        self.open_gather: Any = None
        """Its latest gather while `watch_gathers` follows it."""

    @property
    def name(self) -> str | None:
        """The weight's name under the module `fully_shard` sharded, if known."""
        return None if self.plan is None else self.plan.name

    @property
    def module(self) -> torch.nn.Module | None:
        """The module `quant_fsdp.fully_shard` sharded the weight with (None if unknown or gone)."""
        return None if self._module is None else self._module()

    def before_gather(self, shard: qt.QuantizedTensor, mesh: Any) -> None:
        if self.pending is not None:  # a checkpoint loaded without load_state_dict after dcp.load
            _checkpoint.requantize_pending(self)
        super().before_gather(shard, mesh)  # binds the shard group where fully_shard did not
        _watch.gather_began(self)

    def after_gather(self, shard: qt.QuantizedTensor) -> None:
        _watch.gather_ended(self, shard.device)

    def fsdp_module(self, owner: torch.nn.Module | None) -> torch.nn.Module | None:
        return self.module or super().fsdp_module(owner)

    def count_gather(self, format_name: str, inputs: Sequence[torch.Tensor], world_size: int) -> None:
        count_gather(format_name, inputs, world_size, quantized=True)

    def tensor_shard_for_checkpoint(self, shard: qt.QuantizedTensor, index: Any) -> torch.Tensor:
        return _checkpoint.quantized_local_for_checkpoint(shard, self)


def context_of(quantizer: Any) -> ShardedWeight | None:
    """The ShardedWeight bound to `quantizer`, or None."""
    context = getattr(quantizer, "shard_context", None)
    return context if isinstance(context, ShardedWeight) else None


def count_gathers(module: torch.nn.Module) -> int:
    """Makes the quantized all-gathers of `module`'s quantized weights count in `comm_stats()`
    where another layer shards them (torch's own `fully_shard`, Accelerate's FSDP2 plugin);
    `quant_fsdp.fully_shard` and the torchtitan converter do this themselves. Call it before or
    after sharding; weights that count already are left as they are. Returns how many weights
    were bound a counting context."""
    bound = 0
    for param in module.parameters():
        local = qt.local_quantized(param)
        if local is not None and local.quantizer is not None and context_of(local.quantizer) is None:
            local.quantizer.bind(shard_context=ShardedWeight(local.quantizer.format_name))
            bound += 1
    return bound
