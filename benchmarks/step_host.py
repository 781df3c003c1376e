"""`python benchmarks/step_host.py`: host cost of one FSDP2 training step, as Python calls by package and host ms.

A compiled FSDP2 step whose GEMMs are fast waits on its host: FSDP2's hooks, the quantized
weights' all-gather methods, the compiled graphs' runtime wrappers and the optimizer run Python
for every parameter and every layer, on the critical path. This benchmark builds the runs of
`multi_gpu.py` (torchtitan's layout: fp32 parameters, per-layer `compile` before `fully_shard` of
each decoder layer and of the root, `MixedPrecisionPolicy(bf16, fp32)`; `_multi_gpu_runs.build_run`)
in one process and, for each run, after `--warmup` steps:

- counts the Python function calls of one step (forward, backward, optimizer step, zero_grad)
  with `sys.setprofile`, by the package of the called function: FSDP2 (torch.distributed.fsdp),
  the compiled graphs' runtime (torch._dynamo, _functorch, _subclasses, _guards, fx: the
  AOTAutograd wrappers around each graph, and aot_eager's graph code), DTensor, autograd,
  torch.optim, the rest of torch, and each quant package. A call into the standard library or
  anything else counts for the package of the nearest caller that is one of those. Deterministic
  for a given torch and configuration, unlike wall time on a shared host;
- times `--steps` steps: host ms is the median time a step takes to issue (on CUDA the GPU is
  synchronized once, after the last one; where the host is the bottleneck this is the step time);
- with `--cprofile N`, prints the N entries of one more step's cProfile with the most cumulative time.

World size 1 in one process by default (gloo on the CPU, NCCL on CUDA); under `torchrun` every
rank trains and rank 0 prints. `--device cuda --model llama-2b` measures the 2.2B Llama's layers on
a GPU (`--num-layers` fewer of them for a quicker look).
"""

from __future__ import annotations

import contextlib
import cProfile
import io
import json
import os
import pathlib
import pstats
import statistics
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _arguments import Parser, positive, whole_number
from _multi_gpu_runs import MODELS, Options, all_run_names, build_run, parse_run, rank_batches
from torch.distributed.device_mesh import init_device_mesh

DEFAULT_RUNS = ("bf16:compiled", "fp8:hp:compiled", "fp8:qw:compiled", "fp8:qw-bf16:compiled")

# Where a called function lives, by path below torch's folder (first match wins) or by package.
_TORCH_PARTS = (
    ("distributed/fsdp/", "fsdp2"),
    ("distributed/tensor/", "dtensor"),
    ("_dynamo/", "compiled"),
    ("_functorch/", "compiled"),
    ("_subclasses/", "compiled"),
    ("_guards.py", "compiled"),
    ("fx/", "compiled"),
    ("_inductor/", "compiled"),
    ("autograd/", "autograd"),
    ("optim/", "torch.optim"),
    ("", "torch other"),
)
QUANT_PACKAGES = ("quant_tensors", "quant_fsdp", "quant_core", "quant_optim")
PACKAGES = ("fsdp2", "compiled", "dtensor", "autograd", "torch.optim", "torch other", *QUANT_PACKAGES)


def _package_dirs() -> dict[str, str]:
    """The folder of torch and of each quant package that imports, by package name."""
    dirs = {"torch": os.path.dirname(torch.__file__) + os.sep}
    for name in QUANT_PACKAGES:
        with contextlib.suppress(ImportError):
            dirs[name] = os.path.dirname(__import__(name).__file__) + os.sep
    return dirs


class CallCounter:
    """Counts Python function calls by package (PACKAGES) while active (`sys.setprofile`)."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self._dirs = _package_dirs()
        self._package_of_file: dict[str, str | None] = {}

    def _package(self, filename: str) -> str | None:
        package = self._package_of_file.get(filename, "")
        if package != "":
            return package
        package = None
        for name, folder in self._dirs.items():
            if filename.startswith(folder):
                relative = filename[len(folder) :]
                package = next(p for part, p in _TORCH_PARTS if relative.startswith(part)) if name == "torch" else name
                break
        self._package_of_file[filename] = package
        return package

    def _profile(self, frame, event, arg) -> None:  # type: ignore[no-untyped-def]
        if event != "call":
            return
        while frame is not None:
            package = self._package(frame.f_code.co_filename)
            if package is not None:
                self.counts[package] += 1
                return
            frame = frame.f_back

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        sys.setprofile(self._profile)
        try:
            yield
        finally:
            sys.setprofile(None)


@dataclass(frozen=True)
class StepHost:
    """One run's host cost per training step."""

    run: str
    calls: dict[str, int]
    """Python calls of one step by package (PACKAGES), and their "total"."""
    host_ms: float
    """Median time to issue one step, ms."""
    cprofile: str = ""
    """The top entries of one step's cProfile by cumulative time (with --cprofile)."""


def measure_run(
    run: str,
    options: Options,
    device: torch.device,
    mesh: torch.distributed.device_mesh.DeviceMesh,
    *,
    steps: int,
    cprofile_top: int = 0,
) -> StepHost:
    """Builds `run` (a multi_gpu.py run name), trains `options.num_warmup` steps, then counts one
    step's calls, times `steps` steps and, with `cprofile_top`, profiles one more."""
    spec = parse_run(run)
    model, optimizer, after_step = build_run(spec, options, device, mesh)
    batches = rank_batches(options.config, options.num_warmup + steps + 2, dist.get_rank(), dist.get_world_size())
    batches = batches.to(device)

    def step(i: int) -> None:
        output = model(batches[i, :, :-1])
        logits = getattr(output, "logits", output)  # transformers returns an output object
        F.cross_entropy(logits.flatten(0, 1).float(), batches[i, :, 1:].flatten()).backward()
        optimizer.step()
        after_step()
        optimizer.zero_grad(set_to_none=True)

    for i in range(options.num_warmup):
        step(i)
    counter = CallCounter()
    with counter.counting():
        step(options.num_warmup)
    seconds = []
    for i in range(options.num_warmup + 1, options.num_warmup + 1 + steps):
        start = time.perf_counter()
        step(i)
        seconds.append(time.perf_counter() - start)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    top = ""
    if cprofile_top:
        profiler = cProfile.Profile()
        profiler.runcall(step, options.num_warmup + 1 + steps)
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(cprofile_top)
        top = text.getvalue()
    calls = {package: counter.counts[package] for package in PACKAGES}
    calls["total"] = sum(counter.counts.values())
    return StepHost(run, calls, statistics.median(seconds) * 1e3, top)


def format_table(results: list[StepHost], title: str) -> str:
    """A markdown table: one row per run, Python calls per step by package, total, host ms."""
    header = ["run", *PACKAGES, "total", "host ms"]
    lines = [title, "", "| " + " | ".join(header) + " |", "| --- |" + " ---: |" * (len(header) - 1)]
    for r in results:
        cells = [r.run, *(str(r.calls[p]) for p in PACKAGES), str(r.calls["total"]), f"{r.host_ms:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run_step_host_bench(
    runs: tuple[str, ...],
    options: Options,
    device: str = "cpu",
    *,
    steps: int = 5,
    cprofile_top: int = 0,
    out: pathlib.Path | None = None,
) -> list[StepHost]:
    """Every run measured in this process group (one made here, of world size 1, if none is
    initialised); rank 0 prints the table (and each run's cProfile) and writes step_host.json to `out`."""
    target = torch.device(device)
    if target.type == "cuda":
        target = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(target)
    owns_group = not dist.is_initialized()
    if owns_group:
        if "MASTER_ADDR" not in os.environ:
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
        dist.init_process_group(
            "nccl" if target.type == "cuda" else "gloo",
            rank=int(os.environ.get("RANK", 0)),
            world_size=int(os.environ.get("WORLD_SIZE", 1)),
        )
    try:
        mesh = init_device_mesh(target.type, (dist.get_world_size(),))
        results = []
        for run in runs:
            torch._dynamo.reset()
            results.append(measure_run(run, options, target, mesh, steps=steps, cprofile_top=cprofile_top))
    finally:
        if owns_group:
            dist.destroy_process_group()
    if int(os.environ.get("RANK", 0)) == 0:
        name = torch.cuda.get_device_name(target) if target.type == "cuda" else "cpu"
        config = options.config
        title = (
            f"Python calls and host ms per training step, {options.model} (hidden {config.hidden_size}, "
            f"{config.num_layers} layers), world size {int(os.environ.get('WORLD_SIZE', 1))}, {name}, "
            f"backend {options.compile_backend}, torch {torch.__version__}"
        )
        print(format_table(results, title))
        for r in results:
            if r.cprofile:
                print(f"\n{r.run}: cProfile of one step, by cumulative time\n{r.cprofile}")
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            report = {"title": title, "results": [asdict(r) for r in results]}
            (out / "step_host.json").write_text(json.dumps(report, indent=2) + "\n")
    return results


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _runs(text: str) -> tuple[str, ...]:
    runs = tuple(run.strip() for run in text.split(","))
    unknown = [run for run in runs if run.partition("+")[0] not in all_run_names()]
    if unknown:
        raise ValueError(f"unknown runs {unknown}; choose from {', '.join(all_run_names())}")
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="step_host.py", description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--model", choices=tuple(MODELS), default="tiny")
    parser.add_argument("--model-source", choices=("auto", "transformers", "builtin"), default="builtin")
    parser.add_argument("--num-layers", type=positive, help="decoder layers instead of the model's")
    parser.add_argument("--runs", default=",".join(DEFAULT_RUNS), help="comma-separated multi_gpu.py run names")
    parser.add_argument("--compile-backend", help="default: aot_eager on the CPU, inductor on CUDA")
    parser.add_argument("--warmup", type=whole_number, default=3, help="untimed steps first (compilation)")
    parser.add_argument("--steps", type=positive, default=5, help="timed steps")
    parser.add_argument("--cprofile", type=whole_number, default=0, help="print this many cProfile entries per run")
    parser.add_argument("--out", type=pathlib.Path, help="folder for step_host.json")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here; use --device cpu")
    try:
        runs = _runs(args.runs)
    except ValueError as error:
        parser.error(str(error))
    options = Options(
        model=args.model,
        model_source=args.model_source,
        num_layers=args.num_layers,
        num_warmup=args.warmup,
        num_steps=args.steps,
        learning_rate=3e-4,
        compile_backend=args.compile_backend or ("inductor" if args.device == "cuda" else "aot_eager"),
        profile=False,
    )
    run_step_host_bench(runs, options, args.device, steps=args.steps, cprofile_top=args.cprofile, out=args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
