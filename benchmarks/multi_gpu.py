"""Multi-GPU end-to-end training benchmark: bf16 vs torchao float8 vs every recipe, FSDP2 on every GPU of a host.

Usage:
    # one configuration per process group (one per torchrun: several in one process skew speed
    # and memory by up to 40%); rank 0 writes the result as JSON
    torchrun --nproc-per-node=2 benchmarks/multi_gpu.py --train fp8:qw:compiled --model llama-2b --result r.json
    # the driver: each run its own torchrun, configurations alternated (a,b,c,a,b,c,...)
    python benchmarks/multi_gpu.py --drive --model llama-2b --runs bf16:compiled,fp8:qw:compiled --repeats 3 --out DIR

Runs are named `<base>[:<weights>]:<mode>[+<states>][+rs-fp8]`:
- base `bf16` (torch's fully_shard), `torchao-tensorwise` (torchao.float8 with
  `enable_fsdp_float8_all_gather=True` and `precompute_float8_dynamic_scale_for_fsdp` after each
  step), `torchao-rowwise` (`Float8LinearConfig.from_recipe_name("rowwise")`), or a recipe of
  ours (RECIPES) converted by `qt.convert` and sharded by `quant_fsdp.fully_shard`;
- weights (recipes only): `hp` keeps high-precision weights, gathered quantized
  (`quantize_on_gather=True`), stepped by torch.optim.AdamW (fused on CUDA); `qw` makes them
  quantized primary weights (`quantized_weights=True`) stepped by quant_optim.FusedAdam; `qw-bf16`
  is `qw` with the decoder layers' other parameters (norms) in bf16 (FusedAdam keeps an fp32
  master of each), so that the layers' sharded gradients are bf16 (FSDP2 gives a layer's
  gradients its parameters' one dtype); the root's embedding, norm and lm_head stay fp32;
- mode `eager`, or `compiled`: `block.compile()` on each decoder layer before sharding; or (our
  recipes) `fused`: compiled with quant-core's compiled kernels "inductor" (_compile_modes);
- states (optional): smaller optimizer states. Quantized-weight runs (FusedAdam): `m-bf16` (both
  moments bf16), `m-fp8` (first moment FP8 E4M3 with a per-tensor scale, second bf16),
  `master-bf16` (bf16 masters with stochastic rounding), `master-bf16-m-fp8` (both); the others
  (torch's AdamW): `ao-adamw8bit`, `ao-adamwfp8` (torchao.optim's low-bit AdamW instead);
- `rs-fp8` (recipes only): gradients reduce-scattered in FP8 (`quant_fsdp.fully_shard(...,
  reduce_scatter="fp8")`: 1x128 blocks, one all-to-all, fp32 sums), counted as RS bytes.
Layout (torchtitan's; docs/design.md, 'FSDP2'): the model is built in fp32 on each rank's device from
one seed, converted, then `fully_shard(layer, mesh=..., mp_policy=MixedPrecisionPolicy(
param_dtype=bf16, reduce_dtype=fp32))` on each decoder layer and on the root. The lm_head is never
converted. bf16 and torchao runs use torch.optim.AdamW too; every optimizer has weight decay 0.
Each rank trains on its own slice of every global batch of quant_lab.demo.MarkovTask; the
loss is the cross-entropy of logits.float(). CUDA with NCCL when present, else the CPU with gloo.

`--memory-cap-gib 80 --num-layers N` (or `--batch-size B`) tells whether a model of N decoder
layers (or B sequences per GPU) trains within an H100's 80 GB on a larger GPU: each rank may
allocate at most that much, and a run that would need more becomes a row with its
OutOfMemoryError (lower `--collective-timeout` then: a rank that fails first leaves the others
waiting in a collective).

Per launch: `--warmup` untimed steps, one counted step, `--steps` timed steps (and with
`--profile`, 2 steps under torch.profiler after them, then 2 under cProfile, so no profiler
slows a timed step). Peak memory statistics are reset after the model and optimizer
are built, before the first warm-up step, so the optimizer states allocated by the first step count.
The counted step also records the peak of each of its phases (forward, backward, optimizer step)
and, with `--memory-snapshot`, the CUDA allocator's history: the bytes alive at the step's highest
point, by the code that allocated them (JSON: memory_phases, memory_live_at_peak).

Columns of DIR/multi_gpu.md (DIR/multi_gpu.json holds the same and every launch):
- tokens/s/GPU: batch x sequence per GPU / median step time, median over repeats. A repeat's
  step time is the median over its timed steps on its slowest rank (CUDA events between steps;
  time.perf_counter on the CPU). spread: min-max of tokens/s/GPU over the repeats.
- vs bf16 compiled, vs torchao: ratio of medians to bf16:compiled and to the faster torchao run.
- step ms: the median step time, median over repeats.
- peak GiB: torch.cuda.max_memory_allocated, max over ranks and repeats (on the CPU the peak
  resident set of the process). The split, of the rank and repeat with that peak:
  params = local bytes of model.parameters() after sharding (a QuantizedTensor's codes and scales,
  a QuantizeOnGatherTensor's high-precision shard); grads = local bytes of every .grad after the
  counted step's backward; optim = local bytes of every tensor in optimizer.state after that step
  (moments, step counts, FusedAdam's fp32 masters); act+other = peak - the three (activations,
  gathered weights, caching, workspaces). B/param: params, grads and optim divided by the
  parameters this GPU holds (local elements of model.parameters()), in bytes.
- AG MiB/step: bytes the all-gathers of the counted step delivered to this GPU (output size; the
  input bytes are in the JSON); RS MiB/step: bytes its reduce-scatters took in (the unsharded
  gradients). Counted by wrapping torch.distributed's all_gather_into_tensor/all_gather_single and
  reduce_scatter_tensor/reduce_scatter_single on rank 0 (_multi_gpu_measure.count_collectives).
- loss: the last timed step's loss averaged over ranks, median over repeats.
- breaks, recompiles: Dynamo's graph breaks and recompiles (frames compiled again,
  _multi_gpu_measure.dynamo_counts), total since the process started / after warm-up (during
  the counted and timed steps); max over repeats.
- exposed comm ms (--profile): per step, the time NCCL kernels run on rank 0's GPU while no other
  kernel does (_multi_gpu_measure.exposed_time); the chrome trace of every rank is in DIR/traces.
- GPU compute ms (--profile): per step, the time some non-NCCL kernel runs on rank 0's GPU; a step
  longer than it by more than the exposed communication waited for its host.
- DIR/traces/RUN.rank0.python.txt (--profile): rank 0's Python functions by own time and by
  cumulative time over its cProfile steps (cProfile slows Python, not the GPU: compare functions
  within a run and calls per step across runs).
- host ms hooks/graphs/optim (--profile): per step, rank 0's host time in FSDP2's hooks, in the
  Python of compiled graphs and in the optimizer step (_multi_gpu_measure.host_time_by_kind).
- GPU ms per step by kernel group (--profile, a second table): rank 0's GPU work over its
  profiled steps by what launched it (_multi_gpu_measure.gpu_time_by_group: the optimizer, FSDP2's
  gradient reduction and weight gathers, GEMMs and attention, Inductor's kernels, quant-core's
  quantize kernels, the rest), and how long only copies ran and nothing ran; medians over repeats.
- GPU idle ms by host spans (--profile, a third table): each gap in which rank 0's GPU runs
  nothing, by the host spans (FSDP2 hook, compiled graph, optimizer, else elsewhere) that launched
  the work before and after it (_multi_gpu_measure.gpu_idle_by_launching_span): where the host
  holds the GPU up; each run's largest pairs.
- DIR/traces/RUN.rank0.gaps.tsv (--profile on a GPU): rank 0's LISTED_GAPS longest idle gaps of
  its profiled steps in time order: when, how long, whether the host synchronized between the
  launches, and the kernel or copy on either side with the span that launched it (a few KiB,
  where the chrome trace of the 2.2B model's steps is tens of MiB).
- error: the first line of what a run raised; a launch that exits non-zero without a result
  takes the error a rank printed, else its exit code. The other runs go on.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import datetime
import importlib
import importlib.metadata
import io
import itertools
import json
import os
import pathlib
import pstats
import shlex
import signal
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _e2e_model import describe_model, resolve_model_source
from _multi_gpu_measure import (
    PhasePeaks,
    count_collectives,
    dynamo_counts,
    exposed_time,
    gpu_idle_by_launching_span,
    gpu_time_by_group,
    gradient_bytes,
    host_time_by_kind,
    idle_gaps,
    kernel_intervals,
    local_numel,
    optimizer_state_bytes,
    parameter_bytes,
    peak_memory_bytes,
    phase,
    recorded_memory,
    reset_peak_memory,
    union,
)
from _multi_gpu_report import GIB, Row, build_row, compact_table, markdown, with_ratios
from _multi_gpu_runs import MODELS, Options, RunSpec, build_run, parse_run, rank_batches
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

DEFAULT_RUNS = (
    "bf16:eager,bf16:compiled,torchao-tensorwise:compiled,torchao-rowwise:compiled,fp8:hp:eager,fp8:qw:eager,"
    "fp8:hp:compiled,fp8:qw:compiled,fp8-block:hp:compiled,fp8-block:qw:compiled,mxfp8:hp:compiled,nvfp4:hp:compiled"
)
# Mandatory on the GPU hosts: NVLink multicast can take a shared host's GPUs out of service.
CHILD_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
ERROR_MARK = "MULTI_GPU_RUN_ERROR"
PROFILED_STEPS = 2
LISTED_GAPS = 200  # the longest idle gaps of the profiled steps in RUN.rank0.gaps.tsv


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_rank(
    spec: RunSpec, options: Options, device: torch.device, mesh: DeviceMesh, trace_dir: pathlib.Path
) -> dict:
    """Builds and trains one run on this rank; what this rank measured."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model, optimizer, after_step = build_run(spec, options, device, mesh)
    num_batches = options.num_warmup + 1 + options.num_steps + 2 * PROFILED_STEPS * options.profile
    batches = rank_batches(options.config, num_batches, rank, world_size).to(device)
    grads: list[int] = []

    def step(i: int, peaks: PhasePeaks | None = None) -> torch.Tensor:
        with phase(peaks, "forward", device):
            output = model(batches[i, :, :-1])
            logits = getattr(output, "logits", output)  # transformers returns an output object
            loss = F.cross_entropy(logits.flatten(0, 1).float(), batches[i, :, 1:].flatten())
        with phase(peaks, "backward", device):
            loss.backward()
        if peaks is not None:
            grads.append(gradient_bytes(model))
        with phase(peaks, "optimizer", device):
            optimizer.step()
            after_step()
            optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    params = parameter_bytes(model)
    num_local_params = sum(local_numel(p) for p in model.parameters())
    reset_peak_memory(device)
    for i in range(options.num_warmup):
        step(i)
    _synchronize(device)
    after_warmup = dynamo_counts()
    warmup_peak = peak_memory_bytes(device)  # the counted step's phases reset the statistics
    peaks, at_peak = PhasePeaks(), {}
    with count_collectives() as collectives:
        with recorded_memory(device, at_peak) if options.memory_snapshot else contextlib.nullcontext():
            step(options.num_warmup, peaks)
        _synchronize(device)
    timed = range(options.num_warmup + 1, options.num_warmup + 1 + options.num_steps)
    seconds, loss = _time_steps(step, timed, device)
    at_end = dynamo_counts()
    peak = max(warmup_peak, *peaks.peak.values(), peak_memory_bytes(device))
    states = optimizer_state_bytes(optimizer)
    dist.all_reduce(loss)
    result = {
        "step_s": seconds,
        "loss": float(loss) / world_size,
        "memory": {"peak": peak, "parameters": params, "gradients": grads[0], "optimizer_states": states},
        "local_parameters": num_local_params,
        "memory_phases": asdict(peaks),
        "memory_live_at_peak": at_peak,
        "collectives": {kind: asdict(c) for kind, c in collectives.kinds.items()},
        "dynamo": {
            **{f"{k}_total": v for k, v in at_end.items()},  # since the process started
            **{f"{k}_after_warmup": v - after_warmup[k] for k, v in at_end.items()},
        },
    }
    if options.profile:
        result.update(_profile(step, timed.stop, spec, device, rank, trace_dir))
    return result


def _time_steps(
    step: Callable[[int], torch.Tensor], timed: range, device: torch.device
) -> tuple[list[float], torch.Tensor]:
    """(seconds of each step, last loss): CUDA events between steps, one synchronize at the end."""
    if device.type == "cuda":
        events = [torch.cuda.Event(enable_timing=True) for _ in range(len(timed) + 1)]
        events[0].record()
        for i, event in zip(timed, events[1:], strict=True):
            loss = step(i)
            event.record()
        torch.cuda.synchronize(device)
        return [a.elapsed_time(b) * 1e-3 for a, b in itertools.pairwise(events)], loss
    marks = [time.perf_counter()]
    for i in timed:
        loss = step(i)
        marks.append(time.perf_counter())
    return [b - a for a, b in itertools.pairwise(marks)], loss


def _profile(
    step: Callable[[int], torch.Tensor],
    first: int,
    spec: RunSpec,
    device: torch.device,
    rank: int,
    trace_dir: pathlib.Path,
) -> dict:
    """Profiles PROFILED_STEPS steps into a chrome trace per rank, then PROFILED_STEPS more under cProfile on
    rank 0 (its Python by function); rank 0 adds its exposed communication."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as profiler:
        for i in range(first, first + PROFILED_STEPS):
            step(i)
        _synchronize(device)
    trace_dir.mkdir(parents=True, exist_ok=True)
    trace = trace_dir / f"{spec.name.replace(':', '_')}.rank{rank}.json"
    profiler.export_chrome_trace(str(trace))
    python = cProfile.Profile()
    with python if rank == 0 else contextlib.nullcontext():
        for i in range(first + PROFILED_STEPS, first + 2 * PROFILED_STEPS):
            step(i)
        _synchronize(device)
    if rank != 0:
        return {}
    text = io.StringIO()
    stats = pstats.Stats(python, stream=text)
    for order in ("tottime", "cumulative"):
        text.write(f"== {spec.name}: {PROFILED_STEPS} steps, rank 0, by {order}\n")
        stats.sort_stats(order).print_stats(60)
    (trace_dir / f"{spec.name.replace(':', '_')}.rank0.python.txt").write_text(text.getvalue())
    events = json.loads(trace.read_text())["traceEvents"]
    gaps = idle_gaps(events)
    longest = sorted(gaps, key=lambda g: -g.length)[:LISTED_GAPS]
    first = gaps[0].start if gaps else 0.0  # idle_gaps are in time order
    lines = ["at_us\tidle_us\tsynced\tbefore\tbefore_span\tafter\tafter_span"]  # at: after the first gap opens
    lines += [
        f"{g.start - first:.0f}\t{g.length:.1f}\t{int(g.synced)}\t{g.before}\t{g.before_span}\t{g.after}\t{g.after_span}"
        for g in sorted(longest, key=lambda g: g.start)
    ]
    (trace_dir / f"{spec.name.replace(':', '_')}.rank0.gaps.tsv").write_text("\n".join(lines) + "\n")
    communication, compute = kernel_intervals(events)
    per_step_ms = 1e-3 / PROFILED_STEPS
    return {
        "trace": str(trace),
        "exposed_comm_ms": exposed_time(communication, compute) * per_step_ms if communication or compute else None,
        "gpu_compute_ms": sum(end - start for start, end in union(compute)) * per_step_ms if compute else None,
        "host_ms": {kind: us * per_step_ms for kind, us in host_time_by_kind(events).items()},
        "gpu_ms_by_group": {group: us * per_step_ms for group, us in gpu_time_by_group(events).items()},
        "gpu_idle_ms_by_span": {span: us * per_step_ms for span, us in gpu_idle_by_launching_span(gaps).items()},
    }


def summarize(spec: RunSpec, options: Options, per_rank: list[dict], device: torch.device) -> dict:
    """Rank 0's result from every rank's measurements."""
    medians = [statistics.median(r["step_s"]) for r in per_rank]
    slowest = max(medians)
    peak_rank = max(per_rank, key=lambda r: r["memory"]["peak"])
    memory = dict(peak_rank["memory"])
    memory["activations_other"] = (
        memory["peak"] - memory["parameters"] - memory["gradients"] - memory["optimizer_states"]
    )
    return {
        "run": spec.name,
        "error": "",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "world_size": len(per_rank),
        "tokens_per_s_per_gpu": options.config.tokens_per_step / slowest,
        "step_ms": slowest * 1e3,
        "step_ms_median_by_rank": [m * 1e3 for m in medians],
        "step_ms_rank0": [s * 1e3 for s in per_rank[0]["step_s"]],
        "loss": per_rank[0]["loss"],
        "memory": memory,
        "local_parameters": peak_rank["local_parameters"],
        "peak_by_rank": [r["memory"]["peak"] for r in per_rank],
        "memory_phases": peak_rank["memory_phases"],
        "memory_live_at_peak": per_rank[0]["memory_live_at_peak"],
        "collectives": per_rank[0]["collectives"],
        "dynamo": per_rank[0]["dynamo"],
        "exposed_comm_ms": per_rank[0].get("exposed_comm_ms"),
        "gpu_compute_ms": per_rank[0].get("gpu_compute_ms"),
        "gpu_ms_by_group": per_rank[0].get("gpu_ms_by_group"),
        "gpu_idle_ms_by_span": per_rank[0].get("gpu_idle_ms_by_span"),
        "host_ms": per_rank[0].get("host_ms", {}),
        "trace": per_rank[0].get("trace"),
    }


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0][:300] if text else ''}"


def run_worker(args: argparse.Namespace) -> int:
    """One rank of one run (under torchrun); rank 0 writes the result to --result."""
    os.environ.update(CHILD_ENV)  # before the process group: NCCL reads them at init
    rank, local_rank = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    cuda = torch.cuda.is_available() and args.device != "cpu"
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        if args.memory_cap_gib:  # allocations past it raise torch.OutOfMemoryError: a row with that error
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, args.memory_cap_gib * GIB / total), device)
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        device_id=device if cuda else None,
        timeout=datetime.timedelta(seconds=args.collective_timeout),
    )
    result_path = pathlib.Path(args.result) if args.result else None
    trace_dir = pathlib.Path(args.trace_dir or (result_path.parent if result_path else "."))
    spec, options = parse_run(args.run), options_from(args)
    try:
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        per_rank: list[dict] = [{}] * dist.get_world_size()
        dist.all_gather_object(per_rank, measure_rank(spec, options, device, mesh, trace_dir))
        result = summarize(spec, options, per_rank, device)
    except Exception as error:  # a result row, not a crash: report it (the driver goes on)
        print(f"{ERROR_MARK} rank {rank}: {first_line(error)}", file=sys.stderr, flush=True)
        traceback.print_exc()
        result = {"run": spec.name, "error": first_line(error)}
    if rank == 0:
        if result_path is not None:
            result_path.parent.mkdir(parents=True, exist_ok=True)
            result_path.write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps({k: result[k] for k in ("run", "error", "tokens_per_s_per_gpu", "loss") if k in result}))
    if result["error"]:
        return 1  # no collective after an error: the other ranks may be elsewhere
    dist.destroy_process_group()
    return 0


def options_from(args: argparse.Namespace) -> Options:
    return Options(
        model=args.model,
        model_source=args.model_source,
        num_layers=args.num_layers,
        batch_size=args.batch_size,
        num_warmup=args.warmup,
        num_steps=args.steps,
        learning_rate=args.lr,
        compile_backend=args.compile_backend,
        profile=args.profile,
        memory_snapshot=args.memory_snapshot,
    )


def _torchao_missing() -> str:
    """Why torchao float8 runs cannot run here, or ''. Asked in a subprocess: the driver never
    touches CUDA (a context of its own would hold memory on GPU 0 through every launch)."""
    check = subprocess.run([sys.executable, "-c", "import torchao.float8"], capture_output=True, text=True, check=False)
    if check.returncode == 0:
        return ""
    lines = check.stderr.strip().splitlines() or [f"exit code {check.returncode}"]
    return f"skipped: torchao.float8 does not import ({lines[-1][:200]})"


def _launch_error(log: pathlib.Path, exit_code: int) -> str:
    """The error a failed launch printed: a rank's ERROR_MARK line, else its last exception line."""
    lines = log.read_text(errors="replace").splitlines()
    marked = [line.split(": ", 1)[1] for line in lines if ERROR_MARK in line and ": " in line]
    if marked:
        return marked[0]
    signals = [line.split(":", 1)[1].strip() for line in lines if line.strip().startswith("traceback : Signal")]
    if signals:  # a rank killed (out of host memory, a crash in native code): torchrun's summary
        return f"a rank died: {signals[-1]}"
    raised = [
        line.strip()
        for line in lines
        if line.strip().split(":")[0].endswith(("Error", "Exception")) and "ChildFailedError" not in line
    ]
    return raised[-1][:300] if raised else f"exit code {exit_code}"


def launch(run: str, repeat: int, args: argparse.Namespace, out: pathlib.Path, nproc: int) -> dict:
    """One torchrun of `run`; its exit code, wall time, error and rank 0's result."""
    stem = f"{run.replace(':', '_')}.{repeat}"
    result_path, log = out / "results" / f"{stem}.json", out / "logs" / f"{stem}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    result_path.unlink(missing_ok=True)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--monitor-interval=0.5", f"--nproc-per-node={nproc}",
        str(pathlib.Path(__file__).resolve()), "--train", run, "--result", str(result_path),
        "--trace-dir", str(out / "traces"), *worker_arguments(args),
    ]  # fmt: skip
    start = time.perf_counter()
    with log.open("w") as output:
        output.write(shlex.join(command) + "\n")
        output.flush()
        process = subprocess.Popen(
            command, stdout=output, stderr=subprocess.STDOUT, env={**os.environ, **CHILD_ENV}, start_new_session=True
        )
        try:
            exit_code = process.wait(timeout=args.run_timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # torchrun and the ranks it started: their own session
            exit_code = process.wait()
    seconds = time.perf_counter() - start
    result = json.loads(result_path.read_text()) if result_path.exists() else None
    error = result["error"] if result and result.get("error") else ""
    if exit_code and not error:
        timed_out = seconds >= args.run_timeout
        error = f"timed out after {args.run_timeout} s" if timed_out else _launch_error(log, exit_code)
    return {
        "run": run,
        "repeat": repeat,
        "launched": True,
        "exit_code": exit_code,
        "seconds": seconds,
        "error": error,
        "result": result,
        "log": str(log),
    }


def worker_arguments(args: argparse.Namespace) -> list[str]:
    """The options every launch passes on to its ranks."""
    arguments = ["--model", args.model, "--model-source", args.model_source, "--warmup", str(args.warmup)]
    arguments += ["--steps", str(args.steps), "--lr", str(args.lr), "--compile-backend", args.compile_backend]
    arguments += ["--device", args.device, "--collective-timeout", str(args.collective_timeout)]
    arguments += ["--num-layers", str(args.num_layers)] if args.num_layers else []
    arguments += ["--batch-size", str(args.batch_size)] if args.batch_size else []
    arguments += ["--memory-cap-gib", str(args.memory_cap_gib)] if args.memory_cap_gib else []
    return arguments + (["--profile"] if args.profile else []) + (["--memory-snapshot"] if args.memory_snapshot else [])


def _version(distribution: str) -> str | None:
    """The installed distribution's version, else the module's `__version__` (sources on PYTHONPATH), else None."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        try:
            return importlib.import_module(distribution.replace("-", "_")).__version__
        except ImportError:
            return None


def environment(args: argparse.Namespace, nproc: int, runs: list[str]) -> dict:
    """Device, versions, date, command, model and options: the header of both reports."""
    cuda = torch.cuda.is_available() and args.device != "cpu"
    options = options_from(args)
    return {
        "date": datetime.date.today().isoformat(),
        "command": shlex.join([pathlib.Path(sys.executable).name, *sys.argv]),
        "device": "cuda" if cuda else "cpu",  # the GPU's name once a launch has reported it
        "backend": "nccl" if cuda else "gloo",
        "world_size": nproc,
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "torchao": _version("torchao"),
        "quant_tensors": _version("quant-tensors"),
        "child_env": CHILD_ENV,
        "model_name": args.model,
        "model": describe_model(resolve_model_source(args.model_source)),
        "config": asdict(options.config),
        "runs": runs,
        "repeats": args.repeats,
        "num_warmup": args.warmup,
        "num_steps": args.steps,
        "learning_rate": args.lr,
        "compile_backend": args.compile_backend,
        "profile": args.profile,
        "memory_snapshot": args.memory_snapshot,
        "memory_cap_gib": args.memory_cap_gib,
    }


def write_reports(out: pathlib.Path, report: dict, runs: list[str], launches: list[dict]) -> list[Row]:
    """Writes multi_gpu.json and multi_gpu.md from the launches so far; returns their rows."""
    rows = with_ratios([build_row(run, [x for x in launches if x["run"] == run]) for run in runs])
    report["launch_order"] = [x["run"] for x in launches if x["launched"]]
    ok = [x["result"]["device"] for x in launches if x["result"] and not x["error"]]
    report["device"] = ok[0] if ok else report["device"]
    out.mkdir(parents=True, exist_ok=True)
    document = {**report, "rows": [asdict(r) for r in rows], "launches": launches}
    (out / "multi_gpu.json").write_text(json.dumps(document, indent=2) + "\n")
    (out / "multi_gpu.md").write_text(markdown(report, rows))
    return rows


def drive(args: argparse.Namespace) -> int:
    """Launches every run `--repeats` times, round-robin; writes multi_gpu.json and .md; 1 if a run failed."""
    runs = [parse_run(name).name for name in args.runs.split(",")]
    if len(set(runs)) != len(runs):
        raise ValueError(f"--runs names a run twice: {args.runs}")
    cuda = torch.cuda.is_available() and args.device != "cpu"  # neither creates a CUDA context
    nproc = args.nproc_per_node or (torch.cuda.device_count() if cuda else 2)
    out = pathlib.Path(args.out)
    report = environment(args, nproc, runs)
    torchao_missing = _torchao_missing() if any(r.startswith("torchao-") for r in runs) else ""
    order = [(repeat, run) for repeat in range(args.repeats) for run in runs]  # a,b,c,a,b,c,...
    launches = []
    for index, (repeat, run) in enumerate(order, 1):
        if run.startswith("torchao-") and torchao_missing:
            launches.append(
                {
                    "run": run,
                    "repeat": repeat,
                    "launched": False,
                    "exit_code": 0,
                    "error": torchao_missing,
                    "result": None,
                }
            )
            continue
        print(f"[{index}/{len(order)}] {run} (repeat {repeat + 1}/{args.repeats}) ...", flush=True)
        launches.append(launch(run, repeat, args, out, nproc))
        done = launches[-1]
        speed = done["result"] and done["result"].get("tokens_per_s_per_gpu")
        print(f"    {done['error'] or f'{speed:,.0f} tokens/s/GPU'} ({done['seconds']:.0f} s)", flush=True)
        write_reports(out, report, runs, launches)  # after every launch: a killed driver leaves its rows
    rows = write_reports(out, report, runs, launches)
    print(f"\n{report['world_size']} x {report['device']}, {args.model}, median of {args.repeats} repeats:")
    print(compact_table(rows))
    failed = [r.run for r in rows if r.error and not r.error.startswith("skipped")]
    if failed:
        print(f"runs that failed: {', '.join(failed)}")
    return 1 if failed else 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # `--run` is an alias that torchrun's own parser rejects right after the script (an abbreviation
    # of its --run-path); it works after a `--`.
    parser.add_argument("--train", "--run", dest="run", help="worker: the one run this torchrun trains")
    parser.add_argument("--result", help="worker: where rank 0 writes its JSON result")
    parser.add_argument("--trace-dir", help="worker: where --profile writes each rank's chrome trace")
    parser.add_argument("--drive", action="store_true", help="launch every run of --runs as its own torchrun")
    parser.add_argument("--runs", default=DEFAULT_RUNS, help="driver: comma-separated run names")
    parser.add_argument("--repeats", type=int, default=3, help="driver: launches per run, round-robin")
    parser.add_argument("--out", default="results/multi_gpu", help="driver: folder of the reports, logs and traces")
    parser.add_argument("--nproc-per-node", type=int, help="driver: ranks (default: every GPU, or 2 on the CPU)")
    parser.add_argument("--run-timeout", type=float, default=1800, help="driver: seconds before a launch is killed")
    parser.add_argument("--model", choices=tuple(MODELS), default="llama-2b")
    parser.add_argument("--model-source", choices=("auto", "transformers", "builtin"), default="auto")
    parser.add_argument("--num-layers", type=int, help="decoder layers instead of the model's")
    parser.add_argument("--batch-size", type=int, help="sequences per GPU per step instead of the model's")
    parser.add_argument(
        "--memory-cap-gib",
        type=float,
        help="CUDA: each rank may allocate at most this many GiB (torch.cuda.set_per_process_memory_fraction): "
        "with --num-layers or --batch-size, whether a model or batch fits a smaller GPU, e.g. 80 for an H100 80GB",
    )
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps (compilation happens here)")
    parser.add_argument("--steps", type=int, default=8, help="timed steps")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--compile-backend", default="inductor")
    parser.add_argument("--device", choices=("auto", "cpu"), default="auto", help="cpu: gloo even where CUDA is")
    parser.add_argument("--collective-timeout", type=float, default=900, help="seconds a rank waits in a collective")
    parser.add_argument("--profile", action="store_true", help="2 profiled steps: traces and exposed communication")
    parser.add_argument(
        "--memory-snapshot", action="store_true", help="record the counted step's allocations: what is live at its peak"
    )
    args = parser.parse_args(argv)
    if args.drive == bool(args.run):
        parser.error("give either --drive (the driver) or --train NAME (one run, under torchrun)")
    if args.memory_cap_gib is not None and not args.memory_cap_gib > 0:
        parser.error(f"--memory-cap-gib takes a positive number of GiB, got {args.memory_cap_gib}")
    for option, value in (("--num-layers", args.num_layers), ("--batch-size", args.batch_size)):
        if value is not None and value < 1:
            parser.error(f"{option} takes a positive count, got {value}")
    if args.steps < 1 or args.warmup < 0 or args.repeats < 1:
        parser.error(
            f"need --steps >= 1, --warmup >= 0, --repeats >= 1; got {args.steps}, {args.warmup}, {args.repeats}"
        )
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.drive:
        return drive(args)
    exit_code = run_worker(args)
    # A rank leaves without interpreter teardown: there, the process group that the sharded
    # model's mesh still holds can abort the process ("terminate called without an active
    # exception", seen on gloo) after its result is written, and the launch would count as failed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)


if __name__ == "__main__":
    sys.exit(main())
