"""qt.nn.Linear's host cost: the Python calls one forward and one backward make into quant-core and
quant-tensors, per recipe, counted with sys.setprofile (docs/design.md, 'Tensor subclasses and the
quantized Linear': as lean as torchao's Float8Linear, which makes about 40 per forward)."""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import quant_core
import quant_tensors as qt

# The most Python calls into quant_core and quant_tensors one forward, and one backward, may make:
# every recipe within 60 and 80.
CALL_BOUNDS = {
    "fp8": (58, 68),
    "fp8-delayed": (58, 68),
    "mxfp8": (54, 64),
    "fp8-block": (58, 72),
    "nvfp4": (60, 70),
}
_PACKAGE_DIRS = tuple(str(Path(module.__file__).parent) for module in (quant_core, qt))


def _count_calls(fn: Callable[[], object]) -> Counter[str]:
    """The Python functions of quant_core and quant_tensors that `fn()` calls, by count."""
    counts: Counter[str] = Counter()

    def profile(frame, event, arg):  # type: ignore[no-untyped-def]
        if event == "call":
            code = frame.f_code
            if code.co_filename.startswith(_PACKAGE_DIRS):
                counts[f"{Path(code.co_filename).name}:{code.co_firstlineno} {code.co_qualname}"] += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return counts


def _describe(counts: Counter[str], top: int = 25) -> str:
    return "\n".join(f"{n:4d}  {where}" for where, n in counts.most_common(top))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(CALL_BOUNDS))
def test_linear_forward_and_backward_make_few_python_calls(name, dtype):
    torch.manual_seed(0)
    layer = qt.nn.Linear(256, 256, recipe=qt.recipe_from_name(name), dtype=dtype)
    x = torch.randn(4, 64, 256, dtype=dtype, requires_grad=True)
    dy = torch.randn(4, 64, 256, dtype=dtype)
    layer(x).backward(dy)  # warm-up: first calls may fill caches (backend choice, capability)

    # A new input, as every training step has: one quantized before would be shared ([Note: sibling
    # layers share one quantized input] in quant_tensors.nn) and cost no quantize.
    x = torch.randn(4, 64, 256, dtype=dtype, requires_grad=True)
    outputs = []
    forward = _count_calls(lambda: outputs.append(layer(x)))
    backward = _count_calls(lambda: outputs[0].backward(dy))
    forward_calls, backward_calls = sum(forward.values()), sum(backward.values())
    print(f"{name} {dtype}: {forward_calls} Python calls per forward, {backward_calls} per backward")

    assert forward_calls > 0, "no call was counted: is the profiler hook looking at the right files?"
    assert x.grad is not None  # the backward ran (and was counted)
    forward_bound, backward_bound = CALL_BOUNDS[name]
    assert forward_calls <= forward_bound, (
        f"one {name} forward makes {forward_calls} Python calls into quant_core/quant_tensors (bound "
        f"{forward_bound}). Most called:\n{_describe(forward)}"
    )
    assert backward_calls <= backward_bound, (
        f"one {name} backward makes {backward_calls} Python calls into quant_core/quant_tensors (bound "
        f"{backward_bound}). Most called:\n{_describe(backward)}"
    )


# The most Python calls into quant_core and quant_tensors FSDP2's two hooks may make for one
# parameter's gather once its shard and unsharded tensor are refilled in place (every gather after
# the first: [Note: gathers prepared once] in quant_tensors._fsdp). 12 for every format that sends
# rowwise only, and 2 more here: FakeMesh has no process group, so the plain context binds none
# and asks again at every gather. (MXFP8 also gathers its columnwise usage, joined by a copy at
# every gather.)
GATHER_CALL_BOUND = 14


@pytest.mark.parametrize("recipe_name", ["fp8", "fp8-delayed", "fp8-block", "nvfp4"])
def test_a_refilled_gather_makes_few_python_calls(recipe_name):
    from quant_tensors.testing import FakeMesh

    full = qt.recipe_from_name(recipe_name).quantizer("weight").quantize(torch.randn(256, 256))
    shards = [s.clone() for s in full.chunk(2)]
    mesh = FakeMesh(2)
    pre = lambda shard: shard.fsdp_pre_all_gather(mesh, full.shape, None, None, None)  # noqa: E731
    first = [pre(shard) for shard in shards]
    # FSDP2's all-gather outputs: allocated once, refilled by every later gather's copy-out.
    outputs = tuple(torch.cat(parts) for parts in zip(*(inputs for inputs, _ in first), strict=True))
    unsharded, _ = shards[0].fsdp_post_all_gather(outputs, first[0][1], torch.bfloat16)

    def gather() -> Counter[str]:
        counted, (inputs, payload) = _count_calls(lambda: results.append(pre(shards[0]))), results.pop()
        other, _ = pre(shards[1])
        for output, *parts in zip(outputs, inputs, other, strict=True):
            torch.cat(parts, out=output)
        views = tuple(output.view(output.shape) for output in outputs)  # as FSDP2 hands them over
        post = lambda: shards[0].fsdp_post_all_gather(views, payload, torch.bfloat16, out=unsharded)  # noqa: E731
        return counted + _count_calls(post)

    results: list = []
    gather()  # the second gather finds the prepared inputs and the refilled buffers
    both = gather()

    assert sum(both.values()) > 0, "no call was counted: is the profiler hook looking at the right files?"
    assert sum(both.values()) <= GATHER_CALL_BOUND, (
        f"a refilled gather makes {sum(both.values())} Python calls into quant_core/quant_tensors (bound "
        f"{GATHER_CALL_BOUND}). Most called:\n{_describe(both)}"
    )
