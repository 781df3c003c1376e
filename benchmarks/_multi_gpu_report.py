"""The rows, JSON and markdown of `benchmarks/multi_gpu.py --drive` (its docstring says what every column means)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

BF16_BASELINE = "bf16:compiled"
GIB = 2**30
MIB = 2**20


@dataclass
class Row:
    """One configuration over its repeats; an error leaves the numbers None."""

    run: str
    repeats: int = 0
    """Launches that produced a result."""
    tokens_per_s_per_gpu: float | None = None
    """Median over repeats."""
    tokens_per_s_min: float | None = None
    tokens_per_s_max: float | None = None
    vs_bf16_compiled: float | None = None
    vs_torchao: float | None = None
    """Over the faster torchao run of the same invocation (medians)."""
    torchao_run: str | None = None
    """Which torchao run `vs_torchao` divides by."""
    step_ms: float | None = None
    """Median over repeats of each repeat's median step time (its slowest rank)."""
    peak_memory_gib: float | None = None
    """Max over repeats and ranks."""
    memory_gib: dict[str, float] = field(default_factory=dict)
    """parameters, gradients, optimizer_states, activations_other of the rank and repeat with the peak."""
    bytes_per_parameter: dict[str, float] = field(default_factory=dict)
    """parameters, gradients, optimizer_states of that rank, per parameter element it holds."""
    all_gather_bytes: int | None = None
    """Per step per GPU, output (gathered) bytes; the input bytes are in `collectives`."""
    reduce_scatter_bytes: int | None = None
    """Per step per GPU, input (unsharded gradient) bytes."""
    collectives: dict[str, dict[str, int]] = field(default_factory=dict)
    loss: float | None = None
    """The last step's loss, averaged over ranks; median over repeats."""
    dynamo: dict[str, int] = field(default_factory=dict)
    """graph_breaks/recompiles, total and after_warmup; max over repeats."""
    exposed_comm_ms: float | None = None
    """Per step, rank 0, median over repeats (--profile only)."""
    gpu_compute_ms: float | None = None
    """Per step, rank 0: time some non-NCCL kernel runs; median over repeats (--profile only)."""
    host_ms: dict[str, float] = field(default_factory=dict)
    """Per step, rank 0: host time by kind (fsdp_hooks, compiled_graphs, optimizer); medians (--profile only)."""
    gpu_ms_by_group: dict[str, float] = field(default_factory=dict)
    """Per step, rank 0: GPU time by kernel group (_multi_gpu_measure.GPU_GROUPS, "copies only",
    "idle"); medians (--profile on a GPU only)."""
    gpu_idle_ms_by_span: dict[str, float] = field(default_factory=dict)
    """Per step, rank 0: the GPU's idle time by the host spans that launched the work before and
    after each gap (_multi_gpu_measure.gpu_idle_by_launching_span); medians, 0 for a repeat
    without that pair (--profile on a GPU only)."""
    error: str = ""
    exit_codes: list[int] = field(default_factory=list)


IDLE_ROWS = 6
"""Rows per run in the report's table of GPU idle time by launching spans."""


def _median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def build_row(run: str, launches: Sequence[dict]) -> Row:
    """The row of `run` from its launches (each: exit_code, error, result: rank 0's JSON or None)."""
    results = [launch["result"] for launch in launches if launch["result"] and not launch["result"].get("error")]
    errors = [launch["error"] for launch in launches if launch["error"]]
    row = Row(run, repeats=len(results), exit_codes=[launch["exit_code"] for launch in launches])
    if errors:
        failed = f"{len(errors)}/{len(launches)} repeats failed: " if results else ""
        row.error = failed + errors[0]
    if not results:
        return row
    speeds = [r["tokens_per_s_per_gpu"] for r in results]
    row.tokens_per_s_per_gpu = statistics.median(speeds)
    row.tokens_per_s_min, row.tokens_per_s_max = min(speeds), max(speeds)
    row.step_ms = statistics.median(r["step_ms"] for r in results)
    row.loss = _median([r["loss"] for r in results])
    peak = max(results, key=lambda r: r["memory"]["peak"])
    row.peak_memory_gib = peak["memory"]["peak"] / GIB
    row.memory_gib = {k: v / GIB for k, v in peak["memory"].items() if k != "peak"}
    row.bytes_per_parameter = {
        k: peak["memory"][k] / peak["local_parameters"] for k in ("parameters", "gradients", "optimizer_states")
    }
    row.collectives = results[0]["collectives"]  # the same bytes every repeat
    row.all_gather_bytes = row.collectives["all_gather"]["output_bytes"]
    row.reduce_scatter_bytes = row.collectives["reduce_scatter"]["input_bytes"]
    row.dynamo = {k: max(r["dynamo"][k] for r in results) for k in results[0]["dynamo"]}
    row.exposed_comm_ms = _median([r.get("exposed_comm_ms") for r in results])
    row.gpu_compute_ms = _median([r.get("gpu_compute_ms") for r in results])
    kinds = {kind for r in results for kind in r.get("host_ms") or {}}
    row.host_ms = {kind: _median([(r.get("host_ms") or {}).get(kind) for r in results]) for kind in sorted(kinds)}
    groups = [g for r in results for g in r.get("gpu_ms_by_group") or {}]
    row.gpu_ms_by_group = {
        g: _median([(r.get("gpu_ms_by_group") or {}).get(g) for r in results]) for g in dict.fromkeys(groups)
    }
    idle = [r["gpu_idle_ms_by_span"] for r in results if r.get("gpu_idle_ms_by_span") is not None]
    row.gpu_idle_ms_by_span = {
        span: statistics.median(i.get(span, 0.0) for i in idle) for span in dict.fromkeys(s for i in idle for s in i)
    }
    return row


def with_ratios(rows: list[Row]) -> list[Row]:
    """Fills vs_bf16_compiled and vs_torchao (the faster torchao run)."""
    speeds = {r.run: r.tokens_per_s_per_gpu for r in rows if r.tokens_per_s_per_gpu}
    torchao = max((name for name in speeds if name.startswith("torchao-")), key=speeds.get, default=None)
    bf16 = speeds.get(BF16_BASELINE)
    for r in rows:
        if r.tokens_per_s_per_gpu:
            r.vs_bf16_compiled = r.tokens_per_s_per_gpu / bf16 if bf16 else None
            r.vs_torchao = r.tokens_per_s_per_gpu / speeds[torchao] if torchao else None
            r.torchao_run = torchao
    return rows


def _value(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _pair(dynamo: dict[str, int], name: str) -> str:
    if not dynamo:
        return "-"
    return f"{dynamo[f'{name}_total']}/{dynamo[f'{name}_after_warmup']}"


def _spread(r: Row) -> str:
    if r.tokens_per_s_min is None:
        return "-"
    return f"{r.tokens_per_s_min / 1e3:.1f}-{r.tokens_per_s_max / 1e3:.1f}k"


def _per_parameter(split: dict[str, float]) -> str:
    if not split:
        return "-"
    parts = (split["parameters"], split["gradients"], split["optimizer_states"])
    return f"{sum(parts):.1f} ({' + '.join(f'{p:.1f}' for p in parts)})"


def _host(host_ms: dict[str, float]) -> str:
    kinds = ("fsdp_hooks", "compiled_graphs", "optimizer")
    return " / ".join(_value(host_ms.get(kind), ".1f") for kind in kinds) if host_ms else "-"


def _bytes(value: int | None) -> str:
    return "-" if value is None else f"{value / MIB:.1f}"


FULL_COLUMNS = (
    "run",
    "tokens/s/GPU",
    "spread",
    "vs bf16 compiled",
    "vs torchao",
    "step ms",
    "peak GiB",
    "params GiB",
    "grads GiB",
    "optim GiB",
    "act+other GiB",
    "B/param (params+grads+optim)",
    "AG MiB/step",
    "RS MiB/step",
    "loss",
    "breaks",
    "recompiles",
    "exposed comm ms",
    "GPU compute ms",
    "host ms hooks/graphs/optim",
    "error",
)
COMPACT_COLUMNS = ("run", "tok/s/GPU", "spread", "vs bf16c", "vs torchao", "peak GiB", "AG MiB", "loss", "error")


def _full_cells(r: Row) -> list[str]:
    memory = [
        _value(r.memory_gib.get(k), ".2f") for k in ("parameters", "gradients", "optimizer_states", "activations_other")
    ]
    return [
        r.run,
        _value(r.tokens_per_s_per_gpu and r.tokens_per_s_per_gpu / 1e3, ".2f", "k"),
        _spread(r),
        _value(r.vs_bf16_compiled, ".2f", "x"),
        _value(r.vs_torchao, ".2f", "x"),
        _value(r.step_ms, ".1f"),
        _value(r.peak_memory_gib, ".2f"),
        *memory,
        _per_parameter(r.bytes_per_parameter),
        _bytes(r.all_gather_bytes),
        _bytes(r.reduce_scatter_bytes),
        _value(r.loss, ".4f"),
        _pair(r.dynamo, "graph_breaks"),
        _pair(r.dynamo, "recompiles"),
        _value(r.exposed_comm_ms, ".2f"),
        _value(r.gpu_compute_ms, ".1f"),
        _host(r.host_ms),
        r.error,
    ]


def _compact_cells(r: Row) -> list[str]:
    full = dict(zip(FULL_COLUMNS, _full_cells(r), strict=True))
    return [
        r.run,
        full["tokens/s/GPU"],
        full["spread"],
        full["vs bf16 compiled"],
        full["vs torchao"],
        full["peak GiB"],
        full["AG MiB/step"],
        full["loss"],
        r.error[:80],
    ]


def table(columns: Sequence[str], cells: Sequence[Sequence[str]]) -> str:
    """A markdown table: the columns of names left-aligned, the numbers right-aligned."""
    rule = " | ".join("---" if column in ("run", "error", "before -> after") else "---:" for column in columns)
    lines = ["| " + " | ".join(columns) + " |", "| " + rule + " |"]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in row) + " |" for row in cells]
    return "\n".join(lines)


def compact_table(rows: Sequence[Row]) -> str:
    """The few columns a human reads at the end of a log."""
    return table(COMPACT_COLUMNS, [_compact_cells(r) for r in rows])


def markdown(report: dict, rows: Sequence[Row]) -> str:
    """multi_gpu.md: the header and one row per configuration."""
    c = report["config"]
    torchao = next((r.torchao_run for r in rows if r.torchao_run), None)
    lines = [
        f"## Multi-GPU end to end, {report['model_name']}, {report['world_size']} x {report['device']}",
        "",
        f"- {report['date']}; torch {report['torch']}, transformers {report['transformers']}, torchao {report['torchao']}; "
        f"backend {report['backend']}; environment {report['child_env']}.",
        f"- Command: `{report['command']}`",
        f"- Model: {report['model']}, {c['num_layers']} layers, hidden {c['hidden_size']}, intermediate "
        f"{c['intermediate_size']}, {c['num_heads']} heads, vocab {c['vocab_size']}; fp32 parameters, FSDP2 per decoder "
        f"layer and root, MixedPrecisionPolicy(bf16 params, fp32 reduce); batch {c['batch_size']} x "
        f"{c['sequence_length']} tokens per GPU.",
        f"- {report['repeats']} repeats per run, launched round-robin; each: median of {report['num_steps']} steps after "
        f"{report['num_warmup']} warm-up steps and 1 counted step. vs torchao: over {torchao or '-'}. breaks and "
        "recompiles: total/after warm-up. Memory split: see benchmarks/multi_gpu.py.",
        *(
            [f"- Memory cap: {report['memory_cap_gib']:g} GiB per rank (torch.cuda.set_per_process_memory_fraction)."]
            if report.get("memory_cap_gib")
            else []
        ),
        "",
        table(FULL_COLUMNS, [_full_cells(r) for r in rows]),
    ]
    profiled = [r for r in rows if r.gpu_ms_by_group]
    if profiled:
        groups = list(dict.fromkeys(g for r in profiled for g in r.gpu_ms_by_group))
        lines += [
            "",
            "GPU ms per step by kernel group (rank 0, profiled steps; benchmarks/multi_gpu.py says what each holds):",
            "",
            table(
                ["run", *groups],
                [[r.run, *(_value(r.gpu_ms_by_group.get(g), ".1f") for g in groups)] for r in profiled],
            ),
        ]
    waited = [r for r in rows if r.gpu_idle_ms_by_span]
    if waited:
        lines += [
            "",
            f"GPU idle ms per step by the host spans that launched the work before and after each gap (rank 0, "
            f"profiled steps; each run's {IDLE_ROWS} largest):",
            "",
            table(
                ["run", "before -> after", "idle ms"],
                [
                    [r.run, spans, _value(ms, ".1f")]
                    for r in waited
                    for spans, ms in sorted(r.gpu_idle_ms_by_span.items(), key=lambda item: -item[1])[:IDLE_ROWS]
                ],
            ),
        ]
    return "\n".join(lines) + "\n"
