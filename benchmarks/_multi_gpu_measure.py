"""What one rank of `benchmarks/multi_gpu.py` measures besides time: bytes held, bytes sent, compiles,
and exposed communication in a profiler trace.

Nothing here imports the quant packages: tensors are sized through `__tensor_flatten__`, which
DTensor, quant-tensors' QuantizedTensor, quant-fsdp's QuantizeOnGatherTensor and torchao's float8
weight wrapper all implement.
"""

from __future__ import annotations

import bisect
import contextlib
import inspect
import resource
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

# torch.distributed's names for the collectives FSDP2 issues (the *_single ones from torch 2.13 on,
# the others before), and the kind each one counts as.
COLLECTIVES = {
    "all_gather_into_tensor": "all_gather",
    "all_gather_single": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_single": "reduce_scatter",
    "all_to_all_single": "reduce_scatter",  # quant_fsdp.QuantizedReduceScatter's exchange (runs `+rs-fp8`)
}


def storage_bytes(t: torch.Tensor) -> int:
    """Bytes this rank holds for `t`: a DTensor's local shard, a wrapper subclass's inner tensors
    (a QuantizedTensor's codes and scales, a QuantizeOnGatherTensor's shard), else numel x size."""
    if isinstance(t, DTensor):
        return storage_bytes(t._local_tensor)
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        inner = (getattr(t, n) for n in names)
        return sum(storage_bytes(i) for i in inner if isinstance(i, torch.Tensor))
    return t.numel() * t.element_size()


def local_numel(t: torch.Tensor) -> int:
    """Elements this rank holds of `t`: a DTensor's local shard's (FSDP2 pads none), else t's own."""
    return t._local_tensor.numel() if isinstance(t, DTensor) else t.numel()


def _total_bytes(tensors: Iterable[torch.Tensor]) -> int:
    unique = {id(t): t for t in tensors}  # a tensor listed twice is held once
    return sum(storage_bytes(t) for t in unique.values())


def parameter_bytes(model: torch.nn.Module) -> int:
    """Local bytes of every parameter (FSDP2 shards; quantized weights' codes and scales)."""
    return _total_bytes(model.parameters())


def gradient_bytes(model: torch.nn.Module) -> int:
    """Local bytes of every parameter's gradient (read after backward, before the optimizer step)."""
    return _total_bytes(p.grad for p in model.parameters() if p.grad is not None)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Local bytes of every tensor in `optimizer.state`: moments, step counts, FusedAdam's fp32 masters."""
    return _total_bytes(v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor))


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_bytes(device: torch.device) -> int:
    """torch.cuda.max_memory_allocated on CUDA; on the CPU the process's peak resident set (which
    also holds the interpreter and libraries: only good for checking that the fields are filled)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


@dataclass
class CollectiveBytes:
    """Calls and input/output bytes of one kind of collective, as this rank issued them."""

    calls: int = 0
    input_bytes: int = 0
    output_bytes: int = 0


@dataclass
class CollectiveCounter:
    """What `count_collectives` saw, by kind ("all_gather", "reduce_scatter")."""

    kinds: dict[str, CollectiveBytes] = field(
        default_factory=lambda: {k: CollectiveBytes() for k in ("all_gather", "reduce_scatter")}
    )


@contextlib.contextmanager
def count_collectives() -> Iterator[CollectiveCounter]:
    """Counts the all-gathers and reduce-scatters issued through torch.distributed in the block.

    Wraps every name of COLLECTIVES that this torch has, in the torch.distributed namespace (where
    FSDP2 looks them up), as quant_lab.testing.count_all_gather_bytes does for all-gathers. A
    deprecated name that forwards to its successor counts once (the inner call is not counted).
    Collectives traced into a compiled graph (functional collectives) are not seen: FSDP2 issues
    its own outside the per-block graphs.
    """
    counter = CollectiveCounter()
    inside = threading.local()  # FSDP2 reduce-scatters from autograd's thread
    originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

    def counting(name: str, original: Callable) -> Callable:
        output_name, input_name = list(inspect.signature(original).parameters)[:2]
        kind = counter.kinds[COLLECTIVES[name]]

        def wrapper(*args, **kwargs):
            if getattr(inside, "depth", 0) == 0:
                output = args[0] if args else kwargs[output_name]
                input = args[1] if len(args) > 1 else kwargs[input_name]
                kind.calls += 1
                kind.output_bytes += output.numel() * output.element_size()
                kind.input_bytes += input.numel() * input.element_size()
            inside.depth = getattr(inside, "depth", 0) + 1
            try:
                return original(*args, **kwargs)
            finally:
                inside.depth -= 1

        return wrapper

    try:
        for name, original in originals.items():
            setattr(dist, name, counting(name, original))
        yield counter
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def dynamo_counts() -> dict[str, int]:
    """Graph breaks and recompiles so far in this process.

    torch (2.13) keeps no "recompiles" counter: Dynamo counts every frame it compiles
    (counters["frames"]["total"]) and remembers each code object it compiled
    (convert_frame.input_codes), so recompiles = compiled frames - distinct code objects.
    """
    from torch._dynamo import convert_frame
    from torch._dynamo.utils import counters

    codes = getattr(getattr(convert_frame, "input_codes", None), "seen_ids", ())
    frames = counters["frames"]["total"]
    return {
        "graph_breaks": sum(counters["graph_break"].values()),
        "frames_compiled": frames,
        "recompiles": max(frames - len(codes), 0),
    }


def union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, disjoint intervals covering exactly what `intervals` cover (empty ones dropped)."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def exposed_time(communication: Iterable[tuple[float, float]], compute: Iterable[tuple[float, float]]) -> float:
    """How long some `communication` interval runs while no `compute` interval does:
    |union(communication) - union(compute)|, in the intervals' unit."""
    busy = union(compute)
    exposed, i = 0.0, 0
    for start, end in union(communication):
        covered = 0.0
        while i < len(busy) and busy[i][1] <= start:  # compute that ended before this interval
            i += 1
        j = i
        while j < len(busy) and busy[j][0] < end:
            covered += min(end, busy[j][1]) - max(start, busy[j][0])
            j += 1
        exposed += end - start - covered
    return exposed


HOST_SPANS = {
    "fsdp_hooks": ("FSDP::pre_forward", "FSDP::post_forward", "FSDP::pre_backward", "FSDP::post_backward"),
    "compiled_graphs": ("## Call CompiledFxGraph",),
    "optimizer": ("Optimizer.step#",),
}
"""Host work by kind, as torch.profiler names its spans: FSDP2's hooks (its unshards and
reduce-scatters included), the Python of compiled graphs (Inductor's wrapper: its launches and
allocations), the optimizer's step."""


def host_time_by_kind(trace_events: Sequence[dict]) -> dict[str, float]:
    """Microseconds of host time under each kind of HOST_SPANS in a chrome trace's `traceEvents`:
    the union of the spans whose names start with the kind's prefixes (nested or concurrent spans
    of one kind counted once)."""
    spans: dict[str, list[tuple[float, float]]] = {kind: [] for kind in HOST_SPANS}
    for event in trace_events:
        if event.get("ph") != "X" or event.get("cat") not in ("cpu_op", "user_annotation"):
            continue
        for kind, prefixes in HOST_SPANS.items():
            if event.get("name", "").startswith(prefixes):
                spans[kind].append((float(event["ts"]), float(event["ts"]) + float(event.get("dur", 0))))
    return {kind: sum(end - start for start, end in union(intervals)) for kind, intervals in spans.items()}


GPU_GROUPS = (
    "GEMMs and attention",
    "optimizer",
    "FSDP2 gradients",
    "FSDP2 gathers",
    "Inductor",
    "quantize",
    "other",
)
"""What `gpu_time_by_group` sorts the GPU's work into: by the host span that launched it (the
optimizer step; FSDP2's post-backward spans: gradient copy-in, reduce-scatter and casts; its
pre-forward, pre-backward and prefetch spans: weight copy-in, all-gather, casts, quantize on
gather), else by kernel name (cuBLAS and cuDNN; Inductor's `triton_*`; quant-core's Triton
kernels, named `_*_kernel`)."""
_LAUNCH_GROUPS = (
    ("Optimizer.step#", "optimizer"),
    ("FSDP::post_backward", "FSDP2 gradients"),
    ("FSDP::root_post_backward", "FSDP2 gradients"),
    ("FSDP::pre_forward", "FSDP2 gathers"),
    ("FSDP::root_pre_forward", "FSDP2 gathers"),
    ("FSDP::pre_backward", "FSDP2 gathers"),
    ("FSDP::backward_prefetch", "FSDP2 gathers"),
)
_GEMM_NAMES = ("gemm", "nvjet", "cutlass", "cublas", "sm90_xmma", "cudnn", "flash", "fmha")


def _group_by_name(name: str) -> str:
    lowered = name.lower()
    if any(part in lowered for part in _GEMM_NAMES):
        return "GEMMs and attention"
    if name.startswith("triton_"):
        return "Inductor"
    if name.startswith("_") and name.endswith("_kernel"):
        return "quantize"
    return "other"


def gpu_time_by_group(trace_events: Sequence[dict]) -> dict[str, float]:
    """Microseconds of the GPU's work in a chrome trace's `traceEvents`, by GPU_GROUPS (kernels,
    memory copies and sets; those on concurrent streams each counted), plus "copies only": how long
    copies or sets run while no kernel does, and "idle": how long nothing runs, between the first
    and the last of them. A GPU event finds its launch through its correlation id."""
    launches: dict[object, float] = {}
    spans: list[tuple[float, float, str]] = []
    work: list[dict] = []
    for event in trace_events:
        if event.get("ph") != "X":
            continue
        category = event.get("cat")
        if category in ("cuda_runtime", "cuda_driver") and "correlation" in event.get("args", {}):
            launches[event["args"]["correlation"]] = float(event["ts"])
        elif category == "user_annotation":
            group = next((g for prefix, g in _LAUNCH_GROUPS if event.get("name", "").startswith(prefix)), None)
            if group is not None:
                spans.append((float(event["ts"]), float(event["ts"]) + float(event.get("dur", 0)), group))
        elif category in ("kernel", "gpu_memcpy", "gpu_memset"):
            work.append(event)
    if not work:
        return {}
    totals = dict.fromkeys(GPU_GROUPS, 0.0)
    for event in work:
        launched = launches.get(event.get("args", {}).get("correlation"))
        held = (group for start, end, group in spans if launched is not None and start <= launched <= end)
        totals[next(held, None) or _group_by_name(event.get("name", ""))] += float(event.get("dur", 0))
    intervals = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in work]
    kernels = [i for e, i in zip(work, intervals, strict=True) if e.get("cat") == "kernel"]
    busy = sum(end - start for start, end in union(intervals))
    totals["copies only"] = busy - sum(end - start for start, end in union(kernels))
    totals["idle"] = max(end for _, end in intervals) - min(start for start, _ in intervals) - busy
    return totals


IDLE_SPANS = (
    "FSDP::root_pre_forward",
    "FSDP::pre_forward",
    "FSDP::post_forward",
    "FSDP::pre_backward",
    "FSDP::backward_prefetch",
    "FSDP::root_post_backward",
    "FSDP::post_backward",
    "## Call CompiledFxGraph",
    "Optimizer.zero_grad#",
    "Optimizer.step#",
)
"""The host spans `gpu_idle_by_launching_span` names (torch.profiler's names, matched as prefixes;
the first match names a span): FSDP2's hooks, the compiled graphs' Python, the optimizer."""


@dataclass(frozen=True)
class IdleGap:
    """A stretch in which the GPU runs nothing, and the work on either side of it."""

    start: float
    """When it begins (the trace's microseconds)."""
    length: float
    """Microseconds."""
    before: str
    """The kernel or copy whose end opens it."""
    before_span: str
    """Where the host launched it (`idle_gaps`)."""
    after: str
    """The kernel or copy that closes it."""
    after_span: str
    """Where the host launched it."""
    synced: bool
    """Whether the host waited for the GPU between the two launches."""


def idle_gaps(trace_events: Sequence[dict]) -> list[IdleGap]:
    """Every stretch between the first and the last GPU work of a chrome trace's `traceEvents` in
    which the GPU runs nothing, in time order. A launch's span is the innermost span of IDLE_SPANS
    around it (by its IDLE_SPANS prefix), else "elsewhere" (eager ops, autograd's engine, the
    training loop), or "not traced". The GPU waits through a gap for the host: the host time
    between the two launches is what to make cheaper ("## Call CompiledFxGraph" on both sides:
    launches within one graph's call, or from one graph to the next with no hook between).
    `synced`: the host waited for the GPU between the two launches (a `cuda*Synchronize` call, or
    a copy from or to pageable host memory, which synchronizes); the GPU drained while the host
    waited, and refills only as fast as the host launches."""
    launches: dict[object, float] = {}
    spans: list[tuple[float, float, str]] = []
    work: list[tuple[float, float, object, str]] = []
    syncs: list[float] = []  # host times at which the host waited for the GPU
    pageable: list[object] = []  # correlations of copies from or to pageable memory
    for event in trace_events:
        if event.get("ph") != "X":
            continue
        category, name = event.get("cat"), event.get("name", "")
        start, end = float(event.get("ts", 0)), float(event.get("ts", 0)) + float(event.get("dur", 0))
        if category in ("cuda_runtime", "cuda_driver") and "correlation" in event.get("args", {}):
            launches[event["args"]["correlation"]] = start
        elif category in ("cpu_op", "user_annotation"):
            label = next((prefix for prefix in IDLE_SPANS if name.startswith(prefix)), None)
            if label is not None:
                spans.append((start, end, label))
        elif category in ("kernel", "gpu_memcpy", "gpu_memset"):
            work.append((start, end, event.get("args", {}).get("correlation"), name))
            if category == "gpu_memcpy" and "Pageable" in name:
                pageable.append(event.get("args", {}).get("correlation"))
        if category in ("cuda_runtime", "cuda_driver") and "Synchronize" in name:
            syncs.append(start)
    syncs += [launches[c] for c in pageable if c in launches]
    syncs.sort()

    def launched_in(correlation: object) -> str:
        launched = launches.get(correlation)
        if launched is None:
            return "not traced"
        around = [s for s in spans if s[0] <= launched <= s[1]]
        return max(around, key=lambda s: (s[0], -s[1]))[2] if around else "elsewhere"

    def waited_between(a: object, b: object) -> bool:
        before, after = launches.get(a), launches.get(b)
        if before is None or after is None:
            return False
        return bisect.bisect_left(syncs, before) < bisect.bisect_right(syncs, after)

    gaps: list[IdleGap] = []
    work.sort(key=lambda w: w[0])
    busy_until, last = (work[0][1], work[0]) if work else (0.0, None)
    for item in work[1:]:
        start, end, correlation, name = item
        if start > busy_until:
            gaps.append(
                IdleGap(
                    start=busy_until,
                    length=start - busy_until,
                    before=last[3],
                    before_span=launched_in(last[2]),
                    after=name,
                    after_span=launched_in(correlation),
                    synced=waited_between(last[2], correlation),
                )
            )
        if end > busy_until:
            busy_until, last = end, item
    return gaps


def gpu_idle_by_launching_span(gaps: Sequence[IdleGap]) -> dict[str, float]:
    """Microseconds the GPU runs nothing in `gaps` (`idle_gaps` of a trace) by the spans that
    launched the work on either side of each gap, as "BEFORE -> AFTER", with ", synced" where the
    host waited for the GPU between the two launches."""
    idle: dict[str, float] = {}
    for gap in gaps:
        label = f"{gap.before_span} -> {gap.after_span}" + (", synced" if gap.synced else "")
        idle[label] = idle.get(label, 0.0) + gap.length
    return idle


def kernel_intervals(trace_events: Sequence[dict]) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """(communication, compute) intervals in microseconds of the GPU kernels in a chrome trace's
    `traceEvents` (torch.profiler's export_chrome_trace): NCCL kernels (names containing "nccl")
    and every other kernel. Memory copies and sets count as neither."""
    communication, compute = [], []
    for event in trace_events:
        if event.get("ph") == "X" and event.get("cat") == "kernel":
            interval = (float(event["ts"]), float(event["ts"]) + float(event.get("dur", 0)))
            (communication if "nccl" in event.get("name", "").lower() else compute).append(interval)
    return communication, compute


# ---- where the peak comes from ----------------------------------------------------------------------


@dataclass
class PhasePeaks:
    """Bytes allocated on the device at the start of a step and at the end of each of its phases,
    and the peak within each phase (torch.cuda.max_memory_allocated, reset at each phase's start)."""

    start: int = 0
    allocated: dict[str, int] = field(default_factory=dict)
    peak: dict[str, int] = field(default_factory=dict)


@contextlib.contextmanager
def phase(peaks: PhasePeaks | None, name: str, device: torch.device) -> Iterator[None]:
    """Records `name`'s peak and end-of-phase allocation into `peaks` (a no-op for None or the CPU)."""
    if peaks is None or device.type != "cuda":
        yield
        return
    torch.cuda.synchronize(device)
    if not peaks.allocated:
        peaks.start = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    yield
    torch.cuda.synchronize(device)
    peaks.peak[name] = torch.cuda.max_memory_allocated(device)
    peaks.allocated[name] = torch.cuda.memory_allocated(device)


def _site(frames: Sequence[dict]) -> str:
    """The innermost frame of an allocation that is in this project's or a model's code, else in
    torch (FSDP2, autograd, the optimizer): where the bytes were asked for."""
    interesting = ("quant_", "transformers/", "benchmarks/", "torchao/", "torch/distributed/", "torch/optim/")
    for frame in frames:
        name = frame.get("filename", "")
        if any(key in name for key in interesting):
            short = name.split("site-packages/")[-1].split("src/")[-1]
            return f"{short}:{frame.get('line')} {frame.get('name')}"
    return frames[0].get("filename", "?").split("site-packages/")[-1] + " (no project frame)" if frames else "?"


def live_at_peak(snapshot: dict, device_index: int, top: int = 20) -> dict:
    """Replays a `torch.cuda.memory._snapshot()` trace: the allocations made during the recording
    that are alive at its highest point, summed by the site that made them (_site), largest first.

    Tensors allocated before the recording started (parameters, optimizer states) have no
    allocation event: they are the step's starting bytes, not part of these."""
    live: dict[int, tuple[int, str]] = {}
    total = peak_total = 0
    at_peak: dict[int, tuple[int, str]] = {}
    for event in snapshot["device_traces"][device_index]:
        action, address, size = event["action"], event["addr"], event["size"]
        if action == "alloc":
            live[address] = (size, _site(event.get("frames", [])))
            total += size
            if total > peak_total:
                peak_total, at_peak = total, dict(live)
        elif action == "free_requested" and address in live:
            total -= live.pop(address)[0]
    by_site: dict[str, int] = {}
    by_size: dict[tuple[str, int], int] = {}  # (site, allocation size) -> how many
    for size, site in at_peak.values():
        by_site[site] = by_site.get(site, 0) + size
        by_size[site, size] = by_size.get((site, size), 0) + 1
    largest = sorted(by_site.items(), key=lambda item: -item[1])[:top]
    sizes = sorted(by_size.items(), key=lambda item: -item[0][1] * item[1])[:top]
    return {
        "bytes_at_peak": peak_total,
        "by_site": dict(largest),
        "by_size": [{"site": site, "bytes": size, "count": count} for (site, size), count in sizes],
    }


@contextlib.contextmanager
def recorded_memory(device: torch.device, into: dict) -> Iterator[None]:
    """Records the CUDA allocator's history over the block and puts live_at_peak's answer in `into`."""
    if device.type != "cuda":
        yield
        return
    torch.cuda.memory._record_memory_history(max_entries=500_000, stacks="python")
    try:
        yield
        torch.cuda.synchronize(device)
        into.update(live_at_peak(torch.cuda.memory._snapshot(), device.index or 0))
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
