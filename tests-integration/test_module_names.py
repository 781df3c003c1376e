"""No script or test helper of the repository takes the name of a module that Python or an installed
distribution provides.

The scripts of benchmarks/ and scripts/ import each other by name (run from their folder, that
folder comes first on `sys.path`), and some tests put their own folder on the path of the processes
they start. A file there named like an installed module stands in for it in every import of that
name in such a process: a script `kernels.py` breaks transformers, which imports Hugging Face's
`kernels` package.
"""

from __future__ import annotations

import importlib.metadata
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Folders whose files are imported by name: script folders and every folder of tests.
FOLDERS = ("benchmarks", "scripts", "tests-integration", "benchmarks/tests", "lab/tests", *(f"packages/{p}/tests" for p in (
    "quant-core", "quant-tensors", "quant-fsdp", "quant-optim")))  # fmt: skip


def _importable_names() -> dict[str, str]:
    """Top-level module name -> the file in the repository that a folder on the path would import."""
    names = {}
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).iterdir()):
            if path.suffix == ".py" or (path.is_dir() and (path / "__init__.py").exists()):
                names.setdefault(path.stem, path.relative_to(ROOT).as_posix())
    return names


def test_no_script_or_test_module_shadows_an_installed_or_standard_module():
    installed = importlib.metadata.packages_distributions()
    clashes = [
        f"{file} takes the name {name!r} of a module of "
        + ("the standard library" if name in sys.stdlib_module_names else " and ".join(installed[name]))
        for name, file in _importable_names().items()
        if name in installed or name in sys.stdlib_module_names
    ]
    assert not clashes, "rename these files (a prefix that says what they measure or test):\n" + "\n".join(clashes)


def test_the_check_sees_every_script():
    names = _importable_names()
    assert names["multi_gpu"] == "benchmarks/multi_gpu.py"
    assert names["_e2e"] == "benchmarks/_e2e.py"
    assert names["profile_gpu"] == "scripts/profile_gpu.py"
    assert names["quant_tensors_op_test_helpers"] == "packages/quant-tensors/tests/quant_tensors_op_test_helpers.py"
    assert names["test_warm_ranks"] == "lab/tests/test_warm_ranks.py"


def test_benchmarks_is_importable_by_this_folders_tests_only():
    # Every test file is collected before the first test runs: benchmarks/tests/conftest.py has
    # been imported and its tests collected, so a path entry or a module it left under its bare
    # name (the name a later `import` would find) would be here.
    benchmarks = ROOT / "benchmarks"
    assert str(benchmarks) not in sys.path
    leaked = [
        name
        for name, module in list(sys.modules.items())
        if (file := getattr(module, "__file__", None)) and pathlib.Path(file) == benchmarks / f"{name}.py"
    ]
    assert not leaked, f"modules of benchmarks/ under their own names outside its tests: {leaked}"
