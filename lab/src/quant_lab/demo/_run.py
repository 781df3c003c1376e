"""`quant-fsdp demo`: the most complete end-to-end job the project can do today.

Part 1 (`run_training`, quant_lab.demo._training): trains the test transformer on the synthetic
Markov task with FSDP2 on `--nproc` ranks, bf16 and the chosen recipes (quantized primary weights),
and reports each recipe's final loss against bf16's with a PASS/FAIL verdict, tokens/s, step time,
all-gathered bytes per step and weight memory, with a loss plot.

Part 2 (below): quantizes the Linear weights of the same transformer shape with the weight formats
of the chosen recipes and every backend on this machine, and checks what FSDP2's quantized
all-gather will rely on:
- every backend's codes and scales equal the plain-torch reference bit for bit;
- a simulated gather over the same number of ranks (each dim-0 shard quantized on its own, with
  the all-reduced amax where the format has a per-tensor scale, then data and scales concatenated)
  equals quantizing the unsharded weight bit for bit, for every weight whose shard rows fall on
  the format's block boundaries; the others are counted as needing the high-precision fallback;
- the bytes a gather moves against bf16, and the round-trip error.
It prints both tables and a closing verdict, writes `demo.json` (with the run's metadata),
`demo_gather.json` and `demo_loss.png`; the exit code is 1 if any check fails.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import pathlib
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

import quant_core
import quant_fsdp
import quant_tensors as qt
from quant_lab.demo._model import TransformerConfig
from quant_lab.demo._training import (
    BATCH,
    FINAL_WINDOW,
    LEARNING_RATE,
    VERDICT_MIN_STEPS,
    DemoOptions,
    TrainingResult,
    final_loss_definition,
    plot_losses,
    print_training_table,
    run_training,
    steps_phrase,
)

_HIDDEN = 256
_LAYERS = 4
# (name, out_features, in_features) of each Linear in one transformer block.
_BLOCK_LINEARS = (
    ("qkv", 3 * _HIDDEN, _HIDDEN),
    ("proj", _HIDDEN, _HIDDEN),
    ("fc1", 4 * _HIDDEN, _HIDDEN),
    ("fc2", _HIDDEN, 4 * _HIDDEN),
)


@dataclass(frozen=True)
class WeightRecipe:
    """How one format quantizes a weight, whole or as a shard of a gathered whole."""

    name: str
    trained_as: tuple[str, ...]  # the demo's recipes whose weights take this format
    # (weight, global amax or None) -> (rowwise data, rowwise scales); scales concatenate along dim 0.
    quantize: Callable[[torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor]]
    dequantize: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
    reference: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    row_alignment: int  # shard rows must be a multiple of this (Quantizer.row_alignment) for its blocks to be its own
    per_tensor_amax: bool  # shards must agree on one amax first (the all-reduce)
    per_tensor_scale: bool  # one scale for the tensor: metadata, not gathered


def _fp8(x: torch.Tensor, amax: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    scale, scale_inv = quant_core.fp8_scale(quant_core.amax(x) if amax is None else amax, torch.float8_e4m3fn)
    return quant_core.cast_to_fp8(x, scale, torch.float8_e4m3fn)[0], scale_inv.reshape(1)


def _fp8_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q = quant_core.quantize_fp8_reference(x)
    return q.rowwise_data, q.scale_inv.reshape(1)


def _block(result: quant_core.BlockQuantized) -> tuple[torch.Tensor, torch.Tensor]:
    return result.rowwise_data, result.rowwise_scale_inv


_RECIPES = (
    WeightRecipe(
        "fp8 per-tensor",
        ("fp8", "fp8-delayed"),
        _fp8,
        lambda d, s, amax: quant_core.dequantize_fp8(d, s.reshape(())),
        _fp8_reference,
        row_alignment=1,
        per_tensor_amax=True,
        per_tensor_scale=True,
    ),
    WeightRecipe(
        "mxfp8 1x32",
        ("mxfp8",),
        lambda x, amax: _block(quant_core.quantize_mxfp8(x)),
        lambda d, s, amax: quant_core.dequantize_mxfp8(d, s),
        lambda x: _block(quant_core.quantize_mxfp8_reference(x)),
        row_alignment=1,
        per_tensor_amax=False,
        per_tensor_scale=False,
    ),
    WeightRecipe(
        "fp8 blockwise 128x128",
        ("fp8-block",),
        lambda x, amax: _block(quant_core.quantize_fp8_blockwise(x, (128, 128))),
        lambda d, s, amax: quant_core.dequantize_fp8_blockwise(d, s, (128, 128)),
        lambda x: _block(quant_core.quantize_fp8_blockwise_reference(x, (128, 128))),
        row_alignment=128,
        per_tensor_amax=False,
        per_tensor_scale=False,
    ),
    WeightRecipe(
        "nvfp4 16x16",
        ("nvfp4",),
        lambda x, amax: _block(quant_core.quantize_nvfp4(x, (16, 16), global_amax=amax)),
        lambda d, s, amax: quant_core.dequantize_nvfp4(d, s, amax, (16, 16)),
        lambda x: _block(quant_core.quantize_nvfp4_reference(x, (16, 16))),
        row_alignment=16,
        per_tensor_amax=True,
        per_tensor_scale=False,
    ),
)


@dataclass(frozen=True)
class DemoRow:
    recipe: str
    backend: str
    quantize_ms: float
    gather_bytes_vs_bf16: float
    relative_error: float
    equals_reference: bool
    sharded_gathers_equal: int  # weights whose simulated sharded gather equals the whole, bit for bit
    fallbacks: int  # weights whose shard rows miss the block boundaries
    sharded_gathers_differ: int  # aligned weights whose gather did not match (a failure)


def _weights(seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    weights = {}
    for layer in range(_LAYERS):
        for name, out_features, in_features in _BLOCK_LINEARS:
            linear = torch.nn.Linear(in_features, out_features, bias=False)
            weights[f"layers.{layer}.{name}.weight"] = linear.weight.detach().to(torch.bfloat16)
    return weights


def _sharded_gather(recipe: WeightRecipe, weight: torch.Tensor, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What FSDP2's all-gather of quantized shards yields: each rank quantizes its dim-0 shard."""
    shards = weight.chunk(world_size, dim=0)
    amax = torch.stack([quant_core.amax(s) for s in shards]).max() if recipe.per_tensor_amax else None  # all-reduce
    parts = [recipe.quantize(shard, amax) for shard in shards]
    data = torch.cat([d.view(torch.uint8) for d, _ in parts])  # the all-gather of bytes along dim 0
    scales = parts[0][1] if recipe.per_tensor_scale else torch.cat([s for _, s in parts])
    return data, scales


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _evaluate(weights: dict[str, torch.Tensor], recipe: WeightRecipe, backend: str, world_size: int) -> DemoRow:
    with quant_core.use_backend(backend):
        start = time.perf_counter()
        quantized = {k: recipe.quantize(w, None) for k, w in weights.items()}
        seconds = time.perf_counter() - start
        matches = fallbacks = mismatches = 0
        for k, w in weights.items():
            if (w.shape[0] // world_size) % recipe.row_alignment or w.shape[0] % world_size:
                fallbacks += 1
                continue
            data, scales = _sharded_gather(recipe, w, world_size)
            ok = _same(data, quantized[k][0]) and _same(scales, quantized[k][1])
            matches, mismatches = matches + ok, mismatches + (not ok)
    equals_reference = True
    error_sq = norm_sq = 0.0
    gathered_bytes = 0
    for k, w in weights.items():
        data, scales = quantized[k]
        reference_data, reference_scales = recipe.reference(w)
        equals_reference &= _same(data, reference_data) and _same(scales, reference_scales)
        amax = quant_core.amax(w)
        restored = recipe.dequantize(data, scales, amax)
        error_sq += float((restored - w.float()).square().sum())
        norm_sq += float(w.float().square().sum())
        gathered_bytes += data.numel() * data.element_size() + scales.numel() * scales.element_size()
    bf16_bytes = 2 * sum(w.numel() for w in weights.values())
    return DemoRow(
        recipe.name,
        backend,
        seconds * 1e3,
        gathered_bytes / bf16_bytes,
        (error_sq / norm_sq) ** 0.5,
        equals_reference,
        matches,
        fallbacks,
        mismatches,
    )


def run_demo(out: pathlib.Path, options: DemoOptions) -> int:
    """Runs both parts, prints their tables and a closing verdict, writes demo.json, demo_gather.json
    and demo_loss.png into `out`; returns the exit code (1 if a check failed)."""
    console = Console(width=None if sys.stdout.isatty() else 160)  # logs: no wrapped tables
    try:
        training = run_training(options)
    except KeyboardInterrupt:  # the ranks are ended (run_ranks); rank 0's progress bars hid the cursor
        if console.is_terminal:
            console.show_cursor(True)
            console.line()
        raise
    print_training_table(console, training, options)
    plot_losses(console, training, options, out / "demo_loss.png")
    gathers_passed = run_gather_checks(console, out, options)
    passed = training.passed and gathers_passed
    report = {
        "metadata": _metadata(options),
        "definitions": _definitions(options),
        "loss_floor": training.loss_floor,
        "passed": passed,
        "runs": [asdict(r) for r in training.rows],
    }
    (out / "demo.json").write_text(json.dumps(report, indent=2) + "\n")
    console.print(_verdict(training, gathers_passed, options), highlight=False)
    return 0 if passed else 1


def _verdict(training: TrainingResult, gathers_passed: bool, options: DemoOptions) -> str:
    """The closing line: PASS, FAIL with what failed, or no loss verdict for a run too short for one."""
    failed = [f"{r.run} {r.vs_bf16:+.2%} vs bf16 (bound ±{r.bound:.0%})" for r in training.rows if r.passed is False]
    if not gathers_passed:
        failed.append("a kernel or sharded-gather check (see the second table)")
    if failed:
        return f"[red]FAIL[/red]: {'; '.join(failed)}."
    checks = "kernels equal their references, sharded gathers the whole."
    if options.num_steps < VERDICT_MIN_STEPS:
        return (
            f"No loss verdict: it needs at least {VERDICT_MIN_STEPS} steps, this run has "
            f"{options.num_steps} (--steps); {checks}"
        )
    return (
        f"[green]PASS[/green]: every recipe ({', '.join(options.recipes)}) within its loss bound of bf16 after "
        f"{steps_phrase(options.num_steps)}; {checks}"
    )


def _definitions(options: DemoOptions) -> dict[str, str]:
    return {
        "final_loss": final_loss_definition(options.num_steps) + " (cross-entropy, nats per token, global batch)",
        "vs_bf16": "final_loss / bf16's final_loss - 1; passed when abs(vs_bf16) <= bound (null for bf16 and "
        f"when the run has fewer than {VERDICT_MIN_STEPS} steps)",
        "bound": "the demo's sanity bound for a short run, not a parity bound (docs/benchmarks.md, 'Loss parity "
        "bounds')",
        "loss_floor": "entropy of the task's Markov chain: the lowest loss any model can reach",
        "tokens_per_s": "tokens of the global batch / median step time, all ranks together",
        "gathered_mib_per_step": "bytes FSDP2's all-gathers deliver to one rank per step (median)",
        "weight_mib": "bytes of the Linear weight shards one rank stores",
        "peak_memory_gib": "rank 0's torch.cuda.max_memory_allocated (null on the CPU)",
        "gemms": "the forward GEMM's implementation (quant_tensors.ops.scaled_mm_path)",
    }


def _metadata(options: DemoOptions) -> dict[str, object]:
    """What reproduces the run: the command, the options, versions, device and date."""
    return {
        "command": options.command,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": options.device,
        "device_name": torch.cuda.get_device_name(0) if options.device == "cuda" else f"{platform.machine()} cpu",
        "nproc": options.num_ranks,
        "steps": options.num_steps,
        "seed": options.seed,
        "recipes": list(options.recipes),
        "global_batch": {"sequences": BATCH, "tokens_per_sequence": TransformerConfig().sequence},
        "learning_rate": LEARNING_RATE,
        "final_window": FINAL_WINDOW,
        "versions": {
            "torch": torch.__version__,
            "quant-core": quant_core.__version__,
            "quant-tensors": qt.__version__,
            "quant-fsdp": quant_fsdp.__version__,
            "quant-optim": _installed_version("quant-optim"),  # a sibling package: never imported here
        },
    }


def _installed_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def run_gather_checks(console: Console, out: pathlib.Path, options: DemoOptions) -> bool:
    """Part 2: kernel checks and the simulated sharded gather of the chosen recipes' weight
    formats over `options.num_ranks` ranks; writes demo_gather.json. Returns whether all passed."""
    world_size = options.num_ranks
    weights = _weights(options.seed)
    recipes = [r for r in _RECIPES if set(r.trained_as) & set(options.recipes)]
    backends = quant_core.available_backends("cpu")
    rows = []
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("quantizing", total=len(recipes) * len(backends))
        for recipe in recipes:
            for backend in backends:
                progress.update(task, description=f"{recipe.name} on {backend}")
                rows.append(_evaluate(weights, recipe, backend, world_size))
                progress.advance(task)
    numel = sum(w.numel() for w in weights.values())
    table = Table(
        title=f"The {len(weights)} Linear weights of the transformer's blocks ({numel / 1e6:.1f}M parameters, bf16), "
        f"simulated {world_size}-rank FSDP2 gather"
    )
    for column in ("recipe", "backend", "ms", "bytes/bf16", "rel err", "=ref", "shards=full", "fallback"):
        table.add_column(column, justify="left" if column in ("recipe", "backend") else "right")
    for r in rows:
        gathers = f"{r.sharded_gathers_equal}/{r.sharded_gathers_equal + r.sharded_gathers_differ}"
        table.add_row(
            r.recipe,
            r.backend,
            f"{r.quantize_ms:.1f}",
            f"{r.gather_bytes_vs_bf16:.3f}",
            f"{r.relative_error:.4f}",
            "yes" if r.equals_reference else "[red]NO[/red]",
            gathers if not r.sharded_gathers_differ else f"[red]{gathers}[/red]",
            str(r.fallbacks),
        )
    console.print(table)
    for line in (
        "backend: the quant_core kernels that quantized, reference (plain torch) or cpp (C++). ms: time to quantize "
        "all the weights once.",
        "bytes/bf16: bytes a gather moves (codes and scales) / bf16's. rel err: ||dequantized - weight|| / "
        "||weight|| over all the weights.",
        "=ref: codes and scales equal the plain-torch reference bit for bit. shards=full: weights whose gathered "
        "shards equal the unsharded quantization bit for bit.",
        "fallback: weights whose shard rows miss the format's block boundaries (quant_fsdp.fully_shard gathers "
        "those in high precision and quantizes after).",
    ):
        console.print(line, highlight=False)
    (out / "demo_gather.json").write_text(json.dumps([asdict(r) for r in rows], indent=2) + "\n")
    passed = all(r.equals_reference and not r.sharded_gathers_differ for r in rows)
    return passed
