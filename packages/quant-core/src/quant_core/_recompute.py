"""Quantize ops that torch.compile's partitioner recomputes in the backward instead of saving.

[Note: recomputed quantizations] A compiled training step keeps, from forward to backward, what
its backward reads and the partitioner chose to save rather than recompute. The partitioner
recomputes only ops it knows (aten's pointwise ops, views, ...): a custom op's outputs are saved.
A quantized Linear's backward reads the codes of its input (wgrad), so a compiled layer would save
the FP8 codes of every Linear input on top of the high-precision tensors it saves anyway (the
norm's input, attention's output, the MLP's gate and up outputs, from which the Linear inputs
are recomputed): per decoder layer of the 2.2B Llama, 104 MiB that torchao, whose casts are aten
ops, does not hold. Likewise a weight gathered by FSDP2 arrives rowwise only, and the forward
derives its columnwise (transposed) bytes for the backward's dgrad: saved, they would hold a byte
per weight element of every layer from its forward to its backward, where the gathered weight
itself costs nothing to save (FSDP2 frees it after the forward and refills the same storage for
the backward); recomputed, the backward transposes its own gather. Ops defined `recomputable`
(the quantizes, `transpose_bytes`, `transpose_nvfp4`) are tagged as selective activation checkpointing
tags its region (`CheckpointPolicy.PREFER_RECOMPUTE`, node meta "recompute"), so their outputs are
recomputed from their inputs in the backward: one or two more reads of a tensor that is alive
anyway. Of a quantize traced into several kernels, the ones that make only scalars (an amax, a
scale) are not tagged: their few bytes are saved, and the backward recomputes only the cast.

Only a pure call is tagged: every buffer it writes must have been allocated in the graph for it
(an `empty`, possibly viewed), which the tag covers too. A call that writes a graph input (a
module buffer: an amax history) keeps its outputs saved, as it would be unsafe to run twice. A
region the user tagged already (their own activation checkpointing) keeps the user's tags.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.fx.experimental.proxy_tensor import get_proxy_mode
from torch.utils.checkpoint import CheckpointPolicy

_ALLOCATIONS = frozenset({torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default})
_VIEWS = frozenset(
    {torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default, torch.ops.aten.as_strided.default}
)


@contextlib.contextmanager
def prefer_recompute(args: Sequence[Any], mutated_positions: Sequence[int]) -> Iterator[None]:
    """Tags the graph nodes that the traced call inside the block creates, and the allocations of
    the buffers it writes, to be recomputed in the backward ([Note: recomputed quantizations])."""
    proxy_mode = get_proxy_mode()
    if proxy_mode is None:
        yield
        return
    graph = proxy_mode.tracer.graph
    allocations = _fresh_allocations(proxy_mode, args, mutated_positions)
    count = len(graph.nodes)
    yield
    if allocations is None:
        return
    created = list(itertools.islice(reversed(graph.nodes), len(graph.nodes) - count))
    for node in itertools.chain(created, allocations):
        if not _only_scalars(node):
            node.meta.setdefault("recompute", CheckpointPolicy.PREFER_RECOMPUTE)


# A traced Triton quantize is several nodes: per-tensor FP8's amax launch (partial amaxes), scale
# launch (0-d scale and inverse) and cast launch. Only the cast is worth recomputing: the amax
# reads the whole input again for a few bytes that cost nothing to save. Nodes whose outputs are
# all this small are left untagged, and the partitioner saves what the backward needs of them
# (it recomputes no untagged custom kernel).
_SCALARS = 4096


def _only_scalars(node: Any) -> bool:
    """Whether every tensor `node` produces has at most _SCALARS elements (amaxes, scales)."""
    value = node.meta.get("val")
    values = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else (value,)
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    return bool(tensors) and all(t.numel() <= _SCALARS for t in tensors)


def _fresh_allocations(proxy_mode: Any, args: Sequence[Any], positions: Sequence[int]) -> list[Any] | None:
    """The nodes that allocated (and viewed) each written buffer, or None if one of them is not a
    fresh allocation (a graph input, or a tensor computed earlier)."""
    nodes = []
    for position in positions:
        buffers = args[position] if isinstance(args[position], list) else [args[position]]
        for buffer in buffers:
            if buffer is None:
                continue
            node = _node_of(proxy_mode, buffer)
            while node is not None and node.target in _VIEWS:
                nodes.append(node)
                node = node.args[0]
            if node is None or node.target not in _ALLOCATIONS:
                return None
            nodes.append(node)
    return nodes


def _node_of(proxy_mode: Any, tensor: torch.Tensor) -> Any:
    """The graph node that produced `tensor` (a FunctionalTensor's current value), or None."""
    inner = torch._from_functional_tensor(tensor.elem) if hasattr(tensor, "elem") else tensor
    tracked = proxy_mode.tracer.tensor_tracker.get(inner)
    return None if tracked is None else tracked.proxy.node
