"""The `quant-fsdp` command line: `demo` runs the end-to-end job, `bench` the benchmark suite."""

from __future__ import annotations

import argparse
import pathlib
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `quant-fsdp` console script."""
    parser = argparse.ArgumentParser(prog="quant-fsdp", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="train a small transformer with every recipe and bf16; check the kernels")
    demo.add_argument("--out", type=pathlib.Path, default=pathlib.Path("results"), help="folder for demo.json")
    demo.add_argument("--world-size", type=int, default=4, help="shards in the simulated FSDP gather")
    demo.add_argument("--steps", type=int, default=100, help="training steps per run")
    bench = commands.add_parser("bench", help="run the benchmark suite and write JSON")
    bench.add_argument("--out", type=pathlib.Path, default=pathlib.Path("results"), help="folder for bench.json")
    bench.add_argument("--size", type=int, default=4096, help="square input size of the kernel benchmarks")
    bench.add_argument("--min-run-time", type=float, default=1.0, help="seconds measured per case")
    bench.add_argument(
        "--device",
        choices=("all", "cpu", "cuda"),
        default="all",
        help="devices to benchmark (all: CPU and CUDA if present)",
    )
    args = parser.parse_args(argv)

    if args.command == "demo":
        from quant_fsdp._demo import run_demo

        return run_demo(args.out, world_size=args.world_size, steps=args.steps)
    from quant_fsdp._bench import run_bench

    return run_bench(args.out, size=args.size, min_run_time=args.min_run_time, device=args.device)


if __name__ == "__main__":
    sys.exit(main())
