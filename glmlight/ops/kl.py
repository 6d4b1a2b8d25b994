"""KL estimators between the policy and a reference, per token (Schulman 2020, "Approximating KL")."""

from __future__ import annotations

import torch


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3",
               clamp: float | None = 10.0) -> torch.Tensor:
    """Per-token estimate of KL(π_θ || π_ref) from samples of π_θ, lr = log π_θ − log π_ref.

    k1 = lr; k2 = lr² / 2; k3 = exp(−lr) − 1 + lr (unbiased, low variance, ≥ 0).
    """
    lr = logprobs - ref_logprobs
    if estimator == "k1":
        kl = lr
    elif estimator == "k2":
        kl = 0.5 * lr.pow(2)
    elif estimator == "k3":
        kl = torch.exp(-lr) - 1.0 + lr
    else:
        raise ValueError(f"unknown KL estimator {estimator!r} (k1, k2 or k3)")
    return kl.clamp(-clamp, clamp) if clamp is not None else kl
