"""Group repair for grouped algorithms (GLM-5, Sec. 4: stale or crashed samples).

A group holds the trajectories of one prompt; a trajectory is one sample, or the
segments of one compacted episode (same rollout_id), and is kept or removed as a
whole. A group with more than half of its trajectories valid is padded back to
its size by repeating valid ones; otherwise the whole group is dropped.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable

from glmlight.sample import Sample


def trajectories(group: list[Sample]) -> list[list[Sample]]:
    """The group's samples by rollout_id, segments in order, trajectories in first-seen order."""
    out: dict[int, list[Sample]] = {}
    for s in group:
        out.setdefault(s.rollout_id, []).append(s)
    return [sorted(t, key=lambda s: s.segment) for t in out.values()]


def pad_or_drop_group(group: list[Sample], is_valid: Callable[[list[Sample]], bool], counts: Counter,
                      reason: str, reason_of: Callable[[list[Sample]], str] | None = None) -> list[Sample] | None:
    """Returns the repaired group (as samples), or None if it is dropped. Counts samples:
    dropped/<reason> for invalid ones (dropped/<reason_of(trajectory)> when given),
    dropped/group_<reason> for valid ones of a dropped group, padded/<reason> for repeats added.
    Dropped samples get metadata["drop_reason"] (the sample table shows it)."""
    trajs = trajectories(group)
    valid = [t for t in trajs if is_valid(t)]
    invalid = [t for t in trajs if not is_valid(t)]
    if not invalid:
        return group
    for t in invalid:
        why = reason_of(t) if reason_of else reason
        counts[f"dropped/{why}"] += len(t)
        tag_dropped(t, why)
    if len(valid) * 2 <= len(trajs):
        counts[f"dropped/group_{reason}"] += sum(len(t) for t in valid)
        tag_dropped([s for t in valid for s in t], f"group_{reason}")
        return None
    repeats = [valid[i % len(valid)] for i in range(len(invalid))]
    counts[f"padded/{reason}"] += sum(len(t) for t in repeats)
    return [s for t in valid + repeats for s in t]


def tag_dropped(samples: list[Sample], reason: str) -> list[Sample]:
    """Mark samples as dropped for `reason` (metadata["drop_reason"]); returns them."""
    for s in samples:
        s.metadata["drop_reason"] = reason
    return samples
