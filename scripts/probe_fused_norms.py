"""How far would fused RMSNorm modules take eager training? (issue #16's note, option (b))

    python3 scripts/probe_fused_norms.py [RUN ...]   # on the GPU machine, from gpu-suite.sh's environment
    # default runs: bf16:eager fp8:hp:eager fp8-block:hp:eager mxfp8:hp:eager

A probe for a design decision, not a feature: the e2e bench's default model (transformers'
LlamaForCausalLM when it imports) trained eagerly per run in two forms, alternating for ROUNDS
rounds (the VM's host speed drifts): as it is, and with every RMSNorm module compiled on its own
(one `torch.compile`d function with LlamaRMSNorm's math: Inductor makes its forward and its
backward a kernel or two each, standing in for a fused norm module; the rest stays eager). Tokens/s from the median step of the
bench's timing (`_time_steps` in benchmarks/_e2e.py), ratios to bf16 eager as it is in the same
round, host ms per step beside.
"""

from __future__ import annotations

import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))  # its modules, by name

import torch
from _e2e import E2EOptions, _time_steps, build_run, free_memory, markov_batches, select_runs
from _e2e_model import resolve_model_source


@torch.compile(dynamic=False)
def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm.forward, one compiled function for every norm of a shape."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def compile_norms(model: torch.nn.Module) -> int:
    """Routes each RMSNorm module of `model` through `_rms_norm`; returns how many. (One shared
    compiled function rather than `module.compile()` per module: each module would be a guard
    miss of the same code object, past dynamo's cache limit after eight.)"""
    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    for norm in norms:
        eps = getattr(norm, "variance_epsilon", None) or norm.eps  # transformers' or torch.nn.RMSNorm
        norm.forward = lambda x, norm=norm, eps=eps: _rms_norm(x, norm.weight, eps)
    return len(norms)


def main(names: list[str]) -> None:
    options = E2EOptions(device="cuda")
    device, source = torch.device("cuda"), resolve_model_source("auto")
    batches = markov_batches(options.decoder, options.num_warmup + options.num_steps).to(device)
    tokens = options.decoder.tokens_per_step
    for round_ in range(int(os.environ.get("ROUNDS", "2"))):
        baseline = None
        for spec in select_runs(",".join(names)):
            for fused in (False, True):
                model, _, step = build_run(spec, options, device, source)
                count = compile_norms(model) if fused else 0
                seconds, host, _ = _time_steps(step, batches, options, device)
                speed = tokens / sorted(seconds)[len(seconds) // 2]
                baseline = speed if baseline is None else baseline  # bf16 eager as it is, first
                form = f"{count} norms compiled" if fused else "as it is"
                print(
                    f"round {round_ + 1} {spec.name:20s} {form:18s} {speed / 1e3:6.1f}k tokens/s "
                    f"{speed / baseline:5.2f}x bf16 eager, host {host * 1e3:6.1f} ms/step",
                    flush=True,
                )
                del model, step
                free_memory(device)


if __name__ == "__main__":
    main(sys.argv[1:] or ["bf16:eager", "fp8:hp:eager", "fp8-block:hp:eager", "mxfp8:hp:eager"])
