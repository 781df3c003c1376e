"""The model of the e2e benchmarks (e2e.py, multi_gpu.py): a Llama-style decoder (its data: quant_lab.demo.MarkovTask).

The decoder is Hugging Face transformers' `LlamaForCausalLM` when transformers imports (a model
nobody in this project wrote, built from `LlamaConfig` with random weights), else `Decoder`
below, the same architecture in plain torch: token embeddings, pre-norm blocks of RMSNorm,
rotary causal self-attention (q/k/v/o projections without bias, SDPA) and a SwiGLU MLP
(gate/up/down projections), a final RMSNorm and an untied `lm_head`. Both name the output layer
`lm_head`, which the benchmark keeps in high precision.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass

import torch
import torch.nn.functional as F

MODEL_SOURCES = ("auto", "transformers", "builtin")


@dataclass(frozen=True, kw_only=True)
class DecoderConfig:
    """Sizes of the e2e decoder and of one training batch."""

    vocab_size: int
    """Tokens in the vocabulary (the lm_head's out_features)."""
    hidden_size: int
    """Model width."""
    intermediate_size: int
    """Width of the SwiGLU MLP."""
    num_layers: int
    """Decoder blocks."""
    num_heads: int
    """Attention heads (as many key/value heads: no grouped-query attention)."""
    sequence_length: int
    """Tokens per sequence."""
    batch_size: int
    """Sequences per step."""

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 2:
            raise ValueError(
                f"hidden_size {self.hidden_size} must split into {self.num_heads} heads of an even size (rotary "
                "embeddings rotate pairs); pick num_heads dividing hidden_size / 2"
            )

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.sequence_length

    @property
    def num_parameters(self) -> int:
        """Parameters of either model: embeddings and lm_head, 4 attention and 3 MLP weights and
        2 norms per layer, the final norm."""
        h, i = self.hidden_size, self.intermediate_size
        return 2 * self.vocab_size * h + self.num_layers * (4 * h * h + 3 * h * i + 2 * h) + h


# The one-GPU model of docs/benchmarks.md (0.67B parameters), its wider variant (~1.2B) and a CPU smoke size.
CONFIGS = {
    "default": DecoderConfig(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=8192,
        num_layers=8,
        num_heads=16,
        sequence_length=2048,
        batch_size=4,
    ),
    "large": DecoderConfig(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=4,
        num_heads=32,
        sequence_length=2048,
        batch_size=4,
    ),
    "tiny": DecoderConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_layers=2,
        num_heads=4,
        sequence_length=64,
        batch_size=2,
    ),
}


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class _Attention(torch.nn.Module):
    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.num_heads = config.num_heads
        self.q_proj = torch.nn.Linear(h, h, bias=False)
        self.k_proj = torch.nn.Linear(h, h, bias=False)
        self.v_proj = torch.nn.Linear(h, h, bias=False)
        self.o_proj = torch.nn.Linear(h, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, sequence, hidden = x.shape

        def heads(y: torch.Tensor) -> torch.Tensor:
            return y.view(batch, sequence, self.num_heads, -1).transpose(1, 2)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(batch, sequence, hidden))


class _MLP(torch.nn.Module):
    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = torch.nn.Linear(h, i, bias=False)
        self.up_proj = torch.nn.Linear(h, i, bias=False)
        self.down_proj = torch.nn.Linear(i, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Block(torch.nn.Module):
    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.input_layernorm = torch.nn.RMSNorm(config.hidden_size, eps=1e-6)
        self.self_attn = _Attention(config)
        self.post_attention_layernorm = torch.nn.RMSNorm(config.hidden_size, eps=1e-6)
        self.mlp = _MLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(torch.nn.Module):
    """A Llama-style decoder in plain torch (see the module docstring); returns logits."""

    def __init__(self, config: DecoderConfig, rope_theta: float = 10000.0) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = torch.nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = torch.nn.ModuleList(_Block(config) for _ in range(config.num_layers))
        self.norm = torch.nn.RMSNorm(config.hidden_size, eps=1e-6)
        self.lm_head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        head_dim = config.hidden_size // config.num_heads
        inverse_frequencies = rope_theta ** -(torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        angles = torch.outer(torch.arange(config.sequence_length, dtype=torch.float32), inverse_frequencies)
        angles = torch.cat((angles, angles), dim=-1)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)
        for module in self.modules():  # Llama's initialisation (transformers: initializer_range 0.02)
            if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
                torch.nn.init.normal_(module.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        sequence = tokens.shape[1]
        cos, sin = self.cos[:sequence], self.sin[:sequence]
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))


def resolve_model_source(source: str) -> str:
    """ "transformers" or "builtin": `auto` picks transformers when it imports."""
    if source not in MODEL_SOURCES:
        raise ValueError(f"model source must be one of {', '.join(MODEL_SOURCES)}, got {source!r}")
    if source == "builtin":
        return source
    try:
        import transformers  # noqa: F401
    except ImportError as error:
        if source == "transformers":
            raise ValueError(
                f"--model transformers: transformers does not import ({error}); pip install transformers"
            ) from error
        return "builtin"
    return "transformers"


def describe_model(source: str) -> str:
    if source == "transformers":
        return f"transformers {importlib.metadata.version('transformers')} LlamaForCausalLM (sdpa)"
    return "built-in Llama-style decoder (benchmarks/_e2e_model.py)"


def build_decoder(
    config: DecoderConfig, device: torch.device, source: str, dtype: torch.dtype = torch.bfloat16
) -> torch.nn.Module:
    """A randomly initialised decoder with `dtype` parameters on `device` (seed the RNG first).

    `source` is "transformers" or "builtin" (see `resolve_model_source`). The model returns
    logits for a (batch, sequence) tensor of token ids: a tensor (built-in) or an output with
    `.logits` (transformers).
    """
    with torch.device(device):
        if source == "transformers":
            from transformers import LlamaConfig, LlamaForCausalLM

            llama = LlamaConfig(
                vocab_size=config.vocab_size,
                hidden_size=config.hidden_size,
                intermediate_size=config.intermediate_size,
                num_hidden_layers=config.num_layers,
                num_attention_heads=config.num_heads,
                num_key_value_heads=config.num_heads,
                max_position_embeddings=config.sequence_length,
                tie_word_embeddings=False,
                use_cache=False,  # training: no key/value cache
                attn_implementation="sdpa",
            )
            model = LlamaForCausalLM(llama)
        else:
            model = Decoder(config)
    return model.to(dtype).train()
