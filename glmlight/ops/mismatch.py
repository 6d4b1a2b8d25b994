"""Train/inference mismatch metrics and train/rollout agreement checks.

Every metric is a ratio of sums: :func:`mismatch_sums` returns the per-batch
sums and counts (add them across ranks or steps, e.g. in a torchmetrics
``Metric`` with ``dist_reduce_fx="sum"``) and :func:`reduce_mismatch_sums` turns
summed values into metrics. :func:`mismatch_metrics` is the two composed, so a
single batch and a sum over ranks give the same definition.

Averaging: token-level metrics (kl, k3_kl, chi2_token, trusted_token_ratio)
are means over all mask tokens of the batch; log-ppl metrics and chi2_seq are
per sequence first, then a mean over the sequences that have at least one
mask token. A metric without tokens/sequences to average over is NaN.
"""

from __future__ import annotations

import torch
from torch import Tensor

_CLAMP = 20.0


def mismatch_sums(
    train_logprobs: Tensor,
    rollout_logprobs: Tensor,
    mask: Tensor,
    low: float | None = None,
    high: float | None = None,
) -> dict[str, Tensor]:
    """Sums and counts behind :func:`mismatch_metrics`; inputs [B, T], outputs float32 scalars.

    With r = log π_train − log π_rollout and k = exp(r) per mask token:
      token_count, seq_count (sequences with mask tokens),
      kl_sum = Σ m·(−r), k3_kl_sum = Σ m·(e^r − r − 1), chi2_token_sum = Σ m·k²,
      train_log_ppl_sum = Σ_seq (−Σ_t m·log π_train / Σ_t m), rollout_log_ppl_sum likewise,
      chi2_seq_sum = Σ_seq exp(2·clamp(Σ_t m·r, ±20)),
      trusted_token_sum = Σ m·1[low <= k <= high] (only when low and high are given).
    r is clamped to ±20 before exp in k3_kl and chi2_token.
    """
    # Train/inference mismatch metrics (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You
    # Off-Policy RL Training"; Liu et al. 2025, "When Speed Kills Stability"; both blog posts).
    mask = mask.float()
    valid = mask.bool()
    train = _zero_off_mask(train_logprobs, valid)
    rollout = _zero_off_mask(rollout_logprobs, valid)
    r = train - rollout
    r_clamped = r.clamp(-_CLAMP, _CLAMP)
    k = r_clamped.exp()

    tokens_per_seq = mask.sum(-1)
    has_tokens = tokens_per_seq > 0
    per_seq_count = tokens_per_seq.clamp(min=1.0)
    seq_log_ratio = (r * mask).sum(-1).clamp(-_CLAMP, _CLAMP)

    sums = {
        "token_count": mask.sum(),
        "seq_count": has_tokens.float().sum(),
        "kl_sum": (-r * mask).sum(),
        # k3 = e^r − r − 1 with r = log(π_train/π_rollout): under tokens sampled from π_rollout,
        # E[e^r] = 1 and E[−r] = KL(rollout‖train), so this is an unbiased, non-negative
        # estimate of the same KL as kl_sum (Schulman 2020's k3 with π_rollout as the sampling distribution).
        "k3_kl_sum": ((k - r_clamped - 1.0) * mask).sum(),
        "chi2_token_sum": (k.square() * mask).sum(),
        "train_log_ppl_sum": _per_seq(-(train * mask).sum(-1) / per_seq_count, has_tokens),
        "rollout_log_ppl_sum": _per_seq(-(rollout * mask).sum(-1) / per_seq_count, has_tokens),
        "chi2_seq_sum": _per_seq((2.0 * seq_log_ratio).exp(), has_tokens),
    }
    if low is not None and high is not None:
        sums["trusted_token_sum"] = (((k >= low) & (k <= high)).float() * mask).sum()
    return sums


def reduce_mismatch_sums(sums: dict[str, Tensor]) -> dict[str, Tensor]:
    """Metrics from (possibly rank-summed) :func:`mismatch_sums` output; scalars in, scalars out.

    mismatch_kl = kl_sum / tokens; mismatch_k3_kl = k3_kl_sum / tokens;
    train_log_ppl, rollout_log_ppl = per-sequence log-ppl averaged over sequences;
    log_ppl_diff = train_log_ppl − rollout_log_ppl (positive: the trainer finds the
    sampled text less likely than the engine did); chi2_token = E[k²] − 1;
    chi2_seq = mean over sequences of (Π k)² − 1; trusted_token_ratio when present.
    """
    # Mismatch metrics (Yao et al. 2025; Liu et al. 2025, blog posts): ratios of the sums above.
    tokens, seqs = sums["token_count"], sums["seq_count"]
    train_ppl = _div(sums["train_log_ppl_sum"], seqs)
    rollout_ppl = _div(sums["rollout_log_ppl_sum"], seqs)
    metrics = {
        "mismatch_kl": _div(sums["kl_sum"], tokens),
        "mismatch_k3_kl": _div(sums["k3_kl_sum"], tokens),
        "train_log_ppl": train_ppl,
        "rollout_log_ppl": rollout_ppl,
        "log_ppl_diff": train_ppl - rollout_ppl,
        "chi2_token": _div(sums["chi2_token_sum"], tokens) - 1.0,
        "chi2_seq": _div(sums["chi2_seq_sum"], seqs) - 1.0,
    }
    if "trusted_token_sum" in sums:
        metrics["trusted_token_ratio"] = _div(sums["trusted_token_sum"], tokens)
    return metrics


def mismatch_metrics(
    train_logprobs: Tensor,
    rollout_logprobs: Tensor,
    mask: Tensor,
    low: float | None = None,
    high: float | None = None,
) -> dict[str, Tensor]:
    """Mismatch metrics of one batch (inputs [B, T], outputs float32 scalars).

    Keys: mismatch_kl, mismatch_k3_kl, train_log_ppl, rollout_log_ppl,
    log_ppl_diff, chi2_token, chi2_seq, and trusted_token_ratio (fraction of
    mask tokens with low <= k <= high) when low and high are given. See
    :func:`mismatch_sums` and :func:`reduce_mismatch_sums` for the formulas.
    """
    # Mismatch metrics (Yao et al. 2025; Liu et al. 2025, blog posts).
    return reduce_mismatch_sums(mismatch_sums(train_logprobs, rollout_logprobs, mask, low, high))


def token_agreement(train_argmax: Tensor, engine_tokens: Tensor, mask: Tensor) -> Tensor:
    """Fraction of mask positions where the trainer's argmax equals the engine's token.

    train_argmax, engine_tokens: [B, T] integer; mask: [B, T] 0/1. Returns a
    float32 scalar (NaN without mask positions).
    """
    # Token agreement, validation contract (docs/contracts.md).
    mask = mask.float()
    return _div(((train_argmax == engine_tokens).float() * mask).sum(), mask.sum())


def topk_agreement(indices_a: Tensor, indices_b: Tensor) -> Tensor:
    """Mean over positions of |set_a ∩ set_b| / k for top-k selections of shape [..., k].

    E.g. DSA indexer choices per query token from the trainer and the engine.
    Negative indices are padding (a query with fewer than k candidate keys):
    they never match, and a position's score is the overlap divided by the
    larger number of valid entries of a and b (k when nothing is padded).
    Positions where both sides are all padding are left out of the mean.
    Each side is assumed to hold distinct indices. Returns a float32 scalar
    (NaN when no position has a valid entry). Sort + searchsorted, O(k log k)
    per position.
    """
    # Sparse contract: DSA indexer top-k agreement (docs/contracts.md).
    if indices_a.shape != indices_b.shape:
        raise ValueError(
            f"topk_agreement: shapes differ, {tuple(indices_a.shape)} vs {tuple(indices_b.shape)}"
        )
    k = indices_a.shape[-1]
    a = indices_a.reshape(-1, k)
    b_sorted = indices_b.reshape(-1, k).sort(dim=-1).values.contiguous()
    pos = torch.searchsorted(b_sorted, a.contiguous()).clamp(max=k - 1)
    found = (b_sorted.gather(-1, pos) == a) & (a >= 0)
    overlap = found.float().sum(-1)
    valid = torch.maximum((a >= 0).sum(-1), (indices_b.reshape(-1, k) >= 0).sum(-1)).float()
    scored = valid > 0
    return _div((overlap[scored] / valid[scored]).sum(), scored.float().sum())


def set_agreement(choices_a: Tensor, choices_b: Tensor) -> Tensor:
    """Fraction of positions whose two choices [..., k] are the same set (order ignored), e.g. the
    experts a MoE router picked for a token in the engine and in the trainer. Each side is assumed
    to hold distinct entries. Returns a float32 scalar (NaN for no positions)."""
    # Model contract: routing agreement (docs/contracts.md).
    if choices_a.shape != choices_b.shape:
        raise ValueError(f"set_agreement: shapes differ, {tuple(choices_a.shape)} vs {tuple(choices_b.shape)}")
    k = choices_a.shape[-1]
    a = choices_a.reshape(-1, k).sort(dim=-1).values
    b = choices_b.reshape(-1, k).sort(dim=-1).values
    same = (a == b).all(-1).float()
    return _div(same.sum(), torch.tensor(float(same.numel())))


def _zero_off_mask(logprobs: Tensor, valid: Tensor) -> Tensor:
    """float32 log-probs, exactly 0 where valid is False (padding may hold NaN/inf)."""
    logprobs = logprobs.detach().float()
    return torch.where(valid, logprobs, torch.zeros_like(logprobs))


def _per_seq(values: Tensor, has_tokens: Tensor) -> Tensor:
    """Sum of per-sequence values [B] over sequences that have mask tokens."""
    return torch.where(has_tokens, values, torch.zeros_like(values)).sum()


def _div(num: Tensor, den: Tensor) -> Tensor:
    """num / den, NaN where den is 0."""
    return torch.where(den > 0, num / den.clamp(min=1e-30), torch.full_like(num, float("nan")))
