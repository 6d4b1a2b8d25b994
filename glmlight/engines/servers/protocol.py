"""What the fleet (fleet.py) and a backend's parts say to each other.

- `ServerAdapter`: one server of one backend (one URL): generation and scoring in the backend's wire
  format, pause, flush, resume, the weight version it reports (its label), whether it is up. vLLM's is
  vllm/adapter.py, SGLang's sglang/adapter.py.
- `WeightSync`: a backend's weight-sync transport: gives a set of servers new weights, all or none
  (a process group or a two-phase commit spans every server of an update, so it takes them together).
- `Answer` (one server answer), `Source` (where one version's weights can be had again), the two ways
  an update can fail (`UpdateFailed`: every server is back on the previous version; `FleetFailed`: they
  are not), and the sampling fields SGLang and vLLM spell alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

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


class ServerAdapter(Protocol):
    """One server of a backend, at `url`. Calls are coroutines run on the fleet's HTTP loop; a failure
    is a one-line EngineError. `route` (a `http.UrlPool`) sends a request wherever the fleet routes
    generation (least-loaded server per attempt, or the router); without it the request goes to `url`."""

    url: str
    health_path: str  # what the fleet polls (GET) until the server is ready

    async def generate(self, rid: str, prompt: list[int], params: SamplingParams, route: Any = None) -> Answer:
        """One generation, with the log-probs of the distribution each token was sampled from."""

    async def score(self, rid: str, prompt: list[int], completion: list[int], route: Any = None) -> list[float]:
        """The prefill log-probs of `completion` after `prompt`, at temperature 1."""

    async def pause(self) -> None:
        """Stop generating; requests in flight come back `abort` with their partial answers."""

    async def flush(self) -> None:
        """Drop cached prefixes (computed with the previous weights)."""

    async def resume(self) -> None:
        """Generate again."""

    async def label(self) -> str | None:
        """The weight-version label the server reports now."""

    async def alive(self) -> None:
        """Raise EngineError unless the server answers (also while it is paused)."""

    def labels_answers(self) -> bool:
        """Whether each answer carries the weight version it came from (else the fleet asks `label`
        before every call)."""


class WeightSync(Protocol):
    """A backend's weight-sync transport (vllm/sync.py, sglang/sync.py)."""

    last_seconds: dict[str, float]  # what the last update's stages took (what the servers measured included)
    last_bytes: dict[str, int]  # what the last update sent (delta sync), else {}

    def check(self, servers: Sequence[Any]) -> None:
        """Raise a one-line EngineError if these servers cannot take weight updates at all."""

    def push(self, servers: Sequence[Any], named: list | None, path: str | None, version: int,
             current: Source) -> Source:
        """Give every server the new weights (paused and flushed by the fleet around it), or raise
        UpdateFailed with every server back on `current` (FleetFailed if that is impossible). Returns where
        the new version's weights can be had again."""

    def resync_targets(self, server: Any, servers: Sequence[Any]) -> list:
        """The servers a re-sync of `server` (it restarted) must push to, of the fleet's `servers`."""

    def close(self, servers: Sequence[Any]) -> None:
        """Release what the transport holds (a process group, shared-memory slots); must not fail."""


def sampling_fields(p: SamplingParams) -> dict[str, Any]:
    """The sampling fields SGLang and vLLM spell alike (top_k -1 = off for both)."""
    return {"temperature": p.temperature, "top_p": p.top_p, "top_k": p.top_k if p.top_k > 0 else -1,
            "stop_token_ids": list(p.stop_token_ids), "skip_special_tokens": False}
