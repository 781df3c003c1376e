"""Helpers for FSDP2 tests: train a sharded model, read a rank's bytes (and count_all_gather_bytes,
which the demo counts its gathered bytes with).

Tests train with quant_lab.demo.train; `train_data_parallel` calls it on the slice of a process
group's rank, with the loss averaged over the group. `TensorParallelModel` and
`tensor_parallel_plan` are the transformer the tensor-parallel tests shard with torch's
`parallelize_module`. `train_replicas` is the single-process reference of data-parallel training
(its own loop: several models step together): one model replica per rank slice of the same global
batch, gradients averaged. With quantized activations it is the
reference that differs from FSDP2 only in the order gradients are summed: each replica quantizes
its own slice, with that slice's per-tensor amax and its own stochastic-rounding stream, as each
rank does (a whole-batch single model quantizes the whole batch at once). `run_shared_world` runs
a test file's multi-rank scenarios in one process group ([Note: shared worlds]), on ranks that
stay up between calls (`run_on_warm_ranks`, [Note: warm ranks]).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import gc
import inspect
import multiprocessing.connection
import os
import pathlib
import signal
import sys
import sysconfig
import tempfile
import time
import traceback
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

import quant_tensors as qt
from quant_fsdp import QuantizeOnGatherTensor, fully_shard
from quant_fsdp.parallel import QuantColwiseParallel, QuantRowwiseParallel
from quant_lab import _warm_rank
from quant_lab._all_gather_counter import AllGatherBytes, count_all_gather_bytes
from quant_lab.demo import MarkovTask, MasterWeights, TinyTransformer, TransformerConfig, adamw, train
from quant_lab.demo._launch import load_by_path

__all__ = [
    "AllGatherBytes",
    "SharedWorld",
    "TensorParallelBlock",
    "TensorParallelModel",
    "count_all_gather_bytes",
    "local_bytes",
    "local_state_bytes",
    "quantized_transformer",
    "run_on_warm_ranks",
    "run_shared_world",
    "tensor_parallel_plan",
    "train_data_parallel",
    "train_replicas",
]


def train_data_parallel(
    model: torch.nn.Module,
    task: MarkovTask,
    *,
    steps: int,
    batch_size: int = 8,
    lr: float = 1e-3,
    group: dist.ProcessGroup | None = None,
) -> list[float]:
    """quant_lab.demo.train on this rank's slice of every global batch; returns the global
    batch's loss of every step (averaged over the ranks of `group`, default all ranks; without
    torch.distributed, the whole batch)."""
    world_size = dist.get_world_size(group) if dist.is_initialized() else 1
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    return train(model, task, steps=steps, batch_size=batch_size, lr=lr, batch_slice=(rank, world_size), group=group)


def train_replicas(
    replicas: list[torch.nn.Module],
    task: MarkovTask,
    *,
    steps: int,
    batch_size: int = 8,
    lr: float = 1e-3,
    optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer] | None = None,
) -> list[float]:
    """Data-parallel training in one process: replica i takes slice i of every global batch; the
    gradients are averaged and every replica takes the same optimizer step. Returns the mean losses.

    The optimizer is AdamW (weight decay 0, `lr`) over quant_lab.demo.MasterWeights, or
    `optimizer(replica)` where given (e.g. quant_optim.FusedAdam, which keeps the masters itself)."""
    world_size = len(replicas)
    if batch_size % world_size:
        raise ValueError(f"batch_size {batch_size} does not split over {world_size} replicas")
    if optimizer is None:
        masters = [MasterWeights(model) for model in replicas]
        optimizers = [adamw(m.parameters, lr=lr) for m in masters]
        steppers = [functools.partial(m.step, o) for m, o in zip(masters, optimizers, strict=True)]
    else:
        optimizers = [optimizer(model) for model in replicas]
        steppers = [o.step for o in optimizers]
    sequence = replicas[0].config.sequence
    device = next(replicas[0].parameters()).device  # the task's batches are drawn on the CPU
    losses = []
    for step in range(steps):
        inputs, targets = (t.to(device) for t in task.batch(step, batch_size, sequence))
        step_losses = []
        for model, x, y in zip(replicas, inputs.chunk(world_size), targets.chunk(world_size), strict=True):
            logits = model(x)
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
            loss.backward()
            step_losses.append(loss.detach())
        for params in zip(*(model.parameters() for model in replicas), strict=True):
            mean = torch.stack([p.grad for p in params]).sum(0) / world_size
            for p in params:
                p.grad = mean.clone()
        for step_replica, replica_optimizer in zip(steppers, optimizers, strict=True):
            step_replica()
            replica_optimizer.zero_grad(set_to_none=True)
        for model in replicas:
            model.zero_grad(set_to_none=True)
        losses.append((torch.stack(step_losses).sum() / world_size).item())
    return losses


def quantized_transformer(recipe_name: str, config: TransformerConfig, *, sharded: bool) -> TinyTransformer:
    """A TinyTransformer (seed 0) with quantized primary weights of the recipe; with `sharded`,
    quant_fsdp.fully_shard on every block, then on the root."""
    torch.manual_seed(0)
    model = qt.convert(TinyTransformer(config), qt.recipe_from_name(recipe_name), quantized_weights=True)
    if sharded:
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    return model


def local_bytes(t: torch.Tensor) -> list[torch.Tensor]:
    """Copies of this rank's bytes of a parameter or state (uint8): a QuantizedTensor's buffers, a
    QuantizeOnGatherTensor's wrapped shard, or the tensor's own. Columnwise data that is the
    lossless transpose of rowwise data is left out: a sharded weight keeps none, an unsharded one may."""
    local = t._local_tensor if isinstance(t, DTensor) else t
    if isinstance(local, qt.QuantizedTensor):
        derived = (
            local.quantizer is not None and local.quantizer.can_derive_columnwise and local.rowwise_data is not None
        )
        return [
            b.reshape(-1).view(torch.uint8).clone()
            for name, b in local.buffers().items()
            if b is not None and not (derived and name.startswith("columnwise"))
        ]
    if isinstance(local, QuantizeOnGatherTensor):  # its one inner tensor (torch's subclass protocol)
        (inner,), _ = local.__tensor_flatten__()
        local = getattr(local, inner)
    return [local.detach().reshape(-1).view(torch.uint8).clone()]


def local_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, list[torch.Tensor]]:
    """`local_bytes` of every parameter ("name") and of each of its optimizer states ("name/key")."""
    snapshot = {}
    for name, p in model.named_parameters():
        snapshot[name] = local_bytes(p)
        for key, value in optimizer.state[p].items():
            snapshot[f"{name}/{key}"] = local_bytes(value)
    return snapshot


# ---- a transformer for tensor parallelism -------------------------------------------------------------


class TensorParallelBlock(torch.nn.Module):
    """A pre-norm transformer block with separate q, k, v (so that each shards by heads under TP);
    its Linears are `linear(in_features, out_features)` (torch's, or qt.nn.Linear with a recipe)."""

    def __init__(self, config: TransformerConfig, linear: Callable[[int, int], torch.nn.Module] = torch.nn.Linear):
        super().__init__()
        hidden = config.hidden
        self.head_dim = hidden // config.heads
        self.attention_norm = torch.nn.LayerNorm(hidden)
        self.q, self.k, self.v, self.proj = (linear(hidden, hidden) for _ in range(4))
        self.mlp_norm = torch.nn.LayerNorm(hidden)
        self.fc1 = linear(hidden, 4 * hidden)
        self.fc2 = linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.attention_norm(x)
        q, k, v = self.q(h), self.k(h), self.v(h)
        batch, sequence = q.shape[:2]
        heads = lambda t: t.reshape(batch, sequence, -1, self.head_dim).transpose(1, 2)  # noqa: E731
        attention = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
        x = x + self.proj(attention.transpose(1, 2).reshape(batch, sequence, -1))
        return x + self.fc2(F.gelu(self.fc1(self.mlp_norm(x))))


class TensorParallelModel(torch.nn.Module):
    """Embedding, TensorParallelBlocks, norm and a high-precision LM head (as the e2e
    benchmark's model, benchmarks/_e2e_model.py); `config` is what the training loops of this module read."""

    def __init__(self, config: TransformerConfig, linear: Callable[[int, int], torch.nn.Module] = torch.nn.Linear):
        super().__init__()
        self.config = config
        self.embedding = torch.nn.Embedding(config.vocab, config.hidden)
        self.blocks = torch.nn.ModuleList(TensorParallelBlock(config, linear) for _ in range(config.layers))
        self.norm = torch.nn.LayerNorm(config.hidden)
        self.head = torch.nn.Linear(config.hidden, config.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def tensor_parallel_plan(model: TensorParallelModel, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """torch's styles for the embedding, norms and head; quant_fsdp.parallel's for the block Linears."""
    sp = sequence_parallel
    plan: dict[str, Any] = {
        "embedding": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1) if sp else Replicate()),
        "head": ColwiseParallel(input_layouts=Shard(1) if sp else Replicate(), output_layouts=Replicate()),
    }
    for i in range(len(model.blocks)):
        plan.update(
            {f"blocks.{i}.{name}": QuantColwiseParallel(sequence_parallel=sp) for name in ("q", "k", "v", "fc1")}
        )
        plan.update({f"blocks.{i}.{name}": QuantRowwiseParallel(sequence_parallel=sp) for name in ("proj", "fc2")})
        if sp:
            plan.update({f"blocks.{i}.{name}": SequenceParallel() for name in ("attention_norm", "mlp_norm")})
    if sp:
        plan["norm"] = SequenceParallel()
    return plan


# [Note: shared worlds]
# Starting a process group costs every multi-rank test seconds of spawning and importing torch on
# each rank, so a test file's scenarios of one world size run in one world, in order, and each test
# asserts on its scenario's outcome. A scenario is fn(rank, world_size, *args), a module-level
# function that leaves no global state behind (it restores what it patches). A scenario passed if
# every rank finished it (a barrier follows each one). The first failure ends the world: its test
# fails with the ranks' traceback, and the scenarios it kept from running run alone, each in its
# own world, when their tests ask for them (as run_ranks would), so every test still reports its own
# outcome.


class SharedWorld:
    """The outcome of `run_shared_world`: `check(label)` passes exactly when that scenario passed."""

    def __init__(
        self,
        world_size: int,
        scenarios: dict[str, tuple[Callable[..., None], tuple[Any, ...]]],
        passed: list[str],
        failure: str | None,
    ) -> None:
        self.world_size = world_size
        self.scenarios = scenarios
        self.passed = set(passed)
        # The scenarios run in order, so the first one not passed is the one that failed.
        self.failed = next((label for label in scenarios if label not in self.passed), None) if failure else None
        self.failure = failure

    def check(self, label: str) -> None:
        """Raises unless scenario `label` passed; one the failure kept from running runs now, alone."""
        if label not in self.scenarios:
            raise KeyError(f"no scenario {label!r} in this world; declared: {list(self.scenarios)}")
        if label in self.passed:
            return
        if label == self.failed:
            raise AssertionError(
                f"scenario {label!r} failed in the shared world of {self.world_size} ranks:\n{self.failure}"
            )
        fn, args = self.scenarios[label]
        run_on_warm_ranks(fn, self.world_size, *args)


def run_shared_world(world_size: int, scenarios: dict[str, tuple[Callable[..., None], tuple[Any, ...]]]) -> SharedWorld:
    """Runs every scenario (label: (fn, args), fn(rank, world_size, *args) as for run_ranks) in order
    in one world of `world_size` gloo ranks ([Note: shared worlds], on warm ranks); never raises
    for a failing scenario: `check(label)` on the result does."""
    sources = {str(pathlib.Path(inspect.getfile(fn)).resolve()) for fn, _ in scenarios.values()}
    if len(sources) != 1:
        raise ValueError(f"scenarios of one world come from one file; got {sorted(sources)}")
    plan = [(label, fn.__name__, args) for label, (fn, args) in scenarios.items()]
    failure = None
    with tempfile.TemporaryDirectory() as folder:
        log = pathlib.Path(folder) / "passed"
        log.touch()
        try:
            run_on_warm_ranks(_run_scenarios, world_size, sources.pop(), plan, str(log))
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as error:
            # The rank that spawn reports may be one whose peer failed first: add every rank's own error.
            errors = sorted(pathlib.Path(folder).glob("error-rank-*"))
            failure = "\n".join([str(error), *(f"{e.name}:\n{e.read_text()}" for e in errors)])
        passed = log.read_text().split("\n")[:-1]
    return SharedWorld(world_size, scenarios, passed, failure)


def _run_scenarios(rank: int, world_size: int, source: str, plan: list, log: str) -> None:
    module = load_by_path(source)
    for label, name, args in plan:
        try:
            getattr(module, name)(rank, world_size, *args)
        except BaseException:
            pathlib.Path(log).with_name(f"error-rank-{rank}").write_text(traceback.format_exc())
            raise
        dist.barrier()  # every rank finished it
        if rank == 0:
            with open(log, "a") as file:
                file.write(f"{label}\n")


# [Note: warm ranks]
# Spawning a rank costs ~6 s of CPU before any work (importing torch, its distributed and dynamo
# modules, the quant-* packages): minutes of a CI run over the tests' process groups. So the
# tests' gloo worlds run on ranks that stay up, and ranks start from a fork server (Python's
# "forkserver" start method) that imports torch's modules every rank imports (`_PRELOAD`) once per
# test process: a rank forked from it starts in ~0.2 s instead of ~2.5 s. A rank sets the
# environment variables of the process that starts it (quant_lab._warm_rank) before it imports
# quant_lab.testing and the quant-* packages, as a spawned rank would import them; only what torch
# reads from the environment when it is imported comes from the fork server's start, the first
# world's. The first call of a world size starts its ranks
# and process group, later calls send them (fn's file, fn's name, args) and wait for every rank's
# answer. Each call loads fn's file afresh (its module globals start new, as in a new process)
# and ends with a barrier, then drops that module, sets one intra-op thread again, resets
# torch.compile's caches and collects garbage. What torch keeps process-wide (compiled artifacts, fake tensors in their graphs) may
# outlive a call: a check over every live object skips what it does not own. A rank that
# raises or dies ends its world: the other ranks are killed and the error is raised as
# torch.multiprocessing's spawn raises it (ProcessRaisedException with the rank's traceback,
# ProcessExitedException with its exit code or signal); the next call starts new ranks. Each call
# imports as a rank started for it would: it runs with the caller's `sys.path` of that moment, and
# what it imported from outside the installed environment (the test file, helpers next to it, a
# script folder it put on the path) is dropped from `sys.modules` after it, so no call sees a
# module that an earlier call's file brought in under a name an installed package also has. Ranks
# keep the environment variables they started with. What must run in a fresh process (a
# process that never imports quant_fsdp, a rank killed on purpose, variables set for the ranks,
# NCCL) keeps `run_ranks`. At most `_MAX_WORLDS` worlds stay up at once (the least
# recently used one is closed first) to bound the memory their idle ranks hold: the tests' world
# sizes 1 to 4 all stay up (10 ranks, ~0.6 GiB resident each), so a file that moves between
# them (a checkpoint saved on 2 ranks, loaded on 1, 3 and 4) starts no world twice.
_MAX_WORLDS = 4
_DEATH_GRACE_S = 1.0
# What the fork server imports: the modules of torch that `import quant_lab.testing` imports (all
# but ~0.2 s of a rank's imports).
_PRELOAD = (
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "torch.distributed.tensor.parallel",
    "torch._dynamo",
)


def _rank_context() -> Any:
    """The multiprocessing context warm ranks start in: the fork server where there is one, else spawn."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(list(_PRELOAD))  # read when the server starts, at the first rank
    return context


class _WarmWorld:
    """`world_size` rank processes joined in a gloo process group, each serving calls over a pipe."""

    def __init__(self, world_size: int) -> None:
        context = _rank_context()
        self.folder = tempfile.TemporaryDirectory()
        store = str(pathlib.Path(self.folder.name) / "store")
        self.connections = []
        self.processes = []
        for rank in range(world_size):
            ours, theirs = context.Pipe()
            args = (dict(os.environ), rank, world_size, store, theirs)
            process = context.Process(target=_warm_rank.start, args=args, daemon=True)
            process.start()
            theirs.close()
            self.connections.append(ours)
            self.processes.append(process)

    def run(self, source: str, name: str, args: tuple[Any, ...]) -> None:
        for connection in self.connections:
            connection.send((source, name, args, sys.path))
        waiting = dict(enumerate(self.connections))
        while waiting:
            ready = multiprocessing.connection.wait([*waiting.values(), *(p.sentinel for p in self.processes)])
            for rank, connection in list(waiting.items()):
                if connection in ready:
                    try:
                        outcome = connection.recv()
                    except EOFError:  # it died: its exit code says how, below
                        continue
                    if outcome is not None:
                        # A peer that died makes the others fail ("connection closed by peer"):
                        # report the death, the cause, when it shows within a moment. (A rank
                        # that sent an error leaves with exit code 0: not a death.)
                        others = {p.sentinel: p for r, p in enumerate(self.processes) if r != rank}
                        deadline = time.monotonic() + _DEATH_GRACE_S
                        for sentinel in multiprocessing.connection.wait(list(others), timeout=_DEATH_GRACE_S):
                            # A process's sentinel closes before its exit code can be read: reap it.
                            others[sentinel].join(max(0.0, deadline - time.monotonic()))
                        self._raise_if_one_died({r: c for r, c in waiting.items() if r != rank}, deaths_only=True)
                        raise mp.ProcessRaisedException(
                            f"\n\n-- Process {rank} terminated with the following error:\n{outcome}",
                            rank,
                            self.processes[rank].pid,
                        )
                    del waiting[rank]
            self._raise_if_one_died(waiting)

    def _raise_if_one_died(self, waiting: dict[int, Any], deaths_only: bool = False) -> None:
        """Raises as torch's spawn does for the first rank of `waiting` that exited (with
        `deaths_only`, only for one killed by a signal or leaving with a nonzero code)."""
        for rank, process in enumerate(self.processes):
            if rank in waiting and process.exitcode is not None and not (deaths_only and process.exitcode == 0):
                code = process.exitcode
                signal_name = signal.Signals(-code).name if code < 0 else None
                how = f"signal {signal_name}" if signal_name else f"exit code {code}"
                raise mp.ProcessExitedException(
                    f"process {rank} terminated with {how}", rank, process.pid, code, signal_name
                )

    def close(self) -> None:
        for connection in self.connections:
            with contextlib.suppress(OSError):  # that rank is gone already
                connection.send(None)
        for process in self.processes:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join()
        self.folder.cleanup()

    def kill(self) -> None:
        for process in self.processes:
            process.kill()
        for process in self.processes:
            process.join()
        self.folder.cleanup()


_worlds: dict[int, _WarmWorld] = {}  # by world size, least recently used first


def run_on_warm_ranks(fn: Callable[..., None], world_size: int, *args: Any) -> None:
    """`run_ranks(fn, world_size, *args)` on gloo ranks that stay up between calls ([Note: warm
    ranks]): fn(rank, world_size, *args) on every rank, a module-level function of a file that
    rank processes can load by path. A failure in any rank re-raises here as `run_ranks` raises it."""
    source = str(pathlib.Path(inspect.getfile(fn)).resolve())
    world = _worlds.pop(world_size, None)
    if world is None:
        while len(_worlds) >= _MAX_WORLDS:
            _worlds.pop(next(iter(_worlds))).close()
        world = _WarmWorld(world_size)
    try:
        world.run(source, fn.__name__, args)
    except BaseException:
        world.kill()
        raise
    _worlds[world_size] = world


@atexit.register
def _close_worlds() -> None:
    while _worlds:
        _worlds.popitem()[1].close()


# Where a new rank imports from before any call: the standard library and site-packages.
_INSTALLED = tuple(
    {os.path.join(sysconfig.get_path(key), "") for key in ("stdlib", "platstdlib", "purelib", "platlib")}
)


def _imported_from_outside_the_environment(module: ModuleType) -> bool:
    file = getattr(module, "__file__", None)
    if isinstance(file, str):
        return not file.startswith(_INSTALLED)
    folders = getattr(module, "__path__", None)  # a namespace package has folders but no file
    return folders is not None and not all(str(folder).startswith(_INSTALLED) for folder in folders)


def _serve_calls(rank: int, world_size: int, store: str, connection: multiprocessing.connection.Connection) -> None:
    torch.set_num_threads(1)  # the world's processes share the machine's cores
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    while (call := connection.recv()) is not None:
        source, name, args, caller_path = call
        sys.path[:] = caller_path
        before = set(sys.modules)
        try:
            getattr(load_by_path(source), name)(rank, world_size, *args)
            dist.barrier()  # no rank takes the next call while another still runs this one
        except BaseException:
            connection.send(traceback.format_exc())
            break
        for module_name in sys.modules.keys() - before:  # the call's file and its globals go with it
            if _imported_from_outside_the_environment(sys.modules[module_name]):
                del sys.modules[module_name]
        # A call may change the process's intra-op threads (Accelerate's MULTI_CPU state sets them
        # to the physical cores per local rank it sees): with more threads than the world's share
        # of the cores, every later call's kernels spin in OpenMP waits, several times slower.
        torch.set_num_threads(1)
        torch._dynamo.reset()
        gc.collect()
        connection.send(None)
    # As run_ranks's ranks: leave without tearing the process group down (gloo's threads race
    # with interpreter finalization).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
