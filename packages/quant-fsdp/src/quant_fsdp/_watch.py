"""Naming the weights of a quantized all-gather that does not complete (`watch_gathers`).

[Note: gather watch] A collective that one rank of its group never issues blocks the others
until the backend gives up (NCCL's watchdog, 10 minutes by default, then aborts the process;
gloo raises), and neither backend says what was being gathered. While `watch_gathers(seconds)`
is on, every quantized weight's pre-all-gather hook records when its gather began and its
post-all-gather hook (which runs once FSDP2 has waited for the collective) forgets it; a daemon
thread logs each gather still open after `seconds`, once, on the "quant_fsdp" logger at ERROR:
this rank, the weights that collective holds (names relative to the module `fully_shard` sharded,
formats), and how long it has waited. So a hang says where the ranks parted before the backend's
timeout ends the run. Off (the default), the hooks record nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import torch.distributed as dist

from quant_fsdp import _plan

logger = logging.getLogger("quant_fsdp")

_timeout: float | None = None
_open: dict[int, tuple[float, Any]] = {}  # id(quantizer) -> (when its gather began, quantizer)
_reported: set[int] = set()
_lock = threading.Lock()
_thread: threading.Thread | None = None


def watch_gathers(seconds: float | None) -> None:
    """Logs the weights of every quantized all-gather of this rank that has not completed after
    `seconds` ([Note: gather watch]); None stops watching. Call it on every rank (each watches its
    own gathers), e.g. with a few times a step's duration: the backward's prefetched gathers stay
    open while the layer before them computes."""
    global _timeout, _thread
    if seconds is not None and not seconds > 0:
        raise ValueError(f"watch_gathers takes a positive number of seconds (or None to stop); got {seconds!r}")
    with _lock:
        _timeout = seconds
        _open.clear()
        _reported.clear()
        if seconds is not None and (_thread is None or not _thread.is_alive()):
            _thread = threading.Thread(target=_watch, name="quant_fsdp gather watch", daemon=True)
            _thread.start()


def gather_began(quantizer: Any) -> None:
    """Called by the pre-all-gather hooks of quantized weights."""
    if _timeout is not None:
        _open[id(quantizer)] = (time.monotonic(), quantizer)


def gather_ended(quantizer: Any) -> None:
    """Called by the post-all-gather hooks of quantized weights."""
    if _timeout is not None:
        _open.pop(id(quantizer), None)
        _reported.discard(id(quantizer))  # a later gather of this weight that hangs is reported again


def _watch() -> None:
    while True:
        timeout = _timeout
        if timeout is None:
            return
        time.sleep(min(timeout / 4, 5.0))
        now = time.monotonic()
        with _lock:  # the hooks write `_open` without it: list() copies it under the GIL in one call
            stuck = [(key, began, q) for key, (began, q) in list(_open.items()) if now - began > timeout]
            stuck = [entry for entry in stuck if entry[0] not in _reported]
            _reported.update(key for key, _, _ in stuck)
        by_module: dict[int, list[tuple[float, Any]]] = {}
        for _, began, quantizer in stuck:
            module = _plan.fsdp_module_of(quantizer)
            by_module.setdefault(id(module), []).append((began, quantizer))
        for entries in by_module.values():
            _report(entries, now)


def _report(entries: list[tuple[float, Any]], now: float) -> None:
    module = _plan.fsdp_module_of(entries[0][1])
    weights = ", ".join(f"{_plan.name_of(q) or '?'} ({q.format_name})" for _, q in entries)
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    logger.error(
        "rank %d: the all-gather of %s holding %s began %.1f s ago and has not completed: another rank of "
        "its shard group has not issued it (it stopped, raised, or runs other collectives: compare "
        "quant_fsdp.gather_plan(model) on every rank)",
        rank,
        _class_name(module),
        weights,
        now - min(began for began, _ in entries),
    )


def _class_name(module: Any) -> str:
    """The module's own class name (FSDP2 makes the class FSDP<name> with the original class last
    among its bases)."""
    if module is None:
        return "an FSDP2 module"
    kind = type(module)
    return kind.__bases__[-1].__name__ if kind.__name__.startswith("FSDP") and kind.__bases__ else kind.__name__
