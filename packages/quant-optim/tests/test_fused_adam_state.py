"""FusedAdam's state_dict / load_state_dict without torch.distributed: a torch.save round trip
keeps every state tensor's dtype and bits, and training continues exactly as without the break."""

from __future__ import annotations

import io

import pytest
import torch

import quant_tensors as qt
from quant_core.testing import raw_bits
from quant_optim import FusedAdam

# fp8-delayed is left out: its amax history lives on the quantizer, outside every state dict, so
# a restored model requantizes with another history (tests-integration/test_fused_adam_checkpoint.py).
RECIPES = ("fp8", "mxfp8", "fp8-block", "nvfp4")


class Weights(torch.nn.Module):
    """One parameter of each kind FusedAdam keeps apart: bf16 (fp32 master, bf16 moments in their
    own group), quantized (fp32 master) and fp32 (no master)."""

    def __init__(self, recipe_name: str) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        quantizer = qt.recipe_from_name(recipe_name).quantizer("weight")
        self.bf16 = torch.nn.Parameter(torch.randn(64, 32, generator=generator).to(torch.bfloat16))
        self.quantized = qt.nn.quantized_parameter(torch.randn(128, 128, generator=generator), quantizer)
        self.fp32 = torch.nn.Parameter(torch.randn(48, generator=generator))

    def optimizer(self) -> FusedAdam:
        return FusedAdam(
            [
                {"params": [self.bf16], "exp_avg_dtype": torch.bfloat16, "exp_avg_sq_dtype": torch.bfloat16},
                {"params": [self.quantized, self.fp32]},
            ],
            lr=1e-2,
            weight_decay=0.01,
        )


def train(model: Weights, optimizer: FusedAdam, steps: range) -> None:
    for step in steps:
        generator = torch.Generator().manual_seed(1000 + step)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=generator).to(p.dtype)
        optimizer.step()


def saved(obj: object) -> object:
    """obj after torch.save and torch.load(weights_only=True), as a checkpoint gives it back."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def param_bits(p: torch.Tensor) -> list[torch.Tensor]:
    if isinstance(p, qt.QuantizedTensor):
        return [raw_bits(b.reshape(-1)) for b in p.buffers().values() if b is not None]
    return [raw_bits(p.detach().reshape(-1))]


def assert_same(model: Weights, optimizer: FusedAdam, other: Weights, other_optimizer: FusedAdam) -> None:
    for (name, p), q in zip(model.named_parameters(), other.parameters(), strict=True):
        assert all(torch.equal(a, b) for a, b in zip(param_bits(p), param_bits(q), strict=True)), name
        state, other_state = optimizer.state[p], other_optimizer.state[q]
        assert state.keys() == other_state.keys(), name
        for key, value in state.items():
            assert value.dtype == other_state[key].dtype, (name, key)
            assert torch.equal(raw_bits(value.reshape(-1)), raw_bits(other_state[key].reshape(-1))), (name, key)


@pytest.mark.parametrize("recipe_name", RECIPES)
def test_state_dict_round_trip_keeps_dtypes_and_bits_and_training_continues_bitwise(recipe_name):
    model = Weights(recipe_name)
    optimizer = model.optimizer()
    train(model, optimizer, range(3))
    checkpoint = saved({"model": model.state_dict(), "optimizer": optimizer.state_dict()})

    restored = Weights(recipe_name)
    restored_optimizer = restored.optimizer()
    restored.load_state_dict(checkpoint["model"])
    restored_optimizer.load_state_dict(checkpoint["optimizer"])
    assert_same(model, optimizer, restored, restored_optimizer)
    # The dtypes FusedAdam keeps, which torch's load_state_dict would cast to the parameter's dtype.
    assert restored_optimizer.state[restored.bf16]["master"].dtype == torch.float32
    assert restored_optimizer.state[restored.bf16]["exp_avg"].dtype == torch.bfloat16
    assert restored_optimizer.state[restored.bf16]["exp_avg_sq"].dtype == torch.bfloat16
    assert restored_optimizer.state[restored.quantized]["master"].dtype == torch.float32
    assert "master" not in restored_optimizer.state[restored.fp32]

    train(model, optimizer, range(3, 6))
    train(restored, restored_optimizer, range(3, 6))
    assert_same(model, optimizer, restored, restored_optimizer)
    assert float(restored_optimizer.state[restored.quantized]["step"]) == 6.0


def test_states_exist_from_construction():
    """Every trainable parameter has its state before the first step, so torch.distributed.checkpoint's
    get_state_dict never takes its zero-gradient step (which cannot read a quantized gradient)."""
    model = Weights("fp8")
    model.fp32.requires_grad_(False)
    optimizer = model.optimizer()
    assert set(optimizer.state) == {model.bf16, model.quantized}
    assert float(optimizer.state[model.quantized]["step"]) == 0.0
    assert torch.equal(optimizer.state[model.bf16]["master"], model.bf16.float())


def test_parameters_swapped_into_the_groups_get_their_states_in_state_dict():
    """Accelerate's FSDP2 prepare swaps the parameters for others in the groups' lists (not through
    add_param_group) and moves no state: state_dict drops the old ones' states and makes the new
    ones', so torch's get_state_dict neither meets states it cannot number nor steps on zeros_like
    gradients to make them."""
    old, new = Weights("nvfp4"), Weights("nvfp4")
    optimizer = old.optimizer()
    swap = dict(zip(map(id, old.parameters()), new.parameters(), strict=True))
    for group in optimizer.param_groups:
        group["params"] = [swap[id(p)] for p in group["params"]]
    state_dict = optimizer.state_dict()
    assert sorted(state_dict["state"]) == [0, 1, 2]
    assert {id(p) for p in optimizer.state} == {id(p) for p in new.parameters()}
    assert "master" in state_dict["state"][1]
    assert all(p.grad is None for p in new.parameters())  # no step was taken


def test_fp8_moments_round_trip_and_refuse_a_cast():
    p = torch.nn.Parameter(torch.randn(64, 32))
    optimizer = FusedAdam([p], exp_avg_dtype=torch.float8_e4m3fn, exp_avg_sq_dtype=torch.float8_e4m3fn)
    p.grad = torch.randn(64, 32)
    optimizer.step()
    checkpoint = saved(optimizer.state_dict())
    restored = FusedAdam([p], exp_avg_dtype=torch.float8_e4m3fn, exp_avg_sq_dtype=torch.float8_e4m3fn)
    restored.load_state_dict(checkpoint)
    for key, value in optimizer.state[p].items():
        assert torch.equal(raw_bits(restored.state[p][key].reshape(-1)), raw_bits(value.reshape(-1))), key
    fp32_moments = FusedAdam([p])
    before = {k: v.clone() for k, v in fp32_moments.state[p].items()}
    with pytest.raises(ValueError, match="fp8 moments carry a scale and cannot be cast"):
        fp32_moments.load_state_dict(checkpoint)
    assert all(torch.equal(fp32_moments.state[p][k], v) for k, v in before.items())  # nothing changed


# ---- a quantized weight in its other form ([Note: checkpoints across weight forms]) ----------------


def forms(recipe_name: str) -> tuple[torch.nn.Parameter, torch.nn.Parameter]:
    """One weight in its two forms: high precision (quant-fsdp's alignment fallback marks it) and
    quantized, both from the same (unrelated) initial value."""
    generator = torch.Generator().manual_seed(0)
    high_precision = torch.nn.Parameter(torch.randn(128, 128, generator=generator))
    qt.nn.mark_quantized_weight(high_precision)
    quantizer = qt.recipe_from_name(recipe_name).quantizer("weight")
    quantized = qt.nn.quantized_parameter(torch.randn(128, 128, generator=generator), quantizer)
    return high_precision, quantized


def stepped(p: torch.nn.Parameter, steps: int) -> FusedAdam:
    optimizer = FusedAdam([p], lr=1e-2)
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        p.grad = torch.randn(p.shape, generator=generator)
        optimizer.step()
    return optimizer


def everything(p: torch.nn.Parameter, optimizer: FusedAdam) -> list[torch.Tensor]:
    """Copies of every bit the parameter and its state hold."""
    return [b.clone() for b in param_bits(p)] + [raw_bits(v.reshape(-1)).clone() for v in optimizer.state[p].values()]


@pytest.mark.parametrize("recipe_name", RECIPES)
def test_a_weight_saved_in_high_precision_loads_quantized_from_its_master(recipe_name):
    high_precision, quantized = forms(recipe_name)
    saving = stepped(high_precision, 3)
    assert "master" not in saving.state[high_precision]  # its fp32 shard is the master ...
    checkpoint = saved(saving.state_dict())
    assert torch.equal(checkpoint["state"][0]["master"], high_precision.detach())  # ... and is saved as one

    loading = FusedAdam([quantized], lr=1e-2)
    loading.load_state_dict(checkpoint)  # the model entry (other form) is not needed: the master is the value
    assert torch.equal(raw_bits(loading.state[quantized]["master"]), raw_bits(high_precision.detach()))
    expected = quantized.quantizer.quantize(high_precision.detach())
    assert all(torch.equal(a, b) for a, b in zip(param_bits(quantized), param_bits(expected), strict=True))
    for key in ("exp_avg", "exp_avg_sq", "step"):
        assert torch.equal(loading.state[quantized][key], saving.state[high_precision][key]), key


@pytest.mark.parametrize("recipe_name", RECIPES)
def test_a_weight_saved_quantized_loads_in_high_precision_as_its_master(recipe_name):
    high_precision, quantized = forms(recipe_name)
    saving = stepped(quantized, 3)
    checkpoint = saved(saving.state_dict())
    loading = FusedAdam([high_precision], lr=1e-2)
    loading.load_state_dict(checkpoint)
    assert torch.equal(raw_bits(high_precision.detach()), raw_bits(saving.state[quantized]["master"]))
    assert "master" not in loading.state[high_precision]  # the weight is its own master again
    assert loading.state_dict()["state"][0]["master"] is not high_precision  # saved as a copy


def test_a_checkpoint_without_the_master_of_a_quantized_weight_is_refused_and_changes_nothing():
    for p in forms("fp8-block"):
        optimizer = stepped(p, 2)
        checkpoint = saved(optimizer.state_dict())
        del checkpoint["state"][0]["master"]  # e.g. saved by an optimizer without masters
        before = everything(p, optimizer)
        with pytest.raises(ValueError, match="no fp32 master .* load the model alone and build a new FusedAdam"):
            optimizer.load_state_dict(checkpoint)
        assert all(torch.equal(a, b) for a, b in zip(everything(p, optimizer), before, strict=True))


@pytest.mark.parametrize("key", ["master", "exp_avg"])
def test_a_checkpoint_state_of_another_shape_is_refused_and_changes_nothing(key):
    _, quantized = forms("fp8-block")
    optimizer = stepped(quantized, 2)
    checkpoint = saved(optimizer.state_dict())
    checkpoint["state"][0][key] = checkpoint["state"][0][key][:64]  # another model's, or another shard's
    before = everything(quantized, optimizer)
    with pytest.raises(ValueError, match=rf"{key} for parameter 0 .* has shape \(64, 128\).*reshards"):
        optimizer.load_state_dict(checkpoint)
    assert all(torch.equal(a, b) for a, b in zip(everything(quantized, optimizer), before, strict=True))


def test_a_master_the_load_left_untouched_leaves_the_weight_as_loaded():
    # DCP's partial loads (allow_partial_load=True) leave what the checkpoint lacks as it was in the
    # state dict that FusedAdam.state_dict gave; the weight then keeps what the model's load wrote.
    for p in forms("fp8-block"):
        optimizer = stepped(p, 2)
        state_dict = optimizer.state_dict()  # filled in place by a load, or not
        loaded_weight = torch.randn(128, 128)
        with torch.no_grad():
            p.copy_(loaded_weight)  # the model's load
        before = [b.clone() for b in param_bits(p)]
        optimizer.load_state_dict(state_dict)
        assert all(torch.equal(a, b) for a, b in zip(param_bits(p), before, strict=True)), type(p)


def test_group_dtypes_are_saved_by_name_and_loaded_as_dtypes_or_refused():
    model = Weights("fp8")
    optimizer = model.optimizer()
    train(model, optimizer, range(2))
    checkpoint = optimizer.state_dict()
    # torch's state-dict utilities (cpu_offload=True in get_optimizer_state_dict) take no torch.dtype.
    values = [value for group in checkpoint["param_groups"] for value in group.values()]
    assert not any(isinstance(value, torch.dtype) for value in values)
    assert [group["exp_avg_dtype"] for group in checkpoint["param_groups"]] == ["bfloat16", "float32"]
    other = Weights("fp8")
    other_optimizer = other.optimizer()
    other.load_state_dict(model.state_dict())
    other_optimizer.load_state_dict(saved(checkpoint))
    assert [group["exp_avg_dtype"] for group in other_optimizer.param_groups] == [torch.bfloat16, torch.float32]
    assert_same(model, optimizer, other, other_optimizer)
    checkpoint["param_groups"][0]["exp_avg_sq_dtype"] = "bfloat17"
    with pytest.raises(ValueError, match="exp_avg_sq_dtype='bfloat17', which is not a torch dtype"):
        other_optimizer.load_state_dict(checkpoint)
