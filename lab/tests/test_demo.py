"""`quant-fsdp demo` end to end, as a user runs it: FSDP2 training on 2 gloo ranks (bf16, fp8 and
nvfp4, 12 steps), the table, demo.json with its metadata, demo_gather.json and the plot."""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

import quant_tensors as qt
from quant_fsdp_cli import main
from quant_lab.demo import TinyTransformer, TransformerConfig, _training
from quant_lab.demo._training import FINAL_WINDOW, LOSS_BOUND, DemoOptions, _train_all, demo_recipe


def test_demo_learns_and_writes_the_table_json_and_plot(tmp_path, capsys):
    out = tmp_path / "results"
    # 12 steps: more than the verdict's 10-step window, and enough to learn.
    argv = ["demo", "--recipes", "fp8,nvfp4", "--nproc", "2", "--steps", "12", "--seed", "3", "--out", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    report = json.loads((out / "demo.json").read_text())

    metadata = report["metadata"]
    assert metadata["command"] == "quant-fsdp " + " ".join(argv)
    assert (metadata["nproc"], metadata["steps"], metadata["seed"]) == (2, 12, 3)
    assert (metadata["device"], metadata["recipes"]) == ("cpu", ["fp8", "nvfp4"])
    assert set(metadata["versions"]) == {"torch", "quant-core", "quant-tensors", "quant-fsdp", "quant-optim"}
    assert metadata["versions"]["torch"] == torch.__version__
    age = datetime.datetime.now(datetime.timezone.utc) - datetime.datetime.fromisoformat(metadata["date"])
    assert datetime.timedelta(0) <= age < datetime.timedelta(hours=1)

    runs = {run["run"]: run for run in report["runs"]}
    assert list(runs) == ["bf16", "fp8", "nvfp4"]
    for run in runs.values():
        assert len(run["losses"]) == 12
        assert run["final_loss"] == pytest.approx(statistics.fmean(run["losses"][-FINAL_WINDOW:]))
        # It learns: from ln(256) = 5.7 to a mean of about 4.1 over steps 3-12; the floor (the chain's entropy) is 1.1.
        assert run["final_loss"] < 0.75 * run["losses"][0]
        assert run["final_loss"] > report["loss_floor"] > 0.5
    bf16_final = runs["bf16"]["final_loss"]
    for recipe in ("fp8", "nvfp4"):
        run = runs[recipe]
        assert run["vs_bf16"] == pytest.approx(run["final_loss"] / bf16_final - 1)
        assert run["passed"] is (abs(run["vs_bf16"]) <= LOSS_BOUND[recipe]) is True
        assert run["gemms"] == "emulated"
        # Linear weights travel quantized; norms, embeddings and biases stay bf16.
        assert run["gathered_vs_bf16"] < 0.6
        assert run["fallbacks"] == 0
        assert run["weight_mib"] < 0.55 * runs["bf16"]["weight_mib"]
        assert run["peak_memory_gib"] is None  # CPU
    assert runs["nvfp4"]["gathered_vs_bf16"] < 0.3
    assert report["passed"] is True

    gathers = json.loads((out / "demo_gather.json").read_text())
    assert {row["recipe"] for row in gathers} == {"fp8 per-tensor", "nvfp4 16x16"}  # only the chosen formats
    assert (out / "demo_loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    lines = printed.splitlines()
    assert "2 CPU ranks (gloo), 12 steps of 8x64 tokens, seed 3" in printed
    assert "final loss: mean of the last 10 steps' training losses" in printed
    assert "loss floor" in printed
    assert "entropy" in printed
    for recipe in ("fp8", "nvfp4"):
        row = next(line for line in lines if line.startswith(f"│ {recipe} "))
        assert "PASS" in row
        assert "(emulated GEMMs)" in row
        assert f"{runs[recipe]['vs_bf16']:+.2%}" in row
        assert f"±{LOSS_BOUND[recipe]:.0%}" in row
    # The bound is the demo's own sanity bound, and the legend says where every bound is explained.
    flat = " ".join(printed.split())  # rich wraps long lines
    assert "PASS when within ± bound, the demo's sanity bound for a short run" in flat
    assert "not a parity bound: docs/benchmarks.md, 'Loss parity bounds', says what each bound checks" in flat
    assert report["definitions"]["bound"].startswith("the demo's sanity bound for a short run")
    assert any(
        line.startswith("PASS: every recipe (fp8, nvfp4) within its loss bound of bf16 after 12 steps")
        for line in lines
    )


def test_the_demos_bounds_are_the_ones_docs_benchmarks_lists():
    # docs/benchmarks.md, "Loss parity bounds" (where the demo's legend points): the demo's row of its table.
    page = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md").read_text()
    section = page.split("\n## Loss parity bounds\n", 1)[1].split("\n## ", 1)[0]
    header = next(line for line in section.splitlines() if line.startswith("| check |"))
    row = next(line for line in section.splitlines() if line.startswith("| nox -s demo |"))
    cells = dict(zip(*([c.strip() for c in line.strip("|").split("|")] for line in (header, row)), strict=True))
    documented = {recipe: cells["NVFP4" if recipe == "nvfp4" else "FP8 recipes"] for recipe in LOSS_BOUND}
    assert {recipe: f"{bound:.0%}" for recipe, bound in LOSS_BOUND.items()} == documented


def test_demo_on_one_rank_gathers_nothing(tmp_path, capsys):
    # FSDP2 on one rank skips the collectives: no bytes gathered, no ratio to bf16's.
    out = tmp_path / "results"
    assert main(["demo", "--recipes", "fp8", "--nproc", "1", "--steps", "1", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    flat = " ".join(printed.split())  # rich wraps long lines
    # One step is too short for a loss verdict: the demo says so instead of PASS or FAIL.
    row = next(line for line in printed.splitlines() if line.startswith("│ fp8 "))
    assert "PASS" not in row
    assert "FAIL" not in row
    assert "none (< 10 steps)" in row
    assert "The verdict needs at least 10 steps (this run has 1)" in flat
    assert "No loss verdict: it needs at least 10 steps, this run has 1 (--steps)" in flat
    assert not any(line.startswith(("PASS", "FAIL")) for line in printed.splitlines())
    assert "1 step of 8x64 tokens" in flat
    assert "after 1 step)" in flat
    # What is trained, and every column of the gather table, in a user's words.
    assert "a small transformer (4 blocks, width 256, " in flat
    assert "learning a synthetic next-token task" in flat
    for legend in ("backend: ", "ms: ", "bytes/bf16: ", "rel err: ", "=ref: ", "shards=full: ", "fallback: "):
        assert legend in flat
    report = json.loads((out / "demo.json").read_text())
    assert report["passed"] is True
    runs = {run["run"]: run for run in report["runs"]}
    assert runs["fp8"]["passed"] is None
    assert runs["bf16"]["gathered_mib_per_step"] == runs["fp8"]["gathered_mib_per_step"] == 0
    assert runs["fp8"]["gathered_vs_bf16"] is None
    # The one rank holds every Linear weight: one FP8 byte per bf16 pair, plus one fp32 scale per weight.
    assert runs["fp8"]["weight_mib"] == pytest.approx(runs["bf16"]["weight_mib"] / 2, rel=1e-4)


def test_demo_training_passes_on_demand_columnwise_on_the_recipes_not_the_environment(tmp_path, monkeypatch):
    # Options pass as arguments, never through os.environ. The rank work runs here, in
    # this process, as the one rank of a gloo group.
    monkeypatch.delenv(qt.COLUMNWISE_ON_DEMAND_ENV_VAR, raising=False)
    environment = dict(os.environ)
    options = DemoOptions(recipes=("fp8", "mxfp8"), num_ranks=1, num_steps=1, device="cpu", seed=0)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        _train_all(0, 1, options, str(tmp_path / "results.json"))
    finally:
        dist.destroy_process_group()
    assert dict(os.environ) == environment
    weight_bytes = {run: r["weight_bytes"] for run, r in json.loads((tmp_path / "results.json").read_text()).items()}
    # FP8 weights keep rowwise data only: one byte per bf16 pair (and a scale); MXFP8 keeps both usages.
    assert weight_bytes["fp8"] == pytest.approx(weight_bytes["bf16"] / 2, rel=1e-4)
    assert weight_bytes["mxfp8"] > weight_bytes["bf16"]
    assert demo_recipe("fp8").weight_columnwise_on_demand is True
    assert demo_recipe("mxfp8").weight_columnwise_on_demand is None


@pytest.mark.parametrize(
    ("steps", "label"), [(3, "loss (mean of the last 3 steps) "), (12, "loss (mean of the last 10 steps) ")]
)
def test_progress_bars_name_the_steps_they_average(steps, label, tmp_path, capsys, monkeypatch):
    # Rank 0's work, run here as the one rank of a gloo group; bf16 only, on a narrow one-block model (the
    # label is the point here; the demo's own model trains in the tests above).
    monkeypatch.setattr(_training, "TinyTransformer", lambda: TinyTransformer(TransformerConfig(hidden=128, layers=1)))
    options = DemoOptions(recipes=(), num_ranks=1, num_steps=steps, device="cpu", seed=0)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        _train_all(0, 1, options, str(tmp_path / "results.json"))
    finally:
        dist.destroy_process_group()
    assert label in capsys.readouterr().out


def _session(session: int) -> list[str]:
    """The command lines of the processes of session `session` (from /proc)."""
    found = []
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # state, ppid, pgrp, session, ...
            if int(fields[3]) == session:
                found.append((stat.parent / "cmdline").read_text().replace("\0", " "))
        except OSError:  # it ended meanwhile
            continue
    return found


@pytest.mark.skipif(not pathlib.Path("/proc/self/stat").exists(), reason="finds the rank processes in /proc")
def test_ctrl_c_ends_every_rank_says_one_line_and_writes_nothing(tmp_path):
    out = tmp_path / "results"
    out.mkdir()
    (out / "demo.json").write_text("previous run")
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    argv = ["demo", "--recipes", "fp8", "--steps", "100000", "--out", str(out)]
    # A terminal's foreground command starts with Ctrl-C at its default; a shell's background job
    # (pytest run with `&`) starts with SIGINT ignored, which a child would inherit. A handled
    # signal is reset to its default in the child.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        demo = subprocess.Popen(
            [sys.executable, "-m", "quant_fsdp_cli", *argv],
            env={**os.environ, "TMPDIR": str(temporary)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # its own process group and session, as a shell gives a command
        )
    finally:
        signal.signal(signal.SIGINT, previous)
    try:
        # The ranks' process-group store appears once they have joined the group and begin training.
        while not list(temporary.glob("*/store")):
            assert demo.poll() is None, demo.communicate()
            time.sleep(0.2)
        os.killpg(demo.pid, signal.SIGINT)  # Ctrl-C in a terminal: SIGINT to every process of the group
        _, error = demo.communicate(timeout=120)
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
            demo.wait()
        demo.stderr.close()
    assert demo.returncode == 130
    assert error == f"quant-fsdp demo: interrupted; nothing written to {out}\n"
    assert [p.name for p in out.iterdir()] == ["demo.json"]
    assert (out / "demo.json").read_text() == "previous run"
    assert not list(temporary.glob("quant-fsdp-*")), "the staging folder is removed"
    assert not list(temporary.glob("*/store")), "the ranks' temporary folder is removed"
    # multiprocessing's resource tracker leaves once the command has exited; no rank stays.
    for _ in range(300):
        if not _session(demo.pid):
            break
        time.sleep(0.2)
    assert _session(demo.pid) == []
