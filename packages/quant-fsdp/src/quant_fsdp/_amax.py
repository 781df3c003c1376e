"""One all-reduce for many amaxes: quantize-on-gather shards' (`sync_amax_`), delayed scaling's
histories (`sync_amax_histories_`)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

import quant_core
import quant_tensors as qt
from quant_fsdp._quantize_on_gather import QuantizeOnGatherTensor, quantize_synced_shards


def sync_amax_(params: Iterable[torch.Tensor], group: dist.ProcessGroup | None = None) -> int:
    """All-reduces (MAX) the amaxes of every per-tensor-scaled quantize-on-gather shard in one collective.

    Without it, each such shard's pre-all-gather hook all-reduces its own amax (one collective per
    weight per step) and quantizes the shard. Call it after `optimizer.step()`: it quantizes the
    shards of stateless quantizers right away, alike ones in one call ([Note: shards quantized
    ahead]), so the next gathers send them as they are, as long as the shards are unchanged (a
    later in-place change makes a shard all-reduce and quantize on its own again). `group`
    defaults to the shard group fully_shard gave the quantizers. Parameters of other kinds are skipped: quantized primary weights agree on their
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
    amaxes = quant_core.amax_many([s._data for s in shards])  # one kernel call for all shards
    dist.all_reduce(amaxes, op=dist.ReduceOp.MAX, group=group)
    for shard, amax in zip(shards, amaxes, strict=True):
        shard._synced_amax = (shard.shard_version(), amax)
    quantize_synced_shards(shards)
    return len(shards)


# [Note: shared amax histories] Delayed scaling scales step t with the amaxes of earlier steps.
# Under data parallelism each rank sees other inputs and gradients, so its histories would drift
# apart, and with them its scales. `sync_amax_histories_` reduces (MAX) every delayed-scaling
# history of a module in one collective, so every rank holds the same histories (what
# TransformerEngine does). quant_fsdp.fully_shard syncs before the forward of the outermost sharded
# module (the root): the whole model in one all-reduce per step; inner sharded modules skip.
# Between steps the newest entries (the input amaxes of the last forward, the grad_output amaxes
# of the last backward) are still each rank's own until the next forward's sync. A state dict
# treats buffers as replicated (torch.distributed.checkpoint saves one rank's copy and loads it
# on every rank), so each sharded module's state_dict pre-hook syncs the histories first: the
# saved history is the one the next forward would have used, and syncing again there changes
# nothing (MAX is idempotent), so a resumed run continues bitwise.


def amax_histories(module: torch.nn.Module, *, own_only: bool = False) -> list[torch.Tensor]:
    """The delayed-scaling amax histories of every qt.nn.Linear in `module` (its state buffers);
    `own_only`: leaving out the subtrees of submodules that sync their own (a HistorySyncHook)."""
    return [
        layer.get_buffer(f"{role}_quantizer_state")
        for layer in _modules_outside(module, own_only)
        if isinstance(layer, qt.nn.Linear)
        for role in qt.ROLES
        if isinstance(getattr(layer, f"{role}_quantizer"), qt.Float8DelayedQuantizer)
    ]


def _modules_outside(module: torch.nn.Module, own_only: bool) -> Iterator[torch.nn.Module]:
    """`module` and its submodules, with `own_only` leaving out the subtrees rooted at submodules
    a HistorySyncHook serves."""
    yield module
    for child in module.children():
        if not (own_only and getattr(child, _SYNCS_HISTORIES, False)):
            yield from _modules_outside(child, own_only)


def sync_amax_histories_(
    module: torch.nn.Module, groups: dist.ProcessGroup | Iterable[dist.ProcessGroup] | None = None
) -> int:
    """All-reduces (MAX) every delayed-scaling amax history in `module` in one collective per
    group ([Note: shared amax histories]); returns how many histories were synced.

    `groups`: the data-parallel group, or several (the dims of an HSDP mesh, reduced in turn:
    `[mesh.get_group(d) for d in range(mesh.ndim)]`); default the whole world. Every rank of the
    groups must call it.
    """
    return _all_reduce_max(amax_histories(module), _group_tuple(groups))


def _group_tuple(groups: Any) -> tuple[dist.ProcessGroup | None, ...]:
    """`sync_amax_histories_`'s `groups` as the groups to reduce over in turn (None: the whole world)."""
    if groups is None or isinstance(groups, dist.ProcessGroup):
        return (groups,)
    several = tuple(groups) if isinstance(groups, Iterable) else ()
    if not several or not all(isinstance(group, dist.ProcessGroup) for group in several):
        raise TypeError(
            f"sync_amax_histories_ takes groups= as None (the whole world), a ProcessGroup or several, got {groups!r}; "
            "for a DeviceMesh pass [mesh.get_group(d) for d in range(mesh.ndim)]"
        )
    return several


def _all_reduce_max(histories: list[torch.Tensor], groups: tuple[dist.ProcessGroup | None, ...]) -> int:
    if not histories:
        return 0
    flat = torch.cat(histories)
    for group in groups:
        dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group)
    torch._foreach_copy_(histories, list(flat.split([h.numel() for h in histories])))
    return len(histories)


_SYNCS_HISTORIES = "_quant_fsdp_syncs_amax_histories"  # set on the modules a HistorySyncHook serves


class HistorySyncHook:
    """Forward pre- and post-hooks of a sharded module: the outermost sharded module whose forward
    starts syncs the histories of its whole subtree ([Note: shared amax histories]); sharded modules
    inside its forward skip. Every rank runs the same modules, so all ranks agree on whether to
    communicate. (Version counters cannot tell what changed: quant-core operators write histories
    through pointers.)

    A state_dict pre-hook syncs the histories the module's state dict holds before they are read:
    those of its subtree outside nested modules with a hook of their own (those sync theirs when
    state_dict reaches them), so every history is synced once per state_dict call on a sharded
    module or an ancestor of one, without state kept between calls. Every rank must call it (as
    torch.distributed.checkpoint and get_state_dict do)."""

    _running = 0  # sharded modules whose forward is running, across all hooks

    def __init__(self, groups: tuple[dist.ProcessGroup, ...]) -> None:
        self.groups = groups

    def register(self, module: torch.nn.Module) -> None:
        module.register_forward_pre_hook(self.before)
        module.register_forward_hook(self.after, always_call=True)
        module.register_state_dict_pre_hook(self.before_state_dict)
        setattr(module, _SYNCS_HISTORIES, True)

    def before_state_dict(self, module: torch.nn.Module, prefix: str, keep_vars: bool) -> None:
        _all_reduce_max(amax_histories(module, own_only=True), self.groups)

    @torch.compiler.disable  # communication between compiled blocks, as FSDP2's own hooks
    def before(self, module: torch.nn.Module, args: Any) -> None:
        if HistorySyncHook._running == 0:
            _all_reduce_max(amax_histories(module), self.groups)
        HistorySyncHook._running += 1

    @torch.compiler.disable
    def after(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        HistorySyncHook._running -= 1
