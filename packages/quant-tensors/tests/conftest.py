"""quant-tensors tests: makes this folder's helper module importable, and the fallback-warning fixture.

The repository runs pytest with --import-mode=importlib, which leaves test folders off sys.path; the
op tests (test_ops_*.py) import their shared helpers from quant_tensors_op_test_helpers.py here (a name
no other package's tests use). The fixture is not autouse: only the op test modules use it (their
`pytestmark`), so no other test here changes.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import quant_tensors as qt

_HERE = str(Path(__file__).parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)


@pytest.fixture
def fresh_fallback_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    """The once-per-(class, op) fallback warning set is global: start every test from an empty one."""
    monkeypatch.setattr(qt.QuantizedTensor, "_warned_fallbacks", set())
