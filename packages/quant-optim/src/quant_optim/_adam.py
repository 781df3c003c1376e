"""FusedAdam: Adam/AdamW over fp32, bf16 and quantized parameters, plain or FSDP2 DTensors; its
states and checkpoints. The step is planned in quant_optim._plan and run by quant_optim._step
([Note: FusedAdam step]).

States are created with the optimizer (not at the first step); those of a DTensor parameter are
DTensors like it (mesh, placements, shape, stride), so torch.distributed.checkpoint saves them
and reloads them onto another world size. fp8 moments keep one fp32 scale per (unsharded)
tensor, equal on every shard, so they reshard too.

[Note: checkpoints across weight forms] A quantized weight's value is its master (docs/design.md,
'FusedAdam and checkpoints'; fp32, or bf16: [Note: FusedAdam bf16 masters] in quant_optim._plan); its bytes are the
master's quantization. Its form depends on the layout: where quant-fsdp's alignment fallback
keeps it in high precision (its shards would split blocks, so blockwise FP8 at one world size
and not at another, or any format with uneven shards), that shard is the master itself and
FusedAdam keeps no copy (with bf16 masters, an fp32 shard keeps a bf16 master and takes its
value after each step). So:
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
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils.weak import WeakIdKeyDictionary

import quant_core
import quant_tensors as qt
from quant_optim import _plan, _step
from quant_optim._plan import FP8_MOMENT_DTYPES, buffer_versions, written_record
from quant_optim._write_back import agree_amaxes_and_apply, requantize_from_master

_MOMENT_DTYPES = (*quant_core.MOMENT_DTYPES, *FP8_MOMENT_DTYPES)
_MASTER_DTYPES = (torch.float32, torch.bfloat16)
_SHORT_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16"}
_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class FusedAdam(torch.optim.Optimizer):
    """Adam / AdamW keeping fp32 master weights, or bf16 ones rounded stochastically ([Note: FusedAdam
    bf16 masters] in quant_optim._plan); see [Note: FusedAdam step] in quant_optim._step."""

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
        if master_weight_dtype not in _MASTER_DTYPES:
            raise ValueError(
                f"master_weight_dtype must be torch.float32 or torch.bfloat16 (rounded stochastically), "
                f"got {master_weight_dtype}"
            )
        for name, dtype in (("exp_avg_dtype", exp_avg_dtype), ("exp_avg_sq_dtype", exp_avg_sq_dtype)):
            if dtype not in _MOMENT_DTYPES:
                raise ValueError(f"{name} must be one of {', '.join(map(str, _MOMENT_DTYPES))}, got {dtype}")
        self.capturable = capturable
        """Steps keep every decision in tensors, so a CUDA graph can capture one ([Note: FusedAdam
        tensor-driven step])."""
        self._plan: tuple[tuple[Any, ...], _plan.Plan] | None = None
        """(key, plan) of the last step: the parameters with gradients (and their local tensors and
        gradient dtypes) it was built for ([Note: FusedAdam step])."""
        self._plan_version = 0
        """Bumped by add_param_group and load_state_dict: a plan built before is not used again."""
        self._requantized_bytes: WeakIdKeyDictionary = WeakIdKeyDictionary()
        """Local quantized weights this optimizer wrote from their masters -> [their buffers' versions
        then] (a one-item list: plans hold it and update it in place, `_plan.written_record`)."""
        self._skipped_on_host = 0
        """Skipped steps whose verdict was read on the host."""
        self._skipped_on_device: torch.Tensor | None = None
        """Skipped steps whose verdict stayed on the device: their sum, on that device."""
        self._last_verdict: bool | torch.Tensor = False
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "adam_w_mode": adam_w_mode,
            "master_weights": master_weights,
            "master_weight_dtype": master_weight_dtype,
            "exp_avg_dtype": exp_avg_dtype,
            "exp_avg_sq_dtype": exp_avg_sq_dtype,
        }
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if qt.local_quantized(p) is not None and not group["master_weights"]:
                    raise ValueError("quantized parameters need master_weights=True (an fp32 master to update)")
                if (
                    group["master_weights"]
                    and group["master_weight_dtype"] != torch.float32
                    and p.dtype == torch.float16
                ):
                    raise ValueError(
                        f"a float16 parameter of shape {tuple(p.shape)} cannot keep a bfloat16 master (coarser than "
                        "the parameter): put it in a param group with master_weight_dtype=torch.float32, or "
                        "master_weights=False"
                    )
        self._masters_given: WeakIdKeyDictionary = WeakIdKeyDictionary()
        """Local masters that `state_dict` handed out -> their version then (see `_loaded`)."""

    # ---- state -------------------------------------------------------------------------------

    def _state_of(self, p: torch.Tensor, group: dict[str, Any], index: int | None = None) -> dict[str, Any]:
        """The parameter's state; for a DTensor parameter every tensor in it is a DTensor like it
        (mesh, placements, shape, stride), so torch.distributed.checkpoint can save and reshard it."""
        state = self.state[p]
        if not state:
            local = qt.local_shard(p)
            master = self._initial_master(p, local, group) if _needs_master(p, local, group) else None
            reference = local if master is None else master
            state["step"] = torch.zeros((), dtype=torch.float32)
            for key in ("exp_avg", "exp_avg_sq"):
                dtype = group[f"{key}_dtype"]
                state[key] = qt.shard_like(p, torch.zeros(reference.shape, dtype=dtype, device=reference.device))
                if dtype in FP8_MOMENT_DTYPES:  # one scale for the whole (unsharded) moment
                    state[f"{key}_scale_inv"] = torch.ones((), dtype=torch.float32, device=reference.device)
            if master is not None:
                state["master"] = qt.shard_like(p, master)
            if _rounds_master(p, local, group):
                state["master_rounding_counter"] = self._initial_rounding_counter(p, reference.device, index)
        return state

    def _initial_rounding_counter(self, p: torch.Tensor, device: torch.device, index: int | None) -> torch.Tensor:
        """The stochastic-rounding counter of p's bf16 master: p's `index` among the optimizer's
        parameters (torch's numbering; looked up when None) << 32, so no two parameters draw one
        stream for 2^32 steps ([Note: FusedAdam bf16 masters] in quant_optim._plan)."""
        if index is None:
            index = next(i for i, q in enumerate(q for g in self.param_groups for q in g["params"]) if q is p)
        return torch.tensor(index << 32, dtype=torch.int64, device=device)

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
        first = sum(len(g["params"]) for g in self.param_groups[:-1])
        for index, p in enumerate(group["params"], start=first):
            self._adopt(p, group, index)
        self._plan_version += 1

    def _adopt(self, p: torch.Tensor, group: dict[str, Any], index: int | None = None) -> None:
        """Takes `p` in as a parameter of `group`: checks it, binds its amax group and makes its state."""
        if self.capturable:
            _check_capturable(p)
        # A weight torch's fully_shard sharded gets its amax group at its first gather; requantizing
        # loaded masters before that (load_state_dict) must agree on the whole tensor's amax too.
        qt.fsdp.bind_shard_amax_group(p)
        if p.requires_grad:
            self._state_of(p, group, index)

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
        high precision: a copy of its shard ([Note: checkpoints across weight forms]). The groups'
        dtype options are saved by name ("bfloat16"): torch's state-dict utilities
        (`get_optimizer_state_dict(..., options=StateDictOptions(cpu_offload=True))`, which
        Accelerate's sharded checkpoints use) take no `torch.dtype` values."""
        self._sync_states_with_params()
        state_dict = super().state_dict()
        for group in state_dict["param_groups"]:
            for key in _GROUP_DTYPE_KEYS:
                group[key] = str(group[key]).removeprefix("torch.")
        params = [(p, group) for group in self.param_groups for p in group["params"]]  # torch's numbering
        for index, (p, group) in enumerate(params):
            saved = state_dict["state"].get(index)
            if saved is not None and "master" not in saved and qt.nn.is_quantized_weight(p):
                local = qt.local_shard(p)
                dtype = group["master_weight_dtype"]
                master = torch.empty(local.shape, dtype=dtype, device=local.device).copy_(local)
                state_dict["state"][index] = {**saved, "master": qt.shard_like(p, master)}
            if saved is not None and qt.nn.is_quantized_weight(p):
                master = qt.local_shard(state_dict["state"][index]["master"])
                self._masters_given[master] = master._version
        return state_dict

    def _sync_states_with_params(self) -> None:
        """Makes the states those of the parameters the groups hold now, walking all of them (not per
        step). A caller may put other tensors in the groups' `params` lists without add_param_group:
        Accelerate's FSDP2 prepare swaps the parameters the optimizer was built over for the sharded
        ones (matched by `data_ptr()`) and moves no state. The states made for the old ones are
        dropped (torch's `state_dict` cannot number them), and the new ones are taken in as
        add_param_group would: their amax groups bound and their states made. Without them torch's
        get_state_dict / set_state_dict would see the old states, or none, and initialise the
        missing ones with a step on `zeros_like` gradients (see add_param_group)."""
        held = [(p, group) for group in self.param_groups for p in group["params"]]
        held_ids = {id(p) for p, _ in held}
        for p in [p for p in self.state if id(p) not in held_ids]:
            del self.state[p]
        adopted = False
        for index, (p, group) in enumerate(held):
            if p.requires_grad and not self.state.get(p):
                self._adopt(p, group, index)
                adopted = True
        if adopted:
            self._plan_version += 1

    def _drop_states_of_replaced_params(self) -> None:
        """Forget the states of tensors that no param group holds any more, per step: a caller that
        swaps the groups' parameters for others (Accelerate's FSDP2 prepare) leaves them behind
        (see _sync_states_with_params). Counting suffices here: the first step makes the new
        parameters' states, and the next one finds more states than parameters."""
        if len(self.state) <= sum(len(group["params"]) for group in self.param_groups):
            return  # the common case, checked per step without walking the parameters
        held = {id(p) for group in self.param_groups for p in group["params"]}
        for p in [p for p in self.state if id(p) not in held]:
            del self.state[p]

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
        state_dict = {**state_dict, "param_groups": [_group_dtypes(group) for group in state_dict["param_groups"]]}
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        params = [(p, group) for group in self.param_groups for p in group["params"]]
        for p, _ in params:  # parameters put in the groups without add_param_group too (_sync_states_with_params)
            if self.capturable:
                _check_capturable(p)
            qt.fsdp.bind_shard_amax_group(p)
        master_dtypes = [group["master_weight_dtype"] for group in self.param_groups]
        for group, saved_group in zip(self.param_groups, state_dict["param_groups"], strict=False):
            _check_saved_master_dtype(group, saved_group)
        targets = []  # (parameter, key, saved tensor, dtype to keep it in), checked before any change
        for saved_id, (p, group) in zip(saved_ids, params, strict=False):
            _check_saved_state(saved_id, p, state_dict["state"].get(saved_id, {}), group["master_weight_dtype"])
            dtypes = {
                "master": group["master_weight_dtype"],
                "exp_avg": group["exp_avg_dtype"],
                "exp_avg_sq": group["exp_avg_sq_dtype"],
            }
            for key, value in state_dict["state"].get(saved_id, {}).items():
                if key == "step" or not isinstance(value, torch.Tensor):
                    continue
                dtype = dtypes.get(key, value.dtype)
                if dtype != value.dtype and {dtype, value.dtype} & set(FP8_MOMENT_DTYPES):
                    raise ValueError(
                        f"the checkpoint holds {key} as {value.dtype} but this optimizer keeps it as {dtype}; "
                        f"fp8 moments carry a scale and cannot be cast: load with {key}_dtype={value.dtype}"
                    )
                targets.append((p, key, value, dtype))
        super().load_state_dict(state_dict)  # checks the groups' sizes
        for group, dtype in zip(self.param_groups, master_dtypes, strict=True):
            group["master_weight_dtype"] = dtype  # absent from checkpoints made before bf16 masters (fp32)
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
                        requantize.append(requantize_from_master(local, qt.local_shard(state["master"])))
                        requantized.append(local)
                elif qt.nn.is_quantized_weight(p):  # held in high precision here: the master is its value
                    master = state["master"] if _needs_master(p, local, group) else state.pop("master")
                    if self._loaded(master):
                        local.copy_(qt.local_shard(master))
                elif (fresh or "master" not in state) and _needs_master(p, local, group):
                    # A bf16 parameter saved without a master (master_weights=False), or not saved:
                    # start from the loaded weight, not from the construction-time value, which the
                    # next step would write back over it.
                    state["master"] = qt.shard_like(p, self._weight_value(local, group["master_weight_dtype"]))
                if "master_rounding_counter" not in state and _rounds_master(p, local, group):
                    # Saved without a bf16 master (master_weights=False): its streams start here.
                    state["master_rounding_counter"] = self._initial_rounding_counter(p, local.device, None)
            agree_amaxes_and_apply(requantize)
            for local in requantized:  # the master's quantization ([Note: FusedAdam tensor-driven step])
                written_record(self._requantized_bytes, local)[0] = buffer_versions(local)

    def _loaded(self, master: torch.Tensor) -> bool:
        """Whether `master` holds a loaded value: not a tensor of this optimizer's `state_dict`
        left as it was (DCP's partial loads leave the entries the checkpoint lacks untouched, and
        then the weight keeps what the model's load gave it)."""
        local = qt.local_shard(master)
        return self._masters_given.get(local) != local._version

    @classmethod
    def _initial_master(cls, p: torch.Tensor, local: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        """The master's first value: the high-precision initial value of a quantized weight where
        kept, else the weight's value; rounded to nearest even into a bf16 master."""
        dtype = group["master_weight_dtype"]
        value = qt.high_precision_init_value(p) if isinstance(local, qt.QuantizedTensor) else None
        return cls._weight_value(local, dtype) if value is None else qt.local_shard(value).detach().to(dtype, copy=True)

    @staticmethod
    def _weight_value(local: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A new tensor of `dtype` holding the (dequantized) value of a parameter's local tensor."""
        if isinstance(local, qt.QuantizedTensor):
            return local.dequantize(torch.float32).to(dtype)
        return local.detach().to(dtype, copy=True)

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
        self._drop_states_of_replaced_params()
        work = [(p, group) for group in self.param_groups for p in group["params"] if p.grad is not None]
        if not work:
            self._last_verdict = False
            return loss
        grads = [_local_grad(p) for p, _ in work]
        for (p, _), grad in zip(work, grads, strict=True):  # before anything changes
            self._check_grad(p, grad)
        plan = self._plan_for(work, grads)
        verdict_on_host = not self.capturable and all(bucket.device.type == "cpu" for bucket in plan.buckets)
        verdict = _step.run(plan, grads, found_inf, verdict_on_host=verdict_on_host)
        if verdict_on_host:
            self._last_verdict = bool(verdict)  # read already: a CPU tensor
            self._skipped_on_host += self._last_verdict
            return loss
        if self._skipped_on_device is None or self._skipped_on_device.device != verdict.device:
            if self._skipped_on_device is not None:
                self._skipped_on_host += int(self._skipped_on_device.item())
            self._skipped_on_device = torch.zeros((), dtype=torch.float32, device=verdict.device)
        self._skipped_on_device.add_(verdict)
        self._last_verdict = verdict
        return loss

    def _plan_for(self, work: list[tuple[torch.Tensor, dict[str, Any]]], grads: list[torch.Tensor]) -> _plan.Plan:
        """The step's plan, kept while the same parameters (and local tensors) have gradients of the
        same dtypes, until add_param_group or load_state_dict."""
        key = (
            self._plan_version,
            *(id(p) for p, _ in work),
            *(id(qt.local_shard(p)) for p, _ in work),
            *(g.dtype for g in grads),
        )
        if self._plan is None or self._plan[0] != key:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    "FusedAdam(capturable=True) cannot capture a step over parameters (or gradient dtypes) it has not "
                    "stepped eagerly since it was built or loaded: run one eager step with the same parameters having "
                    "gradients before capturing (torch.cuda.graphs' warm-up)"
                )
            states = [self._state_of(p, group) for p, group in work]
            self._plan = (key, _plan.build_plan(work, states, grads, self._requantized_bytes))
        return self._plan[1]

    @staticmethod
    def _check_grad(p: torch.Tensor, grad: torch.Tensor) -> None:
        local = qt.local_shard(p)
        if grad.dtype not in _GRAD_DTYPES or grad.shape != local.shape:
            raise ValueError(
                f"a parameter of local shape {tuple(local.shape)} has a gradient of dtype {grad.dtype} and local "
                f"shape {tuple(grad.shape)}; FusedAdam takes float32/bfloat16/float16 gradients shaped like the "
                "parameter (nothing was changed)"
            )


def _check_capturable(p: torch.Tensor) -> None:
    """Refuses what a captured step cannot take ([Note: FusedAdam tensor-driven step])."""
    local = qt.local_shard(p)
    if isinstance(local, qt.QuantizedTensor) and not local.quantizer.stateless:
        raise ValueError(
            f"capturable=True cannot step a {type(local.quantizer).__name__} weight of shape {tuple(p.shape)}: its "
            "quantizer keeps state (an amax history, a stochastic-rounding counter) that a requantize on a skipped step "
            "would change, so every step reads the skip verdict on the host. Use a stateless recipe for the weights "
            "(e.g. qt.Float8CurrentScaling, qt.MXFP8BlockScaling, qt.Float8BlockScaling, qt.NVFP4BlockScaling without "
            "stochastic rounding of weights), or capturable=False"
        )


def _keeps_master(p: torch.Tensor, local: torch.Tensor, group: dict[str, Any]) -> bool:
    """Whether p's value is a master in the group's master dtype: a quantized weight (in either
    form), or a bf16/fp16 parameter with master_weights (an fp32 parameter is its own master)."""
    return (
        isinstance(local, qt.QuantizedTensor)
        or qt.nn.is_quantized_weight(p)
        or (group["master_weights"] and local.dtype != torch.float32)
    )


def _needs_master(p: torch.Tensor, local: torch.Tensor, group: dict[str, Any]) -> bool:
    """Whether p's master is a tensor of its own (else the parameter itself is updated)."""
    return isinstance(local, qt.QuantizedTensor) or (
        _keeps_master(p, local, group) and local.dtype != group["master_weight_dtype"]
    )


def _rounds_master(p: torch.Tensor, local: torch.Tensor, group: dict[str, Any]) -> bool:
    """Whether p's master is bf16, rounded stochastically with a counter in p's state."""
    return group["master_weight_dtype"] == torch.bfloat16 and _keeps_master(p, local, group)


_GROUP_DTYPE_KEYS = ("master_weight_dtype", "exp_avg_dtype", "exp_avg_sq_dtype")


def _group_dtypes(saved_group: dict[str, Any]) -> dict[str, Any]:
    """A saved param group with its dtype options as torch dtypes (`state_dict` saves their names;
    a checkpoint may hold the dtypes themselves)."""
    group = dict(saved_group)
    for key in _GROUP_DTYPE_KEYS:
        if isinstance(group.get(key), str):
            dtype = getattr(torch, group[key], None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"the checkpoint's param group holds {key}={group[key]!r}, which is not a torch dtype")
            group[key] = dtype
    return group


def _check_saved_master_dtype(group: dict[str, Any], saved_group: dict[str, Any]) -> None:
    """Refuses, before anything changes, a checkpoint whose masters are kept in another dtype."""
    saved = saved_group.get("master_weight_dtype", torch.float32)  # checkpoints before bf16 masters: fp32
    if saved != group["master_weight_dtype"]:
        raise ValueError(
            f"the checkpoint holds masters as {saved} but this optimizer keeps them as {group['master_weight_dtype']}; "
            "a bf16 master comes with its stochastic-rounding counter and an fp32 master would be rounded: "
            f"load with master_weight_dtype={saved} (nothing was changed)"
        )


def _check_saved_state(saved_id: int, p: torch.Tensor, saved: dict[str, Any], master_dtype: torch.dtype) -> None:
    """Refuses, before anything changes, a saved state that cannot be this parameter's."""
    what = f"parameter {saved_id} of the state dict (shape {tuple(p.shape)}, local {tuple(qt.local_shard(p).shape)})"
    if p.requires_grad and qt.nn.is_quantized_weight(p) and "master" not in saved:
        raise ValueError(
            f"the checkpoint holds no {_SHORT_NAMES[master_dtype]} master for {what}, a quantized weight: its master "
            "is its value, "
            "without it the weight could only be restored from its lossy quantization. Load a "
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
