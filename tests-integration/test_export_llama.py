"""A Hugging Face Llama trained sharded with quantized weights exports to the plain
`LlamaForCausalLM` class: `quant_fsdp.export_state_dict` gives exactly its keys, dtypes and shapes,
`load_state_dict(strict=True)` takes it, and greedy generation from it gives the tokens of the
quantized model's own weights, dequantized.

Two gloo ranks, every recipe, both weight modes, sharded per decoder layer and at the root by
`quant_fsdp.fully_shard` (quantized weights also by torch's own `fully_shard`). The expected
weights come from the same model quantized unsharded in the rank's process: a gather equals the
unsharded quantization, so the export must equal its dequantization bit for bit (the
high-precision weights themselves for quantize-on-gather).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import transformers
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import quant_fsdp
import quant_tensors as qt
from quant_lab.testing import run_on_warm_ranks

RECIPES = ("fp8", "fp8-delayed", "mxfp8", "fp8-block", "nvfp4")
# (weights, sharded by): quantized weights by quant_fsdp and by torch's fully_shard, and
# quantize-on-gather by quant_fsdp
VARIANTS = (("quantized", "quant_fsdp"), ("quantized", "torch"), ("high precision", "quant_fsdp"))
CONFIG = {  # 2-rank shards of 128 rows: whole blocks of every format
    "vocab_size": 256,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 64,
}
PROMPT = [[1, 17, 42, 99, 7, 3, 250, 128]]
NEW_TOKENS = 8


def _not_lm_head(module: torch.nn.Module, name: str) -> bool:
    return name != "lm_head"


def _llama() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).eval()


def _dequantized(model: torch.nn.Module, keys: dict) -> dict[str, torch.Tensor]:
    """The unconverted model's entries of a converted model, quantized weights dequantized."""
    state = model.state_dict()
    return {k: state[k].dequantize() if isinstance(state[k], qt.QuantizedTensor) else state[k] for k in keys}


def _generate(model: torch.nn.Module) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor(PROMPT), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    return out[0, len(PROMPT[0]) :].tolist()


def _exports(rank: int, world_size: int) -> None:
    for recipe_name in RECIPES:
        for weights, sharded_by in VARIANTS:
            label = f"{recipe_name}, {weights} weights, sharded by {sharded_by}"
            original = _llama()
            reference = {k: (v.dtype, v.shape) for k, v in original.state_dict().items()}
            recipe = qt.recipe_from_name(recipe_name)
            quantized = weights == "quantized"
            unsharded = qt.convert(
                copy.deepcopy(original), recipe, quantized_weights=quantized, module_filter_fn=_not_lm_head
            )
            expected = _dequantized(unsharded, reference) if quantized else original.state_dict()
            model = qt.convert(
                copy.deepcopy(original), recipe, quantized_weights=quantized, module_filter_fn=_not_lm_head
            )
            for module in (*model.model.layers, model):
                if sharded_by == "torch":
                    torch_fully_shard(module)
                else:
                    quant_fsdp.fully_shard(module, quantize_on_gather=not quantized)
            exported = quant_fsdp.export_state_dict(model)
            if rank != 0:
                assert exported == {}, label
                continue
            assert {k: (v.dtype, v.shape) for k, v in exported.items()} == reference, label
            for key, value in exported.items():
                assert torch.equal(value, expected[key]), (label, key)
            plain = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).eval()
            plain.load_state_dict(exported, strict=True)
            dequantized = copy.deepcopy(original)
            dequantized.load_state_dict(expected, strict=True)
            assert _generate(plain) == _generate(dequantized), label
        dist.barrier()


def test_sharded_quantized_llama_exports_to_the_plain_class_and_generates_alike():
    run_on_warm_ranks(_exports, 2)
