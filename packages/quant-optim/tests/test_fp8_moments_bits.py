"""FusedAdam with fp8 moments pinned bit for bit: every byte a step writes (parameters, quantized
bytes, masters, moment codes and scale_invs, step counts) after six steps, two of them skipped,
hashed per parameter and compared with the digests below, on both verdict routes.

The digests were recorded from a step that decoded each fp8 moment into fp32 values, ran the
Adam kernel on them and stored them again with the scale of their agreed amax (`amax_many`,
`fp8_scale`, `cast_to_fp8_many`); any step that stores fp8 moments must keep them. The
configurations cover both fp8 formats, an fp8 moment beside a bf16 or fp32 one, AdamW and Adam
with L2 weight decay, fp32 and bf16 masters (stochastic rounding), quantized weights, a
parameter with zero gradients (amax 0), one with tiny gradients (a clamped scale, subnormal
scale_inv) and one with large ones.
"""

from __future__ import annotations

import hashlib

import pytest
import torch

import quant_tensors as qt
from quant_optim import FusedAdam
from quant_optim.testing import SKIP_SCHEDULE, force_device_route, state_bits, step_through

E4M3, E5M2, BF16, FP32 = torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16, torch.float32

CONFIGS = {
    "e4m3-e5m2-adamw": {"exp_avg_dtype": E4M3, "exp_avg_sq_dtype": E5M2},
    "e4m3-bf16-adamw": {"exp_avg_dtype": E4M3, "exp_avg_sq_dtype": BF16},
    "fp32-e4m3-l2": {"exp_avg_dtype": FP32, "exp_avg_sq_dtype": E4M3, "adam_w_mode": False},
    "e5m2-e4m3-l2-bf16-masters": {
        "exp_avg_dtype": E5M2,
        "exp_avg_sq_dtype": E4M3,
        "adam_w_mode": False,
        "master_weight_dtype": BF16,
    },
}

# Per configuration, per parameter: the first 16 hex digits of sha256 over its `state_bits`.
DIGESTS = {
    "e4m3-e5m2-adamw": [
        "626a5d010108caf1",
        "525dcafe5160e21e",
        "57af2d10ae9cf491",
        "d8f6f980c624271e",
        "13ad355524351c6b",
        "401de9cc1d754a40",
        "efb69e19b638bd53",
        "f49de87674381a26",
    ],
    "e4m3-bf16-adamw": [
        "da0249a1d0c06cd2",
        "cef1c658dbbe7fac",
        "ae995441197c8bc2",
        "cb70fd6e953a6521",
        "b40521aeb24e8572",
        "ef67c7c317119422",
        "ec1b19801efceaa6",
        "e4a35847b81f5ffb",
    ],
    "fp32-e4m3-l2": [
        "a2507bd979120f82",
        "a4772392f66f1630",
        "91d99ae0e1c3f9ae",
        "f99a16565b6152b8",
        "6c122ddce8bc285d",
        "ea221432ca62aa8f",
        "c936c5ae0ff21437",
        "ab21b655c1c31efa",
    ],
    "e5m2-e4m3-l2-bf16-masters": [
        "ce347e2a979463d5",
        "125f78f408bb487a",
        "1fc9c5578bb127ca",
        "28ee66992a726f79",
        "3051fe86e588eb8c",
        "4242ceaafa3b5001",
        "11b2e9543f2ad710",
        "41f38f5033d66ca5",
    ],
}

GRADIENT_SCALES = (1.0, 1.0, 0.0, 1e-20, 1e18, 1.0, 1.0, 1.0)


def params_of(seed: int = 7) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)

    def values(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=generator)

    return [
        torch.nn.Parameter(values(96, 64)),
        torch.nn.Parameter(values(300).to(torch.bfloat16)),
        torch.nn.Parameter(values(33, 7)),  # zero gradients
        torch.nn.Parameter(values(50)),  # tiny gradients
        torch.nn.Parameter(values(70)),  # large gradients
        *(
            qt.nn.quantized_parameter(values(128, 256), qt.recipe_from_name(r).quantizer("weight"))
            for r in ("fp8", "mxfp8", "fp8-delayed")
        ),
    ]


def set_grads(params: list[torch.nn.Parameter], step: int, nan: bool = False) -> None:
    generator = torch.Generator().manual_seed(200 + step)
    for p, scale in zip(params, GRADIENT_SCALES, strict=True):
        p.grad = (torch.randn(p.shape, generator=generator) * scale).to(p.dtype)
    if nan:
        params[0].grad[3, 5] = float("nan")


def run(config: dict[str, object]) -> list[str]:
    params = params_of()
    optimizer = FusedAdam(params, lr=1e-2, weight_decay=0.1, **config)
    verdicts = step_through(params, optimizer, set_grads, SKIP_SCHEDULE)
    assert verdicts == [False, True, False, True, False, False]
    digests = []
    for tensors in state_bits(params, optimizer):
        digest = hashlib.sha256()
        for t in tensors:
            digest.update(t.numpy().tobytes())
        digests.append(digest.hexdigest()[:16])
    return digests


@pytest.mark.parametrize("route", ["host", "device"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_fp8_moments_step_bit_for_bit_as_recorded(name, route, monkeypatch):
    if route == "device":
        force_device_route(monkeypatch)
    assert run(CONFIGS[name]) == DIGESTS[name]
