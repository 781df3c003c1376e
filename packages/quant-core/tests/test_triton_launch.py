"""`_triton_launch.launch` ([Note: Triton launches]) runs the kernel Triton itself would run: the
cache of compiled kernels tells apart every constexpr value and every int/tensor specialization."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from quant_core.fp8 import _triton as _triton_fp8
from quant_core.shared._triton_launch import launch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (scripts/gpu-suite.sh)"),
]


def _partial_amaxes(x_MK: torch.Tensor, tile_m: int, tile_k: int) -> torch.Tensor:
    M, K = x_MK.shape
    grid = (-(-M // tile_m), -(-K // tile_k))
    out = torch.full((grid[0] * grid[1],), -1.0, device=x_MK.device)
    launch(
        _triton_fp8._amax_kernel,
        grid,
        x_MK,
        out,
        M,
        K,
        *x_MK.stride(),
        1,
        PARTIAL=True,
        TILE_M=tile_m,
        TILE_K=tile_k,
        num_warps=4,
    )
    return out


def test_alternating_constexprs_and_specializations_each_run_their_own_kernel():
    generator = torch.Generator().manual_seed(0)
    shapes = [(64, 256), (1, 16), (1, 1), (33, 17), (64, 512)]
    for _ in range(3):  # the second and third rounds hit the cache
        for shape in shapes:
            x = torch.randn(shape, generator=generator).cuda()
            for tile_m, tile_k in [(1, 256), (16, 256), (16, 64)]:
                got = _partial_amaxes(x, tile_m, tile_k)
                rows = [x[i : i + tile_m] for i in range(0, shape[0], tile_m)]
                want = [t[:, j : j + tile_k].abs().max() for t in rows for j in range(0, shape[1], tile_k)]
                assert torch.equal(got, torch.stack(want)), (shape, tile_m, tile_k)


def test_a_constexpr_passed_by_position_is_refused():
    x = torch.ones(4, 4, device="cuda")
    out = torch.empty(1, device="cuda")
    with pytest.raises(TypeError, match="by keyword"):
        launch(_triton_fp8._amax_kernel, (1, 1), x, out, 4, 4, 4, 1, 1, True, TILE_M=4, TILE_K=4)


def test_a_launch_hook_set_by_a_user_sees_cached_launches():
    """The cached path passes no hooks while none is set ([Note: Triton launches]); one a profiler adds
    (Triton's `knobs.runtime.launch_enter_hook`) is still called, with the kernel's metadata."""
    from triton import knobs

    x = torch.randn(64, 256, device="cuda")
    _partial_amaxes(x, 16, 64)  # compiled and cached
    seen: list[str] = []
    record = lambda metadata: seen.append(metadata.get()["name"])  # noqa: E731
    chain = knobs.runtime.launch_enter_hook
    try:
        if hasattr(chain, "add"):  # a HookChain
            chain.add(record)
        else:  # a Triton whose hook is a plain attribute
            knobs.runtime.launch_enter_hook = record
        _partial_amaxes(x, 16, 64)
    finally:
        if hasattr(chain, "remove"):
            chain.remove(record)
        else:
            knobs.runtime.launch_enter_hook = chain
    _partial_amaxes(x, 16, 64)
    assert seen == ["_amax_kernel"]
