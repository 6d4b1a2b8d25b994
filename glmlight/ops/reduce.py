"""Masked reductions and loss aggregation."""

from __future__ import annotations

import torch


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None, eps: float = 1e-8) -> torch.Tensor:
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=eps)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=eps)


def aggregate_loss(loss: torch.Tensor, mask: torch.Tensor, mode: str, *, constant: float | None = None, num_sequences: int | None = None,
                   total_tokens: float | None = None) -> torch.Tensor:
    """Reduce a per-token loss [B, T] to a scalar.

    token_mean           Σ m·ℓ / Σ m over the whole batch (DAPO)
    seq_mean_token_mean  mean over sequences of Σ_t m·ℓ / Σ_t m (GRPO, Shao et al. 2024)
    constant             Σ m·ℓ / (B · C) (Dr.GRPO, Liu et al. 2025: no 1/|o_i|)

    For gradient accumulation over
    micro-batches pass the whole minibatch's `total_tokens` / `num_sequences` so that
    the sum of micro-batch losses equals the minibatch loss.
    """
    if mode == "token_mean":
        total = mask.sum() if total_tokens is None else torch.as_tensor(total_tokens)
        return (loss * mask).sum() / total.clamp(min=1.0)
    n_seq = loss.shape[0] if num_sequences is None else num_sequences
    if mode == "seq_mean_token_mean":
        per_seq = (loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
        return per_seq.sum() / max(n_seq, 1)
    if mode == "constant":
        if constant is None:
            raise ValueError("loss_agg='constant' needs a constant (e.g. max response length)")
        return (loss * mask).sum() / (max(n_seq, 1) * constant)
    raise ValueError(f"unknown loss aggregation {mode!r}")
