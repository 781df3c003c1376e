"""Part 1 of `quant-fsdp demo`: train the test transformer with bf16 and with every recipe."""

from __future__ import annotations

import json
import os
import pathlib
import time
from dataclasses import asdict, dataclass

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

import quant_tensors as qt
from quant_tensors.testing import MarkovTask, MasterWeights, TinyTransformer

RECIPES = ("fp8", "fp8-delayed", "mxfp8", "fp8-block", "nvfp4")
BATCH = 4
# Final-loss tolerance against bf16 (issue #5's parity bounds).
TOLERANCE = {"fp8": 0.03, "fp8-delayed": 0.03, "mxfp8": 0.03, "fp8-block": 0.03, "nvfp4": 0.06}


@dataclass(frozen=True)
class TrainingRow:
    run: str
    final_loss: float  # mean of the last 10 steps
    vs_bf16: float  # relative difference of the final loss
    step_ms: float  # median step time
    weight_mib: float  # bytes of the Linear weights as stored (quantized primary weights)
    losses: list[float]


def _linear_weight_bytes(model: torch.nn.Module) -> int:
    total = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            w = module.weight
            if isinstance(w, qt.QuantizedTensor):
                total += sum(b.numel() * b.element_size() for b in w.buffers().values() if b is not None)
            else:
                total += w.numel() * w.element_size()
    return total


def _train(
    recipe: str | None, task: MarkovTask, steps: int, progress: Progress
) -> tuple[list[float], list[float], int]:
    torch.manual_seed(0)
    model = TinyTransformer().to(torch.bfloat16)
    if recipe is not None:
        qt.convert(model, qt.recipe_from_name(recipe), quantized_weights=True)
    weight_bytes = _linear_weight_bytes(model)
    masters = MasterWeights(model)
    optimizer = torch.optim.AdamW(masters.parameters, lr=1e-3, weight_decay=0.0)
    task_id = progress.add_task(recipe or "bf16", total=steps)
    losses, times = [], []
    for step in range(steps):
        start = time.perf_counter()
        inputs, targets = task.batch(step, BATCH, model.config.sequence)
        logits = model(inputs)
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        for p, _ in masters.pairs:
            p.grad = None
        loss.backward()
        masters.step(optimizer)
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
        progress.update(task_id, advance=1, description=f"{recipe or 'bf16':12} loss {losses[-1]:.3f}")
    return losses, times, weight_bytes


def run_training(console: Console, out: pathlib.Path, *, steps: int) -> bool:
    """Trains bf16 and every recipe for `steps` steps; prints a table, writes demo.json and demo_loss.png."""
    # 2-D-scaled weights (per-tensor FP8, 128x128, 16x16) keep rowwise data only and derive
    # columnwise for each dgrad GEMM ([Note: on-demand columnwise]): half the weight memory.
    os.environ.setdefault(qt.COLUMNWISE_ON_DEMAND_ENV_VAR, "1")
    task = MarkovTask()
    rows: list[TrainingRow] = []
    with Progress(console=console) as progress:
        runs = [None, *RECIPES]
        results = {run: _train(run, task, steps, progress) for run in runs}
    bf16_final = sum(results[None][0][-10:]) / 10
    for run, (losses, times, weight_bytes) in results.items():
        final = sum(losses[-10:]) / 10
        step_ms = sorted(times)[len(times) // 2] * 1e3
        rows.append(
            TrainingRow(run or "bf16", final, (final - bf16_final) / bf16_final, step_ms, weight_bytes / 2**20, losses)
        )
    table = Table(
        title=f"TinyTransformer, {steps} steps of {BATCH}x64 tokens, single process (loss floor {task.entropy():.3f})"
    )
    for column in ("run", "final loss", "vs bf16", "step ms", "Linear weights MiB"):
        table.add_column(column, justify="left" if column == "run" else "right")
    passed = True
    for r in rows:
        ok = r.run == "bf16" or abs(r.vs_bf16) <= TOLERANCE[r.run]
        passed &= ok
        change = "" if r.run == "bf16" else f"{r.vs_bf16:+.2%}"
        table.add_row(
            r.run,
            f"{r.final_loss:.4f}",
            change if ok else f"[red]{change}[/red]",
            f"{r.step_ms:.1f}",
            f"{r.weight_mib:.2f}",
        )
    console.print(table)
    (out / "demo.json").write_text(json.dumps([asdict(r) for r in rows], indent=2) + "\n")
    console.print(f"wrote {out / 'demo.json'}")
    _plot(console, rows, out / "demo_loss.png")
    return passed


def _plot(console: Console, rows: list[TrainingRow], path: pathlib.Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        console.print("[yellow]no loss plot: matplotlib is not installed (pip install 'quant-fsdp[demo]')[/yellow]")
        return
    figure, axis = plt.subplots(figsize=(8, 5))
    for r in rows:
        axis.plot(r.losses, label=r.run, linewidth=1.2)
    axis.set_xlabel("step")
    axis.set_ylabel("training loss")
    axis.set_yscale("log")
    axis.set_title("TinyTransformer on the Markov task: bf16 vs quantized recipes")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    console.print(f"wrote {path}")
