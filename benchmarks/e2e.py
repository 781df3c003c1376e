"""Train a Llama-style decoder on one device: bf16, torchao float8 and every recipe (_e2e.py says
what each run does and measures); `--fidelity STEPS` compares how each run trains (_e2e_fidelity.py).

    python benchmarks/e2e.py --device cuda --out results [--runs ...] [--config default|large|tiny] [--repeats N]

Writes e2e.json and e2e.md (with --fidelity: e2e_fidelity.json/.md/.png) into --out. Every
argument is checked before any work starts: a bad value exits with code 2 and one line naming it.
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import shlex
import sys
from collections.abc import Sequence

import torch
from _arguments import Parser, positive, seed
from _e2e import DEFAULT_FIDELITY_RUNS, DEFAULT_RUNS, E2EOptions, RunSpec, run_e2e, run_e2e_processes, select_runs


def parse_args(argv: Sequence[str] | None = None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    parser = Parser(prog="e2e.py", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("results"), help="folder for the results")
    parser.add_argument(
        "--device", choices=("all", "cpu", "cuda"), default="all", help="cuda; cpu; all (default): CUDA if present"
    )
    parser.add_argument(
        "--runs",
        help="comma-separated globs on run names <base>[:hp|qw]:eager|compiled|graphed, e.g. 'bf16,fp8', '*:compiled', "
        "'fp8:qw', 'all' (default: every eager run plus bf16, torchao tensorwise and fp8 compiled; with "
        "--fidelity: bf16:eager and every recipe's hp:eager)",
    )
    parser.add_argument("--config", choices=("default", "large", "tiny"), help="model size (default: default)")
    parser.add_argument("--steps", type=positive, help="timed steps per run (default 8)")
    parser.add_argument("--warmup", type=int, help="untimed warm-up steps per run (default 3)")
    parser.add_argument(
        "--model",
        choices=("auto", "transformers", "builtin"),
        help="transformers' LlamaForCausalLM or the built-in equivalent (default auto: transformers when it imports)",
    )
    parser.add_argument("--compile-backend", help="torch.compile backend of the compiled runs (default inductor)")
    parser.add_argument("--lr", type=float, help="AdamW learning rate, in (0, 1) (default 3e-4)")
    parser.add_argument(
        "--init-seed", type=seed, help="seed of the initial weights; the batches stay the same (default 0)"
    )
    parser.add_argument(
        "--micro-batches",
        type=positive,
        metavar="N",
        help="split each step's batch into N micro-batches and accumulate their gradients (default 1)",
    )
    parser.add_argument(
        "--weight-cache",
        action="store_true",
        default=None,
        help="with high-precision weights, quantize each weight once per step (qt.nn.weight_cache around the "
        "micro-batches) instead of once per micro-batch",
    )
    parser.add_argument(
        "--repeats",
        type=positive,
        metavar="N",
        help="run each run N times, each time in a process of its own, the runs alternating; a row per run "
        "with the median tokens/s and its spread (default 1: every run in this process)",
    )
    parser.add_argument(
        "--fidelity",
        type=positive,
        metavar="STEPS",
        help="train each run STEPS steps on the Markov task and compare final losses with bf16 (writes "
        "e2e_fidelity.json/.md/.png)",
    )
    parser.add_argument(
        "--workers",
        type=positive,
        metavar="N",
        help="with --fidelity: train the runs in N processes side by side, dealt out in turn (CUDA: one GPU each, "
        "the first N visible), one report of them all (default 1)",
    )
    parser.add_argument(
        "--baseline",
        type=pathlib.Path,
        metavar="JSON",
        help="with --fidelity: bf16 eager's curve from an earlier e2e_fidelity.json of the same training instead of "
        "training it again",
    )
    return parser, parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    parser, args = parse_args(argv)
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
        command = shlex.join(["python", "benchmarks/e2e.py", *(sys.argv[1:] if argv is None else argv)])
        options = E2EOptions(
            **{k: v for k, v in settings.items() if v is not None}, device=args.device, command=command
        )
    except ValueError as error:
        parser.error(str(error))
    if args.baseline is not None and not args.fidelity:
        parser.error("--baseline is the bf16 curve of a fidelity comparison: add --fidelity STEPS")
    if args.repeats is not None and args.fidelity:
        parser.error("--repeats times runs in processes of their own: leave out --fidelity, or --repeats")
    if args.workers is not None and not args.fidelity:
        parser.error("--workers spreads the runs of a fidelity comparison: add --fidelity STEPS")
    on_cuda = options.device != "cpu" and torch.cuda.is_available()
    if on_cuda and (args.workers or 1) > torch.cuda.device_count():
        parser.error(f"--workers {args.workers}: only {torch.cuda.device_count()} CUDA devices are visible")
    if args.fidelity:
        from _e2e_fidelity import load_baseline, run_fidelity

        if args.baseline is not None:
            try:
                load_baseline(args.baseline)
            except ValueError as error:
                parser.error(str(error))
        return run_fidelity(
            args.out, runs, options, num_steps=args.fidelity, baseline=args.baseline, workers=args.workers or 1
        )
    if (args.repeats or 1) > 1:
        return run_e2e_processes(args.out, runs, args.repeats, functools.partial(_process_argv, args), options.command)
    return run_e2e(args.out, runs, options)


def _process_argv(args: argparse.Namespace, run: RunSpec, out: pathlib.Path) -> list[str]:
    """This invocation's options for one process of `run` (--repeats), its report into `out`."""
    argv = ["--device", args.device, "--runs", run.name, "--out", str(out)]
    options = {
        "--config": args.config,
        "--steps": args.steps,
        "--warmup": args.warmup,
        "--model": args.model,
        "--compile-backend": args.compile_backend,
        "--lr": args.lr,
        "--init-seed": args.init_seed,
        "--micro-batches": args.micro_batches,
    }
    argv += [part for flag, value in options.items() if value is not None for part in (flag, str(value))]
    return argv + (["--weight-cache"] if args.weight_cache else [])


if __name__ == "__main__":
    sys.exit(main())
