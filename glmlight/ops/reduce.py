"""Masked reductions and loss aggregation."""

from __future__ import annotations

import torch


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None, eps: float = 1e-8) -> torch.Tensor:
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=eps)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=eps)


def loss_normalisers(mask: torch.Tensor) -> dict[str, float]:
    """The denominators of `aggregate_loss` for a batch with this [B, T] mask: its token count, its
    sequences (rows with at least one mask token) and its rows. Summed over data-parallel ranks they
    are the global batch's, so that each rank's loss is its share of the global batch's loss."""
    return {"total_tokens": float(mask.sum()), "num_sequences": float((mask.sum(-1) > 0).sum()),
            "num_rows": float(mask.shape[0])}


def aggregate_loss(loss: torch.Tensor, mask: torch.Tensor, mode: str, *, constant: float | None = None,
                   num_sequences: float | None = None, total_tokens: float | None = None,
                   num_rows: float | None = None) -> torch.Tensor:
    """Reduce a per-token loss [B, T] to a scalar.

    token_mean           Σ m·ℓ / Σ m over the whole batch (DAPO, Yu et al. 2025, arXiv 2503.14476, Eq. 8)
    seq_mean_token_mean  Σ_i (Σ_t m·ℓ / Σ_t m) / N over the N sequences with at least one mask token
                         (GRPO, Shao et al. 2024, arXiv 2402.03300, Eq. 3); a fully masked row is no sequence
    constant             Σ m·ℓ / (B · C) over all B rows (Dr.GRPO, Liu et al. 2025, arXiv 2503.20783: no 1/|o_i|)

    `total_tokens`, `num_sequences` and `num_rows` replace the batch's own denominators (see
    `loss_normalisers`): pass a whole minibatch's for micro-batches, so that the micro-batch losses add
    up to the minibatch loss, and the global batch's (summed over data-parallel ranks), so that the
    ranks' losses add up to the global batch's loss.
    """
    if mode == "token_mean":
        total = mask.sum() if total_tokens is None else torch.as_tensor(total_tokens)
        return (loss * mask).sum() / total.clamp(min=1.0)
    if mode == "seq_mean_token_mean":
        n_seq = (mask.sum(-1) > 0).sum().item() if num_sequences is None else num_sequences
        per_seq = (loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
        return per_seq.sum() / max(n_seq, 1)
    if mode == "constant":
        if constant is None:
            raise ValueError("loss_agg='constant' needs a constant (e.g. max response length)")
        rows = loss.shape[0] if num_rows is None else num_rows
        return (loss * mask).sum() / (max(rows, 1) * constant)
    raise ValueError(f"unknown loss aggregation {mode!r}")
