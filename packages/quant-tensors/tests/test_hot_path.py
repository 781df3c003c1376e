"""qt.nn.Linear's host cost: the Python calls one per-tensor FP8 forward makes into quant-core and
quant-tensors, counted with sys.setprofile (docs/design.md, 'Tensor subclasses and the quantized Linear': as lean as torchao's Float8Linear,
which makes about 40)."""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import quant_core
import quant_tensors as qt

# The most Python calls into quant_core and quant_tensors one forward may make.
FORWARD_CALL_BOUND = 60
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
def test_fp8_linear_forward_makes_few_python_calls(dtype):
    torch.manual_seed(0)
    layer = qt.nn.Linear(256, 256, recipe=qt.Float8CurrentScaling(), dtype=dtype)
    x = torch.randn(4, 64, 256, dtype=dtype, requires_grad=True)
    dy = torch.randn(4, 64, 256, dtype=dtype)
    layer(x).backward(dy)  # warm-up: first calls may fill caches (backend choice, capability)

    # A new input, as every training step has: one quantized before would be shared ([Note: sibling
    # layers share one quantized input] in quant_tensors.nn) and cost no quantize.
    x = torch.randn(4, 64, 256, dtype=dtype, requires_grad=True)
    outputs = []
    forward = _count_calls(lambda: outputs.append(layer(x)))
    both = forward + _count_calls(lambda: outputs[0].backward(dy))

    assert sum(forward.values()) > 0, "no call was counted: is the profiler hook looking at the right files?"
    assert sum(forward.values()) <= FORWARD_CALL_BOUND, (
        f"one forward makes {sum(forward.values())} Python calls into quant_core/quant_tensors (bound "
        f"{FORWARD_CALL_BOUND}; forward + backward: {sum(both.values())}). Most called:\n{_describe(forward)}\n"
        f"forward + backward:\n{_describe(both)}"
    )
