"""quant_fsdp.gather_along_first_dim on 2 and 4 gloo ranks, every recipe ([Note: sequence gather]):
the result equals quantizing the high-precision concatenation bit for bit, on the fast path (only
quantized bytes travel) and on the fallback (shapes the blocks do not divide, unequal shards,
already quantized inputs with disagreeing scales); plain tensors gather exactly; async equals sync."""

from __future__ import annotations

import copy
import datetime

import pytest
import torch
import torch.distributed as dist

import quant_fsdp
import quant_tensors as qt
from quant_core.testing import raw_bits
from quant_lab.testing import SharedWorld, count_all_gather_bytes, run_on_warm_ranks, run_shared_world

RECIPES = ("fp8", "fp8-delayed", "mxfp8", "fp8-block", "nvfp4")


def local_input(rows: int, cols: int, rank: int, *, dtype=torch.bfloat16) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 + rank)
    return (torch.randn(rows, cols, generator=generator) * (1 + rank)).to(dtype)


def everyone(x: torch.Tensor, world_size: int) -> list[torch.Tensor]:
    """Every rank's x (sizes may differ), by a plain object gather (independent of the code under test)."""
    gathered: list[torch.Tensor | None] = [None] * world_size
    dist.all_gather_object(gathered, x)
    return gathered


def assert_same_quantization(got: qt.QuantizedTensor, want: qt.QuantizedTensor, label: str) -> None:
    assert type(got) is type(want), label
    assert got.shape == want.shape, label
    for name, buffer in want.buffers().items():
        other = got.buffers()[name]
        assert (other is None) == (buffer is None), (label, name)
        if buffer is not None:
            assert torch.equal(raw_bits(other.reshape(-1)), raw_bits(buffer.reshape(-1))), (label, name)


def check(x: torch.Tensor, quantizer, world_size: int, label: str, *, expect_fallback: bool) -> None:
    expected_quantizer = copy.deepcopy(quantizer)  # the same history (delayed scaling)
    high_precision = x.dequantize() if isinstance(x, qt.QuantizedTensor) else x
    full = torch.cat(everyone(high_precision.contiguous(), world_size))
    want = expected_quantizer.quantize(full)
    quant_fsdp.reset_comm_stats()
    for async_op in (False, True):
        got, handle = quant_fsdp.gather_along_first_dim(
            x, dist.group.WORLD, quantizer=copy.deepcopy(quantizer), async_op=async_op
        )
        assert (handle is not None) == async_op
        if handle is not None:
            handle.wait()
        if isinstance(x, qt.QuantizedTensor) and not expect_fallback:  # the inputs' own codes and scales
            assert torch.equal(got.dequantize(), full), label
        else:
            assert_same_quantization(got, want, f"{label} async={async_op}")
    stats = quant_fsdp.comm_stats()[quantizer.format_name]
    if expect_fallback:
        assert stats["quantized"] == 0, (label, stats)
        assert stats["fallback"] > 0, (label, stats)
    else:
        assert stats["fallback"] == 0, (label, stats)
        quantized = copy.deepcopy(quantizer).quantize(x.contiguous()) if not isinstance(x, qt.QuantizedTensor) else x
        # Bytes on the wire: the data and non-scalar scales of the gathered usages, world times.
        names = [n for n, b in quantized.buffers().items() if b is not None and b.dim() > 0]
        if quantizer.can_derive_columnwise:
            names = [n for n in names if n.startswith("rowwise")]
        per_call = world_size * sum(
            quantized.buffers()[n].numel() * quantized.buffers()[n].element_size() for n in names
        )
        assert stats["quantized"] == 2 * per_call, (label, stats, per_call)


def _gathers(rank: int, world_size: int) -> None:
    for recipe_name in RECIPES:
        quantizer = qt.recipe_from_name(recipe_name).quantizer("input")
        x = local_input(128, 256, rank)
        check(x, quantizer, world_size, f"{recipe_name} aligned", expect_fallback=False)
        check(
            local_input(256, 128, rank).t(),
            quantizer,
            world_size,
            f"{recipe_name} non-contiguous",
            expect_fallback=False,
        )
        # 100 rows: not a multiple of the blocks (or of FP8's GEMM multiple of 16) in any format
        check(local_input(100, 256, rank), quantizer, world_size, f"{recipe_name} 100 rows", expect_fallback=True)
        rows = 0 if rank == world_size - 1 else 64
        check(
            local_input(rows, 256, rank),
            quantizer,
            world_size,
            f"{recipe_name} empty on one rank",
            expect_fallback=True,
        )
        # Already quantized: the codes travel when the ranks' per-tensor values agree (block formats,
        # delayed scaling's shared history); current-scaling FP8 and NVFP4 scale by the local amax.
        already = copy.deepcopy(quantizer).quantize(x)
        check(
            already,
            quantizer,
            world_size,
            f"{recipe_name} already quantized",
            expect_fallback=recipe_name in ("fp8", "nvfp4"),
        )
        # Quantized in another encoding (FP8 E5M2 vs E4M3, 2-D tiles vs 1-D blocks): the fallback.
        other_role = {"fp8": "grad_output", "fp8-delayed": "grad_output", "fp8-block": "weight", "nvfp4": "weight"}
        if recipe_name in other_role:
            other = qt.recipe_from_name(recipe_name).quantizer(other_role[recipe_name]).quantize(x)
            check(other, quantizer, world_size, f"{recipe_name} other encoding", expect_fallback=True)
    # Without a quantizer: a plain gather, for equal and unequal shards.
    for rows in (8, 3 + rank):
        x = local_input(rows, 5, rank, dtype=torch.float32)
        got, _ = quant_fsdp.gather_along_first_dim(x, dist.group.WORLD)
        assert torch.equal(got, torch.cat(everyone(x, world_size)))


@pytest.mark.parametrize("world_size", [2, 4])
def test_gather_along_first_dim_equals_quantizing_the_concatenation(world_size, request):
    request.getfixturevalue(f"world_{world_size}").check("gathers")


def _hadamard_gathers(rank: int, world_size: int) -> None:
    # NVFP4 with the random Hadamard transform: the fast path agrees on both amaxes (amax(x) and
    # amax(T(x^T)); the ranks' differ, x scaled by 1 + rank) and equals quantizing the concatenation.
    quantizer = qt.NVFP4BlockScaling(random_hadamard_transform=True, hadamard_seed=5).quantizer("input")
    x = local_input(128, 256, rank)
    check(x, quantizer, world_size, "nvfp4 rht aligned", expect_fallback=False)
    check(local_input(256, 128, rank).t(), quantizer, world_size, "nvfp4 rht non-contiguous", expect_fallback=False)
    # 104 rows split runs of 16 (fallback); the concatenation's rows are a multiple of 16 again.
    check(local_input(104, 256, rank), quantizer, world_size, "nvfp4 rht 104 rows", expect_fallback=True)
    # Quantized already: the ranks' amaxes differ, so the fallback; and without the transform, another encoding.
    check(copy.deepcopy(quantizer).quantize(x), quantizer, world_size, "nvfp4 rht already", expect_fallback=True)
    plain = qt.NVFP4BlockScaling().quantizer("input").quantize(x)
    check(plain, quantizer, world_size, "nvfp4 rht from plain", expect_fallback=True)


def test_hadamard_transformed_gathers_agree_on_both_amaxes(world_2):
    world_2.check("nvfp4 rht gathers")


def _mxfp8_unquantizable_sequence(rank: int, world_size: int) -> None:
    # 7984 x 1024 on 2 ranks: 3992 rows per rank, not a multiple of MXFP8's 32-row columnwise blocks.
    quantizer = qt.MXFP8BlockScaling().quantizer("input")
    check(local_input(3992, 1024, rank), quantizer, world_size, "mxfp8 7984x1024", expect_fallback=True)


def test_mxfp8_sequence_the_blocks_do_not_divide_falls_back(world_2):
    world_2.check("mxfp8 sequence")


def _reduce_scatter(rank: int, world_size: int) -> None:
    x = local_input(4 * world_size, 6, rank, dtype=torch.float32)
    total = torch.stack(everyone(x, world_size)).sum(0)  # same order of addition for 2 ranks; see below
    for async_op in (False, True):
        out, handle = quant_fsdp.reduce_scatter_along_first_dim(x, dist.group.WORLD, async_op=async_op)
        if handle is not None:
            handle.wait()
        # Summation order is the collective's: exact on 2 ranks, within fp32 rounding on more.
        torch.testing.assert_close(out, total[4 * rank : 4 * (rank + 1)], rtol=1e-6, atol=1e-6)
        if world_size == 2:
            assert torch.equal(out, total[4 * rank : 4 * (rank + 1)])
    with pytest.raises(ValueError, match=f"splits dim 0 evenly over {world_size} ranks.*pad dim 0"):
        quant_fsdp.reduce_scatter_along_first_dim(torch.zeros(4 * world_size + 1, 2), dist.group.WORLD)
    with pytest.raises(TypeError, match="sums in high precision"):
        quant_fsdp.reduce_scatter_along_first_dim(qt.Float8CurrentScaling().quantizer("input").quantize(x), None)


@pytest.mark.parametrize("world_size", [2, 4])
def test_reduce_scatter_along_first_dim(world_size, request):
    request.getfixturevalue(f"world_{world_size}").check("reduce-scatter")


def _async_gathers_return_before_the_peers_send(rank: int, world_size: int) -> None:
    """Rank 0 issues two async gathers (a quantized one and a fallback) and only then lets the
    other ranks send their shards (over a side group): its calls must have returned without any
    peer data, i.e. nothing is read before wait(). Both are in flight at once; waited in reverse
    order they equal the synchronous results."""
    from quant_fsdp import _sequence

    side = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=60))  # a sync gather deadlocks: fail
    quantizer = qt.MXFP8BlockScaling().quantizer("input")
    inputs = [local_input(64, 256, rank), local_input(100, 256, rank)]  # 100 rows: the fallback
    sync = [quant_fsdp.gather_along_first_dim(x, None, quantizer=copy.deepcopy(quantizer))[0] for x in inputs]

    def after_rank_0_returned(payload):
        def held_back(*args, **kwargs):
            dist.broadcast(torch.zeros(1), src=0, group=side)  # rank 0's "my async call returned"
            return payload(*args, **kwargs)

        return held_back

    originals = _sequence._gather_quantized, _sequence._gather_high_precision
    if rank > 0:
        _sequence._gather_quantized = after_rank_0_returned(_sequence._gather_quantized)
        _sequence._gather_high_precision = after_rank_0_returned(_sequence._gather_high_precision)
    pending = []
    for x in inputs:
        pending.append(quant_fsdp.gather_along_first_dim(x, None, quantizer=copy.deepcopy(quantizer), async_op=True))
        if rank == 0:
            dist.broadcast(torch.zeros(1), src=0, group=side)
    for _, handle in reversed(pending):
        handle.wait()
        handle.wait()  # a second wait is a no-op
    _sequence._gather_quantized, _sequence._gather_high_precision = originals  # for the world's next scenarios
    for (out, _), want in zip(pending, sync, strict=True):
        assert_same_quantization(out, want, f"rank {rank}")


@pytest.mark.parametrize("world_size", [2, 4])
def test_async_gathers_read_nothing_before_wait(world_size, request):
    request.getfixturevalue(f"world_{world_size}").check("async gathers")


def _coalesced_gathers(rank: int, world_size: int) -> None:
    """gather_many_along_first_dim: each result equals gathering that tensor alone, with one
    exchange for all of them instead of one each (collectives counted)."""
    fp8, mxfp8, block = (qt.recipe_from_name(n).quantizer("input") for n in ("fp8", "mxfp8", "fp8-block"))
    nvfp4 = qt.NVFP4BlockScaling().quantizer("input")
    xs = [
        local_input(64, 256, rank),  # MXFP8, quantized bytes
        local_input(64, 256, rank).t(),  # FP8 (the group's amax), non-contiguous
        local_input(100, 256, rank),  # blockwise: 100 rows, the fallback
        local_input(3 + rank, 5, rank, dtype=torch.float32),  # plain, unequal rows
        copy.deepcopy(nvfp4).quantize(local_input(64, 256, rank)),  # already quantized, local amaxes differ
    ]
    quantizers = [mxfp8, fp8, block, None, None]
    with count_all_gather_bytes() as alone:
        want = [
            quant_fsdp.gather_along_first_dim(x, None, quantizer=copy.deepcopy(q))[0]
            for x, q in zip(xs, quantizers, strict=True)
        ]
    for async_op in (False, True):
        with count_all_gather_bytes() as together:
            got, handle = quant_fsdp.gather_many_along_first_dim(
                xs, None, quantizers=[copy.deepcopy(q) for q in quantizers], async_op=async_op
            )
            if handle is not None:
                handle.wait()
        assert together.calls == alone.calls - (len(xs) - 1), (alone.calls, together.calls)
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            if isinstance(b, qt.QuantizedTensor):
                assert_same_quantization(a, b, f"tensor {i} async={async_op}")
            else:
                assert torch.equal(a, b), i
    with pytest.raises(ValueError, match="got 2 tensors but 1 quantizers"):
        quant_fsdp.gather_many_along_first_dim(xs[:2], None, quantizers=[fp8])


@pytest.mark.parametrize("world_size", [2, 4])
def test_coalesced_gathers_equal_gathering_each_alone(world_size, request):
    request.getfixturevalue(f"world_{world_size}").check("coalesced gathers")


def _world_size_1(rank: int, world_size: int) -> None:
    """One rank: no collective; a plain input is quantized, an input already quantized alike is
    returned as it is, one in another encoding is requantized."""
    quantizer = qt.MXFP8BlockScaling().quantizer("input")
    x = local_input(64, 256, rank)
    with count_all_gather_bytes() as counter:
        got, handle = quant_fsdp.gather_along_first_dim(x, None, quantizer=copy.deepcopy(quantizer), async_op=True)
        handle.wait()
        assert_same_quantization(got, copy.deepcopy(quantizer).quantize(x), "plain")
        already = copy.deepcopy(quantizer).quantize(x)
        assert quant_fsdp.gather_along_first_dim(already, None, quantizer=quantizer)[0] is already
        tiles = qt.NVFP4BlockScaling().quantizer("weight").quantize(x)
        nvfp4 = qt.NVFP4BlockScaling().quantizer("input")
        got = quant_fsdp.gather_along_first_dim(tiles, None, quantizer=nvfp4)[0]
        assert_same_quantization(got, qt.NVFP4BlockScaling().quantizer("input").quantize(tiles.dequantize()), "tiles")
    assert counter.calls == 0


def test_world_size_1_only_quantizes():
    run_on_warm_ranks(_world_size_1, 1)


# ---- one world per world size runs every scenario above ([Note: shared worlds] in quant_lab.testing)

SCENARIOS = {
    "gathers": (_gathers, ()),
    "reduce-scatter": (_reduce_scatter, ()),
    "async gathers": (_async_gathers_return_before_the_peers_send, ()),
    "coalesced gathers": (_coalesced_gathers, ()),
}


@pytest.fixture(scope="module")
def world_2() -> SharedWorld:
    return run_shared_world(
        2,
        {
            **SCENARIOS,
            "mxfp8 sequence": (_mxfp8_unquantizable_sequence, ()),
            "nvfp4 rht gathers": (_hadamard_gathers, ()),
        },
    )


@pytest.fixture(scope="module")
def world_4() -> SharedWorld:
    return run_shared_world(4, SCENARIOS)
