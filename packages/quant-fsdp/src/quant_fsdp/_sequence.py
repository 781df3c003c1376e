"""Sequence-parallel collectives: gather activations along dim 0 in their quantized bytes.

[Note: sequence gather] `gather_along_first_dim(x, group, quantizer=...)` returns the
concatenation along dim 0 of every rank's x, quantized:
1. one small all-gather tells every rank the others' dim-0 sizes and per-tensor values (the
   local amax of a fresh per-tensor quantization, both of NVFP4's with the random Hadamard
   transform, or the per-tensor scales and amaxes of already quantized inputs), so every rank
   takes the same path;
2. fast path, when all shards are equal, quantizable and start on the format's block rows and
   per-tensor scales agree: each rank quantizes its x (per-tensor formats with the group's
   amax) and the data and compact scales of the quantizer's usages are gathered as bytes, the
   rowwise buffers concatenated along dim 0, the columnwise ones (x^T) joined along dim 1, as in
   FSDP2's weight gather ([Note: quantized all-gather] in quant_tensors._fsdp). Per-tensor FP8
   gathers rowwise only and transposes locally. The result equals quantizing the gathered
   high-precision tensor bit for bit;
3. otherwise (fallback): dequantize if needed, gather in high precision (contiguous, padded when
   shards differ in size), quantize the result; logged once per call site, counted in
   `comm_stats()` as "fallback".
Without a quantizer (and for a plain input) it is a high-precision gather. With one rank it only
quantizes. `async_op=True` returns once the payload collectives are issued (step 1 is
synchronous: the path depends on it), with a handle whose `wait()` finishes the collectives and
the post-processing; `out` must not be read before. `gather_many_along_first_dim` coalesces
several gathers: one exchange for all, every payload issued before any wait, one handle.
`reduce_scatter_along_first_dim` is the backward's sum-and-split, in high precision.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Sequence
from types import SimpleNamespace

import torch
import torch.distributed as dist

import quant_tensors as qt
from quant_fsdp._stats import count_gather
from quant_tensors import QuantizedTensor, Quantizer

logger = logging.getLogger("quant_fsdp")
_warned_call_sites: set[tuple[str, int]] = set()

_Issued = tuple[torch.Tensor, list[dist.Work], Callable[[], object]]
"""A started gather: its output, its collectives, and what rebuilds the output once they are done."""


class GatherHandle:
    """Finishes asynchronous gathers: `wait()` waits for their collectives, then post-processes."""

    def __init__(self, works: list[dist.Work], finishes: list[Callable[[], object]]) -> None:
        self._works, self._finishes, self._done = works, finishes, False

    def wait(self) -> None:
        if self._done:
            return
        for work in self._works:
            work.wait()
        for finish in self._finishes:
            finish()
        self._done = True


def gather_along_first_dim(
    x: torch.Tensor, group: dist.ProcessGroup | None, *, quantizer: Quantizer | None = None, async_op: bool = False
) -> tuple[torch.Tensor, GatherHandle | None]:
    """Concatenates every rank's `x` along dim 0, quantized when a quantizer is given or x is
    quantized; see [Note: sequence gather]. Returns (out, handle); handle is None unless
    `async_op`, and then `out` is valid only after `handle.wait()`."""
    (out,), handle = _gather_all([x], [quantizer], group, async_op, _call_site())
    return out, handle


def gather_many_along_first_dim(
    xs: Sequence[torch.Tensor],
    group: dist.ProcessGroup | None,
    *,
    quantizers: Sequence[Quantizer | None] | None = None,
    async_op: bool = False,
) -> tuple[list[torch.Tensor], GatherHandle | None]:
    """`gather_along_first_dim` of several tensors, coalesced: one small exchange for all of them,
    then every payload collective issued before any is waited for, and one handle. Each result
    equals gathering that tensor alone. `quantizers[i]` (None: plain, or xs[i]'s own) goes with xs[i]."""
    xs = list(xs)
    quantizers = [None] * len(xs) if quantizers is None else list(quantizers)
    if len(quantizers) != len(xs):
        raise ValueError(f"gather_many_along_first_dim got {len(xs)} tensors but {len(quantizers)} quantizers")
    return _gather_all(xs, quantizers, group, async_op, _call_site())


def _call_site() -> tuple[str, int]:
    frame = sys._getframe(2)  # the caller of the public function calling this
    return frame.f_code.co_filename, frame.f_lineno


def _gather_all(
    xs: list[torch.Tensor], quantizers: list[Quantizer | None], group, async_op: bool, site: tuple[str, int]
) -> tuple[list[torch.Tensor], GatherHandle | None]:
    for x in xs:
        if not isinstance(x, torch.Tensor) or x.dim() == 0:
            raise ValueError(f"gather_along_first_dim needs tensors with at least one dim, got {type(x).__name__}")
    quantizers = [
        q if q is not None or not isinstance(x, QuantizedTensor) else x.quantizer
        for x, q in zip(xs, quantizers, strict=True)
    ]
    world_size = dist.get_world_size(group)
    if world_size == 1 or not xs:
        outs = [
            x if q is None or _usable_as_is(x, q) else q.quantize(_high_precision(x))
            for x, q in zip(xs, quantizers, strict=True)
        ]
        return outs, (GatherHandle([], []) if async_op else None)
    fresh = [
        q is not None and q.per_tensor_amax and not isinstance(x, QuantizedTensor)
        for x, q in zip(xs, quantizers, strict=True)
    ]
    # A fresh per-tensor quantization's own amaxes (NVFP4 with the random Hadamard transform has
    # two, amax(x) and amax(T(x^T)), both agreed over the group), or a quantized input's values.
    local_values = [
        list(q.local_amax(x).reshape(-1)) if f else _per_tensor_values(x) if isinstance(x, QuantizedTensor) else []
        for x, q, f in zip(xs, quantizers, fresh, strict=True)
    ]
    everyone = _exchange(
        [(x.shape[0], v) for x, v in zip(xs, local_values, strict=True)], xs[0].device, group, world_size
    )
    issued = [_issue(*args, group, world_size, site) for args in zip(xs, quantizers, everyone, fresh, strict=True)]
    handle = GatherHandle([w for _, works, _ in issued for w in works], [finish for _, _, finish in issued])
    outs = [out for out, _, _ in issued]
    if async_op:
        return outs, handle
    handle.wait()
    return outs, None


def _issue(
    x: torch.Tensor, quantizer: Quantizer | None, everyone: torch.Tensor, fresh_per_tensor: bool, group, world_size: int,
    site: tuple[str, int],
) -> _Issued:  # fmt: skip
    """Starts one gather on the path every rank agrees on (see `_fallback_reason`)."""
    rows = [int(r) for r in everyone[:, 0].tolist()]
    if quantizer is None:
        return _gather_high_precision(x.contiguous(), rows, group, None)
    reason = _fallback_reason(x, quantizer, rows, everyone, fresh_per_tensor)
    if reason is not None:
        _log_fallback(quantizer, reason, site)
        return _gather_high_precision(_high_precision(x), rows, group, quantizer)
    if fresh_per_tensor:
        amax = everyone[:, 1:].amax(dim=0).to(device=x.device, dtype=torch.float32)
        x = quantizer.quantize(x.contiguous(), amax=amax)
    elif not isinstance(x, QuantizedTensor):
        x = quantizer.quantize(x.contiguous())
    return _gather_quantized(x, quantizer, group, world_size)


def _all_gather(output: torch.Tensor, input: torch.Tensor, **kwargs) -> dist.Work | None:
    """torch 2.13's all_gather_single (the old name warns there), all_gather_into_tensor before."""
    return getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(output, input, **kwargs)


def _reduce_scatter(output: torch.Tensor, input: torch.Tensor, **kwargs) -> dist.Work | None:
    """torch 2.13's reduce_scatter_single (the old name warns there), reduce_scatter_tensor before."""
    return getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)(output, input, **kwargs)


def _usable_as_is(x: torch.Tensor, quantizer: Quantizer) -> bool:
    """Whether x is already quantized in the quantizer's encoding with every usage it asks for."""
    if not isinstance(x, QuantizedTensor) or not x.quantizer.encodes_like(quantizer):
        return False
    return all(have or not want for have, want in zip(x.usages, quantizer.produced_usages, strict=True))


def _high_precision(x: torch.Tensor) -> torch.Tensor:
    return (x.dequantize() if isinstance(x, QuantizedTensor) else x).contiguous()


def _per_tensor_values(x: QuantizedTensor) -> list[torch.Tensor]:
    """The 0-d buffers of a quantized tensor (its per-tensor scale or amax)."""
    return [b for b in x.buffers().values() if b is not None and b.dim() == 0]


def _exchange(
    entries: list[tuple[int, list[torch.Tensor]]], device: torch.device, group, world_size: int
) -> list[torch.Tensor]:
    """For each (dim-0 size, per-tensor values) entry, every rank's: a (world, 1 + len(values))
    float64 tensor. One all-gather for all entries."""
    widths = [1 + len(values) for _, values in entries]
    mine = torch.tensor(
        [float(v) for rows, values in entries for v in (rows, *values)], dtype=torch.float64, device=device
    )
    everyone = mine.new_empty(world_size * mine.numel())  # concatenated along dim 0, as gloo wants it
    _all_gather(everyone, mine, group=group)
    return list(everyone.view(world_size, -1).cpu().split(widths, dim=1))


def _fallback_reason(
    x: torch.Tensor, quantizer: Quantizer, rows: list[int], everyone: torch.Tensor, fresh_per_tensor: bool
) -> str | None:
    """Why the shards cannot be gathered quantized (the same answer on every rank), or None."""
    if len(set(rows)) > 1:
        return f"dim 0 differs between ranks ({rows})"
    if isinstance(x, QuantizedTensor) and not _usable_as_is(x, quantizer):
        return f"the input ({x.quantizer}, usages {x.usages}) is not in the encoding or lacks the usages of {quantizer}"
    if not quantizer.is_quantizable(x):
        return f"shape {tuple(x.shape)} is not divisible by the {quantizer.format_name} blocks {quantizer.dim_multiple}"
    rows_2d = x.numel() // x.shape[-1]
    if rows_2d % quantizer.row_alignment:
        return f"{rows_2d} rows per rank do not fall on {quantizer.format_name}'s {quantizer.row_alignment}-row blocks"
    if not fresh_per_tensor and everyone.shape[1] > 1 and bool((everyone[:, 1:] != everyone[0, 1:]).any()):
        return "the quantized inputs' per-tensor scales differ between ranks"
    return None


def _log_fallback(quantizer: Quantizer, reason: str, site: tuple[str, int]) -> None:
    if site not in _warned_call_sites:
        _warned_call_sites.add(site)
        logger.warning(
            "gather_along_first_dim at %s:%d gathers in high precision, then quantizes (%s): %s", *site,
            quantizer.format_name, reason,
        )  # fmt: skip


def _gather_high_precision(x: torch.Tensor, rows: list[int], group, quantizer: Quantizer | None) -> _Issued:
    """All-gathers contiguous x along dim 0 (padded to the longest shard when sizes differ); with
    a quantizer (the fallback) the full tensor is quantized into `out` once it has arrived."""
    longest, world_size = max(rows), len(rows)
    padded = x if x.shape[0] == longest else torch.cat([x, x.new_zeros((longest - x.shape[0], *x.shape[1:]))])
    gathered = x.new_empty((world_size * longest, *x.shape[1:]))
    full_shape = (sum(rows), *x.shape[1:])
    if quantizer is not None:
        count_gather(quantizer.format_name, [padded], world_size, quantized=False)
    work = _all_gather(gathered, padded, group=group, async_op=True)

    def full() -> torch.Tensor:
        if len(set(rows)) == 1:
            return gathered
        return torch.cat([gathered[r * longest : r * longest + n] for r, n in enumerate(rows)])

    if quantizer is None:
        out = gathered if len(set(rows)) == 1 else x.new_empty(full_shape)
        return out, [work], lambda: None if out is gathered else out.copy_(full())
    out = quantizer.make_empty(full_shape, dtype=x.dtype, device=x.device)
    return out, [work], lambda: quantizer.quantize_(full(), out)


class _CountedGather(qt.fsdp.ShardContext):
    """What a sequence gather of quantized activations tells `all_gather_inputs`: count the bytes
    in `comm_stats()` (the activation's quantizer keeps no context of its own)."""

    def count_gather(self, format_name: str, inputs, world_size: int) -> None:
        count_gather(format_name, inputs, world_size, quantized=True)


_COUNTED = _CountedGather()


def _gather_quantized(shard: QuantizedTensor, quantizer: Quantizer, group, world_size: int) -> _Issued:
    """The fast path of [Note: sequence gather]: the shard's bytes, rebuilt as in FSDP2's gather."""
    rowwise, columnwise = shard.usages
    derive_columnwise = columnwise and quantizer.can_derive_columnwise
    inputs, payload = qt.fsdp.all_gather_inputs(
        shard, world_size, usages=(rowwise, columnwise and not derive_columnwise), context=_COUNTED
    )
    outputs = [t.new_empty((world_size * t.shape[0], *t.shape[1:])) for t in inputs]
    works = [_all_gather(o, i, group=group, async_op=True) for o, i in zip(outputs, inputs, strict=True)]
    out = quantizer.make_empty((world_size * shard.shape[0], *shard.shape[1:]), dtype=shard.dtype, device=shard.device)

    def finish() -> None:
        qt.fsdp.unsharded_from_gather(SimpleNamespace(), tuple(outputs), payload, shard.dtype, out)
        if derive_columnwise:
            out.update_usage(columnwise=True)

    return out, works, finish


def reduce_scatter_along_first_dim(
    x: torch.Tensor, group: dist.ProcessGroup | None, *, async_op: bool = False
) -> tuple[torch.Tensor, GatherHandle | None]:
    """Sums x over the ranks and gives rank r rows [r * n, (r + 1) * n) of the sum along dim 0
    (n = x.shape[0] / world): the backward of `gather_along_first_dim`, in high precision.
    Returns (out, handle) as the gather does."""
    if isinstance(x, QuantizedTensor):
        raise TypeError(
            "reduce_scatter_along_first_dim sums in high precision; pass x.dequantize() (a sum of quantized "
            "codes has no meaning)"
        )
    world_size = dist.get_world_size(group)
    if x.dim() == 0 or x.shape[0] % world_size:
        raise ValueError(
            f"reduce_scatter_along_first_dim splits dim 0 evenly over {world_size} ranks, but x has shape "
            f"{tuple(x.shape)}; pad dim 0 to a multiple of {world_size}"
        )
    out = x.new_empty((x.shape[0] // world_size, *x.shape[1:]))
    work = _reduce_scatter(out, x.contiguous(), group=group, async_op=True)
    if async_op:
        return out, GatherHandle([work], [])
    work.wait()
    return out, None
