"""Kernel backends: which exist, which one runs an op, and how a user forces one.

[Note: backends] Every op has a plain-torch reference kernel (the spec in code); the C++ backend
(`quant_core._C`) serves CPU tensors and the Triton backend CUDA tensors. By default each op runs
on the fastest backend that has a kernel for it on the tensor's device (C++ on CPU, Triton on
CUDA, else the reference). `QUANT_CORE_BACKEND=reference|cpp|triton` or `use_backend(...)`
forces one; forcing a backend that cannot run the op on that device raises instead of falling
back, so a forced run never measures something else.

The choice is resolved once per (op, device type, forced backend) and cached: a call costs a
dict lookup. QUANT_CORE_BACKEND is read once, when the first kernel is resolved;
`reload_backend_env()` re-reads it (tests that change the variable in-process call it).
Registering a kernel forgets the cached choices.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import importlib.util
import os
from collections.abc import Callable, Iterator
from typing import Any, Literal

import torch

Backend = Literal["reference", "cpp", "triton"]
BACKENDS: tuple[Backend, ...] = ("reference", "cpp", "triton")
BACKEND_ENV_VAR = "QUANT_CORE_BACKEND"

# Which device type each backend's kernels run on (None: any device).
_BACKEND_DEVICE: dict[Backend, str | None] = {"reference": None, "cpp": "cpu", "triton": "cuda"}
# Automatic choice, fastest first, per device type.
_AUTO_ORDER: dict[str, tuple[Backend, ...]] = {
    "cpu": ("cpp", "reference"),
    "cuda": ("triton", "reference"),
}
# Modules whose import registers a backend's kernels. Triton has kernels for few ops yet (adam_step);
# CUDA tensors run the reference for the others.
_BACKEND_MODULES: dict[Backend, str] = {"cpp": "quant_core._cpp", "triton": "quant_core._triton"}

_kernels: dict[str, dict[Backend, Callable[..., Any]]] = {}
_load_errors: dict[Backend, str] = {}
_loaded = False
_forced: contextvars.ContextVar[Backend | None] = contextvars.ContextVar("quant_core_backend", default=None)
# QUANT_CORE_BACKEND as read at the first resolution (None: not read yet), and the kernels resolved
# since, keyed by (op, device type, backend forced by use_backend).
_environment: str | None = None
_resolved: dict[tuple[str, str, Backend | None], Callable[..., Any]] = {}
_traceable: set[tuple[str, Backend]] = set()  # (op, backend) of kernels registered traceable


def register_kernel(
    op: str, backend: Backend, *, traceable: bool = False
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Registers the decorated function as `backend`'s kernel for `op`; registering twice raises.

    The function is returned unchanged. Reference kernels are registered to run under
    `torch.no_grad()`: every backend's outputs are plain, non-differentiable tensors.
    `traceable`: torch.compile may trace the kernel's host code instead of keeping the operator
    opaque ([Note: traced Triton kernels] in quant_core._ops).
    """

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        impls = _kernels.setdefault(op, {})
        if backend in impls:
            raise RuntimeError(f"op {op!r} already has a {backend} kernel ({impls[backend].__qualname__})")
        impls[backend] = torch.no_grad()(fn) if backend == "reference" else fn
        if traceable:
            _traceable.add((op, backend))
        _resolved.clear()
        return fn

    return decorate


def is_traceable(op: str, device: torch.device) -> bool:
    """Whether the kernel that runs `op` on `device` was registered `traceable`."""
    return (op, selected_backend(op, device)) in _traceable


def reload_backend_env() -> None:
    """Re-reads QUANT_CORE_BACKEND (otherwise read once, at the first op) and forgets cached choices."""
    global _environment
    _environment = os.environ.get(BACKEND_ENV_VAR, "auto")
    _resolved.clear()


def _load_backends() -> None:
    """Imports the optional backends once, remembering why one could not load."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    for backend, module in _BACKEND_MODULES.items():
        if backend == "triton" and not _triton_usable():
            _load_errors[backend] = "needs the triton package and a CUDA device"
            continue
        try:
            importlib.import_module(module)
        except ImportError as error:  # a broken build or a missing optional package
            _load_errors[backend] = f"{module} failed to import: {error}"


def _triton_usable() -> bool:
    return importlib.util.find_spec("triton") is not None and torch.cuda.is_available()


def available_backends(device: torch.device | str | None = None) -> tuple[Backend, ...]:
    """The backends that loaded on this machine, e.g. ('reference', 'cpp').

    With `device`, only those whose kernels run on tensors of that device.
    """
    _load_backends()
    device_type = None if device is None else torch.device(device).type
    return tuple(
        b
        for b in BACKENDS
        if b not in _load_errors and (device_type is None or _BACKEND_DEVICE[b] in (None, device_type))
    )


def requested_backend() -> Backend | Literal["auto"]:
    """The backend forced by `use_backend` or QUANT_CORE_BACKEND, else 'auto'."""
    forced = _forced.get()
    if forced is not None:
        return forced
    if _environment is None:
        reload_backend_env()
    value = (_environment or "auto").strip().lower() or "auto"
    if value != "auto" and value not in BACKENDS:
        raise ValueError(f"{BACKEND_ENV_VAR}={value!r} is not a backend; use one of auto, {', '.join(BACKENDS)}")
    return value  # type: ignore[return-value]


@contextlib.contextmanager
def use_backend(backend: Backend) -> Iterator[None]:
    """Forces `backend` for every op called inside the block (overrides QUANT_CORE_BACKEND)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r} is not one of {', '.join(BACKENDS)}")
    token = _forced.set(backend)
    try:
        yield
    finally:
        _forced.reset(token)


def selected_backend(op: str, device: torch.device) -> Backend:
    """The backend that `op` runs on for tensors on `device`; raises if a forced one cannot."""
    _load_backends()
    impls = _kernels.get(op)
    if not impls:
        raise NotImplementedError(f"quant_core has no kernel for op {op!r}")
    requested = requested_backend()
    if requested == "auto":
        for backend in _AUTO_ORDER.get(device.type, ("reference",)):
            if backend in impls and backend not in _load_errors:
                return backend
        raise NotImplementedError(f"no quant_core backend runs {op!r} on {device.type} tensors")
    backend_device = _BACKEND_DEVICE[requested]
    if backend_device is not None and backend_device != device.type:
        raise ValueError(
            f"{BACKEND_ENV_VAR}={requested} runs on {backend_device} tensors only, but {op!r} got a "
            f"{device.type} tensor; unset {BACKEND_ENV_VAR} to choose automatically"
        )
    if requested in _load_errors:
        raise RuntimeError(f"the {requested} backend is unavailable: {_load_errors[requested]}")
    if requested not in impls:
        raise NotImplementedError(
            f"the {requested} backend has no kernel for {op!r} yet; unset {BACKEND_ENV_VAR} to use the "
            "fastest backend that has one"
        )
    return requested


def backend_kernel(op: str, backend: Backend) -> Callable[..., Any]:
    """`backend`'s kernel for `op`, whatever the device (for kernels composed of other kernels)."""
    return _kernels[op][backend]


def kernel(op: str, device: torch.device) -> Callable[..., Any]:
    """The kernel that runs `op` for tensors on `device` (see [Note: backends]); cached per
    (op, device type, forced backend), errors are raised again on every call."""
    key = (op, device.type, _forced.get())
    fn = _resolved.get(key)
    if fn is None:
        fn = _kernels[op][selected_backend(op, device)]
        _resolved[key] = fn
    return fn
