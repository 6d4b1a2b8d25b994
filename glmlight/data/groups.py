"""Group repair for grouped algorithms (GLM-5, Sec. 4: stale or crashed samples).

A group with more than half of its samples valid is padded back to its size by
repeating valid samples; otherwise the whole group is dropped.
"""

from __future__ import annotations

from collections import Counter

from glmlight.sample import Sample


def pad_or_drop_group(group: list[Sample], valid: list[bool], counts: Counter, reason: str) -> list[Sample] | None:
    """Returns the repaired group, or None if it is dropped. Counts what it removes:
    dropped/<reason> for invalid samples, dropped/group_<reason> for valid samples of a dropped group,
    padded/<reason> for repeats added."""
    if len(group) != len(valid):
        raise ValueError("group and valid flags differ in length")
    good = [s for s, ok in zip(group, valid) if ok]
    bad = len(group) - len(good)
    if bad == 0:
        return group
    counts[f"dropped/{reason}"] += bad
    if len(good) * 2 <= len(group):
        counts[f"dropped/group_{reason}"] += len(good)
        return None
    repeats = [good[i % len(good)] for i in range(bad)]
    counts[f"padded/{reason}"] += len(repeats)
    return good + repeats
