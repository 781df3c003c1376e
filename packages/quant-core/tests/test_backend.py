from __future__ import annotations

import json
import subprocess
import sys
import threading

import pytest
import torch

import quant_core
from quant_core import _backends, _library


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


def _recording(monkeypatch: pytest.MonkeyPatch, op: str) -> list[str]:
    """Has each backend's implementation of `op` append the backend's name to the list returned
    before it runs: what a forced run and `call`'s direct path run. An unforced call through
    torch.ops runs the implementation registered on the device's key, which records nothing."""
    operator = _library.OPERATORS[op]
    ran: list[str] = []
    for backend, run in list(operator.implementations.items()):
        monkeypatch.setitem(
            operator.implementations, backend, lambda *args, b=backend, run=run: ran.append(b) or run(*args)
        )
    monkeypatch.setattr(operator, "eager", {})  # `call` resolves again, to the recording ones
    return ran


def _forcing_kernel_installed() -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key("quant_core::amax", "BackendSelect")


def test_cpp_backend_is_built_and_listed():
    # A plain install builds the extension; CI must exercise it rather than silently skip it.
    assert quant_core.available_backends()[:2] == ("reference", "cpp")
    assert quant_core._C.__version__ == quant_core.__version__


def test_auto_picks_cpp_on_cpu_without_a_forcing_kernel(monkeypatch):
    set_backend_env(monkeypatch, None)
    ran = _recording(monkeypatch, "amax")
    assert quant_core.selected_backend("amax", torch.device("cpu")) == "cpp"
    torch.ops.quant_core.amax(torch.ones(1, 3))  # the CPU key's kernel, nothing in between
    quant_core.amax(torch.ones(1, 3))
    assert ran == ["cpp"]
    assert not _forcing_kernel_installed()


@pytest.mark.parametrize("name", ["reference", "cpp"])
def test_environment_variable_forces_backend(monkeypatch, name):
    set_backend_env(monkeypatch, name)
    ran = _recording(monkeypatch, "amax")
    assert quant_core.selected_backend("amax", torch.device("cpu")) == name
    torch.ops.quant_core.amax(torch.ones(1, 3))
    quant_core.amax(torch.ones(1, 3))
    assert ran == [name, name]


def test_environment_variable_is_read_once_until_reloaded(monkeypatch):
    set_backend_env(monkeypatch, "reference")
    ran = _recording(monkeypatch, "amax")
    monkeypatch.setenv(quant_core.BACKEND_ENV_VAR, "cpp")  # not re-read: no per-call environment reads
    assert quant_core.selected_backend("amax", torch.device("cpu")) == "reference"
    torch.ops.quant_core.amax(torch.ones(1, 3))
    quant_core.reload_backend_env()
    assert quant_core.selected_backend("amax", torch.device("cpu")) == "cpp"
    torch.ops.quant_core.amax(torch.ones(1, 3))
    assert ran == ["reference", "cpp"]


def test_use_backend_overrides_environment(monkeypatch):
    set_backend_env(monkeypatch, "cpp")
    ran = _recording(monkeypatch, "amax")
    with quant_core.use_backend("reference"):
        assert quant_core.selected_backend("amax", torch.device("cpu")) == "reference"
        torch.ops.quant_core.amax(torch.ones(1, 3))
    assert quant_core.selected_backend("amax", torch.device("cpu")) == "cpp"
    torch.ops.quant_core.amax(torch.ones(1, 3))
    assert ran == ["reference", "cpp"]


def _amax_then_fail(x: torch.Tensor) -> None:
    quant_core.amax(x)
    raise RuntimeError("inside the block")


def test_nested_blocks_restore_the_outer_backend_on_exit_and_on_error(monkeypatch):
    set_backend_env(monkeypatch, None)
    ran = _recording(monkeypatch, "amax")
    x = torch.ones(1, 3)
    with quant_core.use_backend("cpp"):
        with quant_core.use_backend("reference"):
            torch.ops.quant_core.amax(x)
        torch.ops.quant_core.amax(x)
        with pytest.raises(RuntimeError, match="inside the block"), quant_core.use_backend("reference"):
            _amax_then_fail(x)
        quant_core.amax(x)
    assert ran == ["reference", "cpp", "reference", "cpp"]
    torch.ops.quant_core.amax(x)  # unforced again: the CPU key's kernel
    assert ran == ["reference", "cpp", "reference", "cpp"]


def test_leaving_the_last_block_removes_the_forcing_kernels(monkeypatch):
    set_backend_env(monkeypatch, None)
    assert not _forcing_kernel_installed()
    with quant_core.use_backend("reference"):
        assert _forcing_kernel_installed()
        with quant_core.use_backend("cpp"):
            assert _forcing_kernel_installed()
    assert not _forcing_kernel_installed()


def test_a_forced_backend_applies_to_compiled_code(monkeypatch):
    set_backend_env(monkeypatch, None)
    ran = _recording(monkeypatch, "amax")
    compiled = torch.compile(lambda x: quant_core.amax(x) * 2, backend="aot_eager", fullgraph=True)
    x = torch.randn(4, 8)
    with quant_core.use_backend("reference"):
        want = compiled(x)  # compiled while forced
    assert ran == ["reference"]
    assert torch.equal(compiled(x), want)
    assert ran == ["reference"]  # the graph calls the operator: the CPU key's kernel once unforced
    with quant_core.use_backend("cpp"):
        compiled(x)
    assert ran == ["reference", "cpp"]


def test_a_forced_backend_applies_to_every_thread(monkeypatch):
    set_backend_env(monkeypatch, None)
    # Forcing is process-wide ([Note: backends]): a thread started inside the block runs it too.
    ran = _recording(monkeypatch, "amax")
    with quant_core.use_backend("reference"):
        thread = threading.Thread(target=torch.ops.quant_core.amax, args=(torch.ones(1, 3),))
        thread.start()
        thread.join()
    assert ran == ["reference"]


def test_unknown_backend_in_environment_is_rejected(monkeypatch):
    set_backend_env(monkeypatch, "cuda")
    for _ in range(2):  # errors are raised on every call, never cached
        with pytest.raises(ValueError, match="QUANT_CORE_BACKEND='cuda' is not a backend"):
            quant_core.amax(torch.ones(1, 3))
    with pytest.raises(ValueError, match="QUANT_CORE_BACKEND='cuda' is not a backend"):
        torch.ops.quant_core.amax(torch.ones(1, 3))
    with quant_core.use_backend("reference"):  # a block overrides it
        assert quant_core.amax(torch.ones(1, 3)).item() == 1.0


def test_unknown_backend_in_use_backend_is_rejected():
    with pytest.raises(ValueError, match="not one of"), quant_core.use_backend("fast"):  # type: ignore[arg-type]
        pass


def test_forcing_a_backend_on_the_wrong_device_raises_naming_the_fix(monkeypatch):
    for _ in range(2):
        with (
            quant_core.use_backend("triton"),
            pytest.raises(ValueError, match="runs on cuda tensors only.*outside the use_backend block"),
        ):
            quant_core.amax(torch.ones(1, 3))
    assert quant_core.amax(torch.ones(1, 3)).item() == 1.0
    set_backend_env(monkeypatch, "triton")
    with pytest.raises(ValueError, match="runs on cuda tensors only.*unset QUANT_CORE_BACKEND"):
        torch.ops.quant_core.amax(torch.ones(1, 3))


def test_each_backend_is_registered_on_its_dispatch_key():
    # torch's dispatcher picks the kernel by device: C++ on CPU, the reference elsewhere (Triton
    # registers on CUDA where it loads).
    for key in ("CPU", "CompositeExplicitAutograd"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key("quant_core::amax", key)
    x = torch.randn(8, 8)
    assert torch.equal(torch.ops.quant_core.amax(x), quant_core.amax_reference(x))


def test_every_module_with_triton_kernels_is_among_the_triton_modules():
    # register_triton_kernels imports `_backends.TRITON_MODULES` (found on disk), so a module
    # registering a Triton kernel outside them would leave its op without a CUDA kernel. In a fresh
    # process (the Triton modules set Inductor options when imported), every module of quant_core
    # is imported; the modules of the Triton kernels registered then must all be among them.
    pytest.importorskip("triton")
    code = """
import importlib, json, pkgutil
import quant_core
from quant_core import _backends, _library
for module in pkgutil.walk_packages(quant_core.__path__, "quant_core."):
    importlib.import_module(module.name)
kernels = {name: op.kernels["triton"].__module__ for name, op in _library.OPERATORS.items() if "triton" in op.kernels}
print(json.dumps(kernels))
"""
    run = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    modules = json.loads(run.stdout.splitlines()[-1])
    assert set(modules) == set(_library.OPERATORS)  # every op has one
    missing = {op: module for op, module in modules.items() if module not in _backends.TRITON_MODULES}
    assert not missing, f"Triton kernels in modules register_triton_kernels does not import: {missing}"


def test_registering_a_kernel_twice_raises():
    with pytest.raises(RuntimeError, match="already has a reference kernel"):
        _library.register_kernel("amax", "reference")(lambda x: x)


def test_forced_backend_without_kernel_for_op_raises(monkeypatch):
    monkeypatch.delitem(_library.OPERATORS["amax"].implementations, "cpp")
    monkeypatch.setattr(_library.OPERATORS["amax"], "eager", {})
    with quant_core.use_backend("cpp"):
        for run in (quant_core.amax, torch.ops.quant_core.amax):
            with pytest.raises(NotImplementedError, match="cpp backend has no kernel for 'amax'"):
                run(torch.ones(1, 3))
        with pytest.raises(NotImplementedError, match="cpp backend has no kernel for 'amax'"):
            quant_core.selected_backend("amax", torch.device("cpu"))
    assert quant_core.selected_backend("amax", torch.device("cpu")) == "reference"


def test_available_backends_per_device():
    assert quant_core.available_backends("cpu") == ("reference", "cpp")
    assert "cpp" not in quant_core.available_backends("cuda")
    assert quant_core.available_backends(torch.device("meta")) == ("reference",)


def test_forcing_triton_says_why_it_is_unavailable():
    with quant_core.use_backend("triton"), pytest.raises(RuntimeError, match="triton backend is unavailable: "):
        quant_core.selected_backend("amax", torch.device("cuda"))
