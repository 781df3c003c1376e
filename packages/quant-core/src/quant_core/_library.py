"""The `quant_core` operator namespace: each op defined once with torch.library, its kernels
registered on the dispatch keys of their devices.

[Note: custom ops] Every kernel of quant_core is reached through an operator
`torch.ops.quant_core.<op>`, defined once (`define_op`: the schema is inferred from the op's
arguments tuple, [Note: operator arguments]) with a kernel per backend (`register_kernel`), each
registered on a dispatch key of torch's dispatcher: the C++ kernel on CPU, the Triton kernel on
CUDA, the plain-torch reference on CompositeExplicitAutograd (any device without a kernel of its
own). torch's dispatcher picks the backend by the tensors' device. An op's body holds what every
backend shares (allocating the outputs, skipping empty inputs) and calls the kernel it was
registered with; an op made with `define_kernel_op` has no body: its kernels take the op's
arguments tuple as it is. torch.compile traces the public functions into graphs holding these
operators as opaque nodes (their fake implementations give output shapes and dtypes), except
traceable Triton kernels ([Note: traced Triton kernels]). Operators that fill caller-given buffers
declare exactly those as mutated and return nothing; the others return new tensors.

[Note: backends] One switch forces a backend for debugging and tests: `use_backend("reference")`
(a context) or QUANT_CORE_BACKEND=reference (read at import; `reload_backend_env()` re-reads it).
"cpp" and "triton" may be forced too (they run on CPU and CUDA tensors only); forcing a backend
that cannot run an op on that device raises instead of falling back, so a forced run never
measures something else. Forcing installs a fragment, `torch.library.Library(NAMESPACE, "IMPL")`,
holding for each operator a kernel on the BackendSelect dispatch key that runs the forced backend
(`_forced_kernel`). BackendSelect comes after the Python key (tensor subclasses, fake tensors,
functionalization and torch.compile's tracing still see the operator) and before the device keys,
and nothing else of quant_core is registered on it: the fragment overrides no registration (torch
warns when one does) and destroying it (`Library._destroy`) removes its kernels, leaving
BackendSelect's fallthrough. Only one fragment is installed at a time, for the innermost open
`use_backend` block, else for QUANT_CORE_BACKEND; entering or leaving a block replaces it (nested
blocks: the inner one wins, the outer one is forced again on exit, an exception included). While
nothing is forced there is no fragment and the dispatcher runs the kernels registered on the
device keys, with no check per call. Compiled code calls the operators through the dispatcher, so
a forced backend applies to it too. Forcing is process-wide: while a `use_backend` block is open,
every thread runs the forced backend, not only the thread or context that opened it.

The public functions (`quant_core.quantize_fp8`, ...) check their arguments once and call these
operators through `call` ([Note: eager operator calls]); `quant_core.unchecked` and the operators
themselves are the unchecked entry points for callers that have validated already (each
operator's contract is in its format module's docstring; an operator called outside it may write
out of bounds).

Why `torch.library.Library.define` + `impl` rather than `torch.library.custom_op` (or
`triton_op`): the same schema, fake kernels and tracing, but custom_op's Python wrappers
(autograd, version counters) cost ~20 us per call on the host against ~3 us here. These operators
are not differentiable: the Autograd key falls through, no kernel records autograd history
(reference kernels run under `torch.no_grad()`). Kernels that write through pointers (C++,
Triton) leave version counters alone, so every operator bumps the version of each buffer it
mutates after its kernel ran (autograd's saved-tensor checks then see the write).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import typing
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal, TypeVar

import torch
from torch._subclasses.functional_tensor import FunctionalTensorMode

from quant_core._backends import BACKEND_DEVICE, BACKENDS, Backend, cpp_extension, unavailable_reason
from quant_core._recompute import prefer_recompute
from quant_core._version import __version__

NAMESPACE = "quant_core"
BACKEND_ENV_VAR = "QUANT_CORE_BACKEND"
Kernel = Callable[..., Any]  # one backend's kernel of an op, as its body calls it
ArgsT = TypeVar("ArgsT", bound=tuple)  # an operator's arguments ([Note: operator arguments])

# The dispatch key each backend's kernels are registered on.
_DISPATCH_KEY: dict[Backend, str] = {"reference": "CompositeExplicitAutograd", "cpp": "CPU", "triton": "CUDA"}

_library = torch.library.Library(NAMESPACE, "DEF")


class Operator:
    """One operator: its body and, per backend, its kernel and its implementation (the body with
    that kernel, as registered on the backend's dispatch key). The body is `body(kernel, *arguments)`,
    the arguments as the dispatcher passes them (`_bound`). `eager` holds, per device type, the
    implementation the dispatcher runs there while nothing is forced (filled by `call`, emptied
    while a backend is forced)."""

    def __init__(
        self,
        name: str,
        body: Callable[..., Any],
        mutates_args: Sequence[str],
        recomputable: bool = False,
        arguments: type[tuple] | None = None,
    ) -> None:
        self.name = name
        self.arguments = arguments  # the op's arguments tuple ([Note: operator arguments])
        self.body = body
        self.mutates_args = tuple(mutates_args)
        self.recomputable = recomputable
        self.kernels: dict[Backend, Callable[..., Any]] = {}
        self.implementations: dict[Backend, Callable[..., Any]] = {}
        self.traceable: set[Backend] = set()
        self.fused_kernel: Callable[..., Any] | None = None  # [Note: kernels Inductor fuses]
        self.fused_applies: Callable[[Any], bool] | None = None  # which calls the fused kernel serves
        self.eager: dict[str, Callable[..., Any]] = {}
        self.overload: Any = None

    def implementation(self, backend: Backend, *, version_bumps: bool = True) -> Callable[..., Any]:
        """The op's implementation around `backend`'s kernel: the body with that kernel, bumping
        the versions of the mutated buffers."""
        run = functools.partial(self.body, self.kernels[backend])
        return _bumping_versions(run, self.mutated_positions) if self.mutates_args and version_bumps else run

    def fuses(self, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
        """Whether the fused kernel serves a call with these arguments ([Note: kernels Inductor fuses])."""
        if self.fused_kernel is None:
            return False
        return self.fused_applies is None or self.fused_applies(self.arguments(*args, **kwargs))

    @functools.cached_property
    def mutated_positions(self) -> tuple[int, ...]:
        names = [argument.name for argument in self.overload._schema.arguments]
        return tuple(names.index(name) for name in self.mutates_args)

    def select(self, device_type: str, forced: _Forced | None) -> Backend:
        """The backend this op runs on for tensors of `device_type` while `forced` is forced (None:
        nothing is); raises if the forced backend cannot run it there."""
        if forced is None:
            for backend in _AUTO_ORDER.get(device_type, ("reference",)):
                if backend in self.implementations and unavailable_reason(backend) is None:
                    return backend
            raise NotImplementedError(f"no quant_core backend runs {self.name!r} on {device_type} tensors")
        backend = forced.checked_backend()
        backend_device = BACKEND_DEVICE[backend]
        if backend_device is not None and backend_device != device_type:
            raise ValueError(
                f"{forced.by} runs on {backend_device} tensors only, but {self.name!r} got a {device_type} tensor; "
                f"{forced.undo} to choose the backend automatically, or force 'reference' (any device)"
            )
        reason = unavailable_reason(backend)
        if reason is not None:
            raise RuntimeError(f"the {backend} backend is unavailable: {reason}")
        if backend not in self.implementations:
            raise NotImplementedError(
                f"the {backend} backend has no kernel for {self.name!r} yet; {forced.undo} to use the fastest "
                "backend that has one"
            )
        return backend


# Automatic choice, fastest first, per device type.
_AUTO_ORDER: dict[str, tuple[Backend, ...]] = {"cpu": ("cpp", "reference"), "cuda": ("triton", "reference")}
# Every operator defined, by name, in definition order.
OPERATORS: dict[str, Operator] = {}


def define_op(
    name: str,
    arguments: type[tuple],
    *,
    mutates_args: Sequence[str] = (),
    fake: Callable[..., Any] | None = None,
    recomputable: bool = False,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Defines `torch.ops.quant_core.<name>` from its arguments and its body.

    `arguments` is the op's `typing.NamedTuple` ([Note: operator arguments]): its fields, their
    annotations and defaults give the schema's arguments, `mutates_args` naming those written in
    place. The body, `body(kernel, args)`, is the part every backend shares: it receives the
    arguments as that tuple and calls `kernel` (the backend's, registered with
    `register_kernel`); its return annotation gives the schema's returns. `fake(args)` computes
    output metadata under torch.compile (default: no outputs, for operators that only fill
    buffers). `recomputable`: under torch.compile, a call that writes only buffers allocated for it
    is recomputed in the backward rather than saved ([Note: recomputed quantizations] in
    quant_core._recompute). Returns the body unchanged.
    """

    def decorate(body: Callable[..., Any]) -> Callable[..., Any]:
        _define(
            name,
            arguments,
            _schema(arguments, body, mutates_args),
            _bound(body, arguments),
            mutates_args,
            _bound_fake(fake, arguments),
            recomputable,
        )
        return body

    return decorate


def define_kernel_op(
    name: str,
    arguments: type[tuple],
    *,
    mutates_args: Sequence[str] = (),
    fake: Callable[..., Any] | None = None,
    recomputable: bool = False,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Defines `torch.ops.quant_core.<name>` (arguments as for `define_op`) without a body: every
    kernel takes the arguments tuple as it is. The decorated function, whose return annotation
    gives the schema's returns, is registered as the reference kernel."""

    def decorate(reference: Callable[..., Any]) -> Callable[..., Any]:
        _define(
            name,
            arguments,
            _schema(arguments, reference, mutates_args),
            _bound(None, arguments),
            mutates_args,
            _bound_fake(fake, arguments),
            recomputable,
        )
        return register_kernel(name, "reference")(reference)

    return decorate


# [Note: operator arguments] Each operator's arguments are one `typing.NamedTuple` defined beside
# the operator in its format module: the schema is inferred from its fields (`define_op`), the
# op's body receives a call's arguments as one such tuple, and every backend's kernel takes it
# (plus the outputs the body allocated) and reads the fields by name, as does the op's fake; so
# the parameter list is written once. Callers pass the arguments positionally, in field order
# (`call`, torch.ops); the tuple is built once per call, after the dispatch. A kernel made of
# other ops' kernels (the composed FP8 quantizes, the multi-tensor quantizes) builds their tuples.
def _bound(body: Callable[..., Any] | None, arguments: type[tuple]) -> Callable[..., Any]:
    """The operator's body as the dispatcher calls it, `bound(kernel, *args, **kwargs)`: the
    arguments bound into an `arguments` tuple, then `body(kernel, args)` (without a body,
    `kernel(args)`). A call that gives every argument positionally (eager calls) builds the tuple
    with `tuple.__new__`, skipping NamedTuple's Python-level `__new__`."""
    size, new = len(arguments._fields), tuple.__new__  # type: ignore[attr-defined]
    if body is None:

        def call_kernel(kernel: Kernel, *args: Any, **kwargs: Any) -> Any:
            return kernel(new(arguments, args) if len(args) == size and not kwargs else arguments(*args, **kwargs))

        return call_kernel

    def call_body(kernel: Kernel, *args: Any, **kwargs: Any) -> Any:
        return body(kernel, new(arguments, args) if len(args) == size and not kwargs else arguments(*args, **kwargs))

    return call_body


def _bound_fake(fake: Callable[..., Any] | None, arguments: type[tuple]) -> Callable[..., Any] | None:
    """`fake`, which takes the arguments tuple, adapted to torch's convention for fake
    implementations (the arguments one by one)."""
    if fake is None:
        return None

    def bound(*args: Any, **kwargs: Any) -> Any:
        return fake(arguments(*args, **kwargs))

    return bound


def with_contiguous(args: ArgsT, *fields: str) -> ArgsT:
    """`args` with the tensors in `fields` made contiguous: `args` itself when they are (a body's
    normalization before its kernel, free on the usual path)."""
    copies = None
    for field in fields:  # a loop, not a comprehension: no call of its own on every operator call
        tensor = getattr(args, field)
        if not tensor.is_contiguous():
            copies = copies or {}
            copies[field] = tensor.contiguous()
    return args if copies is None else args._replace(**copies)  # type: ignore[attr-defined]


def _define(
    name: str,
    arguments: type[tuple],
    schema: str,
    body: Callable[..., Any],
    mutates_args: Sequence[str],
    fake: Callable[..., Any] | None,
    recomputable: bool,
) -> None:
    _library.define(name + schema)
    _library.impl(name, torch.library.fallthrough_kernel, "Autograd")
    torch.library.register_fake(f"{NAMESPACE}::{name}", fake or _no_outputs, lib=_library)
    operator = Operator(name, body, mutates_args, recomputable, arguments)
    operator.overload = getattr(torch.ops.quant_core, name).default
    torch.library.register_torch_dispatch(
        f"{NAMESPACE}::{name}", FunctionalTensorMode, _traced_where_traceable(operator), lib=_library
    )
    OPERATORS[name] = operator
    if _fragment is not None:  # QUANT_CORE_BACKEND forces a backend from import on
        _fragment.impl(name, _forced_kernel(operator, _forced), "BackendSelect")


def _schema(arguments: type[tuple], returning: Callable[..., Any], mutates_args: Sequence[str]) -> str:
    """The schema `(arguments) -> returns` of an operator: `torch.library.infer_schema` of the
    fields of `arguments` (annotations resolved in its module, defaults kept), returning what
    `returning` is annotated to return (resolved in its module). Optional tensor lists
    (`list[torch.Tensor] | None = None`), which infer_schema does not take (torch 2.13), are
    inferred as tensor lists defaulting to None, then marked optional, `Tensor[]? name=None` (the
    only default a tensor list can have in a schema)."""
    annotations = typing.get_type_hints(arguments)
    defaults = arguments._field_defaults  # type: ignore[attr-defined]
    optional = [field for field, annotation in annotations.items() if annotation == list[torch.Tensor] | None]
    parameters = [
        inspect.Parameter(
            field,
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
            annotation=list[torch.Tensor] if field in optional else annotations[field],
            default=defaults.get(field, inspect.Parameter.empty),
        )
        for field in arguments._fields  # type: ignore[attr-defined]
    ]
    returns = inspect.get_annotations(returning, eval_str=True).get("return", inspect.Signature.empty)

    def prototype() -> None:
        """What infer_schema reads: the signature below, every annotation resolved."""

    prototype.__signature__ = inspect.Signature(parameters, return_annotation=returns)  # type: ignore[attr-defined]
    schema = torch.library.infer_schema(prototype, mutates_args=tuple(mutates_args))
    for name in optional:
        assert f"[] {name}=None" in schema, (schema, name)
        schema = schema.replace(f"[] {name}=None", f"[]? {name}=None")
    return schema


def register_kernel(
    op: str, backend: Backend, *, traceable: bool = False
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Registers the decorated function as `backend`'s kernel of `op` on the backend's dispatch
    key; registering twice raises. The function is returned unchanged.

    Reference kernels are registered to run under `torch.no_grad()`: every backend's outputs are
    plain, non-differentiable tensors. `traceable`: torch.compile may trace the kernel's host code
    instead of keeping the operator opaque ([Note: traced Triton kernels]).
    """

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        if backend == "cpp" and cpp_extension() is None:
            return fn  # a broken build: CPU tensors run the reference (available_backends says why)
        operator = OPERATORS[op]
        if backend in operator.kernels:
            raise RuntimeError(f"op {op!r} already has a {backend} kernel ({operator.kernels[backend].__qualname__})")
        operator.kernels[backend] = torch.no_grad()(fn) if backend == "reference" else fn
        if traceable:
            operator.traceable.add(backend)
        operator.implementations[backend] = operator.implementation(backend)
        operator.eager.clear()
        _library.impl(op, operator.implementations[backend], _DISPATCH_KEY[backend])
        return fn

    return decorate


def register_fused_kernel(
    op: str, *, applies: Callable[[Any], bool] | None = None
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Registers the decorated function, written in torch ops and taking the arguments as `op`'s
    kernels do, as the kernel torch.compile traces for `op` where compiled kernels are "inductor"
    ([Note: kernels Inductor fuses]); it must give bit for bit the reference's results under
    Inductor's fusion. `applies(args)` (the arguments tuple): whether it serves a call; the others
    keep quant-core's kernel. Registering twice raises. The function is returned unchanged."""

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        operator = OPERATORS[op]
        if operator.fused_kernel is not None:
            raise RuntimeError(f"op {op!r} already has a fused kernel ({operator.fused_kernel.__qualname__})")
        operator.fused_kernel = torch.no_grad()(fn)
        operator.fused_applies = applies
        return fn

    return decorate


def _device_type(args: Sequence[Any]) -> str:
    """The device type of an operator's first tensor argument (lists of tensors included)."""
    for arg in args:
        if isinstance(arg, torch.Tensor):
            return arg.device.type
        if isinstance(arg, list) and arg and isinstance(arg[0], torch.Tensor):
            return arg[0].device.type
    return "cpu"


def backend_kernel(op: str, backend: Backend) -> Callable[..., Any]:
    """`backend`'s kernel of `op`, whatever the device (for kernels composed of other kernels)."""
    return OPERATORS[op].kernels[backend]


# ---- the switch ([Note: backends]) --------------------------------------------------------------


class _Forced:
    """A backend forced by a `use_backend` block or by QUANT_CORE_BACKEND (whose value may name no
    backend: the forced kernels then raise). `by` and `undo` word the errors."""

    def __init__(self, backend: str, by: str, undo: str) -> None:
        self.backend, self.by, self.undo = backend, by, undo

    def checked_backend(self) -> Backend:
        if self.backend not in BACKENDS:
            raise ValueError(f"{self.by} is not a backend; use one of auto, {', '.join(BACKENDS)}")
        return self.backend  # type: ignore[return-value]


_environment: _Forced | None = None  # QUANT_CORE_BACKEND as read by `reload_backend_env`
_blocks: list[_Forced] = []  # the open `use_backend` blocks, innermost last
_forced: _Forced | None = None  # what the installed fragment forces
_fragment: torch.library.Library | None = None  # the fragment forcing it: a kernel per op on BackendSelect


def _install() -> None:
    """Installs the fragment of the innermost open `use_backend` block, else of QUANT_CORE_BACKEND,
    else none, replacing the one installed (destroying a Library removes its kernels)."""
    global _forced, _fragment
    forced = _blocks[-1] if _blocks else _environment
    if forced is _forced:
        return
    if _fragment is not None:
        _fragment._destroy()
    _forced, _fragment = forced, None
    for operator in OPERATORS.values():
        operator.eager.clear()
    if forced is not None:
        _fragment = torch.library.Library(NAMESPACE, "IMPL")
        for operator in OPERATORS.values():
            _fragment.impl(operator.name, _forced_kernel(operator, forced), "BackendSelect")


def _forced_kernel(operator: Operator, forced: _Forced) -> Callable[..., Any]:
    """The fragment's kernel of `operator`: the forced backend's implementation, where it can run
    on the arguments' device (`Operator.select` raises otherwise)."""

    def forced_kernel(*args: Any) -> Any:
        return operator.implementations[operator.select(_device_type(args), forced)](*args)

    return forced_kernel


def reload_backend_env() -> None:
    """Re-reads QUANT_CORE_BACKEND (otherwise read once, at import) and forces what it names
    (process-wide, below any open `use_backend` block)."""
    global _environment
    value = os.environ.get(BACKEND_ENV_VAR, "auto").strip().lower() or "auto"
    _environment = (
        None if value == "auto" else _Forced(value, f"{BACKEND_ENV_VAR}={value!r}", f"unset {BACKEND_ENV_VAR}")
    )
    _install()


def requested_backend() -> Backend | Literal["auto"]:
    """The backend forced by `use_backend` or QUANT_CORE_BACKEND, else 'auto'."""
    return "auto" if _forced is None else _forced.checked_backend()


@contextlib.contextmanager
def use_backend(backend: Backend) -> Iterator[None]:
    """Forces `backend` for every op called inside the block (overrides QUANT_CORE_BACKEND; an
    inner block overrides an outer one); `use_backend("reference")` runs the plain-torch reference
    of every op. Process-wide: every thread runs the forced backend while the block is open
    ([Note: backends])."""
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r} is not one of {', '.join(BACKENDS)}")
    forced = _Forced(backend, f"use_backend({backend!r})", "call it outside the use_backend block")
    _blocks.append(forced)
    try:
        _install()
        yield
    finally:
        _blocks.remove(forced)
        _install()


def selected_backend(op: str, device: torch.device) -> Backend:
    """The backend that `op` runs on for tensors on `device`; raises if a forced one cannot."""
    return OPERATORS[op].select(torch.device(device).type, _forced)


# ---- calls ------------------------------------------------------------------------------------


# [Note: eager operator calls] A call through torch.ops costs the dispatcher's host time: ~2 us on
# this project's CI machine, 13-28 us per call on an H100 VM's host (docs/benchmarks.md), where a
# training step's Linear runs 3-15 quant_core operators and each of their kernels takes tens of us
# of GPU time. So `call` runs the implementation the dispatcher would run (version-counter bumps
# included; `Operator.eager`, resolved once per op and device type) directly, but only when nothing
# could tell the two apart: no backend forced (the forcing fragment's kernels run in the
# dispatcher, [Note: backends]), no torch.compile tracing, no dispatch or torch-function mode (fake
# tensors, functionalization, op counters), no functorch transform, no profiler (its traces name
# the operator), and only plain tensors among the arguments (a subclass's __torch_dispatch__ would
# handle the operator). The operators record no autograd history either way (the Autograd key
# falls through). Otherwise the call goes through torch.ops.
def call(name: str, *args: Any) -> Any:
    """`torch.ops.quant_core.<name>(*args)`, run directly in eager code ([Note: eager operator calls])."""
    operator = OPERATORS[name]
    if (
        torch.compiler.is_compiling()  # first: dynamo folds it to True and never reaches the C calls below
        or torch._C._len_torch_dispatch_stack()
        or torch._C._is_torch_function_mode_enabled()
        or torch._C._are_functorch_transforms_active()
        or torch._C._autograd._profiler_enabled()
    ):
        return operator.overload(*args)
    for arg in args:  # `_plain(args)`, unrolled one level: a call less per operator
        kind = type(arg)
        if kind is torch.Tensor or arg is None:
            continue
        if (kind is list and not _plain(arg)) or (isinstance(arg, torch.Tensor) and kind is not torch.nn.Parameter):
            return operator.overload(*args)
    first = args[0]
    if type(first) is list:
        if not first:
            return operator.overload(*args)
        first = first[0]
    run = operator.eager.get(first.device.type)
    if run is None:
        if _forced is not None:  # the fragment's kernel runs the forced backend ([Note: backends])
            return operator.overload(*args)
        run = operator.eager[first.device.type] = operator.implementations[operator.select(first.device.type, None)]
    return run(*args)


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


def _bumping_versions(run: Callable[..., Any], positions: Sequence[int]) -> Callable[..., Any]:
    """run, then the version counters of the mutated tensors bumped (arguments given positionally:
    a tensor, a list of tensors, or None; trailing defaulted ones, which hold None, may be left out)."""

    def bumping(*args: Any) -> Any:
        result = run(*args)
        written: list[torch.Tensor] = []
        for i in positions:
            if i >= len(args):
                continue
            if isinstance(args[i], torch.Tensor):
                written.append(args[i])
            elif args[i] is not None:
                written.extend(args[i])
        torch._C._increment_version(written)
        return result

    bumping.__wrapped__ = run  # type: ignore[attr-defined]
    return bumping


def _no_outputs(*args: object) -> None:
    return None


# [Note: traced Triton kernels] Under torch.compile, AOTAutograd functionalizes the graph; an
# operator whose kernel for the tensors' device was registered `traceable` (`register_kernel`)
# is not kept as one opaque node there: its implementation runs under the FunctionalTensorMode,
# so its allocations become graph ops and its Triton launches (`triton_launch.launch`) become
# `wrap_triton` calls, which Inductor compiles and launches from its generated code, without
# quant_core's Python in between (what `torch.library.triton_op` does for an operator of its
# own). Other kernels (C++, the references, Triton kernels not marked) stay opaque operators.
def _traced_where_traceable(operator: Operator) -> Callable[..., Any]:
    def rule(mode: FunctionalTensorMode, op: Any, types: Any, args: Any, kwargs: Any) -> Any:
        backend = operator.select(_device_type(args), _forced)
        tagging = (
            prefer_recompute(args, operator.mutated_positions) if operator.recomputable else contextlib.nullcontext()
        )
        with tagging:
            if _compiled_kernels == "inductor" and _forced is None and operator.fuses(args, kwargs):
                with mode:
                    return operator.body(operator.fused_kernel, *args, **kwargs)
            if backend not in operator.traceable:
                return mode.__torch_dispatch__(op, types, args, kwargs)
            with mode:
                return operator.implementation(backend, version_bumps=False)(*args, **kwargs)

    return rule


# [Note: kernels Inductor fuses] A traced Triton kernel is still a kernel of its own in Inductor's
# code: a quantize reads the bf16 tensor that the kernel before it wrote, and an emulated GEMM's
# operands are dequantized into bf16 copies by another kernel. Some operators also have a fused
# kernel (`register_fused_kernel`): their reference written so that Inductor, which sees its torch
# ops, can fuse it into the kernels around it (a norm, silu * up, a gradient's producer, the
# dequantize that reads the codes), so that a tensor it alone read is not written at all. Compiled
# kernels "inductor" (QUANT_CORE_COMPILED_KERNELS=inductor, read at import, or
# `use_compiled_kernels("inductor")` around the compile) trace those kernels, on every device;
# "quant-core" (the default) keeps quant-core's own (traced Triton launches on CUDA, opaque C++
# operators on the CPU). A forced backend ([Note: backends]) wins over both. A fused kernel must
# give the reference's bits under Inductor, which elides a bf16 rounding between the ops it fuses
# (`emulate_precision_casts` off): one that reads a bf16 tensor rounds it again in integer
# arithmetic (`bf16_rounded` in quant_core.shared._numerics), which Inductor keeps (an fp16 input
# keeps quant-core's kernels: `FUSABLE_INPUT_DTYPES`). Nor does
# Inductor's generated code divide as IEEE does (quant-core's Triton kernels use `div_rn`): a fused
# kernel multiplies, compares and works on bits only, takes a scale that needs a division from
# quant-core's own operator, and serves only the calls it can (`applies`). The choice is
# made when a graph is traced: a compiled graph keeps the kernels it was traced with. torch's
# compile caches (AOTAutograd's, on disk too) key a graph by what Dynamo traced, which names
# quant-core's operators but not the kernels traced for them, so quant-core adds its own tags to
# `torch.compiler.config.cache_key_tag` (after the user's): its version, and while "inductor" is
# chosen, that choice. A graph cached by another quant-core release or with the other choice is
# then compiled again rather than served.
COMPILED_KERNELS_ENV_VAR = "QUANT_CORE_COMPILED_KERNELS"
CompiledKernels = Literal["quant-core", "inductor"]
_COMPILED_KERNELS: tuple[CompiledKernels, ...] = typing.get_args(CompiledKernels)
_CACHE_TAGS = {"quant-core": (f"quant-core-{__version__}",)}
_CACHE_TAGS["inductor"] = (*_CACHE_TAGS["quant-core"], "quant-core-compiled-kernels=inductor")


def _checked_compiled_kernels(value: str, by: str) -> CompiledKernels:
    if value not in _COMPILED_KERNELS:
        raise ValueError(f"{by} is not one of {', '.join(map(repr, _COMPILED_KERNELS))}")
    return value  # type: ignore[return-value]


def _choose_compiled_kernels(kind: CompiledKernels) -> None:
    """Makes `kind` the compiled kernels, with the compile caches' tag that goes with it."""
    global _compiled_kernels
    _compiled_kernels = kind
    ours = set(_CACHE_TAGS["inductor"])
    tags = [t for t in torch.compiler.config.cache_key_tag.split(",") if t and t not in ours]
    torch.compiler.config.cache_key_tag = ",".join([*tags, *_CACHE_TAGS[kind]])


_compiled_kernels: CompiledKernels = "quant-core"
_choose_compiled_kernels(
    _checked_compiled_kernels(
        os.environ.get(COMPILED_KERNELS_ENV_VAR, "quant-core").strip().lower() or "quant-core",
        f"{COMPILED_KERNELS_ENV_VAR}={os.environ.get(COMPILED_KERNELS_ENV_VAR)!r}",
    )
)


def compiled_kernels() -> CompiledKernels:
    """The kernels torch.compile traces for quant-core's operators now: "quant-core" or
    "inductor" ([Note: kernels Inductor fuses])."""
    return _compiled_kernels


@contextlib.contextmanager
def use_compiled_kernels(kind: CompiledKernels) -> Iterator[None]:
    """Graphs traced inside the block use `kind`'s kernels: "inductor" for the operators that have a
    fused kernel, "quant-core" for quant-core's own ([Note: kernels Inductor fuses]). Process-wide;
    graphs compiled before keep theirs (`torch._dynamo.reset()` drops them)."""
    checked = _checked_compiled_kernels(kind, f"use_compiled_kernels({kind!r})")
    before = _compiled_kernels
    _choose_compiled_kernels(checked)
    try:
        yield
    finally:
        _choose_compiled_kernels(before)


reload_backend_env()
