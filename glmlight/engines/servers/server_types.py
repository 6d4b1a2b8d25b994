"""The small types the server engines share: what an answer carries (`Answer`), where one version's
weights can be had again (`Source`), the two ways an update can fail (`UpdateFailed`: every server is
back on the previous version; `FleetFailed`: they are not), the sampling fields SGLang and vLLM spell
alike, and the engines' constructor settings read from the config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from glmlight.errors import EngineError
from glmlight.engines.base import Generation, SamplingParams


class UpdateFailed(EngineError):
    """A weight update failed and every server still serves the previous version (retried)."""


class FleetFailed(EngineError):
    """Servers were left on different or unknown weights: the engine cannot go on."""

    fatal = True


@dataclass
class Answer:
    """One server answer: the generation, the server, and the weight-version labels the server
    reported for it (empty when it reports none)."""

    gen: Generation
    url: str
    labels: list[str]


@dataclass
class Source:
    """Where the weights of one version can be had again (re-syncs, reverts): tensors, or a
    checkpoint path the servers can read; `label` is what the servers report for them."""

    version: int
    label: str | None
    named: list | None = None
    path: str | None = None


def sampling_fields(p: SamplingParams) -> dict[str, Any]:
    """The sampling fields SGLang and vLLM spell alike (top_k -1 = off for both)."""
    return {"temperature": p.temperature, "top_p": p.top_p, "top_k": p.top_k if p.top_k > 0 else -1,
            "stop_token_ids": list(p.stop_token_ids), "skip_special_tokens": False}


def server_settings(cfg: Any) -> dict[str, Any]:
    """Constructor arguments every server engine takes, from the whole config."""
    from glmlight.engines.servers.http import HttpSettings

    s = cfg.rollout.server
    return dict(urls=list(s.urls), router=bool(s.router), http=HttpSettings.from_config(s),
                ready_timeout_s=float(s.launch_timeout_s), weight_sync=s.weight_sync,
                weight_sync_dir=s.weight_sync_dir, shm_dir=s.shm_dir, model_path=s.model_path or cfg.model.path,
                update_retries=int(s.update_retries), resync=bool(s.resync), verify_updates=bool(s.verify_updates),
                weight_format=str(cfg.rollout.weight_format), launch_restarts=int(s.launch_restarts))
