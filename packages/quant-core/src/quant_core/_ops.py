"""The `quant_core` operator namespace: one torch.library operator per kernel dispatch point.

[Note: custom ops] Every kernel of quant_core is reached through an operator
`torch.ops.quant_core.<op>` whose implementation picks the backend kernel (`_backend.kernel`,
[Note: backends]) at run time (a few operators run several kernels in one dispatch: [Note: fused
FP8 quantize]), so torch.compile traces the public functions into graphs that hold
these operators as opaque nodes (their fake implementations give output shapes and dtypes), and
`use_backend` still applies to compiled code. Operators that fill caller-given buffers declare
exactly those as mutated and return nothing; the others return new tensors.

The public functions (`quant_core.quantize_fp8`, ...) check their arguments once and call these
operators through `call` ([Note: eager operator calls]). The operators themselves are the
unchecked fast entry points for callers that have validated already: each one's docstring states
its contract (what the caller guarantees); an operator called outside its contract may write out
of bounds.

Why `torch.library.Library.define` + `impl` rather than `torch.library.custom_op`: the same
schema, fake kernels and tracing, but custom_op's Python wrappers (autograd, version counters)
cost ~20 us per call on the host against ~3 us here. These operators are not differentiable:
the Autograd key falls through, no kernel records autograd history (reference kernels run under
`torch.no_grad()`, see `_backend.register_kernel`). Kernels that write through pointers (C++,
Triton) leave version counters alone, so every operator bumps the version of each buffer it
mutates after its kernel ran (autograd's saved-tensor checks then see the write).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._subclasses.functional_tensor import FunctionalTensorMode

from quant_core import _backend

NAMESPACE = "quant_core"
_library = torch.library.Library(NAMESPACE, "DEF")
# Every operator defined, in definition order: the kernel registry's op names, and the operators
# that run several kernels in one dispatch ([Note: fused FP8 quantize] in `_fp8_quantize`).
OPERATORS: list[str] = []
# name -> (the implementation the dispatcher runs, the operator's default overload), for `call`
_operators: dict[str, tuple[Callable[..., Any], Any]] = {}


def define_op(
    name: str, *, mutates_args: Sequence[str] = (), fake: Callable[..., Any] | None = None
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Defines `torch.ops.quant_core.<name>` from the decorated, fully annotated implementation.

    The schema is inferred from the annotations, `mutates_args` naming the arguments written in
    place. `fake` computes output metadata under torch.compile (default: no outputs, for operators
    that only fill buffers). Returns the implementation unchanged; call the operator as
    `call(name, ...)` or `torch.ops.quant_core.<name>` (the implementation alone would bypass tracing).
    """

    def decorate(impl: Callable[..., Any]) -> Callable[..., Any]:
        schema = torch.library.infer_schema(impl, mutates_args=tuple(mutates_args))
        _library.define(name + schema)
        kernel = _bumping_versions(impl, mutates_args) if mutates_args else impl
        _library.impl(name, kernel, "CompositeExplicitAutograd")
        _library.impl(name, torch.library.fallthrough_kernel, "Autograd")
        torch.library.register_fake(f"{NAMESPACE}::{name}", fake or _no_outputs, lib=_library)
        torch.library.register_torch_dispatch(
            f"{NAMESPACE}::{name}", FunctionalTensorMode, _traced_where_traceable(name, impl), lib=_library
        )
        OPERATORS.append(name)
        _operators[name] = (kernel, getattr(torch.ops.quant_core, name).default)
        return impl

    return decorate


# [Note: eager operator calls] A call through torch.ops costs the dispatcher's host time: ~2 us on
# this project's CI machine, 13-28 us per call on an H100 VM's host (docs/benchmarks.md), where a
# training step's Linear runs 3-15 quant_core operators and each of their kernels takes tens of us
# of GPU time. So `call` runs the implementation the dispatcher would run (version-counter bumps
# included) directly, but only when nothing could tell the two apart: no torch.compile tracing, no
# dispatch or torch-function mode (fake tensors, functionalization, op counters), no functorch
# transform, no profiler (its traces name the operator), and only plain tensors among the arguments
# (a subclass's __torch_dispatch__ would handle the operator). The operators record no autograd
# history either way (the Autograd key falls through). Otherwise the call goes through torch.ops.
def call(name: str, *args: Any) -> Any:
    """`torch.ops.quant_core.<name>(*args)`, run directly in eager code ([Note: eager operator calls])."""
    kernel, operator = _operators[name]
    if (
        torch.compiler.is_compiling()  # first: dynamo folds it to True and never reaches the C calls below
        or torch._C._len_torch_dispatch_stack()
        or torch._C._is_torch_function_mode_enabled()
        or torch._C._are_functorch_transforms_active()
        or torch._C._autograd._profiler_enabled()
    ):
        return operator(*args)
    for arg in args:  # `_plain(args)`, unrolled one level: a call less per operator
        kind = type(arg)
        if kind is torch.Tensor or arg is None:
            continue
        if (kind is list and not _plain(arg)) or (isinstance(arg, torch.Tensor) and kind is not torch.nn.Parameter):
            return operator(*args)
    return kernel(*args)


def _plain(args: Sequence[Any]) -> bool:
    """No tensor subclass among args (lists of tensors included); nn.Parameter counts as plain."""
    for arg in args:
        kind = type(arg)
        if kind is list:
            if not _plain(arg):
                return False
        elif isinstance(arg, torch.Tensor) and kind is not torch.Tensor and kind is not torch.nn.Parameter:
            return False
    return True


def _bumping_versions(impl: Callable[..., Any], mutates_args: Sequence[str]) -> Callable[..., Any]:
    """impl, then the version counters of the mutated tensors bumped (arguments given positionally:
    a tensor, a list of tensors, or None)."""
    names = list(inspect.signature(impl).parameters)
    positions = [names.index(arg) for arg in mutates_args]

    def run(*args: Any) -> Any:
        result = impl(*args)
        written: list[torch.Tensor] = []
        for i in positions:
            if isinstance(args[i], torch.Tensor):
                written.append(args[i])
            elif args[i] is not None:
                written.extend(args[i])
        torch._C._increment_version(written)
        return result

    return run


def _no_outputs(*args: object) -> None:
    return None


# [Note: traced Triton kernels] Under torch.compile, AOTAutograd functionalizes the graph; an
# operator whose kernel for the tensors' device was registered `traceable` (`register_kernel`)
# is not kept as one opaque node there: its implementation runs under the FunctionalTensorMode,
# so its allocations become graph ops and its Triton launches (`_triton_launch.launch`) become
# `wrap_triton` calls, which Inductor compiles and launches from its generated code, without
# quant_core's Python in between (what `torch.library.triton_op` does for an operator of its
# own). Other kernels (C++, the references, Triton kernels not marked) stay opaque operators.
def _traced_where_traceable(name: str, impl: Callable[..., Any]) -> Callable[..., Any]:
    def rule(mode: FunctionalTensorMode, op: Any, types: Any, args: Any, kwargs: Any) -> Any:
        device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
        if device is None or not _backend.is_traceable(name, device):
            return mode.__torch_dispatch__(op, types, args, kwargs)
        with mode:
            return impl(*args, **kwargs)

    return rule
