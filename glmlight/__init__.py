"""glmlight: Lightning-style RL post-training for GLM-5-style models.

    import glmlight
    run = glmlight.build(glmlight.compose(["algo=sao", "trainer.max_steps=20"]))
    run.fit()

`import glmlight` is light (torch only): the Python API below loads Lightning, Hydra and the
algorithms on first use, so that low-level modules (the weight-transport code a vLLM worker
imports, the ops) can be used without them. `import glmlight.accelerators` registers the
Ascend NPU accelerator with Lightning (`build` does it for you).
"""

import os as _os
import sys as _sys
from typing import Any


# Idle intra-op threads sleep instead of spinning (GNU OpenMP, which this CPU build of torch uses, spins
# for a while by default): beside another CPU-bound process the default run took 1.6x its quiet time with
# spinning threads and 1.0x with sleeping ones, with no cost on a quiet machine (docs/performance.md).
# OpenMP reads the variable when torch loads it, so it only takes effect if glmlight is imported first;
# set OMP_WAIT_POLICY=ACTIVE to keep spinning.
if "torch" not in _sys.modules:
    _os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from glmlight.sample import Experience, Sample, Status  # noqa: E402

__version__ = "0.1.0"

_LAZY = {
    "build": "glmlight.run.build",
    "Run": "glmlight.run.run",
    "compose": "glmlight.config.compose",
    "register_algorithm": "glmlight.config.registry",
}

__all__ = ["Experience", "Run", "Sample", "Status", "build", "compose", "register_algorithm"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'glmlight' has no attribute {name!r}")
