"""torchtitan 0.3 with quant_fsdp.torchtitan.QuantLinearConverter and quant_optim.torchtitan.FusedAdamOptimizers.

torchtitan's llama3 "debugmodel" comes from its own config registry (`model_registry`, converters
listed there), cut to 2 layers and given torch's SDPA as inner attention (the flex attention of the
debug config has no backward on the CPU); then torchtitan's own `parallelize_llama` (activation
checkpointing, FSDP2 with its MixedPrecisionPolicy in bf16) on 2 gloo ranks, as torchtitan's
Trainer does it (which itself needs a GPU: its device falls back to "cuda"). Random tokens stand
in for the debug config's dataset. All scenarios share one warm world of 2 ranks.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable

import pytest

pytest.importorskip("torchtitan")

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

import quant_fsdp
from quant_lab.testing import count_all_gather_bytes, run_on_warm_ranks

SEQUENCE = 64
BATCH = 2
VOCAB = 2048
LAYERS = 2
# bf16 against FP8 (current scaling, quantized weights) over 4 steps of the 2-layer model: the loss
# is ~8 and the FP8 GEMMs move it by ~1e-4 relative or less; 1% leaves room for
# other seeds while catching a broken layer (a wrong scale or transpose moves it by tens of percent).
PARITY_RTOL = 1e-2


def _build(
    recipe: str | None,
    quantized_weights: bool,
    world_size: int,
    before_init: Callable[[torch.nn.Module], None] | None = None,
    **converter: object,
):
    """torchtitan's debug llama3 with our converter (None: without), parallelized by torchtitan,
    then initialised as torchtitan's Trainer does (after `before_init(model)`, where given)."""
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.activation_checkpoint import FullAC
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import model_registry

    from quant_fsdp.torchtitan import QuantLinearConverter, unfuse_qkv

    parallel_dims_module.device_type = "cpu"  # torchtitan's device falls back to "cuda" without a GPU
    converters = []
    if recipe is not None:
        converters = [QuantLinearConverter.Config(recipe_name=recipe, quantized_weights=quantized_weights, **converter)]
    spec = model_registry("debugmodel", converters=converters)
    config = unfuse_qkv(spec.model)  # as the converter does for quantized weights: the same model for all
    config.layers = config.layers[:LAYERS]
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    parallelism = ParallelismConfig(spmd_backend="partial_dtensor")
    config.update_from_config(config=_JobConfig(parallelism))
    parallel_dims = ParallelDims.from_config(parallelism, world_size)
    parallel_dims.build_mesh()
    torch.manual_seed(0)
    with torch.device("meta"):
        model = config.build()
    model.verify_module_protocol()
    model = spec.parallelize_fn(
        model,
        parallel_dims=parallel_dims,
        training=TrainingConfig(local_batch_size=BATCH, seq_len=SEQUENCE, mixed_precision_param="bfloat16"),
        parallelism=parallelism,
        compile_config=CompileConfig(),
        ac_config=FullAC.Config(),
        dump_folder="",
    )
    for module in model.modules():  # gloo has no PREMUL_SUM, which FSDP2 uses for a divide factor of 1
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
    model.to_empty(device="cpu")
    if before_init is not None:
        before_init(model)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    return model, spec


@dataclasses.dataclass
class _JobConfig:
    parallelism: object


def _optimizer(model: torch.nn.Module, **config: object):
    from quant_optim.torchtitan import FusedAdamOptimizers

    return FusedAdamOptimizers.Config(lr=1e-3, **config).build(model_parts=[model])


def _train(model, optimizer, rank: int, world_size: int, steps: int, first: int = 0) -> list[float]:
    """`steps` steps on random tokens (each rank its own, seeded by step and rank); the global loss."""
    losses = []
    for step in range(first, first + steps):
        tokens = torch.randint(
            0, VOCAB, (BATCH, SEQUENCE + 1), generator=torch.Generator().manual_seed(step * 8 + rank)
        )
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()) / world_size
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        dist.all_reduce(total := loss.detach().clone())
        losses.append(total.item())
    return losses


def _parity_and_gathered_bytes(rank: int, world_size: int) -> None:
    steps = 4
    losses, gathered = {}, {}
    quant_fsdp.reset_comm_stats()
    for recipe in (None, "fp8"):
        model, _ = _build(recipe, recipe is not None, world_size)
        optimizer = _optimizer(model)
        with count_all_gather_bytes() as gathered[recipe]:
            losses[recipe] = _train(model, optimizer, rank, world_size, steps)
    for reference, fp8 in zip(losses[None], losses["fp8"], strict=True):
        assert math.isfinite(fp8), losses
        assert abs(fp8 - reference) <= PARITY_RTOL * abs(reference), (losses, rank)
    assert losses["fp8"] != losses[None]  # the converter did change the GEMMs
    stats = quant_fsdp.comm_stats()
    assert stats["per-tensor FP8"]["quantized"] > 0, stats
    assert stats["per-tensor FP8"]["fallback"] == 0, stats
    # Same FSDP units, same gathers in the same order: those of the transformer blocks (FP8 block
    # Linears + two bf16 norm weights) shrink, those of the embedding and of the root (norm,
    # lm_head, kept bf16 by filter_fqns' default) do not.
    bf16, fp8 = gathered[None].sizes, gathered["fp8"].sizes
    assert len(bf16) == len(fp8)
    blocks = [(a, b) for a, b in zip(bf16, fp8, strict=True) if a != b]
    assert len(blocks) == steps * 2 * LAYERS, (bf16, fp8)  # each block: forward and backward
    ratio = sum(b for _, b in blocks) / sum(a for a, _ in blocks)
    assert ratio <= 0.52, ratio


def _checkpoint_resume(rank: int, world_size: int, folder: str, converter: dict[str, object]) -> None:
    """DCP save and resume as torchtitan's checkpointer stores them (model state dict from
    get_model_state_dict, the optimizers' flat FQN-keyed state dict): bit for bit."""
    model, _ = _build("fp8", True, world_size, **converter)
    optimizer = _optimizer(model)
    _train(model, optimizer, rank, world_size, 2)
    saved = get_model_state_dict(model)
    if converter.get("reduce_scatter_error_feedback"):
        residuals = [key for key in saved if key.endswith("fp8_reduce_scatter_residual")]
        # one per FSDP2 unit: each block, the embedding, and norm with lm_head (the root has no parameters of its own)
        assert len(residuals) == LAYERS + 2, residuals
        assert any(saved[key].to_local().abs().sum() > 0 for key in residuals)  # what the FP8 codes did not carry
    dcp.save({"model": saved, "optimizer": optimizer.state_dict()}, checkpoint_id=folder)
    expected = _train(model, optimizer, rank, world_size, 2, first=2)

    resumed, _ = _build("fp8", True, world_size, **converter)
    resumed_optimizer = _optimizer(resumed)
    state = {"model": get_model_state_dict(resumed), "optimizer": resumed_optimizer.state_dict()}
    dcp.load(state, checkpoint_id=folder)
    set_model_state_dict(resumed, state["model"])
    resumed_optimizer.load_state_dict(state["optimizer"])
    got = _train(resumed, resumed_optimizer, rank, world_size, 2, first=2)
    assert got == expected, (got, expected)
    for (name, a), b in zip(model.state_dict().items(), resumed.state_dict().values(), strict=True):
        a, b = (t.to_local() if hasattr(t, "to_local") else t for t in (a, b))
        a, b = (t.dequantize() if hasattr(t, "dequantize") else t for t in (a, b))
        assert torch.equal(a, b), name


def _fsdp_units(model: torch.nn.Module) -> list[list[torch.nn.Parameter]]:
    """The parameters of each FSDP2 unit that has any (one per FSDP state: [norm, lm_head] share one)."""
    units: dict[int, list[torch.nn.Parameter]] = {}
    owner: dict[int, int] = {}
    for module in model.modules():  # parents before children: a child unit takes its own parameters
        if isinstance(module, FSDPModule):
            state = id(module._get_fsdp_state())
            for param in module.parameters():
                owner[id(param)] = state
    for param in model.parameters():
        units.setdefault(owner[id(param)], []).append(param)
    return list(units.values())


def _reduce_scatter_bytes(model: torch.nn.Module, world_size: int) -> tuple[int, int]:
    """(bytes QuantizedReduceScatter sends, bf16 bytes of FSDP2's reduce-scatter input) for one
    backward: each unit's gradients padded along dim 0 to the world size; one E4M3 code per element
    and an fp32 scale per 128 of each rank's chunk (padded to whole blocks), for every rank."""
    fp8 = bf16 = 0
    for params in _fsdp_units(model):
        padded = sum(math.ceil(p.shape[0] / world_size) * world_size * (p.numel() // p.shape[0]) for p in params)
        bf16 += 2 * padded
        fp8 += world_size * math.ceil(padded // world_size / 128) * (128 + 4)
    return fp8, bf16


def _fp8_reduce_scatter(rank: int, world_size: int) -> None:
    steps = 4
    losses, sent = {}, {}
    for reduce_scatter in (None, "fp8"):
        model, _ = _build("fp8", True, world_size, reduce_scatter=reduce_scatter)
        quant_fsdp.reset_comm_stats()
        losses[reduce_scatter] = _train(model, _optimizer(model), rank, world_size, steps)
        sent[reduce_scatter] = quant_fsdp.comm_stats().get("FP8 reduce-scatter")
    for reference, fp8 in zip(losses[None], losses["fp8"], strict=True):
        assert abs(fp8 - reference) <= PARITY_RTOL * abs(reference), (losses, rank)
    assert losses["fp8"][1:] != losses[None][1:]  # the FP8 gradients did change the later steps
    assert sent[None] is None, sent
    fp8_bytes, bf16_bytes = _reduce_scatter_bytes(model, world_size)
    assert sent["fp8"] == {"quantized": steps * fp8_bytes, "fallback": 0}, (sent, fp8_bytes)
    assert fp8_bytes <= 0.53 * bf16_bytes, fp8_bytes / bf16_bytes


class _OtherReduceScatter(ReduceScatter):
    """A reduce-scatter of someone else's (as symmetric memory's is)."""

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


def _another_reduce_scatter_is_refused(rank: int, world_size: int) -> None:
    def set_another(model: torch.nn.Module) -> None:
        model.layers["1"].set_custom_reduce_scatter(_OtherReduceScatter())

    with pytest.raises(
        ValueError, match="already reduce-scatters with _OtherReduceScatter.*enable_fsdp_symm_mem = False"
    ):
        _build("fp8", True, world_size, before_init=set_another, reduce_scatter="fp8")


def _hugging_face_export(rank: int, world_size: int) -> None:
    """export_state_dict (FusedAdam's fp32 masters) through torchtitan's Llama3StateDictAdapter
    loads with strict=True into transformers' LlamaForCausalLM of the same shape."""
    model, spec = _build("fp8", True, world_size)
    optimizer = _optimizer(model)
    _train(model, optimizer, rank, world_size, 1)
    exported = quant_fsdp.export_state_dict(model, optimizer.optimizers[0])
    if rank != 0:
        assert exported == {}
        return
    hf_state = spec.state_dict_adapter(model.config, None).to_hf(exported)
    import transformers

    attention = model.config.layers[0].attention
    hf_config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=model.config.dim,
        intermediate_size=model.config.layers[0].feed_forward.w1.out_features,
        num_hidden_layers=LAYERS,
        num_attention_heads=attention.n_heads,
        num_key_value_heads=attention.n_kv_heads or attention.n_heads,
        tie_word_embeddings=False,
    )
    hf_model = transformers.LlamaForCausalLM(hf_config)
    assert set(hf_state) == set(hf_model.state_dict())
    hf_model.load_state_dict(hf_state, strict=True)
    masters = {name: state["master"] for name, state in _named_states(optimizer.optimizers[0]) if "master" in state}
    assert masters  # the quantized block weights exported their fp32 masters
    assert torch.equal(
        hf_model.model.layers[0].self_attn.o_proj.weight, hf_state["model.layers.0.self_attn.o_proj.weight"]
    )


def _named_states(optimizer):
    for group in optimizer.param_groups:
        for name, param in zip(group["param_names"], group["params"], strict=True):
            yield name, optimizer.state[param]


def _adamw_refuses_quantized_weights(rank: int, world_size: int) -> None:
    from torchtitan.components.optimizer import ParamGroupConfig, default_adamw

    from quant_optim.torchtitan import with_quantized_training_checks

    model, spec = _build("fp8", True, world_size)
    optimizer = default_adamw(lr=1e-3).build(model_parts=[model])
    # torchtitan's own AdamW: refused by the checks' post_optimizer_build_fn, called as the Trainer does.
    previous_calls = []
    spec.post_optimizer_build_fn = lambda *args: previous_calls.append(args)  # e.g. MoE load balancing
    spec = with_quantized_training_checks(spec)
    with pytest.raises(ValueError, match=r"AdamW cannot step quantized weights \(layers\.0\..*FusedAdamOptimizers"):
        spec.post_optimizer_build_fn(optimizer, [model], None)
    assert previous_calls == []  # the checks run first
    fused_adam = _optimizer(model)
    spec.post_optimizer_build_fn(fused_adam, [model], None)  # FusedAdam passes, then the spec's own hook runs
    assert previous_calls == [(fused_adam, [model], None)]
    # Without the checks, its first step raises quant-tensors' error, which names FusedAdam.
    with pytest.raises(NotImplementedError, match="quant_optim.FusedAdam"):
        _train(model, optimizer, rank, world_size, 1)
    # Our container refuses an AdamW group over quantized weights when it is built.
    group = ParamGroupConfig(pattern=r".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-3})
    with pytest.raises(ValueError, match='name "FusedAdam" as the optimizer_name'):
        _optimizer(model, param_groups=[group])


def test_fp8_trains_like_bf16_and_gathers_half_the_bytes() -> None:
    run_on_warm_ranks(_parity_and_gathered_bytes, 2)


@pytest.mark.parametrize(
    "converter",
    [
        {},
        {"reduce_scatter": "fp8", "reduce_scatter_stochastic_rounding": True, "reduce_scatter_error_feedback": True},
    ],
    ids=["fsdp2-reduce-scatter", "fp8-reduce-scatter-sr-ef"],
)
def test_dcp_save_and_resume_is_bitwise(tmp_path, converter) -> None:
    run_on_warm_ranks(_checkpoint_resume, 2, str(tmp_path / "checkpoint"), converter)


def test_fp8_reduce_scatter_trains_like_fsdp2s_and_sends_half_the_bytes() -> None:
    """reduce_scatter="fp8" (E4M3, 1 x 128 blocks) against FSDP2's fp32 reduce-scatter, 4 steps on 2
    ranks: losses within PARITY_RTOL, the bytes comm_stats() counts those of the FP8 rows, at most
    0.53x a bf16 reduce-scatter's."""
    run_on_warm_ranks(_fp8_reduce_scatter, 2)


def test_fp8_reduce_scatter_over_another_comm_is_refused() -> None:
    run_on_warm_ranks(_another_reduce_scatter_is_refused, 2)


@pytest.mark.parametrize(
    ("field", "match"),
    [
        ({"reduce_scatter": "int8"}, r"reduce_scatter='int8'\): use None .* or \"fp8\""),
        (
            {"reduce_scatter_dtype": "float8_e4m3fnuz"},
            r"reduce_scatter_dtype='float8_e4m3fnuz'\): use \"float8_e4m3fn\"",
        ),
        ({"reduce_scatter_block_size": 256}, r"reduce_scatter_block_size=256\): block_size 256 is larger"),
        (
            {"reduce_scatter_block_size": 48},
            r"reduce_scatter_block_size=48\): block_size must be .*\(16, 32, 64 or 128\)",
        ),
    ],
    ids=["kind", "dtype", "block-too-large", "block-not-dividing-128"],
)
def test_bad_reduce_scatter_fields_are_refused_when_the_converter_is_built(field, match) -> None:
    from quant_fsdp.torchtitan import QuantLinearConverter

    options = {"reduce_scatter": "fp8", **field}
    with pytest.raises(ValueError, match=match):
        QuantLinearConverter.Config(**options).build()


def test_hugging_face_export_loads_strictly_into_llama() -> None:
    pytest.importorskip("transformers")
    run_on_warm_ranks(_hugging_face_export, 2)


def test_torch_adamw_on_quantized_weights_is_refused() -> None:
    run_on_warm_ranks(_adamw_refuses_quantized_weights, 2)


def test_unknown_recipe_names_the_choices() -> None:
    from quant_fsdp.torchtitan import QuantLinearConverter

    with pytest.raises(ValueError, match="recipe_name='fp9'.*choose one of fp8, fp8-delayed, mxfp8, fp8-block, nvfp4"):
        QuantLinearConverter.Config(recipe_name="fp9").build()


def _debug_llama_on_cpu(**converter: object) -> torch.nn.Module:
    """torchtitan's debug llama3 (one layer) with our converter, built and initialised on the CPU, unsharded."""
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import model_registry

    from quant_fsdp.torchtitan import QuantLinearConverter

    spec = model_registry("debugmodel", converters=[QuantLinearConverter.Config(**converter)])
    spec.model.layers = spec.model.layers[:1]
    spec.model.layers[0].attention.inner_attention = ScaledDotProductAttention.Config()
    torch.manual_seed(0)
    model = spec.model.build()
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model


@pytest.mark.parametrize("recipe", ["fp8", "fp8-block", "nvfp4"])
def test_rowwise_only_weights_hold_no_columnwise_data_and_train_alike(recipe) -> None:
    from quant_fsdp.torchtitan import QuantLinear

    tokens = torch.randint(0, VOCAB, (BATCH, SEQUENCE), generator=torch.Generator().manual_seed(0))
    gradients = []
    for on_demand in (False, True):
        model = _debug_llama_on_cpu(recipe_name=recipe, quantized_weights=True, weight_columnwise_on_demand=on_demand)
        layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
        assert layers
        assert all((m.weight.columnwise_data is None) == on_demand for m in layers)
        model(tokens).float().square().mean().backward()
        gradients.append({n: p.grad for n, p in model.named_parameters()})
    # the dgrad operand derived from rowwise data is the columnwise data bit for bit
    assert gradients[0].keys() == gradients[1].keys()
    for name, grad in gradients[0].items():
        torch.testing.assert_close(gradients[1][name], grad, rtol=0, atol=0, msg=name)


def test_rowwise_only_weights_are_refused_for_mxfp8_naming_the_recipes_that_take_them() -> None:
    from quant_fsdp.torchtitan import QuantLinearConverter

    with pytest.raises(ValueError, match=r"weight_columnwise_on_demand=True\).*fp8, fp8-delayed, fp8-block, nvfp4"):
        QuantLinearConverter.Config(recipe_name="mxfp8", weight_columnwise_on_demand=True).build()


def test_unquantizable_linear_stays_high_precision_with_one_warning() -> None:
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.llama3 import model_registry

    from quant_fsdp.torchtitan import QuantLinear, QuantLinearConverter

    config = model_registry("debugmodel").model
    config.layers = config.layers[:LAYERS]
    config.layers[0].feed_forward.w2 = dataclasses.replace(config.layers[0].feed_forward.w2, in_features=700)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        converted = QuantLinearConverter.Config(recipe_name="fp8-block").build().convert(config)
    messages = [str(w.message) for w in caught if "QuantLinearConverter" in str(w.message)]
    assert len(messages) == 1, messages
    assert "layers.0.feed_forward.w2 (256 x 700)" in messages[0]
    assert type(converted.layers[0].feed_forward.w2) is Linear.Config
    assert type(converted.layers[1].feed_forward.w2) is QuantLinear.Config
    assert type(converted.lm_head) is Linear.Config  # filter_fqns' default


def test_torchao_float8_converter_and_ours_are_refused() -> None:
    pytest.importorskip("torchao")
    from torchtitan.components.quantization import Float8LinearConverter
    from torchtitan.models.llama3 import model_registry

    from quant_fsdp.torchtitan import QuantLinearConverter

    float8 = Float8LinearConverter.Config(emulate=True)
    with pytest.raises(ValueError, match="List only QuantLinearConverter.Config in `converters`"):
        model_registry("debugmodel", converters=[float8, QuantLinearConverter.Config()])


def test_torchao_float8_converter_after_ours_is_refused_after_the_optimizer_build() -> None:
    pytest.importorskip("torchao")
    from torchtitan.components.quantization import Float8LinearConverter
    from torchtitan.models.llama3 import model_registry

    from quant_fsdp.torchtitan import QuantLinearConverter
    from quant_optim.torchtitan import with_quantized_training_checks

    # Ours leaves lm_head in high precision (filter_fqns' default); torchao's then converts it.
    float8 = Float8LinearConverter.Config(emulate=True)
    spec = with_quantized_training_checks(
        model_registry("debugmodel", converters=[QuantLinearConverter.Config(), float8])
    )
    spec.model.layers = spec.model.layers[:LAYERS]
    with torch.device("meta"):
        model = spec.model.build()
    with pytest.raises(ValueError, match=r"torchtitan's own quantized Linears \(lm_head \(Float8Linear\)\) next to"):
        spec.post_optimizer_build_fn([], [model], None)
