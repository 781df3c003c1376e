from __future__ import annotations

import os
import subprocess
import sys
from importlib import metadata

import pytest

import quant_core

# The name as Inductor reads it (not imported from quant_core: the test must see a misspelling).
STATIC_LAUNCH_ENV_VAR = "TORCHINDUCTOR_STATIC_LAUNCH_USER_DEFINED_TRITON_KERNELS"


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


@pytest.mark.parametrize("set_by_user", [None, "0", "1"])
def test_the_triton_kernels_turn_on_inductors_static_launches_unless_the_user_chose(set_by_user):
    # [Note: static launches under torch.compile]: the variable (for Inductor's compile workers)
    # and Inductor's flag (for this process) say the same, the user's choice when one was made.
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != STATIC_LAUNCH_ENV_VAR}
    if set_by_user is not None:
        env[STATIC_LAUNCH_ENV_VAR] = set_by_user
    code = f"""
import os
import torch._inductor.config as inductor_config
import quant_core.shared._triton_launch
print(os.environ["{STATIC_LAUNCH_ENV_VAR}"], inductor_config.static_launch_user_defined_triton_kernels)
"""
    printed = subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True)
    want = "1 True" if set_by_user in (None, "1") else "0 False"
    assert printed.stdout.split("\n")[-2] == want
