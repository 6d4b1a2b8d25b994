"""Composable Lightning callbacks for glmlight. Each knows nothing of the others.

Corrections and monitors implement `on_experience(trainer, module, batch)`, called by
the RLModule after the train-side old log-probs exist and before the loss, in
callback order (weights multiply, masks intersect).
"""

from callbacks.corrections import IcePop, MaskedIS, RejectionSampling, TruncatedIS
from callbacks.evaluation import HeldOutEval
from callbacks.index_agreement import IndexAgreement
from callbacks.mismatch import MismatchMonitor
from callbacks.sample_logging import SampleTable
from callbacks.version_gate import PolicyVersionGate
from callbacks.weight_sync import WeightSync

__all__ = ["HeldOutEval", "IcePop", "IndexAgreement", "MaskedIS", "MismatchMonitor", "PolicyVersionGate",
           "RejectionSampling", "SampleTable", "TruncatedIS", "WeightSync"]
