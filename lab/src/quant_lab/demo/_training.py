"""Part 1 of `quant-fsdp demo`: FSDP2 training of the test transformer, bf16 and the chosen recipes.

`num_ranks` processes (gloo on the CPU; NCCL on CUDA, one GPU each) shard the model with FSDP2
(each block, then the root); bf16 uses torch's fully_shard, the recipes quant_fsdp.fully_shard
with quantized primary weights (fp32 masters through MasterWeights), kept rowwise only where the
format derives columnwise data (`demo_recipe`). Each step's all-gathered
bytes are counted on the collective itself. Every run starts from the same seeded weights and
sees the same batches.
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import statistics
import tempfile
import time
from dataclasses import dataclass, replace

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import quant_fsdp
import quant_tensors as qt
from quant_lab._all_gather_counter import count_all_gather_bytes
from quant_lab.demo._cpu_gemms import bf16_gemms_in_fp32
from quant_lab.demo._launch import run_ranks
from quant_lab.demo._model import MarkovTask, TinyTransformer, TransformerConfig, train

RECIPES = ("fp8", "fp8-delayed", "mxfp8", "fp8-block", "nvfp4")
BATCH = 8  # sequences per global batch, split evenly over the ranks
# The demo's sanity bound on |final loss / bf16's final loss - 1|: a short run (60 steps by default,
# any --seed and --nproc) of a recipe that trains stays within it. It is not a parity bound: the
# parity test (tests-integration/test_training_parity.py) and the GPU fidelity runs hold tighter
# ones; docs/benchmarks.md, "Loss parity bounds", says what each bound checks.
LOSS_BOUND = {"fp8": 0.03, "fp8-delayed": 0.03, "mxfp8": 0.03, "fp8-block": 0.03, "nvfp4": 0.06}
FINAL_WINDOW = 10  # the final loss is the mean of the last FINAL_WINDOW steps' losses
# The verdict compares final losses, means of the last FINAL_WINDOW steps' losses: a shorter run has
# fewer to average, its first steps, where every run still sits near the same initial loss.
VERDICT_MIN_STEPS = FINAL_WINDOW
LEARNING_RATE = 1e-3


@dataclass(frozen=True, kw_only=True)
class DemoOptions:
    """What `quant-fsdp demo` runs; quant_fsdp_cli checks each value before work starts."""

    recipes: tuple[str, ...]
    """Recipes trained after bf16 (names from RECIPES)."""
    num_ranks: int
    """Training processes; each trains on BATCH // num_ranks sequences of every batch."""
    num_steps: int
    """Training steps per run."""
    device: str
    """"cpu" (gloo) or "cuda" (NCCL, rank r on GPU r)."""
    seed: int
    """Seeds the initial weights and the task's Markov chain."""
    command: str = ""
    """The command line, recorded in demo.json."""


def ranks_phrase(options: DemoOptions) -> str:
    """Where the demo trains, e.g. "2 CPU ranks (gloo)"."""
    kind, backend = ("GPU", "NCCL") if options.device == "cuda" else ("CPU", "gloo")
    return f"{options.num_ranks} {kind} rank{'s' if options.num_ranks > 1 else ''} ({backend})"


def steps_phrase(num_steps: int) -> str:
    """E.g. "1 step", "60 steps"."""
    return f"{num_steps} step{'' if num_steps == 1 else 's'}"


def model_phrase(num_parameters: int) -> str:
    """What the demo trains, in a user's words."""
    config = TransformerConfig()
    return (
        f"a small transformer ({config.layers} blocks, width {config.hidden}, {num_parameters / 1e6:.1f}M "
        "parameters) learning a synthetic next-token task"
    )


def final_loss_definition(num_steps: int) -> str:
    """What the table's "final loss" is, in words."""
    window = min(FINAL_WINDOW, num_steps)
    return f"mean of the last {window} steps' training losses" if window > 1 else "the one step's training loss"


@dataclass(frozen=True)
class TrainingRow:
    run: str
    final_loss: float  # mean of the last FINAL_WINDOW steps' losses
    vs_bf16: float  # final_loss / bf16's final loss - 1
    bound: float | None  # |vs_bf16| <= bound passes; None for bf16
    passed: bool | None  # None for bf16 and for runs shorter than VERDICT_MIN_STEPS
    gemms: str  # "bf16", "emulated" or "torch._scaled_mm" (quant_tensors.ops.scaled_mm_path)
    step_ms: float  # median step time
    tokens_per_s: float  # tokens of the global batch / median step time
    gathered_mib_per_step: float  # bytes the all-gathers delivered to one rank per step (median)
    gathered_vs_bf16: float | None  # None on one rank: FSDP2 gathers nothing there
    weight_mib: float  # bytes of the Linear weight shards one rank stores
    peak_memory_gib: float | None  # rank 0's torch.cuda.max_memory_allocated; None on the CPU
    fallbacks: int  # weights gathered in high precision (quant_fsdp's alignment policy)
    losses: list[float]


@dataclass(frozen=True)
class TrainingResult:
    rows: list[TrainingRow]
    loss_floor: float  # the Markov chain's entropy: the lowest mean loss any model can reach
    num_parameters: int

    @property
    def passed(self) -> bool:
        return all(r.passed is not False for r in self.rows)


def demo_recipe(name: str) -> qt.Recipe:
    """The recipe `name` as the demo trains it: 2-D-scaled weights (per-tensor FP8, 128x128, 16x16)
    keep rowwise data only and derive columnwise for each dgrad GEMM ([Note: on-demand columnwise]
    in quant_tensors.quantizer): half the weight memory. MXFP8 weights keep both usages."""
    recipe = qt.recipe_from_name(name)
    if not recipe.quantizer("weight").can_derive_columnwise:
        return recipe
    return replace(recipe, weight_columnwise_on_demand=True)


def _linear_shard_bytes(model: torch.nn.Module) -> int:
    total = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            local = qt.local_shard(module.weight)
            buffers = local.buffers().values() if isinstance(local, qt.QuantizedTensor) else [local]
            total += sum(b.numel() * b.element_size() for b in buffers if b is not None)
    return total


def _train_one(recipe: str | None, options: DemoOptions, rank: int, world_size: int, progress: Progress | None) -> dict:
    device = torch.device("cuda", rank) if options.device == "cuda" else torch.device("cpu")
    torch.manual_seed(options.seed)  # every rank and every run starts from the same weights
    model = TinyTransformer().to(torch.bfloat16).to(device)
    shard = torch_fully_shard
    if recipe is not None:
        qt.convert(model, demo_recipe(recipe), quantized_weights=True)
        shard = quant_fsdp.fully_shard
    for block in model.blocks:
        shard(block)
    shard(model)
    plans = [] if recipe is None else quant_fsdp.gather_plan(model)
    name = recipe or "bf16"
    task_id = None if progress is None else progress.add_task(name, total=options.num_steps, loss="")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    losses, times, gathered = [], [], []
    with count_all_gather_bytes() as counted:
        # A step's time and bytes run from the end of the previous step's report to its own (the
        # loop reads the loss with .item(), which waits for the GPU); the first step's time holds
        # the loop's set-up too (fp32 masters, the run's batches), which the median leaves out.
        last_time, last_bytes = time.perf_counter(), 0

        def report(step: int, loss: float) -> None:
            nonlocal last_time, last_bytes
            times.append(time.perf_counter() - last_time)
            gathered.append(counted.bytes - last_bytes)
            losses.append(loss)
            if progress is not None:
                window = statistics.fmean(losses[-FINAL_WINDOW:])
                progress.update(task_id, advance=1, loss=f"{window:.3f}")
            last_time, last_bytes = time.perf_counter(), counted.bytes

        # On the CPU the recipes' GEMMs run in fp32 (emulated); bf16's do too, with its bf16 operands
        # and output ([Note: bf16 GEMMs on CPUs without bf16 instructions] in quant_lab.demo._cpu_gemms).
        fp32_gemms = recipe is None and device.type == "cpu"
        with bf16_gemms_in_fp32() if fp32_gemms else contextlib.nullcontext():
            train(
                model,
                MarkovTask(seed=options.seed),
                steps=options.num_steps,
                batch_size=BATCH,
                lr=LEARNING_RATE,
                batch_slice=(rank, world_size),
                on_step=report,
            )
    return {
        "losses": losses,
        "step_s": statistics.median(times),
        "gathered_bytes_per_step": statistics.median(gathered),
        "weight_bytes": _linear_shard_bytes(model),
        "peak_memory_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        "fallbacks": sum(not p.quantized_gather for p in plans),
    }


def _train_all(rank: int, world_size: int, options: DemoOptions, result_path: str) -> None:
    progress = None
    if rank == 0:
        window = min(FINAL_WINDOW, options.num_steps)
        loss = f"loss (mean of the last {window} steps)" if window > 1 else "loss"
        progress = Progress(
            TextColumn("{task.description:12}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn(f"{loss} {{task.fields[loss]}}"),
            TimeElapsedColumn(),
            console=Console(),
        )
        progress.start()
    results = {}
    try:
        for recipe in (None, *options.recipes):
            results[recipe or "bf16"] = _train_one(recipe, options, rank, world_size, progress)
    finally:
        if progress is not None:
            progress.stop()
    if rank == 0:
        pathlib.Path(result_path).write_text(json.dumps(results))


def _ratio(value: float, reference: float) -> float | None:
    return value / reference if reference else None


def _gemm_path(recipe: str, device: str) -> str:
    """The forward GEMM's implementation for `recipe` on `device` (a 64x256 input, a 256x256 weight)."""
    quantizers = qt.recipe_from_name(recipe)
    x = torch.randn(64, 256, dtype=torch.bfloat16, device=device)
    w = torch.randn(256, 256, dtype=torch.bfloat16, device=device)
    return qt.ops.scaled_mm_path(quantizers.quantizer("input").quantize(x), quantizers.quantizer("weight").quantize(w))


def run_training(options: DemoOptions) -> TrainingResult:
    """FSDP2-trains bf16 and `options.recipes` on `options.num_ranks` ranks; rank 0 shows progress."""
    with tempfile.TemporaryDirectory() as tmp:
        result_path = pathlib.Path(tmp) / "results.json"
        backend = "nccl" if options.device == "cuda" else "gloo"
        run_ranks(_train_all, options.num_ranks, options, str(result_path), backend=backend)
        results = json.loads(result_path.read_text())
    tokens_per_step = BATCH * TransformerConfig().sequence
    bf16 = results["bf16"]
    bf16_final = statistics.fmean(bf16["losses"][-FINAL_WINDOW:])
    rows = []
    for run, r in results.items():
        final = statistics.fmean(r["losses"][-FINAL_WINDOW:])
        vs_bf16 = final / bf16_final - 1
        bound = LOSS_BOUND.get(run)
        rows.append(
            TrainingRow(
                run,
                final_loss=final,
                vs_bf16=vs_bf16,
                bound=bound,
                passed=None if bound is None or options.num_steps < VERDICT_MIN_STEPS else abs(vs_bf16) <= bound,
                gemms="bf16" if run == "bf16" else _gemm_path(run, options.device),
                step_ms=r["step_s"] * 1e3,
                tokens_per_s=tokens_per_step / r["step_s"],
                gathered_mib_per_step=r["gathered_bytes_per_step"] / 2**20,
                gathered_vs_bf16=_ratio(r["gathered_bytes_per_step"], bf16["gathered_bytes_per_step"]),
                weight_mib=r["weight_bytes"] / 2**20,
                peak_memory_gib=None if r["peak_memory_bytes"] is None else r["peak_memory_bytes"] / 2**30,
                fallbacks=r["fallbacks"],
                losses=r["losses"],
            )
        )
    num_parameters = sum(p.numel() for p in TinyTransformer().parameters())
    return TrainingResult(rows, MarkovTask(seed=options.seed).entropy(), num_parameters)


def print_training_table(console: Console, result: TrainingResult, options: DemoOptions) -> None:
    """The table of part 1 and the lines that define its columns."""
    table = Table(
        title=f"{model_phrase(result.num_parameters)}\nFSDP2 on {ranks_phrase(options)}, "
        f"{steps_phrase(options.num_steps)} of {BATCH}x{TransformerConfig().sequence} tokens, seed {options.seed}"
    )
    on_gpu = options.device == "cuda"
    columns = ["run", "final loss", "vs bf16", "bound", "verdict", "tokens/s", "step ms", "gathered MiB/step"]
    columns += ["weights MiB/rank", *(["peak GiB"] if on_gpu else []), "fallbacks"]
    for column in columns:
        table.add_column(column, justify="left" if column in ("run", "verdict") else "right")
    too_short = options.num_steps < VERDICT_MIN_STEPS
    for r in result.rows:
        verdict = {None: "-", True: "[green]PASS[/green]", False: "[red]FAIL[/red]"}[r.passed]
        if r.bound is not None and too_short:
            verdict = f"none (< {VERDICT_MIN_STEPS} steps)"
        step = f"{r.step_ms:.1f}" + (" (emulated GEMMs)" if r.gemms == "emulated" else "")
        cells = [
            r.run,
            f"{r.final_loss:.4f}",
            "-" if r.run == "bf16" else f"{r.vs_bf16:+.2%}",
            "-" if r.bound is None else f"±{r.bound:.0%}",
            verdict,
            f"{r.tokens_per_s:,.0f}",
            step,
            f"{r.gathered_mib_per_step:.2f}" + ("" if r.gathered_vs_bf16 is None else f" ({r.gathered_vs_bf16:.2f}x)"),
            f"{r.weight_mib:.2f}",
            *([f"{r.peak_memory_gib:.2f}"] if on_gpu else []),
            str(r.fallbacks),
        ]
        table.add_row(*cells)
    console.print(table)
    bf16_final = result.rows[0].final_loss
    emulated = any(r.gemms == "emulated" for r in result.rows)
    for line in (
        f"final loss: {final_loss_definition(options.num_steps)} (cross-entropy, nats per token, global batch); "
        "the progress bars show the same mean.",
        "vs bf16: final loss / bf16's final loss - 1. verdict: PASS when within ± bound, the demo's sanity bound for a "
        "short run (a recipe that trains stays within it), not a parity bound: docs/benchmarks.md, 'Loss parity "
        "bounds', says what each bound checks.",
        *(
            [
                f"The verdict needs at least {VERDICT_MIN_STEPS} steps (this run has {options.num_steps}): the final "
                f"losses it compares are means of {FINAL_WINDOW} steps' losses."
            ]
            if too_short
            else []
        ),
        f"The task's loss floor is {result.loss_floor:.3f}: the entropy of the random Markov chain that generates "
        f"its tokens, the lowest loss any model can reach (bf16 is {bf16_final - result.loss_floor:.3f} above it "
        f"after {steps_phrase(options.num_steps)}).",
        "tokens/s: the global batch's tokens / the median step time (step ms), all ranks together.",
        *(
            [
                "emulated GEMMs: no FP8/FP4 matmul for this format on this device, so the operands are dequantized "
                "and multiplied in high precision (on a GPU slower than bf16's GEMMs; on the CPU bf16's multiply in "
                "fp32 too, from its bf16 operands)."
            ]
            if emulated
            else []
        ),
        "gathered: bytes FSDP2's all-gathers deliver to one rank per step (x bf16's); the Linear weights travel "
        "quantized, norms, embeddings and biases in bf16.",
        "weights: bytes of the Linear weight shards one rank stores. fallbacks: weights gathered in high precision "
        "(shard rows off the format's block boundaries).",
        *(["peak GiB: rank 0's torch.cuda.max_memory_allocated over the run."] if on_gpu else []),
    ):
        console.print(line, highlight=False)


def plot_losses(console: Console, result: TrainingResult, options: DemoOptions, path: pathlib.Path) -> bool:
    """demo_loss.png: the loss curves above, each recipe's loss relative to bf16's below, with its
    bound. Returns False (and says why) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FixedLocator, FuncFormatter, MaxNLocator, NullLocator
    except ImportError:
        console.print("[yellow]no loss plot: matplotlib is not installed (pip install matplotlib)[/yellow]")
        return False
    figure, (losses, gaps) = plt.subplots(2, 1, figsize=(10, 10), sharex=True, height_ratios=(1, 1.2))
    steps = range(1, options.num_steps + 1)
    bf16 = result.rows[0].losses
    window = min(FINAL_WINDOW, options.num_steps)
    line_styles = ("-", "--", "-.", ":", (0, (5, 1, 1, 1)))
    smoothed_extremes = [0.0]
    for index, r in enumerate(result.rows):
        if r.run == "bf16":  # wide and pale under the recipes, which mostly lie on it
            losses.plot(steps, r.losses, label="bf16 (baseline)", color="black", linewidth=4, alpha=0.3)
            continue
        color, style = f"C{index - 1}", line_styles[(index - 1) % len(line_styles)]
        losses.plot(steps, r.losses, label=r.run, color=color, linestyle=style, linewidth=1.3)
        per_step = [100 * (loss / reference - 1) for loss, reference in zip(r.losses, bf16, strict=True)]
        gaps.plot(steps, per_step, color=color, linewidth=0.7, alpha=0.3)
        smoothed = [100 * (_trailing_mean(r.losses, s, window) / _trailing_mean(bf16, s, window) - 1) for s in steps]
        smoothed_extremes += [abs(v) for v in smoothed]
        gaps.plot(
            steps, smoothed, color=color, linestyle=style, linewidth=1.8, label=f"{r.run} (final {r.vs_bf16:+.2%})"
        )
    losses.axhline(result.loss_floor, color="grey", linestyle=":", linewidth=1.0)
    losses.annotate(
        f"loss floor {result.loss_floor:.2f} (the task's entropy)",
        (1, result.loss_floor),
        xytext=(0, 4),
        textcoords="offset points",
        horizontalalignment="left",
        color="grey",
        fontsize=9,
    )
    losses.set(ylabel="training loss (nats/token)", title="training loss per step (every run sees the same batches)")
    losses.set_ylim(bottom=min(result.loss_floor, *(min(r.losses) for r in result.rows)) - 0.1)
    losses.legend(title="run", fontsize=9)
    bounds = sorted({r.bound for r in result.rows if r.bound is not None})
    for number, bound in enumerate(bounds):
        dash = ("--", "-.", ":")[number % 3]
        names = ", ".join(r.run for r in result.rows if r.bound == bound)
        for sign in (1, -1):
            gaps.axhline(
                sign * 100 * bound,
                color="dimgrey",
                linestyle=dash,
                linewidth=1.0,
                label=f"bound ±{bound:.0%} ({names})" if sign > 0 else None,
            )
    gaps.axhline(0, color="black", linewidth=0.8)
    # Symmetric log scale, linear within ±0.5%: recipes a few 0.1% apart stay apart while the
    # bounds (3%, 6%) stay on the panel.
    limit = max(1.25 * 100 * max(bounds, default=0.03), 1.1 * max(smoothed_extremes))
    gaps.set_ylim(-limit, limit)
    gaps.set_yscale("symlog", linthresh=0.5, linscale=1.0)
    marks = {0.0, 0.25, 0.5, 1.0, *(100 * b for b in bounds)}
    gaps.yaxis.set_major_locator(FixedLocator(sorted({sign * m for m in marks for sign in (1, -1)})))
    gaps.yaxis.set_minor_locator(NullLocator())
    gaps.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:+g}%" if value else "0%"))
    gaps.set(
        xlabel="step",
        ylabel="loss / bf16's loss - 1\n(symmetric log scale, linear within ±0.5%)",
        title=f"loss relative to bf16: bold = mean of the last {window} steps (ends at the table's value), "
        "faint = each step",
    )
    gaps.legend(fontsize=9, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.14))
    gaps.xaxis.set_major_locator(MaxNLocator(integer=True, steps=[1, 2, 5, 10]))
    for axis in (losses, gaps):
        axis.grid(alpha=0.3)
    figure.suptitle(
        f"quant-fsdp demo: {model_phrase(result.num_parameters)}\nFSDP2 on {ranks_phrase(options)}, seed {options.seed}"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def _trailing_mean(values: list[float], step: int, window: int) -> float:
    """Mean of values[step - window : step] (fewer at the start): the final loss at `step`."""
    return statistics.fmean(values[max(0, step - window) : step])
