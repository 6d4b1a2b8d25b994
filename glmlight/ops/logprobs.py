"""Token log-probabilities and entropy from logits."""

from __future__ import annotations

import torch


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / temperature)[label], float32.

    logits [B, T, V], labels [B, T] -> [B, T]. Computed as logit[label] - logsumexp(logits)
    so that the full [B, T, V] log-softmax is never materialised.
    """
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    picked = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) per position: [B, T, V] -> [B, T]."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(-1)
