"""glmlight: Lightning-style RL post-training for GLM-5-style models.

    import glmlight
    run = glmlight.build(glmlight.compose(["algo=sao", "trainer.max_steps=20"]))
    run.fit()

`import glmlight` is light (torch only): the Python API below loads Lightning, Hydra and the
algorithms on first use, so that low-level modules (the weight-transport code a vLLM worker
imports, the ops) can be used without them. `import glmlight.accelerators` registers the
Ascend NPU accelerator with Lightning (`build` does it for you).
"""

from typing import Any

from glmlight.sample import Experience, Sample, Status

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
