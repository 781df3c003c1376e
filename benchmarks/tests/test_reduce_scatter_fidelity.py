"""benchmarks/reduce_scatter_fidelity.py on the tiny configuration, on the CPU, 2 simulated ranks:
the report it writes, and one step's reduced gradients against an independent computation."""

from __future__ import annotations

import itertools
import json
import math
import types

import pytest
import reduce_scatter_fidelity
import torch
import torch.nn.functional as F
from _e2e import E2EOptions, build_run, select_runs
from _e2e_fidelity import fidelity_task
from reduce_scatter_fidelity import gradient_offsets, main, padded_numel, rank_gradients, reduce_bf16, reduce_fp8

import quant_core
import quant_fsdp

TINY = ["--config", "tiny", "--device", "cpu", "--model", "builtin", "--ranks", "2"]


def test_a_tiny_run_writes_the_table_the_curves_and_the_plot(tmp_path):
    assert main([*TINY, "--steps", "3", "--runs", "bf16:eager,fp8-block:hp:eager", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "reduce_scatter_fidelity.json").read_text())
    assert (report["ranks"], report["rank_batch"], report["config"]["batch_size"], report["num_steps"]) == (2, 1, 2, 3)
    rows = {row["run"]: row for row in report["rows"]}
    assert list(rows) == ["bf16:eager", "fp8-block:hp:eager"]
    for row in rows.values():
        assert not row["error"]
        assert len(row["bf16_losses"]) == len(row["fp8_losses"]) == 3
        assert all(math.isfinite(loss) for loss in row["bf16_losses"] + row["fp8_losses"])
        assert row["bf16_final_loss"] == row["bf16_losses"][-1]  # the last tenth of 3 steps: one step
        assert row["fp8_vs_bf16"] == row["fp8_final_loss"] / row["bf16_final_loss"] - 1
        assert row["bound"] == 0.003
        assert row["bf16_step_ms"] > 0
        assert row["fp8_step_ms"] > 0
    # Both reductions start from the same weights and batch: their first losses agree.
    assert rows["fp8-block:hp:eager"]["bf16_losses"][0] == rows["fp8-block:hp:eager"]["fp8_losses"][0]
    table = (tmp_path / "reduce_scatter_fidelity.md").read_text()
    assert "| fp8-block:hp:eager |" in table
    assert "| ms per step, bf16 / FP8 RS |" in table
    step_ms = f"{rows['bf16:eager']['bf16_step_ms']:.0f} / {rows['bf16:eager']['fp8_step_ms']:.0f}"
    assert f"| {step_ms} |" in table
    assert "2 simulated ranks with a micro-batch of 1 x 64 tokens each" in table
    assert (tmp_path / "reduce_scatter_fidelity.png").read_bytes().startswith(b"\x89PNG")


def test_a_compiled_run_trains_like_its_eager_twin(tmp_path):
    """`:compiled` runs compile the model (here with aot_eager: the same graphs traced, the same
    kernels run), so both reductions' losses equal the eager run's bit for bit."""
    arguments = ["--steps", "2", "--runs", "fp8:hp:eager,fp8:hp:compiled", "--compile-backend", "aot_eager"]
    torch._dynamo.utils.counters.clear()
    assert main([*TINY, *arguments, "--out", str(tmp_path)]) == 0
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # only the compiled run compiles
    eager, compiled = json.loads((tmp_path / "reduce_scatter_fidelity.json").read_text())["rows"]
    assert (eager["run"], compiled["run"]) == ("fp8:hp:eager", "fp8:hp:compiled")
    assert compiled["bf16_losses"] == eager["bf16_losses"]
    assert compiled["fp8_losses"] == eager["fp8_losses"]


def test_runs_of_several_calls_join_one_table_with_include(tmp_path, capsys):
    """A call's report holds its rows from the first run on; --include puts an earlier call's rows
    of the same training first, and refuses a report of another training or one holding a run again."""
    first, second = tmp_path / "first", tmp_path / "second"
    assert main([*TINY, "--steps", "3", "--runs", "bf16:eager", "--out", str(first)]) == 0
    earlier = first / "reduce_scatter_fidelity.json"
    command = [*TINY, "--steps", "3", "--runs", "fp8:hp:eager", "--include", str(earlier), "--out", str(second)]
    assert main(command) == 0
    (bf16_row,) = json.loads(earlier.read_text())["rows"]
    report = json.loads((second / "reduce_scatter_fidelity.json").read_text())
    assert [row["run"] for row in report["rows"]] == ["bf16:eager", "fp8:hp:eager"]
    assert report["rows"][0] == bf16_row
    assert len(report["rows"][1]["fp8_losses"]) == 3
    table = (second / "reduce_scatter_fidelity.md").read_text()
    assert "| bf16:eager |" in table
    assert "| fp8:hp:eager |" in table
    capsys.readouterr()
    for arguments, message in [
        (["--steps", "2", "--runs", "fp8:hp:eager"], "was trained differently (num_steps)"),
        (["--steps", "3", "--ranks", "1", "--runs", "fp8:hp:eager"], "was trained differently (ranks, rank_batch"),
        (["--steps", "3", "--runs", "bf16:eager"], "already holds bf16:eager (bf16, fp8): leave it out of --runs"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            main([*TINY, *arguments, "--include", str(earlier), "--out", str(tmp_path / "refused")])
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(SystemExit):
        main([*TINY, "--include", str(tmp_path / "broken.json"), "--out", str(tmp_path / "refused")])
    assert "not a readable reduce_scatter_fidelity.json" in capsys.readouterr().err
    assert not (tmp_path / "refused").exists()  # a refused call writes nothing


def test_two_calls_each_training_one_reduction_make_the_row_of_one_call(tmp_path, capsys):
    """--reductions trains one reduction per call; the second call's --include of the first makes
    one row, equal to the row of a call that trains both (the same curves, finals and comparison);
    a reduction the included report holds already is refused."""
    common = [*TINY, "--steps", "3", "--runs", "fp8:hp:eager"]
    assert main([*common, "--out", str(tmp_path / "both")]) == 0
    assert main([*common, "--reductions", "fp8", "--out", str(tmp_path / "fp8")]) == 0
    fp8_only = tmp_path / "fp8" / "reduce_scatter_fidelity.json"
    (half,) = json.loads(fp8_only.read_text())["rows"]
    assert half["bf16_losses"] == []
    assert half["bf16_final_loss"] is None
    assert half["fp8_vs_bf16"] is None
    assert "| fp8:hp:eager | - |" in (tmp_path / "fp8" / "reduce_scatter_fidelity.md").read_text()
    command = [*common, "--reductions", "bf16", "--include", str(fp8_only), "--out", str(tmp_path / "joined")]
    assert main(command) == 0
    (joined,) = json.loads((tmp_path / "joined" / "reduce_scatter_fidelity.json").read_text())["rows"]
    (both,) = json.loads((tmp_path / "both" / "reduce_scatter_fidelity.json").read_text())["rows"]
    for key in ("run", "bf16_losses", "fp8_losses", "bf16_final_loss", "fp8_final_loss", "fp8_vs_bf16", "bound"):
        assert joined[key] == both[key], key
    # Side by side: each reduction in a call of its own, then `--runs ''` joins the two reports.
    assert main([*common, "--reductions", "bf16", "--out", str(tmp_path / "bf16")]) == 0
    bf16_only = tmp_path / "bf16" / "reduce_scatter_fidelity.json"
    halves = ["--include", str(bf16_only), "--include", str(fp8_only)]
    assert main([*TINY, "--steps", "3", "--runs", "", *halves, "--out", str(tmp_path / "side")]) == 0
    (side,) = json.loads((tmp_path / "side" / "reduce_scatter_fidelity.json").read_text())["rows"]
    for key in ("run", "bf16_losses", "fp8_losses", "bf16_final_loss", "fp8_final_loss", "fp8_vs_bf16", "bound"):
        assert side[key] == both[key], key
    assert (tmp_path / "side" / "reduce_scatter_fidelity.png").read_bytes().startswith(b"\x89PNG")
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main([*common, "--include", str(fp8_only), "--out", str(tmp_path / "refused")])
    assert exit_info.value.code == 2
    assert "already holds fp8:hp:eager (fp8): leave it out of --runs" in capsys.readouterr().err
    twice = ["--include", str(fp8_only), "--include", str(fp8_only)]
    with pytest.raises(SystemExit):
        main([*common, "--reductions", "bf16", *twice, "--out", str(tmp_path / "refused")])
    assert "two rows hold fp8:hp:eager with the fp8 reduce-scatter" in capsys.readouterr().err
    assert not (tmp_path / "refused").exists()


def test_a_call_cut_short_keeps_the_runs_it_finished(tmp_path, monkeypatch):
    """The report and plot are written after each run: a call stopped in its second run (here an
    interrupt in that run's training) leaves the first run's row and curves on disk."""
    trained = []
    train = reduce_scatter_fidelity.train

    def train_then_stop(spec, *args, **kwargs):
        if trained and spec.name != trained[-1]:
            raise KeyboardInterrupt
        trained.append(spec.name)
        return train(spec, *args, **kwargs)

    monkeypatch.setattr(reduce_scatter_fidelity, "train", train_then_stop)
    with pytest.raises(KeyboardInterrupt):
        main([*TINY, "--steps", "2", "--runs", "bf16:eager,fp8:hp:eager", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "reduce_scatter_fidelity.json").read_text())["rows"]
    assert [(row["run"], len(row["fp8_losses"])) for row in rows] == [("bf16:eager", 2)]
    assert "| bf16:eager |" in (tmp_path / "reduce_scatter_fidelity.md").read_text()
    assert (tmp_path / "reduce_scatter_fidelity.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize("stop", [KeyboardInterrupt, RuntimeError])
def test_a_run_stopped_in_its_second_reduction_keeps_the_first(tmp_path, monkeypatch, stop):
    """The report is written after each reduction too: a call stopped in a run's second reduction
    (an interrupt: the device call's deadline) or one whose second reduction fails (an error row)
    leaves the first reduction's curve on disk, which a later call completes with --include."""
    calls = []
    train = reduce_scatter_fidelity.train

    def train_then_stop(*args, **kwargs):
        calls.append(args[0].name)
        if len(calls) == 2:
            raise stop("stopped in the fp8 reduce-scatter")
        return train(*args, **kwargs)

    common = [*TINY, "--steps", "2", "--runs", "fp8:hp:eager"]
    monkeypatch.setattr(reduce_scatter_fidelity, "train", train_then_stop)
    if stop is KeyboardInterrupt:
        with pytest.raises(KeyboardInterrupt):
            main([*common, "--out", str(tmp_path / "first")])
    else:
        assert main([*common, "--out", str(tmp_path / "first")]) == 1
    first = tmp_path / "first" / "reduce_scatter_fidelity.json"
    (row,) = json.loads(first.read_text())["rows"]
    assert (row["run"], len(row["bf16_losses"]), row["fp8_losses"]) == ("fp8:hp:eager", 2, [])
    assert row["error"] == ("" if stop is KeyboardInterrupt else "RuntimeError: stopped in the fp8 reduce-scatter")
    assert (tmp_path / "first" / "reduce_scatter_fidelity.png").read_bytes().startswith(b"\x89PNG")
    monkeypatch.setattr(reduce_scatter_fidelity, "train", train)
    command = [*common, "--reductions", "fp8", "--include", str(first), "--out", str(tmp_path / "second")]
    assert main(command) == 0
    (joined,) = json.loads((tmp_path / "second" / "reduce_scatter_fidelity.json").read_text())["rows"]
    assert joined["bf16_losses"] == row["bf16_losses"]
    assert len(joined["fp8_losses"]) == 2
    assert not joined["error"]
    assert joined["fp8_vs_bf16"] == joined["fp8_final_loss"] / joined["bf16_final_loss"] - 1


@pytest.mark.parametrize(
    ("deadline_s", "begins", "ends"),
    [
        ("1", "DeadlineError: not started: --deadline-s has passed", "has passed"),
        (
            "5",
            "DeadlineError: stopped after step 2: its 18 steps left at 1000 ms would end ",
            " s past --deadline-s; train it in a call of its own",
        ),
    ],
)
def test_a_reduction_that_would_end_past_the_deadline_stops_or_does_not_start(
    tmp_path, monkeypatch, deadline_s, begins, ends
):
    """--deadline-s, on a clock that advances one second each time the script reads it: the first
    reduction finds the deadline passed before it starts, or at its first tenth (2 of 20 steps)
    projects the rest past it and stops; its row says which, with no curve, and the call fails."""
    ticks = itertools.count()
    monkeypatch.setattr(reduce_scatter_fidelity, "time", types.SimpleNamespace(perf_counter=lambda: next(ticks)))
    command = [*TINY, "--steps", "20", "--runs", "bf16:eager", "--deadline-s", deadline_s, "--out", str(tmp_path)]
    assert main(command) == 1
    (row,) = json.loads((tmp_path / "reduce_scatter_fidelity.json").read_text())["rows"]
    assert row["error"].startswith(begins), row["error"]
    assert row["error"].endswith(ends), row["error"]
    assert (row["bf16_losses"], row["fp8_losses"]) == ([], [])


def test_a_deadline_the_reductions_end_before_changes_nothing(tmp_path):
    common = [*TINY, "--steps", "3", "--runs", "fp8:hp:eager"]
    assert main([*common, "--out", str(tmp_path / "free")]) == 0
    assert main([*common, "--deadline-s", "600", "--out", str(tmp_path / "deadline")]) == 0
    (free,) = json.loads((tmp_path / "free" / "reduce_scatter_fidelity.json").read_text())["rows"]
    (deadline,) = json.loads((tmp_path / "deadline" / "reduce_scatter_fidelity.json").read_text())["rows"]
    assert not deadline["error"]
    assert (deadline["bf16_losses"], deadline["fp8_losses"]) == (free["bf16_losses"], free["fp8_losses"])


def _dequantized_chunk(x: torch.Tensor) -> torch.Tensor:
    """One rank's chunk (whole 128-element blocks) through quant-core's reference blockwise FP8 (E4M3, 1 x 128)."""
    quantized = quant_core.quantize_fp8_blockwise_reference(x.float().reshape(-1, 128), (1, 128), torch.float8_e4m3fn)
    return quant_core.dequantize_fp8_blockwise_reference(quantized.rowwise_data, quantized.rowwise_scale_inv).reshape(
        -1
    )


def test_one_steps_reduced_gradients_equal_each_ranks_gradient_reduced_by_hand():
    ranks = 2
    options = E2EOptions(config="tiny", device="cpu", model_source="builtin")
    model, _, _ = build_run(select_runs("fp8-block:hp:eager")[0], options, torch.device("cpu"), "builtin")
    tokens = fidelity_task(options.decoder).batches(range(1), ranks, options.decoder.sequence_length)[0]
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    parameters = list(model.parameters())
    offsets = gradient_offsets(parameters, ranks)
    assert offsets == [0, *itertools.accumulate(padded_numel(p.numel(), ranks) for p in parameters)]
    buffer = torch.full((ranks, offsets[-1]), 7.0, dtype=torch.bfloat16)
    for start, p in zip(offsets, parameters, strict=False):  # the padding starts zero, as in train()
        buffer[:, start + p.numel() : start + padded_numel(p.numel(), ranks)] = 0
    loss = rank_gradients(model, inputs, targets, ranks, buffer)
    assert all(p.grad is None for p in parameters)
    # The whole rows reduced at once, as train() does; each parameter's region checked below
    # against its own chunks reduced by hand.
    reduced_fp8 = reduce_fp8(buffer, quant_fsdp.QuantizedReduceScatter())
    reduced_bf16 = reduce_bf16(buffer)

    # Rank r's gradient, computed on its own sequence (one per rank).
    losses, grads = [], []
    for rank in range(ranks):
        logits = model(inputs[rank : rank + 1])
        rank_loss = F.cross_entropy(logits.flatten(0, 1).float(), targets[rank : rank + 1].flatten())
        losses.append(rank_loss.detach())
        grads.append(torch.autograd.grad(rank_loss, parameters))
    assert torch.equal(loss, torch.stack(losses).mean())
    for k, p in enumerate(parameters):
        region = slice(offsets[k], offsets[k] + p.numel())
        flats = [F.pad(g[k].reshape(-1), (0, padded_numel(p.numel(), ranks) - p.numel())) for g in grads]
        assert all(torch.equal(buffer[rank, region], flats[rank][: p.numel()]) for rank in range(ranks)), k
        chunks = [flat.chunk(ranks) for flat in flats]
        # FP8: rank j's shard is the sum over ranks, in order, of their chunk j quantized alone, / ranks.
        shards = []
        for j in range(ranks):
            total = _dequantized_chunk(chunks[0][j])
            for rank in range(1, ranks):
                total = total + _dequantized_chunk(chunks[rank][j])
            shards.append((total / ranks).bfloat16())
        want = torch.cat(shards)[: p.numel()]
        assert torch.equal(reduced_fp8[region], want), k
        # bf16: the ranks' gradients summed in bf16, then halved in bf16.
        assert torch.equal(reduced_bf16[region], (flats[0] + flats[1])[: p.numel()] / ranks), k
        assert not torch.equal(want, (flats[0] + flats[1])[: p.numel()] / ranks), k  # FP8 rounds


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--runs", "fp8:qw:eager"], "fp8:qw:eager: the simulation trains eager or compiled runs with high-precision"),
        (["--runs", "bf16:graphed"], "bf16:graphed: the simulation trains eager or compiled runs"),
        (["--runs", "fp9"], "'fp9' matches no run"),
        (["--runs", ""], "--runs '' trains nothing: pass the reports to join with --include FILE"),
        (["--ranks", "0"], "--ranks: must be >= 1"),
        (["--reductions", "fp16"], "--reductions: 'fp16': name bf16, fp8 or both, once each"),
        (["--reductions", "fp8,fp8"], "--reductions: 'fp8,fp8': name bf16, fp8 or both"),
        (["--deadline-s", "0"], "--deadline-s: must be > 0 seconds, got 0"),
    ],
)
def test_bad_arguments_exit_2_with_one_line_naming_them(arguments, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([*TINY, *arguments])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
