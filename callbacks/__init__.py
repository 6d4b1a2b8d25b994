"""Composable Lightning callbacks for glmlight (`glmlight.callbacks`). Each knows nothing of the others.

This folder is installed as the package `glmlight.callbacks` (pyproject.toml maps it; a source checkout
used without installing maps it the same way, `glmlight/__init__.py`). Imported by its folder's name,
`callbacks`, it is that same package, so there is one set of classes.

Extension points (callbacks/base.py):

- `ExperienceHook`: a callback with `on_experience(trainer, module, batch)` is called by the
  RLModule in every RL step, in callback order, after the train-side old log-probs exist and
  before the advantages and the loss. Corrections and monitors are such hooks; their changes
  compose (token weights multiply, loss masks intersect). A hook that reads no old log-probs
  sets `reads_old_logprobs = False`.
- `Correction`: subclass it and implement `compute(batch) -> CorrectionResult` for a new
  per-token correction; it composes with the others as IcePop and TIS do.

Any other behaviour is a plain `lightning.Callback` (weight sync, evaluation, gating), listed
in the config under `callbacks.NAME._target_` or appended to `run.trainer.callbacks`.
"""

import sys as _sys

if __name__ != "glmlight.callbacks":  # imported by the folder's name, `callbacks`: be glmlight.callbacks
    import importlib as _importlib

    _package = _importlib.import_module("glmlight.callbacks")
    _sys.modules[__name__] = _package
    for _name, _module in list(_sys.modules.items()):
        if _name.startswith("glmlight.callbacks."):
            _sys.modules[__name__ + _name[len("glmlight.callbacks"):]] = _module
    globals().update({_k: getattr(_package, _k) for _k in _package.__all__})
else:
    from .base import Correction, ExperienceHook
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

__all__ = ["Correction", "ExperienceHook", "HeldOutEval", "IcePop", "IndexAgreement", "MaskedIS", "MismatchMonitor",
           "PolicyVersionGate", "RejectionSampling", "RoutingAgreement", "RunHealth", "SampleTable", "TruncatedIS", "WeightSync"]
