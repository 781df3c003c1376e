"""A warm rank's entry point ([Note: warm ranks] in quant_lab.testing).

It imports nothing of the repository's at module level: a rank forked from the fork server, which
holds torch imported, takes the environment variables of the process that starts it first, then
imports quant_lab.testing (and with it the quant-* packages), as a rank spawned afresh would.
"""

from __future__ import annotations

import os
from typing import Any


def start(environment: dict[str, str], *args: Any) -> None:
    """Serves calls (quant_lab.testing._serve_calls(*args)) with `environment` as os.environ."""
    os.environ.clear()
    os.environ.update(environment)
    from quant_lab.testing import _serve_calls

    _serve_calls(*args)
