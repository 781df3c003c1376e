"""Which of quant_core's kernel backends can run here: the plain-torch reference (any device), the
C++ extension (CPU; a build that failed to import leaves it out) and Triton (CUDA, where the triton
package imports). `quant_core._library` registers each backend's kernels on its device's dispatch
key and chooses among the available ones ([Note: backends] there).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import pkgutil
from typing import Any, Literal

import torch

Backend = Literal["reference", "cpp", "triton"]
BACKENDS: tuple[Backend, ...] = ("reference", "cpp", "triton")
# The device type each backend's kernels run on (None: any device).
BACKEND_DEVICE: dict[Backend, str | None] = {"reference": None, "cpp": "cpu", "triton": "cuda"}


def available_backends(device: torch.device | str | None = None) -> tuple[Backend, ...]:
    """The backends that loaded on this machine, e.g. ('reference', 'cpp').

    With `device`, only those whose kernels run on tensors of that device.
    """
    device_type = None if device is None else torch.device(device).type
    return tuple(
        b
        for b in BACKENDS
        if unavailable_reason(b) is None and (device_type is None or BACKEND_DEVICE[b] in (None, device_type))
    )


def unavailable_reason(backend: Backend) -> str | None:
    """Why `backend` cannot run here, or None where it can."""
    if backend == "cpp" and cpp_extension() is None:
        return f"quant_core._C failed to import: {_extension_error}"
    if backend == "triton" and not triton_usable():
        return "needs the triton package and a CUDA device"
    return None


_extension: Any = None
_extension_error: str | None = None


def cpp_extension() -> Any:
    """quant_core._C, or None where it failed to import (a broken build)."""
    global _extension, _extension_error
    if _extension is None and _extension_error is None:
        try:
            from quant_core import _C

            _extension = _C
        except ImportError as error:
            _extension_error = str(error)
    return _extension


def _triton_modules() -> tuple[str, ...]:
    """Every `_triton*` module of quant_core's subpackages, found on disk: a format folder's
    register their kernels when imported, `shared`'s hold what the kernels share. A module is
    registered by its name alone, so none can be left out of a list."""
    root = os.path.dirname(__file__)
    return tuple(
        f"quant_core.{package.name}.{module.name}"
        for package in pkgutil.iter_modules([root])
        if package.ispkg
        for module in pkgutil.iter_modules([os.path.join(root, package.name)])
        if module.name.startswith("_triton")
    )


# The modules whose import registers the Triton kernels (CUDA key), imported only where they can run.
TRITON_MODULES = _triton_modules()


def register_triton_kernels() -> None:
    """Imports the Triton modules (`TRITON_MODULES`), whose kernels register on the CUDA dispatch key."""
    for module in TRITON_MODULES:
        importlib.import_module(module)


@functools.cache
def triton_usable() -> bool:
    """Whether the Triton kernels can run here: the triton package and a CUDA device."""
    return importlib.util.find_spec("triton") is not None and torch.cuda.is_available()
