"""The benchmark tests import the scripts of benchmarks/ (a folder of scripts, not a package) by
name, as the scripts import each other when run from there.

benchmarks/ is on `sys.path`, and the scripts' modules are in `sys.modules`, only while a test of
this folder is collected or runs: every other test file of the run (and the rank processes it
starts) imports as if the folder did not exist, so a script's name can never stand in for an
installed module of the same name. Between this folder's tests the scripts' modules are kept
aside, not dropped, so a test and the functions it calls share one copy of each module.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Generator, Iterator
from pathlib import Path
from types import ModuleType

import pytest

_BENCHMARKS = str(Path(__file__).resolve().parents[1])
_kept_aside: dict[str, ModuleType] = {}


def _from_benchmarks(module: ModuleType) -> bool:
    # A script imported through the entry inserted below has that entry as its folder, verbatim.
    file = getattr(module, "__file__", None)
    return isinstance(file, str) and os.path.dirname(file) == _BENCHMARKS


@contextlib.contextmanager
def _benchmarks_importable() -> Iterator[None]:
    saved_path = list(sys.path)
    sys.path.insert(0, _BENCHMARKS)
    sys.modules.update(_kept_aside)
    present = set(sys.modules)
    try:
        yield
    finally:
        sys.path[:] = saved_path
        imported_here = [name for name in sys.modules.keys() - present if _from_benchmarks(sys.modules[name])]
        for name in [*_kept_aside, *imported_here]:
            _kept_aside[name] = sys.modules.pop(name)


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Generator[None, object, object]:
    with _benchmarks_importable():
        return (yield)


# Each phase of a test (setup, call, teardown) is its own hook: these three are called for this
# folder's tests only (pytest_runtest_protocol would be called for every test of the run).
@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, object, object]:
    with _benchmarks_importable():
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, object, object]:
    with _benchmarks_importable():
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, object, object]:
    with _benchmarks_importable():
        return (yield)
