"""quant_fsdp.parallel: tensor and sequence parallel qt.nn.Linear under torch's parallelize_module.

Per layer: forward and backward equal the unsharded layer's slices, with and without SP, on 2 and
4 gloo ranks. Quantized primary weights: each local weight is the slice of the whole weight's
quantization, and FusedAdam trains TP=2 + SP to the one-process losses for every recipe. Shared
gathers, errors for bad inputs, DCP resume. Training parity of the layouts against one process
(TP, TP + SP, FSDP2 x TP + SP; every recipe in rows of each) is the scenario table's,
test_scenarios.py.
"""

from __future__ import annotations

import copy
import dataclasses
import functools

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import parallelize_module

import quant_fsdp
import quant_tensors as qt
from quant_fsdp.parallel import QuantColwiseParallel, QuantRowwiseParallel
from quant_lab.demo import MarkovTask, TransformerConfig, adamw, train
from quant_lab.testing import (
    SharedWorld,
    TensorParallelModel,
    run_shared_world,
    tensor_parallel_plan,
)
from quant_optim import FusedAdam

RECIPES = ("fp8", "fp8-delayed", "mxfp8", "fp8-block", "nvfp4")
LOSS_TOLERANCE = 5e-3  # relative, at every step, as the parity tests
LR = 3e-4  # as the parity tests
CONFIG = TransformerConfig(vocab=256, hidden=256, layers=2, heads=4, sequence=64)
STEPS, BATCH = 5, 8
TASK = MarkovTask(CONFIG.vocab)


def make_model(recipe_name: str) -> TensorParallelModel:
    """The test transformer (seed 0) built with qt.nn.Linear layers of the recipe."""
    torch.manual_seed(0)
    return TensorParallelModel(CONFIG, functools.partial(qt.nn.Linear, recipe=qt.recipe_from_name(recipe_name)))


# ---- one layer: forward and backward equal the unsharded layer's slices -------------------------


def deterministic(recipe_name: str) -> qt.Recipe:
    """The recipe, with NVFP4's stochastic rounding of gradients off: a rank's slice of dy draws
    other random numbers than the whole dy does, so only round-to-nearest compares elementwise
    (the training test above keeps it on)."""
    recipe = qt.recipe_from_name(recipe_name)
    return dataclasses.replace(recipe, stochastic_rounding=False) if recipe_name == "nvfp4" else recipe


LAYER_CASES = [  # (style, sequence_parallel, sequence_dim)
    *((QuantColwiseParallel, False, 0), (QuantColwiseParallel, True, 0), (QuantColwiseParallel, True, 1)),
    *((QuantRowwiseParallel, False, 0), (QuantRowwiseParallel, True, 0), (QuantRowwiseParallel, True, 1)),
]


def in_layout(t: torch.Tensor, dim: int | None, *, sequence_dim: int, world_size: int, rank: int) -> torch.Tensor:
    """A sequence-first [s, b, h] tensor in the TP layer's layout, this rank's slice along dim
    (None: all of it)."""
    t = t if sequence_dim == 0 else t.transpose(0, 1)
    return t if dim is None else t.chunk(world_size, dim=dim)[rank]


def _layer_matches_unsharded(rank: int, world_size: int) -> None:
    """The reference runs the whole layer on sequence-first tensors [s, b, h]; the TP layer gets
    them as [s, b, h] (sequence_dim=0) or [b, s, h] (sequence_dim=1), sliced as its style wants.
    Its gather orders tokens (sequence, batch) either way, so the wgrad's token blocks match.
    512 features and 128 x 4 tokens: 128 features and 128 token rows per rank on 4 ranks, so every
    format quantizes the local weights and gathers quantized."""
    mesh = init_device_mesh("cpu", (world_size,))
    generator = torch.Generator().manual_seed(7)
    x, dy = (torch.randn(128, 4, 512, generator=generator) for _ in range(2))  # the same on every rank
    for recipe_name in RECIPES:
        for style_type, sequence_parallel, sequence_dim in LAYER_CASES:
            label = f"{recipe_name} {style_type.__name__} sp={sequence_parallel} sequence_dim={sequence_dim}"
            torch.manual_seed(1)
            reference = qt.nn.Linear(512, 512, recipe=deterministic(recipe_name))
            layer = copy.deepcopy(reference)
            parallelize_module(layer, mesh, style_type(sequence_parallel=sequence_parallel, sequence_dim=sequence_dim))
            want_x = x.clone().requires_grad_(True)
            want_y = reference(want_x)
            want_y.backward(dy)
            want_y = want_y.detach()

            mine = functools.partial(in_layout, sequence_dim=sequence_dim, world_size=world_size, rank=rank)
            sequence = sequence_dim if sequence_parallel else None
            input_dim, output_dim = (sequence, -1) if style_type is QuantColwiseParallel else (-1, sequence)
            local_x = mine(x, input_dim).clone().requires_grad_(True)
            quant_fsdp.reset_comm_stats()
            got = layer(local_x)
            got.backward(mine(dy, output_dim))
            # Sequence parallel: the column-parallel input (forward) or the row-parallel gradient
            # (backward) travels quantized; nothing is gathered otherwise.
            stats = quant_fsdp.comm_stats().get(layer.input_quantizer.format_name, {"quantized": 0, "fallback": 0})
            assert (stats["quantized"] > 0) == sequence_parallel, (label, stats)
            assert stats["fallback"] == 0, (label, stats)
            weight_dim, bias_dim = (0, 0) if style_type is QuantColwiseParallel else (1, None)
            # Exact up to the order of fp32 sums: over the ranks (row-parallel y, column-parallel dx)
            # and inside the GEMMs of a slice.
            pairs = {
                "y": (got.detach(), mine(want_y, output_dim)),
                "dx": (local_x.grad, mine(want_x.grad, input_dim)),
                "dw": (layer.weight.grad.to_local(), reference.weight.grad.chunk(world_size, dim=weight_dim)[rank]),
                "db": (
                    layer.bias.grad.to_local(),
                    reference.bias.grad if bias_dim is None else reference.bias.grad.chunk(world_size)[rank],
                ),
            }
            for name, (a, b) in pairs.items():
                # fp32 GEMMs over slices may sum in another order: 1e-5 of the largest magnitude
                scale = float(b.abs().max())
                torch.testing.assert_close(
                    a, b, rtol=1e-5, atol=1e-5 * scale, msg=lambda m, n=f"{label} {name}": f"{n}: {m}"
                )


@pytest.mark.parametrize("world_size", [2, 4])
def test_parallel_linear_equals_the_unsharded_layer(world_size, request):
    request.getfixturevalue(f"world_{world_size}").check("layer")


def _qkv_share_one_gather(rank: int, world_size: int) -> None:
    """Three column-parallel SP layers reading one input object (q, k, v) gather it once when
    their quantizers quantize alike (not delayed scaling: each layer's amax history is its own),
    with the same outputs and gradients as three separate gathers."""
    mesh = init_device_mesh("cpu", (world_size,))
    generator = torch.Generator().manual_seed(11)
    x = torch.randn(128, 4, 512, generator=generator).chunk(world_size)[rank]  # sequence first
    dys = [torch.randn(128, 4, 512 // world_size, generator=generator) for _ in range(3)]
    for recipe_name in RECIPES:
        torch.manual_seed(2)
        shared = [qt.nn.Linear(512, 512, recipe=deterministic(recipe_name)) for _ in range(3)]
        separate = copy.deepcopy(shared)
        for layer in shared + separate:
            parallelize_module(layer, mesh, QuantColwiseParallel(sequence_parallel=True, sequence_dim=0))
        runs = {}
        for name, layers, inputs in [
            ("shared", shared, [x.clone().requires_grad_(True)] * 3),
            ("separate", separate, [x.clone().requires_grad_(True) for _ in range(3)]),
        ]:
            quant_fsdp.reset_comm_stats()
            ys = [layer(i) for layer, i in zip(layers, inputs, strict=True)]
            sum((y * dy).sum() for y, dy in zip(ys, dys, strict=True)).backward()
            gathered = sum(counts["quantized"] for counts in quant_fsdp.comm_stats().values())
            dx = sum(i.grad for i in {id(i): i for i in inputs}.values())
            runs[name] = (gathered, ys, dx, [layer.weight.grad.to_local() for layer in layers])
        (shared_bytes, *got), (separate_bytes, *want) = runs["shared"], runs["separate"]
        assert shared_bytes * (1 if recipe_name == "fp8-delayed" else 3) == separate_bytes, recipe_name
        for y, y_alone in zip(got[0], want[0], strict=True):
            assert torch.equal(y, y_alone), recipe_name
        torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=1e-6)  # dx: one sum of three vs three sums
        for dw, dw_alone in zip(got[2], want[2], strict=True):
            assert torch.equal(dw, dw_alone), recipe_name


def _rowwise_data_freed_with_the_input(rank: int, world_size: int) -> None:
    """The gathered input keeps its rowwise data (the forward GEMMs) while the input lives, and
    only the columnwise data (the wgrad GEMM) once it is gone; the backward still runs."""
    from quant_fsdp.parallel import _SHARED_GATHER

    mesh = init_device_mesh("cpu", (world_size,))
    layer = qt.nn.Linear(512, 512, recipe=qt.MXFP8BlockScaling())
    parallelize_module(layer, mesh, QuantColwiseParallel(sequence_parallel=True, sequence_dim=0))
    leaf = (
        torch.randn(128, 4, 512, generator=torch.Generator().manual_seed(5))
        .chunk(world_size)[rank]
        .requires_grad_(True)
    )
    x = leaf * 1  # not a leaf: nothing else keeps it alive
    y = layer(x)
    gathered = getattr(x, _SHARED_GATHER).gathered
    assert gathered.usages == (True, True)
    del x
    assert gathered.usages == (False, True)
    y.sum().backward()
    assert leaf.grad is not None
    assert layer.weight.grad is not None


def test_gathered_rowwise_data_is_freed_with_the_input(world_2):
    world_2.check("rowwise data freed")


def test_layers_reading_one_input_share_its_gather(world_2):
    world_2.check("qkv share one gather")


def _bad_inputs(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (world_size,))
    recipe = qt.Float8BlockScaling()
    with pytest.raises(TypeError, match="parallelizes qt.nn.Linear layers.*qt.convert"):
        parallelize_module(torch.nn.Linear(256, 256), mesh, QuantColwiseParallel())
    with pytest.warns(UserWarning, match="out_features=257"):
        odd = qt.nn.Linear(256, 257, recipe=qt.Float8CurrentScaling())
    with pytest.raises(ValueError, match="splits out_features=257 .* over 2 ranks"):
        parallelize_module(odd, mesh, QuantColwiseParallel())
    with pytest.raises(ValueError, match="takes a 1-D TP mesh"):
        QuantRowwiseParallel()._apply(qt.nn.Linear(256, 256, recipe=recipe), init_device_mesh("cpu", (1, world_size)))
    # 256 / 2 = 128 columns per rank fit 128 x 128 tiles; 128 / 2 = 64 do not.
    quantized = qt.convert(torch.nn.Sequential(torch.nn.Linear(128, 256)), recipe, quantized_weights=True)[0]
    with pytest.raises(ValueError, match=r"local weight of \(256, 64\).*cannot hold.*quantized_weights"):
        parallelize_module(quantized, mesh, QuantRowwiseParallel())
    assert isinstance(quantized.weight, qt.QuantizedTensor)  # left as it was
    parallelize_module(quantized, mesh, QuantColwiseParallel())
    with pytest.raises(ValueError, match="already a DTensor"):
        parallelize_module(quantized, mesh, QuantColwiseParallel())
    with pytest.raises(NotImplementedError, match="quantized primary weight split for tensor parallelism.*TP alone"):
        quant_fsdp.fully_shard(torch.nn.Sequential(quantized), mesh=mesh)
    fp8 = qt.nn.Linear(256, 256, recipe=qt.Float8CurrentScaling())
    fp8.weight_quantizer.bind(amax_group=dist.new_group(backend="gloo"))
    weight = fp8.weight
    with pytest.raises(ValueError, match="already agrees on its amax over another group"):
        parallelize_module(fp8, mesh, QuantColwiseParallel())
    assert fp8.weight is weight  # a refused layer is left as it was
    layer = parallelize_module(
        qt.nn.Linear(256, 256, recipe=recipe), mesh, QuantColwiseParallel(sequence_parallel=True)
    )
    wrong = DTensor.from_local(torch.randn(2, 64, 256), mesh, [Replicate()])
    with pytest.raises(ValueError, match=r"expects an input placed as Shard\(dim=1\)"):
        layer(wrong)
    with pytest.raises(ValueError, match="sequence_dim=1.*leading dims"):
        layer(torch.randn(64, 256))
    rowwise = parallelize_module(
        qt.nn.Linear(256, 256, recipe=recipe), mesh, QuantRowwiseParallel(sequence_parallel=True)
    )
    with pytest.raises(ValueError, match="splits the sequence .*pad the sequence"):
        rowwise(torch.randn(2, 63, 128))
    # A local weight the blocks do not divide: the explicit fallback, and the result is still right.
    torch.manual_seed(3)
    narrow = qt.nn.Linear(256, 128, recipe=recipe)
    reference = copy.deepcopy(narrow)
    with pytest.warns(UserWarning, match="local weight of 64 x 256.*computes in high precision"):
        parallelize_module(narrow, mesh, QuantColwiseParallel(sequence_parallel=True))
    x = torch.randn(2, 64, 256, generator=torch.Generator().manual_seed(0))
    want = torch.nn.functional.linear(x, reference.weight, reference.bias).chunk(world_size, dim=-1)[rank]
    torch.testing.assert_close(narrow(x.chunk(world_size, dim=1)[rank]), want, rtol=1e-5, atol=1e-5)


def test_bad_inputs_get_clear_errors(world_2):
    world_2.check("bad inputs")


def train_steps(model: TensorParallelModel, optimizer: torch.optim.Optimizer, steps: range) -> list[float]:
    """Whole batches (every TP rank sees the same ones); returns the losses."""
    return train(model, TASK, steps=steps, batch_size=BATCH, optimizer=optimizer)


# ---- quantized primary weights with FusedAdam -----------------------------------------------------


def quantized_weights_model(recipe_name: str) -> TensorParallelModel:
    """make_model with the block Linears' weights stored quantized (qt.convert's mode 1)."""
    model = make_model(recipe_name)
    for layer in model.blocks.modules():
        if isinstance(layer, qt.nn.Linear):
            layer.weight = qt.nn.quantized_parameter(layer.weight.detach(), layer.weight_quantizer)
    return model


def _quantized_weights_train(rank: int, world_size: int, expected: dict) -> None:
    """TP=2 + SP with quantized primary weights: every local weight is the slice of the whole
    weight's quantization (dequantized values compared bitwise; not for delayed scaling, whose
    slices scale by the amax history the whole weight's quantization started), and FusedAdam (fp32
    masters, requantizing with the amax agreed over TP) trains to the one-process losses."""
    mesh = init_device_mesh("cpu", (world_size,))
    for recipe_name, want in expected.items():
        whole = quantized_weights_model(recipe_name)
        model = quantized_weights_model(recipe_name)
        parallelize_module(model, mesh, tensor_parallel_plan(model, sequence_parallel=True))
        for (name, p), w in zip(model.blocks.named_parameters(), whole.blocks.parameters(), strict=True):
            if isinstance(w, qt.QuantizedTensor) and w.quantizer.stateless:
                dim = p.placements[0].dim
                slice_of_whole = w.dequantize().chunk(world_size, dim=dim)[rank]
                assert torch.equal(p.to_local().dequantize(), slice_of_whole), (recipe_name, name)
        got = train_steps(model, FusedAdam(model.parameters(), lr=LR), range(STEPS))
        worst = max(abs(g - w) / abs(w) for g, w in zip(got, want, strict=True))
        if rank == 0:
            print(f"{recipe_name} quantized weights tp={world_size} sp=True: max relative loss difference {worst:.2e}")
        assert worst <= LOSS_TOLERANCE, (recipe_name, worst, got, want)


def test_tensor_parallel_quantized_weights_with_fused_adam_match_single_process(world_2):
    world_2.check("quantized weights")


def quantized_weights_training() -> tuple:
    """The _quantized_weights_train scenario with its single-process losses of every recipe."""
    expected = {}
    for recipe_name in RECIPES:
        model = quantized_weights_model(recipe_name)
        expected[recipe_name] = train_steps(model, FusedAdam(model.parameters(), lr=LR), range(STEPS))
    return _quantized_weights_train, (expected,)


# ---- torch.distributed.checkpoint ----------------------------------------------------------------


def _checkpoint_resumes_bitwise(rank: int, world_size: int, path: str) -> None:
    """TP parameters are DTensors: DCP saves model and AdamW state at step 2, and a fresh TP model
    loading it continues bitwise like the original. (MXFP8: its quantizers keep no state; the
    TP weights themselves are high precision in every recipe.)"""
    mesh = init_device_mesh("cpu", (world_size,))

    def build() -> tuple[TensorParallelModel, torch.optim.Optimizer]:
        model = make_model("mxfp8")
        parallelize_module(model, mesh, tensor_parallel_plan(model, sequence_parallel=True))
        return model, adamw(model.parameters(), lr=LR)

    model, optimizer = build()
    train_steps(model, optimizer, range(2))
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=path)
    want = train_steps(model, optimizer, range(2, 4))

    resumed, resumed_optimizer = build()
    model_state, optimizer_state = get_state_dict(resumed, resumed_optimizer)
    dcp.load({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=path)
    set_state_dict(resumed, resumed_optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)
    assert train_steps(resumed, resumed_optimizer, range(2, 4)) == want
    for (name, a), b in zip(model.named_parameters(), resumed.parameters(), strict=True):
        assert torch.equal(
            a.to_local() if isinstance(a, DTensor) else a, b.to_local() if isinstance(b, DTensor) else b
        ), name


def test_checkpoint_of_a_tensor_parallel_model_resumes_bitwise(world_2):
    world_2.check("checkpoint")


# ---- one world per world size runs every scenario above ([Note: shared worlds] in quant_lab.testing)


@pytest.fixture(scope="module")
def world_2(tmp_path_factory: pytest.TempPathFactory) -> SharedWorld:
    checkpoint = str(tmp_path_factory.mktemp("tensor_parallel") / "checkpoint")
    return run_shared_world(
        2,
        {
            "layer": (_layer_matches_unsharded, ()),
            "qkv share one gather": (_qkv_share_one_gather, ()),
            "rowwise data freed": (_rowwise_data_freed_with_the_input, ()),
            "bad inputs": (_bad_inputs, ()),
            "quantized weights": quantized_weights_training(),
            "checkpoint": (_checkpoint_resumes_bitwise, (checkpoint,)),
        },
    )


@pytest.fixture(scope="module")
def world_4() -> SharedWorld:
    return run_shared_world(4, {"layer": (_layer_matches_unsharded, ())})
