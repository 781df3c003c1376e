"""torch.distributed.checkpoint with FusedAdam on FSDP2 (gloo, CPU), quantized primary weights, every recipe.

A quantized weight takes one of two forms per world size ([Note: checkpoints across weight forms]
in quant_optim._adam): quantized, or, where its shards would split blocks, high precision (the
alignment fallback; with this model: blockwise FP8's 128-row blocks on 2 and 4 ranks, and every
format's 128-row weights on 3 ranks, whose shards are uneven). Its fp32 master is its value
whatever the form. Scenario, in five calls of warm ranks (processes are shared, the comparisons run
in the test process):
- 2 ranks, every recipe: train 5 steps, save model and optimizer (get_state_dict, dcp.save), write
  the full tensors saved, train on to step 10;
- 1, 3 and 4 ranks: load every recipe's 2-rank checkpoint, then train 2 steps; and save a
  checkpoint of their own after 5 steps (fp8-block on 1 and 4 ranks, the per-tensor formats on
  3), whose weights take the other form on 2 ranks (or, 4 -> 2, other chunks);
- 2 ranks again: resume every recipe for 5 steps (bit for bit the uninterrupted run, quantizer
  states included), load the 1-, 3- and 4-rank checkpoints (also the model alone), and try
  checkpoints that must be refused.
A loaded tensor equals the saved one bit for bit, except a weight that changed form: held
quantized, it is its master's quantization; held in high precision, its master.
"""

from __future__ import annotations

import pathlib
import re

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

import quant_fsdp
import quant_tensors as qt
from quant_core.testing import raw_bits
from quant_lab import demo
from quant_lab.demo import MarkovTask, TinyTransformer, TransformerConfig
from quant_lab.testing import local_state_bytes, quantized_transformer, run_on_warm_ranks
from quant_optim import FusedAdam

RECIPES = ("fp8", "fp8-delayed", "mxfp8", "fp8-block", "nvfp4")
CONFIG = TransformerConfig(vocab=128, hidden=128, layers=2, heads=2, sequence=32)
BATCH = 8
SAVE_STEP, LAST_STEP = 5, 10
STEPS_AFTER_LOAD = 2
OTHER_WORLD_SIZES = (1, 3, 4)
SAVED_ELSEWHERE = {1: ("fp8-block",), 3: ("fp8", "fp8-delayed", "nvfp4"), 4: ("fp8-block",)}  # loaded on 2
QUANTIZED, HIGH_PRECISION = "quantized", "high precision"
# Model-only loads on 2 ranks, each followed by load_state_dict or by a forward (no load_state_dict).
MODEL_ONLY_LOADS = {(1, "fp8-block"): "load_state_dict", (3, "fp8-delayed"): "forward"}

# Losses after loading on another world size, against the uninterrupted run on the saving one. The
# weights are equal (masters bitwise, quantized weights their quantization); with 1, 2 or 4 ranks
# what differs is the order in which the ranks' gradients and losses are summed, and for formats
# whose activations or gradients are scaled per tensor (fp8, fp8-delayed, nvfp4) or drawn per
# element (nvfp4's stochastic rounding), the slice of the batch each rank quantizes; 3 ranks also
# weight the batch's sequences unequally (slices of 3, 3 and 2, each rank's mean loss). Measured
# (2 steps, this CPU): <= 1.1e-7 (an ulp of the loss) for mxfp8 and fp8-block on 1, 2 and 4 ranks,
# <= 1.3e-3 for the other formats there, <= 5.1e-3 with 3 ranks (3.6e-3 at the first step for
# every format: the weighting alone).
SAME_MATH_RTOL = 1e-6
PER_SLICE_SCALING_RTOL = 5e-3
UNEQUAL_SLICES_RTOL = 1e-2


def build(recipe_name: str) -> tuple[TinyTransformer, FusedAdam]:
    model = quantized_transformer(recipe_name, CONFIG, sharded=True)
    return model, FusedAdam(model.parameters(), lr=1e-3, weight_decay=0.01)


def train(model: TinyTransformer, optimizer: FusedAdam, steps: range, rank: int, world_size: int) -> list[float]:
    return demo.train(
        model,
        MarkovTask(CONFIG.vocab),
        steps=steps,
        batch_size=BATCH,
        optimizer=optimizer,
        batch_slice=(rank, world_size),
    )


def save(model: TinyTransformer, optimizer: FusedAdam, path: pathlib.Path) -> None:
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=path)


def load(model: TinyTransformer, optimizer: FusedAdam, path: pathlib.Path) -> None:
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.load({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)


# ---- what is compared -----------------------------------------------------------------------------


def gathered(tensor: torch.Tensor) -> list[torch.Tensor]:
    everyone: list[torch.Tensor | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, tensor)
    return everyone  # type: ignore[return-value]


def full_snapshot(
    model: TinyTransformer, optimizer: FusedAdam | None
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Full tensors, equal on every rank whatever the world size, and each quantized weight's form.

    Parameters as held (quantized ones dequantized, plus their rowwise codes, shards concatenated
    along the rows, and their per-tensor values), optimizer states with full_tensor(), a quantized
    weight's master in either form ("name/master": a high-precision weight is its own), and the
    module buffers (amax histories, stochastic-rounding counters)."""
    snapshot, forms = {}, {}
    for name, p in model.named_parameters():
        local = p._local_tensor
        if isinstance(local, qt.QuantizedTensor):
            forms[name] = QUANTIZED
            snapshot[name] = qt.shard_like(p, local.dequantize(torch.float32)).full_tensor()
            snapshot[f"{name}:rowwise_data"] = torch.cat(gathered(raw_bits(local.rowwise_data)))
            for key, buffer in local.buffers().items():
                if buffer is not None and buffer.dim() == 0:  # per-tensor values: equal on every shard
                    values = gathered(buffer)
                    assert all(torch.equal(v, values[0]) for v in values), (name, key)
                    snapshot[f"{name}:{key}"] = values[0]
        elif isinstance(local, quant_fsdp.QuantizeOnGatherTensor):
            forms[name] = HIGH_PRECISION
            snapshot[name] = snapshot[f"{name}/master"] = qt.shard_like(p, local._data).full_tensor()
        else:
            snapshot[name] = p.full_tensor()
        for key, value in {} if optimizer is None else optimizer.state[p].items():
            snapshot[f"{name}/{key}"] = value.full_tensor() if isinstance(value, DTensor) else value
    for name, buffer in model.named_buffers():
        snapshot[name] = buffer
    return {k: v.detach().clone() for k, v in snapshot.items()}, forms  # training goes on after it


def expected_after_load(
    saved: dict, saved_forms: dict, loaded_forms: dict, recipe_name: str, *, with_optimizer: bool = True
) -> dict:
    """What a load of `saved` holds: the saved tensors, and for a weight that changed form its
    master's quantization (delayed scaling: with the loaded amax history, which it then pushes)
    or its master ([Note: checkpoints across weight forms]). Without the optimizer, a weight now
    held in high precision is the dequantized one (the master is not loaded)."""
    expected = dict(saved) if with_optimizer else {k: v for k, v in saved.items() if "/" not in k}
    quantizer = qt.recipe_from_name(recipe_name).quantizer("weight")
    for name, form in loaded_forms.items():
        if form == saved_forms[name]:
            continue
        for key in [k for k in expected if k.startswith(f"{name}:")]:
            del expected[key]
        master = saved[f"{name}/master"]
        if form == HIGH_PRECISION:
            expected[name] = master if with_optimizer else saved[name]
            continue
        history = f"{name.removesuffix('.weight')}.weight_quantizer_state"
        state = saved[history].clone() if history in saved else None
        quantized = quantizer.quantize(master, state=state)
        expected[name] = quantized.dequantize(torch.float32)
        expected[f"{name}:rowwise_data"] = raw_bits(quantized.rowwise_data)
        for key, buffer in quantized.buffers().items():
            if buffer is not None and buffer.dim() == 0:
                expected[f"{name}:{key}"] = buffer
        if state is not None:
            expected[history] = state
    return expected


def assert_bitwise_equal(got: dict, want: dict, label: str) -> None:
    assert got.keys() == want.keys(), (label, sorted(got.keys() ^ want.keys()))
    for name in want:
        a, b = got[name], want[name]
        if isinstance(b, list):
            assert len(a) == len(b), (label, name)
            assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), (label, name)
        else:
            assert a.dtype == b.dtype, (label, name, a.dtype, b.dtype)
            assert torch.equal(raw_bits(a.reshape(-1)), raw_bits(b.reshape(-1))), (label, name)


def local_bytes_and_buffers(model: TinyTransformer, optimizer: FusedAdam) -> dict[str, list[torch.Tensor]]:
    snapshot = local_state_bytes(model, optimizer)
    snapshot.update({name: [raw_bits(b.reshape(-1)).clone()] for name, b in model.named_buffers()})
    return snapshot


# ---- rank work ----------------------------------------------------------------------------------


def _save_and_train_on(rank: int, world_size: int, root: pathlib.Path, recipes: tuple[str, ...], last_step: int):
    """Trains each recipe to SAVE_STEP, saves it under root/saved_on_<world>/<recipe>, trains on to last_step."""
    for recipe_name in recipes:
        directory = root / f"saved_on_{world_size}" / recipe_name
        model, optimizer = build(recipe_name)
        train(model, optimizer, range(SAVE_STEP), rank, world_size)
        save(model, optimizer, directory / "checkpoint")
        snapshot, forms = full_snapshot(model, optimizer)
        losses = train(model, optimizer, range(SAVE_STEP, last_step), rank, world_size)
        if rank == 0:
            saved = {"snapshot": snapshot, "forms": forms, "losses": losses, "world_size": world_size}
            torch.save(saved, directory / "saved.pt")
        torch.save(local_bytes_and_buffers(model, optimizer), directory / f"uninterrupted_rank{rank}.pt")


def _load_and_train(rank: int, world_size: int, directory: pathlib.Path, recipe_name: str) -> None:
    model, optimizer = build(recipe_name)
    load(model, optimizer, directory / "checkpoint")
    snapshot, forms = full_snapshot(model, optimizer)
    losses = train(model, optimizer, range(SAVE_STEP, SAVE_STEP + STEPS_AFTER_LOAD), rank, world_size)
    if rank == 0:
        torch.save({"snapshot": snapshot, "forms": forms, "losses": losses}, directory / f"loaded_on_{world_size}.pt")


def _load_model_only(rank: int, world_size: int, directory: pathlib.Path, recipe_name: str, then: str) -> None:
    """Loads the model alone, then `load_state_dict` (set_model_state_dict) or a forward: either
    quantizes the weights staged from the other form that need the shards' amax."""
    model = quantized_transformer(recipe_name, CONFIG, sharded=True)
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=directory / "checkpoint")
    if then == "load_state_dict":
        set_model_state_dict(model, state["model"])
    else:
        with torch.no_grad():
            model(MarkovTask(CONFIG.vocab).batch(0, BATCH, CONFIG.sequence)[0].chunk(world_size)[rank])
        model.reshard()  # the root keeps its parameters gathered after a forward
    snapshot, forms = full_snapshot(model, None)
    if rank == 0:  # the parameters (a forward moves the activations' amax histories)
        snapshot = {k: v for k, v in snapshot.items() if k.split(":")[0] in dict(model.named_parameters())}
        torch.save({"snapshot": snapshot, "forms": forms}, directory / f"model_loaded_on_{world_size}.pt")


def _on_another_world_size(rank: int, world_size: int, root: pathlib.Path) -> None:
    for recipe_name in RECIPES:
        _load_and_train(rank, world_size, root / "saved_on_2" / recipe_name, recipe_name)
    _save_and_train_on(rank, world_size, root, SAVED_ELSEWHERE[world_size], SAVE_STEP + STEPS_AFTER_LOAD)


def _resume(rank: int, world_size: int, directory: pathlib.Path, recipe_name: str) -> None:
    model, optimizer = build(recipe_name)
    load(model, optimizer, directory / "checkpoint")
    train(model, optimizer, range(SAVE_STEP, LAST_STEP), rank, world_size)
    assert all(float(optimizer.state[p]["step"]) == LAST_STEP for p in model.parameters())
    torch.save(local_bytes_and_buffers(model, optimizer), directory / f"resumed_rank{rank}.pt")


def _refusals(rank: int, world_size: int, root: pathlib.Path) -> dict[str, tuple[str, bool]]:
    """Loads that must fail: (message, whether the model and optimizer were left as they were)."""
    model, optimizer = build("fp8-block")
    train(model, optimizer, range(1), rank, world_size)
    before = local_bytes_and_buffers(model, optimizer)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    without_masters = {
        "state": {fqn: {k: v for k, v in s.items() if k != "master"} for fqn, s in optimizer_state["state"].items()},
        "param_groups": optimizer_state["param_groups"],
    }
    reshaped = {
        "state": {
            **optimizer_state["state"],
            "blocks.0.fc1.weight": {**optimizer_state["state"]["blocks.0.fc1.weight"], "master": torch.zeros(3)},
        },
        "param_groups": optimizer_state["param_groups"],
    }
    attempts = {
        "DCP, no masters": lambda: dcp_round_trip(model, optimizer, without_masters, root / "without_masters"),
        "DCP, another shape": lambda: dcp_round_trip(model, optimizer, reshaped, root / "reshaped"),
        "in memory, no masters": lambda: set_state_dict(
            model, optimizer, model_state_dict=model_state, optim_state_dict=without_masters
        ),
    }
    results = {}
    for label, attempt in attempts.items():
        try:
            attempt()
            message = ""
        except (Exception, CheckpointException) as error:  # DCP's exception is a BaseException
            message = str(error)
        results[label] = (message, _same(local_bytes_and_buffers(model, optimizer), before))
    return results


def dcp_round_trip(model: TinyTransformer, optimizer: FusedAdam, optimizer_state: dict, path: pathlib.Path) -> None:
    """Saves the model with `optimizer_state`, then loads that checkpoint into model and optimizer."""
    model_state, _ = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=path)
    load(model, optimizer, path)


def _same(got: dict, want: dict) -> bool:
    return got.keys() == want.keys() and all(
        len(got[k]) == len(want[k]) and all(torch.equal(a, b) for a, b in zip(got[k], want[k], strict=True))
        for k in want
    )


def _on_two_ranks_again(rank: int, world_size: int, root: pathlib.Path) -> None:
    for recipe_name in RECIPES:
        _resume(rank, world_size, root / "saved_on_2" / recipe_name, recipe_name)
    for saved_on, recipes in SAVED_ELSEWHERE.items():
        for recipe_name in recipes:
            _load_and_train(rank, world_size, root / f"saved_on_{saved_on}" / recipe_name, recipe_name)
    for (saved_on, recipe_name), then in MODEL_ONLY_LOADS.items():
        _load_model_only(rank, world_size, root / f"saved_on_{saved_on}" / recipe_name, recipe_name, then)
    refusals = _refusals(rank, world_size, root)
    if rank == 0:
        torch.save(refusals, root / "refusals.pt")


# ---- the runs (module fixtures: each process set serves many tests) ----------------------------


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    root = tmp_path_factory.mktemp("fused_adam_dcp")
    run_on_warm_ranks(_save_and_train_on, 2, root, RECIPES, LAST_STEP)
    return root


@pytest.fixture(scope="module")
def loaded_on_other_world_sizes(checkpoints: pathlib.Path) -> pathlib.Path:
    for world_size in OTHER_WORLD_SIZES:
        run_on_warm_ranks(_on_another_world_size, world_size, checkpoints)
    return checkpoints


@pytest.fixture(scope="module")
def back_on_two_ranks(loaded_on_other_world_sizes: pathlib.Path) -> pathlib.Path:
    run_on_warm_ranks(_on_two_ranks_again, 2, loaded_on_other_world_sizes)
    return loaded_on_other_world_sizes


def check_load(directory: pathlib.Path, world_size: int, recipe_name: str) -> None:
    saved = torch.load(directory / "saved.pt", weights_only=True)
    loaded = torch.load(directory / f"loaded_on_{world_size}.pt", weights_only=True)
    expected = expected_after_load(saved["snapshot"], saved["forms"], loaded["forms"], recipe_name)
    assert_bitwise_equal(loaded["snapshot"], expected, f"{recipe_name} on {world_size} ranks")
    if 3 in (world_size, saved["world_size"]):
        rtol = UNEQUAL_SLICES_RTOL
    else:
        rtol = SAME_MATH_RTOL if recipe_name in ("mxfp8", "fp8-block") else PER_SLICE_SCALING_RTOL
    torch.testing.assert_close(
        torch.tensor(loaded["losses"]), torch.tensor(saved["losses"][:STEPS_AFTER_LOAD]), rtol=rtol, atol=0
    )


# ---- tests --------------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe_name", RECIPES)
def test_resume_on_two_ranks_continues_bitwise(back_on_two_ranks, recipe_name):
    """5 more steps after loading equal the uninterrupted run: parameters (raw bytes), masters,
    moments, steps, and the quantizer states that live across steps (amax histories, NVFP4's
    stochastic-rounding counter: a resume without them scales or rounds differently)."""
    directory = back_on_two_ranks / "saved_on_2" / recipe_name
    saved = torch.load(directory / "saved.pt", weights_only=True)["snapshot"]
    states = [k for k in saved if k.endswith("quantizer_state")]
    assert bool(states) == (recipe_name in ("fp8-delayed", "nvfp4")), states
    assert all(saved[k].any() for k in states), "the saved quantizer states have advanced"
    for rank in range(2):
        expected = torch.load(directory / f"uninterrupted_rank{rank}.pt", weights_only=True)
        resumed = torch.load(directory / f"resumed_rank{rank}.pt", weights_only=True)
        assert_bitwise_equal(resumed, expected, f"{recipe_name} rank {rank}")


@pytest.mark.parametrize(("recipe_name", "world_size"), [(r, w) for r in RECIPES for w in OTHER_WORLD_SIZES])
def test_two_rank_checkpoint_loads_bitwise_on_another_world_size(loaded_on_other_world_sizes, recipe_name, world_size):
    check_load(loaded_on_other_world_sizes / "saved_on_2" / recipe_name, world_size, recipe_name)


@pytest.mark.parametrize(("recipe_name", "saved_on"), [(r, w) for w, rs in SAVED_ELSEWHERE.items() for r in rs])
def test_checkpoint_of_another_world_size_loads_on_two_ranks(back_on_two_ranks, recipe_name, saved_on):
    directory = back_on_two_ranks / f"saved_on_{saved_on}" / recipe_name
    saved_forms = torch.load(directory / "saved.pt", weights_only=True)["forms"]
    loaded_forms = torch.load(directory / "loaded_on_2.pt", weights_only=True)["forms"]
    changed = {name for name, form in loaded_forms.items() if form != saved_forms[name]}
    assert bool(changed) == (saved_on != 4), changed  # 4 -> 2: the same forms, in other chunks
    check_load(directory, 2, recipe_name)


@pytest.mark.parametrize(("saved_on", "recipe_name"), list(MODEL_ONLY_LOADS))
def test_model_alone_loads_from_the_other_form(back_on_two_ranks, saved_on, recipe_name):
    """Without the optimizer: a weight held quantized on 2 ranks and in high precision where it
    was saved is quantized from the loaded value (the master); one held in high precision here is
    the dequantized weight."""
    directory = back_on_two_ranks / f"saved_on_{saved_on}" / recipe_name
    saved = torch.load(directory / "saved.pt", weights_only=True)
    loaded = torch.load(directory / "model_loaded_on_2.pt", weights_only=True)
    changed = {name for name, form in loaded["forms"].items() if form != saved["forms"][name]}
    assert {loaded["forms"][name] for name in changed} == ({QUANTIZED} if saved_on == 3 else {HIGH_PRECISION})
    expected = expected_after_load(
        saved["snapshot"], saved["forms"], loaded["forms"], recipe_name, with_optimizer=False
    )
    parameters = {k for k in loaded["snapshot"] if ":" not in k}
    expected = {k: v for k, v in expected.items() if k.split(":")[0] in parameters}
    assert_bitwise_equal(loaded["snapshot"], expected, f"{recipe_name} model from {saved_on} ranks")


def test_checkpoints_without_masters_or_of_another_shape_are_refused_before_anything_changes(back_on_two_ranks):
    refusals = torch.load(back_on_two_ranks / "refusals.pt", weights_only=True)
    patterns = {  # torch's DCP planner refuses first, naming the key; FusedAdam names the fix
        "DCP, no masters": r"Missing key in checkpoint state_dict: optimizer\.state\..*\.master",
        "DCP, another shape": r"Size mismatch .* for optimizer\.state\.blocks\.0\.fc1\.weight\.master",
        "in memory, no masters": r"no fp32 master .* load the model alone and build a new FusedAdam",
    }
    for label, pattern in patterns.items():
        message, unchanged = refusals[label]
        assert message, f"{label}: loaded without an error"
        assert re.search(pattern, message, re.DOTALL), (label, message)
        assert unchanged, f"{label}: the model or optimizer changed"
