"""benchmarks/optim.py: the eager rows timed in interleaved rounds ([Note: interleaved rounds]
there), per-round ratios, and a tiny CPU run end to end."""

from __future__ import annotations

import json
import re
import statistics
import time

import optim as bench
import pytest
import torch

CPU = torch.device("cpu")


def test_rounds_interleave_the_steps_and_alternate_who_goes_first():
    calls = []
    steps = {name: (lambda name=name: calls.append(name)) for name in ("a", "b", "c")}
    # min_run_time=0: one block of one step per step function per round.
    ms = bench.interleaved_ms(steps, rounds=4, min_run_time=0.0, device=CPU)

    rounds = ["a", "b", "c", "c", "b", "a"] * 2
    assert calls[-len(rounds) :] == rounds
    assert set(calls[: -len(rounds)]) == set(steps)  # the warm-ups, before any round
    assert {name: len(times) for name, times in ms.items()} == {"a": 4, "b": 4, "c": 4}


def test_each_round_times_one_step_of_each_function():
    steps = {"slow": lambda: time.sleep(2e-3), "fast": lambda: None}
    ms = bench.interleaved_ms(steps, rounds=2, min_run_time=0.02, device=CPU)
    assert all(slow >= 2.0 for slow in ms["slow"]), ms  # ms per step, not per block
    assert all(fast < 0.5 for fast in ms["fast"]), ms


def test_ratio_is_taken_within_each_round():
    # Per round 1/1, 4/2, 4/8: median 1 (the ratio of the medians, 4/2, would be 2).
    assert bench.ratio_spread([1.0, 4.0, 4.0], [1.0, 2.0, 8.0]) == {"median": 1.0, "min": 0.5, "max": 2.0}


def test_rounds_below_one_are_refused(tmp_path):
    with pytest.raises(ValueError, match="--rounds must be at least 1"):
        bench.run(tmp_path, tensors=1, numel=1024, min_run_time=0.0, device=CPU, rounds=0)


def test_tiny_cpu_run_reports_every_round_and_the_spread(tmp_path, capsys):
    report = bench.run(tmp_path, tensors=2, numel=32 * 1024, min_run_time=0.02, device=CPU, rounds=2)

    assert set(report["ms per round"]) == {"fp32", "fp8", "mxfp8"}
    table = capsys.readouterr().out
    for kind, rows in report["ms per round"].items():
        baseline = next(name for name in rows if name.startswith("torch"))
        assert len(rows) >= 2, rows  # FusedAdam and its torch baseline at least
        for name, ms in rows.items():
            assert len(ms) == 2, (kind, name, ms)
            assert min(ms) > 0, (kind, name, ms)
            assert report["cases"][kind][name] == statistics.median(ms)
            if name == baseline:
                assert name not in report["x torch"][kind]
                continue
            spread = report["x torch"][kind][name]
            assert spread == bench.ratio_spread(rows[baseline], ms)
            assert spread["min"] <= spread["median"] <= spread["max"]
            printed = f"{spread['median']:.2f} ({spread['min']:.2f}-{spread['max']:.2f})"
            assert re.search(rf"^{kind} +{re.escape(name)} +[0-9.]+ +{re.escape(printed)}$", table, re.MULTILINE)
    assert json.loads((tmp_path / "bench_optim.json").read_text()) == report
