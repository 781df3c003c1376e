from __future__ import annotations

import pytest

import quant_core
from quant_core.testing import kernel_backends


@pytest.fixture(params=kernel_backends())
def backend(request: pytest.FixtureRequest):
    """Each non-reference backend available here, forced for the duration of the test."""
    with quant_core.use_backend(request.param):
        yield request.param
