"""A table of named training scenarios over gloo: recipe x weight mode x world size x
layout x resume, a pairwise cover rather than the full product.

27 rows (SCENARIOS): every recipe in every layout (25), and every recipe at world size 1, where
only FSDP runs; every value of two axes that a valid row can combine appears together in some row
(test_the_table_covers_every_valid_pair_of_axes). Not combinable: HSDP and FSDP+TP need 4 ranks,
TP 2 or 4, FSDP+TP takes high-precision weights only (quant_fsdp.fully_shard refuses quantized
TP weights), blockwise FP8 cannot take TP=4 (64-feature local weights).

Each row trains a small transformer for STEPS steps (AdamW on high-precision weights that FSDP2
quantizes when it gathers them, "hp", or quant_optim.FusedAdam on quantized primary weights,
"qw"), optionally saving model and optimizer with DCP after SAVE_AFTER steps and resuming in
freshly built modules, and is checked three ways, each its own test with the row's name as id:
- loss parity: world size 1 equals the same model without FSDP bit for bit; larger worlds are
  within LOSS_TOLERANCE of single-process data-parallel training (quant_lab.testing.train_replicas,
  one replica per data-parallel rank, the same optimizer), where the order of fp32 sums (gradients
  over ranks, TP partial products) and the slice of the batch that per-tensor activation scales
  and NVFP4's stochastic rounding see are the only differences; a resumed run's losses equal the
  uninterrupted run's bit for bit (docs/design.md, 'FusedAdam and checkpoints');
- quantized bytes: what comm_stats() counts as quantized in the last step equals what the formats
  predict (computed below from the codes and scales per element, independently of the product),
  and its ratio to the same gathers in bf16 is within BOUNDS (below);
- no unexpected fallback: comm_stats()'s fallback bytes (and, under FSDP2, the gather plan) are
  exactly the row's named fallback, none where it names none.

Rows run in one shared world per world size ([Note: shared worlds] in quant_lab.testing); rank 0
writes each row's losses and counters, the tests assert on them.

The same ground in depth: test_fsdp2_training.py (parity, 12 steps, every recipe x mode x
world 1/2), test_fused_adam_fsdp2.py / test_fused_adam_parity.py (FusedAdam on FSDP2),
test_fsdp2_gather.py (exact bytes against a bf16 FSDP2 run, fallbacks, MXFP8 without
reshard_after_forward), test_tensor_parallel.py (TP layers bitwise, TP+SP training with quantized
weights, TP checkpoints), test_sequence_gather.py (every sequence-gather path),
test_fused_adam_checkpoint.py (DCP across world sizes and weight forms).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import pathlib
from fractions import Fraction
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

import quant_fsdp
import quant_tensors as qt
from quant_lab import demo
from quant_lab.demo import MarkovTask, TransformerConfig
from quant_lab.testing import (
    SharedWorld,
    TensorParallelModel,
    run_shared_world,
    tensor_parallel_plan,
    train_replicas,
)
from quant_optim import FusedAdam

RECIPES = ("fp8", "fp8-delayed", "mxfp8", "fp8-block", "nvfp4")
WEIGHTS = ("hp", "qw")
LAYOUTS = ("FSDP", "HSDP", "TP", "TP+SP", "FSDP+TP")
CONFIG = TransformerConfig(vocab=128, hidden=128, layers=2, heads=2, sequence=32)
# TP layouts: 256 features keep every local weight of TP=2 on 128 x 128 tiles (blockwise FP8) and
# 4 heads split over TP=4.
TP_CONFIG = TransformerConfig(vocab=128, hidden=256, layers=2, heads=4, sequence=32)
BATCH, STEPS, SAVE_AFTER = 8, 4, 2
LR = 3e-4  # as the parity tests: at 1e-3 NVFP4 amplifies summation-order noise (NOTES)
# Relative, at every step (quant-fsdp NOTES "Numerics under data parallelism"): runs
# that differ only in the order gradients are summed drift 0.20% apart within 50 steps at lr 3e-4
# (NVFP4, batch 16); here 4 steps. Observed maxima are printed with -s.
LOSS_TOLERANCE = 5e-3
TASK = MarkovTask(CONFIG.vocab)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Scenario:
    """One row of the table."""

    name: str
    """The test id."""
    recipe: str
    """qt.recipe_from_name name."""
    weights: str
    """"hp": high-precision weights, quant_fsdp.fully_shard(quantize_on_gather=True), torch AdamW;
    "qw": qt.convert(quantized_weights=True), quant_optim.FusedAdam."""
    world_size: int
    """Ranks."""
    layout: str
    """FSDP (every rank), HSDP (2 replicas x 2 shards), TP / TP+SP (every rank one TP group, the
    whole batch), FSDP+TP (2 x 2: FSDP2 over dp, TP with SP over tp)."""
    resume: bool = False
    """Save with DCP after SAVE_AFTER steps, train on; resume in fresh modules and compare."""
    fallback: str = ""
    """The fallback the row expects ("" for none)."""

    def __post_init__(self) -> None:
        worlds = {"FSDP": (1, 2, 4), "HSDP": (4,), "TP": (2, 4), "TP+SP": (2, 4), "FSDP+TP": (4,)}
        if self.recipe not in RECIPES or self.weights not in WEIGHTS or self.layout not in LAYOUTS:
            raise ValueError(f"{self.name}: unknown recipe, weight mode or layout")
        if self.world_size not in worlds[self.layout]:
            raise ValueError(f"{self.name}: {self.layout} runs on {worlds[self.layout]} ranks")
        if self.tp == 4 and self.recipe == "fp8-block":
            raise ValueError(f"{self.name}: TP=4 leaves 64-feature local weights, off blockwise FP8's 128 x 128 tiles")
        if self.layout == "FSDP+TP" and self.weights == "qw":
            raise ValueError(f"{self.name}: quant_fsdp.fully_shard refuses quantized TP weights (docs/fsdp.md)")

    @property
    def dp(self) -> int:
        """Data-parallel ranks (slices of the global batch)."""
        return {"FSDP": self.world_size, "HSDP": self.world_size, "FSDP+TP": 2}.get(self.layout, 1)

    @property
    def tp(self) -> int:
        return self.world_size // self.dp

    @property
    def config(self) -> TransformerConfig:
        return CONFIG if self.tp == 1 else TP_CONFIG

    @property
    def shards(self) -> int:
        """FSDP2's shard group size (0: no FSDP2)."""
        return {"FSDP": self.world_size, "HSDP": 2, "FSDP+TP": 2}.get(self.layout, 0)

    @property
    def sequence_parallel(self) -> bool:
        return self.layout in ("TP+SP", "FSDP+TP")


SPLIT_TILES = "blockwise FP8 weights whose 64-row shards split 128-row tiles (all but fc1) gather in high precision"
TP_WEIGHTS = "TP weights under FSDP2 gather their high-precision slices (quantized TP gathers: not built yet)"
SCENARIOS = (
    # FSDP at world size 1 (bitwise against no FSDP): every recipe.
    Scenario(name="fsdp1-fp8-hp", recipe="fp8", weights="hp", world_size=1, layout="FSDP"),
    Scenario(name="fsdp1-fp8-delayed-qw-resume", recipe="fp8-delayed", weights="qw", world_size=1, layout="FSDP", resume=True),
    Scenario(name="fsdp1-mxfp8-hp-resume", recipe="mxfp8", weights="hp", world_size=1, layout="FSDP", resume=True),
    Scenario(name="fsdp1-fp8-block-qw", recipe="fp8-block", weights="qw", world_size=1, layout="FSDP"),
    Scenario(name="fsdp1-nvfp4-hp", recipe="nvfp4", weights="hp", world_size=1, layout="FSDP"),
    Scenario(name="fsdp2-fp8-block-qw-resume", recipe="fp8-block", weights="qw", world_size=2, layout="FSDP", resume=True, fallback=SPLIT_TILES),
    Scenario(name="fsdp4-nvfp4-qw", recipe="nvfp4", weights="qw", world_size=4, layout="FSDP"),
    # HSDP (2 replicas x 2 shards): every recipe.
    Scenario(name="hsdp4-fp8-qw", recipe="fp8", weights="qw", world_size=4, layout="HSDP"),
    Scenario(name="hsdp4-fp8-delayed-hp-resume", recipe="fp8-delayed", weights="hp", world_size=4, layout="HSDP", resume=True),
    Scenario(name="hsdp4-mxfp8-qw-resume", recipe="mxfp8", weights="qw", world_size=4, layout="HSDP", resume=True),
    Scenario(name="hsdp4-fp8-block-hp", recipe="fp8-block", weights="hp", world_size=4, layout="HSDP", fallback=SPLIT_TILES),
    Scenario(name="hsdp4-nvfp4-hp", recipe="nvfp4", weights="hp", world_size=4, layout="HSDP"),
    # TP without SP: nothing goes through quant-fsdp's gathers.
    Scenario(name="tp2-fp8-qw", recipe="fp8", weights="qw", world_size=2, layout="TP"),
    Scenario(name="tp2-fp8-delayed-hp", recipe="fp8-delayed", weights="hp", world_size=2, layout="TP"),
    Scenario(name="tp4-mxfp8-hp-resume", recipe="mxfp8", weights="hp", world_size=4, layout="TP", resume=True),
    Scenario(name="tp2-fp8-block-qw-resume", recipe="fp8-block", weights="qw", world_size=2, layout="TP", resume=True),
    Scenario(name="tp2-nvfp4-hp", recipe="nvfp4", weights="hp", world_size=2, layout="TP"),
    # TP + sequence parallel: activations and gradients gathered quantized.
    Scenario(name="tpsp2-fp8-hp-resume", recipe="fp8", weights="hp", world_size=2, layout="TP+SP", resume=True),
    Scenario(name="tpsp2-fp8-delayed-qw", recipe="fp8-delayed", weights="qw", world_size=2, layout="TP+SP"),
    Scenario(name="tpsp2-mxfp8-qw", recipe="mxfp8", weights="qw", world_size=2, layout="TP+SP"),
    Scenario(name="tpsp2-fp8-block-hp", recipe="fp8-block", weights="hp", world_size=2, layout="TP+SP"),
    Scenario(name="tpsp4-nvfp4-qw-resume", recipe="nvfp4", weights="qw", world_size=4, layout="TP+SP", resume=True),
    # FSDP2 over TP + SP (high-precision weights only).
    Scenario(name="fsdp2xtp2-fp8-hp", recipe="fp8", weights="hp", world_size=4, layout="FSDP+TP", fallback=TP_WEIGHTS),
    Scenario(name="fsdp2xtp2-fp8-delayed-hp-resume", recipe="fp8-delayed", weights="hp", world_size=4, layout="FSDP+TP", resume=True, fallback=TP_WEIGHTS),
    Scenario(name="fsdp2xtp2-mxfp8-hp", recipe="mxfp8", weights="hp", world_size=4, layout="FSDP+TP", fallback=TP_WEIGHTS),
    Scenario(
        name="fsdp2xtp2-fp8-block-hp", recipe="fp8-block", weights="hp", world_size=4, layout="FSDP+TP",
        fallback=f"{TP_WEIGHTS}; sequence gathers of 64 token rows split 128-row blocks",
    ),
    Scenario(name="fsdp2xtp2-nvfp4-hp-resume", recipe="nvfp4", weights="hp", world_size=4, layout="FSDP+TP", resume=True, fallback=TP_WEIGHTS),
)  # fmt: skip


# ---- the model -------------------------------------------------------------------------------------


def unsharded_model(recipe_name: str, weights: str, config: TransformerConfig) -> TensorParallelModel:
    """The model (seed 0) converted to the recipe and weight mode, not yet distributed."""
    torch.manual_seed(0)
    model = TensorParallelModel(config)
    return qt.convert(
        model,
        qt.recipe_from_name(recipe_name),
        quantized_weights=weights == "qw",
        module_filter_fn=lambda _, name: name != "head",
    )


def make_optimizer(weights: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    if weights == "qw":
        return FusedAdam(model.parameters(), lr=LR)
    return demo.adamw(model.parameters(), lr=LR)


# ---- rank work ---------------------------------------------------------------------------------------


@dataclasses.dataclass
class Run:
    """A distributed model of a row with its optimizer and this rank's data-parallel slice."""

    scenario: Scenario
    model: TensorParallelModel
    optimizer: torch.optim.Optimizer
    mesh: DeviceMesh | None

    def train(self, steps: range) -> list[float]:
        dp_rank, group = 0, None
        if self.scenario.layout in ("FSDP", "HSDP"):
            dp_rank = dist.get_rank()
        elif self.scenario.layout == "FSDP+TP":
            dp_rank, group = self.mesh["dp"].get_local_rank(), self.mesh["dp"].get_group()
        return demo.train(
            self.model,
            TASK,
            steps=steps,
            batch_size=BATCH,
            optimizer=self.optimizer,
            batch_slice=(dp_rank, self.scenario.dp),
            group=group,
        )


def distributed(scenario: Scenario, mesh: DeviceMesh | None) -> Run:
    model = unsharded_model(scenario.recipe, scenario.weights, scenario.config)
    on_gather = scenario.weights == "hp"
    if scenario.tp > 1:
        parallelize_module(model, mesh["tp"], tensor_parallel_plan(model, scenario.sequence_parallel))
    if scenario.shards:
        fsdp_mesh = mesh["dp"] if scenario.layout == "FSDP+TP" else mesh
        for module in (*model.blocks, model):
            quant_fsdp.fully_shard(module, quantize_on_gather=on_gather, mesh=fsdp_mesh)
    return Run(scenario, model, make_optimizer(scenario.weights, model), mesh)


def make_mesh(scenario: Scenario) -> DeviceMesh | None:
    if scenario.layout == "HSDP":
        return init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    if scenario.tp > 1:
        return init_device_mesh("cpu", (scenario.dp, scenario.tp), mesh_dim_names=("dp", "tp"))
    return None


def save(run: Run, path: pathlib.Path) -> None:
    model_state, optimizer_state = get_state_dict(run.model, run.optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=path)


def load(run: Run, path: pathlib.Path) -> None:
    model_state, optimizer_state = get_state_dict(run.model, run.optimizer)
    dcp.load({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=path)
    set_state_dict(run.model, run.optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)


def _train_scenario(rank: int, world_size: int, fields: dict[str, Any], directory: str) -> None:
    """Trains the row (saving and resuming it where it says so), counting the last step's
    gathers; rank 0 writes losses, counters and the gather plan to directory/<name>.pt."""
    scenario = Scenario(**fields)
    path = pathlib.Path(directory) / scenario.name
    mesh = make_mesh(scenario)
    run = distributed(scenario, mesh)
    losses, uninterrupted, first = [], None, 0
    if scenario.resume:
        losses = run.train(range(SAVE_AFTER))
        save(run, path / "checkpoint")
        uninterrupted = run.train(range(SAVE_AFTER, STEPS))
        run = distributed(scenario, mesh)
        load(run, path / "checkpoint")
        first = SAVE_AFTER
    losses += run.train(range(first, STEPS - 1))
    quant_fsdp.reset_comm_stats()
    losses += run.train(range(STEPS - 1, STEPS))
    stats = quant_fsdp.comm_stats()
    plan = {p.name: p.quantized_gather for p in quant_fsdp.gather_plan(run.model)} if scenario.shards else {}
    reference = (
        reference_losses(scenario.recipe, scenario.weights, scenario.config, 1) if world_size == 1 else None
    )  # in this process: same threads
    if rank == 0:
        result = {
            "losses": losses,
            "uninterrupted": uninterrupted,
            "stats": stats,
            "plan": plan,
            "reference": reference,
        }
        torch.save(result, pathlib.Path(directory) / f"{scenario.name}.pt")


# ---- expectations --------------------------------------------------------------------------------------


@functools.cache
def reference_losses(recipe_name: str, weights: str, config: TransformerConfig, dp: int) -> list[float]:
    """Single-process data-parallel training: one replica per data-parallel rank, the weight
    mode's optimizer, no FSDP or TP."""
    replicas = [unsharded_model(recipe_name, weights, config) for _ in range(dp)]
    optimizer = functools.partial(make_optimizer, weights)
    return train_replicas(replicas, TASK, steps=STEPS, batch_size=BATCH, lr=LR, optimizer=optimizer)


# Bytes per element from the formats (docs/design.md, 'Numerics'): codes, plus block scales per element;
# per-tensor scales and NVFP4's global amax are not gathered. Weights: the rowwise usage (per-tensor
# FP8, 128 x 128 and 16 x 16 tiles derive columnwise locally; MXFP8 gathers rowwise for the forward
# and columnwise for the backward, of equal size). Activations and gradients (1-D blocks): one gather
# carries both usages (forward or dgrad GEMM, and wgrad GEMM) unless columnwise is a transpose.
WEIGHT_BYTES = {
    "fp8": Fraction(1),
    "fp8-delayed": Fraction(1),
    "mxfp8": 1 + Fraction(1, 32),  # E8M0 scale per 32
    "fp8-block": 1 + Fraction(4, 128 * 128),  # fp32 scale per 128 x 128 tile
    "nvfp4": Fraction(1, 2) + Fraction(1, 16 * 16),  # E2M1 pairs, E4M3 scale per 16 x 16 tile
}
ACTIVATION_BYTES = {
    "fp8": Fraction(1),
    "fp8-delayed": Fraction(1),
    "mxfp8": 2 * (1 + Fraction(1, 32)),
    "fp8-block": 2 * (1 + Fraction(4, 128)),  # fp32 scale per 1 x 128 block
    "nvfp4": 2 * (Fraction(1, 2) + Fraction(1, 16)),  # E4M3 scale per 1 x 16 block
}
BLOCK_ROWS = {"fp8": 1, "fp8-delayed": 1, "mxfp8": 32, "fp8-block": 128, "nvfp4": 16}  # weight shards
TOKEN_ROWS = {"fp8": 16, "fp8-delayed": 16, "mxfp8": 32, "fp8-block": 128, "nvfp4": 16}  # local tokens
BOUNDS = {"fp8": 0.52, "fp8-delayed": 0.52, "mxfp8": 0.52, "fp8-block": 0.52, "nvfp4": 0.30}  # gather bytes / bf16's
HIGH_PRECISION = 4  # fp32 parameters and activations


@dataclasses.dataclass(frozen=True)
class Expected:
    quantized: int
    """Quantized bytes all-gathered in one step."""
    fallback: int
    """High-precision bytes all-gathered in one step for quantized weights and activations."""
    bf16: int
    """The quantized gathers' bytes in bf16."""
    usages: int
    """Usages one gather carries (the bound of section 9 is per usage)."""
    plan: dict[str, bool]
    """FSDP2's gather plan: quantized weight -> gathered quantized."""


def whole(bytes_: Fraction) -> int:
    assert bytes_.denominator == 1, bytes_
    return int(bytes_)


@functools.cache
def expected(scenario: Scenario) -> Expected:
    """What the last step gathers (every rank receives the full tensor of each gather):
    - FSDP2 (FSDP, HSDP): every block Linear weight twice (forward and backward: blocks reshard
      after forward), quantized if its shards fall on its format's block rows, else in fp32;
    - FSDP2 over TP: the TP weights' local slices twice, in fp32 (TP_WEIGHTS);
    - sequence parallel, per block: the column-parallel inputs in the forward (q, k, v share one
      gather unless delayed scaling keeps a history per layer; fc1), the row-parallel gradients
      (proj, fc2) in the backward; quantized if the local tokens fall on the format's block rows."""
    recipe, hidden = scenario.recipe, scenario.config.hidden
    weights = {"q": (hidden, hidden), "k": (hidden, hidden), "v": (hidden, hidden), "proj": (hidden, hidden)}
    weights |= {"fc1": (4 * hidden, hidden), "fc2": (hidden, 4 * hidden)}
    quantized = fallback = bf16 = Fraction(0)
    plan = {}
    for i in range(scenario.config.layers):
        for layer, (rows, columns) in weights.items():
            numel = rows * columns
            if scenario.layout in ("FSDP", "HSDP"):
                aligned = rows % scenario.shards == 0 and rows // scenario.shards % BLOCK_ROWS[recipe] == 0
                plan[f"blocks.{i}.{layer}.weight"] = aligned
                if aligned:
                    quantized += 2 * numel * WEIGHT_BYTES[recipe]
                    bf16 += 2 * numel * 2
                else:
                    fallback += 2 * numel * HIGH_PRECISION
            elif scenario.layout == "FSDP+TP":
                plan[f"blocks.{i}.{layer}.weight"] = False
                fallback += 2 * numel // scenario.tp * HIGH_PRECISION
    if scenario.sequence_parallel:
        tokens = BATCH // scenario.dp * scenario.config.sequence
        gathers = scenario.config.layers * ((4 if recipe == "fp8-delayed" else 2) + 2)
        if tokens // scenario.tp % TOKEN_ROWS[recipe] == 0:
            quantized += gathers * tokens * hidden * ACTIVATION_BYTES[recipe]
            bf16 += gathers * tokens * hidden * 2
        else:
            fallback += gathers * tokens * hidden * HIGH_PRECISION
    usages = 2 if scenario.sequence_parallel and recipe in ("mxfp8", "fp8-block", "nvfp4") else 1
    return Expected(whole(quantized), whole(fallback), whole(bf16), usages, plan)


# ---- one world per world size runs its rows; the tests assert on what rank 0 wrote ------------------


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return tmp_path_factory.mktemp("scenarios")


def world_size(world_size: int, directory: pathlib.Path) -> SharedWorld:
    rows = [s for s in SCENARIOS if s.world_size == world_size]
    return run_shared_world(
        world_size, {s.name: (_train_scenario, (dataclasses.asdict(s), str(directory))) for s in rows}
    )


@pytest.fixture(scope="module")
def world_1(results: pathlib.Path) -> SharedWorld:
    return world_size(1, results)


@pytest.fixture(scope="module")
def world_2(results: pathlib.Path) -> SharedWorld:
    return world_size(2, results)


@pytest.fixture(scope="module")
def world_4(results: pathlib.Path) -> SharedWorld:
    return world_size(4, results)


def outcome(scenario: Scenario, request: pytest.FixtureRequest) -> dict[str, Any]:
    request.getfixturevalue(f"world_{scenario.world_size}").check(scenario.name)
    return torch.load(request.getfixturevalue("results") / f"{scenario.name}.pt", weights_only=True)


ROWS = [pytest.param(s, id=s.name) for s in SCENARIOS]


@pytest.mark.parametrize("scenario", ROWS)
def test_loss_parity(scenario: Scenario, request: pytest.FixtureRequest) -> None:
    result = outcome(scenario, request)
    losses = result["losses"]
    assert len(losses) == STEPS
    if scenario.world_size == 1:  # FSDP2 on one rank computes exactly what the model alone does
        assert losses == result["reference"]
    else:
        want = reference_losses(scenario.recipe, scenario.weights, scenario.config, scenario.dp)
        worst = max(abs(g - w) / abs(w) for g, w in zip(losses, want, strict=True))
        print(f"{scenario.name}: max relative loss difference {worst:.2e}")
        assert worst <= LOSS_TOLERANCE, (losses, want)
    if scenario.resume:  # the same layout: the resumed run continues bit for bit
        assert losses[SAVE_AFTER:] == result["uninterrupted"]


@pytest.mark.parametrize("scenario", ROWS)
def test_quantized_bytes(scenario: Scenario, request: pytest.FixtureRequest) -> None:
    result = outcome(scenario, request)
    want = expected(scenario)
    format_name = qt.recipe_from_name(scenario.recipe).quantizer("weight").format_name
    assert set(result["stats"]) <= {format_name}, result["stats"]
    got = result["stats"].get(format_name, {"quantized": 0})["quantized"]
    assert got == want.quantized, (got, want)
    if not want.bf16:
        return  # nothing gathered quantized: TP alone reduces in high precision; see the fallback test
    ratio = got / want.bf16
    print(f"{scenario.name}: {ratio:.4f}x bf16 ({want.usages} usage(s) per gather)")
    assert ratio <= BOUNDS[scenario.recipe] * want.usages


@pytest.mark.parametrize("scenario", ROWS)
def test_no_unexpected_fallback(scenario: Scenario, request: pytest.FixtureRequest) -> None:
    result = outcome(scenario, request)
    want = expected(scenario)
    assert (want.fallback > 0) == bool(scenario.fallback), "the row's named fallback and the formats disagree"
    got = sum(counts["fallback"] for counts in result["stats"].values())
    assert got == want.fallback, (got, want)
    assert result["plan"] == want.plan


AXES = {"recipe": RECIPES, "weights": WEIGHTS, "world_size": (1, 2, 4), "layout": LAYOUTS, "resume": (False, True)}


def valid(**values: Any) -> bool:
    try:
        Scenario(name="", **values)
    except ValueError:
        return False
    return True


def test_the_table_covers_every_valid_pair_of_axes() -> None:
    """Every value of every axis, and every pair of values of two axes that some valid row can
    hold (e.g. not FSDP+TP with quantized weights, not HSDP on 2 ranks), appears in a row; in
    particular every recipe in every layout. Names are unique."""
    assert len({s.name for s in SCENARIOS}) == len(SCENARIOS)
    full = [dict(zip(AXES, values, strict=True)) for values in itertools.product(*AXES.values())]
    rows = [{axis: getattr(s, axis) for axis in AXES} for s in SCENARIOS]
    for a, b in itertools.combinations(AXES, 2):
        possible = {(v[a], v[b]) for v in full if valid(**v)}
        covered = {(row[a], row[b]) for row in rows}
        assert possible <= covered, (a, b, sorted(possible - covered, key=str))
