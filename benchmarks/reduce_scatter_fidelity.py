"""Does FSDP2 with the FP8 gradient reduce-scatter train like FSDP2's bf16 reduce-scatter? N ranks simulated on one device.

    python benchmarks/reduce_scatter_fidelity.py --device cuda --out results [--ranks 8] [--steps 1000]
        [--runs bf16:eager,*:hp:eager] [--config default|large|tiny] [--rank-batch B] [--include FILE ...]
        [--compile-backend inductor|aot_eager] [--reductions bf16,fp8] [--deadline-s SECONDS]

Each run of e2e.py's fidelity comparison (bf16 compute and each recipe with high-precision weights,
eager, or `:compiled` with the model under `torch.compile`) trains twice from the same initial
weights on the same batches of the fidelity task (_e2e_fidelity: the Markov task over
FIDELITY_STATES ids, AdamW with its warm-up), each step's gradient reduced over N simulated ranks:
rank i's micro-batch is slice i of the step's batch (N x B sequences), its gradient computed on its
own (forward, backward) and kept in bf16, the reduce dtype of
`MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16)`. The two reductions of the N gradients,
each parameter flattened and zero-padded to a multiple of N x 128 elements (rank j's shard is chunk
j of that, whole 128-element blocks; the parameters' regions lie end to end in one row per rank,
reduced in one call per step: each element's result is its 128-element block's, as with one call
per parameter):
- bf16: FSDP2's reduce-scatter in bf16 (AVG): the ranks' gradients summed in bf16 in rank order
  ((g0 + g1) + g2 ...), each sum rounded to bf16, then divided by N in bf16. NCCL sums in its
  ring's (or tree's) order instead, and may divide before summing;
- fp8: `quant_fsdp.QuantizedReduceScatter().simulate(...)` (E4M3, 1 x 128 blocks, AVG), bit for bit
  what the collective gives each rank. FSDP2 hands the collective one flat input per parameter
  group, in which a parameter's shard need not start on a block: a block may hold the end of
  one parameter's shard and the start of the next; here blocks never span two parameters.
Each rank's shard of the reduced gradient is the parameter's gradient; every simulated rank would
take the same optimizer step, so one model stands for all of them. The final loss is the mean of
the last tenth of the steps; the fp8 reduction's relative to the bf16 reduction's is compared
with BOUNDS; each reduction's median wall time per step (after the first tenth) is reported beside
it. Writes reduce_scatter_fidelity.json/.md/.png into --out, again after each reduction of
each run (a call cut short keeps the reductions it finished; a reduction that fails leaves an
error row with the curves trained before it); a bad argument exits with code 2 and one line naming it.

Runs of 1000 steps take minutes each on a GPU: spread them over several calls and pass the
earlier calls' reduce_scatter_fidelity.json with `--include`; their rows (checked to be the same
training) come first in this call's table and plot. `--reductions bf16` or `--reductions fp8`
trains one reduction of each run: the other call's row of the same run completes it. With
`--deadline-s`, a reduction that would end past that many seconds from the start stops (at each
tenth of its steps, projected from its median step so far) or does not start, and its row says so:
a call of fixed length spends its time on reductions that finish. Processes
that train side by side on one GPU each write their own --out; `--runs ''` with each of their
reports as an --include joins them into one table and plot without training.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import pathlib
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace

import torch
import torch.distributed as dist
from _arguments import Parser, positive, positive_seconds
from _compile_modes import COMPILED_MODES, compile_backend
from _e2e import (
    DEFAULT_FIDELITY_RUNS,
    E2EOptions,
    RunSpec,
    build_run,
    console_for_logs,
    each_run,
    environment,
    first_line,
    format_value,
    header_lines,
    loss_of,
    select_runs,
)
from _e2e_fidelity import (
    SAME_TRAINING,
    fidelity_task,
    final_window,
    lr_warmup_steps,
    plot_losses,
    set_learning_rate,
)
from _e2e_model import resolve_model_source
from rich.console import Console
from rich.table import Table

import quant_fsdp

REDUCE_DTYPE = torch.bfloat16
BLOCK = 128  # QuantizedReduceScatter's default block: every rank's shard is whole blocks
REDUCTIONS = ("bf16", "fp8")
# Largest |final loss with the FP8 reduce-scatter / with the bf16 one - 1|.
BOUNDS = {"nvfp4": 0.01, "nvfp4-rht": 0.01}
DEFAULT_BOUND = 0.003  # bf16 compute and every FP8 recipe


class DeadlineError(RuntimeError):
    """A reduction that would end after --deadline-s: stopped, or not started."""


# Report keys that must agree for rows of two calls to sit in one table (`--include`).
SAME_REDUCTION_TRAINING = (*SAME_TRAINING, "ranks", "rank_batch", "reductions", "layout")


@dataclass(frozen=True)
class ReductionRow:
    """One run trained with each reduction, and how the fp8 reduction's final loss compares."""

    run: str
    bf16_final_loss: float | None = None
    """Mean loss of the last tenth of the steps, bf16 reduce-scatter."""
    fp8_final_loss: float | None = None
    """The same with the FP8 reduce-scatter."""
    fp8_vs_bf16: float | None = None
    """fp8_final_loss / bf16_final_loss - 1."""
    bound: float | None = None
    seconds: float | None = None
    """Wall time of the row's trainings."""
    bf16_step_ms: float | None = None
    """Median wall time of a step after the first tenth (compilation, warm-up), bf16 reduce-scatter."""
    fp8_step_ms: float | None = None
    """The same with the FP8 reduce-scatter."""
    error: str = ""
    bf16_losses: list[float] = field(default_factory=list)
    fp8_losses: list[float] = field(default_factory=list)

    @property
    def within(self) -> bool | None:
        if self.fp8_vs_bf16 is None or self.bound is None:
            return None
        return abs(self.fp8_vs_bf16) <= self.bound

    @property
    def trained(self) -> set[str]:
        """The reductions this row holds a loss curve of."""
        return {name for name in REDUCTIONS if getattr(self, f"{name}_losses")}


def reduction_row(
    run: str, curves: dict[str, list[float]], bound: float, seconds: float, step_ms: dict[str, float | None]
) -> ReductionRow:
    """The row of `run` from its loss curve and median step time of each reduction trained (one or both)."""
    window = final_window(len(next(iter(curves.values()))))
    finals = {name: statistics.fmean(curve[-window:]) for name, curve in curves.items()}
    bf16, fp8 = finals.get("bf16"), finals.get("fp8")
    return ReductionRow(
        run,
        bf16_final_loss=bf16,
        fp8_final_loss=fp8,
        fp8_vs_bf16=None if bf16 is None or fp8 is None else fp8 / bf16 - 1,
        bound=bound,
        seconds=seconds,
        bf16_step_ms=step_ms.get("bf16"),
        fp8_step_ms=step_ms.get("fp8"),
        bf16_losses=curves.get("bf16", []),
        fp8_losses=curves.get("fp8", []),
    )


def merge_rows(rows: Sequence[ReductionRow]) -> list[ReductionRow]:
    """`rows` with each run's rows of different reductions (calls with `--reductions`) made one, in
    the order the runs first appear; ValueError if two rows hold the same run's same reduction."""
    merged: list[ReductionRow] = []
    for row in rows:
        partner = next((i for i, r in enumerate(merged) if r.run == row.run and r.trained and row.trained), None)
        if partner is None:
            merged.append(row)
            continue
        earlier = merged[partner]
        again = sorted(earlier.trained & row.trained)
        if again:
            raise ValueError(f"two rows hold {row.run} with the {' and '.join(again)} reduce-scatter")
        curves = {name: getattr(r, f"{name}_losses") for r in (earlier, row) for name in r.trained}
        step_ms = {name: getattr(r, f"{name}_step_ms") for r in (earlier, row) for name in r.trained}
        seconds = (earlier.seconds or 0.0) + (row.seconds or 0.0)
        merged[partner] = reduction_row(row.run, curves, row.bound, seconds, step_ms)
    return merged


def padded_numel(numel: int, ranks: int) -> int:
    """A parameter's flat length in the simulated reduce-scatter input: a multiple of ranks x BLOCK."""
    return -(-numel // (ranks * BLOCK)) * ranks * BLOCK


def gradient_offsets(parameters: Sequence[torch.Tensor], ranks: int) -> list[int]:
    """Where each parameter's gradient starts in a rank's row of the gradient buffer: the
    parameters' padded regions (`padded_numel`) end to end, in order; the last entry is the row's
    length. Every region is whole 128-element blocks, so a block never holds two parameters and
    reducing the rows whole gives each element what reducing its parameter's region alone would."""
    offsets = [0]
    for p in parameters:
        offsets.append(offsets[-1] + padded_numel(p.numel(), ranks))
    return offsets


def rank_gradients(
    model: torch.nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    ranks: int,
    out: torch.Tensor,
    forward: Callable[[torch.Tensor], object] | None = None,
) -> torch.Tensor:
    """Fills row i of `out` (ranks, gradient_offsets(...)[-1]), zero outside the parameters'
    regions, with rank i's gradients, computed on its micro-batch, slice i of `inputs`/`targets`,
    by `forward` (default: the model itself; e.g. its compiled module): parameter k's flat gradient
    at its offset (`gradient_offsets`, `model.parameters()` order). Leaves no gradient on the
    model; returns the mean of the ranks' losses."""
    parameters = list(model.parameters())
    offsets = gradient_offsets(parameters, ranks)
    losses = []
    for rank, (x, y) in enumerate(zip(inputs.chunk(ranks), targets.chunk(ranks), strict=True)):
        loss = loss_of(model if forward is None else forward, x, y)
        loss.backward()
        regions, grads = [], []
        for p, start in zip(parameters, offsets[:-1], strict=True):
            region = out[rank, start : start + p.numel()]
            if p.grad is None:  # FSDP2 would leave the parameter out of the reduce-scatter
                region.zero_()
            else:
                regions.append(region)
                grads.append(p.grad.reshape(-1))
        torch._foreach_copy_(regions, grads)
        model.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return torch.stack(losses).mean()


def reduce_bf16(gradients: torch.Tensor) -> torch.Tensor:
    """FSDP2's bf16 reduce-scatter (AVG) of the (ranks, n) bf16 gradients, every rank's shard
    together: summed in bf16 in rank order, then divided by the number of ranks in bf16."""
    total = gradients[0].clone()
    for gradient in gradients[1:]:
        total += gradient
    return total.div_(gradients.shape[0])


def reduce_fp8(gradients: torch.Tensor, comm: quant_fsdp.QuantizedReduceScatter) -> torch.Tensor:
    """The FP8 reduce-scatter (AVG) of the (ranks, n) gradients, every rank's shard together
    (`comm.simulate`: rank j's output is chunk j)."""
    return torch.cat(comm.simulate(list(gradients.unbind()), dist.ReduceOp.AVG))


def _allocator_counts(device: torch.device, since: dict[str, int] | None = None) -> dict[str, int]:
    """The caching allocator's counts of retried allocations (each frees cached blocks and waits for
    the device) and of device mallocs and frees, minus `since`'s; empty off CUDA."""
    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    keys = ("num_alloc_retries", "num_device_alloc", "num_device_free")
    return {k: stats.get(k, 0) - (since or {}).get(k, 0) for k in keys}


def train(
    spec: RunSpec,
    reduce: Callable[[torch.Tensor], torch.Tensor],
    data: torch.Tensor,
    ranks: int,
    options: E2EOptions,
    device: torch.device,
    source: str,
    console: Console,
    deadline: float | None = None,
) -> tuple[list[float], float]:
    """One run trained on `data` (steps, ranks x B, sequence + 1) with each step's gradient `reduce`d
    over the ranks: (the loss curve, the median wall time in ms of a step after the first tenth).
    Steps are timed as the host issues them (no synchronize): once the device's queue is full, a
    step waits for the device, so the median is the device's time per step where it is the
    bottleneck. DeadlineError at a tenth of the steps if the rest, at the median step so far,
    would end after `deadline` (a `time.perf_counter()` value)."""
    model, optimizer, _ = build_run(spec, options, device, source)
    compiled = spec.mode in COMPILED_MODES
    forward = torch.compile(model, backend=compile_backend(options.compile_backend, spec.mode)) if compiled else model
    parameters = list(model.parameters())
    offsets = gradient_offsets(parameters, ranks)
    # Zeros: the padding between regions is never written.
    gradients = torch.zeros(ranks, offsets[-1], dtype=REDUCE_DTYPE, device=device)
    num_steps = data.shape[0]
    losses, starts = [], []
    # The reduction's share of a step on the device: an event before and after it (CUDA only).
    events = [] if device.type == "cuda" else None
    allocations = _allocator_counts(device)
    for s in range(num_steps):
        starts.append(time.perf_counter())
        set_learning_rate(optimizer, options.learning_rate, s, num_steps)
        batch = data[s].to(device, non_blocking=True)
        losses.append(rank_gradients(model, batch[:, :-1], batch[:, 1:], ranks, gradients, forward))
        if events is not None:
            events.append((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
            events[-1][0].record()
        reduced = reduce(gradients)  # one reduction of every parameter's region
        if events is not None:
            events[-1][1].record()
        for p, start in zip(parameters, offsets[:-1], strict=True):
            p.grad = reduced[start : start + p.numel()].view_as(p).to(p.dtype)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if (s + 1) % final_window(num_steps) == 0:
            console.print(f"    step {s + 1}/{num_steps}: loss {losses[-1].item():.4f}", highlight=False)
            if deadline is not None and s + 1 < num_steps:
                now = time.perf_counter()
                step_s = statistics.median(b - a for a, b in itertools.pairwise([*starts, now]))
                end = now + (num_steps - s - 1) * step_s
                if end > deadline:
                    raise DeadlineError(
                        f"stopped after step {s + 1}: its {num_steps - s - 1} steps left at {1e3 * step_s:.0f} ms "
                        f"would end {end - deadline:.0f} s past --deadline-s; train it in a call of its own"
                    )
    starts.append(time.perf_counter())
    steps_ms = [1e3 * (b - a) for a, b in itertools.pairwise(starts)]
    first = min(final_window(num_steps), num_steps - 1)
    step_ms = statistics.median(steps_ms[first:])
    console.print(f"    {step_ms:.1f} ms per step (median after step {final_window(num_steps)})", highlight=False)
    if events is not None:
        torch.cuda.synchronize(device)
        reduce_ms = statistics.median(a.elapsed_time(b) for a, b in events[first:])
        counts = ", ".join(f"{k} {v}" for k, v in _allocator_counts(device, since=allocations).items())
        console.print(
            f"    of which the reduction {reduce_ms:.1f} ms on the device; allocator: {counts}", highlight=False
        )
    return torch.stack(losses).float().cpu().tolist(), step_ms


def _measure(
    spec: RunSpec,
    data: torch.Tensor,
    ranks: int,
    options: E2EOptions,
    device: torch.device,
    source: str,
    console: Console,
    reductions: Sequence[str] = REDUCTIONS,
    on_reduction: Callable[[ReductionRow], None] | None = None,
    deadline: float | None = None,
) -> ReductionRow:
    """The row of `spec` trained with each of `reductions`; `on_reduction` gets the row so far after
    each reduction but the last (a call stopped in the next keeps it). A reduction that raises ends
    the row with the error, keeping the curves trained before it; so does one that would end after
    `deadline` (`train`), or that finds it passed."""
    comm = quant_fsdp.QuantizedReduceScatter()
    reducers = {"bf16": reduce_bf16, "fp8": lambda g: reduce_fp8(g, comm)}
    bound = BOUNDS.get(spec.base, DEFAULT_BOUND)
    curves: dict[str, list[float]] = {}
    step_ms: dict[str, float | None] = {}
    start = time.perf_counter()
    for name in reductions:
        console.print(f"  {name} reduce-scatter", highlight=False)
        try:
            if deadline is not None and time.perf_counter() > deadline:
                raise DeadlineError("not started: --deadline-s has passed")
            curves[name], step_ms[name] = train(
                spec, reducers[name], data, ranks, options, device, source, console, deadline
            )
        except Exception as error:  # a benchmark row, not a test: report it and go on
            so_far = reduction_row(spec.name, curves, bound, time.perf_counter() - start, step_ms) if curves else None
            return replace(so_far or ReductionRow(spec.name), error=f"{type(error).__name__}: {first_line(error)}")
        if on_reduction is not None and len(curves) < len(reductions):
            on_reduction(reduction_row(spec.name, curves, bound, time.perf_counter() - start, step_ms))
    row = reduction_row(spec.name, curves, bound, time.perf_counter() - start, step_ms)
    if row.fp8_vs_bf16 is not None:
        console.print(
            f"    final loss {row.bf16_final_loss:.4f} (bf16), {row.fp8_final_loss:.4f} (fp8): "
            f"{100 * row.fp8_vs_bf16:+.3f}%",
            highlight=False,
        )
    return row


COLUMNS = (
    "run",
    "final loss, bf16 RS",
    "final loss, FP8 RS",
    "FP8 vs bf16",
    "bound",
    "within",
    "ms per step, bf16 / FP8 RS",
    "seconds",
    "error",
)


def _cells(r: ReductionRow) -> list[str]:
    return [
        r.run,
        format_value(r.bf16_final_loss, ".4f"),
        format_value(r.fp8_final_loss, ".4f"),
        format_value(None if r.fp8_vs_bf16 is None else 100 * r.fp8_vs_bf16, "+.3f", "%"),
        format_value(None if r.bound is None else 100 * r.bound, ".1f", "%"),
        {None: "-", True: "yes", False: "NO"}[r.within],
        f"{format_value(r.bf16_step_ms, '.0f')} / {format_value(r.fp8_step_ms, '.0f')}",
        format_value(r.seconds, ".0f"),
        r.error,
    ]


def markdown(report: dict, rows: list[ReductionRow]) -> str:
    """reduce_scatter_fidelity.md: the header and the final-loss table, ready for docs/benchmarks.md."""
    lines = [
        f"## FP8 gradient reduce-scatter fidelity, {report['config_name']} configuration",
        "",
        *header_lines(report),
    ]
    lines.append(
        f"- Per step, {report['ranks']} simulated ranks with a micro-batch of {report['rank_batch']} x "
        f"{report['config']['sequence_length']} tokens each; "
        f"{report['num_steps']} steps on the Markov task over {report['markov_states']} token ids (loss floor "
        f"{report['loss_floor']:.3f} nats), learning rate {report['learning_rate']} after "
        f"{report['lr_warmup_steps']} warm-up steps; final loss = mean of the last {report['final_window']} steps; "
        "plot: reduce_scatter_fidelity.png."
    )
    lines.append(f"- Reductions: {report['reductions']['bf16']}; {report['reductions']['fp8']}. {report['layout']}")
    lines += ["", "| " + " | ".join(COLUMNS) + " |", "| --- |" + " ---: |" * (len(COLUMNS) - 2) + " --- |"]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in _cells(r)) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def run_reduce_scatter_fidelity(
    out: pathlib.Path,
    runs: Sequence[RunSpec],
    options: E2EOptions,
    *,
    ranks: int,
    num_steps: int,
    rank_batch: int,
    included: Sequence[pathlib.Path] = (),
    reductions: Sequence[str] = REDUCTIONS,
    deadline: float | None = None,
    console: Console | None = None,
) -> int:
    """Trains each of `runs` with each of `reductions`; prints the table, writes
    reduce_scatter_fidelity.json/.md/.png (after each reduction), the rows of the `included` reports
    first (a run's rows of different reductions made one); 1 if a run failed. ValueError if an
    included report is unreadable, was trained differently, or already holds one of `runs` with
    one of `reductions`. `deadline` (a `time.perf_counter()` value): see `_measure`."""
    console = console or console_for_logs()
    device = options.torch_device()
    source = resolve_model_source(options.model_source)
    config = options.decoder
    task = fidelity_task(config)
    report = environment(options, device, source)
    report.update(
        config={**report["config"], "batch_size": ranks * rank_batch},
        num_warmup=0,
        num_steps=num_steps,
        ranks=ranks,
        rank_batch=rank_batch,
        lr_warmup_steps=lr_warmup_steps(num_steps),
        final_window=final_window(num_steps),
        markov_states=len(task.state_ids),
        loss_floor=task.entropy(),
        reductions={
            "bf16": "bf16, the ranks' bf16 gradients summed in bf16 in rank order, then divided by the ranks in bf16",
            "fp8": f"fp8, {quant_fsdp.QuantizedReduceScatter()!r}.simulate (AVG, bf16 output)",
        },
        layout=f"Each parameter's gradient flattened and zero-padded to a multiple of {ranks} x {BLOCK} elements.",
    )
    earlier = merge_rows([row for path in included for row in load_rows(path, report, runs, reductions)])
    rows = list(earlier)
    data = torch.empty(0)
    if runs:
        console.print(f"generating {num_steps} batches of {ranks} x {rank_batch} sequences", highlight=False)
        data = task.batches(range(num_steps), ranks * rank_batch, config.sequence_length)
        if device.type == "cuda":
            data = data.pin_memory()
    new: list[ReductionRow] = []
    measure = functools.partial(
        _measure,
        data=data,
        ranks=ranks,
        options=options,
        device=device,
        source=source,
        console=console,
        reductions=reductions,
        deadline=deadline,
        on_reduction=lambda row: write_report(out, report, merge_rows([*earlier, *new, row]), console),
    )
    for row in each_run(runs, device, console, measure, ReductionRow):
        if row.error:
            console.print(f"    {row.error}", highlight=False)
        new.append(row)
        rows = merge_rows([*earlier, *new])
        write_report(out, report, rows, console)
    if not runs:  # only joining the included reports
        write_report(out, report, rows, console)
    table = Table(title=f"FP8 vs bf16 reduce-scatter: {report['model']}, {ranks} simulated ranks, {num_steps} steps")
    for column in COLUMNS:
        table.add_column(column, justify="left" if column in ("run", "error") else "right")
    for r in rows:
        table.add_row(*_cells(r), style="red" if r.within is False or r.error else None)
    console.print(table)
    failed = [r.run for r in rows if r.error]
    if failed:
        console.print(f"runs that failed: {', '.join(failed)}")
    return 1 if failed else 0


def write_report(out: pathlib.Path, report: dict, rows: Sequence[ReductionRow], console: Console) -> None:
    """reduce_scatter_fidelity.json, .md and .png (the loss curves) in `out`, with every row so far."""
    out.mkdir(parents=True, exist_ok=True)
    stem = out / "reduce_scatter_fidelity"
    stem.with_suffix(".json").write_text(json.dumps({**report, "rows": [asdict(r) for r in rows]}, indent=2) + "\n")
    stem.with_suffix(".md").write_text(markdown(report, rows))
    curves = {f"{r.run} {name} RS": getattr(r, f"{name}_losses") for r in rows for name in REDUCTIONS}
    baselines = {f"{r.run} fp8 RS": f"{r.run} bf16 RS" for r in rows}
    plot_losses(console, curves, baselines, report, stem.with_suffix(".png"), "the bf16 reduce-scatter")


def load_rows(
    path: pathlib.Path, report: dict, runs: Sequence[RunSpec], reductions: Sequence[str]
) -> list[ReductionRow]:
    """The rows of an earlier reduce_scatter_fidelity.json (`--include`) of the same training as
    `report`, none of them one of `runs` with one of `reductions`; ValueError naming the problem."""
    try:
        earlier = json.loads(path.read_text())
        rows = [ReductionRow(**row) for row in earlier["rows"]]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(
            f"--include {path}: not a readable reduce_scatter_fidelity.json ({type(error).__name__}: {error})"
        ) from None
    differ = [key for key in SAME_REDUCTION_TRAINING if earlier.get(key) != report.get(key)]
    if differ:
        raise ValueError(
            f"--include {path} was trained differently ({', '.join(differ)}): pass the same --config, --steps, "
            "--ranks, --rank-batch, --lr and --model as its call"
        )
    names = {spec.name for spec in runs}
    again = [
        f"{row.run} ({', '.join(sorted(row.trained & set(reductions)))})"
        for row in rows
        if row.run in names and row.trained & set(reductions)
    ]
    if again:
        raise ValueError(
            f"--include {path} already holds {'; '.join(again)}: leave it out of --runs, or train the other "
            "reduction with --reductions"
        )
    return rows


def parse_args(argv: Sequence[str] | None = None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    parser = Parser(prog="reduce_scatter_fidelity.py", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("results"), help="folder for the results")
    parser.add_argument(
        "--device", choices=("all", "cpu", "cuda"), default="all", help="cuda; cpu; all (default): CUDA if present"
    )
    parser.add_argument(
        "--runs",
        default=DEFAULT_FIDELITY_RUNS,
        help="comma-separated globs on e2e.py's eager or compiled runs with high-precision weights "
        f"(default {DEFAULT_FIDELITY_RUNS}); '' trains none, joining the --include reports",
    )
    parser.add_argument("--config", choices=("default", "large", "tiny"), default="default", help="model size")
    parser.add_argument("--ranks", type=positive, default=8, metavar="N", help="simulated ranks (default 8)")
    parser.add_argument(
        "--steps", type=positive, default=1000, help="training steps per run and reduction (default 1000)"
    )
    parser.add_argument(
        "--rank-batch",
        type=positive,
        metavar="B",
        help="sequences per rank and step (default: the configuration's batch divided by the ranks, at least 1)",
    )
    parser.add_argument(
        "--model",
        choices=("auto", "transformers", "builtin"),
        default="auto",
        help="transformers' LlamaForCausalLM or the built-in equivalent (default auto: transformers when it imports)",
    )
    parser.add_argument("--lr", type=float, help="AdamW learning rate, in (0, 1) (default 3e-4)")
    parser.add_argument(
        "--compile-backend",
        choices=("inductor", "aot_eager"),
        default="inductor",
        help="torch.compile backend of :compiled runs (aot_eager traces the same graphs without generating code)",
    )
    parser.add_argument(
        "--reductions",
        default=",".join(REDUCTIONS),
        help="comma-separated reductions to train each run with (default bf16,fp8; one of them to spread a "
        "run's two trainings over two calls, joined with --include)",
    )
    parser.add_argument(
        "--include",
        type=pathlib.Path,
        action="append",
        default=[],
        metavar="FILE",
        help="an earlier call's reduce_scatter_fidelity.json of the same training: its rows join this call's "
        "table and plot (repeatable)",
    )
    parser.add_argument(
        "--deadline-s",
        type=positive_seconds,
        metavar="SECONDS",
        help="stop or skip a reduction that would end more than this many seconds after the start (default: none)",
    )
    return parser, parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    start = time.perf_counter()
    parser, args = parse_args(argv)
    try:
        runs = select_runs(args.runs) if args.runs else []
        command = shlex.join(
            ["python", "benchmarks/reduce_scatter_fidelity.py", *(sys.argv[1:] if argv is None else argv)]
        )
        settings = {"learning_rate": args.lr} if args.lr is not None else {}
        options = E2EOptions(
            config=args.config,
            device=args.device,
            model_source=args.model,
            compile_backend=args.compile_backend,
            command=command,
            **settings,
        )
    except ValueError as error:
        parser.error(str(error))
    others = [spec.name for spec in runs if spec.mode not in ("eager", *COMPILED_MODES) or spec.quantized_weights]
    if others:
        parser.error(
            f"--runs: {', '.join(others)}: the simulation trains eager or compiled runs with high-precision "
            f"weights (bf16:eager, <recipe>:hp:compiled, ...); pass patterns such as {DEFAULT_FIDELITY_RUNS!r}"
        )
    if not runs and not args.include:
        parser.error("--runs '' trains nothing: pass the reports to join with --include FILE")
    reductions = [name for name in args.reductions.split(",") if name]
    unknown = [name for name in reductions if name not in REDUCTIONS]
    if unknown or not reductions or len(set(reductions)) < len(reductions):
        parser.error(f"--reductions: {args.reductions!r}: name bf16, fp8 or both, once each")
    rank_batch = args.rank_batch or max(1, options.decoder.batch_size // args.ranks)
    try:
        return run_reduce_scatter_fidelity(
            args.out,
            runs,
            options,
            ranks=args.ranks,
            num_steps=args.steps,
            rank_batch=rank_batch,
            included=args.include,
            reductions=[name for name in REDUCTIONS if name in reductions],
            deadline=None if args.deadline_s is None else start + args.deadline_s,
        )
    except ValueError as error:
        parser.error(str(error))


if __name__ == "__main__":
    sys.exit(main())
