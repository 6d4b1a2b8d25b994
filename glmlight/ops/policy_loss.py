"""Per-token policy-gradient losses. Each returns a per-token loss [B, T] (to be
aggregated by `ops.reduce.aggregate_loss`) and the per-token clip indicators."""

from __future__ import annotations

from typing import NamedTuple

import torch


class PolicyLossOutput(NamedTuple):
    loss: torch.Tensor  # [B, T]
    ratio: torch.Tensor  # [B, T] exp(log π_θ − log π_old)
    clipped: torch.Tensor  # [B, T] 1 where the clipped branch was taken
    dual_clipped: torch.Tensor  # [B, T] 1 where the dual clip bound was taken


def ppo_clip_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                  eps_low: float, eps_high: float, dual_clip_c: float | None = None) -> PolicyLossOutput:
    """PPO clipped surrogate with clip-higher (DAPO) and optional dual clip.

    L = max(−r·A, −clip(r, 1 − ε_low, 1 + ε_high)·A)   (Schulman et al. 2017; DAPO Eq. 10)
    dual clip, A < 0: L = min(L, −c·A)                  (Ye et al. 2020; slime eps_clip_c)
    """
    log_ratio = (logprobs - old_logprobs).clamp(-20.0, 20.0)
    ratio = log_ratio.exp()
    unclipped = -ratio * advantages
    clipped = -ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * advantages
    loss = torch.maximum(unclipped, clipped)
    clip_taken = (clipped > unclipped).float()
    dual = torch.zeros_like(loss)
    if dual_clip_c is not None:
        if dual_clip_c <= 1.0:
            raise ValueError(f"dual_clip_c must be > 1, got {dual_clip_c}")
        bound = -dual_clip_c * advantages
        dual = ((advantages < 0) & (loss > bound)).float()
        loss = torch.where(advantages < 0, torch.minimum(loss, bound), loss)
    return PolicyLossOutput(loss, ratio.detach(), clip_taken, dual)
