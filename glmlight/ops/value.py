"""Critic-side math: terminal rewards on tokens and the (clipped) value loss."""

from __future__ import annotations

import torch


def terminal_rewards(rewards: torch.Tensor, action_mask: torch.Tensor) -> torch.Tensor:
    """Place each sequence's scalar reward [B] on its last action token: [B, T] (zeros elsewhere).

    Outcome-reward RL with a critic (PPO/VAPO/SAO): r_t = R at the final action token, 0 before.
    """
    T = action_mask.shape[1]
    positions = torch.arange(T, device=action_mask.device).expand_as(action_mask)
    last = torch.where(action_mask > 0, positions, torch.full_like(positions, -1)).max(dim=1).values
    out = torch.zeros_like(action_mask, dtype=torch.float32)
    has = last >= 0
    out[has.nonzero().squeeze(-1), last[has]] = rewards[has].float()
    return out


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip: float | None = None) -> torch.Tensor:
    """Masked value loss ½·E[(V − R)²]; with clip c (PPO, Schulman et al. 2017 impl.):
    ½·E[max((V − R)², (V_old + clip(V − V_old, −c, c) − R)²)]."""
    err = (values - returns) ** 2
    if clip is not None:
        clipped = old_values + (values - old_values).clamp(-clip, clip)
        err = torch.maximum(err, (clipped - returns) ** 2)
    return 0.5 * (err * mask).sum() / mask.sum().clamp(min=1.0)
