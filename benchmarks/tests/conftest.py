"""The benchmark tests import the scripts of benchmarks/ (a folder of scripts, not a package) by
name, as the scripts import each other when run from there."""

from __future__ import annotations

import sys
from pathlib import Path

_BENCHMARKS = str(Path(__file__).resolve().parents[1])
if _BENCHMARKS not in sys.path:
    sys.path.insert(0, _BENCHMARKS)
