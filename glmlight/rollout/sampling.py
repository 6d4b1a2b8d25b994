"""Token sampling for the embedded engine: temperature, top-k, top-p, per-request seeds.

The log-prob returned for a sampled token is taken from the distribution it was
actually sampled from (after temperature, top-k and top-p); for greedy rows
(temperature 0) it is the plain log-softmax of the logits.
"""

from __future__ import annotations

import torch


def processed_logprobs(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Log-probs of the sampling distribution per row. logits [B, V]; the other args [B].

    Greedy rows (temperature 0) use temperature 1 here; filtered-out tokens get -inf.
    """
    logits = logits.float()
    temp = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    scaled = logits / temp.unsqueeze(-1)
    V = scaled.shape[-1]
    if bool((top_k > 0).any()):
        k = torch.where(top_k > 0, top_k.clamp(max=V), torch.full_like(top_k, V))
        kth = scaled.sort(dim=-1, descending=True).values.gather(-1, (k - 1).unsqueeze(-1))
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if bool((top_p < 1).any()):
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token once the mass of the tokens strictly before it already reaches top_p.
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p.unsqueeze(-1)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return torch.log_softmax(scaled, dim=-1)


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    generators: list[torch.Generator] | torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; returns (tokens [B], logprobs [B]).

    Sampling uses the exponential race (argmax of log p − log E, E ~ Exp(1)), which
    draws exactly from p. With a list of generators each row draws its noise from
    its own generator, so a request's tokens do not depend on the rest of the batch.
    """
    logp = processed_logprobs(logits, temperature, top_k, top_p)
    B, V = logp.shape
    if isinstance(generators, list):
        noise = torch.stack([torch.empty(V, device=logp.device).exponential_(generator=g) for g in generators])
    else:
        noise = torch.empty_like(logp).exponential_(generator=generators)
    sampled = (logp - noise.log()).argmax(-1)
    greedy = logp.argmax(-1)
    tokens = torch.where(temperature > 0, sampled, greedy)
    return tokens, logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
