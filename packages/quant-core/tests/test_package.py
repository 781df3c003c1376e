from __future__ import annotations

import subprocess
import sys
from importlib import metadata

import quant_core


def test_version_is_the_installed_distribution_version():
    # _version.py is the one source of the version: the built metadata must agree with it.
    assert quant_core.__version__ == metadata.version("quant-core")


def test_public_names_are_importable():
    for name in quant_core.__all__:
        assert hasattr(quant_core, name), name


def test_a_broken_cpp_build_leaves_the_reference_running():
    # quant_core._C failing to import (a broken build) must not break `import quant_core`: CPU
    # tensors then run the reference kernels (the multi-tensor ones too), and
    # available_backends() says so.
    code = """
import sys
sys.modules["quant_core._C"] = None
import torch, quant_core
assert quant_core.available_backends("cpu") == ("reference",), quant_core.available_backends("cpu")
x = torch.randn(64, 64)
with quant_core.use_backend("reference"):
    want = quant_core.quantize_mxfp8(2 * x)
got = quant_core.quantize_mxfp8(x)
quant_core.quantize_mxfp8_many([2 * x], [got])
assert torch.equal(got.rowwise_data.view(torch.uint8), want.rowwise_data.view(torch.uint8))
assert torch.equal(got.rowwise_scale_inv, want.rowwise_scale_inv)
"""
    subprocess.run([sys.executable, "-c", code], check=True)
