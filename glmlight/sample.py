"""The action contract (TITO): a `Sample` is one trajectory as exact token ids.

Nothing downstream of the engine ever decodes and re-encodes text to recover an
action. A `Sample` holds the prompt ids the engine saw and the response ids it
produced (plus, for agents, observation ids spliced in with loss_mask 0), the
engine's log-prob of every response token, and the policy version that produced
each token. `Experience` is a padded batch of samples: the tensors an algorithm
trains on.

Replay records (the model and sparse contracts, docs/contracts.md): when asked for them, the engine
records its discrete choices for every token it ran through the model, prompt and response, i.e.
positions 0 .. len(prompt) + len(response) - 2 (the last sampled token is never run):

- `routed_experts` [n, L_moe, k]: the expert ids each MoE layer chose (L_moe = the MoE layers in
  order, k = experts per token); uint8 when there are at most 256 experts, else int16;
- `indexer_topk` [m, L_ix, k_ix]: the key positions each DSA layer that runs its own indexer
  selected, ascending, for the query positions k_ix .. n - 1 only (m = max(0, n - k_ix); a query
  before position k_ix has at most k_ix keys and selects them all); int16 below 32768 positions,
  else int32.

n may stop early (before trailing tokens no trained token depends on, e.g. an agent's last
observation); a record without gaps from position 0 is all replay needs. Both are None when nobody
asked (the default).

Per-turn sampling (`metadata[SAMPLING_KEY]`): when some of a sample's tokens were drawn with other
settings than the run's (the agent gateway's `client_sampling`), the sample lists them as
`[start, end, temperature, top_k, top_p]` ranges of response positions; `Experience.sampling` holds
them per token, and the trainer scores those tokens at them (glmlight/algorithms/scoring.py). Tokens
outside every range were drawn with the run's settings.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields
from typing import Any, Iterable

import torch

EXPERT_DTYPES = (torch.uint8, torch.int16, torch.int32)
POSITION_DTYPES = (torch.int16, torch.int32)
SAMPLING_KEY = "sampling"  # metadata: [[start, end, temperature, top_k, top_p], ...] (module docstring)


def expert_dtype(num_experts: int) -> torch.dtype:
    """The smallest dtype of routed-expert records for a model with `num_experts` routed experts."""
    return torch.uint8 if num_experts <= 256 else torch.int16 if num_experts <= 2**15 else torch.int32


def position_dtype(num_positions: int) -> torch.dtype:
    """The smallest dtype of DSA top-k records for sequences of `num_positions` tokens."""
    return torch.int16 if num_positions <= 2**15 else torch.int32


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
    # Replay records (module docstring); equality ignores them (compare with torch.equal).
    routed_experts: torch.Tensor | None = field(default=None, compare=False)
    indexer_topk: torch.Tensor | None = field(default=None, compare=False)

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
        if self.routed_experts is not None or self.indexer_topk is not None:
            self._validate_records()
        return self

    def _validate_records(self) -> None:
        ran = len(self.prompt_ids) + len(self.response_ids) - 1  # positions the engine ran
        where = f"(rollout_id={self.rollout_id})"
        r = self.routed_experts
        if r is not None:
            if not isinstance(r, torch.Tensor) or r.dim() != 3 or r.dtype not in EXPERT_DTYPES:
                raise SampleError(f"Sample.routed_experts must be a [positions, moe_layers, k] uint8/int16/int32 "
                                  f"tensor {where}")
            if r.shape[0] > ran:
                raise SampleError(f"Sample.routed_experts has {r.shape[0]} positions but the engine ran {ran} {where}")
            if r.numel() and int(r.min()) < 0:
                raise SampleError(f"Sample.routed_experts holds a negative expert id {where}")
        ix = self.indexer_topk
        if ix is not None:
            if not isinstance(ix, torch.Tensor) or ix.dim() != 3 or ix.dtype not in POSITION_DTYPES:
                raise SampleError(f"Sample.indexer_topk must be a [positions, indexer_layers, k] int16/int32 tensor "
                                  f"{where}")
            k = ix.shape[2]
            if ix.shape[0] > max(0, ran - k):
                raise SampleError(f"Sample.indexer_topk has {ix.shape[0]} query positions from position {k} but the "
                                  f"engine ran {ran} {where}")
            if ix.numel():
                query = torch.arange(k, k + ix.shape[0])[:, None, None]
                if int(ix.min()) < 0 or bool((ix.long() > query).any()):
                    raise SampleError(f"Sample.indexer_topk selects a key outside [0, query position] {where}")

    def record_positions(self) -> tuple[int | None, int | None]:
        """How many leading positions the routing and the index records cover (None: no record);
        an index record covers every position before k_ix as well."""
        r, ix = self.routed_experts, self.indexer_topk
        return (None if r is None else r.shape[0], None if ix is None else ix.shape[2] + ix.shape[0])

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
    # Replay records in the padded layout (None when no sample has one): [B, P + T, L, k], -1 at
    # columns without a record. routed_experts: expert ids (int16); indexer_topk: the selected key
    # *columns* of this layout (int32), for query columns at positions >= k only.
    routed_experts: torch.Tensor | None = None
    indexer_topk: torch.Tensor | None = None
    # The sampling each response token was drawn with, where it is not the run's (module docstring):
    # [B, T, 3] float32 (temperature, top_k, top_p), NaN where the run's settings apply; None when
    # every token of the batch was drawn with the run's settings (the common case).
    sampling: torch.Tensor | None = None

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
        offsets = [P - len(s.prompt_ids) for s in samples]
        return cls(
            routed_experts=_padded_records(samples, offsets, P + T, "routed_experts"),
            indexer_topk=_padded_records(samples, offsets, P + T, "indexer_topk"),
            sampling=_padded_sampling(samples, T),
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


def _padded_sampling(samples: list[Sample], T: int) -> torch.Tensor | None:
    """The per-turn sampling ranges of `samples` (metadata[SAMPLING_KEY]) per token: [B, T, 3] float32,
    NaN outside every range; None when no sample has a range."""
    if not any(s.metadata.get(SAMPLING_KEY) for s in samples):
        return None
    out = torch.full((len(samples), T, 3), float("nan"))
    for b, s in enumerate(samples):
        for r in s.metadata.get(SAMPLING_KEY) or ():
            start, end, *setting = r
            if len(setting) != 3 or not 0 <= start <= end <= s.response_length:
                raise SampleError(f"Sample.metadata[{SAMPLING_KEY!r}] has a range {r!r} outside the response's "
                                  f"{s.response_length} tokens or not [start, end, temperature, top_k, top_p] "
                                  f"(rollout_id={s.rollout_id})")
            out[b, int(start):int(end)] = torch.tensor(setting, dtype=torch.float32)
    return out


def _padded_records(samples: list[Sample], offsets: list[int], S: int, name: str) -> torch.Tensor | None:
    """One record field of `samples` in the padded layout [B, S, L, k] (-1 where a sample has no record),
    or None when no sample has one. Index records become key columns (position + the row's offset)."""
    recs = [getattr(s, name) for s in samples]
    shapes = {tuple(r.shape[1:]) for r in recs if r is not None}
    if not shapes:
        return None
    if len(shapes) > 1:
        raise SampleError(f"Sample.{name} records of different shapes {sorted(shapes)} in one batch")
    L, k = shapes.pop()
    index = name == "indexer_topk"
    out = torch.full((len(samples), S, L, k), -1, dtype=torch.int32 if index else torch.int16)
    for b, (r, off) in enumerate(zip(recs, offsets)):
        if r is None or not len(r):
            continue
        first = off + (k if index else 0)  # the column of the record's first query position
        out[b, first:first + len(r)] = r.to(out.dtype) + off if index else r.to(out.dtype)
    return out
