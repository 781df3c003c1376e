"""quant_fsdp.watch_gathers on CUDA gathers, whose completion the host learns from an event
([Note: gather watch]); a fake event stands in for the GPU so this runs everywhere. The scenarios
with real collectives are in tests-integration (gloo) and the 2-GPU suite (NCCL)."""

from __future__ import annotations

import logging
import time
from typing import ClassVar

import pytest
import torch

from quant_fsdp import _watch


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


@pytest.fixture
def watched(monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    _Event.created.clear()
    caplog.set_level(logging.ERROR, logger="quant_fsdp")
    _watch.watch_gathers(0.2)
    yield caplog
    _watch.watch_gathers(None)


class _Weight:  # what the watch reads of a weight's context (quant_fsdp._context.ShardedWeight)
    def __init__(self, format_name: str) -> None:
        self.format_name = format_name
        self.name = None
        self.module = None
        self.open_gather = None


def _gather(name: str) -> _Weight:
    weight = _Weight(name)
    _watch.gather_began(weight)
    _watch.gather_ended(weight, torch.device("cuda", 0))  # the host goes on; the event tells
    return weight


def _errors(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]


def test_a_cuda_gather_stays_open_until_its_event_completes_and_is_logged_once(watched):
    _gather("per-tensor FP8")
    _gather("MXFP8")  # queued behind the first on the GPU
    time.sleep(0.6)
    errors = _errors(watched)
    assert len(errors) == 1, errors
    assert "holding ? (per-tensor FP8) began" in errors[0]
    assert "1 later weight gathers wait behind it" in errors[0]


def test_gathers_behind_a_completed_one_wait_from_its_completion(watched):
    _gather("per-tensor FP8")
    _gather("MXFP8")
    time.sleep(0.6)
    _Event.created[0].done = True  # the stuck gather completes; the one behind it an instant later
    time.sleep(0.1)
    _Event.created[1].done = True
    time.sleep(0.4)
    assert len(_errors(watched)) == 1, _errors(watched)


def test_completed_cuda_gathers_log_nothing(watched):
    for _ in range(3):
        _gather("per-tensor FP8")
        _Event.created[-1].done = True
    time.sleep(0.5)
    assert _errors(watched) == []
    assert not _watch._gathers  # completed gathers are forgotten
