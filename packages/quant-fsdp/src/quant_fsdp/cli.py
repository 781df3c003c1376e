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

from quant_fsdp._version import __version__

Runner = Callable[[pathlib.Path], int]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `quant-fsdp` console script. Every argument is checked before any work
    starts: a bad value exits with code 2 and one line naming it (argparse's convention)."""
    parser = argparse.ArgumentParser(prog="quant-fsdp", description=__doc__)
    parser.add_argument("--version", action="version", version=f"quant-fsdp {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="train a small transformer with every recipe and bf16; check the kernels")
    demo.add_argument(
        "--out",
        type=pathlib.Path,
        default=pathlib.Path("results"),
        help="folder for demo.json, demo_gather.json and demo_loss.png",
    )
    demo.add_argument(
        "--world-size",
        type=_world_size,
        default=4,
        help="shards in the simulated FSDP gather check (a power of two, 1-64; training always uses 2 ranks)",
    )
    demo.add_argument("--steps", type=_positive, default=100, help="training steps per run")
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
        from quant_fsdp._demo import run_demo

        return lambda out: run_demo(out, world_size=args.world_size, steps=args.steps)
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


_E2E_OPTIONS = ("runs", "config", "steps", "warmup", "model", "compile_backend", "fidelity")


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _world_size(text: str) -> int:
    value = int(text)
    if not 1 <= value <= 64 or value & (value - 1):
        raise argparse.ArgumentTypeError(
            f"must be a power of two from 1 to 64 (the demo's weights split into equal block-aligned shards), got {value}"
        )
    return value


def _kernel_size(text: str) -> int:
    value = int(text)
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
        help="comma-separated globs on run names <base>[:hp|qw]:eager|compiled, e.g. 'bf16,fp8', '*:compiled', "
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
    e2e.add_argument(
        "--fidelity",
        type=_positive,
        metavar="STEPS",
        help="train each run STEPS steps on the Markov task and compare final losses with bf16 (writes "
        "e2e_fidelity.json/.md/.png)",
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
        }
        options = E2EOptions(
            **{k: v for k, v in settings.items() if v is not None},
            device=args.device,
            command=shlex.join(["quant-fsdp", *(sys.argv[1:] if argv is None else argv)]),
        )
    except ValueError as error:
        parser.error(str(error))
    if args.fidelity:
        from quant_fsdp._e2e_fidelity import run_fidelity

        return lambda out: run_fidelity(out, runs, options, num_steps=args.fidelity)
    return lambda out: run_e2e(out, runs, options)


if __name__ == "__main__":
    sys.exit(main())
