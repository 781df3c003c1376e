"""quant_fsdp.watch_gathers on CUDA gathers, whose completion the host learns from an event
([Note: gather watch]); a fake event stands in for the GPU so this runs everywhere, and a fake
clock for the time, so each pass of the watch thread sees the time it is due at, whatever the
host's load. The scenarios with real collectives are in tests-integration (gloo) and the 2-GPU
suite (NCCL)."""

from __future__ import annotations

import logging
import threading
from typing import ClassVar

import pytest
import torch

from quant_fsdp import _watch

TIMEOUT = 4.0  # the watch passes every TIMEOUT / 4 = 1 s: every time below is exact in binary


class _Event:
    """torch.cuda.Event's record/query, completing when the test says so."""

    created: ClassVar[list[_Event]] = []

    def __init__(self) -> None:
        self.done = False
        _Event.created.append(self)

    def record(self) -> None:
        pass

    def query(self) -> bool:
        return self.done


class _Clock:
    """The watch's clock (`_watch._clock`): time stands still until `advance`, which wakes the
    watch thread at each time its sleep ends meanwhile and returns once the thread has run that
    pass and sleeps again."""

    def __init__(self) -> None:
        self.now = 0.0
        self._changed = threading.Condition()
        self._sleeps = 0  # how many times the watch thread began to sleep
        self._wakes_at: float | None = None  # while it sleeps: when it is due
        self._stopped = False

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        with self._changed:
            self._sleeps += 1
            wakes_at = self._wakes_at = self.now + seconds
            self._changed.notify_all()
            self._changed.wait_for(lambda: self._stopped or self.now >= wakes_at)
            self._wakes_at = None

    def advance(self, seconds: float) -> None:
        with self._changed:
            end = self.now + seconds
            self._await(lambda: self._wakes_at is not None)
            while self._wakes_at <= end:
                self.now, sleeps = self._wakes_at, self._sleeps
                self._changed.notify_all()
                self._await(lambda sleeps=sleeps: self._sleeps > sleeps)  # it ran the pass due now and sleeps again
            self.now = end

    def stop(self) -> None:
        """Lets every sleep return at once (the watch thread ends after watch_gathers(None))."""
        with self._changed:
            self._stopped = True
            self._changed.notify_all()

    def _await(self, sleeping) -> None:
        # A deadlock guard, not a timing check: the thread has a minute for what it does at once.
        assert self._changed.wait_for(sleeping, timeout=60), "the watch thread is not sleeping on the fake clock"


@pytest.fixture
def clock(monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    _Event.created.clear()
    fake = _Clock()
    monkeypatch.setattr(_watch, "_clock", fake)
    caplog.set_level(logging.ERROR, logger="quant_fsdp")
    _watch.watch_gathers(TIMEOUT)
    thread = _watch._thread
    yield fake
    _watch.watch_gathers(None)
    fake.stop()
    thread.join()


class _Weight:  # what the watch reads of a weight's context (quant_fsdp._context.ShardedWeight)
    def __init__(self, format_name: str, module: torch.nn.Module | None = None, name: str | None = None) -> None:
        self.format_name = format_name
        self.name = name
        self.module = module
        self.open_gather = None


class Block(torch.nn.Module):
    pass


def _gather(format_name: str, module: torch.nn.Module | None = None, name: str | None = None) -> _Weight:
    weight = _Weight(format_name, module, name)
    _watch.gather_began(weight)
    _watch.gather_ended(weight, torch.device("cuda", 0))  # the host goes on; the event tells
    return weight


def _errors(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]


def test_a_cuda_gather_stays_open_until_its_event_completes_and_is_logged_once(clock, caplog):
    _gather("per-tensor FP8")
    _gather("MXFP8")  # queued behind the first on the GPU
    # The watch counts a gather's wait from its first pass after the gather began (1 s): at 5 s it
    # has waited exactly the timeout.
    clock.advance(TIMEOUT + 1.0)
    assert _errors(caplog) == []
    clock.advance(1.0)
    errors = _errors(caplog)
    assert len(errors) == 1, errors
    assert "holding ? (per-tensor FP8) began 6.0 s ago" in errors[0]
    assert "MXFP8" not in errors[0]
    assert "; 1 later weight gathers wait behind it" in errors[0]
    clock.advance(10 * TIMEOUT)
    assert len(_errors(caplog)) == 1, _errors(caplog)


def test_gathers_behind_a_completed_one_wait_from_its_completion(clock, caplog):
    _gather("per-tensor FP8")
    clock.advance(2.0)
    _gather("MXFP8")
    clock.advance(4.0)
    assert len(_errors(caplog)) == 1
    clock.advance(0.5)
    _Event.created[0].done = True  # the stuck gather completes; the watch sees it in its pass at 7 s
    clock.advance(4.5)  # 11 s: the MXFP8 gather has waited the timeout behind it, 9 s in all
    assert len(_errors(caplog)) == 1, _errors(caplog)
    clock.advance(1.0)
    errors = _errors(caplog)
    assert len(errors) == 2, errors
    assert "holding ? (MXFP8) began 10.0 s ago" in errors[1]
    assert "later weight gathers" not in errors[1]


def test_the_weights_of_one_collective_are_reported_together(clock, caplog):
    first, second = Block(), Block()
    _gather("per-tensor FP8", first, "attention.wq")
    _gather("MXFP8", first, "attention.wk")
    _gather("NVFP4", second, "attention.wq")
    clock.advance(TIMEOUT + 2.0)
    errors = _errors(caplog)
    assert len(errors) == 1, errors
    assert (
        "the all-gather of Block holding attention.wq (per-tensor FP8), attention.wk (MXFP8) began 6.0 s ago"
        in errors[0]
    )
    assert "; 1 later weight gathers wait behind it" in errors[0]


def test_completed_cuda_gathers_log_nothing(clock, caplog):
    for _ in range(3):
        _gather("per-tensor FP8")
        _Event.created[-1].done = True
    clock.advance(10 * TIMEOUT)
    assert _errors(caplog) == []
    assert not _watch._gathers  # completed gathers are forgotten
