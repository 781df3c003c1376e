"""The `quant-fsdp` command line: `demo` runs the end-to-end job, `bench` the benchmark suite
(`bench --e2e`: training a Llama-style decoder on one device)."""

from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import shlex
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from typing import NoReturn

from quant_fsdp._version import __version__

Runner = Callable[[pathlib.Path], int]


class _Parser(argparse.ArgumentParser):
    """argparse, with a refused value reported in one line (no usage block above it)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `quant-fsdp` console script. Every argument is checked before any work
    starts: a bad value exits with code 2 and one line naming it and what to do."""
    parser = _Parser(prog="quant-fsdp", description=__doc__)
    parser.add_argument("--version", action="version", version=f"quant-fsdp {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="FSDP2-train a small transformer with bf16 and each recipe")
    _add_demo_arguments(demo)
    demo.set_defaults(subparser=demo)  # reports the demo's option errors as `quant-fsdp demo: error: ...`
    bench = commands.add_parser("bench", help="run the benchmark suite and write JSON")
    bench.add_argument("--out", type=pathlib.Path, default=pathlib.Path("results"), help="folder for the JSON results")
    bench.add_argument(
        "--size", type=_kernel_size, default=4096, help="square input size of the kernel benchmarks (a multiple of 128)"
    )
    bench.add_argument("--min-run-time", type=_positive_seconds, default=1.0, help="seconds measured per case")
    bench.add_argument(
        "--device",
        choices=("all", "cpu", "cuda"),
        default="all",
        help="devices to benchmark (all: CPU and CUDA if present; with --e2e: CUDA if present, else the CPU)",
    )
    bench.add_argument(
        "--linear",
        action="store_true",
        help="host time per Linear forward + backward (bf16 256^3): nn.Linear, every recipe, torchao; eager and "
        "compiled; write linear_host.json",
    )
    _add_e2e_arguments(bench)
    args = parser.parse_args(argv)
    problem = _unwritable(args.out)
    if problem:
        parser.error(f"--out {args.out}: {problem}")
    run = _command(parser, args, argv)
    with _staged(args.out) as folder:
        return run(folder)


def _command(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: Sequence[str] | None) -> Runner:
    """The checked command, as a function of the folder it writes into."""
    if args.command == "demo":
        return _demo_command(args.subparser, args, argv)
    if args.e2e:
        return _e2e_command(parser, args, argv)
    if args.linear:
        from quant_fsdp._bench_linear import run_linear_host_bench

        return lambda out: run_linear_host_bench(out, args.device)
    given = [f"--{name.replace('_', '-')}" for name in _E2E_OPTIONS if getattr(args, name) is not None]
    if given:
        parser.error(f"{', '.join(given)} configure the end-to-end benchmark: add --e2e")
    from quant_fsdp._bench import run_bench

    return lambda out: run_bench(out, size=args.size, min_run_time=args.min_run_time, device=args.device)


@contextlib.contextmanager
def _staged(out: pathlib.Path) -> Iterator[pathlib.Path]:
    """A temporary folder the command writes into; its files move into `out` once the command
    has returned (whatever its exit code), so a run that raises or is interrupted leaves `out` as
    it was."""
    staging = pathlib.Path(tempfile.mkdtemp(prefix="quant-fsdp-"))
    try:
        yield staging
        written = sorted(staging.iterdir())
        out.mkdir(parents=True, exist_ok=True)
        for path in written:
            shutil.move(path, out / path.name)
        print(f"wrote {', '.join(p.name for p in written)} to {out}")
    finally:
        shutil.rmtree(staging, ignore_errors=True)


_E2E_OPTIONS = (
    "runs",
    "config",
    "steps",
    "warmup",
    "model",
    "compile_backend",
    "fidelity",
    "lr",
    "init_seed",
    "micro_batches",
    "weight_cache",
    "baseline",
)


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None


def _positive(text: str) -> int:
    value = _integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _seed(text: str) -> int:
    value = _integer(text)
    if not 0 <= value < 2**63:
        raise argparse.ArgumentTypeError(f"must be a whole number from 0 to 2**63 - 1, got {value}")
    return value


def _num_ranks(text: str) -> int:
    from quant_fsdp.demo._training import BATCH

    value = _integer(text)
    if not 1 <= value <= BATCH or BATCH % value:
        divisors = ", ".join(str(n) for n in range(1, BATCH + 1) if BATCH % n == 0)
        raise argparse.ArgumentTypeError(
            f"must split the global batch of {BATCH} sequences evenly over the ranks: one of {divisors}; got {value}"
        )
    return value


def _recipe_names(text: str) -> tuple[str, ...]:
    from quant_fsdp.demo._training import RECIPES

    if text.strip() == "all":
        return RECIPES
    names = [name.strip() for name in text.split(",")]
    unknown = [name for name in names if name not in RECIPES]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown recipe {', '.join(map(repr, unknown))}; give 'all' or a comma-separated list of "
            f"{', '.join(RECIPES)} (bf16 always runs, as the baseline)"
        )
    return tuple(dict.fromkeys(names))


def _kernel_size(text: str) -> int:
    value = _integer(text)
    if value < 128 or value % 128:
        raise argparse.ArgumentTypeError(f"must be a positive multiple of 128 (every block format's tile), got {value}")
    return value


def _positive_seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 seconds, got {text}")
    return value


def _unwritable(out: pathlib.Path) -> str:
    """Why results cannot be written to folder `out` (created later, when work starts), or ''."""
    if out.exists() and not out.is_dir():
        return "exists and is not a folder; name a folder"
    existing = next(p for p in (out.absolute(), *out.absolute().parents) if p.exists())
    try:  # a probe folder, removed at once: permissions alone do not tell (root, /proc, read-only mounts)
        os.rmdir(tempfile.mkdtemp(dir=existing))
    except OSError as error:
        return f"cannot create folders under {existing} ({error.strerror}); name a writable folder"
    return ""


DEMO_STEPS = 60  # every recipe on 2 CPU ranks: 1m23s on 2 idle cores, ~2 min shared (100 steps: 3m38s shared)


def _add_demo_arguments(demo: argparse.ArgumentParser) -> None:
    demo.add_argument(
        "--recipes",
        type=_recipe_names,
        metavar="NAMES",
        default="all",
        help="comma-separated recipes trained after bf16: fp8, fp8-delayed, mxfp8, fp8-block, nvfp4 (default: all)",
    )
    demo.add_argument(
        "--nproc",
        type=_num_ranks,
        metavar="N",
        default=2,
        help="training ranks, each a process with 8/N sequences of each batch: 1, 2, 4 or 8 (default 2); the "
        "simulated gather check shards over as many",
    )
    demo.add_argument(
        "--steps", type=_positive, default=DEMO_STEPS, help=f"training steps per run (default {DEMO_STEPS})"
    )
    demo.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="cpu: gloo ranks; cuda: NCCL, one GPU per rank; auto (default): cuda when torch sees --nproc GPUs, "
        "else cpu",
    )
    demo.add_argument(
        "--seed", type=_seed, default=0, help="seed of the initial weights and of the task's Markov chain (default 0)"
    )
    demo.add_argument(
        "--out",
        type=pathlib.Path,
        default=pathlib.Path("results"),
        help="folder for demo.json, demo_gather.json and demo_loss.png (default results)",
    )


def _demo_command(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: Sequence[str] | None) -> Runner:
    import torch

    from quant_fsdp.demo._run import run_demo
    from quant_fsdp.demo._training import DemoOptions

    num_gpus = torch.cuda.device_count()
    if args.device == "cuda" and num_gpus == 0:
        parser.error(f"argument --device: torch {torch.__version__} sees no GPU; use --device cpu (or auto)")
    if args.device == "cuda" and num_gpus < args.nproc:
        parser.error(
            f"argument --nproc: {args.nproc} ranks on --device cuda need {args.nproc} GPUs, torch sees {num_gpus}; "
            f"use --nproc {num_gpus} or --device cpu"
        )
    device = "cuda" if args.device == "cuda" or (args.device == "auto" and num_gpus >= args.nproc) else "cpu"
    options = DemoOptions(
        recipes=args.recipes,
        num_ranks=args.nproc,
        num_steps=args.steps,
        device=device,
        seed=args.seed,
        command=_command_line(argv),
    )
    return lambda out: run_demo(out, options)


def _command_line(argv: Sequence[str] | None) -> str:
    return shlex.join(["quant-fsdp", *(sys.argv[1:] if argv is None else argv)])


def _add_e2e_arguments(bench: argparse.ArgumentParser) -> None:
    bench.add_argument(
        "--e2e",
        action="store_true",
        help="instead of the kernels: train a Llama-style decoder on one device with bf16, torchao float8 and every "
        "recipe; write e2e.json and e2e.md",
    )
    e2e = bench.add_argument_group("end to end (with --e2e)")
    e2e.add_argument(
        "--runs",
        help="comma-separated globs on run names <base>[:hp|qw]:eager|compiled|graphed, e.g. 'bf16,fp8', '*:compiled', "
        "'fp8:qw', 'all' (default: every eager run plus bf16, torchao tensorwise and fp8 compiled; with "
        "--fidelity: bf16:eager and every recipe's hp:eager)",
    )
    e2e.add_argument("--config", choices=("default", "large", "tiny"), help="model size (default: default)")
    e2e.add_argument("--steps", type=_positive, help="timed steps per run (default 8)")
    e2e.add_argument("--warmup", type=int, help="untimed warm-up steps per run (default 3)")
    e2e.add_argument(
        "--model",
        choices=("auto", "transformers", "builtin"),
        help="transformers' LlamaForCausalLM or the built-in equivalent (default auto: transformers when it imports)",
    )
    e2e.add_argument("--compile-backend", help="torch.compile backend of the compiled runs (default inductor)")
    e2e.add_argument("--lr", type=float, help="AdamW learning rate, in (0, 1) (default 3e-4)")
    e2e.add_argument(
        "--init-seed", type=_seed, help="seed of the initial weights; the batches stay the same (default 0)"
    )
    e2e.add_argument(
        "--micro-batches",
        type=_positive,
        metavar="N",
        help="split each step's batch into N micro-batches and accumulate their gradients (default 1)",
    )
    e2e.add_argument(
        "--weight-cache",
        action="store_true",
        default=None,
        help="with high-precision weights, quantize each weight once per step (qt.nn.weight_cache around the "
        "micro-batches) instead of once per micro-batch",
    )
    e2e.add_argument(
        "--fidelity",
        type=_positive,
        metavar="STEPS",
        help="train each run STEPS steps on the Markov task and compare final losses with bf16 (writes "
        "e2e_fidelity.json/.md/.png)",
    )
    e2e.add_argument(
        "--baseline",
        type=pathlib.Path,
        metavar="JSON",
        help="with --fidelity: bf16 eager's curve from an earlier e2e_fidelity.json of the same training instead of "
        "training it again",
    )


def _e2e_command(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: Sequence[str] | None) -> Runner:
    from quant_fsdp._bench_e2e import DEFAULT_FIDELITY_RUNS, DEFAULT_RUNS, E2EOptions, run_e2e, select_runs

    try:
        runs = select_runs(args.runs or (DEFAULT_FIDELITY_RUNS if args.fidelity else DEFAULT_RUNS))
        settings = {
            "config": args.config,
            "num_steps": args.steps,
            "num_warmup": args.warmup,
            "model_source": args.model,
            "compile_backend": args.compile_backend,
            "learning_rate": args.lr,
            "init_seed": args.init_seed,
            "micro_batches": args.micro_batches,
            "weight_cache": args.weight_cache,
        }
        options = E2EOptions(
            **{k: v for k, v in settings.items() if v is not None},
            device=args.device,
            command=_command_line(argv),
        )
    except ValueError as error:
        parser.error(str(error))
    if args.baseline is not None and not args.fidelity:
        parser.error("--baseline is the bf16 curve of a fidelity comparison: add --fidelity STEPS")
    if args.fidelity:
        from quant_fsdp._e2e_fidelity import load_baseline, run_fidelity

        if args.baseline is not None:
            try:
                load_baseline(args.baseline)
            except ValueError as error:
                parser.error(str(error))
        return lambda out: run_fidelity(out, runs, options, num_steps=args.fidelity, baseline=args.baseline)
    return lambda out: run_e2e(out, runs, options)


if __name__ == "__main__":
    sys.exit(main())
