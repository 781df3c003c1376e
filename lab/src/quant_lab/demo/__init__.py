"""`quant-fsdp demo` and what it is made of: a small transformer, a Markov next-token task, fp32
master weights for plain torch optimizers, the training loop and a multi-process launcher.

quant-fsdp's command line (`quant-fsdp demo`, the module quant_fsdp_cli) runs the demo; tests train the
same model on the same task with the same loop (`train`), and tests and benchmarks launch their
process groups with `run_ranks`.
"""

from quant_lab.demo._cpu_gemms import bf16_gemms_in_fp32
from quant_lab.demo._launch import run_ranks
from quant_lab.demo._model import MarkovTask, MasterWeights, TinyTransformer, TransformerConfig, adamw, train

__all__ = [
    # model and task
    "MarkovTask",
    "TinyTransformer",
    "TransformerConfig",
    # training
    "MasterWeights",
    "adamw",
    "train",
    "bf16_gemms_in_fp32",
    # processes
    "run_ranks",
]
