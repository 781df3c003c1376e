"""The `quant-fsdp` command line: `demo` FSDP2-trains a small transformer with bf16 and each recipe
and checks the quantized all-gather. The demo and the benchmarks live in the repository (its lab
package, lab/, and its benchmarks/ folder), not in this package."""

# A module beside the quant_fsdp package, not in it: importing quant_fsdp imports torch (seconds), so
# the command parses and answers --help, --version and bad arguments before importing either. The
# demo is the repository's lab package (quant_lab.demo), installed beside quant-fsdp from a clone.

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.util
import os
import pathlib
import shlex
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from typing import NoReturn

Runner = Callable[[pathlib.Path], int]

# The demo's recipes and global batch (quant_lab.demo._training), repeated here so that checking
# --recipes and --nproc imports no torch; test_cli checks that both agree.
RECIPES = ("fp8", "fp8-delayed", "mxfp8", "fp8-block", "nvfp4")
BATCH = 8


class _Parser(argparse.ArgumentParser):
    """argparse, with a refused value reported in one line (no usage block above it)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `quant-fsdp` console script. Every argument is checked before any work
    starts: a bad value exits with code 2 and one line naming it and what to do."""
    parser = _Parser(prog="quant-fsdp", description=__doc__)
    version = importlib.metadata.version("quant-fsdp")
    parser.add_argument("--version", action="version", version=f"quant-fsdp {version}")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="FSDP2-train a small transformer with bf16 and each recipe")
    _add_demo_arguments(demo)
    demo.set_defaults(subparser=demo)  # reports the demo's option errors as `quant-fsdp demo: error: ...`
    args = parser.parse_args(argv)
    if importlib.util.find_spec("quant_lab") is None:
        args.subparser.exit(
            2,
            f"{args.subparser.prog}: error: the demo ships with the quant-fsdp repository, not with this package: "
            "run `nox -s demo` in a clone of it, or `pip install ./lab` there and then quant-fsdp demo\n",
        )
    problem = _unwritable(args.out)
    if problem:
        args.subparser.error(f"argument --out {args.out}: {problem}")
    try:
        run = _demo_command(args.subparser, args, argv)
        with _staged(args.out) as folder:
            return run(folder)
    except KeyboardInterrupt:  # Ctrl-C: the ranks are ended (quant_lab.demo.run_ranks), `out` is as it was
        print(f"{args.subparser.prog}: interrupted; nothing written to {args.out}", file=sys.stderr)
        return 130


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
    value = _integer(text)
    if not 1 <= value <= BATCH or BATCH % value:
        divisors = ", ".join(str(n) for n in range(1, BATCH + 1) if BATCH % n == 0)
        raise argparse.ArgumentTypeError(
            f"must split the global batch of {BATCH} sequences evenly over the ranks: one of {divisors}; got {value}"
        )
    return value


def _recipe_names(text: str) -> tuple[str, ...]:
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


def _unwritable(out: pathlib.Path) -> str:
    """Why results cannot be written to folder `out` (created later, when work starts), or ''."""
    if out.exists() and not out.is_dir():
        return "exists and is not a folder; name a folder"
    existing = next(p for p in (out.absolute(), *out.absolute().parents) if p.exists())
    if not existing.is_dir():
        return f"{existing} is a file, so no folder can be created in it; name a folder"
    if not os.access(existing, os.W_OK | os.X_OK):
        where = "folder is not writable" if existing == out.absolute() else f"folder {existing} is not writable"
        return f"{where}; name a writable folder"
    try:  # a probe folder, removed at once: permissions alone do not tell (root, /proc, read-only mounts)
        os.rmdir(tempfile.mkdtemp(dir=existing))
    except OSError as error:
        return f"cannot create folders in {existing} ({error.strerror}); name a writable folder"
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
        metavar="FOLDER",
        help="folder for demo.json, demo_gather.json and demo_loss.png, created if missing and filled once the "
        "demo has finished (default results)",
    )


def _demo_command(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: Sequence[str] | None) -> Runner:
    import torch

    from quant_lab.demo._run import run_demo
    from quant_lab.demo._training import DemoOptions

    num_gpus = torch.cuda.device_count()
    if args.device == "cuda" and num_gpus == 0:
        parser.error(f"argument --device: torch {torch.__version__} sees no GPU; use --device cpu (or auto)")
    if args.device == "cuda" and num_gpus < args.nproc:
        parser.error(
            f"argument --nproc: {args.nproc} ranks on --device cuda need {args.nproc} GPUs, torch sees {num_gpus}; "
            f"use --nproc {num_gpus} or --device cpu"
        )
    device = "cuda" if args.device == "cuda" or (args.device == "auto" and num_gpus >= args.nproc) else "cpu"
    cores = _cpu_cores()
    if device == "cpu" and args.nproc > cores:
        print(
            f"{parser.prog}: warning: --nproc {args.nproc} is more ranks than the {cores} CPU cores this process "
            f"may use; the ranks then wait for cores, so tokens/s and step ms are not comparable with runs of "
            f"--nproc {cores} or fewer",
            file=sys.stderr,
        )
    options = DemoOptions(
        recipes=args.recipes,
        num_ranks=args.nproc,
        num_steps=args.steps,
        device=device,
        seed=args.seed,
        command=_command_line(argv),
    )
    return lambda out: run_demo(out, options)


def _cpu_cores() -> int:
    """CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _command_line(argv: Sequence[str] | None) -> str:
    return shlex.join(["quant-fsdp", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
