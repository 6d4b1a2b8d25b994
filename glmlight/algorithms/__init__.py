"""The built-in algorithms. Each module defines its LightningModule and config dataclass and
registers both (glmlight.config.registry); importing this package registers all four."""

from glmlight.algorithms.base import RLModule
from glmlight.algorithms.compaction import CompactionConfig, CompactionRL
from glmlight.algorithms.grpo import GRPO, GRPOConfig
from glmlight.algorithms.opd import OPD, OPDConfig
from glmlight.algorithms.sao import SAO, SAOConfig

__all__ = ["GRPO", "OPD", "SAO", "CompactionConfig", "CompactionRL", "GRPOConfig", "OPDConfig", "RLModule",
           "SAOConfig"]
