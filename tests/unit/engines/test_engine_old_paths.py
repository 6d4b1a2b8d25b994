"""The engines' former module paths (glmlight.rollout.<name>) are the glmlight.engines modules themselves,
imported with a DeprecationWarning; the vLLM worker extension's former path, which servers are started
with, imports in a server's environment as the new one does."""

import importlib.util
import os
import subprocess
import sys

import pytest

import glmlight.rollout
from glmlight.rollout import MOVED
from tests.conftest import REPO


def test_old_paths_are_the_same_modules(monkeypatch):
    for name in ("local", "servers"):  # imported afresh here, whatever ran before
        monkeypatch.delitem(sys.modules, f"glmlight.rollout.{name}", raising=False)
        monkeypatch.delattr(glmlight.rollout, name, raising=False)
    with pytest.warns(DeprecationWarning, match="glmlight.rollout.local is now glmlight.engines.local.engine"):
        from glmlight.rollout.local import LocalEngine as OldLocalEngine
    with pytest.warns(DeprecationWarning, match="glmlight.rollout.servers is now glmlight.engines.servers.base"):
        from glmlight.rollout import servers as old_servers
    from glmlight.engines.local.engine import LocalEngine
    from glmlight.engines.servers import base

    assert OldLocalEngine is LocalEngine and old_servers is base
    assert sys.modules["glmlight.rollout.servers"] is base and base.__spec__.name == "glmlight.engines.servers.base"
    assert all(importlib.util.find_spec(new) is not None for new in MOVED.values())


def test_the_old_worker_extension_path_imports_with_torch_and_safetensors_alone(tmp_path):
    """`--worker-extension-cls glmlight.rollout.vllm_worker.WeightLoaderExtension`, as running servers were
    started: the same class, in an environment without Lightning, Hydra, OmegaConf, transformers, aiohttp."""
    blocker = tmp_path / "sitecustomize.py"
    blocker.write_text("import sys\nfor name in ('lightning', 'hydra', 'omegaconf', 'transformers', 'aiohttp', "
                       "'torchmetrics', 'lightning_utilities'):\n    sys.modules[name] = None\n")
    code = ("import glmlight.rollout.vllm_worker as old, glmlight.engines.servers.vllm_worker as new; "
            "assert old.WeightLoaderExtension is new.WeightLoaderExtension")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), REPO])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-1500:]
