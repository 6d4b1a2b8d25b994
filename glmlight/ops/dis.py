"""Direct Double-sided Importance Sampling (DIS), GLM-5's policy loss for SAO.

r_t = π_θ(y_t) / π_rollout(y_t); f(x) = x if 1 − ε_low < x < 1 + ε_high else 0;
L = −E_t[f(r_t)·Â_t·log π_θ(y_t)] with f(r) detached. Because f(r) = r is a
constant in the loss, the gradient inside the window is
−r·Â·∇log π_θ = −Â·∇π_θ / π_rollout: the unclipped importance-sampled policy
gradient; tokens outside the window contribute nothing.
"""

from __future__ import annotations

import torch
from torch import Tensor


def dis_mask(logprobs: Tensor, rollout_logprobs: Tensor, eps_low: float, eps_high: float) -> Tensor:
    """Trust-window mask: 1 where 1 − eps_low < r < 1 + eps_high (strict), else 0.

    logprobs, rollout_logprobs: [B, T]; r = exp(logprobs − rollout_logprobs),
    computed detached. Returns float32 [B, T] 0/1 (NaN log-probs give 0).
    """
    # GLM-5 (arXiv 2602.15763) Eq. 3–5: the f-window of DIS.
    r = _ratio(logprobs, rollout_logprobs)
    return ((r > 1.0 - eps_low) & (r < 1.0 + eps_high)).float()


def dis_loss_per_token(
    logprobs: Tensor, rollout_logprobs: Tensor, advantages: Tensor, eps_low: float, eps_high: float
) -> tuple[Tensor, Tensor]:
    """Per-token DIS loss −f(r)·Â·log π_θ and the window mask; all tensors [B, T].

    logprobs carry the gradient (current policy); rollout_logprobs and
    advantages are constants. f(r) = r·mask is detached, so
    d loss / d logprobs = −r·Â inside the window and 0 outside. Aggregation
    over tokens (and the loss mask) is left to the caller.
    """
    # GLM-5 (arXiv 2602.15763) Eq. 3–5; f(r) detached, so the gradient inside the window is −r·Â·∇log π_θ.
    window = dis_mask(logprobs, rollout_logprobs, eps_low, eps_high)
    r = _ratio(logprobs, rollout_logprobs)
    f = torch.where(window.bool(), r, torch.zeros_like(r))
    loss = -f * advantages.detach().float() * logprobs.float()
    return loss, window


def _ratio(logprobs: Tensor, rollout_logprobs: Tensor) -> Tensor:
    """Detached r = exp(logprobs − rollout_logprobs), log-ratio clamped to ±20. [B, T]."""
    return (logprobs.detach().float() - rollout_logprobs.detach().float()).clamp(-20.0, 20.0).exp()
