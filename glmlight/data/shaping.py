"""Length shaping of a round's samples before grouping (DAPO, arXiv:2503.14476 §3.4): mask the loss of
truncated responses, or add the soft overlong penalty to their rewards."""

from __future__ import annotations

from collections import Counter

import torch

from glmlight.ops.advantages import soft_overlong_penalty
from glmlight.sample import Sample, Status


def apply_overlong(samples: list[Sample], mode: str, max_new_tokens: int, cache: int, counts: Counter) -> None:
    """rollout.overlong: "mask" zeroes the loss mask of truncated samples (counted `overlong_masked`);
    "soft_penalty" adds the penalty of the length that max_new_tokens bounds — a single-turn sample's
    response, an agent episode's longest action turn (observations and the other turns do not count
    against a turn's budget) — to every scored sample's reward (kept in metadata["overlong_penalty"])."""
    if mode == "mask":
        for s in samples:
            if s.status is Status.TRUNCATED:
                s.loss_mask = [0] * s.response_length
                counts["overlong_masked"] += 1
    elif mode == "soft_penalty":
        scored = [s for s in samples if s.reward is not None]
        if scored:
            lengths = torch.tensor([max(s.metadata.get("action_lengths") or [s.response_length]) for s in scored])
            pen = soft_overlong_penalty(lengths, max_new_tokens, cache)
            for s, p in zip(scored, pen.tolist()):
                s.reward += p
                s.metadata["overlong_penalty"] = p
