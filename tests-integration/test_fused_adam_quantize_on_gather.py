"""FusedAdam over quant-fsdp's quantize-on-gather shards (`QuantizeOnGatherTensor`, a wrapper
subclass of a plain high-precision tensor): they step through quant-core's Adam operator on the
tensors they wrap, bit for bit as plain parameters, and every step that updates them advances the
shard's version (which the quantized gather's cache keys on); a skipped step changes no value."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import quant_fsdp
import quant_tensors as qt
from quant_core.testing import raw_bits
from quant_optim import FusedAdam


class _Calls(TorchDispatchMode):
    """Records the operators called at the top level (not those inside another operator)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[object] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("capturable", [False, True])
def test_quantize_on_gather_shards_step_through_the_adam_operator_like_plain_parameters(capturable):
    generator = torch.Generator().manual_seed(0)
    values = [torch.randn(64, 32, generator=generator), torch.randn(48, generator=generator)]
    wrapped = [torch.nn.Parameter(quant_fsdp.QuantizeOnGatherTensor(v.clone(), qt.Float8Quantizer())) for v in values]
    plain = [torch.nn.Parameter(v.clone()) for v in values]
    kwargs = {"lr": 1e-2, "weight_decay": 0.01, "capturable": capturable}
    optimizers = FusedAdam(wrapped, **kwargs), FusedAdam(plain, **kwargs)
    for step, nan in enumerate((False, True, False, False)):
        grads = [torch.randn(v.shape, generator=generator) for v in values]
        grads[1][step] = float("nan") if nan else grads[1][step]
        versions = [w.shard_version() for w in wrapped]
        calls = []
        for params, optimizer in zip((wrapped, plain), optimizers, strict=True):
            for p, g in zip(params, grads, strict=True):
                p.grad = g.clone()
            calls.append(_Calls())
            with calls[-1]:
                optimizer.step()
            assert optimizer.last_step_skipped == nan
        if not nan:  # the Adam operator, not the torch ops of a reference update
            assert torch.ops.quant_core.adam_step.default in calls[0].ops
            assert torch.ops.aten.sqrt_.default not in calls[0].ops
            assert torch.ops.aten.div.Tensor not in calls[0].ops
        advanced = [w.shard_version() > v for w, v in zip(wrapped, versions, strict=True)]
        # A verdict read on the host skips the call; one read by the kernel leaves the operator's
        # declared writes counted (the next gather requantizes the unchanged shard).
        assert advanced == [not nan or capturable] * 2, step
        for w, p in zip(wrapped, plain, strict=True):
            assert type(w.data) is quant_fsdp.QuantizeOnGatherTensor
            assert torch.equal(raw_bits(w.detach().reshape(-1)), raw_bits(p.detach().reshape(-1))), step
            for key, value in optimizers[1].state[p].items():
                assert torch.equal(raw_bits(optimizers[0].state[w][key].reshape(-1)), raw_bits(value.reshape(-1)))
