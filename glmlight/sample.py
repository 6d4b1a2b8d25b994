"""The action contract (TITO): a `Sample` is one trajectory as exact token ids.

Nothing downstream of the engine ever decodes and re-encodes text to recover an
action. A `Sample` holds the prompt ids the engine saw and the response ids it
produced (plus, for agents, observation ids spliced in with loss_mask 0), the
engine's log-prob of every response token, and the policy version that produced
each token. `Experience` is a padded batch of samples: the tensors an algorithm
trains on.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields
from typing import Any, Iterable

import torch


class Status(str, enum.Enum):
    COMPLETED = "completed"  # the engine stopped on a stop token
    TRUNCATED = "truncated"  # hit max_new_tokens or the context budget
    ABORTED = "aborted"  # the engine aborted the request (e.g. a weight update)
    FAILED = "failed"  # reward, environment or engine failure: never trained on


class SampleError(ValueError):
    """A sample whose fields disagree; the message names the field."""


@dataclass
class Sample:
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    # Per response token: 1 = the policy's own action (trained on), 0 = observation / template.
    loss_mask: list[int] = field(default_factory=list)
    # Per response token: the engine's log-prob of that token (0.0 where loss_mask is 0).
    rollout_logprobs: list[float] = field(default_factory=list)
    # Per response token: the policy version that produced it (-1 for observation tokens).
    versions: list[int] = field(default_factory=list)
    reward: float | None = None
    status: Status = Status.COMPLETED
    group_id: int = 0
    rollout_id: int = 0
    segment: int = 0
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.status = Status(self.status)
        self.validate()

    def validate(self) -> "Sample":
        if not self.prompt_ids:
            raise SampleError("Sample.prompt_ids is empty")
        n = len(self.response_ids)
        for name in ("loss_mask", "rollout_logprobs", "versions"):
            got = len(getattr(self, name))
            if got != n:
                raise SampleError(
                    f"Sample.{name} has {got} entries but response_ids has {n} (rollout_id={self.rollout_id})"
                )
        if any(m not in (0, 1) for m in self.loss_mask):
            raise SampleError(f"Sample.loss_mask must hold 0/1 only (rollout_id={self.rollout_id})")
        return self

    @property
    def response_length(self) -> int:
        return len(self.response_ids)

    @property
    def num_action_tokens(self) -> int:
        return int(sum(self.loss_mask))

    @property
    def first_version(self) -> int:
        """w0: the version of the first action token (the oldest weights that acted)."""
        acted = [v for v, m in zip(self.versions, self.loss_mask) if m]
        return min(acted) if acted else -1

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["status"] = self.status.value
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Sample":
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise SampleError(f"Sample has no field(s) {sorted(unknown)}")
        return cls(**d)


@dataclass
class Experience:
    """A padded batch. Prompts are left-padded to P, responses right-padded to T.

    input_ids / attention_mask: [B, P + T]; every response tensor is [B, T] and
    position t of the response is predicted by the logits at column P + t - 1.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    response_mask: torch.Tensor  # 1 on real response tokens (actions and observations)
    loss_mask: torch.Tensor  # 1 on action tokens that are trained on; corrections may zero more
    action_mask: torch.Tensor  # 1 on the policy's own tokens as produced (never changed by corrections)
    rollout_logprobs: torch.Tensor
    versions: torch.Tensor
    rewards: torch.Tensor  # [B]
    prompt_length: int
    samples: list[Sample]
    # Filled in by algorithms and callbacks.
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    teacher_logprobs: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    values: torch.Tensor | None = None
    # Per-token weight from importance corrections (1 = untouched), composed by callbacks:
    # weights multiply; a correction that removes a token from the loss zeroes loss_mask,
    # one that keeps it in the denominator zeroes only its weight.
    token_weights: torch.Tensor | None = None
    stats: dict[str, float] = field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def response_length(self) -> int:
        return self.response_mask.shape[1]

    @property
    def response_ids(self) -> torch.Tensor:
        return self.input_ids[:, self.prompt_length :]

    def to(self, device: torch.device | str) -> "Experience":
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor):
                setattr(self, f.name, v.to(device))
        return self

    def select(self, index: torch.Tensor | list[int]) -> "Experience":
        """Rows `index` as a new Experience (used for minibatches)."""
        idx = torch.as_tensor(index, dtype=torch.long)
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor):
                out[f.name] = v[idx.to(v.device)]
            elif f.name == "samples":
                out[f.name] = [v[i] for i in idx.tolist()]
            elif f.name == "stats":
                out[f.name] = dict(v)
            else:
                out[f.name] = v
        return Experience(**out)

    @classmethod
    def collate(cls, samples: Iterable[Sample], pad_token_id: int) -> "Experience":
        samples = list(samples)
        if not samples:
            raise SampleError("cannot collate an empty list of samples")
        for s in samples:
            s.validate()
            if s.status is Status.FAILED:
                raise SampleError(f"FAILED sample (rollout_id={s.rollout_id}) reached collate")
        P = max(len(s.prompt_ids) for s in samples)
        T = max(1, max(s.response_length for s in samples))

        def padded(rows: Iterable[list], fill: Any, dtype: torch.dtype) -> torch.Tensor:
            # one tensor from right-padded Python rows: far cheaper than a copy per row
            return torch.tensor([row + [fill] * (T - len(row)) for row in rows], dtype=dtype)

        prompts = torch.tensor([[pad_token_id] * (P - len(s.prompt_ids)) + s.prompt_ids for s in samples],
                               dtype=torch.long)
        input_ids = torch.cat([prompts, padded((s.response_ids for s in samples), pad_token_id, torch.long)], 1)
        lengths = torch.tensor([[len(s.prompt_ids), s.response_length] for s in samples])
        column = torch.arange(P + T)
        attention_mask = ((column >= P - lengths[:, :1]) & (column < P + lengths[:, 1:])).long()
        response_mask = (column[:T] < lengths[:, 1:]).float()
        loss_mask = padded((s.loss_mask for s in samples), 0, torch.float32)
        rollout_logprobs = padded((s.rollout_logprobs for s in samples), 0.0, torch.float32)
        versions = padded((s.versions for s in samples), -1, torch.long)
        rewards = torch.tensor([float(s.reward) if s.reward is not None else 0.0 for s in samples])
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        return cls(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            response_mask=response_mask,
            loss_mask=loss_mask,
            action_mask=loss_mask.clone(),
            rollout_logprobs=rollout_logprobs,
            versions=versions,
            rewards=rewards,
            prompt_length=P,
            samples=samples,
        )
