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

from glmlight.data.groups import pad_or_drop_group
from glmlight.sample import Sample


class PolicyVersionGate(pl.Callback):
    def __init__(self, max_staleness: int = 1):
        if max_staleness < 0:
            raise ValueError("PolicyVersionGate.max_staleness must be >= 0")
        self.max_staleness = max_staleness
        self.dropped: Counter = Counter()
        self._module: pl.LightningModule | None = None

    def setup(self, trainer: pl.Trainer, module: pl.LightningModule, stage: str) -> None:
        dm = trainer.datamodule
        if dm is None or not hasattr(dm, "filters"):
            raise RuntimeError("PolicyVersionGate needs a RolloutDataModule")
        if self.filter not in dm.filters:
            dm.filters.append(self.filter)
        self._module = module

    @property
    def state_key(self) -> str:
        return self._generate_state_key(max_staleness=self.max_staleness)

    def is_stale(self, sample: Sample, current: int) -> bool:
        w0 = sample.first_version
        return w0 >= 0 and current - w0 > self.max_staleness

    def filter(self, samples: list[Sample], counts: Counter, current: int | None = None) -> list[Sample]:
        """Keep fresh samples, repairing or dropping groups; counts go into `counts`."""
        if current is None:
            if self._module is None:
                raise RuntimeError("PolicyVersionGate is not attached to a trainer; pass current=")
            current = self._module.policy_version
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

    def state_dict(self) -> dict[str, Any]:
        return {"dropped": dict(self.dropped)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.dropped = Counter(state_dict.get("dropped", {}))
