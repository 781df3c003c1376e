"""Optimizer state configurations the benchmarks name after "+" in a run's name.

Quantized-weight runs step with quant_optim.FusedAdam, whose master and moment dtypes are its
options; without a "+<states>" suffix it keeps fp32 masters and moments.
"""

from __future__ import annotations

import torch

FUSED_ADAM_STATES = {
    "m-bf16": {"exp_avg_dtype": torch.bfloat16, "exp_avg_sq_dtype": torch.bfloat16},
    "m-fp8": {"exp_avg_dtype": torch.float8_e4m3fn, "exp_avg_sq_dtype": torch.bfloat16},
    "master-bf16": {"master_weight_dtype": torch.bfloat16},
    "master-bf16-m-fp8": {
        "master_weight_dtype": torch.bfloat16,
        "exp_avg_dtype": torch.float8_e4m3fn,
        "exp_avg_sq_dtype": torch.bfloat16,
    },
}
