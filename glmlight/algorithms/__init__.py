"""Algorithms: each a LightningModule on top of RLModule, registered by config name."""

from glmlight.algorithms.base import RLModule
from glmlight.algorithms.grpo import GRPO
from glmlight.config import GRPOConfig, register_algo_schema

ALGORITHMS: dict[str, type[RLModule]] = {"grpo": GRPO}
register_algo_schema("grpo", GRPOConfig)

__all__ = ["ALGORITHMS", "GRPO", "RLModule"]
