"""Outcome-reward advantages and reward shaping for group-based algorithms."""

from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, normalize_std: bool = True,
                     eps: float = 1e-6) -> torch.Tensor:
    """Per-sample advantage [B] from rewards [B] and integer group ids [B].

    GRPO (Shao et al. 2024): A_i = (R_i − mean_g R) / (std_g R + eps);
    Dr.GRPO (Liu et al. 2025): A_i = R_i − mean_g R (normalize_std=False).
    std is the population std (divide by G), as in the GRPO formula.
    """
    rewards = rewards.float()
    _, inverse = torch.unique(group_ids, return_inverse=True)
    n_groups = int(inverse.max()) + 1
    count = torch.zeros(n_groups).index_add_(0, inverse, torch.ones_like(rewards))
    mean = torch.zeros(n_groups).index_add_(0, inverse, rewards) / count
    centred = rewards - mean[inverse]
    if not normalize_std:
        return centred
    var = torch.zeros(n_groups).index_add_(0, inverse, centred**2) / count
    return centred / (var.sqrt()[inverse] + eps)


def soft_overlong_penalty(lengths: torch.Tensor, max_len: int, cache_len: int) -> torch.Tensor:
    """DAPO (Yu et al. 2025, Eq. 13): 0 if |y| ≤ L_max − L_cache;
    ((L_max − L_cache) − |y|) / L_cache inside the cache window; −1 beyond L_max."""
    lengths = lengths.float()
    start = max_len - cache_len
    penalty = (start - lengths) / max(cache_len, 1)
    penalty = torch.where(lengths <= start, torch.zeros_like(penalty), penalty)
    return torch.where(lengths > max_len, torch.full_like(penalty, -1.0), penalty)
