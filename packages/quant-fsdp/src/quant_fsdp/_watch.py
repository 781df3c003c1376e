"""Naming the weights of a quantized all-gather that does not complete (`watch_gathers`).

[Note: gather watch] A collective that one rank of its group never issues blocks the others
until the backend gives up (NCCL's watchdog, 10 minutes by default, then aborts the process;
gloo raises), and neither backend says what was being gathered. While `watch_gathers(seconds)`
is on, every quantized weight's pre-all-gather hook records when its gather began and its
post-all-gather hook marks where it completes: on CPU tensors (gloo), the hook runs once the
collective has completed, and forgets it; on CUDA tensors (NCCL) the host does not wait for the
collective (FSDP2 makes the compute stream wait), so the hook records a CUDA event on the current
stream, which completes after the collective, and the gather stays open until the event has. A
daemon thread logs, once, the gather that began first among those still open after `seconds`, on
the "quant_fsdp" logger at ERROR: this rank, the weights that collective holds (names relative to
the module `fully_shard` sharded, formats), how long it has waited, and how many later gathers
wait behind it (on NCCL every later collective of the group is queued behind the stuck one). So a
hang says where the ranks parted before the backend's timeout ends the run. Off (the default),
the hooks record nothing.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger("quant_fsdp")


@dataclass(slots=True)
class _Gather:
    """One quantized weight's gather as the watch follows it."""

    began: float
    weight: Any
    """The weight's context (quant_fsdp._context.ShardedWeight)."""
    done: bool = False
    """Its post-all-gather hook ran on CPU tensors (gloo: the collective had completed)."""
    event: torch.cuda.Event | None = None
    """On CUDA tensors: recorded by the post-all-gather hook, completes after the collective."""
    reported: bool = False

    def completed(self) -> bool:
        return self.done or (self.event is not None and self.event.query())


_clock: Any = time
"""What the watch reads the time from (`monotonic()`) and waits with (`sleep(seconds)`): the time
module, a fake one in tests."""
_timeout: float | None = None
# Gathers in the order they began; the watch drops completed ones from the front. A weight's
# context holds its latest gather for its post hook (`open_gather`).
_gathers: collections.deque[_Gather] = collections.deque()
_lock = threading.Lock()
_thread: threading.Thread | None = None


def watch_gathers(seconds: float | None) -> None:
    """Logs the weights of the oldest quantized all-gather of this rank that has not completed
    after `seconds`, once ([Note: gather watch]); None stops watching. Call it on every rank
    (each watches its own gathers), e.g. with a few times a step's duration: the backward's
    prefetched gathers stay open while the layer before them computes."""
    global _timeout, _thread
    if seconds is not None and not seconds > 0:
        raise ValueError(f"watch_gathers takes a positive number of seconds (or None to stop); got {seconds!r}")
    with _lock:
        _timeout = seconds
        _gathers.clear()
        if seconds is not None and (_thread is None or not _thread.is_alive()):
            _thread = threading.Thread(target=_watch, name="quant_fsdp gather watch", daemon=True)
            _thread.start()


def gather_began(weight: Any) -> None:
    """Called by the pre-all-gather hooks of quantized weights, with the weight's context."""
    if _timeout is not None:
        gather = _Gather(_clock.monotonic(), weight)
        _gathers.append(gather)
        weight.open_gather = gather


def gather_ended(weight: Any, device: torch.device) -> None:
    """Called by the post-all-gather hooks of quantized weights, with the weight's context and the
    gathered tensors' device."""
    if _timeout is None:
        return
    gather, weight.open_gather = weight.open_gather, None
    if gather is None:
        return
    if device.type == "cuda":  # completes with an event the watch polls ([Note: gather watch])
        event = torch.cuda.Event()
        event.record()
        gather.event = event
    else:
        gather.done = True


def _watch() -> None:
    front, front_since = None, 0.0  # the oldest open gather and since when it is the oldest
    while True:
        timeout = _timeout
        if timeout is None:
            return
        _clock.sleep(min(timeout / 4, 5.0))
        now = _clock.monotonic()
        with _lock:  # the hooks append without it; the watch alone removes, from the front
            while _gathers and _gathers[0].completed():
                _gathers.popleft()
            if not _gathers:
                continue
            if _gathers[0] is not front:  # gathers queued behind a completed one wait from then on
                front, front_since = _gathers[0], now
            if now - max(front.began, front_since) <= timeout or front.reported:
                continue
            front.reported = True
            waiting = [g for g in list(_gathers) if not g.completed()]
        module = front.weight.module
        together = 1  # the collective's other weights: the gathers that follow of its module
        while module is not None and together < len(waiting) and waiting[together].weight.module is module:
            together += 1
        weights = [g.weight for g in waiting[:together]]
        _report(module, weights, now - front.began, later=len(waiting) - together)


def _report(module: Any, weights_gathered: list[Any], waited: float, later: int) -> None:
    weights = ", ".join(f"{w.name or '?'} ({w.format_name})" for w in weights_gathered)
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    behind = f"; {later} later weight gathers wait behind it" if later else ""
    logger.error(
        "rank %d: the all-gather of %s holding %s began %.1f s ago and has not completed%s: another rank of "
        "its shard group has not issued it (it stopped, raised, or runs other collectives: compare "
        "quant_fsdp.gather_plan(model) on every rank)",
        rank,
        _class_name(module),
        weights,
        waited,
        behind,
    )


def _class_name(module: Any) -> str:
    """The module's own class name (FSDP2 makes the class FSDP<name> with the original class last
    among its bases)."""
    if module is None:
        return "an FSDP2 module"
    kind = type(module)
    return kind.__bases__[-1].__name__ if kind.__name__.startswith("FSDP") and kind.__bases__ else kind.__name__
