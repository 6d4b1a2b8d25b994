"""KL estimators between the policy and a reference, per token (Schulman 2020, "Approximating KL
Divergence", http://joschu.net/blog/kl-approx.html).

With lr = log π_θ(y) − log π_ref(y) for tokens y sampled from π_θ:

  k1 = lr                   unbiased for KL(π_θ ‖ π_ref); high variance, can be negative.
  k2 = lr² / 2              biased, low variance, ≥ 0.
  k3 = exp(−lr) − 1 + lr    unbiased, low variance, ≥ 0.

What each gives as a LOSS term (its gradient in expectation over y ~ π_θ, with the samples'
distribution held fixed as in on-policy RL code): k1's gradient is ∇log π_θ, whose expectation is
0 (it adds noise, no pull towards π_ref); k2's is lr·∇log π_θ, exactly ∇KL(π_θ ‖ π_ref) (the
reverse-KL gradient); k3's is (1 − π_ref/π_θ)·∇log π_θ, whose expectation is ∇KL(π_ref ‖ π_θ)
(the forward-KL gradient), not the reverse-KL gradient.
"""

from __future__ import annotations

import torch

K3_LOG_RATIO_CLAMP = 20.0  # exp(20) ≈ 4.9e8: finite; exp(−lr) overflows float32 below lr ≈ −88
K3_MAX = 10.0  # k3's value cap (slime and verl clamp low_var_kl to [−10, 10])


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3",
               clamp: float | None = None) -> torch.Tensor:
    """Per-token estimate of KL(π_θ ‖ π_ref) from samples of π_θ; [B, T] -> [B, T].

    k3 clamps lr to ±20 before the exp and its value to ≤ 10, as slime's and verl's low_var_kl
    do, so a very negative log-ratio anywhere (padding included) cannot overflow into a NaN
    gradient. k1 and k2 are not clamped (they have no exp). `clamp`: an extra bound |kl| ≤ clamp
    on any estimator (None: none).
    """
    lr = logprobs - ref_logprobs
    if estimator == "k1":
        kl = lr
    elif estimator == "k2":
        kl = 0.5 * lr.pow(2)
    elif estimator == "k3":
        lr = lr.clamp(-K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP)
        kl = (torch.exp(-lr) - 1.0 + lr).clamp(max=K3_MAX)
    else:
        raise ValueError(f"unknown KL estimator {estimator!r} (k1, k2 or k3)")
    return kl.clamp(-clamp, clamp) if clamp is not None else kl
