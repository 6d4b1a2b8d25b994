"""Critic-based advantages: GAE, skip-observation GAE, cross-trajectory GAE, and helpers.

Tensors are [B, T] right-padded over the response; masks are 0/1. Advantages
and returns are float32 and exactly 0 where the mask is 0.
"""

from __future__ import annotations

import torch
from torch import Tensor


def gae(
    rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float | Tensor
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over [B, T]; returns (advantages, returns), both [B, T].

    rewards: per-token rewards (typically the terminal reward on the last valid
    token); values: V(s_t); mask: 1 on valid response tokens; lam: float or [B]
    tensor (per-sequence λ). δ_t = r_t + γ·V_{t+1} − V_t, Â_t = δ_t + γλ·Â_{t+1},
    with V and Â after the last valid token equal to 0. returns = Â + V on valid
    tokens, 0 elsewhere. A mask with holes is treated as in
    :func:`skip_observation_gae`.
    """
    # GAE (Schulman et al. 2016, arXiv 1506.02438, Eq. 16), a reverse scan.
    return _scan(rewards, values, mask, gamma, lam)


def skip_observation_gae(
    rewards: Tensor, values: Tensor, action_mask: Tensor, gamma: float, lam: float | Tensor
) -> tuple[Tensor, Tensor]:
    """GAE over action tokens only, skipping observation tokens; returns (advantages, returns) [B, T].

    Across an observation the last token of action i links directly to the
    first token of action i+1: δ = r + γ·V(a_{i+1,0}) − V(a_{i,N}),
    Â(a_{i,N}) = δ + γλ·Â(a_{i+1,0}). This equals ordinary :func:`gae` on the
    sequence with the observation tokens deleted. Rewards on non-action tokens
    are ignored (put the reward on an action token); outputs are 0 on
    non-action tokens. lam: float or [B] tensor.
    """
    # SAO Skip-Observation GAE (Hou et al. 2026, arXiv 2607.07508, §4).
    return _scan(rewards, values, action_mask, gamma, lam)


def adaptive_lambda(lengths: Tensor, alpha: float = 1.5) -> Tensor:
    """λ = 1 − 1/(α·l) per sequence; lengths [B] (clamped to l >= 1) -> float32 [B].

    Length-adaptive GAE from VAPO (Yue et al. 2025, arXiv 2504.05118, §3.2), whose α is 0.05; SAO
    (Hou et al. 2026, arXiv 2607.07508, §4) uses it for the policy's advantages with α = 1.5 (the
    default here) and λ = 1 for the critic's targets. A larger α puts λ closer to 1.
    """
    return 1.0 - 1.0 / (alpha * lengths.float().clamp(min=1.0))


def segment_lambda(length: int | float, alpha: float = 1.5) -> float:
    """λ_s = 1 − 1/(α·L_s) for a segment of L_s response tokens (clamped to L_s >= 1)."""
    # CompactionRL cross-trajectory GAE λ_s (Li et al. 2026, arXiv 2607.05378).
    return 1.0 - 1.0 / (alpha * max(float(length), 1.0))


def cross_trajectory_gae(
    segment_advantages: list[Tensor], segment_masks: list[Tensor], gamma: float, lambdas: list[float]
) -> list[Tensor]:
    """Discount each segment's local advantages by the trainable tokens after it.

    Â_{s,i} = (γ·λ_s)^{N_after(s)}·Â^local_{s,i}, N_after(s) = Σ_{s' > s} Σ_i m_{s',i}.
    segment_advantages, segment_masks: one 1-D [T_s] tensor per segment, in
    trajectory order; lambdas[s] = λ_s (see :func:`segment_lambda`). Returns one
    float32 [T_s] tensor per segment, 0 where its mask is 0.
    """
    # CompactionRL cross-trajectory GAE (Li et al. 2026, arXiv 2607.05378).
    if not len(segment_advantages) == len(segment_masks) == len(lambdas):
        raise ValueError(
            "cross_trajectory_gae: need one mask and one lambda per segment, got "
            f"{len(segment_advantages)} advantages, {len(segment_masks)} masks, {len(lambdas)} lambdas"
        )
    counts = [float(m.float().sum()) for m in segment_masks]
    out = []
    for s, (adv, m) in enumerate(zip(segment_advantages, segment_masks)):
        n_after = sum(counts[s + 1 :])
        out.append((gamma * lambdas[s]) ** n_after * adv.float() * m.float())
    return out


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """(x − mean)/sqrt(var + eps) over mask tokens; mean added back if not shift_mean. [B, T] -> [B, T].

    Mean and (population) variance are taken over all mask tokens of the batch,
    so the whitened mask tokens have mean 0 and variance ≈ 1. 0 where mask is 0.
    """
    # Advantage whitening (as TRL and verl do it), population variance.
    mask = mask.float()
    x = torch.where(mask.bool(), x.float(), torch.zeros_like(x, dtype=torch.float32))
    mean, var = _masked_mean_var(x, mask)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * mask


def masked_scale(x: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """x / sqrt(var + eps) over mask tokens, without the mean shift; [B, T] -> [B, T], 0 where mask is 0.

    Normalises the scale of advantages while keeping every sign and every ratio between them:
    CompactionRL's cross-trajectory discount (γλ_s)^N_after must survive normalisation, which
    centring would undo (an early segment of a successful trajectory would turn negative).
    """
    mask = mask.float()
    x = torch.where(mask.bool(), x.float(), torch.zeros_like(x, dtype=torch.float32))
    _, var = _masked_mean_var(x, mask)
    return x * torch.rsqrt(var + eps) * mask


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> Tensor:
    """1 − Var[returns − values] / Var[returns] over mask tokens; [B, T] inputs -> float32 scalar.

    1 is a perfect critic, 0 no better than a constant, negative worse; NaN when
    Var[returns] is 0.
    """
    # The critic diagnostic PPO implementations log.
    mask = mask.float()
    valid = mask.bool()
    returns = torch.where(valid, returns.float(), torch.zeros_like(returns, dtype=torch.float32))
    values = torch.where(valid, values.float(), torch.zeros_like(values, dtype=torch.float32))
    _, var_returns = _masked_mean_var(returns, mask)
    _, var_residual = _masked_mean_var(returns - values, mask)
    undefined = torch.full_like(var_returns, float("nan"))
    return torch.where(var_returns > 0, 1.0 - var_residual / var_returns, undefined)


def _scan(
    rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float | Tensor
) -> tuple[Tensor, Tensor]:
    """Reverse GAE scan that carries (V, Â) of the next mask token across mask-0 positions."""
    rewards, values, mask = rewards.float(), values.detach().float(), mask.float()
    batch, length = rewards.shape
    lam_b = torch.as_tensor(lam, dtype=torch.float32, device=rewards.device).expand(batch)
    next_value = torch.zeros(batch, device=rewards.device)
    next_adv = torch.zeros(batch, device=rewards.device)
    advantages = torch.zeros_like(rewards)
    for t in reversed(range(length)):
        valid = mask[:, t].bool()
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv = delta + gamma * lam_b * next_adv
        advantages[:, t] = torch.where(valid, adv, torch.zeros_like(adv))
        next_value = torch.where(valid, values[:, t], next_value)
        next_adv = torch.where(valid, adv, next_adv)
    returns = torch.where(mask.bool(), advantages + values, torch.zeros_like(values))
    return advantages, returns


def _masked_mean_var(x: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Mean and population variance of x over mask tokens (x must be finite everywhere)."""
    count = mask.sum().clamp(min=1.0)
    mean = (x * mask).sum() / count
    var = ((x - mean).square() * mask).sum() / count
    return mean, var
