"""Helpers for tests of quant-tensors and the packages above it.

The model, task and training loop live in product code (`quant_tensors.demo`); they are
re-exported here for the tests that import them from this module.
"""

from __future__ import annotations

from quant_tensors.demo import MarkovTask, MasterWeights, TinyTransformer, TransformerConfig, train

__all__ = ["MarkovTask", "MasterWeights", "TinyTransformer", "TransformerConfig", "train"]
