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

import pytest

pytest.importorskip("torchtitan")

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.fsdp import FSDPModule

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


def _build(recipe: str | None, quantized_weights: bool, world_size: int, **converter: object):
    """torchtitan's debug llama3 with our converter (None: without), parallelized by torchtitan."""
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


def _checkpoint_resume(rank: int, world_size: int, folder: str) -> None:
    """DCP save and resume as torchtitan's checkpointer stores them (model state dict from
    get_model_state_dict, the optimizers' flat FQN-keyed state dict): bit for bit."""
    model, _ = _build("fp8", True, world_size)
    optimizer = _optimizer(model)
    _train(model, optimizer, rank, world_size, 2)
    dcp.save({"model": get_model_state_dict(model), "optimizer": optimizer.state_dict()}, checkpoint_id=folder)
    expected = _train(model, optimizer, rank, world_size, 2, first=2)

    resumed, _ = _build("fp8", True, world_size)
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


def test_dcp_save_and_resume_is_bitwise(tmp_path) -> None:
    run_on_warm_ranks(_checkpoint_resume, 2, str(tmp_path / "checkpoint"))


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
