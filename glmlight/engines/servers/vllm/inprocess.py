"""`VLLMInProcessEngine`: the RolloutEngine protocol over a `vllm.LLM` in this process (rollout.server.in_process),
weights loaded through the worker extension's stage-and-commit (`load_named_tensors`, a layerwise
reload). vllm is imported here only, lazily. Not run in this repository's tests (no vLLM in the
trainer's environment)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from glmlight.errors import EngineError
from glmlight.engines import transport as wt
from glmlight.engines.base import Generation, NamedTensors, SamplingParams
from glmlight.engines.servers.protocol import sampling_fields
from glmlight.engines.servers.settings import served_model_path
from glmlight.engines.servers.vllm.wire import ASCEND_OPTIONS, EXTENSION, FINISH_REASONS


class VLLMInProcessEngine:
    def __init__(self, model_path: str, *, ascend: bool = False, llm_kwargs: dict | None = None, version: int = 0):
        if ascend:
            for k, v in ASCEND_OPTIONS["env"].items():
                os.environ.setdefault(k, v)
        import vllm

        self._vllm = vllm
        ascend_kwargs = {**ASCEND_OPTIONS["llm_kwargs"], "additional_config": dict(ASCEND_OPTIONS["additional_config"])}
        kwargs = {"model": model_path, "worker_extension_cls": EXTENSION, "enable_prefix_caching": True,
                  "logprobs_mode": "processed_logprobs",  # the log-probs of the distribution sampled from
                  **(ascend_kwargs if ascend else {}), **(llm_kwargs or {})}
        self.llm = vllm.LLM(**kwargs)
        self._version = version

    @classmethod
    def from_config(cls, cfg: Any) -> VLLMInProcessEngine:
        return cls(served_model_path(cfg), ascend=cfg.rollout.backend == "vllm_ascend")

    @property
    def version(self) -> int:
        return self._version

    def generate(self, prompts: list[list[int]], params: SamplingParams | Sequence[SamplingParams]) -> list[Generation]:
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        sps = [self._vllm.SamplingParams(n=1, max_tokens=p.max_new_tokens, logprobs=0, seed=p.seed, **sampling_fields(p))
               for p in params]
        outs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], sps, use_tqdm=False)
        gens = []
        for out in outs:
            c = out.outputs[0]
            ids = list(c.token_ids)
            lps = [float(c.logprobs[i][t].logprob) for i, t in enumerate(ids)]
            gens.append(Generation(ids, lps, FINISH_REASONS.get(c.finish_reason or "abort", "abort"),
                                   [self._version] * len(ids)))
        return gens

    def score(self, prompts: list[list[int]], completions: list[list[int]]) -> list[list[float]]:
        sp = self._vllm.SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
        outs = self.llm.generate([{"prompt_token_ids": list(p) + list(c)} for p, c in zip(prompts, completions)],
                                 sp, use_tqdm=False)
        return [[float(o.prompt_logprobs[len(p) + j][t].logprob) for j, t in enumerate(c)]
                for o, p, c in zip(outs, prompts, completions)]

    def update_weights(self, named_tensors: NamedTensors | None = None, *, path: str | None = None, version: int) -> None:
        if (named_tensors is None) == (path is None):
            raise ValueError("update_weights needs exactly one of named_tensors or path")
        named = list(named_tensors) if named_tensors is not None else wt.read_checkpoint(path)  # type: ignore[arg-type]
        self.llm.collective_rpc("load_named_tensors", args=(named, version))
        self.llm.reset_prefix_cache()
        served = {r["weight_version"] for r in self.llm.collective_rpc("glmlight_weight_version")}
        if served != {str(version)}:
            raise EngineError(f"in-process vLLM workers report weight versions {sorted(map(str, served))}, expected {version}")
        self._version = version

    def close(self) -> None:
        self.llm = None
