"""Train/inference mismatch corrections: per-token weights and keep masks.

Notation (GLM-5, arXiv 2602.15763, Eq. 1; Yao et al. 2025, "Your Efficient RL Framework Secretly
Brings You Off-Policy RL Training", blog): for every response token,
``k = π_old / π_rollout = exp(old_logprobs − rollout_logprobs)``, the ratio of the
trainer's probability (same weights as the engine, trainer numerics) to the
engine's probability of the sampled token.

Every function takes ``[B, T]`` right-padded tensors and a 0/1 ``mask`` (the loss
mask: 1 on action tokens). Positions with ``mask == 0`` (padding, prompt or
observation tokens) never enter a statistic or a sequence-level product; there
the returned weight is 1 and ``keep_mask`` is 0, so ``keep_mask`` can directly
replace the loss mask and corrections compose by multiplying weights and
multiplying keep masks. Removed tokens always get weight 0. Weights are
detached: they are constants in the loss.
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

import torch
from torch import Tensor

Level = Literal["token", "sequence", "geometric"]
Mode = Literal["truncate", "mask", "clip"]


class CorrectionResult(NamedTuple):
    """Output of a correction.

    weights: [B, T] float32 per-token multiplier for the policy-gradient term
        (1 where mask is 0, 0 on removed tokens).
    keep_mask: [B, T] float32 0/1, 1 on mask tokens that stay in the loss.
    stats: python floats; always "removed_frac" (fraction of mask tokens with
        keep_mask 0) and "weight_mean" (mean weight over kept tokens); NaN when
        the quantity has no tokens to average over.
    """

    weights: Tensor
    keep_mask: Tensor
    stats: dict[str, float]


def icepop(
    old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, low: float, high: float
) -> CorrectionResult:
    """IcePop: weight = k if low <= k <= high else 0 (inclusive band); shapes [B, T].

    keep_mask is 1 inside the band. As in slime, the caller usually keeps popped
    tokens in the loss denominator (divide by the loss mask, not keep_mask);
    stats add "popped_frac" (equal to "removed_frac").
    """
    # GLM-5 (arXiv 2602.15763) Eq. 1 pop(ρ, 1/β, β), β = 2; Ring-1T (arXiv 2510.18855) IcePop M(k) = k·1[α ≤ k ≤ β].
    result = _band(_token_ratio(old_logprobs, rollout_logprobs, mask), mask, low, high)
    result.stats["popped_frac"] = result.stats["removed_frac"]
    return result


def truncated_is(
    old_logprobs: Tensor,
    rollout_logprobs: Tensor,
    mask: Tensor,
    clip_low: float = 0.0,
    clip_high: float = 2.0,
) -> CorrectionResult:
    """Truncated importance sampling: weight = clamp(k, clip_low, clip_high); shapes [B, T].

    No token is removed (keep_mask equals mask). stats add "clipped_frac", the
    fraction of mask tokens whose k fell outside [clip_low, clip_high].
    """
    # TIS (Yao et al. 2025, blog): min(k, C), C = 2; as slime's clamp(k, 0, 2).
    mask = mask.float()
    ratio = _token_ratio(old_logprobs, rollout_logprobs, mask)
    weights = _on_mask(ratio.clamp(clip_low, clip_high), mask)
    outside = ((ratio < clip_low) | (ratio > clip_high)).float()
    stats = _base_stats(weights, mask, mask)
    stats["clipped_frac"] = _frac(outside, mask)
    return CorrectionResult(weights, mask.clone(), stats)


def masked_is(
    old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, low: float, high: float
) -> CorrectionResult:
    """Masked importance sampling (MIS): weight = k inside [low, high]; else removed; shapes [B, T].

    Same numbers as :func:`icepop`; the difference is what the caller does with
    keep_mask: MIS removes rejected tokens from the loss denominator too
    (aggregate with keep_mask), IcePop keeps them there (aggregate with the
    loss mask).
    """
    # MIS (Liu et al. 2025, "When Speed Kills Stability", blog), token level, mode "mask".
    return rejection_sampling(old_logprobs, rollout_logprobs, mask, "token", low, high, "mask")


def rejection_sampling(
    old_logprobs: Tensor,
    rollout_logprobs: Tensor,
    mask: Tensor,
    level: Level,
    low: float,
    high: float,
    mode: Mode,
    veto_threshold: float | None = None,
    batch_normalize: bool = False,
) -> CorrectionResult:
    """Importance weights / rejection at token, sequence or geometric level; shapes [B, T].

    Ratio by level (sums over mask tokens of one sequence, broadcast to its tokens):
      token:     k_t
      sequence:  exp(Σ_t m·log k_t)
      geometric: exp(Σ_t m·log k_t / Σ_t m)
    Log-ratios (the per-token one, or the sequence sum/mean) are clamped to
    [−20, 20] before exp.

    mode:
      truncate: weight = min(ratio, high); ``low`` is not used.
      clip:     weight = clamp(ratio, low, high).
      mask:     weight = ratio inside [low, high] (inclusive); outside, the token
                (token level) or the whole sequence (sequence/geometric level)
                gets keep_mask 0 and weight 0.
    veto_threshold: a sequence with any mask token whose raw (unclamped) k is
        below it is removed entirely (keep_mask 0, weight 0).
    batch_normalize: divide the weights on mask tokens by their mean over kept
        tokens (token-weighted), so kept weights average 1. Skipped (factor 1)
        when that mean is <= 1e-8 or nothing is kept.

    Removed tokens are meant to leave the loss denominator: aggregate with
    keep_mask.

    Names in other frameworks:
      glmlight         slime mismatch helper               verl rollout_corr
      level            tis_level / rs_level                rollout_is / rollout_rs
      mode             tis_mode                            (IS weights truncate, RS masks)
      low              tis_lower_bound / rs_lower_bound    rollout_rs_threshold_lower
      high             tis_upper_bound / rs_upper_bound    rollout_is_threshold / rollout_rs_threshold
      veto_threshold   rs_veto_threshold                   rollout_token_veto_threshold
      batch_normalize  tis_batch_normalize                 rollout_is_batch_normalize
    slime and verl normalise sequence-level weights by the mean over sequences;
    here the mean is over kept tokens for every level.

    stats: "removed_frac", "weight_mean", "ratio_low_frac" / "ratio_high_frac"
    (fraction of mask tokens whose level ratio is below low / above high),
    "veto_seq_frac" (fraction of sequences with mask tokens that were vetoed,
    with veto_threshold) and "batch_norm_factor" (with batch_normalize).
    """
    # MIS / rejection sampling (Liu et al. 2025, "When Speed Kills Stability", blog); settings as in verl and slime.
    mask = mask.float()
    raw = _masked_raw_log_ratio(old_logprobs, rollout_logprobs, mask)
    ratio = _level_log_ratio(raw, mask, level).clamp(-20.0, 20.0).exp()

    keep = mask.clone()
    if mode == "truncate":
        weights = ratio.clamp(max=high)
    elif mode == "clip":
        weights = ratio.clamp(low, high)
    elif mode == "mask":
        weights = ratio
        keep = keep * ((ratio >= low) & (ratio <= high)).float()
    else:
        raise ValueError(f"rejection_sampling: mode must be 'truncate', 'clip' or 'mask', got {mode!r}")

    stats = {
        "ratio_low_frac": _frac((ratio < low).float(), mask),
        "ratio_high_frac": _frac((ratio > high).float(), mask),
    }
    if veto_threshold is not None:
        vetoed = _vetoed_sequences(raw, mask, veto_threshold)
        keep = keep * (~vetoed).float().unsqueeze(-1)
        has_tokens = mask.sum(-1) > 0
        stats["veto_seq_frac"] = _ratio(vetoed[has_tokens].float().sum(), has_tokens.float().sum())

    weights = _on_mask(weights * keep, mask)
    if batch_normalize:
        weights, stats["batch_norm_factor"] = _batch_normalize(weights, mask, keep)
    stats.update(_base_stats(weights, mask, keep))
    return CorrectionResult(weights, keep, stats)


def _token_ratio(old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor) -> Tensor:
    """k per token with the log-ratio clamped to ±20; 1 where mask is 0. [B, T]."""
    return _masked_raw_log_ratio(old_logprobs, rollout_logprobs, mask).clamp(-20.0, 20.0).exp()


def _masked_raw_log_ratio(old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor) -> Tensor:
    """Unclamped log k on mask tokens, exactly 0 elsewhere (padding may hold NaN/inf). [B, T]."""
    diff = old_logprobs.detach().float() - rollout_logprobs.detach().float()
    return torch.where(mask.bool(), diff, torch.zeros_like(diff))


def _level_log_ratio(raw: Tensor, mask: Tensor, level: Level) -> Tensor:
    """Per-token, per-sequence sum or per-sequence mean of log k, broadcast to [B, T]."""
    if level == "token":
        return raw
    total = raw.sum(-1, keepdim=True)
    if level == "sequence":
        return total.expand_as(raw)
    if level == "geometric":
        return (total / mask.sum(-1, keepdim=True).clamp(min=1.0)).expand_as(raw)
    raise ValueError(f"rejection_sampling: level must be 'token', 'sequence' or 'geometric', got {level!r}")


def _vetoed_sequences(raw: Tensor, mask: Tensor, veto_threshold: float) -> Tensor:
    """[B] bool: sequence has a mask token with k < veto_threshold (compared in log space)."""
    catastrophic = (raw < math.log(veto_threshold)) & mask.bool()
    return catastrophic.any(-1)


def _band(ratio: Tensor, mask: Tensor, low: float, high: float) -> CorrectionResult:
    """Keep tokens with low <= ratio <= high at weight ratio; others weight 0, keep 0."""
    mask = mask.float()
    keep = mask * ((ratio >= low) & (ratio <= high)).float()
    weights = _on_mask(ratio * keep, mask)
    return CorrectionResult(weights, keep, _base_stats(weights, mask, keep))


def _batch_normalize(weights: Tensor, mask: Tensor, keep: Tensor) -> tuple[Tensor, float]:
    """Divide weights on mask tokens by their mean over kept tokens; returns (weights, factor)."""
    kept = mask * keep
    count = kept.sum()
    mean = (weights * kept).sum() / count.clamp(min=1.0)
    if count == 0 or mean <= 1e-8:
        return weights, 1.0
    return _on_mask(weights / mean, mask), mean.item()


def _on_mask(values: Tensor, mask: Tensor) -> Tensor:
    """values where mask is 1, 1.0 elsewhere."""
    return torch.where(mask.bool(), values, torch.ones_like(values))


def _base_stats(weights: Tensor, mask: Tensor, keep: Tensor) -> dict[str, float]:
    kept = mask * keep
    return {
        "removed_frac": _frac(1.0 - keep, mask),
        "weight_mean": _ratio((weights * kept).sum(), kept.sum()),
    }


def _frac(indicator: Tensor, mask: Tensor) -> float:
    """Fraction of mask tokens where indicator is 1 (NaN without mask tokens)."""
    return _ratio((indicator * mask).sum(), mask.sum())


def _ratio(num: Tensor, den: Tensor) -> float:
    return (num / den).item() if den > 0 else float("nan")
