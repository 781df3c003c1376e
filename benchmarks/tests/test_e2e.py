"""benchmarks/e2e.py on the tiny configuration, on the CPU: every run yields a row (no numbers asserted)."""

from __future__ import annotations

import io
import json
import math
from dataclasses import replace

import _e2e as bench_e2e
import e2e
import pytest
import torch
from _compile_modes import COMPILED_MODES, compile_backend
from _e2e import (
    DEFAULT_FIDELITY_RUNS,
    DEFAULT_RUNS,
    GRAPH_WARMUP_STEPS,
    OPT_IN_RECIPES,
    RECIPES,
    STATEFUL_WEIGHT_RECIPES,
    E2EOptions,
    build_run,
    environment,
    header_lines,
    markov_batches,
    recipe_of,
    run_e2e,
    select_runs,
)
from _e2e_model import CONFIGS, Decoder
from _optimizer_states import FUSED_ADAM_STATES
from e2e import main
from rich.console import Console

import quant_core
import quant_tensors as qt
from quant_core.testing import tracing_fused_kernels
from quant_lab.testing import local_bytes


def _names(patterns: str) -> list[str]:
    return [r.name for r in select_runs(patterns)]


def test_run_filters_select_by_glob_and_by_name_prefix():
    assert _names("bf16") == ["bf16:eager", "bf16:compiled", "bf16:graphed"]
    assert _names("fp8:hp") == ["fp8:hp:eager", "fp8:hp:compiled", "fp8:hp:fused", "fp8:hp:graphed"]
    assert _names("fp8:qw:*d, bf16:eager") == ["bf16:eager", "fp8:qw:compiled", "fp8:qw:fused", "fp8:qw:graphed"]
    assert _names("torchao-*:compiled") == ["torchao-tensorwise:compiled", "torchao-rowwise:compiled"]
    assert _names("fp8:hp,bf16") == [  # graphed runs last (what a capture leaves would count in later peaks)
        "bf16:eager",
        "bf16:compiled",
        "fp8:hp:eager",
        "fp8:hp:compiled",
        "fp8:hp:fused",
        "bf16:graphed",
        "fp8:hp:graphed",
    ]
    named = [r for r in RECIPES if r not in OPT_IN_RECIPES]  # what globs select
    assert _names("*:hp:eager") == [f"{r}:hp:eager" for r in named]
    assert len(_names("all")) == 3 + 2 * 3 + 2 * 4 * len(named) - 1  # less fp8-delayed:qw:graphed
    default = _names(DEFAULT_RUNS)
    assert all(n.endswith(":eager") for n in default if not n.startswith(("bf16", "torchao-tensorwise", "fp8:")))
    assert _names(DEFAULT_FIDELITY_RUNS) == ["bf16:eager", *(f"{r}:hp:eager" for r in named)]
    assert _names("nvfp4:hp:*d") == ["nvfp4:hp:compiled", "nvfp4:hp:fused", "nvfp4:hp:graphed"]  # not nvfp4-rht's
    assert _names("nvfp4-rht:hp:*d") == ["nvfp4-rht:hp:compiled", "nvfp4-rht:hp:fused", "nvfp4-rht:hp:graphed"]
    assert _names("fp8-delayed:qw") == ["fp8-delayed:qw:eager", "fp8-delayed:qw:compiled", "fp8-delayed:qw:fused"]
    assert [r for r in RECIPES if not recipe_of(r).quantizer("weight").stateless] == list(STATEFUL_WEIGHT_RECIPES)
    assert recipe_of("nvfp4-rht").quantizer("input").random_hadamard_transform


def test_an_unknown_run_is_refused_when_parsing_arguments(capsys):
    with pytest.raises(ValueError, match=r"'fp9' matches no run"):
        select_runs("bf16,fp9")
    with pytest.raises(SystemExit) as exit_info:
        main(["--runs", "fp9"])
    assert exit_info.value.code == 2
    assert "matches no run" in capsys.readouterr().err


def test_quantized_weight_runs_take_fused_adam_states_after_a_plus():
    assert _names("fp8:qw:eager+m-fp8,fp8:qw:eager,bf16:eager") == ["bf16:eager", "fp8:qw:eager", "fp8:qw:eager+m-fp8"]
    assert _names("fp8:qw+master-bf16") == [
        "fp8:qw:eager+master-bf16",
        "fp8:qw:compiled+master-bf16",
        "fp8:qw:fused+master-bf16",
        "fp8:qw:graphed+master-bf16",
    ]
    with pytest.raises(ValueError, match=r"FusedAdam's state configurations are m-bf16, m-fp8"):
        select_runs("fp8:qw:eager+m-fp4")
    with pytest.raises(ValueError, match=r"matches runs without quantized weights \(fp8:hp:eager\)"):
        select_runs("fp8:hp:eager+m-fp8")
    options = E2EOptions(config="tiny", device="cpu", model_source="builtin")
    for run, states in (
        ("fp8:qw:eager", {}),
        ("fp8:qw:eager+master-bf16-m-fp8", FUSED_ADAM_STATES["master-bf16-m-fp8"]),
    ):
        _, optimizer, step = build_run(select_runs(run)[0], options, torch.device("cpu"), "builtin")
        assert type(optimizer).__name__ == "FusedAdam", run
        group = optimizer.param_groups[0]
        assert group["master_weight_dtype"] == states.get("master_weight_dtype", torch.float32), run
        assert group["exp_avg_dtype"] == states.get("exp_avg_dtype", torch.float32), run
        batch = markov_batches(options.decoder, 1)[0]
        assert torch.isfinite(step(batch[:, :-1], batch[:, 1:])), run


def test_a_graphed_run_needs_cuda():
    options = E2EOptions(config="tiny", device="cpu", model_source="builtin")
    with pytest.raises(ValueError, match="bf16:graphed captures CUDA graphs: run it with --device cuda"):
        build_run(select_runs("bf16:graphed")[0], options, torch.device("cpu"), "builtin")


@pytest.mark.cuda
@pytest.mark.parametrize("run", ["bf16", *(f"{r}:hp" for r in RECIPES), "fp8:qw", "nvfp4:qw"])
def test_a_graphed_run_trains_like_the_eager_run_bit_for_bit(run, monkeypatch):
    """[Note: graphed runs]: eager warm-up steps, then one captured step replayed for the rest;
    losses, parameters and module buffers (delayed-scaling histories, stochastic-rounding
    counters) equal the eager run's after every replayed step."""
    options = E2EOptions(config="tiny", device="cuda", model_source="builtin")
    device = torch.device("cuda")
    batches = markov_batches(options.decoder, GRAPH_WARMUP_STEPS + 3).to(device)
    python_steps = []  # the graphed run's Python step runs for the warm-up and the capture only
    graphed = bench_e2e.cuda_graphed

    def counted(step, device):
        def counting_step(inputs, targets):
            python_steps.append(1)
            return step(inputs, targets)

        return graphed(counting_step, device)

    monkeypatch.setattr(bench_e2e, "cuda_graphed", counted)
    trained = {}
    for mode in ("eager", "graphed"):
        model, _, step = build_run(select_runs(f"{run}:{mode}")[0], options, device, "builtin")
        losses = torch.stack([step(b[:, :-1], b[:, 1:]) for b in batches])
        state = {name: local_bytes(t) for name, t in model.state_dict().items()}
        trained[mode] = (losses, state)
    assert len(python_steps) == GRAPH_WARMUP_STEPS + 1  # 5 steps trained, 2 of them replays
    (eager_losses, eager_state), (graphed_losses, graphed_state) = trained["eager"], trained["graphed"]
    assert torch.equal(graphed_losses, eager_losses), (graphed_losses, eager_losses)
    assert graphed_state.keys() == eager_state.keys()
    for name, buffers in eager_state.items():
        assert all(torch.equal(a, b) for a, b in zip(graphed_state[name], buffers, strict=True)), name


def _trained(run: str, options: E2EOptions, device: torch.device, steps: int = 2) -> tuple[torch.Tensor, dict]:
    model, _, step = build_run(select_runs(run)[0], options, device, "builtin")
    losses = torch.stack([step(b[:, :-1], b[:, 1:]) for b in markov_batches(options.decoder, steps).to(device)])
    return losses, {name: local_bytes(t) for name, t in model.state_dict().items()}


def _same_training(a: tuple[torch.Tensor, dict], b: tuple[torch.Tensor, dict]) -> bool:
    (losses_a, state_a), (losses_b, state_b) = a, b
    return (
        torch.equal(losses_a, losses_b)
        and state_a.keys() == state_b.keys()
        and all(all(map(torch.equal, state_a[k], state_b[k])) for k in state_a)
    )


def test_fused_runs_trace_the_fused_kernels_and_compiled_runs_do_not():
    """`_compile_modes.compile_backend`: a fused run's graphs hold torch ops where a compiled run's
    hold quant-core's quantize and dequantize operators ([Note: kernels Inductor fuses])."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs: list[torch.fx.Graph] = []

    def record(module: torch.fx.GraphModule, inputs: list[torch.Tensor]):  # type: ignore[no-untyped-def]
        graphs.append(module.graph)
        return make_boxed_func(module.forward)

    torch._dynamo.register_backend(aot_autograd(fw_compiler=record, bw_compiler=record), "test_e2e_recording")

    def mxfp8(x: torch.Tensor) -> torch.Tensor:
        q = quant_core.quantize_mxfp8(x * 2)
        return quant_core.dequantize_mxfp8(q.rowwise_data, q.rowwise_scale_inv)

    operators = {}
    for mode in COMPILED_MODES:
        graphs.clear()
        torch._dynamo.reset()
        torch.compile(mxfp8, backend=compile_backend("test_e2e_recording", mode))(torch.randn(8, 64))
        (graph,) = graphs
        operators[mode] = {
            str(node.args[0] if "auto_functionalized" in str(node.target) else node.target)
            for node in graph.nodes
            if node.op == "call_function"
        }
    assert {"quant_core.quantize_mxfp8.default", "quant_core.dequantize_mxfp8.default"} <= operators["compiled"]
    assert not any("quant_core" in op for op in operators["fused"])
    assert quant_core.compiled_kernels() == "quant-core"  # the choice held only while the graph was traced
    with pytest.raises(ValueError, match="mode 'eager' does not compile"):
        compile_backend("inductor", "eager")


def test_a_fused_run_trains_like_the_compiled_run_under_aot_eager():
    """aot_eager runs the traced ops one by one, so no rounding is elided and the fused kernels'
    torch ops give quant-core's kernels' bits: the runs train alike."""
    options = E2EOptions(config="tiny", device="cpu", model_source="builtin", compile_backend="aot_eager")
    device = torch.device("cpu")
    trained, traced = [], []
    for mode in ("compiled", "fused"):
        torch._dynamo.reset()
        with tracing_fused_kernels() as counts:
            trained.append(_trained(f"mxfp8:qw:{mode}", options, device))
        traced.append(counts["quantize_mxfp8"])
    assert traced[0] == 0
    assert traced[1] > 0
    assert _same_training(*trained)


@pytest.mark.cuda
@pytest.mark.parametrize("run", ["fp8:hp", "mxfp8:qw", "fp8-block:hp"])
def test_a_fused_run_trains_like_the_compiled_run_bit_for_bit_under_inductor(run, monkeypatch):
    """Inductor on CUDA with its bf16 roundings kept (`emulate_precision_casts`), so that the two
    runs' graphs differ only in the quantizes: quant-core's fused kernels (Inductor's Triton code)
    train as quant-core's own Triton kernels, bit for bit (checked on the CPU's Inductor too)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (run scripts/gpu-suite.sh on a GPU machine)")
    from torch._inductor.utils import fresh_cache

    monkeypatch.setattr(torch._inductor.config, "emulate_precision_casts", True)
    options = E2EOptions(config="tiny", device="cuda", model_source="builtin", compile_backend="inductor")
    trained, traced = [], []
    for mode in ("compiled", "fused"):
        torch._dynamo.reset()
        with fresh_cache(), tracing_fused_kernels() as counts:
            trained.append(_trained(f"{run}:{mode}", options, torch.device("cuda"), steps=3))
        traced.append(sum(counts.values()))
    assert traced[0] == 0
    assert traced[1] > 0
    assert _same_training(*trained)


@pytest.mark.parametrize("recipe", ["fp8", "mxfp8", "nvfp4"])
def test_micro_batches_with_the_weight_cache_train_like_without_it(recipe, monkeypatch):
    """Stateless recipes: quantizing each weight once per step gives the same bytes as once per micro-batch."""
    forwards, blocks = [], []
    monkeypatch.setattr(Decoder, "forward", _counting(Decoder.forward, forwards))
    monkeypatch.setattr(qt.nn, "weight_cache", _counting(qt.nn.weight_cache, blocks))
    options = E2EOptions(config="tiny", device="cpu", model_source="builtin", micro_batches=2)
    uncached = _trained(f"{recipe}:hp:eager", options, torch.device("cpu"))
    assert forwards == [(1, 64)] * 4  # two steps of two micro-batches of one sequence
    assert blocks == []
    cached = _trained(f"{recipe}:hp:eager", replace(options, weight_cache=True), torch.device("cpu"))
    assert len(blocks) == 2  # one block per step
    assert _same_training(uncached, cached)


def _counting(function, calls: list):
    """`function`, recording the shape (or the type) of its second argument, else of its first, per call."""

    def counted(*args, **kwargs):
        first = args[1] if len(args) > 1 else args[0]
        calls.append(tuple(first.shape) if isinstance(first, torch.Tensor) else type(first))
        return function(*args, **kwargs)

    return counted


def test_the_report_names_the_micro_batches_and_the_weight_cache():
    options = E2EOptions(config="tiny", device="cpu", model_source="builtin", micro_batches=2)
    lines = {
        cache: "\n".join(
            header_lines(environment(replace(options, weight_cache=cache), torch.device("cpu"), "builtin"))
        )
        for cache in (False, True)
    }
    assert "2 micro-batches per step, gradients accumulated; weights quantized every micro-batch." in lines[False]
    assert "high-precision weights quantized once per step (qt.nn.weight_cache" in lines[True]
    plain = header_lines(environment(replace(options, micro_batches=1), torch.device("cpu"), "builtin"))
    assert "micro-batch" not in "\n".join(plain)


def test_micro_batches_must_divide_the_batch(capsys):
    with pytest.raises(ValueError, match="micro-batches must divide the batch of 2 sequences"):
        E2EOptions(config="tiny", micro_batches=3)
    with pytest.raises(SystemExit) as exit_info:
        main(["--config", "tiny", "--micro-batches", "3"])
    assert exit_info.value.code == 2
    assert "micro-batches must divide" in capsys.readouterr().err


@pytest.mark.cuda
@pytest.mark.parametrize("run", ["fp8:hp", "fp8-delayed:hp", "mxfp8:hp"])
def test_a_graphed_run_with_the_weight_cache_trains_like_the_eager_run(run):
    """The cache's block lies inside the captured step: replays quantize each weight in the first
    micro-batch again, so a replayed step trains like an eager one, bit for bit."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (run scripts/gpu-suite.sh on a GPU machine)")
    options = E2EOptions(config="tiny", device="cuda", model_source="builtin", micro_batches=2, weight_cache=True)
    device = torch.device("cuda")
    steps = GRAPH_WARMUP_STEPS + 3
    assert _same_training(
        _trained(f"{run}:eager", options, device, steps), _trained(f"{run}:graphed", options, device, steps)
    )


def test_builtin_decoder_has_the_configured_parameter_count():
    config = CONFIGS["tiny"]
    assert sum(p.numel() for p in Decoder(config).parameters()) == config.num_parameters


def test_tiny_e2e_runs_record_every_run_and_failures(tmp_path, monkeypatch):
    recipe_from_name = qt.recipe_from_name

    def fail_for_fp8_block(name):
        if name == "fp8-block":
            raise RuntimeError("forced failure\nsecond line")
        return recipe_from_name(name)

    monkeypatch.setattr(qt, "recipe_from_name", fail_for_fp8_block)
    runs = select_runs("bf16:eager,fp8:hp:eager,fp8:hp:compiled,fp8:qw:eager,fp8-block:hp:eager")
    options = E2EOptions(
        config="tiny", num_steps=2, num_warmup=1, device="cpu", model_source="builtin", compile_backend="aot_eager"
    )
    output = io.StringIO()
    assert run_e2e(tmp_path, runs, options, console=Console(file=output, width=200)) == 1  # one run failed

    report = json.loads((tmp_path / "e2e.json").read_text())
    rows = {row["run"]: row for row in report["rows"]}
    assert list(rows) == ["bf16:eager", "fp8:hp:eager", "fp8:hp:compiled", "fp8:qw:eager", "fp8-block:hp:eager"]
    for name in ("bf16:eager", "fp8:hp:eager", "fp8:hp:compiled", "fp8:qw:eager"):
        row = rows[name]
        assert row["error"] == ""
        assert math.isfinite(row["tokens_per_s"])
        assert row["tokens_per_s"] > 0
        assert math.isfinite(row["loss"])
        assert math.isfinite(row["vs_bf16_eager"])
        assert len(row["step_ms_all"]) == 2
    assert rows["bf16:eager"]["vs_bf16_eager"] == 1.0
    assert rows["fp8-block:hp:eager"]["error"] == "RuntimeError: forced failure"
    assert rows["fp8-block:hp:eager"]["tokens_per_s"] is None
    assert report["model"].startswith("built-in")
    assert report["config"] == {
        "vocab_size": 256,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_layers": 2,
        "num_heads": 4,
        "sequence_length": 64,
        "batch_size": 2,
    }
    table = (tmp_path / "e2e.md").read_text()
    assert "| fp8:qw:eager |" in table
    assert "RuntimeError: forced failure |" in table
    assert "runs that failed: fp8-block:hp:eager" in output.getvalue()


def test_tiny_fidelity_compares_final_losses_with_bf16(tmp_path):
    from _e2e_fidelity import run_fidelity

    options = E2EOptions(config="tiny", device="cpu", model_source="builtin")
    runs = select_runs("bf16:eager,fp8:qw:eager")
    output = io.StringIO()
    assert run_fidelity(tmp_path, runs, options, num_steps=3, console=Console(file=output, width=200)) == 0
    report = json.loads((tmp_path / "e2e_fidelity.json").read_text())
    rows = {row["run"]: row for row in report["rows"]}
    assert list(rows) == ["bf16:eager", "fp8:qw:eager"]
    assert rows["bf16:eager"]["vs_bf16"] == 0.0
    assert len(rows["fp8:qw:eager"]["losses"]) == 3
    assert math.isfinite(rows["fp8:qw:eager"]["vs_bf16"])
    assert rows["fp8:qw:eager"]["tolerance"] == 0.005
    assert "| fp8:qw:eager |" in (tmp_path / "e2e_fidelity.md").read_text()


def test_fidelity_takes_bf16_from_a_baseline_of_the_same_training(tmp_path):
    from _e2e_fidelity import run_fidelity

    options = E2EOptions(config="tiny", device="cpu", model_source="builtin")
    console = Console(file=io.StringIO(), width=200)
    assert run_fidelity(tmp_path / "first", select_runs("bf16:eager"), options, num_steps=3, console=console) == 0
    baseline = tmp_path / "first" / "e2e_fidelity.json"
    runs = select_runs("bf16:eager,fp8:hp:eager")
    assert run_fidelity(tmp_path / "second", runs, options, num_steps=3, baseline=baseline, console=console) == 0
    first = json.loads(baseline.read_text())["rows"][0]
    report = json.loads((tmp_path / "second" / "e2e_fidelity.json").read_text())
    rows = {row["run"]: row for row in report["rows"]}
    assert list(rows) == ["bf16:eager", "fp8:hp:eager"]  # bf16 read, not trained again
    assert rows["bf16:eager"]["losses"] == first["losses"]
    assert rows["fp8:hp:eager"]["vs_bf16"] == rows["fp8:hp:eager"]["final_loss"] / first["final_loss"] - 1
    assert "e2e_fidelity.json" in report["baseline"]
    # Another number of steps is another training: refused before any run, nothing written.
    output = io.StringIO()
    code = run_fidelity(tmp_path / "third", runs, options, num_steps=4, baseline=baseline, console=Console(file=output))
    assert code == 2
    assert "trained differently (num_steps" in output.getvalue()
    assert not (tmp_path / "third").exists()


@pytest.mark.parametrize(
    ("argv_tail", "message"),
    [
        (["--baseline", "x.json"], "add --fidelity STEPS"),
        (["--fidelity", "3", "--baseline", "missing.json"], "not a readable e2e_fidelity.json"),
    ],
)
def test_bad_baseline_exits_2_with_one_line(tmp_path, capsys, argv_tail, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["--out", str(tmp_path / "out"), *argv_tail])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_step_count_below_one_exits_2_with_one_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--steps", "0"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert len(error.splitlines()) == 1, error
    assert "--steps: must be >= 1" in error


def test_fidelity_rows_compare_state_configurations_with_their_fp32_state_run():
    from _e2e_fidelity import FidelityRow, _with_gaps

    rows = _with_gaps(
        [
            FidelityRow("bf16:eager", final_loss=2.0),
            FidelityRow("fp8:qw:eager", final_loss=2.02),
            FidelityRow("fp8:qw:eager+m-fp8", final_loss=2.0402),
            FidelityRow("nvfp4:qw:eager+m-fp8", final_loss=2.1),  # no fp32-state twin in this report
        ]
    )
    assert [r.vs_fp32_states for r in rows][:2] == [None, None]
    assert rows[2].vs_fp32_states == pytest.approx(0.01)
    assert rows[2].vs_bf16 == pytest.approx(0.0201)
    assert rows[3].vs_fp32_states is None


def test_fidelity_workers_train_their_share_each_into_one_report(tmp_path):
    """Two worker processes train the runs dealt out to them; the report holds every run in the
    order asked, each loss curve that of the same run trained in this process, and the state
    configuration compared with its fp32-state run, which the other worker trained."""
    from _e2e_fidelity import run_fidelity

    options = E2EOptions(config="tiny", device="cpu", model_source="builtin")
    runs = select_runs("bf16:eager,fp8:qw:eager,fp8:qw:eager+m-bf16")
    console = Console(file=io.StringIO(), width=200)
    assert run_fidelity(tmp_path / "one", runs, options, num_steps=3, console=console) == 0
    assert run_fidelity(tmp_path / "two", runs, options, num_steps=3, workers=2, console=console) == 0
    alone, spread = (
        {row["run"]: row for row in json.loads((tmp_path / name / "e2e_fidelity.json").read_text())["rows"]}
        for name in ("one", "two")
    )
    assert list(spread) == ["bf16:eager", "fp8:qw:eager", "fp8:qw:eager+m-bf16"]
    assert {run: row["losses"] for run, row in spread.items()} == {run: row["losses"] for run, row in alone.items()}
    assert spread["fp8:qw:eager+m-bf16"]["vs_fp32_states"] == alone["fp8:qw:eager+m-bf16"]["vs_fp32_states"]
    assert "fp8:qw:eager" in (tmp_path / "two" / "fidelity-worker-1.log").read_text()


def test_workers_without_fidelity_exit_2_with_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--out", str(tmp_path / "out"), "--workers", "2"])
    assert exit_info.value.code == 2
    assert "add --fidelity STEPS" in capsys.readouterr().err


def test_each_run_measures_in_turn_and_skips_torchao_where_it_does_not_import(monkeypatch):
    monkeypatch.setattr(bench_e2e, "torchao_missing", lambda: "skipped: no torchao")
    runs = select_runs("bf16:eager,torchao-tensorwise:compiled,fp8:hp:eager")
    measured = []

    def measure(spec):
        measured.append(spec.name)
        return bench_e2e.E2ERow(spec.name, tokens_per_s=1.0)

    console = Console(file=io.StringIO(), width=200)
    rows = list(bench_e2e.each_run(runs, torch.device("cpu"), console, measure, bench_e2e.E2ERow))
    assert measured == ["bf16:eager", "fp8:hp:eager"]
    assert [(r.run, r.error) for r in rows] == [
        ("bf16:eager", ""),
        ("torchao-tensorwise:compiled", "skipped: no torchao"),
        ("fp8:hp:eager", ""),
    ]
    assert "[2/3] torchao-tensorwise:compiled ..." in console.file.getvalue()


def test_repeats_alternate_the_runs_one_process_each_into_median_rows(tmp_path, monkeypatch):
    launched = []
    speeds = {"bf16:eager": [100.0, 120.0, 110.0], "bf16:compiled": [200.0, 180.0, 240.0], "fp8:hp:compiled": [300.0]}
    options = E2EOptions(config="tiny", device="cpu", model_source="builtin", command="a child's")
    header = environment(options, torch.device("cpu"), "builtin")

    def one_process(name, argv, folder):
        launched.append((name, folder.name, argv))
        repeat = int(folder.name.rsplit(".", 1)[1])
        if name == "fp8:hp:compiled" and repeat > 1:
            return bench_e2e.E2ERow(name, error=f"RuntimeError: repeat {repeat}"), None
        speed = speeds[name][repeat - 1]
        row = bench_e2e.E2ERow(
            name, tokens_per_s=speed, peak_memory_gib=speed / 100, host_ms_per_step=speed / 10, step_ms=1e3 / speed,
            loss=speed / 1e3, vs_bf16_eager=9.0,
        )  # fmt: skip
        return row, header

    monkeypatch.setattr(bench_e2e, "_one_process", one_process)
    runs = select_runs("bf16:eager,bf16:compiled,fp8:hp:compiled")
    console = Console(file=io.StringIO(), width=200)
    code = bench_e2e.run_e2e_processes(
        tmp_path, runs, 3, lambda run, out: ["--runs", run.name, "--out", str(out)], "e2e.py --repeats 3", console
    )
    assert code == 1  # a process failed
    order = [name for name, _, _ in launched]
    assert order == ["bf16:eager", "bf16:compiled", "fp8:hp:compiled"] * 3
    assert launched[4][1:] == (
        "bf16_compiled.2",
        ["--runs", "bf16:compiled", "--out", str(tmp_path / "processes" / "bf16_compiled.2")],
    )

    report = json.loads((tmp_path / "e2e.json").read_text())
    assert (report["command"], report["repeats"], report["config_name"]) == ("e2e.py --repeats 3", 3, "tiny")
    rows = {row["run"]: row for row in report["rows"]}
    assert rows["bf16:eager"]["tokens_per_s"] == 110.0
    assert rows["bf16:eager"]["tokens_per_s_spread"] == [100.0, 120.0]
    assert rows["bf16:eager"]["peak_memory_gib"] == 1.2
    assert rows["bf16:eager"]["host_ms_per_step"] == 11.0
    assert rows["bf16:compiled"]["tokens_per_s"] == 200.0
    assert rows["bf16:compiled"]["vs_bf16_eager"] == pytest.approx(200 / 110)  # from the medians, not the children
    assert rows["bf16:compiled"]["vs_bf16_compiled"] == 1.0
    assert rows["fp8:hp:compiled"]["tokens_per_s"] == 300.0
    assert rows["fp8:hp:compiled"]["vs_bf16_compiled"] == 1.5
    assert rows["fp8:hp:compiled"]["error"] == "2/3 processes failed: RuntimeError: repeat 2"
    table = (tmp_path / "e2e.md").read_text()
    assert "| bf16:eager | 0.1k (0.1-0.1k) | 1.00x | 0.55x |" in table
    assert "3 per run, launched round-robin" in table
    assert "[5/9] bf16:compiled (repeat 2/3) ..." in console.file.getvalue()
    assert "median of 3 processes' medians of 8 steps" in console.file.getvalue()
    assert "runs that failed: fp8:hp:compiled" in console.file.getvalue()


def test_repeats_run_each_process_with_this_invocations_options(tmp_path):
    out = tmp_path / "out"
    argv = ["--device", "cpu", "--config", "tiny", "--model", "builtin", "--steps", "1", "--warmup", "0"]
    assert main([*argv, "--runs", "bf16:eager", "--repeats", "2", "--out", str(out)]) == 0
    report = json.loads((out / "e2e.json").read_text())
    assert report["repeats"] == 2
    assert report["num_steps"] == 1
    assert report["num_warmup"] == 0
    assert report["config"]["hidden_size"] == CONFIGS["tiny"].hidden_size
    (row,) = report["rows"]
    assert row["run"] == "bf16:eager"
    assert row["error"] == ""
    low, high = row["tokens_per_s_spread"]
    assert low <= row["tokens_per_s"] <= high
    assert len(row["step_ms_all"]) == 2
    for repeat in (1, 2):
        child = json.loads((out / "processes" / f"bf16_eager.{repeat}" / "e2e.json").read_text())
        assert [r["run"] for r in child["rows"]] == ["bf16:eager"]
        assert "--repeats" not in child["command"]


def test_each_process_gets_every_option_of_the_invocation_but_its_runs_and_out(tmp_path):
    argv = [
        "--device", "cpu", "--config", "tiny", "--steps", "2", "--warmup", "1", "--model", "builtin",
        "--compile-backend", "aot_eager", "--lr", "0.01", "--init-seed", "3", "--micro-batches", "2",
        "--weight-cache", "--runs", "bf16:eager,fp8:hp:eager", "--repeats", "3", "--out", str(tmp_path / "out"),
    ]  # fmt: skip
    _, args = e2e.parse_args(argv)
    (run,) = select_runs("fp8:hp:eager")
    _, child = e2e.parse_args(e2e._process_argv(args, run, tmp_path / "process"))
    # Every option a later one adds is forwarded unless it is named here.
    not_forwarded = {"runs", "out", "repeats", "fidelity", "workers", "baseline"}
    for option, value in vars(args).items():
        if option not in not_forwarded:
            assert getattr(child, option) == value, option
    assert (child.runs, child.out, child.repeats) == ("fp8:hp:eager", tmp_path / "process", None)


def test_repeats_with_fidelity_exit_2_with_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--out", str(tmp_path / "out"), "--fidelity", "10", "--repeats", "3"])
    assert exit_info.value.code == 2
    assert "leave out --fidelity, or --repeats" in capsys.readouterr().err
