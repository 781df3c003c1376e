"""Rank processes of test_torch_fully_shard.py: torch's own `fully_shard` over quantized primary
weights (the all-gather hooks are QuantizedTensor's own, each weight with the plain shard context
its first gather binds), in processes that never import quant_fsdp or, given `--import-quant-fsdp`,
that import it first.

`python torch_fully_shard_ranks.py RANK WORLD_SIZE STORE_FILE [--import-quant-fsdp]` joins a gloo
group and, for every
recipe, shards a converted model per block and at the root, trains a few steps (forward, backward,
an SGD step on fp32 masters that requantizes the shards) and checks, against the same model
unsharded in this process:
- forward outputs and input gradients: bitwise equal (the gathered weight is the unsharded one,
  and the same GEMMs run);
- weight gradients (FSDP2's reduce-scatter: the mean over ranks): equal to the mean of the
  unsharded model's per-rank gradients within rtol 1e-6 (the order of the reduction is gloo's);
- the gathered weights after the requantize: bitwise the quantization of the unsharded masters
  with their global amax (the default policy bound the shard group as `amax_group`);
- MXFP8 sends one usage per gather where FSDP2 gathers again in the backward (the blocks), both
  at once where it does not (the root's head).
Prints "checked RECIPE DIGEST" per recipe, DIGEST a sha256 of the outputs, gradients, every
all-gather's input bytes and the gathered weights, which the test compares between the processes
that imported quant_fsdp and those that did not; the importing ones check that `comm_stats()`
counted nothing (quant_fsdp's counters are for the weights it shards). Any failure exits non-zero
with the traceback.
"""

from __future__ import annotations

import copy
import hashlib
import os
import sys
import traceback

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import quant_tensors as qt
from quant_core.testing import raw_bits

RECIPES = ("fp8", "fp8-delayed", "mxfp8", "fp8-block", "nvfp4")
WIDTH = 256  # shards of 128 rows at 2 ranks: whole blocks of every format
BATCH = 32
STEPS = 3
LR = 0.5


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(WIDTH, WIDTH, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x))


class Model(torch.nn.Module):
    """Two blocks (sharded on their own: FSDP2 gathers their weights again in the backward) and a
    head the root gathers (kept for the backward: MXFP8 gathers both usages at once there)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block() for _ in range(2))
        self.head = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def linears(self) -> list[torch.nn.Module]:
        return [block.linear for block in self.blocks] + [self.head]


def inputs(step: int, rank: int) -> torch.Tensor:
    return torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(1000 * step + rank))


def run(model: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, input gradient) of one forward and backward of a mean-square loss."""
    x = x.clone().requires_grad_(True)
    out = model(x)
    out.float().pow(2).mean().backward()
    return out.detach(), x.grad


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def assert_bitwise(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert (a.shape, a.dtype) == (b.shape, b.dtype), (what, a.shape, b.shape, a.dtype, b.dtype)
    assert torch.equal(raw_bits(a.reshape(-1)), raw_bits(b.reshape(-1))), what


def assert_same_buffers(gathered: qt.QuantizedTensor, expected: qt.QuantizedTensor, names, what: str) -> None:
    assert type(gathered) is type(expected), what
    assert gathered.shape == expected.shape, what
    for name in names:
        assert_bitwise(getattr(gathered, name), getattr(expected, name), f"{what}: {name}")


def sgd_step(
    param: torch.Tensor, reference_params: list[torch.Tensor], grad: torch.Tensor, rank: int, world_size: int
) -> None:
    """One SGD step on the fp32 master of a parameter, written into the sharded parameter and every
    reference. A quantized weight is requantized from the master (as an optimizer that keeps
    masters does): the shard quantizes its rows, with the amax agreed over the shard group."""
    first = reference_params[0]
    quantized = isinstance(first, qt.QuantizedTensor)
    master = (first.dequantize() if quantized else first.detach()) - LR * grad
    local = qt.local_shard(param)
    with torch.no_grad():
        if quantized:
            local.quantizer.quantize_(master.chunk(world_size)[rank].contiguous(), local)
            for reference in reference_params:
                reference.quantizer.quantize_(master, reference)
        else:
            local.copy_(master.chunk(world_size)[rank])
            for reference in reference_params:
                reference.copy_(master)


class Digest:
    """sha256 over the bytes of tensors seen in order."""

    def __init__(self) -> None:
        self.sha = hashlib.sha256()

    def add(self, *tensors: torch.Tensor) -> None:
        for t in tensors:
            if isinstance(t, qt.QuantizedTensor):
                self.add(*(b for b in t.buffers().values() if b is not None))
            else:
                self.sha.update(
                    raw_bits(t.detach().reshape(-1)).clone().numpy().tobytes()
                )  # a copy: numpy pins storage


def check_recipe(rank: int, world_size: int, recipe_name: str) -> str:
    """Checks one recipe; returns the digest of what it computed and gathered."""
    digest = Digest()
    gathers = []
    # FSDP2's all-gather of every parameter group: dist.all_gather_single (torch 2.13), or
    # all_gather_into_tensor (earlier releases).
    originals = {
        name: getattr(dist, name) for name in ("all_gather_single", "all_gather_into_tensor") if hasattr(dist, name)
    }

    def counting(original):
        def counted(output, input, *args, **kwargs):
            digest.add(input)
            gathers.append(input.numel())
            return original(output, input, *args, **kwargs)

        return counted

    for name, original in originals.items():
        setattr(dist, name, counting(original))
    try:
        check_training(rank, world_size, recipe_name, digest)
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
    assert gathers, "FSDP2's all-gathers were not seen"
    return digest.sha.hexdigest()


def check_training(rank: int, world_size: int, recipe_name: str, digest: Digest) -> None:
    torch.manual_seed(0)
    model = Model()
    qt.convert(model, qt.recipe_from_name(recipe_name), quantized_weights=True)
    # The same model unsharded, once per rank's inputs (delayed scaling's state advances per forward).
    references = [copy.deepcopy(model) for _ in range(world_size)]
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    weights = [linear.weight for linear in model.linears()]
    assert all(isinstance(qt.local_shard(w), qt.QuantizedTensor) for w in weights), recipe_name

    for step in range(STEPS):
        out, x_grad = run(model, inputs(step, rank))
        digest.add(out, x_grad)
        expected = [run(reference, inputs(step, r)) for r, reference in enumerate(references)]
        assert_bitwise(out, expected[rank][0], f"{recipe_name} step {step}: output")
        assert_bitwise(x_grad, expected[rank][1], f"{recipe_name} step {step}: input gradient")
        for name, param in model.named_parameters():
            reference_params = [dict(reference.named_parameters())[name] for reference in references]
            mean = sum(p.grad for p in reference_params) / world_size
            torch.testing.assert_close(full(param.grad), mean, rtol=1e-6, atol=0, msg=f"{recipe_name} {name}")
            sgd_step(param, reference_params, mean, rank, world_size)
        model.zero_grad(set_to_none=True)
        for reference in references:
            reference.zero_grad(set_to_none=True)

    # The gathered weights are the references' (the unsharded quantization), bit for bit.
    for i, (linear, reference) in enumerate(zip(model.linears(), references[rank].linears(), strict=True)):
        owner = model if linear is model.head else model.blocks[i]
        owner.unshard()
        gathered, expected = linear.weight, reference.weight
        names = [
            n for n, b in expected.buffers().items() if b is not None and (n.startswith("rowwise") or b.dim() == 0)
        ]
        if linear is model.head and gathered.usages[1]:  # the root gathers MXFP8's both usages at once
            names = [n for n, b in expected.buffers().items() if b is not None]
        assert_same_buffers(gathered, expected, names, f"{recipe_name} linear {i}")
        digest.add(*(getattr(gathered, name) for name in names))  # not the buffers a later gather fills
        owner.reshard()
        # What a forward gather sends: MXFP8 blocks, which FSDP2 gathers again in the backward,
        # send rowwise only; the root's head, kept for the backward, both usages; 2-D-scaled and
        # per-tensor formats rowwise only (columnwise is derived after the gather).
        weight = linear.weight
        _, payload = weight.to_local().fsdp_pre_all_gather(weight.device_mesh, weight.shape, None, linear, None)
        both = recipe_name == "mxfp8" and linear is model.head
        sent = {name.split("_")[0] for name in payload.names}
        assert sent == ({"rowwise", "columnwise"} if both else {"rowwise"}), (recipe_name, i, payload.names)
        assert type(weight.to_local().quantizer.shard_context) is qt.fsdp.ShardContext, recipe_name


def main(rank: int, world_size: int, store: str, import_quant_fsdp: bool) -> None:
    torch.set_num_threads(1)
    if import_quant_fsdp:
        import quant_fsdp

        quant_fsdp.reset_comm_stats()
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    assert import_quant_fsdp or "quant_fsdp" not in sys.modules, "a module this process imported pulled in quant_fsdp"
    for recipe_name in RECIPES:
        print(f"checked {recipe_name} {check_recipe(rank, world_size, recipe_name)}", flush=True)
    assert import_quant_fsdp or "quant_fsdp" not in sys.modules
    if import_quant_fsdp:
        assert quant_fsdp.comm_stats() == {}, quant_fsdp.comm_stats()
    dist.barrier()


if __name__ == "__main__":
    try:
        main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], "--import-quant-fsdp" in sys.argv[4:])
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    # Leave without tearing the process group down: gloo's threads race interpreter finalization.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
