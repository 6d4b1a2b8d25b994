"""Outcome-reward advantages and reward shaping for group-based algorithms."""

from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, normalize_std: bool = True,
                     eps: float = 1e-6, singleton: str = "zero") -> torch.Tensor:
    """Per-sample advantage [B] (float32) from rewards [B] and integer group ids [B].

    GRPO (Shao et al. 2024, arXiv 2402.03300, §4.1.2): A_i = (R_i − mean_g R) / (std_g R + eps);
    Dr.GRPO (Liu et al. 2025, arXiv 2503.20783, §3.1): A_i = R_i − mean_g R (normalize_std=False).

    std is the population std (divide by G). The GRPO paper writes std(r) without saying which;
    this is a choice (verl divides by G − 1, TRL by G − 1 too; the difference is a factor
    sqrt(G / (G − 1)) on every advantage of the group).

    A group whose rewards are all equal gets exactly 0 for every member, whatever the value
    and group size: the statistics are accumulated in float64 and an equal-reward group is
    detected by its min and max, so no rounding error of the mean survives to be divided by a
    std of the same size.

    singleton: what a group of one sample gets. "zero" (default): A = 0, no baseline exists.
    "raw": A = R (verl's convention for a group of one: mean 0, std 1), for terms such as MOPD's
    outcome reward with one sample per prompt, where a centred reward would be silently 0.
    """
    if singleton not in ("zero", "raw"):
        raise ValueError(f"group_advantages: singleton must be 'zero' or 'raw', got {singleton!r}")
    if rewards.numel() == 0:
        return rewards.float()
    r = rewards.detach().double()
    _, inverse = torch.unique(group_ids, return_inverse=True)
    inverse = inverse.to(r.device)
    n_groups = int(inverse.max()) + 1
    zeros = torch.zeros(n_groups, dtype=torch.float64, device=r.device)
    count = zeros.index_add(0, inverse, torch.ones_like(r))
    mean = zeros.index_add(0, inverse, r) / count
    lo = torch.full_like(zeros, float("inf")).scatter_reduce(0, inverse, r, "amin")
    hi = torch.full_like(zeros, float("-inf")).scatter_reduce(0, inverse, r, "amax")
    equal = (lo == hi)[inverse]
    centred = torch.where(equal, torch.zeros_like(r), r - mean[inverse])
    single = count[inverse] == 1
    if singleton == "raw":
        centred = torch.where(single, r, centred)
    if not normalize_std:
        return centred.float()
    var = zeros.index_add(0, inverse, centred.square()) / count
    std = torch.where(single, torch.ones_like(r), var.sqrt()[inverse])
    return (centred / (std + eps)).float()


def soft_overlong_penalty(lengths: torch.Tensor, max_len: int, cache_len: int) -> torch.Tensor:
    """DAPO (Yu et al. 2025, Eq. 13): 0 if |y| ≤ L_max − L_cache;
    ((L_max − L_cache) − |y|) / L_cache inside the cache window; −1 beyond L_max."""
    lengths = lengths.float()
    start = max_len - cache_len
    penalty = (start - lengths) / max(cache_len, 1)
    penalty = torch.where(lengths <= start, torch.zeros_like(penalty), penalty)
    return torch.where(lengths > max_len, torch.full_like(penalty, -1.0), penalty)
