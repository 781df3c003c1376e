"""Launching Triton kernels with less host time than `kernel[grid](...)`.

[Note: Triton launches] `JITFunction.run` binds the arguments, computes their specialization and
the compiled kernel's cache key on every launch: tens of microseconds of Python per launch on an
H100 VM's host, more than the GPU time of a quantize at the sizes of a training step's Linear
layers (docs/benchmarks.md, host time per Linear). `launch` keys its own cache of compiled kernels on what
Triton specializes on (per positional tensor: dtype and 16-byte alignment; per positional int:
== 1, divisibility by 16, 32-bit range; bools and None by value; the constexprs, which must be
passed by keyword, and the launch options by value; the current device), a superset of Triton's
key, so a hit always finds the kernel Triton itself would run.
A miss launches through Triton's normal path, which compiles if needed, and remembers the
compiled kernel; a hit calls the compiled kernel's launcher directly (the call Triton 3.6-3.9
make at the end of `JITFunction.run`), passing no launch hooks and no launch metadata while no
hook is set (Triton keeps its hooks in `HookChain`s that are never None: calling two empty chains
and building the metadata cost a few us per launch on an H100 VM's host). Under TRITON_INTERPRET=1
every launch takes the normal path.

[Note: static launches under torch.compile] In compiled code these kernels are `wrap_triton`
calls that Inductor launches itself ([Note: traced Triton kernels] in quant_core._library). It
launches its own kernels through torch's C++ launcher, but another library's kernels through
Triton's Python launcher unless TORCHINDUCTOR_STATIC_LAUNCH_USER_DEFINED_TRITON_KERNELS=1: about
10 us more host time per launch (torch.profiler on an H200 host: 22-33 us of host time per launch
of these kernels against 10-17 per Inductor kernel), and a per-tensor FP8 Linear's forward +
backward has 11 of them. Importing the Triton kernels sets that variable where it is unset, and
Inductor's flag with it (the variable reaches Inductor's compile workers; the flag covers a
process that imported Inductor's config before); a kernel Inductor cannot launch statically
takes Triton's launcher as before. TORCHINDUCTOR_STATIC_LAUNCH_USER_DEFINED_TRITON_KERNELS=0
keeps Triton's launcher for every such kernel.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch._inductor import config as inductor_config
from torch._subclasses.functional_tensor import FunctionalTensor
from torch.library import wrap_triton
from triton import knobs
from triton.runtime.jit import JITFunction

_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
STATIC_LAUNCH_ENV_VAR = "TORCHINDUCTOR_STATIC_LAUNCH_USER_DEFINED_TRITON_KERNELS"
if STATIC_LAUNCH_ENV_VAR not in os.environ:  # [Note: static launches under torch.compile]
    os.environ[STATIC_LAUNCH_ENV_VAR] = "1"
    inductor_config.static_launch_user_defined_triton_kernels = True
# key -> (compiled kernel, the values of its parameters after the positional ones)
_compiled: dict[tuple[Any, ...], tuple[Any, tuple[Any, ...]]] = {}


def _specialization(value: object) -> object:
    """What Triton's specialization (and so its compiled kernel) may depend on in an argument."""
    kind = type(value)
    if kind is int:
        return value == 1, value & 15 == 0, -(2**31) <= value < 2**31
    if kind is float or kind is bool or value is None:
        return value if kind is not float else float
    if isinstance(value, torch.Tensor):
        return value.dtype, value.data_ptr() & 15 == 0
    return value  # constexpr values: dtypes, strings, ...


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for the host (`triton.cdiv` is a constexpr function: slower off the GPU)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (n >= 1), for the host."""
    return 1 << (n - 1).bit_length()


def launch(kernel: JITFunction, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
    """`kernel[grid](*args, **kwargs)` ([Note: Triton launches]): args are the kernel's parameters
    in order, kwargs its remaining parameters by name (constexprs) and launch options
    (num_warps, enable_fp_fusion, ...)."""
    if _INTERPRETED:
        kernel[grid](*args, **kwargs)
        return
    # [Note: traced Triton kernels] in quant_core._library: functional tensors only come with their
    # mode on the dispatch stack, so eager launches skip the scan of their arguments.
    if torch._C._len_torch_dispatch_stack() and any(isinstance(a, FunctionalTensor) for a in args):
        wrap_triton(kernel)[grid](*args, **kwargs)
        return
    # torch's own calls behind Triton's driver.active.get_current_device / get_current_stream
    device = torch._C._cuda_getDevice()
    # kwargs (constexprs and options) are constants of each call site: keyed by value, in order.
    key = (id(kernel), device, *kwargs.items(), *map(_specialization, args))  # kernels are module globals
    entry = _compiled.get(key)
    if entry is None:
        if any(param.is_constexpr for param in kernel.params[: len(args)]):
            # Positional args are keyed by their specialization, which a constexpr's value exceeds.
            raise TypeError(f"pass the constexpr parameters of {kernel.__name__} by keyword")
        compiled = kernel[grid](*args, **kwargs)
        _compiled[key] = (compiled, tuple(kwargs[name] for name in kernel.arg_names[len(args) :]))
        return
    compiled, constexprs = entry
    stream = torch._C._cuda_getCurrentRawStream(device)
    enter_hook, exit_hook = (
        _hook_or_none(knobs.runtime.launch_enter_hook),
        _hook_or_none(knobs.runtime.launch_exit_hook),
    )
    hooked = enter_hook is not None or exit_hook is not None
    metadata = compiled.launch_metadata(grid, stream, *args, *constexprs) if hooked else None
    compiled.run(
        grid[0],
        grid[1] if len(grid) > 1 else 1,
        grid[2] if len(grid) > 2 else 1,
        stream,
        compiled.function,
        compiled.packed_metadata,
        metadata,
        enter_hook,
        exit_hook,
        *args,
        *constexprs,
    )


def _hook_or_none(hook: Any) -> Any:
    """A launch hook, or None where none is set (an empty `HookChain`, or None in older Tritons)."""
    return None if hook is None or getattr(hook, "calls", None) == [] else hook
