"""benchmarks/torchtitan_trainer.py's driver: torchtitan 0.2's step lines parsed, medians, the
table and the runs' flags. Pure functions: nothing here imports torchtitan (CI has 0.3)."""

from __future__ import annotations

import json

import pytest
import torchtitan_trainer as titan

# torchtitan 0.2.2's step line (components/metrics.py) as its logger prints it, colours on.
RED, GREEN, ORANGE, TURQUOISE, BLUE, CYAN, MAGENTA, RESET = (
    "\033[31m",
    "\033[32m",
    "\033[38;2;180;60;0m",
    "\033[38;2;54;234;195m",
    "\033[34m",
    "\033[36m",
    "\033[35m",
    "\033[39m",
)


def step_line(step, loss, memory, tps, tflops, mfu, color=True) -> str:
    c = (RED, GREEN, ORANGE, TURQUOISE, BLUE, CYAN, MAGENTA, RESET) if color else ("",) * 8
    return (
        f"[rank0]:[titan] 2026-12-06 09:30:0{step % 10},123 - root - INFO - "
        f"{c[0]}step: {step:2}  {c[1]}loss: {loss:8.5f}  {c[2]}grad_norm: {1.2345:7.4f}  "
        f"{c[3]}memory: {memory:5.2f}GiB({memory / 79.1 * 100:.2f}%)  {c[4]}tps: {round(tps):,}  "
        f"{c[5]}tflops: {tflops:,.2f}  {c[6]}mfu: {mfu:.2f}%{c[7]}"
    )


SAMPLE = "\n".join(
    [
        "[rank0]:[titan] 2026-12-06 09:29:58,001 - root - INFO - Starting job: Llama 3 8B training",
        "[rank0]:[titan] 2026-12-06 09:29:59,002 - root - INFO - Applied FSDP to the model on one rank",
        step_line(1, 10.84113, 70.5, 1_012, 58.9, 5.96),
        step_line(2, 10.12, 61.5, 14_321, 833.2, 84.25, color=False),
        "W1206 09:30:02.000000 123 torch/_dynamo/convert_frame.py:1000] a warning with step: in it",
        step_line(3, 9.5, 38.02, 15_002, 1_012.34, 85.5),
        f"[rank0]:[titan] - root - INFO - {RED}validate step:  3  {GREEN}loss:  9.9000  "
        f"{TURQUOISE}memory: 70.00GiB(88.50%)  {BLUE}tps: 99,999{RESET}",
        step_line(4, 9.25, 38.5, 14_800, 990.0, 84.0),
    ]
)


def test_parse_steps_reads_every_training_step_line_with_or_without_colours():
    steps = titan.parse_steps(SAMPLE)
    assert steps == [
        titan.Step(step=1, loss=10.84113, memory_gib=70.5, tps=1012.0, mfu=5.96),
        titan.Step(step=2, loss=10.12, memory_gib=61.5, tps=14321.0, mfu=84.25),
        titan.Step(step=3, loss=9.5, memory_gib=38.02, tps=15002.0, mfu=85.5),
        titan.Step(step=4, loss=9.25, memory_gib=38.5, tps=14800.0, mfu=84.0),
    ]


def test_summarize_run_takes_medians_after_the_warmup_and_the_peak_over_every_step():
    summary = titan.summarize_run(titan.parse_steps(SAMPLE), warmup=1)
    assert summary == {
        "tps_median": 14800.0,  # steps 2-4; step 1 (compiling) left out
        "mfu_median": 84.25,
        "peak_gib": 70.5,  # step 1's (compiling), left out of the medians but not of the peak
        "measured_steps": 3,
        "first_loss": 10.84113,
        "last_loss": 9.25,
    }
    assert titan.summarize_run(titan.parse_steps(SAMPLE), warmup=2)["tps_median"] == pytest.approx((15002 + 14800) / 2)


def test_summarize_run_without_steps_after_the_warmup_names_the_fix():
    with pytest.raises(ValueError, match=r"no step after the 4 warm-up steps.*last step is 4.*lower --warmup"):
        titan.summarize_run(titan.parse_steps(SAMPLE), warmup=4)
    with pytest.raises(ValueError, match="last step is 0"):
        titan.summarize_run([], warmup=0)


def result(run, tps, peak=40.0, mfu=50.0, repeat=0):
    return {"run": run, "repeat": repeat, "tps_median": tps, "mfu_median": mfu, "peak_gib": peak}


def test_summary_table_medians_over_repeats_and_ratios_to_bf16_and_the_best_float8():
    results = [
        result("bf16", 1000.0, peak=60.0),
        result("float8-tensorwise", 1150.0),
        result("float8-rowwise", 1100.0),
        result("fp8:qw-bf16", 1200.0, peak=30.0),
        result("bf16", 1100.0, peak=61.0, repeat=1),
        result("float8-tensorwise", 1250.0, repeat=1),
        result("float8-rowwise", 1120.0, repeat=1),
        result("fp8:qw-bf16", 1300.0, peak=31.0, repeat=1),
        result("fp8:qw-bf16", 1260.0, peak=30.5, repeat=2),
        {"run": "fp8:qw", "repeat": 0, "error": "no step"},
    ]
    rows, table = titan.summary_table(results)
    by_run = {row["run"]: row for row in rows}
    assert by_run["bf16"]["tps"] == 1050.0
    assert by_run["bf16"]["peak_gib"] == 61.0
    assert by_run["fp8:qw-bf16"]["tps"] == 1260.0
    assert by_run["fp8:qw-bf16"]["repeats"] == 3
    assert by_run["fp8:qw-bf16"]["vs_bf16"] == pytest.approx(1260 / 1050)
    # torchtitan's best float8 is tensorwise (median 1200), not rowwise (1110)
    assert by_run["fp8:qw-bf16"]["vs_float8_best"] == pytest.approx(1260 / 1200)
    assert by_run["float8-rowwise"]["vs_float8_best"] == pytest.approx(1110 / 1200)
    assert by_run["fp8:qw"] == {"run": "fp8:qw", "repeats": 0}
    lines = table.splitlines()
    assert lines[0].startswith("| run | tokens/s (median)")
    assert "vs torchtitan float8 best" in lines[0]
    assert [line.split(" | ")[0] for line in lines[2:]] == [
        "| bf16",
        "| float8-tensorwise",
        "| float8-rowwise",
        "| fp8:qw-bf16",
        "| fp8:qw",
    ]
    assert lines[5] == "| fp8:qw-bf16 | 1,260 | 3 (1,200-1,300) | 1.200x | 1.050x | 50.0 | 31.00 |"
    assert lines[6] == "| fp8:qw | failed | 0 | | | | |"


def test_summary_table_without_baselines_leaves_the_ratios_empty():
    rows, table = titan.summary_table([result("fp8:hp", 900.0)])
    assert rows[0]["vs_bf16"] is None
    assert rows[0]["vs_float8_best"] is None
    assert table.splitlines()[2] == "| fp8:hp | 900 | 1 (900-900) |  |  | 50.0 | 40.00 |"


def test_run_flags_of_ours_name_the_converter_fused_adam_and_the_states():
    flags = titan.run_flags("fp8:qw-bf16+master-bf16-m-fp8")
    assert flags[:4] == ["--model.converters", "quant_linear", "--quant_linear.recipe_name", "fp8"]
    assert "--quant_linear.quantized_weights" in flags
    assert "--quant_linear.bf16_layers" in flags
    assert flags[flags.index("--optimizer.name") + 1] == "FusedAdam"
    assert flags[flags.index("--optimizer.master_weight_dtype") + 1] == "bfloat16"
    assert flags[flags.index("--optimizer.exp_avg_dtype") + 1] == "float8_e4m3fn"
    assert flags[flags.index("--optimizer.exp_avg_sq_dtype") + 1] == "bfloat16"
    assert titan.run_flags("mxfp8:hp") == ["--model.converters", "quant_linear", "--quant_linear.recipe_name", "mxfp8"]
    assert "--quant_linear.bf16_layers" not in titan.run_flags("fp8:qw")
    assert "--quant_linear.weight_columnwise_on_demand" not in flags
    rowwise_weights = titan.run_flags("fp8:qw-bf16+master-bf16-m-fp8+rowwise-weights")
    assert rowwise_weights == [*flags, "--quant_linear.weight_columnwise_on_demand"]
    assert titan.run_flags("bf16") == []
    rowwise = titan.run_flags("float8-rowwise")
    assert rowwise[rowwise.index("--quantize.linear.float8.recipe_name") + 1] == "rowwise"
    assert "--quantize.linear.float8.enable_fsdp_float8_all_gather" in titan.run_flags("float8-tensorwise")


def test_a_fused_run_is_its_run_with_quant_cores_fused_kernels_in_its_environment():
    fused = "fp8-block:qw-bf16+master-bf16-m-fp8+rowwise-weights+fused"
    assert titan.run_flags(fused) == titan.run_flags(fused.removesuffix("+fused"))
    assert titan.run_environment(fused) == {"QUANT_CORE_COMPILED_KERNELS": "inductor"}
    assert titan.run_environment("fp8-block:qw-bf16+master-bf16-m-fp8") == {}
    assert titan.run_environment("float8-rowwise") == {}
    assert titan.run_flags("mxfp8:hp+fused") == titan.run_flags("mxfp8:hp")


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("fp8", r"unknown run 'fp8'.*bf16, float8-tensorwise, float8-rowwise or <recipe>:<hp\|qw\|qw-bf16>"),
        ("fp8:qw+m-fp16", r"unknown states 'm-fp16'; choose one of m-bf16, m-fp8"),
        ("fp8:hp+m-bf16", r"high-precision weights step with torchtitan's AdamW"),
        ("fp8:hp+rowwise-weights", r"\+rowwise-weights apply to quantized weights"),
    ],
)
def test_run_flags_refuse_unknown_runs_naming_the_choices(name, message):
    with pytest.raises(ValueError, match=message):
        titan.run_flags(name)


def test_the_text_set_is_deterministic_json_lines_of_the_size_asked(tmp_path):
    first = (titan.write_text_set(tmp_path / "a", kilobytes=50) / "train.jsonl").read_text()
    second = (titan.write_text_set(tmp_path / "b", kilobytes=50) / "train.jsonl").read_text()
    other = (titan.write_text_set(tmp_path / "c", kilobytes=50, seed=1) / "train.jsonl").read_text()
    assert first == second != other
    assert 50 * 1024 <= len(first) < 60 * 1024
    texts = [json.loads(line)["text"] for line in first.splitlines()]
    assert all(texts)
    assert len(set(texts)) == len(texts)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--runs", "fp8"], "--runs: unknown run 'fp8'"),
        (["--runs", ","], "--runs: name at least one run"),
        (["--repeats", "0"], "--repeats: must be >= 1, got 0"),
        (["--layers", "33"], "--layers 33: Llama 3 8B has 32 layers; give 1 to 32"),
        (["--steps", "5", "--warmup", "5"], "--warmup 5: give 0 to --steps - 1 (4)"),
        (["--deadline-s", "-1"], "--deadline-s: must be > 0 seconds, got -1"),
        (["--run-timeout-s", "0"], "--run-timeout-s: must be > 0 seconds, got 0"),
    ],
)
def test_bad_arguments_exit_2_with_one_line_naming_them_before_anything_runs(arguments, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        titan.main([*arguments, "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()
