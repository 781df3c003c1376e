"""The FP8 gradient reduce-scatter under HSDP, on 4 gloo ranks (2 replicas x 2 shards).

FSDP2 hands the comm its shard group: each replica quantizes and reduce-scatters within itself,
then FSDP2 all-reduces the shards across replicas in the reduce dtype. When both replicas train
on the same data, that all-reduce averages two equal fp32 shards, which is exact, so every rank's
gradient must equal, bit for bit, what plain FSDP2 over its own shard group (each replica a
2-rank FSDP world) gives with the FP8 reduce-scatter, and the bytes it sends must be the same.
Quantizing across all 4 ranks would cut the gradients into other chunks and blocks and differ.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy

import quant_fsdp
import quant_tensors as qt
from quant_lab.demo import MarkovTask, TinyTransformer, TransformerConfig
from quant_lab.testing import run_on_warm_ranks

CONFIG = TransformerConfig(vocab=128, hidden=128, layers=2, heads=2, sequence=32)
BATCH = 8
REPLICAS, SHARDS = 2, 2


def build(mesh, reduce_scatter) -> TinyTransformer:
    torch.manual_seed(0)
    model = qt.convert(TinyTransformer(CONFIG), qt.recipe_from_name("fp8"), quantized_weights=False)
    policy = MixedPrecisionPolicy(reduce_dtype=torch.float32)
    for block in model.blocks:
        quant_fsdp.fully_shard(block, mesh=mesh, mp_policy=policy, reduce_scatter=reduce_scatter())
    return quant_fsdp.fully_shard(model, mesh=mesh, mp_policy=policy, reduce_scatter=reduce_scatter())


def gradients(model: TinyTransformer, shard_rank: int, step: int) -> dict[str, torch.Tensor]:
    """This rank's gradient shards after one backward on the shard's slice of step `step`'s batch:
    the same slice on both replicas."""
    inputs, targets = (
        t.chunk(SHARDS)[shard_rank] for t in MarkovTask(CONFIG.vocab).batch(step, BATCH, CONFIG.sequence)
    )
    logits = model(inputs)
    F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1)).backward()
    grads = {name: p.grad.to_local().clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads


def _hsdp_equals_fsdp_within_each_replica(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (REPLICAS, SHARDS), mesh_dim_names=("replicate", "shard"))
    shard_rank = mesh.get_local_rank("shard")
    for comm in (
        lambda: "fp8",
        lambda: quant_fsdp.QuantizedReduceScatter(torch.float8_e5m2, block_size=32),
        lambda: quant_fsdp.QuantizedReduceScatter(stochastic_rounding=True, seed=5),
    ):
        fsdp, hsdp = build(mesh["shard"], comm), build(mesh, comm)
        for step in range(2):  # the second step: stochastic rounding's stream has advanced alike
            quant_fsdp.reset_comm_stats()
            want = gradients(fsdp, shard_rank, step)
            fsdp_bytes = quant_fsdp.comm_stats()["FP8 reduce-scatter"]
            quant_fsdp.reset_comm_stats()
            got = gradients(hsdp, shard_rank, step)
            assert quant_fsdp.comm_stats()["FP8 reduce-scatter"] == fsdp_bytes
            assert list(got) == list(want)
            different = [name for name in want if not torch.equal(got[name], want[name])]
            assert not different, (comm(), step, different)
        # Not a vacuous match: the FP8 gradients differ from FSDP2's own fp32 reduce-scatter.
        reference = gradients(build(mesh, lambda: None), shard_rank, 0)
        assert any(not torch.equal(reference[n], g) for n, g in gradients(build(mesh, comm), shard_rank, 0).items())


def test_hsdp_quantizes_within_each_shard_group_and_averages_replicas_in_the_reduce_dtype():
    run_on_warm_ranks(_hsdp_equals_fsdp_within_each_replica, REPLICAS * SHARDS)
