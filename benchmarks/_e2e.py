"""The e2e benchmark (`python benchmarks/e2e.py`): train a Llama-style decoder on one device, bf16 vs torchao vs every recipe.

Every run builds a fresh model from the same seed (_e2e_model) and trains it on the
same batches of the Markov task. Runs are named `<base>[:<weights>]:<mode>`:
- base: `bf16`, `torchao-tensorwise`, `torchao-rowwise` (torchao.float8's
  `convert_to_float8_training`), or a recipe of ours (`qt.convert`);
- weights (recipes only): `hp` keeps high-precision weights, quantized every forward, stepped by
  torch.optim.AdamW (fused on CUDA); `qw` makes them quantized primary weights
  (`quantized_weights=True`) stepped by quant_optim.FusedAdam (fp32 masters and moments, or the
  state configuration a `+<states>` suffix names: FUSED_ADAM_STATES in _optimizer_states);
- mode: `eager`; `compiled` (`torch.compile(model)`); `fused` (recipes only: compiled with
  quant-core's compiled kernels "inductor", `_compile_modes`); or `graphed`: eager code whose
  whole training step (forward, backward, optimizer) is captured once in a CUDA graph and
  replayed ([Note: graphed runs]; CUDA only).
bf16 and torchao runs use torch.optim.AdamW too. The lm_head is never converted.

Per run: tokens/s from the median step time of `num_steps` steps after `num_warmup` warm-up
steps (on CUDA, CUDA events between steps, one synchronize at the end: a host-bound step shows as
its wall time, a device-bound one as its GPU time), ratios to bf16 eager and to torchao
tensorwise compiled of the same invocation, peak memory (torch.cuda.max_memory_allocated, reset
after the model is built), host CPU time per step (time.process_time over the timed steps; a
blocking synchronize inside a step spins and counts), and the
last step's loss. A run that raises becomes a row with its error; the others go on.

`--fidelity STEPS` trains each run for STEPS steps instead and compares final losses with bf16
eager's (_e2e_fidelity).
"""

from __future__ import annotations

import contextlib
import datetime
import fnmatch
import functools
import gc
import importlib.metadata
import itertools
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import TypeVar

import torch
import torch.nn.functional as F
from _compile_modes import COMPILED_MODES, compile_backend
from _e2e_model import (
    CONFIGS,
    MODEL_SOURCES,
    DecoderConfig,
    build_decoder,
    describe_model,
    resolve_model_source,
)
from _optimizer_states import FUSED_ADAM_STATES
from rich.console import Console
from rich.table import Table

import quant_core
import quant_tensors as qt
from quant_lab.demo import MarkovTask
from quant_optim import FusedAdam

# Variants of the named recipes, each run only when a --runs pattern names it ("nvfp4-rht", not "*"):
# NVFP4 with the random Hadamard transform on its wgrad operands ([Note: NVFP4 random Hadamard
# transform] in quant_core); fp8 whose forward GEMM accumulates without promotion, as torchao's
# does ([Note: fast accumulation] in quant_tensors.ops).
OPT_IN_RECIPES: dict[str, Callable[[], qt.Recipe]] = {
    "nvfp4-rht": lambda: qt.NVFP4BlockScaling(random_hadamard_transform=True),
    "fp8-fast": lambda: qt.Float8CurrentScaling(fprop_fast_accumulation=True),
}
RECIPES = ("fp8", "fp8-delayed", "mxfp8", "fp8-block", "nvfp4", *OPT_IN_RECIPES)
TORCHAO_RECIPES = ("tensorwise", "rowwise")
STATEFUL_WEIGHT_RECIPES = ("fp8-delayed",)  # weight quantizers with state (an amax history)
MODES = ("eager", "compiled", "fused", "graphed")
# Every eager run and the compiled runs docs/benchmarks.md's one-GPU table compares (~7 min on one H100).
DEFAULT_RUNS = "*:eager,bf16:compiled,torchao-tensorwise:compiled,fp8:*:compiled"
DEFAULT_FIDELITY_RUNS = "bf16:eager,*:hp:eager"
BF16_BASELINE = "bf16:eager"
BF16_COMPILED = "bf16:compiled"
TORCHAO_BASELINE = "torchao-tensorwise:compiled"
SEED = 0
LEARNING_RATE = 3e-4


@dataclass(frozen=True)
class RunSpec:
    """One training configuration: what converts the Linears, which weights, how the step runs."""

    base: str
    """"bf16", "torchao-<recipe>" or one of RECIPES (`recipe_of`)."""
    quantized_weights: bool = False
    """Recipes only: quantized primary weights, stepped by quant_optim.FusedAdam."""
    mode: str = "eager"
    """One of MODES: eager, torch.compile(model) (with quant-core's fused kernels: `fused`), or the
    eager step captured in a CUDA graph."""
    states: str = ""
    """Quantized weights only: FusedAdam's state configuration, a key of FUSED_ADAM_STATES ("":
    fp32 masters and moments)."""

    @property
    def name(self) -> str:
        weights = ("qw" if self.quantized_weights else "hp",) if self.base in RECIPES else ()
        return ":".join((self.base, *weights, self.mode)) + (f"+{self.states}" if self.states else "")


@dataclass(frozen=True, kw_only=True)
class E2EOptions:
    """How the e2e benchmark runs."""

    config: str = "default"
    """Model and batch size: a key of _e2e_model.CONFIGS."""
    num_steps: int = 8
    """Timed steps per run."""
    num_warmup: int = 3
    """Untimed steps before them (compilation happens here)."""
    device: str = "all"
    """"cuda", "cpu", or "all": CUDA when present, else the CPU."""
    model_source: str = "auto"
    """"transformers", "builtin", or "auto": transformers' LlamaForCausalLM when it imports."""
    compile_backend: str = "inductor"
    """torch.compile backend of the compiled runs ("aot_eager" traces without generating code)."""
    learning_rate: float = LEARNING_RATE
    """AdamW's learning rate (the fidelity runs reach it after a linear warm-up)."""
    init_seed: int = SEED
    """Seed of the initial weights (the batches stay the same): run-to-run spread of a recipe."""
    micro_batches: int = 1
    """Micro-batches per step: the batch split by sequences, gradients accumulated over them."""
    weight_cache: bool = False
    """Recipes with high-precision weights quantize each weight once per step, inside
    `qt.nn.weight_cache` around the micro-batches, instead of once per micro-batch."""
    command: str = ""
    """The command line, for the report."""

    def __post_init__(self) -> None:
        if self.config not in CONFIGS:
            raise ValueError(f"config must be one of {', '.join(CONFIGS)}, got {self.config!r}")
        if not 0 < self.learning_rate < 1:
            raise ValueError(f"learning rate must be in (0, 1), got {self.learning_rate}")
        if self.num_steps < 1 or self.num_warmup < 0:
            raise ValueError(f"need steps >= 1 and warmup >= 0, got {self.num_steps} and {self.num_warmup}")
        if self.model_source not in MODEL_SOURCES:
            raise ValueError(f"model must be one of {', '.join(MODEL_SOURCES)}, got {self.model_source!r}")
        batch = self.decoder.batch_size
        if self.micro_batches < 1 or batch % self.micro_batches:
            raise ValueError(
                f"micro-batches must divide the batch of {batch} sequences ({self.config} config), got {self.micro_batches}"
            )

    @property
    def decoder(self) -> DecoderConfig:
        return CONFIGS[self.config]

    def torch_device(self) -> torch.device:
        if self.device == "cuda" and not torch.cuda.is_available():
            raise SystemExit("e2e.py --device cuda: no CUDA device is visible")
        return torch.device("cuda" if self.device != "cpu" and torch.cuda.is_available() else "cpu")


@dataclass(frozen=True)
class E2ERow:
    """What one run measured; an error leaves the numbers None."""

    run: str
    tokens_per_s: float | None = None
    vs_bf16_eager: float | None = None
    vs_torchao_compiled: float | None = None
    """Over torchao float8 tensorwise compiled of the same invocation."""
    peak_memory_gib: float | None = None
    """torch.cuda.max_memory_allocated over the steps (CUDA only)."""
    host_ms_per_step: float | None = None
    step_ms: float | None = None
    """Median step time."""
    loss: float | None = None
    """The last step's loss."""
    error: str = ""
    """'<type>: <first line>' of what the run raised, or 'skipped: <why>'."""
    step_ms_all: list[float] = field(default_factory=list)
    """Each timed step's time (with processes per run: each process's median)."""
    vs_bf16_compiled: float | None = None
    """Over bf16 compiled of the same invocation."""
    tokens_per_s_spread: tuple[float, float] | None = None
    """With processes per run (`run_e2e_processes`): the lowest and highest process's tokens/s."""


def all_runs() -> list[RunSpec]:
    """Every run, in the order they execute and print."""
    bases = ("bf16", *(f"torchao-{r}" for r in TORCHAO_RECIPES))
    runs = [RunSpec(base, mode=mode) for base in bases for mode in MODES if mode != "fused"]
    runs += [RunSpec(recipe, qw, mode) for recipe in RECIPES for qw in (False, True) for mode in MODES]
    # A captured FusedAdam step cannot requantize weights whose quantizer keeps state (a skipped
    # step would change it): such recipes have no graphed run with quantized weights.
    runs = [r for r in runs if not (r.quantized_weights and r.mode == "graphed" and r.base in STATEFUL_WEIGHT_RECIPES)]
    # Graphed runs last: what a capture leaves allocated (e.g. cuBLAS's workspace for the side
    # stream) would count in the peak memory of every later run.
    return sorted(runs, key=lambda r: r.mode == "graphed")


def select_runs(patterns: str) -> list[RunSpec]:
    """The runs that comma-separated `patterns` name, in `all_runs` order.

    A pattern is a glob on run names (`*:compiled`, `torchao-*`, `fp8:qw:eager`) and also matches
    the names it prefixes up to a colon: `fp8` is fp8's four runs, `fp8:qw` its two with quantized
    weights. `all` is every run but those of OPT_IN_RECIPES, which only a pattern starting with
    their name selects. A pattern may end in `+<states>` (FUSED_ADAM_STATES): its quantized-weight
    runs with FusedAdam's states of that name (`fp8:qw:eager+m-fp8`). A pattern that matches
    nothing is a ValueError naming the runs.
    """
    runs = all_runs()
    names = [r.name for r in runs]
    chosen: list[RunSpec] = []
    for pattern, _, states in (p.strip().partition("+") for p in patterns.split(",")):
        pattern = "*" if pattern == "all" else pattern
        matched = [
            r
            for r in runs
            if (fnmatch.fnmatchcase(r.name, pattern) or fnmatch.fnmatchcase(r.name, f"{pattern}:*"))
            and (r.base not in OPT_IN_RECIPES or pattern.startswith(r.base))
        ]
        if not matched:
            raise ValueError(
                f"--runs: {pattern!r} matches no run. Runs: {', '.join(names)}. Patterns are comma-separated globs "
                "('fp8', 'fp8:qw', '*:compiled', 'torchao-*', 'all'), each optionally followed by +<states>"
            )
        if states:
            if states not in FUSED_ADAM_STATES:
                raise ValueError(
                    f"--runs: {pattern}+{states}: FusedAdam's state configurations are {', '.join(FUSED_ADAM_STATES)}"
                )
            if not all(r.quantized_weights for r in matched):
                raise ValueError(
                    f"--runs: {pattern}+{states} matches runs without quantized weights "
                    f"({', '.join(r.name for r in matched if not r.quantized_weights)}); only FusedAdam "
                    "(quantized weights) takes states"
                )
            matched = [replace(r, states=states) for r in matched]
        chosen += [r for r in matched if r not in chosen]
    order = {r.name: i for i, r in enumerate(runs)}
    return sorted(chosen, key=lambda r: (order[replace(r, states="").name], r.states))


def torchao_missing() -> str:
    """Why torchao float8 runs cannot run here, or ''."""
    try:
        import torchao.float8  # noqa: F401
    except Exception as error:  # an ImportError, or a torchao built for another torch
        return f"skipped: torchao.float8 does not import ({type(error).__name__}: {first_line(error)})"
    return ""


def recipe_of(base: str) -> qt.Recipe:
    """The recipe of a run's base: `qt.recipe_from_name`, or one of OPT_IN_RECIPES."""
    if base in OPT_IN_RECIPES:
        return OPT_IN_RECIPES[base]()
    return qt.recipe_from_name(base)


def _not_lm_head(module: torch.nn.Module, name: str) -> bool:
    return name != "lm_head"


def _optimizer(
    model: torch.nn.Module, spec: RunSpec, options: E2EOptions, device: torch.device
) -> torch.optim.Optimizer:
    """quant_optim.FusedAdam (the run's states) for quantized weights, else torch's AdamW (fused on
    CUDA); no weight decay; capturable for graphed runs."""
    capturable = spec.mode == "graphed"
    if spec.quantized_weights:
        states = FUSED_ADAM_STATES.get(spec.states, {})
        return FusedAdam(model.parameters(), lr=options.learning_rate, capturable=capturable, **states)
    fused = device.type == "cuda"
    return torch.optim.AdamW(
        model.parameters(), lr=options.learning_rate, weight_decay=0.0, fused=fused, capturable=capturable
    )


def loss_of(model: Callable[[torch.Tensor], object], inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The cross-entropy of the model's fp32 logits for `inputs` against `targets` (token ids)."""
    output = model(inputs)
    logits = getattr(output, "logits", output)  # transformers returns an output object
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def build_run(
    spec: RunSpec, options: E2EOptions, device: torch.device, source: str
) -> tuple[torch.nn.Module, torch.optim.Optimizer, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
    """(model, optimizer, step) of one run; `step(inputs, targets)` trains one step and returns the loss."""
    torch.manual_seed(options.init_seed)
    model = build_decoder(options.decoder, device, source)
    if spec.base.startswith("torchao-"):
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        recipe = Float8LinearConfig.from_recipe_name(spec.base.removeprefix("torchao-"))
        convert_to_float8_training(model, config=recipe, module_filter_fn=_not_lm_head)
    elif spec.base != "bf16":
        recipe = recipe_of(spec.base)
        qt.convert(model, recipe, quantized_weights=spec.quantized_weights, module_filter_fn=_not_lm_head)
    if spec.mode == "graphed" and device.type != "cuda":
        raise ValueError(f"{spec.name} captures CUDA graphs: run it with --device cuda")
    optimizer = _optimizer(model, spec, options, device)
    compiled = spec.mode in COMPILED_MODES
    forward = torch.compile(model, backend=compile_backend(options.compile_backend, spec.mode)) if compiled else model
    cached = options.weight_cache and spec.base in RECIPES and not spec.quantized_weights
    parts = options.micro_batches

    def step(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        losses = []
        with qt.nn.weight_cache(model) if cached else contextlib.nullcontext():
            for part_inputs, part_targets in zip(inputs.chunk(parts), targets.chunk(parts), strict=True):
                loss = loss_of(forward, part_inputs, part_targets)
                (loss / parts if parts > 1 else loss).backward()
                losses.append(loss.detach())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return losses[0] if parts == 1 else torch.stack(losses).mean()

    return model, optimizer, cuda_graphed(step, device) if spec.mode == "graphed" else step


# [Note: graphed runs] A `graphed` run is an eager run without its host time: its step (forward,
# backward, optimizer) is captured in one CUDA graph and replayed, as a user of an eager model
# would do with torch.cuda.graphs to remove launch overhead. The first GRAPH_WARMUP_STEPS steps
# run eagerly on a side stream (what capture needs: lazy initialisation, cuBLAS workspaces, the
# optimizer's states), the next one is captured and then replayed with its batch copied into the
# graph's input tensors, so every call still trains one step on its own batch. AdamW is made
# `capturable`. Everything the step runs must be capturable: no host syncs, no host-to-device
# copies of pageable memory; quant-core's operators are (their pointer tables are cached, [Note:
# pointer tables]). The cuda tests check that a graphed run trains bit for bit like the eager one.
GRAPH_WARMUP_STEPS = 2


@functools.cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """The warm-up stream of graphed runs, one per device for all of them (each new stream would
    get its own cuBLAS workspace, kept until the process ends)."""
    return torch.cuda.Stream(device)


def cuda_graphed(
    step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], device: torch.device
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """`step(inputs, targets) -> loss`, run eagerly for GRAPH_WARMUP_STEPS calls, then captured in
    a CUDA graph and replayed ([Note: graphed runs]); the returned loss is a copy."""
    side = _side_stream(device)
    eager_calls = 0
    captured: tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def graphed(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        nonlocal eager_calls, captured
        if eager_calls < GRAPH_WARMUP_STEPS:
            eager_calls += 1
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                loss = step(inputs, targets)
            torch.cuda.current_stream(device).wait_stream(side)
            return loss
        if captured is None:  # graph inputs: the first captured call's batch, refilled below
            graph, static_inputs, static_targets = torch.cuda.CUDAGraph(), inputs.clone(), targets.clone()
            with torch.cuda.graph(graph):
                static_loss = step(static_inputs, static_targets)
            captured = (graph, static_inputs, static_targets, static_loss)
        graph, static_inputs, static_targets, static_loss = captured
        static_inputs.copy_(inputs)
        static_targets.copy_(targets)
        graph.replay()
        return static_loss.clone()

    return graphed


def free_memory(device: torch.device) -> None:
    """Drops what a finished run left: compiled graphs, reference cycles, cached CUDA blocks."""
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_steps(
    step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    batches: torch.Tensor,
    options: E2EOptions,
    device: torch.device,
) -> tuple[list[float], float, float]:
    """(seconds of each timed step, host CPU seconds per timed step, last loss)."""
    for i in range(options.num_warmup):
        step(batches[i, :, :-1], batches[i, :, 1:])
    _synchronize(device)
    timed = range(options.num_warmup, options.num_warmup + options.num_steps)
    cpu_start = time.process_time()
    if device.type == "cuda":
        events = [torch.cuda.Event(enable_timing=True) for _ in range(len(timed) + 1)]
        events[0].record()
        for i, event in zip(timed, events[1:], strict=True):
            loss = step(batches[i, :, :-1], batches[i, :, 1:])
            event.record()
        host = time.process_time() - cpu_start
        torch.cuda.synchronize(device)
        seconds = [a.elapsed_time(b) * 1e-3 for a, b in itertools.pairwise(events)]
    else:
        marks = [time.perf_counter()]
        for i in timed:
            loss = step(batches[i, :, :-1], batches[i, :, 1:])
            marks.append(time.perf_counter())
        host = time.process_time() - cpu_start
        seconds = [b - a for a, b in itertools.pairwise(marks)]
    return seconds, host / len(timed), float(loss)


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:300] if text else ""


def measure_run(spec: RunSpec, batches: torch.Tensor, options: E2EOptions, device: torch.device, source: str) -> E2ERow:
    """Builds and times one run; what it raises becomes the row's error."""
    try:
        model, optimizer, step = build_run(spec, options, device, source)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        seconds, host, loss = _time_steps(step, batches, options, device)
    except Exception as error:  # a benchmark row, not a test: report it and go on
        return E2ERow(spec.name, error=f"{type(error).__name__}: {first_line(error)}")
    del model, optimizer, step
    median = statistics.median(seconds)
    return E2ERow(
        spec.name,
        tokens_per_s=options.decoder.tokens_per_step / median,
        peak_memory_gib=torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        host_ms_per_step=host * 1e3,
        step_ms=median * 1e3,
        loss=loss,
        step_ms_all=[s * 1e3 for s in seconds],
    )


def _with_ratios(rows: list[E2ERow]) -> list[E2ERow]:
    speeds = {r.run: r.tokens_per_s for r in rows}
    bf16, compiled, torchao = (speeds.get(b) for b in (BF16_BASELINE, BF16_COMPILED, TORCHAO_BASELINE))
    return [
        replace(
            r,
            vs_bf16_eager=r.tokens_per_s / bf16 if r.tokens_per_s and bf16 else None,
            vs_bf16_compiled=r.tokens_per_s / compiled if r.tokens_per_s and compiled else None,
            vs_torchao_compiled=r.tokens_per_s / torchao if r.tokens_per_s and torchao else None,
        )
        for r in rows
    ]


def _version_of(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment(options: E2EOptions, device: torch.device, source: str) -> dict[str, object]:
    """Device, versions, date, command, model and sizes: the header of both reports."""
    config = options.decoder
    return {
        "date": datetime.date.today().isoformat(),
        "command": options.command,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"{platform.machine()} cpu",
        "torch": torch.__version__,
        "triton": _version_of("triton"),
        "transformers": _version_of("transformers"),
        "torchao": _version_of("torchao"),
        "quant_core": quant_core.__version__,
        "quant_tensors": qt.__version__,
        "env": {k: os.environ[k] for k in ("QUANT_CORE_BACKEND", qt.COLUMNWISE_ON_DEMAND_ENV_VAR) if k in os.environ},
        "threads": torch.get_num_threads(),
        "model": describe_model(source),
        "config_name": options.config,
        "config": asdict(config),
        "num_parameters": config.num_parameters,
        "num_warmup": options.num_warmup,
        "num_steps": options.num_steps,
        "compile_backend": options.compile_backend,
        "learning_rate": options.learning_rate,
        "init_seed": options.init_seed,
        "micro_batches": options.micro_batches,
        "weight_cache": options.weight_cache,
    }


def header_lines(report: dict) -> list[str]:
    c = report["config"]
    versions = ", ".join(f"{k} {report[k]}" for k in ("torch", "triton", "transformers", "torchao") if report[k])
    return [
        f"- Device: {report['device']}; {versions}; quant-tensors {report['quant_tensors']}; {report['date']}.",
        f"- Command: `{report['command']}`" + (f" (environment: {report['env']})" if report["env"] else ""),
        f"- Model: {report['model']}, {format_count(report['num_parameters'])} parameters (vocab {c['vocab_size']}, "
        f"hidden {c['hidden_size']}, intermediate {c['intermediate_size']}, {c['num_layers']} layers, "
        f"{c['num_heads']} heads), bf16 parameters, lm_head never quantized; batch {c['batch_size']} x "
        f"{c['sequence_length']} tokens; initial weights from seed {report['init_seed']}." + _micro_batching(report),
    ]


def _micro_batching(report: dict) -> str:
    parts = report.get("micro_batches", 1)  # absent from reports written before micro-batching
    if parts == 1:
        return ""
    cache = (
        "recipes' high-precision weights quantized once per step (qt.nn.weight_cache; compiled graphs quantize per "
        "micro-batch)"
        if report["weight_cache"]
        else "weights quantized every micro-batch"
    )
    return f" {parts} micro-batches per step, gradients accumulated; {cache}."


def format_count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def format_value(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _cells(r: E2ERow) -> list[str]:
    tokens = None if r.tokens_per_s is None else r.tokens_per_s / 1e3
    spread = (
        "" if r.tokens_per_s_spread is None else " ({:.1f}-{:.1f}k)".format(*(t / 1e3 for t in r.tokens_per_s_spread))
    )
    return [
        r.run,
        format_value(tokens, ".1f", "k") + spread,
        format_value(r.vs_bf16_eager, ".2f", "x"),
        format_value(r.vs_bf16_compiled, ".2f", "x"),
        format_value(r.vs_torchao_compiled, ".2f", "x"),
        format_value(r.peak_memory_gib, ".1f"),
        format_value(r.host_ms_per_step, ".1f"),
        format_value(r.loss, ".4f"),
        r.error,
    ]


COLUMNS = (
    "run",
    "tokens/s",
    "vs bf16 eager",
    "vs bf16 compiled",
    "vs torchao tw compiled",
    "peak GiB",
    "host ms/step",
    "loss",
    "error",
)


def markdown(report: dict, rows: list[E2ERow]) -> str:
    """e2e.md: the header and one table row per run, ready for docs/benchmarks.md."""
    lines = [f"## End to end, {report['config_name']} configuration", "", *header_lines(report)]
    steps = f"{report['num_steps']} steps after {report['num_warmup']} warm-up steps"
    repeats = report.get("repeats", 1)
    lines.append(
        (
            f"- Each run in processes of its own, {repeats} per run, launched round-robin: tokens/s is the median "
            f"(spread: lowest-highest) of the processes' medians of {steps}; host ms/step and loss medians, "
            "peak GiB the highest."
            if repeats > 1
            else f"- Median of {steps}."
        )
        + " Host ms/step is process CPU time over the timed steps; peak GiB is torch.cuda.max_memory_allocated."
    )
    lines += ["", "| " + " | ".join(COLUMNS) + " |", "| --- |" + " ---: |" * (len(COLUMNS) - 2) + " --- |"]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in _cells(r)) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _table(report: dict, rows: list[E2ERow]) -> Table:
    c = report["config"]
    table = Table(
        title=f"End to end on {report['device']}: {report['model']}, {format_count(report['num_parameters'])}, "
        f"{c['batch_size']}x{c['sequence_length']} tokens, median of "
        + (f"{report['repeats']} processes' medians of " if report.get("repeats", 1) > 1 else "")
        + f"{report['num_steps']} steps"
    )
    for column in COLUMNS:
        table.add_column(column, justify="left" if column in ("run", "error") else "right")
    for r in rows:
        table.add_row(*_cells(r), style="red" if r.error and not r.error.startswith("skipped") else None)
    return table


def console_for_logs() -> Console:
    return Console(width=None if sys.stdout.isatty() else 160)  # logs: no wrapped tables


def markov_task(config: DecoderConfig, states: int | None = None) -> MarkovTask:
    """The Markov task over the configuration's vocabulary (visiting `states` ids of it, default all)."""
    return MarkovTask(config.vocab_size, seed=SEED, states=states)


def markov_batches(config: DecoderConfig, num_steps: int) -> torch.Tensor:
    """The token ids of steps 0 .. num_steps - 1 (the same for every run and invocation), on the CPU."""
    return markov_task(config).batches(range(num_steps), config.batch_size, config.sequence_length)


RowT = TypeVar("RowT")  # a benchmark's row type (E2ERow, the fidelity's FidelityRow)


def each_run(
    runs: Sequence[RunSpec],
    device: torch.device,
    console: Console,
    measure: Callable[[RunSpec], RowT],
    row_type: Callable[..., RowT],
) -> Iterator[RowT]:
    """Each run's row in turn: `measure(spec)`, then the device's memory freed; a torchao run where
    torchao does not import gets `row_type(name, error=why)` instead."""
    skipped = torchao_missing() if any(r.base.startswith("torchao-") for r in runs) else ""
    for index, spec in enumerate(runs, 1):
        console.print(f"[{index}/{len(runs)}] {spec.name} ...", highlight=False)
        if spec.base.startswith("torchao-") and skipped:
            yield row_type(spec.name, error=skipped)
        else:
            yield measure(spec)
            free_memory(device)


def run_e2e(out: pathlib.Path, runs: Sequence[RunSpec], options: E2EOptions, console: Console | None = None) -> int:
    """Times `runs`, prints the table, writes e2e.json and e2e.md to `out`; 1 if a run failed."""
    console = console or console_for_logs()
    device = options.torch_device()
    source = resolve_model_source(options.model_source)
    report = environment(options, device, source)
    batches = markov_batches(options.decoder, options.num_warmup + options.num_steps).to(device)
    rows = []
    for r in each_run(runs, device, console, lambda spec: measure_run(spec, batches, options, device, source), E2ERow):
        _print_outcome(console, r)
        rows.append(r)
    return _write_report(out, report, _with_ratios(rows), console)


def _print_outcome(console: Console, row: E2ERow) -> None:
    console.print(f"    {row.error or f'{row.tokens_per_s:,.0f} tokens/s, loss {row.loss:.4f}'}", highlight=False)


def _write_report(out: pathlib.Path, report: dict, rows: list[E2ERow], console: Console) -> int:
    """Prints the table, writes e2e.json and e2e.md to `out`; 1 if a run failed."""
    console.print(_table(report, rows))
    out.mkdir(parents=True, exist_ok=True)
    (out / "e2e.json").write_text(json.dumps({**report, "rows": [asdict(r) for r in rows]}, indent=2) + "\n")
    (out / "e2e.md").write_text(markdown(report, rows))
    failed = [r.run for r in rows if r.error and not r.error.startswith("skipped")]
    if failed:
        console.print(f"runs that failed: {', '.join(failed)}")
    return 1 if failed else 0


E2E_SCRIPT = pathlib.Path(__file__).with_name("e2e.py")


def fold_repeats(name: str, rows: Sequence[E2ERow]) -> E2ERow:
    """One run's row from the rows of its processes: the median tokens/s with its spread, the
    medians of step time, host time and loss, the highest peak; processes that failed are counted
    in the error."""
    good = [r for r in rows if not r.error]
    errors = [r.error for r in rows if r.error]
    if not good:
        return E2ERow(name, error=errors[0] if errors else "no process ran")
    speeds = [r.tokens_per_s for r in good]
    peaks = [r.peak_memory_gib for r in good if r.peak_memory_gib is not None]
    return E2ERow(
        name,
        tokens_per_s=statistics.median(speeds),
        tokens_per_s_spread=(min(speeds), max(speeds)),
        peak_memory_gib=max(peaks) if peaks else None,
        host_ms_per_step=statistics.median(r.host_ms_per_step for r in good),
        step_ms=statistics.median(r.step_ms for r in good),
        loss=statistics.median(r.loss for r in good),
        error=f"{len(errors)}/{len(rows)} processes failed: {errors[0]}" if errors else "",
        step_ms_all=[r.step_ms for r in good],
    )


def _one_process(name: str, argv: Sequence[str], folder: pathlib.Path) -> tuple[E2ERow, dict | None]:
    """Runs `e2e.py ARGV` (one run, its report into `folder`, its output into folder/e2e.log): the
    run's row and the report's header, or a row with the error when it wrote no report."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "e2e.json").unlink(missing_ok=True)
    with (folder / "e2e.log").open("w") as log:
        exit_code = subprocess.run(
            [sys.executable, str(E2E_SCRIPT), *argv], stdout=log, stderr=subprocess.STDOUT
        ).returncode
    report_path = folder / "e2e.json"
    if not report_path.exists():
        return E2ERow(name, error=f"exit code {exit_code} without a report ({folder / 'e2e.log'})"), None
    report = json.loads(report_path.read_text())
    (row,) = report.pop("rows")
    return E2ERow(**row), report


def run_e2e_processes(
    out: pathlib.Path,
    runs: Sequence[RunSpec],
    repeats: int,
    process_argv: Callable[[RunSpec, pathlib.Path], list[str]],
    command: str,
    console: Console | None = None,
) -> int:
    """Each run `repeats` times, each time in a process of its own (`e2e.py` with `process_argv(run,
    folder)`), the runs alternating (run 1, run 2, ..., run 1, ...); one row per run from its
    processes' rows (`fold_repeats`) into e2e.json and e2e.md in `out`, each process's own report
    and log in out/processes/. Returns 1 if a process failed."""
    console = console or console_for_logs()
    results: dict[str, list[E2ERow]] = {spec.name: [] for spec in runs}
    header: dict | None = None
    total, index = repeats * len(runs), 0
    for repeat in range(1, repeats + 1):
        for spec in runs:
            index += 1
            console.print(f"[{index}/{total}] {spec.name} (repeat {repeat}/{repeats}) ...", highlight=False)
            folder = out / "processes" / f"{spec.name.replace(':', '_')}.{repeat}"
            row, report = _one_process(spec.name, process_argv(spec, folder), folder)
            header = header or report
            _print_outcome(console, row)
            results[spec.name].append(row)
    rows = _with_ratios([fold_repeats(name, rows) for name, rows in results.items()])
    if header is None:
        console.print("no process wrote a report: see the logs in " + str(out / "processes"))
        return 1
    return _write_report(out, {**header, "command": command, "repeats": repeats}, rows, console)
