from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import quant_core
from quant_core import _library


@pytest.fixture(autouse=True)
def _reread_environment_afterwards():
    """Tests here change QUANT_CORE_BACKEND with monkeypatch; autouse fixtures are torn down after
    monkeypatch has restored it, so re-reading here leaves the next test the real environment."""
    yield
    quant_core.reload_backend_env()


def set_backend_env(monkeypatch: pytest.MonkeyPatch, value: str | None) -> None:
    """Sets (or, with None, unsets) QUANT_CORE_BACKEND and has quant_core read it again."""
    if value is None:
        monkeypatch.delenv(quant_core.BACKEND_ENV_VAR, raising=False)
    else:
        monkeypatch.setenv(quant_core.BACKEND_ENV_VAR, value)
    quant_core.reload_backend_env()


def _resolved_kernel(op: str) -> object:
    """The kernel inside the implementation an op resolves to on CPU (its body bound to it)."""
    run = _library.OPERATORS[op].resolve("cpu")
    run = getattr(run, "__wrapped__", run)  # inside the version bumps of an op that mutates buffers
    return run.args[0]


def test_cpp_backend_is_built_and_listed():
    # A plain install builds the extension; CI must exercise it rather than silently skip it.
    assert quant_core.available_backends()[:2] == ("reference", "cpp")
    assert quant_core._C.__version__ == quant_core.__version__


def test_auto_picks_cpp_on_cpu(monkeypatch):
    set_backend_env(monkeypatch, None)
    assert quant_core.selected_backend("amax", torch.device("cpu")) == "cpp"


@pytest.mark.parametrize("name", ["reference", "cpp"])
def test_environment_variable_forces_backend(monkeypatch, name):
    set_backend_env(monkeypatch, name)
    assert quant_core.selected_backend("cast_to_fp8", torch.device("cpu")) == name
    assert _resolved_kernel("cast_to_fp8") is _library.OPERATORS["cast_to_fp8"].kernels[name]


def test_environment_variable_is_read_once_until_reloaded(monkeypatch):
    set_backend_env(monkeypatch, "reference")
    assert _resolved_kernel("amax") is _library.OPERATORS["amax"].kernels["reference"]
    monkeypatch.setenv(quant_core.BACKEND_ENV_VAR, "cpp")  # not re-read: no per-call environment reads
    assert quant_core.selected_backend("amax", torch.device("cpu")) == "reference"
    assert _resolved_kernel("amax") is _library.OPERATORS["amax"].kernels["reference"]
    quant_core.reload_backend_env()
    assert quant_core.selected_backend("amax", torch.device("cpu")) == "cpp"
    assert _resolved_kernel("amax") is _library.OPERATORS["amax"].kernels["cpp"]


def test_use_backend_overrides_environment(monkeypatch):
    set_backend_env(monkeypatch, "cpp")
    with quant_core.use_backend("reference"):
        assert quant_core.selected_backend("amax", torch.device("cpu")) == "reference"
        assert _resolved_kernel("amax") is _library.OPERATORS["amax"].kernels["reference"]
    assert quant_core.selected_backend("amax", torch.device("cpu")) == "cpp"
    assert _resolved_kernel("amax") is _library.OPERATORS["amax"].kernels["cpp"]


def test_unknown_backend_in_environment_is_rejected(monkeypatch):
    set_backend_env(monkeypatch, "cuda")
    for _ in range(2):  # errors are raised on every call, never cached
        with pytest.raises(ValueError, match="QUANT_CORE_BACKEND='cuda' is not a backend"):
            quant_core.amax(torch.ones(3))


def test_unknown_backend_in_use_backend_is_rejected():
    with pytest.raises(ValueError, match="not one of"), quant_core.use_backend("fast"):  # type: ignore[arg-type]
        pass


def test_forcing_a_backend_on_the_wrong_device_raises():
    for _ in range(2):
        with quant_core.use_backend("triton"), pytest.raises(ValueError, match="runs on cuda tensors only"):
            quant_core.amax(torch.ones(3))
    assert quant_core.amax(torch.ones(3)).item() == 1.0


def test_each_backend_is_registered_on_its_dispatch_key():
    # torch's dispatcher picks the kernel by device: C++ on CPU, the reference elsewhere (Triton
    # registers on CUDA where it loads).
    for key in ("CPU", "CompositeExplicitAutograd"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key("quant_core::amax", key)
    x = torch.randn(8, 8)
    assert torch.equal(torch.ops.quant_core.amax(x), quant_core.amax_reference(x))


def test_forcing_the_reference_reaches_calls_through_the_dispatcher(monkeypatch):
    calls = []
    reference = _library.OPERATORS["amax"].kernels["reference"]
    monkeypatch.setitem(_library.OPERATORS["amax"].kernels, "reference", lambda x: calls.append(1) or reference(x))
    _library.OPERATORS["amax"].resolved.clear()
    x = torch.randn(4, 4)
    torch.ops.quant_core.amax(x)
    assert calls == []
    with quant_core.use_backend("reference"):
        torch.ops.quant_core.amax(x)
    assert calls == [1]
    _library.OPERATORS["amax"].resolved.clear()


def test_every_module_with_triton_kernels_is_among_the_triton_modules():
    # register_triton_kernels imports `_library.TRITON_MODULES` (found on disk), so a module
    # registering a Triton kernel outside them would leave its op without a CUDA kernel. In a fresh
    # process (the Triton modules set Inductor options when imported), every module of quant_core
    # is imported; the modules of the Triton kernels registered then must all be among them.
    pytest.importorskip("triton")
    code = """
import importlib, json, pkgutil
import quant_core
from quant_core import _library
for module in pkgutil.walk_packages(quant_core.__path__, "quant_core."):
    importlib.import_module(module.name)
kernels = {name: op.kernels["triton"].__module__ for name, op in _library.OPERATORS.items() if "triton" in op.kernels}
print(json.dumps(kernels))
"""
    run = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    modules = json.loads(run.stdout.splitlines()[-1])
    assert set(modules) == set(_library.OPERATORS)  # every op has one
    missing = {op: module for op, module in modules.items() if module not in _library.TRITON_MODULES}
    assert not missing, f"Triton kernels in modules register_triton_kernels does not import: {missing}"


def test_registering_a_kernel_twice_raises():
    with pytest.raises(RuntimeError, match="already has a reference kernel"):
        _library.register_kernel("amax", "reference")(lambda x: x)


def test_forced_backend_without_kernel_for_op_raises(monkeypatch):
    operator = _library.Operator("only_reference_op", None, ())
    operator.kernels["reference"] = lambda: None
    monkeypatch.setitem(_library.OPERATORS, "only_reference_op", operator)
    with (
        quant_core.use_backend("cpp"),
        pytest.raises(NotImplementedError, match="cpp backend has no kernel for 'only_reference_op'"),
    ):
        quant_core.selected_backend("only_reference_op", torch.device("cpu"))
    assert quant_core.selected_backend("only_reference_op", torch.device("cpu")) == "reference"


def test_available_backends_per_device():
    assert quant_core.available_backends("cpu") == ("reference", "cpp")
    assert "cpp" not in quant_core.available_backends("cuda")
    assert quant_core.available_backends(torch.device("meta")) == ("reference",)


def test_forcing_triton_says_why_it_is_unavailable():
    with quant_core.use_backend("triton"), pytest.raises(RuntimeError, match="triton backend is unavailable: "):
        quant_core.selected_backend("amax", torch.device("cuda"))
