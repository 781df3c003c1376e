"""torch's full state dict and quant_fsdp.export_state_dict of quantized models (gloo, CPU), every recipe.

On 1 and 2 ranks (one world each, [Note: shared worlds] in quant_lab.testing), for three ways of
sharding: quant_fsdp.fully_shard with quantized primary weights, torch's own fully_shard with
quantized primary weights, quant_fsdp.fully_shard with quantize-on-gather:
- at construction, `get_model_state_dict(full_state_dict=True)` equals the state dict of the same
  model built without sharding, bit for bit (every buffer of every quantized weight), and with
  `cpu_offload=True` rank 0 gets the same and the other ranks nothing;
- after FusedAdam steps, each rank's slice of every full tensor is its shard, bit for bit, and
  `set_model_state_dict(..., full_state_dict=True)` into a freshly built sharded model gives it the
  trained model's bytes (parameters and buffers);
- `export_state_dict` loads with strict=True into the unconverted TinyTransformer, equals the full
  state dict's weights dequantized bit for bit, gives a loss on a fixed batch within
  LOSS_TOLERANCE of the quantized model's; with the optimizer it holds FusedAdam's fp32 masters
  bit for bit.
Single-process models and bad inputs are tested in this process.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import quant_fsdp
import quant_tensors as qt
from quant_core.testing import raw_bits
from quant_lab.demo import MarkovTask, TinyTransformer, TransformerConfig, train
from quant_lab.testing import SharedWorld, local_bytes, run_shared_world
from quant_optim import FusedAdam

RECIPES = ("fp8", "fp8-delayed", "mxfp8", "fp8-block", "nvfp4")
QUANT_FSDP_WEIGHTS, TORCH_WEIGHTS, ON_GATHER = "quant_fsdp quantized weights", "torch quantized weights", "on gather"
VARIANTS = (QUANT_FSDP_WEIGHTS, TORCH_WEIGHTS, ON_GATHER)
# Blockwise FP8 shards of 64 rows split 128-row tiles: quant_fsdp.fully_shard takes the
# high-precision fallback for them (covered here), torch's fully_shard cannot shard them at all.
# The model sharded by torch's fully_shard has dims whose 2-rank shards are multiples of 128 rows.
CONFIG = TransformerConfig(vocab=128, hidden=128, layers=2, heads=2, sequence=32)
ALIGNED_CONFIG = TransformerConfig(vocab=256, hidden=256, layers=1, heads=2, sequence=32)
BATCH, STEPS = 8, 5
FULL = StateDictOptions(full_state_dict=True)
# The exported model computes in fp32 with exactly the quantized model's weights (dequantized), so
# its loss differs from the quantized model's only by the quantization of the activations that
# enter each qt.nn.Linear (the loss is a forward). Measured after 5 steps: at most 0.07% (relative)
# for every recipe, 0.37% after 30 (NVFP4). 1% leaves room for that, and is a tenth of what the 5
# steps change the loss by (5.01 -> 4.59): exporting the initial weights would fail.
LOSS_TOLERANCE = 1e-2


def build(recipe_name: str, variant: str, *, sharded: bool = True) -> TinyTransformer:
    """TinyTransformer (seed 0) converted for the variant; sharded per block, then the root."""
    torch.manual_seed(0)
    model = TinyTransformer(ALIGNED_CONFIG if variant == TORCH_WEIGHTS else CONFIG)
    qt.convert(model, qt.recipe_from_name(recipe_name), quantized_weights=variant != ON_GATHER)
    if sharded:
        for module in (*model.blocks, model):
            if variant == TORCH_WEIGHTS:
                torch_fully_shard(module)
            else:
                quant_fsdp.fully_shard(module, quantize_on_gather=variant == ON_GATHER)
    return model


def fixed_batch_loss(model: torch.nn.Module) -> float:
    inputs, targets = MarkovTask(model.config.vocab).batch(1000, 16, model.config.sequence)
    with torch.no_grad():
        logits = model(inputs)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1)).item()


# ---- comparisons ------------------------------------------------------------------------------------


def entry_bytes(value: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every buffer of a state-dict entry as raw bytes: a QuantizedTensor's by name, a plain tensor's own.
    Columnwise data that is the lossless transpose of rowwise data is left out: a sharded weight
    keeps none (its gather derives it), an unsharded one may hold it."""
    if isinstance(value, qt.QuantizedTensor):
        derived = value.quantizer.can_derive_columnwise and value.rowwise_data is not None
        return {
            name: raw_bits(b.contiguous().reshape(-1))
            for name, b in value.buffers().items()
            if b is not None and not (derived and name.startswith("columnwise"))
        }
    return {"": raw_bits(value.detach().contiguous().reshape(-1))}


def assert_entries_equal(got: torch.Tensor, want: torch.Tensor, label: str) -> None:
    assert type(got) is type(want) or not isinstance(want, qt.QuantizedTensor), (label, type(got), type(want))
    assert (got.shape, got.dtype) == (want.shape, want.dtype), (label, got.shape, got.dtype, want.shape, want.dtype)
    got_bytes, want_bytes = entry_bytes(got), entry_bytes(want)
    assert got_bytes.keys() == want_bytes.keys(), (label, sorted(got_bytes), sorted(want_bytes))
    assert all(torch.equal(got_bytes[k], want_bytes[k]) for k in want_bytes), label


def assert_state_dicts_equal(got: dict, want: dict, label: str) -> None:
    assert got.keys() == want.keys(), (label, sorted(got.keys() ^ want.keys()))
    for key in want:
        assert_entries_equal(got[key], want[key], f"{label}: {key}")


def plain(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A full state dict as plain tensors, the way a user converts it: quantized weights dequantized."""
    return {k: v.dequantize() if isinstance(v, qt.QuantizedTensor) else v for k, v in state.items()}


def local_state(model: torch.nn.Module) -> dict[str, list[torch.Tensor]]:
    return {key: local_bytes(value) for key, value in model.state_dict().items()}


# ---- the scenario: full state dict, round trip, export ----------------------------------------------


def _full_state_dict_and_export(rank: int, world_size: int, recipe_name: str, variant: str) -> None:
    label = f"{recipe_name}, {variant}, {world_size} rank(s)"
    model = build(recipe_name, variant)
    unsharded = build(recipe_name, variant, sharded=False)
    at_start = get_model_state_dict(model, options=FULL)
    if variant == QUANT_FSDP_WEIGHTS:
        for plan in quant_fsdp.gather_plan(model):
            if plan.fallback_reason:  # the model holds the weight's high-precision value: quantized, it is the weight
                owner = unsharded.get_submodule(plan.name.rpartition(".")[0])
                at_start[plan.name] = owner.weight_quantizer.quantize(at_start[plan.name])
    assert_state_dicts_equal(at_start, unsharded.state_dict(), label)

    optimizer = FusedAdam(model.parameters(), lr=1e-3)
    train(
        model,
        MarkovTask(model.config.vocab),
        steps=STEPS,
        batch_size=BATCH,
        optimizer=optimizer,
        batch_slice=(rank, world_size),
    )
    full = get_model_state_dict(model, options=FULL)
    offloaded = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        assert_state_dicts_equal(offloaded, full, f"{label}, cpu_offload")
    else:
        assert offloaded == {}, label
    for name, p in model.named_parameters():
        local = p._local_tensor
        shard = local._data if isinstance(local, quant_fsdp.QuantizeOnGatherTensor) else local
        assert_entries_equal(full[name].chunk(world_size)[rank], shard, f"{label}: slice of {name}")

    fresh = build(recipe_name, variant)
    set_model_state_dict(fresh, dict(full), options=FULL)  # (torch updates the dict it is given)
    trained = local_state(model)
    loaded = local_state(fresh)
    assert loaded.keys() == trained.keys(), label
    for key, want in trained.items():
        assert all(torch.equal(a, b) for a, b in zip(loaded[key], want, strict=True)), f"{label}: round trip of {key}"

    exported = quant_fsdp.export_state_dict(model)
    with_masters = quant_fsdp.export_state_dict(model, optimizer)
    masters = {
        name: optimizer.state[p]["master"].full_tensor()
        for name, p in model.named_parameters()
        if "master" in optimizer.state[p]
    }
    quantized_loss = fixed_batch_loss(model)
    if rank != 0:
        assert exported == with_masters == {}, label
        return
    original = TinyTransformer(model.config)
    original.load_state_dict(exported, strict=True)
    assert_state_dicts_equal(exported, {k: v for k, v in plain(full).items() if k in exported}, f"{label}: export")
    assert (len(masters) > 0) == (variant != ON_GATHER), (label, sorted(masters))
    assert_state_dicts_equal(with_masters, {**exported, **masters}, f"{label}: export with masters")
    exported_loss = fixed_batch_loss(original)
    assert abs(exported_loss / quantized_loss - 1) <= LOSS_TOLERANCE, (label, exported_loss, quantized_loss)


def scenarios() -> dict:
    return {
        f"{recipe_name}, {variant}": (_full_state_dict_and_export, (recipe_name, variant))
        for recipe_name in RECIPES
        for variant in VARIANTS
    }


@pytest.fixture(scope="module")
def world_1() -> SharedWorld:
    return run_shared_world(1, scenarios())


@pytest.fixture(scope="module")
def world_2() -> SharedWorld:
    return run_shared_world(2, scenarios())


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("recipe_name", RECIPES)
@pytest.mark.parametrize("world_size", [1, 2])
def test_full_state_dict_round_trips_and_exports_to_the_original_model(world_size, recipe_name, variant, request):
    request.getfixturevalue(f"world_{world_size}").check(f"{recipe_name}, {variant}")


# ---- one process ------------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe_name", RECIPES)
def test_single_process_full_state_dict_and_export(recipe_name):
    model = build(recipe_name, QUANT_FSDP_WEIGHTS, sharded=False)
    optimizer = FusedAdam(model.parameters(), lr=1e-3)
    train(model, MarkovTask(CONFIG.vocab), steps=STEPS, batch_size=BATCH, optimizer=optimizer)
    full = get_model_state_dict(model, options=FULL)
    assert_state_dicts_equal(full, model.state_dict(), recipe_name)

    exported = quant_fsdp.export_state_dict(model)
    original = TinyTransformer(CONFIG)
    original.load_state_dict(exported, strict=True)
    assert_state_dicts_equal(exported, {k: v for k, v in plain(full).items() if k in exported}, recipe_name)
    quantized_loss, exported_loss = fixed_batch_loss(model), fixed_batch_loss(original)
    assert abs(exported_loss / quantized_loss - 1) <= LOSS_TOLERANCE, (exported_loss, quantized_loss)

    masters = {
        name: optimizer.state[p]["master"] for name, p in model.named_parameters() if "master" in optimizer.state[p]
    }
    assert len(masters) == 4 * CONFIG.layers + 1  # every qt.nn.Linear weight: qkv, proj, fc1, fc2, head
    assert_state_dicts_equal(quant_fsdp.export_state_dict(model, optimizer), {**exported, **masters}, recipe_name)
    in_bf16 = quant_fsdp.export_state_dict(model, dtype=torch.bfloat16)
    assert_state_dicts_equal(in_bf16, {k: v.to(torch.bfloat16) for k, v in exported.items()}, recipe_name)


# ---- bad inputs -------------------------------------------------------------------------------------


def test_export_refuses_an_optimizer_that_does_not_own_the_model():
    model = build("fp8", QUANT_FSDP_WEIGHTS, sharded=False)
    other = FusedAdam(build("fp8", QUANT_FSDP_WEIGHTS, sharded=False).parameters())
    count = len(list(model.parameters()))
    with pytest.raises(
        ValueError, match=rf"does not own {count} trainable parameter\(s\) of the model \(embedding.weight"
    ):
        quant_fsdp.export_state_dict(model, other)
    partial = FusedAdam([p for name, p in model.named_parameters() if name != "head.weight"])
    with pytest.raises(ValueError, match=r"does not own 1 trainable parameter\(s\) of the model \(head.weight\)"):
        quant_fsdp.export_state_dict(model, partial)


def test_export_refuses_an_optimizer_without_masters_of_quantized_weights():
    model = build("nvfp4", QUANT_FSDP_WEIGHTS, sharded=False)
    with pytest.raises(ValueError, match="blocks.0.qkv.weight is a quantized weight, but AdamW keeps no fp32 master"):
        quant_fsdp.export_state_dict(model, torch.optim.AdamW(model.parameters()))


def test_export_refuses_a_dtype_that_is_not_floating_point():
    model = build("fp8", QUANT_FSDP_WEIGHTS, sharded=False)
    with pytest.raises(ValueError, match="dtype must be a floating-point dtype"):
        quant_fsdp.export_state_dict(model, dtype=torch.int8)
