"""Composable Lightning callbacks for glmlight. Each knows nothing of the others."""

from callbacks.evaluation import HeldOutEval
from callbacks.sample_logging import SampleTable
from callbacks.weight_sync import WeightSync

__all__ = ["HeldOutEval", "SampleTable", "WeightSync"]
