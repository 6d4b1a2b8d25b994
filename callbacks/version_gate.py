"""PolicyVersionGate: bounded staleness (GLM-5 Sec. 4).

A sample whose first action token was produced by version w0 is stale when
current − w0 > max_staleness; a compacted trajectory is stale when any of its
segments is. Stale trajectories are removed before the batch is built; a group with more than half of its samples fresh is padded back by
repeating fresh ones, otherwise the group is dropped. Drops are counted by
reason in the rollout metrics (`rollout/dropped/stale`, `.../group_stale`).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import lightning.pytorch as pl
from typing_extensions import override

from glmlight.groups import pad_or_drop_group
from glmlight.hooks import RLCallback
from glmlight.sample import Sample


class PolicyVersionGate(RLCallback):
    """Drops trajectories older than `max_staleness` policy versions before a batch is built
    (`on_rollout_samples`: the data module calls it with each round's samples and the policy version
    training is at).

    Args:
        max_staleness: τ; 0 keeps only samples of the current version, 1 (the default) allows the
            one-step-off-policy samples of `rollout.mode=async`.

    Raises:
        ValueError: if max_staleness < 0.
    """

    def __init__(self, max_staleness: int = 1):
        if max_staleness < 0:
            raise ValueError("PolicyVersionGate.max_staleness must be >= 0")
        self.max_staleness = max_staleness
        self.dropped: Counter = Counter()

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(max_staleness=self.max_staleness)

    def is_stale(self, sample: Sample, current: int) -> bool:
        w0 = sample.first_version
        return w0 >= 0 and current - w0 > self.max_staleness

    @override
    def on_rollout_samples(self, trainer: pl.Trainer, module: pl.LightningModule, samples: list[Sample],
                           counts: Counter, policy_version: int) -> list[Sample]:
        return self.filter(samples, counts, policy_version)

    def filter(self, samples: list[Sample], counts: Counter, current: int) -> list[Sample]:
        """Keep the samples fresh at policy version `current`, repairing or dropping groups; counts go
        into `counts`."""
        groups: dict[int, list[Sample]] = {}
        for s in samples:
            groups.setdefault(s.group_id, []).append(s)
        kept: list[Sample] = []
        local: Counter = Counter()
        for group in groups.values():
            repaired = pad_or_drop_group(group, lambda t: not any(self.is_stale(s, current) for s in t),
                                         local, "stale")
            if repaired is not None:
                kept.extend(repaired)
        counts.update(local)
        self.dropped.update(local)
        return kept

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"dropped": dict(self.dropped)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.dropped = Counter(state_dict.get("dropped", {}))
