from __future__ import annotations

from importlib import metadata

import quant_core


def test_version_is_the_installed_distribution_version():
    # _version.py is the one source of the version: the built metadata must agree with it.
    assert quant_core.__version__ == metadata.version("quant-core")


def test_public_names_are_importable():
    for name in quant_core.__all__:
        assert hasattr(quant_core, name), name
