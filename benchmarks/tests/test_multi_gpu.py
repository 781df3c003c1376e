"""benchmarks/multi_gpu.py on the CPU: its driver over gloo (world size 2, tiny model), its report
rows, and the exposed-communication arithmetic of --profile.

The driver trains four runs once each, each launch its own torchrun (~18 s a launch on 2 cores,
most of it the three processes' imports): bf16, FP8 with quantized weights eager and compiled,
and MXFP8 quantized on gather (the other weight mode and the format whose gathers differ between
forward and backward, in one launch); how it orders repeats and folds them into rows is checked
with launches stubbed out (test_repeats_launch_round_robin_into_median_rows). The compiled run
uses the `aot_eager` backend: Dynamo and AOTAutograd trace as for Inductor and the same kernels
run, so it trains bit for bit like its eager twin (as test_fsdp2_compile.py checks in one
process), without Inductor's ~20 s per compile.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import subprocess
import sys

import _multi_gpu_measure as measure
import _multi_gpu_report as report_rows
import _multi_gpu_runs as runs
import multi_gpu
import pytest
import scaling_model
import torch
import torch.nn.functional as F

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1]
RUNS = ("bf16:eager", "fp8:qw:eager", "mxfp8:hp:eager", "fp8:qw:compiled")
REPEATS = 1
# 8 layers instead of the tiny model's 2, so that the decoder layers' quantized gathers outweigh
# the root's (the embedding and lm_head gather in bf16 in every run), as in the 2.2B Llama.
ARGS = [
    "--drive", "--device", "cpu", "--nproc-per-node", "2", "--model", "tiny", "--num-layers", "8",
    "--model-source", "builtin", "--compile-backend", "aot_eager", "--runs", ",".join(RUNS),
    "--repeats", str(REPEATS), "--warmup", "1", "--steps", "1",
]  # fmt: skip


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("multi_gpu")
    command = [sys.executable, str(BENCHMARKS / "multi_gpu.py"), *ARGS, "--out", str(out), "--profile"]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    assert completed.returncode == 0, completed.stdout[-4000:] + completed.stderr[-4000:]
    result = json.loads((out / "multi_gpu.json").read_text())
    result["markdown"] = (out / "multi_gpu.md").read_text()
    result["stdout"] = completed.stdout
    result["out"] = out
    return result


def reference_losses(options: runs.Options, world_size: int) -> list[float]:
    """The loss of each step of the warm-up, counted and timed steps of a launch, trained another
    way: the same model (seed, fp32) in this process without FSDP, on the whole global batch of
    each step (the ranks' slices together), in fp32, with torch's AdamW at the launch's lr."""
    config = dataclasses.replace(options.config, batch_size=options.config.batch_size * world_size)
    num_steps = options.num_warmup + 1 + options.num_steps
    batches = runs.rank_batches(config, num_steps, rank=0, world_size=1)
    torch.manual_seed(runs.SEED)
    model = runs.build_model(config, torch.device("cpu"), options.model_source)
    optimizer = torch.optim.AdamW(model.parameters(), lr=options.learning_rate, weight_decay=0.0)
    losses = []
    for tokens in batches:
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def rows_by_run(report: dict) -> dict[str, dict]:
    return {row["run"]: row for row in report["rows"]}


def test_every_run_trains_on_every_repeat(report):
    rows = rows_by_run(report)
    assert list(rows) == list(RUNS)
    for run, row in rows.items():
        assert row["error"] == "", run
        assert row["exit_codes"] == [0] * REPEATS, run
        assert row["repeats"] == REPEATS
        assert row["tokens_per_s_per_gpu"] > 0
        assert row["tokens_per_s_min"] <= row["tokens_per_s_per_gpu"] <= row["tokens_per_s_max"]


def test_each_run_reports_the_loss_of_its_last_timed_step(report):
    """Each row's loss against the same step trained in fp32 in this process (reference_losses).
    Measured (2-core AMD EPYC, AVX2, 2026-12-06): the bf16 row 1.5e-4 nats from it (bf16
    parameters and activations), the MXFP8 row 7.6e-4 and the FP8 rows 3.1e-3 (their rounding
    besides), while a step of training moves the loss by 0.02 nats here (5.608, 5.555, 5.536), and
    a loss summed instead of averaged over the ranks is twice it. The bounds, 5e-4 nats for bf16
    and 4e-3 for the recipes, leave 3.5e-4 and 9e-4 for another CPU's rounding (which moves
    these losses by far less than bf16's rounding does). A row that reports another step's loss
    (0.02 away), an untrained model's (0.03) or the sum over the ranks fails, as does an FP8 GEMM
    that scales the weights by 1.25 (4.6e-3)."""
    options = multi_gpu.options_from(multi_gpu.parse_args(ARGS))
    expected = reference_losses(options, world_size=2)[-1]
    for run, row in rows_by_run(report).items():
        bound = 5e-4 if run.startswith("bf16") else 4e-3
        assert abs(row["loss"] - expected) <= bound, (run, row["loss"], expected)


def test_compiled_run_trains_like_eager_without_breaks_or_recompiles(report):
    rows = rows_by_run(report)
    compiled, eager = rows["fp8:qw:compiled"], rows["fp8:qw:eager"]
    assert compiled["loss"] == eager["loss"]
    assert compiled["dynamo"]["frames_compiled_total"] > 0
    assert eager["dynamo"]["frames_compiled_total"] == 0
    assert compiled["dynamo"]["graph_breaks_total"] == 0
    assert compiled["dynamo"]["recompiles_after_warmup"] == 0
    assert compiled["all_gather_bytes"] == eager["all_gather_bytes"]


def test_repeats_launch_round_robin_into_median_rows(tmp_path, monkeypatch):
    """Three repeats of two runs alternate a, b, a, b, a, b; each row takes the median of its
    repeats; a torchao run that cannot import is a row with the reason, never launched."""
    launched = []

    def launch(run, repeat, args, out, nproc):
        launched.append((run, repeat))
        # Repeat i runs at 2**i times the run's speed: the median (2x) is not the mean (7/3 x).
        result = {**_result(100.0 * 2**repeat * (1 + len(run)), 2**30), "device": "cpu"}
        return {
            "run": run,
            "repeat": repeat,
            "launched": True,
            "exit_code": 0,
            "seconds": 0,
            "error": "",
            "result": result,
        }

    monkeypatch.setattr(multi_gpu, "launch", launch)
    monkeypatch.setattr(multi_gpu, "_torchao_missing", lambda: "skipped: torchao.float8 does not import (stubbed)")
    runs = ("bf16:eager", "torchao-tensorwise:compiled", "fp8:qw:eager")
    args = multi_gpu.parse_args(
        ["--drive", "--device", "cpu", "--model", "tiny", "--model-source", "builtin", "--runs", ",".join(runs),
         "--repeats", "3", "--out", str(tmp_path)]
    )  # fmt: skip
    assert multi_gpu.drive(args) == 0
    assert launched == [(run, i) for i in range(3) for run in ("bf16:eager", "fp8:qw:eager")]
    written = json.loads((tmp_path / "multi_gpu.json").read_text())
    assert written["launch_order"] == ["bf16:eager", "fp8:qw:eager"] * 3
    rows = rows_by_run(written)
    assert list(rows) == list(runs)
    for run in ("bf16:eager", "fp8:qw:eager"):
        speed = 100.0 * (1 + len(run))
        row = rows[run]
        assert row["repeats"] == 3
        speeds = [row["tokens_per_s_min"], row["tokens_per_s_per_gpu"], row["tokens_per_s_max"]]
        assert speeds == [speed, 2 * speed, 4 * speed]
    torchao = rows["torchao-tensorwise:compiled"]
    assert torchao["error"] == "skipped: torchao.float8 does not import (stubbed)"
    assert torchao["repeats"] == 0
    assert torchao["tokens_per_s_per_gpu"] is None


def test_gathers_and_reductions_move_the_bytes_the_scaling_model_counts(report):
    """Each row's all-gather and reduce-scatter bytes (FSDP2's collectives, counted on rank 0) are
    scaling_model.step_bytes of its weights, byte for byte: what scaling_model.py counts for the
    2.2B Llama is what these gathers move (MXFP8 rowwise in the forward, columnwise in the
    backward; the other formats rowwise; gradients in fp32 whatever the weights)."""
    config = multi_gpu.options_from(multi_gpu.parse_args(ARGS)).config
    for run, row in rows_by_run(report).items():
        counted = scaling_model.step_bytes(config, runs.parse_run(run).base, world_size=2)
        assert {"all_gather": row["all_gather_bytes"], "reduce_scatter": row["reduce_scatter_bytes"]} == counted, run


def test_memory_breakdown(report):
    rows = rows_by_run(report)
    for run, row in rows.items():
        memory = row["memory_gib"]
        assert set(memory) == {"parameters", "gradients", "optimizer_states", "activations_other"}, run
        assert all(value >= 0 for value in memory.values()), (run, memory)
        assert row["peak_memory_gib"] >= sum(memory.values()) - 1e-9
    bf16, quantized, high_precision = rows["bf16:eager"], rows["fp8:qw:eager"], rows["mxfp8:hp:eager"]
    # fp8 primary weights hold a byte per element where fp32 ones hold four; FusedAdam adds fp32
    # masters for them; quantize-on-gather keeps fp32 shards and AdamW's two moments, as bf16 does.
    assert quantized["memory_gib"]["parameters"] < 0.7 * bf16["memory_gib"]["parameters"]
    assert quantized["memory_gib"]["optimizer_states"] > 1.3 * bf16["memory_gib"]["optimizer_states"]
    for key in ("parameters", "gradients", "optimizer_states"):
        assert high_precision["memory_gib"][key] == pytest.approx(bf16["memory_gib"][key], rel=1e-3), key
    # fp32 parameters and gradients, AdamW's two fp32 moments (and a step count per tensor).
    assert bf16["bytes_per_parameter"]["parameters"] == bf16["bytes_per_parameter"]["gradients"] == 4.0
    assert bf16["bytes_per_parameter"]["optimizer_states"] == pytest.approx(8.0, rel=1e-3)


def test_reports_hold_every_run(report):
    table_lines = [line for line in report["markdown"].splitlines() if line.startswith("| ")]
    assert [line.split(" | ")[0].removeprefix("| ") for line in table_lines[2:]] == list(RUNS)
    assert report["stdout"].rstrip().splitlines()[-1].startswith(f"| {RUNS[-1]} |")  # the table prints last
    assert report["world_size"] == 2
    assert report["backend"] == "gloo"


def test_profiles_split_host_time_by_kind(report):
    # On the CPU there are no kernels (no GPU compute, no exposed communication), but the host spans
    # of FSDP2's hooks and the optimizer step are in every run's trace.
    for row in report["rows"]:
        assert row["gpu_compute_ms"] is None, row["run"]
        assert row["gpu_ms_by_group"] == {}, row["run"]
        assert row["gpu_idle_ms_by_span"] == {}, row["run"]
        gaps = (report["out"] / "traces" / f"{row['run'].replace(':', '_')}.rank0.gaps.tsv").read_text()
        assert gaps.splitlines() == ["at_us\tidle_us\tsynced\tbefore\tbefore_span\tafter\tafter_span"], row["run"]
        assert row["host_ms"]["fsdp_hooks"] > 0, row["run"]
        assert row["host_ms"]["optimizer"] > 0, row["run"]
        python = (report["out"] / "traces" / f"{row['run'].replace(':', '_')}.rank0.python.txt").read_text()
        for text in ("by tottime", "by cumulative", "_fsdp_param_group.py"):  # FSDP2 ran in its steps
            assert text in python, (row["run"], text)


def test_a_run_that_raises_becomes_a_row_with_its_error(tmp_path):
    # AdamW refuses a negative learning rate on every rank, after the model is built and sharded.
    command = [
        sys.executable, str(BENCHMARKS / "multi_gpu.py"), "--drive", "--device", "cpu", "--nproc-per-node", "2",
        "--model", "tiny", "--model-source", "builtin", "--runs", "bf16:eager", "--repeats", "1", "--lr", "-1",
        "--out", str(tmp_path),
    ]  # fmt: skip
    completed = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert completed.returncode == 1, completed.stdout[-4000:] + completed.stderr[-4000:]
    (row,) = json.loads((tmp_path / "multi_gpu.json").read_text())["rows"]
    assert row["error"] == "ValueError: Invalid learning rate: -1.0"
    assert row["exit_codes"] == [1]
    assert row["tokens_per_s_per_gpu"] is None
    assert "Invalid learning rate" in completed.stdout.splitlines()[-2]  # the table's row, then the failed runs


@pytest.mark.parametrize(
    ("communication", "compute", "exposed"),
    [
        ([(0, 10), (20, 30)], [(5, 25)], 10),  # each half hidden
        ([(0, 10), (5, 15)], [(12, 20)], 12),  # overlapping communication counts once
        ([(0, 10)], [(2, 4), (3, 6), (8, 9)], 5),  # overlapping compute covers once: 0-2, 6-8, 9-10
        ([(0, 10)], [], 10),
        ([], [(0, 10)], 0),
        ([(0, 10)], [(-5, 20)], 0),  # compute covers it all
        ([(0, 4), (6, 10)], [(3, 7)], 6),  # one compute interval spans two communication intervals
        ([(0, 10)], [(10, 20), (-5, 0)], 10),  # touching is not overlapping
    ],
)
def test_exposed_time(communication, compute, exposed):
    assert measure.exposed_time(communication, compute) == exposed


def test_kernel_intervals_split_nccl_from_compute():
    events = [
        {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllGather_RING_LL(...)", "ts": 100.0, "dur": 50.0},
        {"ph": "X", "cat": "kernel", "name": "sm90_xmma_gemm_bf16", "ts": 120.0, "dur": 10.0},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD", "ts": 0.0, "dur": 500.0},
        {"ph": "X", "cat": "cpu_op", "name": "nccl:all_gather", "ts": 90.0, "dur": 5.0},
        {"ph": "i", "cat": "kernel", "name": "nccl marker", "ts": 1.0},
    ]
    communication, compute = measure.kernel_intervals(events)
    assert communication == [(100.0, 150.0)]
    assert compute == [(120.0, 130.0)]
    assert measure.exposed_time(communication, compute) == 40.0


def test_host_time_by_kind_unites_nested_and_repeated_spans():
    events = [
        {"ph": "X", "cat": "user_annotation", "name": "FSDP::pre_forward (layers.0)", "ts": 0.0, "dur": 10.0},
        {"ph": "X", "cat": "user_annotation", "name": "FSDP::pre_backward (layers.0)", "ts": 5.0, "dur": 10.0},
        {"ph": "X", "cat": "user_annotation", "name": "FSDP::all_gather (layers.0)", "ts": 1.0, "dur": 2.0},
        {"ph": "X", "cat": "cpu_op", "name": "## Call CompiledFxGraph abc ##", "ts": 20.0, "dur": 4.0},
        {"ph": "X", "cat": "cpu_op", "name": "## Call CompiledFxGraph def ##", "ts": 30.0, "dur": 6.0},
        {"ph": "X", "cat": "user_annotation", "name": "Optimizer.step#FusedAdam.step", "ts": 40.0, "dur": 3.0},
        {"ph": "X", "cat": "gpu_user_annotation", "name": "Optimizer.step#FusedAdam.step", "ts": 40.0, "dur": 9.0},
        {"ph": "X", "cat": "kernel", "name": "FSDP::pre_forward", "ts": 0.0, "dur": 99.0},
    ]
    assert measure.host_time_by_kind(events) == {"fsdp_hooks": 15.0, "compiled_graphs": 10.0, "optimizer": 3.0}


def test_gpu_time_by_group_follows_the_launching_span_then_the_kernel_name():
    def launch(correlation, ts):
        return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 1.0,
                "args": {"correlation": correlation}}  # fmt: skip

    def gpu(correlation, name, ts, dur, cat="kernel"):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"correlation": correlation}}

    def span(name, ts, dur):
        return {"ph": "X", "cat": "user_annotation", "name": name, "ts": ts, "dur": dur}

    events = [
        span("FSDP::pre_backward (layers.1)", 0.0, 10.0),
        span("FSDP::post_backward_reduce (layers.1)", 20.0, 10.0),
        span("FSDP::post_backward_accumulate (layers.1)", 22.0, 1.0),  # nested in the reduce span
        span("Optimizer.step#FusedAdam.step", 40.0, 10.0),
        launch(1, 1.0), gpu(1, "void at::native::vectorized_elementwise_kernel<8>", 100.0, 4.0),
        launch(2, 2.0), gpu(2, "Memcpy DtoD (Device -> Device)", 104.0, 6.0, "gpu_memcpy"),
        launch(3, 12.0), gpu(3, "nvjet_sm90_tst_64x24", 110.0, 20.0),  # outside every span: by name
        launch(4, 13.0), gpu(4, "triton_red_fused_abs_amax_mul_0", 130.0, 5.0),
        launch(5, 14.0), gpu(5, "_cast_kernel", 135.0, 3.0),
        launch(6, 22.5), gpu(6, "void at::native::detail::chunk_cat_cuda_kernel", 140.0, 8.0),
        launch(7, 45.0), gpu(7, "_adam_kernel", 150.0, 30.0),
        launch(8, 46.0), gpu(8, "Memset (Device)", 200.0, 10.0, "gpu_memset"),
        launch(9, 15.0), gpu(9, "void at::native::reduce_kernel", 205.0, 2.0),  # beside the memset
        gpu(10, "cudnn_generated_fort_native_sdpa_sm90_flash_fprop", 120.0, 5.0),  # launch not traced
    ]  # fmt: skip
    assert measure.gpu_time_by_group(events) == {
        "GEMMs and attention": 25.0,
        "optimizer": 40.0,
        "FSDP2 gradients": 8.0,
        "FSDP2 gathers": 10.0,
        "Inductor": 5.0,
        "quantize": 3.0,
        "other": 2.0,
        "copies only": 6.0 + 8.0,  # the memcpy, and the memset but the 2 us beside the reduce
        "idle": 2.0 + 2.0 + 20.0,  # 138-140, 148-150, 180-200
    }
    assert measure.gpu_time_by_group([span("FSDP::pre_forward", 0.0, 1.0)]) == {}  # a CPU trace


def test_gpu_idle_goes_to_the_innermost_spans_launching_the_work_around_each_gap():
    def launch(correlation, ts):
        return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 1.0,
                "args": {"correlation": correlation}}  # fmt: skip

    def gpu(correlation, ts, dur, cat="kernel"):
        return {"ph": "X", "cat": cat, "name": "k", "ts": ts, "dur": dur, "args": {"correlation": correlation}}

    def span(name, ts, dur, cat="user_annotation"):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}

    graph, hook = "## Call CompiledFxGraph", "FSDP::pre_forward"
    events = [
        span("FSDP::pre_forward (layers.0)", 0.0, 10.0),
        span("FSDP::all_gather (layers.0)", 1.0, 2.0),  # not a span of its own: its hook's
        span("## Call CompiledFxGraph abc ##", 5.0, 4.0, "cpu_op"),  # nested in the pre-forward span
        span("FSDP::post_backward_reduce (layers.0)", 20.0, 10.0),
        span("Optimizer.step#FusedAdam.step", 40.0, 10.0),
        launch(1, 1.5), gpu(1, 100.0, 20.0),  # ends last of the first three
        launch(2, 2.0), gpu(2, 105.0, 10.0, "gpu_memcpy"),  # inside the first: no gap
        launch(3, 6.0), gpu(3, 110.0, 2.0),  # inside the first: no gap
        launch(4, 8.0), gpu(4, 121.0, 1.0),  # gap 120-121: hook -> graph
        launch(5, 21.0), gpu(5, 130.0, 5.0, "gpu_memset"),  # gap 122-130: graph -> post-backward
        launch(6, 35.0), gpu(6, 140.0, 5.0),  # gap 135-140: post-backward -> no span
        launch(7, 41.0), gpu(7, 145.0, 5.0),  # right after: no gap
        launch(8, 7.0), gpu(8, 152.0, 1.0),  # gap 150-152: optimizer -> graph
        launch(9, 8.5), gpu(9, 153.5, 1.0),  # gap 153-153.5: graph -> graph
        gpu(10, 160.0, 1.0),  # gap 154.5-160, its launch not traced
    ]  # fmt: skip
    gaps = measure.idle_gaps(events)
    idle = measure.gpu_idle_by_launching_span(gaps)
    assert [(g.start, g.length) for g in gaps] == [
        (120.0, 1.0),
        (122.0, 8.0),
        (135.0, 5.0),
        (150.0, 2.0),
        (153.0, 0.5),
        (154.5, 5.5),
    ]
    assert gaps[1] == measure.IdleGap(122.0, 8.0, "k", graph, "k", "FSDP::post_backward", synced=False)
    assert idle == {
        f"{hook} -> {graph}": 1.0,
        f"{graph} -> FSDP::post_backward": 8.0,
        "FSDP::post_backward -> elsewhere": 5.0,
        f"Optimizer.step# -> {graph}": 2.0,
        f"{graph} -> {graph}": 0.5,
        f"{graph} -> not traced": 5.5,
    }
    assert sum(idle.values()) == measure.gpu_time_by_group(events)["idle"]
    assert measure.idle_gaps([span("FSDP::pre_forward", 0.0, 1.0)]) == []  # a CPU trace

    # The host waits for the GPU between two launches: in a synchronize call, or in a copy from
    # pageable memory; a pinned copy waits for nothing.
    def copy(correlation, ts, memory):
        return {"ph": "X", "cat": "gpu_memcpy", "name": f"Memcpy HtoD ({memory} -> Device)", "ts": ts, "dur": 1.0,
                "args": {"correlation": correlation}}  # fmt: skip

    waited = {**launch(2, 2.0), "name": "cudaStreamSynchronize", "dur": 100.0}
    synced = [
        launch(1, 1.0), gpu(1, 100.0, 10.0), waited,
        launch(3, 103.0), gpu(3, 112.0, 1.0),  # gap 110-112: after the sync
        launch(4, 104.0), copy(4, 113.0, "Pinned"),
        launch(5, 105.0), gpu(5, 120.0, 1.0),  # gap 114-120: nothing waited between launches 4 and 5
        launch(6, 106.0), copy(6, 122.0, "Pageable"),  # gap 121-122: the copy waits at its launch
        launch(7, 124.0), gpu(7, 130.0, 1.0),  # gap 123-130: after the pageable copy
    ]  # fmt: skip
    assert measure.gpu_idle_by_launching_span(measure.idle_gaps(synced)) == {
        "elsewhere -> elsewhere, synced": 2.0 + 1.0 + 7.0,
        "elsewhere -> elsewhere": 6.0,
    }


def _result(tokens: float, peak: int) -> dict:
    collectives = {"all_gather": {"output_bytes": 8}, "reduce_scatter": {"input_bytes": 16}}
    memory = {"peak": peak, "parameters": 1, "gradients": 2, "optimizer_states": 3, "activations_other": peak - 6}
    dynamo = {
        "graph_breaks_total": 0,
        "graph_breaks_after_warmup": 0,
        "recompiles_total": 1,
        "recompiles_after_warmup": 0,
    }
    speed = {"tokens_per_s_per_gpu": tokens, "step_ms": 1e3 / tokens}
    profile = {
        "gpu_compute_ms": 1e3 / tokens / 2,
        "host_ms": {"fsdp_hooks": tokens / 100, "optimizer": 1.0},
        "gpu_ms_by_group": {"optimizer": tokens / 10, "idle": 1.0},
        "gpu_idle_ms_by_span": {"a -> b": tokens / 100, **({"c -> d": 3.0} if tokens > 250 else {})},
    }
    return {
        "error": "",
        **speed,
        **profile,
        "loss": 2.0,
        "memory": memory,
        "local_parameters": 2,
        "collectives": collectives,
        "dynamo": dynamo,
    }


def test_rows_take_medians_spreads_peaks_and_errors():
    launches = [
        {"exit_code": 0, "error": "", "result": _result(100.0, 10 * 2**30)},
        {"exit_code": 1, "error": "RuntimeError: out of memory", "result": None},
        {"exit_code": 0, "error": "", "result": _result(300.0, 12 * 2**30)},
        {"exit_code": 0, "error": "", "result": _result(200.0, 11 * 2**30)},
    ]
    row = report_rows.build_row("fp8:qw:compiled", launches)
    assert (row.tokens_per_s_per_gpu, row.tokens_per_s_min, row.tokens_per_s_max) == (200.0, 100.0, 300.0)
    assert row.peak_memory_gib == 12
    assert row.memory_gib["activations_other"] == pytest.approx(12 - 6 / 2**30)
    assert row.bytes_per_parameter == {"parameters": 0.5, "gradients": 1.0, "optimizer_states": 1.5}
    assert row.repeats == 3
    assert row.gpu_compute_ms == 1e3 / 200 / 2
    assert row.host_ms == {"fsdp_hooks": 2.0, "optimizer": 1.0}
    assert row.gpu_ms_by_group == {"optimizer": 20.0, "idle": 1.0}
    assert row.gpu_idle_ms_by_span == {"a -> b": 2.0, "c -> d": 0.0}  # 0 where absent
    assert row.exit_codes == [0, 1, 0, 0]
    assert row.error == "1/4 repeats failed: RuntimeError: out of memory"
    failed = report_rows.build_row("nvfp4:hp:eager", [launches[1]])
    assert failed.tokens_per_s_per_gpu is None
    assert failed.error == "RuntimeError: out of memory"
    bf16 = report_rows.build_row("bf16:compiled", [{"exit_code": 0, "error": "", "result": _result(100.0, 1)}])
    slow, fast = (
        report_rows.build_row(name, [{"exit_code": 0, "error": "", "result": _result(speed, 1)}])
        for name, speed in (("torchao-rowwise:compiled", 50.0), ("torchao-tensorwise:compiled", 80.0))
    )
    rows = report_rows.with_ratios([row, bf16, slow, fast, failed])
    assert rows[0].vs_bf16_compiled == 2.0
    assert rows[0].vs_torchao == 2.5
    assert rows[0].torchao_run == "torchao-tensorwise:compiled"
    assert rows[-1].vs_torchao is None


def test_live_at_peak_replays_the_allocator_trace():
    """The allocations alive at the trace's highest point, summed by the code that made them;
    frees of blocks allocated before the recording are ignored."""

    def event(action: str, address: int, size: int, filename: str = "") -> dict:
        frames = [{"filename": "/env/site-packages/torch/nn/modules/module.py", "line": 1, "name": "_call_impl"}]
        if filename:
            frames.insert(0, {"filename": f"/env/site-packages/{filename}", "line": 7, "name": "f"})
        return {"action": action, "addr": address, "size": size, "frames": frames}

    trace = [
        event("free_requested", 99, 1000),  # allocated before the recording
        event("alloc", 1, 100, "torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py"),
        event("alloc", 2, 50, "quant_tensors/nn.py"),
        event("alloc", 3, 50, "quant_tensors/nn.py"),
        event("free_requested", 1, 100),
        event("alloc", 4, 120, "transformers/models/llama/modeling_llama.py"),
        event("free_completed", 1, 100),
        event("free_requested", 4, 120),
    ]
    live = measure.live_at_peak({"device_traces": [[], trace]}, device_index=1)
    assert live["bytes_at_peak"] == 220
    assert live["by_site"] == {
        "transformers/models/llama/modeling_llama.py:7 f": 120,
        "quant_tensors/nn.py:7 f": 100,
    }
    assert live["by_size"][0] == {"site": "transformers/models/llama/modeling_llama.py:7 f", "bytes": 120, "count": 1}
    assert live["by_size"][1] == {"site": "quant_tensors/nn.py:7 f", "bytes": 50, "count": 2}


def test_run_names_take_optimizer_states():
    spec = runs.parse_run("fp8:qw:compiled+m-fp8")
    assert (spec.base, spec.weights, spec.mode, spec.states) == ("fp8", "qw", "compiled", "m-fp8")
    assert spec.name == "fp8:qw:compiled+m-fp8"
    assert runs.parse_run("bf16:compiled+ao-adamw8bit").states == "ao-adamw8bit"
    with pytest.raises(
        ValueError, match="steps with quant_optim.FusedAdam, whose state options are m-bf16, m-fp8, master-bf16, "
    ):
        runs.parse_run("fp8:qw:eager+ao-adamw8bit")
    with pytest.raises(ValueError, match="steps with torch's AdamW"):
        runs.parse_run("fp8:hp:eager+m-fp8")
    with pytest.raises(ValueError, match="unknown run"):
        runs.parse_run("fp8:eager+m-fp8")


def test_recipe_runs_take_the_fp8_reduce_scatter():
    spec = runs.parse_run("fp8:qw-bf16:compiled+master-bf16-m-fp8+rs-fp8")
    assert (spec.states, spec.reduce_scatter) == ("master-bf16-m-fp8", "rs-fp8")
    assert spec.name == "fp8:qw-bf16:compiled+master-bf16-m-fp8+rs-fp8"
    assert runs.parse_run("fp8-block:qw:compiled+rs-fp8").states == ""
    assert runs.parse_run(runs.parse_run("fp8:hp:eager+rs-fp8").name).reduce_scatter == "rs-fp8"
    with pytest.raises(ValueError, match="for runs of our recipes"):
        runs.parse_run("bf16:compiled+rs-fp8")
    with pytest.raises(ValueError, match="at most one"):
        runs.parse_run("fp8:qw:eager+m-fp8+m-bf16")


@pytest.mark.parametrize(
    ("states", "moments"), [("", (torch.float32,) * 2), ("m-fp8", (torch.float8_e4m3fn, torch.bfloat16))]
)
def test_quantized_weight_runs_step_with_fused_adam_states(states, moments):
    spec = runs.parse_run(f"fp8:qw:eager{'+' + states if states else ''}")
    optimizer = runs.make_optimizer(spec, [torch.nn.Parameter(torch.randn(4, 4))], 1e-3, torch.device("cpu"))
    assert type(optimizer).__name__ == "FusedAdam"
    assert (optimizer.defaults["exp_avg_dtype"], optimizer.defaults["exp_avg_sq_dtype"]) == moments


def test_a_memory_cap_and_model_overrides_reach_every_rank_and_the_report():
    args = multi_gpu.parse_args(
        ["--drive", "--runs", "fp8:qw:compiled", "--num-layers", "40", "--batch-size", "6", "--memory-cap-gib", "80"]
    )
    passed = multi_gpu.worker_arguments(args)
    assert passed[passed.index("--memory-cap-gib") + 1] == "80.0"
    assert passed[passed.index("--num-layers") + 1] == "40"
    config = multi_gpu.options_from(multi_gpu.parse_args(["--train", "fp8:qw:compiled", *passed])).config
    assert (config.num_layers, config.batch_size, config.hidden_size) == (40, 6, 4096)
    header = multi_gpu.environment(args, 2, ["fp8:qw:compiled"])
    assert header["memory_cap_gib"] == 80
    assert "- Memory cap: 80 GiB per rank" in report_rows.markdown(header, [])
    assert "Memory cap" not in report_rows.markdown({**header, "memory_cap_gib": None}, [])
    for bad in (["--memory-cap-gib", "0"], ["--batch-size", "0"], ["--num-layers", "-1"]):
        with pytest.raises(SystemExit):
            multi_gpu.parse_args(["--drive", *bad])


def test_qw_bf16_rounds_the_decoder_layers_and_keeps_the_root_fp32():
    torch.manual_seed(0)
    model = runs.build_model(runs.MODELS["tiny"], torch.device("cpu"), "builtin")
    before = {name: param.detach().clone() for name, param in model.named_parameters()}
    runs.round_layers_to_bf16(model)
    in_layers = {f"layers.{name}" for name, _ in runs.decoder_layers(model).named_parameters()}
    assert 0 < len(in_layers) < len(before)  # the root holds the embedding, final norm and lm_head
    for name, param in model.named_parameters():
        assert param.dtype == (torch.bfloat16 if name in in_layers else torch.float32), name
        assert torch.equal(param, before[name].to(param.dtype)), name


def test_the_markdown_adds_the_kernel_groups_of_profiled_rows():
    runs = ["bf16:compiled", "fp8:qw:compiled"]
    header = multi_gpu.environment(multi_gpu.parse_args(["--drive", "--runs", ",".join(runs)]), 1, runs)
    plain = report_rows.Row(runs[0])
    profiled = report_rows.Row(runs[1], gpu_ms_by_group={"optimizer": 25.44, "idle": 5.26})
    text = report_rows.markdown(header, [plain, profiled])
    assert text.endswith("| run | optimizer | idle |\n| --- | ---: | ---: |\n| fp8:qw:compiled | 25.4 | 5.3 |\n")
    assert "kernel group" not in report_rows.markdown(header, [plain])
    waited = dataclasses.replace(profiled, gpu_idle_ms_by_span={"a -> b": 1.04, "c -> d": 3.96})
    other = report_rows.Row("bf16:compiled", gpu_idle_ms_by_span={f"x -> {i}": float(i) for i in range(8)})
    text = report_rows.markdown(header, [other, waited])
    largest = "".join(f"| bf16:compiled | x -> {i} | {i}.0 |\n" for i in range(7, 7 - report_rows.IDLE_ROWS, -1))
    assert text.endswith(
        "| run | before -> after | idle ms |\n| --- | --- | ---: |\n"
        + largest
        + "| fp8:qw:compiled | c -> d | 4.0 |\n| fp8:qw:compiled | a -> b | 1.0 |\n"
    )
    assert "idle ms" not in report_rows.markdown(header, [plain, profiled])
