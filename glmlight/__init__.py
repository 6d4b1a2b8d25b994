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


def _map_checkout_callbacks() -> None:
    """In a source checkout that is imported without being installed (PYTHONPATH=the checkout), its
    top-level callbacks/ folder is `glmlight.callbacks`, as the installed package maps it (pyproject.toml)."""
    import importlib.util

    here = _os.path.dirname(_os.path.abspath(__file__))
    folder = _os.path.join(_os.path.dirname(here), "callbacks")
    if _os.path.isdir(_os.path.join(here, "callbacks")) or not _os.path.isfile(_os.path.join(folder, "__init__.py")):
        return  # installed (the package holds it), or not a checkout

    class CheckoutCallbacks:
        @staticmethod
        def find_spec(name: str, path: Any = None, target: Any = None) -> Any:
            if name != "glmlight.callbacks":
                return None
            return importlib.util.spec_from_file_location(name, _os.path.join(folder, "__init__.py"),
                                                          submodule_search_locations=[folder])

    if not any(type(f).__name__ == "CheckoutCallbacks" for f in _sys.meta_path):
        _sys.meta_path.insert(0, CheckoutCallbacks())


_map_checkout_callbacks()

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
    "build": "glmlight.builder",
    "Run": "glmlight.builder",
    "compose": "glmlight.cli",
    "register_algorithm": "glmlight.registry",
}

__all__ = ["Experience", "Run", "Sample", "Status", "build", "compose", "register_algorithm"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'glmlight' has no attribute {name!r}")
