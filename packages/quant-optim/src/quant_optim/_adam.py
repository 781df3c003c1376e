"""FusedAdam: Adam/AdamW over fp32, bf16 and quantized parameters, plain or FSDP2 DTensors.

[Note: FusedAdam step] For every parameter the step works on local tensors (a DTensor's shard):
1. every gradient is checked for NaN/Inf first (quant_core.has_non_finite, one pass), or the
   caller's `found_inf` is taken instead; one all-reduce makes the verdict every rank's, and a
   skipped step leaves parameters, masters, moments and step counts as they were;
2. the update runs on the fp32 master (the parameter itself when it is fp32) through
   quant_core.adam_step_: one call per kind of parameter (group options, step count, dtypes),
   one threaded pass in C++ for CPU tensors ([Note: Adam numerics] in quant_core.adam._adam: fp32
   results are within a few ulp of torch.optim.AdamW, not bitwise: torch's rounding differs
   between its own kernels). The same pass returns max |master| for per-tensor formats;
3. low-precision parameters are written back from the master: bf16/fp16 by a cast, quantized
   parameters by requantizing into their buffers (`quantizer.quantize_`). Everything scaled by
   a per-tensor amax (per-tensor FP8 and NVFP4 weights, fp8 moments) takes it from one stacked
   all-reduce (MAX) per process group per step, not one per parameter (`_write_back`).

States are created with the optimizer (not at the first step); those of a DTensor parameter are
DTensors like it (mesh, placements, shape, stride), so torch.distributed.checkpoint saves them
and reloads them onto another world size. fp8 moments keep one fp32 scale per (unsharded)
tensor, equal on every shard, so they reshard too.

[Note: checkpoints across weight forms] A quantized weight's value is its fp32 master (DESIGN
section 6); its bytes are the master's quantization. Its form depends on the layout: where
quant-fsdp's alignment fallback keeps it in high precision (its shards would split blocks, so
blockwise FP8 at one world size and not at another, or any format with uneven shards), that
fp32 shard is the master itself and FusedAdam keeps no copy. So:
- `state_dict()` holds the "master" of every quantized weight in either form
  (`qt.nn.is_quantized_weight`): for a high-precision one, a copy of its shard. The keys are then
  the same on every layout and DCP plans a load from any world size, in every direction.
- `load_state_dict()` needs that master (a ValueError naming the fix otherwise; shapes are
  checked too, before anything changes), and derives the weight from it: held in high
  precision here, the weight takes the master's value (no copy kept); held quantized here, the
  master is kept and the weight requantized from it: bit for bit what the saving run held on its
  own layout (DCP loaded those same bytes) and what an uninterrupted run holds on this one
  (a stateless quantizer's quantization of the master, per-tensor amaxes agreed in one
  all-reduce as in a step). Delayed scaling is the exception: its bytes were scaled with the
  amax history before the last step pushed its amax, and requantizing would push it again, so
  the bytes DCP loaded stay. When they come from the high-precision form, quant-fsdp quantizes
  the loaded value (the master) with the loaded history, which is what a run holding the weight
  quantized holds after that step.
- the model entry (the quantized bytes, or the fallback's shard) is read across forms by
  quant_fsdp._checkpoint (DCP's load protocol on the local tensors), so a model-only load works
  too: a quantized weight quantized from the loaded high-precision value, a fallback weight
  holding the dequantized one until this load writes its master in. The order of the two loads
  does not matter (torch's set_state_dict loads the optimizer first). A master that the load did
  not fill (DCP's partial loads leave the state dict's tensors as `state_dict` gave them: their
  version counters tell) derives nothing: the weight keeps what the model's load gave it.

On CUDA (and with `capturable=True` on any device) the step keeps every decision in tensors:
[Note: FusedAdam tensor-driven step] in quant_optim._tensor_step, which also says what
`capturable=True` (CUDA graphs) refuses. CPU tensors step as above, deciding on the host (a read
of a CPU tensor costs no sync); both give the same bits.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils.weak import WeakIdKeyDictionary

import quant_core
import quant_tensors as qt
from quant_optim import _tensor_step
from quant_optim._write_back import PendingAmax, agree_amaxes_and_apply, requantize_into, shard_groups

_FP8_MOMENT_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_MOMENT_DTYPES = (*quant_core.MOMENT_DTYPES, *_FP8_MOMENT_DTYPES)
_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class FusedAdam(torch.optim.Optimizer):
    """Adam / AdamW keeping fp32 master weights; see [Note: FusedAdam step] in quant_optim._adam."""

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        adam_w_mode: bool = True,
        master_weights: bool = True,
        master_weight_dtype: torch.dtype = torch.float32,
        exp_avg_dtype: torch.dtype = torch.float32,
        exp_avg_sq_dtype: torch.dtype = torch.float32,
        capturable: bool = False,
    ) -> None:
        if not (isinstance(lr, torch.Tensor) or lr >= 0.0):
            raise ValueError(f"lr must be >= 0, got {lr}")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas must lie in [0, 1), got {betas}")
        if eps < 0.0 or weight_decay < 0.0:
            raise ValueError(f"eps and weight_decay must be >= 0, got {eps} and {weight_decay}")
        if master_weight_dtype != torch.float32:
            raise ValueError(f"master_weight_dtype must be torch.float32, got {master_weight_dtype}")
        for name, dtype in (("exp_avg_dtype", exp_avg_dtype), ("exp_avg_sq_dtype", exp_avg_sq_dtype)):
            if dtype not in _MOMENT_DTYPES:
                raise ValueError(f"{name} must be one of {', '.join(map(str, _MOMENT_DTYPES))}, got {dtype}")
        self.capturable = capturable
        """Steps keep every decision in tensors, so a CUDA graph can capture one ([Note: FusedAdam
        tensor-driven step])."""
        self._plan: tuple[tuple[Any, ...], Any] | None = None
        """(key, plan) of the tensor-driven step: the parameters with gradients it was built for."""
        self._plan_version = 0
        """Bumped by add_param_group and load_state_dict: a plan built before is not used again."""
        self._requantized_bytes: WeakIdKeyDictionary = WeakIdKeyDictionary()
        """Local quantized weights this optimizer wrote from their masters -> [their buffers' versions
        then] (a one-item list: plans hold it and update it in place, `_tensor_step.written_record`)."""
        self._skipped_on_host = 0
        self._skipped_on_device: torch.Tensor | None = None
        self._last_verdict: bool | torch.Tensor = False
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "adam_w_mode": adam_w_mode,
            "master_weights": master_weights,
            "exp_avg_dtype": exp_avg_dtype,
            "exp_avg_sq_dtype": exp_avg_sq_dtype,
        }
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if qt.local_quantized(p) is not None and not group["master_weights"]:
                    raise ValueError("quantized parameters need master_weights=True (an fp32 master to update)")
        self._masters_given: WeakIdKeyDictionary = WeakIdKeyDictionary()
        """Local masters that `state_dict` handed out -> their version then (see `_loaded`)."""

    # ---- state -------------------------------------------------------------------------------

    def _state_of(self, p: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        """The parameter's state; for a DTensor parameter every tensor in it is a DTensor like it
        (mesh, placements, shape, stride), so torch.distributed.checkpoint can save and reshard it."""
        state = self.state[p]
        if not state:
            local = qt.local_shard(p)
            master = self._initial_master(p, local) if self._needs_master(local, group) else None
            reference = local if master is None else master
            state["step"] = torch.zeros((), dtype=torch.float32)
            for key in ("exp_avg", "exp_avg_sq"):
                dtype = group[f"{key}_dtype"]
                state[key] = qt.shard_like(p, torch.zeros(reference.shape, dtype=dtype, device=reference.device))
                if dtype in _FP8_MOMENT_DTYPES:  # one scale for the whole (unsharded) moment
                    state[f"{key}_scale_inv"] = torch.ones((), dtype=torch.float32, device=reference.device)
            if master is not None:
                state["master"] = qt.shard_like(p, master)
        return state

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's add_param_group; then every trainable parameter of the group gets its state now,
        not at its first step.

        torch.distributed.checkpoint's get_state_dict / set_state_dict create missing states with a
        step on `zeros_like(p)` gradients at lr 0 (`_init_optim_state`). For a quantized parameter
        that gradient is a QuantizedTensor, which the update cannot read, and the step would write
        every parameter back from a fresh master (over a model state loaded just before). With
        the states in place that step is never taken.
        """
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        for p in group["params"]:
            if self.capturable:
                _check_capturable(p, group)
            if p.requires_grad:
                self._state_of(p, group)
        self._plan_version += 1

    @property
    def last_step_skipped(self) -> bool:
        """Whether the last step was skipped because some gradient was not finite. On CUDA the step
        leaves this verdict on the device ([Note: FusedAdam tensor-driven step]): reading it waits
        for the step's kernels (one host sync, here and not in the step)."""
        return bool(self._last_verdict)

    @property
    def skipped_steps(self) -> int:
        """Steps skipped because some gradient was not finite (on CUDA a host sync, as last_step_skipped)."""
        on_device = 0 if self._skipped_on_device is None else int(self._skipped_on_device.item())
        return self._skipped_on_host + on_device

    def state_dict(self) -> dict[str, Any]:
        """torch's state_dict, with the master of every quantized weight that this layout holds in
        high precision: a copy of its shard ([Note: checkpoints across weight forms])."""
        state_dict = super().state_dict()
        params = [p for group in self.param_groups for p in group["params"]]  # torch's numbering
        for index, p in enumerate(params):
            saved = state_dict["state"].get(index)
            if saved is not None and "master" not in saved and qt.nn.is_quantized_weight(p):
                local = qt.local_shard(p)
                master = torch.empty(local.shape, dtype=torch.float32, device=local.device).copy_(local)
                state_dict["state"][index] = {**saved, "master": qt.shard_like(p, master)}
            if saved is not None and qt.nn.is_quantized_weight(p):
                master = qt.local_shard(state_dict["state"][index]["master"])
                self._masters_given[master] = master._version
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load_state_dict, with masters and moments in the dtypes this optimizer keeps them in,
        and quantized weights derived from their masters ([Note: checkpoints across weight forms]).

        torch casts every floating state tensor to its parameter's dtype
        (`Optimizer._process_value_according_to_param_policy`, called through the class name, so
        not overridable): the fp32 master of a bf16 parameter would be rounded to bf16, bf16
        moments of an fp32 parameter widened, fp32 scales of fp8 moments rounded. The saved
        tensors are put back here, moved to the parameter's device: masters and moments cast to
        the group's dtypes (fp32, `exp_avg_dtype`, `exp_avg_sq_dtype`: a no-op when the checkpoint
        was made with the same settings, so the round trip is bitwise), every other tensor but
        `step` (which torch leaves as saved) in its saved dtype.

        Raises ValueError, with nothing changed, when a quantized weight has no master in
        `state_dict` or a saved state is shaped otherwise than its parameter.
        """
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        params = [(p, group) for group in self.param_groups for p in group["params"]]
        targets = []  # (parameter, key, saved tensor, dtype to keep it in), checked before any change
        for saved_id, (p, group) in zip(saved_ids, params, strict=False):
            _check_saved_state(saved_id, p, state_dict["state"].get(saved_id, {}))
            dtypes = {
                "master": torch.float32,
                "exp_avg": group["exp_avg_dtype"],
                "exp_avg_sq": group["exp_avg_sq_dtype"],
            }
            for key, value in state_dict["state"].get(saved_id, {}).items():
                if key == "step" or not isinstance(value, torch.Tensor):
                    continue
                dtype = dtypes.get(key, value.dtype)
                if dtype != value.dtype and {dtype, value.dtype} & set(_FP8_MOMENT_DTYPES):
                    raise ValueError(
                        f"the checkpoint holds {key} as {value.dtype} but this optimizer keeps it as {dtype}; "
                        f"fp8 moments carry a scale and cannot be cast: load with {key}_dtype={value.dtype}"
                    )
                targets.append((p, key, value, dtype))
        super().load_state_dict(state_dict)  # checks the groups' sizes
        self._plan_version += 1
        for p, key, value, dtype in targets:
            self.state[p][key] = value.to(dtype=dtype, device=p.device)
        with torch.no_grad():  # the weights take values derived from the loaded masters
            requantize, requantized = [], []
            for p, group in params:
                if not p.requires_grad:
                    continue
                state, fresh = self.state[p], not self.state[p]
                if fresh:  # not in the checkpoint
                    self._state_of(p, group)
                local = qt.local_shard(p)
                if isinstance(local, qt.QuantizedTensor):
                    # Delayed scaling keeps its loaded bytes (see the Note).
                    if local.quantizer.stateless and self._loaded(state["master"]):
                        requantize.append(_requantize_from(local, qt.local_shard(state["master"])))
                        requantized.append(local)
                elif qt.nn.is_quantized_weight(p):  # held in high precision here: the master is its value
                    master = state["master"] if self._needs_master(local, group) else state.pop("master")
                    if self._loaded(master):
                        local.copy_(qt.local_shard(master))
                elif (fresh or "master" not in state) and self._needs_master(local, group):
                    # A bf16 parameter saved without a master (master_weights=False), or not saved:
                    # start from the loaded weight, not from the construction-time value, which the
                    # next step would write back over it.
                    state["master"] = qt.shard_like(p, self._weight_value(local))
            agree_amaxes_and_apply(requantize)
            for local in requantized:  # the master's quantization ([Note: FusedAdam tensor-driven step])
                _tensor_step.written_record(self._requantized_bytes, local)[0] = _tensor_step.buffer_versions(local)

    def _loaded(self, master: torch.Tensor) -> bool:
        """Whether `master` holds a loaded value: not a tensor of this optimizer's `state_dict`
        left as it was (DCP's partial loads leave the entries the checkpoint lacks untouched, and
        then the weight keeps what the model's load gave it)."""
        local = qt.local_shard(master)
        return self._masters_given.get(local) != local._version

    @staticmethod
    def _needs_master(local: torch.Tensor, group: dict[str, Any]) -> bool:
        return isinstance(local, qt.QuantizedTensor) or (group["master_weights"] and local.dtype != torch.float32)

    @classmethod
    def _initial_master(cls, p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        value = qt.high_precision_init_value(p) if isinstance(local, qt.QuantizedTensor) else None
        return (
            cls._weight_value(local) if value is None else qt.local_shard(value).detach().to(torch.float32, copy=True)
        )

    @staticmethod
    def _weight_value(local: torch.Tensor) -> torch.Tensor:
        """A new fp32 tensor holding the (dequantized) value of a parameter's local tensor."""
        if isinstance(local, qt.QuantizedTensor):
            return local.dequantize(torch.float32)
        return local.detach().to(torch.float32, copy=True)

    # ---- step --------------------------------------------------------------------------------

    @torch.no_grad()
    def step(
        self, closure: Callable[[], torch.Tensor] | None = None, *, found_inf: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """One Adam step for every parameter with a gradient; see [Note: FusedAdam step].

        `found_inf` (optional, GradScaler style): a tensor that is nonzero when the caller found a
        non-finite gradient (e.g. while unscaling). When given it replaces the optimizer's own
        check, which saves reading every gradient once more; a nonzero value on any rank skips
        the step on all ranks.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = [(p, group) for group in self.param_groups for p in group["params"] if p.grad is not None]
        grads = [_local_grad(p) for p, _ in work]
        for (p, _), grad in zip(work, grads, strict=True):  # before anything changes
            self._check_grad(p, grad)
        if work and (self.capturable or qt.local_shard(work[0][0]).device.type == "cuda"):
            self._tensor_driven_step(work, grads, found_inf)
            return loss
        self._last_verdict = not self._grads_finite(grads, found_inf) if work else False
        if self._last_verdict:
            self._skipped_on_host += 1
            return loss
        updates = [self._prepare(p, group, grad) for (p, group), grad in zip(work, grads, strict=True)]
        self._update(updates)
        self._write_back(updates)
        for (p, _), u in zip(work, updates, strict=True):
            self.state[p]["step"].fill_(u.step)
        return loss

    def _tensor_driven_step(
        self, work: list[tuple[torch.Tensor, dict[str, Any]]], grads: list[torch.Tensor], found_inf: torch.Tensor | None
    ) -> None:
        """[Note: FusedAdam tensor-driven step]; its plan is kept while the same parameters have gradients."""
        key = (self._plan_version, *(id(p) for p, _ in work), *(g.dtype for g in grads))
        if self._plan is None or self._plan[0] != key:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    "FusedAdam(capturable=True) cannot capture a step over parameters (or gradient dtypes) it has not "
                    "stepped eagerly since it was built or loaded: run one eager step with the same parameters having "
                    "gradients before capturing (torch.cuda.graphs' warm-up)"
                )
            self._plan = (key, _tensor_step.build_plan(self, work, grads))
        verdict = _tensor_step.step(self, self._plan[1], grads, found_inf)
        if self._skipped_on_device is None or self._skipped_on_device.device != verdict.device:
            self._skipped_on_device = torch.zeros((), dtype=torch.float32, device=verdict.device)
        self._skipped_on_device.add_(verdict)
        self._last_verdict = verdict

    @staticmethod
    def _check_grad(p: torch.Tensor, grad: torch.Tensor) -> None:
        local = qt.local_shard(p)
        if grad.dtype not in _GRAD_DTYPES or grad.shape != local.shape:
            raise ValueError(
                f"a parameter of local shape {tuple(local.shape)} has a gradient of dtype {grad.dtype} and local "
                f"shape {tuple(grad.shape)}; FusedAdam takes float32/bfloat16/float16 gradients shaped like the "
                "parameter (nothing was changed)"
            )

    def _prepare(self, p: torch.Tensor, group: dict[str, Any], grad: torch.Tensor) -> _ParamUpdate:
        """Names the local tensors the parameter's update touches (changes nothing)."""
        state = self._state_of(p, group)
        local = qt.local_shard(p)
        if "master" in state:
            master = qt.local_shard(state["master"])
        elif local.dtype != torch.float32:  # master_weights=False: a transient fp32 copy
            master = local.detach().to(torch.float32)
        else:
            master = local
        moments, fp8_moments = [], []
        for key in ("exp_avg", "exp_avg_sq"):
            stored = qt.local_shard(state[key])
            if stored.dtype in _FP8_MOMENT_DTYPES:  # the update runs on fp32 values
                values = quant_core.dequantize_fp8(stored, state[f"{key}_scale_inv"], torch.float32)
                fp8_moments.append(_Fp8Moment(stored, state[f"{key}_scale_inv"], values))
                stored = values
            moments.append(stored)
        return _ParamUpdate(
            local=local,
            master=master,
            grad=grad,
            exp_avg=moments[0],
            exp_avg_sq=moments[1],
            step=int(state["step"]) + 1,
            group=group,
            fp8_moments=fp8_moments,
            shard_groups=shard_groups(p),
        )

    @staticmethod
    def _update(updates: list[_ParamUpdate]) -> None:
        """Steps every master with one quant_core.adam_step_ call per kind of parameter (same
        group options, step count, dtypes and device). Parameters that are requantized with a
        per-tensor amax get it from the same pass."""
        buckets: dict[tuple[Any, ...], list[_ParamUpdate]] = {}
        for u in updates:
            key = (id(u.group), u.step, u.grad.dtype, u.exp_avg.dtype, u.exp_avg_sq.dtype, u.master.device)
            buckets.setdefault(key, []).append(u)
        for bucket in buckets.values():
            group, step = bucket[0].group, bucket[0].step
            lr = group["lr"].item() if isinstance(group["lr"], torch.Tensor) else group["lr"]
            beta1, beta2 = group["betas"]
            scalars = quant_core.AdamScalars.of(
                lr=lr,
                beta1=beta1,
                beta2=beta2,
                eps=group["eps"],
                weight_decay=group["weight_decay"],
                step=step,
                adam_w_mode=group["adam_w_mode"],
            )
            amaxes = quant_core.adam_step_(
                [u.master for u in bucket],
                [u.grad for u in bucket],
                [u.exp_avg for u in bucket],
                [u.exp_avg_sq for u in bucket],
                scalars,
                compute_amax=any(u.per_tensor_quantized for u in bucket),
            )
            if amaxes is not None:
                for u, amax in zip(bucket, amaxes, strict=True):
                    u.amax = amax

    @staticmethod
    def _write_back(updates: list[_ParamUpdate]) -> None:
        """Writes low-precision parameters from their masters and fp8 moments from their fp32
        values. Everything scaled by a per-tensor amax (per-tensor FP8 and NVFP4 weights, fp8
        moments) takes it from one all-reduce per process group for all of them."""
        pending: list[PendingAmax] = []
        for u in updates:
            if u.per_tensor_quantized:
                quantizer = u.local.quantizer
                groups = () if quantizer.amax_group is None else (quantizer.amax_group,)
                requantize = functools.partial(requantize_into, quantizer, u.master, u.local)
                pending.append(PendingAmax(groups, u.amax, requantize))
            elif isinstance(u.local, qt.QuantizedTensor):  # a block-scaled format: its own scales
                u.local.quantizer.quantize_(u.master, u.local)
            elif u.master is not u.local:
                u.local.copy_(u.master)  # a bf16 cast
        moments = [(u.shard_groups, moment) for u in updates for moment in u.fp8_moments]
        if moments:  # their amaxes in one kernel call
            moment_amaxes = quant_core.amax_many([moment.values for _, moment in moments])
            pending += [
                PendingAmax(groups, amax, moment.store)
                for (groups, moment), amax in zip(moments, moment_amaxes, strict=True)
            ]
        agree_amaxes_and_apply(pending)

    @staticmethod
    def _grads_finite(grads: list[torch.Tensor], found_inf: torch.Tensor | None) -> bool:
        """Whether every rank may step: no local gradient anywhere holds NaN or Inf. A caller's
        `found_inf` (GradScaler's unscale already read every gradient) replaces the check here.
        One all-reduce makes the verdict every rank's."""
        bad = quant_core.has_non_finite(grads) if found_inf is None else (found_inf != 0).any().to(torch.float32)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        return not bool(bad)


def _requantize_from(local: qt.QuantizedTensor, master: torch.Tensor) -> PendingAmax:
    """The requantization of a loaded quantized weight from its master (an amax to agree on for
    per-tensor formats, over the group the weight's shards share it in)."""
    quantizer = local.quantizer
    if not quantizer.per_tensor_amax:
        return PendingAmax((), None, lambda amax: quantizer.quantize_(master, local))
    groups = () if quantizer.amax_group is None else (quantizer.amax_group,)
    return PendingAmax(
        groups, quant_core.amax_many([master])[0], functools.partial(requantize_into, quantizer, master, local)
    )


def _check_capturable(p: torch.Tensor, group: dict[str, Any]) -> None:
    """Refuses what a captured step cannot take ([Note: FusedAdam tensor-driven step])."""
    for key in ("exp_avg_dtype", "exp_avg_sq_dtype"):
        if group[key] in _FP8_MOMENT_DTYPES:
            raise ValueError(
                f"capturable=True cannot keep {key}={group[key]}: fp8 moments are stored from their values with a "
                "per-tensor scale, which a skipped step would change, so every step reads the skip verdict on the host. "
                f"Use {key}=torch.bfloat16 (or float32) with capturable=True, or capturable=False"
            )
    local = qt.local_shard(p)
    if isinstance(local, qt.QuantizedTensor) and not local.quantizer.stateless:
        raise ValueError(
            f"capturable=True cannot step a {type(local.quantizer).__name__} weight of shape {tuple(p.shape)}: its "
            "quantizer keeps state (an amax history, a stochastic-rounding counter) that a requantize on a skipped step "
            "would change, so every step reads the skip verdict on the host. Use a stateless recipe for the weights "
            "(e.g. qt.Float8CurrentScaling, qt.MXFP8BlockScaling, qt.Float8BlockScaling, qt.NVFP4BlockScaling without "
            "stochastic rounding of weights), or capturable=False"
        )


def _check_saved_state(saved_id: int, p: torch.Tensor, saved: dict[str, Any]) -> None:
    """Refuses, before anything changes, a saved state that cannot be this parameter's."""
    what = f"parameter {saved_id} of the state dict (shape {tuple(p.shape)}, local {tuple(qt.local_shard(p).shape)})"
    if p.requires_grad and qt.nn.is_quantized_weight(p) and "master" not in saved:
        raise ValueError(
            f"the checkpoint holds no fp32 master for {what}, a quantized weight: its master is its value "
            "(DESIGN section 6), without it the weight could only be restored from its lossy quantization. Load a "
            "checkpoint saved from FusedAdam.state_dict (torch's get_state_dict), which holds the master of every "
            "quantized weight in either form, or load the model alone and build a new FusedAdam, whose masters start "
            "from the loaded weights (nothing was changed)"
        )
    for key in ("master", "exp_avg", "exp_avg_sq"):
        value = saved.get(key)
        if isinstance(value, torch.Tensor) and (
            value.shape != p.shape or qt.local_shard(value).shape != qt.local_shard(p).shape
        ):
            raise ValueError(
                f"the checkpoint's {key} for {what} has shape {tuple(value.shape)} (local "
                f"{tuple(qt.local_shard(value).shape)}): it belongs to another model, or to another layout loaded "
                "without resharding. Load this model's checkpoint; onto another world size load it through "
                "torch.distributed.checkpoint (get_state_dict, dcp.load, set_state_dict), which reshards "
                "(nothing was changed)"
            )


def _local_grad(p: torch.Tensor) -> torch.Tensor:
    """p's gradient as a local tensor laid out like p's: a DTensor gradient placed otherwise is
    redistributed first (torch's TP styles leave Partial gradients on replicated norm weights and
    Replicate ones on row-sharded embeddings; reading their local tensors would use a partial
    sum or the wrong rows). That is a collective on p's mesh, as torch's optimizers do it."""
    grad = p.grad
    if isinstance(grad, DTensor) and isinstance(p, DTensor) and tuple(grad.placements) != tuple(p.placements):
        grad = grad.redistribute(p.device_mesh, p.placements)
    return qt.local_shard(grad)


@dataclass(eq=False)
class _ParamUpdate:
    """The local tensors one parameter's step reads and writes."""

    local: torch.Tensor
    """The parameter's local tensor (a DTensor's shard): fp32, bf16/fp16 or a QuantizedTensor."""
    master: torch.Tensor
    """The fp32 tensor the update runs on: the master weight, or `local` itself when fp32."""
    grad: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: int
    """The step count including this step."""
    group: dict[str, Any]
    fp8_moments: list[_Fp8Moment]
    """Moments kept in fp8: `exp_avg`/`exp_avg_sq` above are then their fp32 values."""
    shard_groups: tuple[dist.ProcessGroup, ...]
    """The process groups the parameter is sharded over (none when it is not a DTensor)."""
    amax: torch.Tensor | None = None
    """max |master| after the update, for parameters requantized with a per-tensor amax."""

    @property
    def per_tensor_quantized(self) -> bool:
        return isinstance(self.local, qt.QuantizedTensor) and self.local.quantizer.per_tensor_amax


@dataclass(eq=False)
class _Fp8Moment:
    """A moment stored as fp8 codes with one fp32 scale for the whole unsharded tensor."""

    codes: torch.Tensor
    scale_inv: torch.Tensor
    """The state's 0-d scale_inv (equal on every shard)."""
    values: torch.Tensor
    """fp32 values the step updates: dequantized before it, stored back by `store`."""

    def store(self, amax: torch.Tensor) -> None:
        scale, scale_inv = quant_core.fp8_scale(amax, self.codes.dtype)
        quant_core.cast_to_fp8(self.values, scale, self.codes.dtype, rowwise_out=self.codes)
        self.scale_inv.copy_(scale_inv)
