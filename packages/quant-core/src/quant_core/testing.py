"""Inputs and comparisons for testing quantization code (used by every quant-* package's tests)."""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
import tempfile
import textwrap
import threading
import warnings
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from quant_core._backends import Backend, available_backends
from quant_core.shared._checks import FLOAT_DTYPES, FP8_DTYPES

__all__ = [
    "FLOAT_DTYPES",
    "FP8_DTYPES",
    "TritonInterpreterRun",
    "adversarial",
    "adversarial_amaxes",
    "assert_results_bitwise_equal",
    "tracing_fused_kernels",
    "kernel_backends",
    "no_host_syncs",
    "quantize_many_inputs",
    "raw_bits",
    "run_in_triton_interpreter",
    "splitmix64_int",
]

# Values every kernel must get right besides random ones: signed zeros, fp32 denormals, a value
# that is an fp16 denormal, +-Inf, NaN of both signs, values far above every format's max.
_SPECIALS = (
    0.0,
    -0.0,
    float("nan"),
    -float("nan"),
    float("inf"),
    -float("inf"),
    1e-40,
    -1e-42,
    6e-8,
    1e30,
    -3e5,
    448.0,
)


def adversarial(shape: tuple[int, ...], dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    """Gaussian values scaled over 16 decades, with `_SPECIALS` planted at random positions."""
    generator = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    magnitudes = torch.logspace(-8, 8, max(n, 1))[torch.randperm(max(n, 1), generator=generator)][:n]
    x = torch.randn(n, generator=generator) * magnitudes
    positions = torch.randperm(n, generator=generator)[: min(n, len(_SPECIALS))]
    x[positions] = torch.tensor(_SPECIALS[: len(positions)])
    return x.reshape(shape).to(dtype)


# (shape, usages) of a list a multi-tensor block quantize must get right in one call: several
# tiles and partial edge blocks of every format in both directions, tiles dividing x (no masks),
# one row, empty, 1-D and 3-D, each usage alone and both (usages differ within the list).
_MANY_CASES: tuple[tuple[tuple[int, ...], bool, bool], ...] = (
    ((129, 140), True, True),
    ((1, 33), True, False),
    ((0, 64), True, True),
    ((128, 256), True, True),
    ((3, 5, 41), False, True),
    ((7,), True, True),
    ((64, 128), True, False),
    ((40, 48), False, True),
)


def quantize_many_inputs(
    dtype: torch.dtype = torch.float32, seed: int = 0
) -> list[tuple[torch.Tensor, dict[str, bool]]]:
    """(tensor, {"rowwise": .., "columnwise": ..}) pairs for one multi-tensor quantize call
    (`quantize_mxfp8_many`, `quantize_fp8_blockwise_many`): `adversarial` values of `dtype` in the
    shapes above, and a transposed (non-contiguous) view with both usages."""
    pairs = [
        (adversarial(shape, dtype, seed=seed + i), {"rowwise": rowwise, "columnwise": columnwise})
        for i, (shape, rowwise, columnwise) in enumerate(_MANY_CASES)
    ]
    pairs.append((adversarial((160, 96), dtype, seed=seed + len(pairs)).t(), {"rowwise": True, "columnwise": True}))
    return pairs


# Amaxes every scale kernel must get right: zeros, fp32 subnormals (the scale overflows and is
# clamped), the fp32 extremes, format maxima, non-finite and negative values (a scale is 1 unless
# amax > 0; an infinite amax gives scale 0).
_SPECIAL_AMAXES = (
    0.0,
    -0.0,
    1e-45,
    1e-40,
    1.1754942e-38,
    1.0,
    3.0,
    448.0,
    57344.0,
    3e38,
    3.4028234663852886e38,
    float("inf"),
    -float("inf"),
    float("nan"),
    -float("nan"),
    -5.0,
)


def _result_tensors(result: object) -> list[torch.Tensor | None]:
    """Every tensor of a (nested) result of tuples, lists and quantized dataclasses, in order."""
    if isinstance(result, torch.Tensor) or result is None:
        return [result]
    if dataclasses.is_dataclass(result):
        result = [getattr(result, f.name) for f in dataclasses.fields(result)]
    return [t for item in result for t in _result_tensors(item)]  # type: ignore[union-attr]


def assert_results_bitwise_equal(got: object, want: object) -> None:
    """Two (nested) results hold the same tensors, in order, with equal dtypes, shapes and bytes
    (NaN payloads included)."""
    got_tensors, want_tensors = _result_tensors(got), _result_tensors(want)
    assert len(got_tensors) == len(want_tensors)
    for g, w in zip(got_tensors, want_tensors, strict=True):
        assert (g is None) == (w is None)
        if g is not None:
            assert g.dtype == w.dtype
            assert g.shape == w.shape
            assert torch.equal(g.reshape(-1).view(torch.uint8), w.reshape(-1).view(torch.uint8))


@contextmanager
def tracing_fused_kernels() -> Iterator[Counter[str]]:
    """Counts, by operator name, the calls torch.compile traces through an operator's fused kernel
    while the block is open ([Note: kernels Inductor fuses] in quant_core._library): nonzero only for
    graphs traced (not served from a cache) with compiled kernels "inductor"."""
    from quant_core._library import OPERATORS

    traced: Counter[str] = Counter()
    fused = {name: op.fused_kernel for name, op in OPERATORS.items() if op.fused_kernel is not None}

    def counting(name: str, kernel: Any) -> Any:
        def count(*args: Any) -> Any:
            traced[name] += 1
            return kernel(*args)

        return count

    for name, kernel in fused.items():
        OPERATORS[name].fused_kernel = counting(name, kernel)
    try:
        yield traced
    finally:
        for name, kernel in fused.items():
            OPERATORS[name].fused_kernel = kernel


def adversarial_amaxes(num_random: int = 400, seed: int = 0) -> torch.Tensor:
    """fp32 1-D: `_SPECIAL_AMAXES` and `num_random` amaxes spread over 60 decades, in a seeded
    random order (also usable as a sequence of steps for amax histories)."""
    generator = torch.Generator().manual_seed(seed)
    exponents = torch.randint(-30, 30, (num_random,), generator=generator).float()
    random = torch.randn(num_random, generator=generator).exp() * 10.0**exponents
    amaxes = torch.cat([torch.tensor(_SPECIAL_AMAXES), random])
    return amaxes[torch.randperm(len(amaxes), generator=generator)]


# fp32 bits, 16-bit draw, bf16 bits: [Note: bf16 stochastic rounding] worked by hand (the edges
# every backend's rounding must meet; tests aim at them through the whole Adam step too).
BF16_STOCHASTIC_CASES = [
    (0x3F800000, 0xFFFF, 0x3F80),  # a bf16 value stays, whatever the draw
    (0x3F808000, 0x7FFF, 0x3F80),  # halfway: down below 2^15
    (0x3F808000, 0x8000, 0x3F81),  # ... up from 2^15
    (0x3F80FFFF, 0x0000, 0x3F80),  # just below the upper neighbour: down only with draw 0
    (0x3F80FFFF, 0x0001, 0x3F81),
    (0x3FFFFFFF, 0x0001, 0x4000),  # up across a binade edge
    (0xBF808000, 0x8000, 0xBF81),  # negative: the magnitude rounds up, away from zero
    (0xBF808000, 0x7FFF, 0xBF80),
    (0x00000000, 0xFFFF, 0x0000),  # +0
    (0x80000000, 0xFFFF, 0x8000),  # -0 keeps its sign
    (0x00000001, 0xFFFE, 0x0000),  # the smallest fp32 subnormal: to 0 ...
    (0x00000001, 0xFFFF, 0x0001),  # ... or to the smallest bf16 subnormal
    (0x807FFFFF, 0x0001, 0x8080),  # the largest subnormal up to the smallest normal
    (0x7F7F0001, 0xFFFE, 0x7F7F),  # beyond the largest finite bf16: stays finite ...
    (0x7F7F0001, 0xFFFF, 0x7F80),  # ... or becomes Inf, with probability low16 / 2^16
    (0x7F7FFFFF, 0x0001, 0x7F80),  # fp32 max
    (0xFF7FFFFF, 0x0000, 0xFF7F),
    (0xFF7FFFFF, 0x0001, 0xFF80),  # -fp32 max to -Inf, never into the sign
    (0x7F800000, 0xFFFF, 0x7F80),  # +-Inf stay
    (0xFF800000, 0xFFFF, 0xFF80),
    (0x7F800001, 0x0000, 0x7FC0),  # NaN: the canonical bf16 NaN (the bare rule would give Inf)
    (0xFFFFFFFF, 0xFFFF, 0x7FC0),  # (the bare rule would carry past bit 31)
    (0xFFC00000, 0x1234, 0x7FC0),  # x86's default NaN, negative
]


def float32_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """The fp32 values of uint32 bit patterns held in an int64 tensor."""
    return torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32).view(torch.float32)


def raw_bits(t: torch.Tensor | None) -> torch.Tensor | None:
    """The bytes of a quantized buffer as uint8, so comparisons are bitwise (NaN codes included)."""
    return None if t is None else t.view(torch.uint8)


def splitmix64_int(seed: int, index: int) -> int:
    """Draw `index` of the SplitMix64 stream of `seed` ([Note: counter RNG]) in Python integers:
    the textbook algorithm, independent of the tensor arithmetic the references use."""
    mask = (1 << 64) - 1
    z = ((index + 1) * 0x9E3779B97F4A7C15 + seed) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return z ^ (z >> 31)


@contextmanager
def no_host_syncs() -> Iterator[None]:
    """Inside, a CUDA operation that synchronizes with the host raises (torch's sync debug mode,
    restored on exit however the block ends; torch's warning that the mode is a prototype is
    silenced)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Synchronization debug mode is a prototype")
        torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def kernel_backends() -> tuple[Backend, ...]:
    """Every available backend except the reference, which they are all compared against."""
    return tuple(b for b in available_backends() if b != "reference")


class TritonInterpreterRun:
    """`source` (dedented) running in a fresh Python process under TRITON_INTERPRET=1, which Triton
    reads when kernels are defined, from a file (Triton reads a kernel's source text). Started when
    made; `check` waits for it (from any thread)."""

    def __init__(self, source: str) -> None:
        self._folder = tempfile.TemporaryDirectory()
        script = os.path.join(self._folder.name, "interpreted.py")
        with open(script, "w") as file:
            file.write(textwrap.dedent(source))
        environment = {**os.environ, "TRITON_INTERPRET": "1"}
        self._process = subprocess.Popen(
            [sys.executable, script], env=environment, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        self._stderr: str | None = None
        self._lock = threading.Lock()  # one thread reads the pipe, any thread may wait

    def wait(self) -> None:
        """Waits for the process to end."""
        with self._lock:
            if self._stderr is None:
                self._stderr = self._process.communicate()[1]
                self._folder.cleanup()

    def kill(self) -> None:
        """Ends the process now."""
        self._process.kill()
        self.wait()

    def check(self) -> None:
        """Waits for the process; AssertionError with the end of its stderr if it failed."""
        self.wait()
        assert self._process.returncode == 0, self._stderr[-3000:]


def run_in_triton_interpreter(source: str) -> None:
    """Runs `source` in the Triton interpreter (`TritonInterpreterRun`) and checks that it passed."""
    TritonInterpreterRun(source).check()
