"""The RolloutEngine protocol: token ids in, token ids and log-probs out.

Every engine (embedded, SGLang, vLLM) owns its own copy of the weights; only
`update_weights` moves weights into it, and `version` changes only when the
engine has acknowledged the new weights.

Beyond the protocol an engine may have optional abilities, each declared here as a protocol of its
own; callers ask `isinstance(engine, Ability)` (or `can_score_at_temperature`) instead of guessing:

- `CapturesReplay`: returns replay records (`algo.replay`, the agreement monitors);
- `HasState`: its sampling state is saved with checkpoints, so a resumed run samples as the
  uninterrupted one would;
- `HoldsModel`: its torch model lives in this process (the agreement monitors' prefill);
- `SendsFp8Weights`: `update_weights` takes the block-FP8 checkpoint layout (`rollout.weight_format=fp8`);
- `SeedsSampling`: says whether a request's seed fixes its samples (an engine that does not say: it does),
  so a resumed run is told when its samples cannot repeat the interrupted run's;
- `score(..., temperature=)`: prefill log-probs at a temperature (OPD teachers; `can_score_at_temperature`);
- `filter_order`: how it combines top-k and top-p ("sequential", glmlight's definition, or "joint", as
  SGLang samples; `filter_order_of`), so the trainer scores its rollouts over the same kept set.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Iterable, Protocol, Sequence, runtime_checkable

import torch

from glmlight.sample import Status


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 64
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None  # per-request seed; None = engine's own stream

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be >= 0, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass
class Generation:
    """One engine answer. `logprobs[i]` is the log-prob of `token_ids[i]` under the
    distribution the engine sampled it from; `versions[i]` the weights that produced it.
    `routed_experts` / `indexer_topk`: the replay records of prompt + output, in the layout of
    `Sample`'s fields of these names (None unless the engine was asked to capture them)."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length" | "abort" | "error" (the engine failed this request)
    versions: list[int]
    routed_experts: torch.Tensor | None = None
    indexer_topk: torch.Tensor | None = None

    @property
    def status(self) -> Status:
        return finish_reason_to_status(self.finish_reason)


def finish_reason_to_status(reason: str) -> Status:
    try:
        return {"stop": Status.COMPLETED, "length": Status.TRUNCATED, "abort": Status.ABORTED,
                "error": Status.FAILED}[reason]
    except KeyError:
        raise ValueError(f"unknown finish_reason {reason!r} (expected stop, length, abort or error)") from None


NamedTensors = Iterable[tuple[str, torch.Tensor]]

# The finish reasons a server may report for a finished request.
SERVER_FINISH_REASONS = ("stop", "length", "abort")


def normalize_requests(prompts: list[list[int]], params: SamplingParams | Sequence[SamplingParams]
                       ) -> list[SamplingParams]:
    """One SamplingParams per prompt; rejects a count mismatch and empty prompts."""
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    if len(params) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt {i} is empty")
    return list(params)


@runtime_checkable
class RolloutEngine(Protocol):
    @property
    def version(self) -> int:
        """The policy version of the weights the engine serves now."""

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[Generation]:
        """Generate one answer per prompt (token ids), in order."""

    def score(self, prompts: list[list[int]], completions: list[list[int]]) -> list[list[float]]:
        """Prefill: log-prob of each completion token given its prompt (teacher log-probs, probes)."""

    def update_weights(
        self, named_tensors: NamedTensors | None = None, *, path: str | None = None, version: int
    ) -> None:
        """Load new weights (tensors, or a safetensors checkpoint path); then serve `version`."""

    def close(self) -> None:
        """Release the engine's resources."""


# ------------------------------------------------------------------------------------- optional abilities
@runtime_checkable
class CapturesReplay(Protocol):
    def capture_replay(self, routing: bool = False, index: bool = False) -> None:
        """From now on return the replay records asked for with every generation (`Generation.routed_experts`
        / `.indexer_topk`); raises when the engine or its servers cannot."""


@runtime_checkable
class HasState(Protocol):
    def state_dict(self) -> dict[str, Any]:
        """The engine's sampling state (its seed stream, counters): saved with the run's checkpoints."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a `state_dict` (a resumed run samples as the uninterrupted one would)."""


@runtime_checkable
class HoldsModel(Protocol):
    model: Any  # the engine's torch.nn.Module, in this process


@runtime_checkable
class SendsFp8Weights(Protocol):
    sends_fp8_weights: bool  # True: update_weights takes the block-FP8 checkpoint layout


@runtime_checkable
class SeedsSampling(Protocol):
    seeded_sampling: bool  # False: per-request seeds do not fix the samples (SGLang without deterministic inference)


@runtime_checkable
class SharedFleet(Protocol):
    """An engine that every data-parallel rank reaches as a client of one fleet of servers: one rank owns it
    (launches it, pushes the weights into it); the others only adopt each version the owner pushed."""

    owns_fleet: bool

    def adopt_version(self, version: int) -> None: ...


def can_score_at_temperature(engine: Any) -> bool:
    """Whether `engine.score` takes a `temperature` (servers score at temperature 1 only)."""
    score = getattr(engine, "score", None)
    return callable(score) and "temperature" in inspect.signature(score).parameters


def filter_order_of(engine: object) -> str:
    """How the engine combines top-k and top-p when both are on (its `filter_order`: "sequential" or
    "joint", glmlight/ops/logprobs.py); an engine that does not say samples as glmlight's own: sequential."""
    return str(getattr(engine, "filter_order", "sequential"))
