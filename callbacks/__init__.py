"""Composable Lightning callbacks for glmlight (`glmlight.callbacks`). Each knows nothing of the others.

This folder is installed as the package `glmlight.callbacks` (pyproject.toml maps it, in a wheel and in an
editable install alike): import it by that name.

Extension points:

- `glmlight.hooks.RLCallback`: a callback with `on_experience(trainer, module, batch)` is called by the
  RLModule in every RL step, in callback order, after the train-side old log-probs exist and
  before the advantages and the loss. Corrections and monitors are such hooks; their changes
  compose (token weights multiply, loss masks intersect). A hook that reads no old log-probs
  sets `reads_old_logprobs = False`.
- `Correction`: subclass it and implement `compute(batch) -> CorrectionResult` for a new
  per-token correction; it composes with the others as IcePop and TIS do.

Any other behaviour is a plain `lightning.Callback` (weight sync, evaluation, gating), listed
in the config under `callbacks.NAME._target_` or appended to `run.trainer.callbacks`.
"""

from .base import Correction
from .corrections import IcePop, MaskedIS, RejectionSampling, TruncatedIS
from .evaluation import HeldOutEval
from .index_agreement import IndexAgreement
from .mismatch import MismatchMonitor
from .retokenization import RetokenizationCheck
from .routing_agreement import RoutingAgreement
from .run_health import RunHealth
from .sample_logging import SampleTable
from .version_gate import PolicyVersionGate
from .weight_sync import WeightSync

__all__ = ["Correction", "HeldOutEval", "IcePop", "IndexAgreement", "MaskedIS", "MismatchMonitor",
           "PolicyVersionGate", "RejectionSampling", "RetokenizationCheck", "RoutingAgreement", "RunHealth", "SampleTable", "TruncatedIS", "WeightSync"]
