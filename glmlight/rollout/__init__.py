"""The engines' former module paths: `glmlight.rollout.<name>` is the `glmlight.engines` module it became
(`MOVED`; the same module object), imported with a DeprecationWarning. They keep working in code, in
configs (`_target_: glmlight.rollout.sglang.SGLangEngine`) and in `python -m glmlight.rollout.<name>`.
`vllm_worker.py` is a file of its own: vLLM servers are started with `--worker-extension-cls
glmlight.rollout.vllm_worker.WeightLoaderExtension`.

Standard library only: a vLLM worker imports this package with torch and safetensors alone."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import warnings

_LOCAL = ("batch", "dense_runner", "glm_runner", "glm_weights", "hf_runner", "records", "sampling")
_SERVERS = ("http", "launch", "replay_codec", "server_checks", "server_guard", "server_replay", "server_suspects",
            "server_types", "sglang", "sglang_wire", "tiny_checkpoint", "vllm", "vllm_inprocess", "vllm_wire")
MOVED = {"base": "glmlight.engines.base", "factory": "glmlight.engines.factory", "retry": "glmlight.engines.retry",
         "transport": "glmlight.engines.transport", "local": "glmlight.engines.local.engine",
         "servers": "glmlight.engines.servers.base",
         **{name: f"glmlight.engines.local.{name}" for name in _LOCAL},
         **{name: f"glmlight.engines.servers.{name}" for name in _SERVERS}}


class _Alias:
    """The import system's finder and loader of `glmlight.rollout.<name>`: the module is the new one."""

    def find_spec(self, fullname: str, path=None, target=None):
        package, _, name = fullname.rpartition(".")
        if package != __name__ or name not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self, is_package=False)

    def create_module(self, spec):
        new = _moved(spec.name)
        module = importlib.import_module(new)
        spec.loader_state = module.__spec__
        return module

    def exec_module(self, module) -> None:
        module.__spec__ = module.__spec__.loader_state  # the import system set the old path's spec on it

    def get_code(self, fullname: str):  # python -m glmlight.rollout.<name>
        new = _moved(fullname)
        return importlib.util.find_spec(new).loader.get_code(new)


def _moved(old: str) -> str:
    """The new path of `old`, warning once per import, at the importing line."""
    new = MOVED[old.rpartition(".")[2]]
    level, frame = 2, sys._getframe(1)
    while frame is not None and (frame.f_code.co_filename == __file__ or frame.f_code.co_filename.startswith("<frozen")):
        level, frame = level + 1, frame.f_back
    warnings.warn(f"{old} is now {new}", DeprecationWarning, stacklevel=level)
    return new


if not any(isinstance(finder, _Alias) for finder in sys.meta_path):
    sys.meta_path.append(_Alias())
