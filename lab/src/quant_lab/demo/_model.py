"""The demo's model, task and training loop: a small transformer, a Markov next-token task, fp32
master weights for plain torch optimizers, and the training loop.

`quant-fsdp demo` trains TinyTransformer on MarkovTask; tests train it to compare recipes with
bf16; the e2e benchmarks (benchmarks/e2e.py, benchmarks/multi_gpu.py) train their decoder on MarkovTask.
The task: token sequences from a fixed random Markov chain in which each token has 4 likely
successors, so a model can learn it and its loss has a known floor (the chain's entropy). Every
run with the same seeds sees the same initial weights and the same batches.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

import quant_tensors as qt


@dataclass(frozen=True, kw_only=True)
class TransformerConfig:
    """Sizes of TinyTransformer (every Linear dim a multiple of 128, so every recipe quantizes it)."""

    vocab: int = 256
    """Tokens in the vocabulary (also the LM head's out_features)."""
    hidden: int = 256
    """Model width."""
    layers: int = 4
    """Transformer blocks."""
    heads: int = 4
    """Attention heads."""
    sequence: int = 64
    """Tokens per sequence."""


class _Block(torch.nn.Module):
    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        h = config.hidden
        self.heads = config.heads
        self.attention_norm = torch.nn.LayerNorm(h)
        self.qkv = torch.nn.Linear(h, 3 * h)
        self.proj = torch.nn.Linear(h, h)
        self.mlp_norm = torch.nn.LayerNorm(h)
        self.fc1 = torch.nn.Linear(h, 4 * h)
        self.fc2 = torch.nn.Linear(4 * h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, sequence, hidden = x.shape
        q, k, v = self.qkv(self.attention_norm(x)).split(hidden, dim=-1)
        heads = lambda t: t.reshape(batch, sequence, self.heads, -1).transpose(1, 2)  # noqa: E731
        attention = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
        x = x + self.proj(attention.transpose(1, 2).reshape(batch, sequence, hidden))
        return x + self.fc2(F.gelu(self.fc1(self.mlp_norm(x))))


class TinyTransformer(torch.nn.Module):
    """A decoder-only transformer: embeddings, pre-norm blocks, an untied LM head."""

    def __init__(self, config: TransformerConfig | None = None) -> None:
        super().__init__()
        self.config = config = config or TransformerConfig()
        self.embedding = torch.nn.Embedding(config.vocab, config.hidden)
        self.position = torch.nn.Embedding(config.sequence, config.hidden)
        self.blocks = torch.nn.ModuleList(_Block(config) for _ in range(config.layers))
        self.norm = torch.nn.LayerNorm(config.hidden)
        self.head = torch.nn.Linear(config.hidden, config.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embedding(tokens) + self.position(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class MarkovTask:
    """Token sequences from a fixed random Markov chain with `successors` likely next tokens per token.

    A model can learn it (a next-token table), and its loss has a known floor (`entropy`). The
    batch of step `s` depends on `s` and `seed` only, so every run with the same seeds sees the same
    batches. It scales to a 32000-token vocabulary (the e2e benchmark): successors are
    drawn with replacement, and the sequences of many steps are generated together.
    """

    def __init__(self, vocab: int = 256, successors: int = 4, seed: int = 0, states: int | None = None) -> None:
        """`states`: how many token ids the chain visits (default: all `vocab`), chosen at random.
        Fewer states make a task a model learns in fewer steps, with logits over the whole vocabulary."""
        if states is not None and not 1 <= states <= vocab:
            raise ValueError(f"states must be between 1 and vocab={vocab}, got {states}")
        generator = torch.Generator().manual_seed(seed)
        self.vocab = vocab
        # Drawn in this order (successors, probabilities, visited ids): the same seed, the same chain.
        successors_of = torch.randint(vocab if states is None else states, (vocab, successors), generator=generator)
        self.probabilities = torch.softmax(torch.randn(vocab, successors, generator=generator), dim=-1)
        self.state_ids = torch.arange(vocab) if states is None else torch.randperm(vocab, generator=generator)[:states]
        self.next_tokens = self.state_ids[successors_of]  # token id -> its successors' token ids
        self._cumulative = self.probabilities.cumsum(dim=-1)

    def entropy(self) -> float:
        """The loss floor: the chain's mean conditional entropy over its states (nats per token)."""
        # Successors drawn twice for a token add their probabilities: sum_j p_j log P(next_j) sums
        # P log P over the distinct next tokens.
        next_tokens, probabilities = self.next_tokens[self.state_ids], self.probabilities[self.state_ids]
        same = next_tokens[:, :, None] == next_tokens[:, None, :]
        merged = (same * probabilities[:, None, :]).sum(-1)
        return float(-(probabilities * merged.log()).sum(-1).mean())

    def batches(self, steps: range, batch_size: int, sequence: int) -> torch.Tensor:
        """Token ids of shape (len(steps), batch_size, sequence + 1), on the CPU: step s's inputs
        are `[s, :, :-1]`, its targets `[s, :, 1:]`."""
        draws = torch.stack(
            [
                torch.rand(batch_size, sequence + 1, generator=torch.Generator().manual_seed(1_000_003 * (s + 1)))
                for s in steps
            ]
        ).flatten(0, 1)
        tokens = torch.empty(draws.shape, dtype=torch.long)
        num_states = len(self.state_ids)
        tokens[:, 0] = self.state_ids[(draws[:, 0] * num_states).long().clamp_(max=num_states - 1)]
        last = self.next_tokens.shape[1] - 1
        for t in range(sequence):  # inverse-CDF sampling of each token's successor
            choice = (draws[:, t + 1, None] > self._cumulative[tokens[:, t]]).sum(-1).clamp_(max=last)
            tokens[:, t + 1] = self.next_tokens[tokens[:, t], choice]
        return tokens.view(len(steps), batch_size, sequence + 1)

    def batch(self, step: int, batch_size: int, sequence: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of step `step`: `batches(range(step, step + 1), ...)` split."""
        tokens = self.batches(range(step, step + 1), batch_size, sequence)[0]
        return tokens[:, :-1], tokens[:, 1:]


class MasterWeights:
    """fp32 master copies of a model's quantized parameters, for a plain torch optimizer.

    `step` moves each quantized parameter's gradient to its master, steps the optimizer over the
    masters, then requantizes each parameter with `p.copy_(master)`
    (quant-optim's FusedAdam does this fused; this is the reference path). Parameters may be
    QuantizedTensors or FSDP2's DTensors of QuantizedTensor shards (masters are then DTensors too).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.pairs: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        self.parameters: list[torch.Tensor] = []
        for p in model.parameters():
            if qt.local_quantized(p) is not None:
                initial = qt.high_precision_init_value(p)
                master = (_dequantized(p) if initial is None else initial).float().clone().requires_grad_(True)
                self.pairs.append((p, master))
                self.parameters.append(master)
            else:
                self.parameters.append(p)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        for p, master in self.pairs:  # the gradient moves to the master
            master.grad = None if p.grad is None else p.grad.float()
            p.grad = None
        optimizer.step()
        with torch.no_grad():
            for p, master in self.pairs:
                p.copy_(master)


def adamw(parameters: Iterable[torch.Tensor], *, lr: float, weight_decay: float = 0.0) -> torch.optim.AdamW:
    """torch's AdamW, with foreach ops (one call per op over every parameter, the same results as
    its loop over parameters, where under FSDP2 each op dispatches through DTensor once per
    parameter) unless DTensors and plain tensors mix, which foreach ops refuse (tensor parallelism
    leaves some parameters unsharded)."""
    parameters = list(parameters)
    uniform = len({isinstance(p, DTensor) for p in parameters}) <= 1
    return torch.optim.AdamW(parameters, lr=lr, weight_decay=weight_decay, foreach=uniform)


def _dequantized(p: torch.Tensor) -> torch.Tensor:
    return qt.shard_like(p, qt.local_quantized(p).dequantize())


def train(
    model: torch.nn.Module,
    task: MarkovTask,
    *,
    steps: int | range,
    batch_size: int = 8,
    optimizer: torch.optim.Optimizer | None = None,
    lr: float = 1e-3,
    batch_slice: tuple[int, int] = (0, 1),
    group: dist.ProcessGroup | None = None,
    on_step: Callable[[int, float], None] | None = None,
) -> list[float]:
    """Trains `model` on `task`; returns the global batch's loss of every step.

    One step: this rank's slice of the step's global batch -> forward -> cross-entropy over fp32
    logits -> backward -> optimizer step -> the loss recorded.

    Args:
        steps: how many steps (steps 0 to steps - 1), or a range of steps (a resumed run goes on
            with `range(first, last)`); step s trains on the task's batch s.
        optimizer: stepped as given (e.g. quant_optim.FusedAdam, which keeps its own masters);
            default: AdamW (`lr`, no weight decay) over a new MasterWeights(model).
        batch_slice: (i, n): train on slice i of n of every global batch (data parallelism; cut
            by `torch.chunk`, so the last slice is smaller where n does not divide batch_size);
            with n > 1 the recorded loss is the mean of the n slices' losses, all-reduced over
            `group` (default: all ranks; pass the data-parallel group when other ranks hold the
            same slice).
        on_step: called with the step and its recorded loss after each step.
    """
    index, num_slices = batch_slice
    if optimizer is None:
        masters = MasterWeights(model)
        optimizer = adamw(masters.parameters, lr=lr)
        step_optimizer = functools.partial(masters.step, optimizer)
    else:
        step_optimizer = optimizer.step
    steps = range(steps) if isinstance(steps, int) else steps
    sequence = model.config.sequence if hasattr(model, "config") else 64
    device = next(model.parameters()).device  # the task's batches are drawn on the CPU
    batches = task.batches(steps, batch_size, sequence)
    losses = []
    for step, tokens in zip(steps, batches, strict=True):
        tokens = tokens.chunk(num_slices)[index].to(device)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        step_optimizer()
        mean = loss.detach()
        if num_slices > 1:
            mean = mean.clone()
            dist.all_reduce(mean, group=group)
        losses.append((mean / num_slices).item())
        if on_step is not None:
            on_step(step, losses[-1])
    return losses
