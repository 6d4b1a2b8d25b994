"""Token sampling for the embedded engine: temperature, top-k, top-p, per-request seeds.

The log-prob returned for a sampled token is taken from the distribution it was
actually sampled from (after temperature, top-k and top-p); for greedy rows
(temperature 0) it is the plain log-softmax of the logits.

The engine samples by inversion (`sample_with_uniforms`): each request draws its
uniforms from its own seeded generator once, when it is admitted, and token `t`
of the request uses uniform `t`. A request's tokens therefore depend on its
seed and its own logits only, never on which other requests share the batch or
when it joined, and a decode step samples the whole batch with a handful of
tensor ops (no per-row generator calls).
"""

from __future__ import annotations

import torch

from glmlight.ops.logprobs import processed_logits


def processed_logprobs(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
    *, use_top_k: bool | None = None, use_top_p: bool | None = None, order: str = "sequential",
) -> torch.Tensor:
    """Log-probs of the sampling distribution per row (`glmlight.ops.logprobs.processed_logits`,
    the function the trainer uses too). logits [B, V]; the other args [B]. Greedy rows
    (temperature 0) use temperature 1 here; filtered-out tokens get -inf. `order`: how top-k and
    top-p combine (the embedded engine samples "sequential"; "joint" is SGLang's)."""
    z = processed_logits(logits, temperature, top_k, top_p, use_top_k=use_top_k, use_top_p=use_top_p, order=order)
    return torch.log_softmax(z, dim=-1)


def sample_with_uniforms(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    uniforms: torch.Tensor,
    *,
    use_top_k: bool | None = None,
    use_top_p: bool | None = None,
    greedy: str = "some",
    order: str = "sequential",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row by inverting the row's CDF at `uniforms` [B] (in [0, 1));
    returns (tokens [B], logprobs [B]).

    The chosen token is the first whose cumulative probability exceeds u·(total mass),
    so a token of zero probability (filtered out) is never chosen. `greedy` is "none"
    (no row has temperature 0), "all" or "some"; it only skips work.
    """
    logp = processed_logprobs(logits, temperature, top_k, top_p, use_top_k=use_top_k, use_top_p=use_top_p,
                              order=order)
    if greedy == "all":
        tokens = logp.argmax(-1)
    else:
        cdf = logp.exp().cumsum(-1)
        total = cdf[:, -1:]
        tokens = torch.searchsorted(cdf, uniforms.to(cdf.dtype).unsqueeze(-1) * total, right=True).squeeze(-1)
        # u·total can round up to total; never step past the last token with positive mass
        tokens = torch.minimum(tokens, (cdf < total).sum(-1))
        if greedy != "none":
            tokens = torch.where(temperature > 0, tokens, logp.argmax(-1))
    return tokens, logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def request_uniforms(seed: int, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The `n` uniforms a request with this seed samples its tokens from (CPU generator,
    so the stream is the same on every device)."""
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, generator=g, dtype=torch.float64).to(device)


def request_spec_uniforms(seed: int, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[2, n]: the uniforms of speculative decoding's acceptance tests and of its resampled tokens (token `t`'s
    in column `t`), drawn from the request's generator after its `request_uniforms`, which stay what they are."""
    g = torch.Generator().manual_seed(seed)
    torch.rand(n, generator=g, dtype=torch.float64)
    return torch.rand(2, n, generator=g, dtype=torch.float64).to(device)
