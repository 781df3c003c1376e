"""`python benchmarks/e2e.py --fidelity STEPS`: does each recipe train the e2e model like bf16 does?
(and each FusedAdam state configuration of quantized weights like fp32 states do: `vs fp32 states`)

Each run trains a fresh model (same seed) for STEPS steps on the same batches of the Markov task
over the configuration's vocabulary (32000 by default), visiting FIDELITY_STATES of its ids, with
AdamW at `--lr` (default 3e-4) after a linear warm-up over the first tenth of the steps (at most
100). Why fewer states: on the chain over all 32000 ids the 0.67B model sits on a plateau near
the unigram loss for 200-450 steps and drops when it leaves it; when that happens varies from run
to run (bf16, fp8 and fp8-block left it 150 steps apart, H100, 2026-11-24), so a final loss after
a few hundred steps measured that moment, not the recipe's numerics. The final loss is the
mean of the last tenth of the steps; its relative difference to bf16 eager's is compared with
the project's bounds (every FP8 recipe within 0.5%, NVFP4 within 2%; published anchors: DeepSeek-V3
blockwise FP8 within 0.25% of bf16, the NVFP4 paper within ~1% of FP8).

`--baseline FILE` takes bf16 eager's row from an earlier e2e_fidelity.json of the same training
(model, steps, task, learning rate, initial weights) instead of training it again, so the runs of
one comparison can be split over calls of limited length; the report names the file.
`--workers N` trains the runs in N processes side by side (on CUDA, one GPU each), dealt out in
turn, and writes one report of them all.
"""

from __future__ import annotations

import json
import multiprocessing
import pathlib
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace

import torch
from _e2e import (
    BF16_BASELINE,
    RECIPES,
    E2EOptions,
    RunSpec,
    build_run,
    console_for_logs,
    each_run,
    environment,
    first_line,
    format_value,
    header_lines,
    markov_task,
)
from _e2e_model import DecoderConfig, resolve_model_source
from rich.console import Console
from rich.table import Table

from quant_lab.demo import MarkovTask

# Token ids the fidelity task's chain visits (see above).
FIDELITY_STATES = 2048
# Largest |final loss / bf16's - 1| allowed; runs without a bound (bf16, torchao) are reported only.
TOLERANCE = {**dict.fromkeys(RECIPES, 0.005), "nvfp4": 0.02, "nvfp4-rht": 0.02}


@dataclass(frozen=True)
class FidelityRow:
    """One run's training curve and how its final loss compares with bf16 eager's."""

    run: str
    final_loss: float | None = None
    """Mean loss of the last tenth of the steps."""
    vs_bf16: float | None = None
    """final_loss / bf16 eager's - 1."""
    vs_fp32_states: float | None = None
    """Runs with FusedAdam states (`+<states>`): final_loss / that of the same run with fp32 states - 1."""
    tolerance: float | None = None
    tokens_per_s: float | None = None
    """Over the whole training, data transfers and warm-up included."""
    error: str = ""
    losses: list[float] = field(default_factory=list)

    @property
    def within(self) -> bool | None:
        if self.vs_bf16 is None or self.tolerance is None:
            return None
        return abs(self.vs_bf16) <= self.tolerance


# What must agree between a baseline file and this call for its bf16 curve to be comparable.
SAME_TRAINING = ("model", "config", "num_steps", "markov_states", "learning_rate", "lr_warmup_steps", "init_seed")


def load_baseline(path: pathlib.Path) -> tuple[dict, FidelityRow]:
    """(the report, bf16 eager's row) of an earlier e2e_fidelity.json; ValueError naming the problem."""
    try:
        report = json.loads(path.read_text())
        row = next(r for r in report["rows"] if r["run"] == BF16_BASELINE and r["losses"])
        return report, FidelityRow(**row)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(
            f"--baseline {path}: not a readable e2e_fidelity.json ({type(error).__name__}: {error})"
        ) from None
    except StopIteration:
        raise ValueError(f"--baseline {path}: has no {BF16_BASELINE} row with a loss curve; train it once") from None


def _check_baseline(report: dict, baseline: dict, path: pathlib.Path) -> None:
    differ = [key for key in SAME_TRAINING if report.get(key) != baseline.get(key)]
    if differ:
        raise ValueError(
            f"--baseline {path} was trained differently ({', '.join(differ)}): run bf16 in this call or pass a "
            "baseline of the same model, steps, task, learning rate and initial weights"
        )


def fidelity_task(config: DecoderConfig) -> MarkovTask:
    """The Markov task over the configuration's vocabulary, visiting at most FIDELITY_STATES ids of it."""
    return markov_task(config, FIDELITY_STATES if config.vocab_size > FIDELITY_STATES else None)


def final_window(num_steps: int) -> int:
    """How many last steps the final loss averages: a tenth of them."""
    return max(1, num_steps // 10)


def lr_warmup_steps(num_steps: int) -> int:
    """The linear learning-rate warm-up: a tenth of the steps, at most 100."""
    return max(1, min(100, num_steps // 10))


def set_learning_rate(optimizer: torch.optim.Optimizer, learning_rate: float, step: int, num_steps: int) -> None:
    """Step `step`'s learning rate: `learning_rate` after the linear warm-up (`lr_warmup_steps`)."""
    for group in optimizer.param_groups:
        group["lr"] = learning_rate * min(1.0, (step + 1) / lr_warmup_steps(num_steps))


def _train(
    spec: RunSpec, data: torch.Tensor, options: E2EOptions, device: torch.device, source: str, console: Console
) -> FidelityRow:
    num_steps = data.shape[0]
    try:
        model, optimizer, step = build_run(spec, options, device, source)
        losses = []
        start = time.perf_counter()
        for s in range(num_steps):
            set_learning_rate(optimizer, options.learning_rate, s, num_steps)
            batch = data[s].to(device, non_blocking=True)
            losses.append(step(batch[:, :-1], batch[:, 1:]))
            if (s + 1) % final_window(num_steps) == 0:
                console.print(f"    step {s + 1}/{num_steps}: loss {losses[-1].item():.4f}", highlight=False)
        curve = torch.stack(losses).float().cpu().tolist()
        seconds = time.perf_counter() - start
    except Exception as error:  # a benchmark row, not a test: report it and go on
        return FidelityRow(spec.name, error=f"{type(error).__name__}: {first_line(error)}")
    del model, optimizer, step
    final_loss = statistics.fmean(curve[-final_window(num_steps) :])
    # in the log as soon as known: a call cut short by its time limit keeps the runs that finished
    console.print(
        f"    final loss {final_loss:.4f} (mean of the last {final_window(num_steps)} steps)", highlight=False
    )
    return FidelityRow(
        spec.name,
        final_loss=final_loss,
        tolerance=TOLERANCE.get(spec.base),
        tokens_per_s=num_steps * data[0, :, 1:].numel() / seconds,
        losses=curve,
    )


def _with_gaps(rows: list[FidelityRow]) -> list[FidelityRow]:
    final = {r.run: r.final_loss for r in rows}
    bf16 = final.get(BF16_BASELINE)

    def gap(loss: float | None, baseline: float | None) -> float | None:
        return loss / baseline - 1 if loss and baseline else None

    return [
        replace(
            r, vs_bf16=gap(r.final_loss, bf16), vs_fp32_states=gap(r.final_loss, final.get(r.run.partition("+")[0]))
        )
        if "+" in r.run
        else replace(r, vs_bf16=gap(r.final_loss, bf16))
        for r in rows
    ]


COLUMNS = ("run", "final loss", "vs bf16", "vs fp32 states", "bound", "within", "tokens/s", "error")


def _cells(r: FidelityRow) -> list[str]:
    within = {None: "-", True: "yes", False: "NO"}[r.within]
    tokens = None if r.tokens_per_s is None else r.tokens_per_s / 1e3
    return [
        r.run,
        format_value(r.final_loss, ".4f"),
        format_value(None if r.vs_bf16 is None else 100 * r.vs_bf16, "+.2f", "%"),
        format_value(None if r.vs_fp32_states is None else 100 * r.vs_fp32_states, "+.2f", "%"),
        format_value(None if r.tolerance is None else 100 * r.tolerance, ".1f", "%"),
        within,
        format_value(tokens, ".1f", "k"),
        r.error,
    ]


def markdown(report: dict, rows: list[FidelityRow]) -> str:
    """e2e_fidelity.md: the header and the final-loss table, ready for docs/benchmarks.md."""
    lines = [f"## Training fidelity, {report['config_name']} configuration", "", *header_lines(report)]
    lines.append(
        f"- {report['num_steps']} steps per run on the Markov task over {report['markov_states']} token ids (loss floor "
        f"{report['loss_floor']:.3f} nats), "
        f"learning rate {report['learning_rate']} after {report['lr_warmup_steps']} warm-up steps; final loss = "
        f"mean of the last {report['final_window']} steps; plot: e2e_fidelity.png."
    )
    if "baseline" in report:
        lines.append(f"- {report['baseline']}")
    lines += ["", "| " + " | ".join(COLUMNS) + " |", "| --- |" + " ---: |" * (len(COLUMNS) - 2) + " --- |"]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in _cells(r)) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def plot_losses(
    console: Console,
    curves: dict[str, list[float]],
    baselines: dict[str, str],
    report: dict,
    path: pathlib.Path,
    versus: str,
) -> None:
    """A PNG of two panels: every loss curve (and the task's loss floor); and, for each curve
    `baselines` maps to another, its moving mean over the final-loss window relative to that
    curve's, in % ("% vs `versus`"), so each gap curve ends at the table's value."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        console.print("no loss plot: matplotlib is not installed (pip install matplotlib)")
        return
    tensors = {run: torch.tensor(curve) for run, curve in curves.items() if curve}
    figure, (losses, gaps) = plt.subplots(1, 2, figsize=(13, 5))
    window = final_window(report["num_steps"])
    for index, (run, curve) in enumerate(tensors.items()):
        losses.plot(curve, label=run, linewidth=1.0, color=f"C{index}")
        baseline = tensors.get(baselines.get(run, ""))
        if baseline is not None:
            ratio = curve.unfold(0, window, 1).mean(-1) / baseline.unfold(0, window, 1).mean(-1) - 1
            gaps.plot(range(window - 1, len(curve)), 100 * ratio, label=run, linewidth=1.0, color=f"C{index}")
    losses.axhline(report["loss_floor"], color="gray", linestyle=":", label="loss floor")
    losses.set(xlabel="step", ylabel="training loss", yscale="log", title=f"{report['model']}, Markov task")
    gaps.axhline(0, color="gray", linewidth=0.8)
    gaps.set(xlabel="step", ylabel=f"% vs {versus}", title=f"loss vs {versus} (moving mean of {window} steps)")
    for axis in (losses, gaps):
        if axis.get_legend_handles_labels()[0]:  # no gap curves when a baseline trained alone
            axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def run_fidelity(
    out: pathlib.Path,
    runs: Sequence[RunSpec],
    options: E2EOptions,
    *,
    num_steps: int,
    baseline: pathlib.Path | None = None,
    workers: int = 1,
    console: Console | None = None,
) -> int:
    """Trains `runs` for `num_steps` steps each (in `workers` processes: `_train_in_workers`); prints
    the table, writes e2e_fidelity.json/.md/.png; 1 if a run failed, 2 if `baseline` (an earlier
    e2e_fidelity.json giving bf16 eager's row) was trained differently."""
    baseline_report, baseline_row = load_baseline(baseline) if baseline is not None else (None, None)
    console = console or console_for_logs()
    device = options.torch_device()
    source = resolve_model_source(options.model_source)
    config = options.decoder
    task = fidelity_task(config)
    report = {
        **environment(options, device, source),
        "num_warmup": 0,
        "num_steps": num_steps,
        "lr_warmup_steps": lr_warmup_steps(num_steps),
        "final_window": final_window(num_steps),
        "markov_states": len(task.state_ids),
        "loss_floor": task.entropy(),
    }
    if baseline_report is not None:
        try:
            _check_baseline(report, baseline_report, baseline)
        except ValueError as error:
            console.print(str(error), highlight=False)
            return 2
        runs = [spec for spec in runs if spec.name != BF16_BASELINE]
        report["baseline"] = (
            f"{BF16_BASELINE} from {baseline.name} ({baseline_report['date']}, {baseline_report['command']})"
        )
        console.print(f"{report['baseline']}", highlight=False)
    rows = [baseline_row] if baseline_row is not None else []
    if workers > 1 and len(runs) > 1:
        rows += _train_in_workers(out, runs, options, num_steps, workers, console)
    else:
        rows += _train_runs(runs, options, num_steps, console)
    rows = _with_gaps(rows)
    table = Table(title=f"Training fidelity: {report['model']}, {num_steps} steps, Markov task")
    for column in COLUMNS:
        table.add_column(column, justify="left" if column in ("run", "error") else "right")
    for r in rows:
        table.add_row(
            *_cells(r), style="red" if r.within is False or (r.error and not r.error.startswith("skipped")) else None
        )
    console.print(table)
    out.mkdir(parents=True, exist_ok=True)
    (out / "e2e_fidelity.json").write_text(json.dumps({**report, "rows": [asdict(r) for r in rows]}, indent=2) + "\n")
    (out / "e2e_fidelity.md").write_text(markdown(report, rows))
    curves = {r.run: r.losses for r in rows}
    baselines = dict.fromkeys((run for run in curves if run != BF16_BASELINE), BF16_BASELINE)
    plot_losses(console, curves, baselines, report, out / "e2e_fidelity.png", "bf16 eager")
    failed = [r.run for r in rows if r.error and not r.error.startswith("skipped")]
    if failed:
        console.print(f"runs that failed: {', '.join(failed)}")
    return 1 if failed else 0


def _train_runs(runs: Sequence[RunSpec], options: E2EOptions, num_steps: int, console: Console) -> list[FidelityRow]:
    """Each run trained in turn on this process's device, a row each."""
    device = options.torch_device()
    source = resolve_model_source(options.model_source)
    config = options.decoder
    console.print(f"generating {num_steps} batches of the Markov task ({config.vocab_size} tokens)", highlight=False)
    data = fidelity_task(config).batches(range(num_steps), config.batch_size, config.sequence_length)
    if device.type == "cuda":
        data = data.pin_memory()
    rows = []
    for row in each_run(
        runs, device, console, lambda spec: _train(spec, data, options, device, source, console), FidelityRow
    ):
        if row.error:
            console.print(f"    {row.error}", highlight=False)
        rows.append(row)
    return rows


def _train_in_workers(
    out: pathlib.Path, runs: Sequence[RunSpec], options: E2EOptions, num_steps: int, workers: int, console: Console
) -> list[FidelityRow]:
    """The runs dealt out in turn to `workers` processes (spawned; on CUDA worker i trains on GPU i),
    each logging to out/fidelity-worker-<i>.log and writing its rows to a JSON there; the rows in
    the order of `runs`. A worker that died leaves an error row for each of its runs."""
    out.mkdir(parents=True, exist_ok=True)
    shares = [list(runs[i::workers]) for i in range(workers)]
    context = multiprocessing.get_context("spawn")
    processes = []
    for i, share in enumerate(shares):
        if share:
            process = context.Process(target=_worker, args=(i, share, options, num_steps, out), daemon=True)
            process.start()
            processes.append((i, share, process))
            console.print(f"worker {i}: {', '.join(spec.name for spec in share)} (log: fidelity-worker-{i}.log)")
    found: dict[str, FidelityRow] = {}
    for i, share, process in processes:
        process.join()
        path = out / f"fidelity-worker-{i}.json"
        if path.exists():
            found.update((row["run"], FidelityRow(**row)) for row in json.loads(path.read_text()))
        console.print(f"worker {i} ended (exit code {process.exitcode})", highlight=False)
        for spec in share:
            found.setdefault(spec.name, FidelityRow(spec.name, error=f"its worker exited with code {process.exitcode}"))
    return [found[spec.name] for spec in runs]


def _worker(index: int, runs: list[RunSpec], options: E2EOptions, num_steps: int, out: pathlib.Path) -> None:
    if options.torch_device().type == "cuda":
        torch.cuda.set_device(index)
    with (out / f"fidelity-worker-{index}.log").open("w") as log:
        rows = _train_runs(runs, options, num_steps, Console(file=log, width=160))
    (out / f"fidelity-worker-{index}.json").write_text(json.dumps([asdict(r) for r in rows]))
