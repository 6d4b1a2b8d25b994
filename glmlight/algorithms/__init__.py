"""Algorithms: each a LightningModule on top of RLModule, registered by config name."""

from glmlight.algorithms.base import RLModule
from glmlight.algorithms.compaction import CompactionConfig, CompactionRL
from glmlight.algorithms.grpo import GRPO
from glmlight.algorithms.opd import OPD, OPDConfig
from glmlight.algorithms.sao import SAO, SAOConfig
from glmlight.config import GRPOConfig, register_algo_schema

ALGORITHMS: dict[str, type[RLModule]] = {"grpo": GRPO, "sao": SAO, "opd": OPD, "compaction": CompactionRL}
register_algo_schema("grpo", GRPOConfig)
register_algo_schema("opd", OPDConfig)
register_algo_schema("sao", SAOConfig)
register_algo_schema("compaction", CompactionConfig)

__all__ = ["ALGORITHMS", "CompactionRL", "GRPO", "OPD", "RLModule", "SAO"]
