"""Speculative sampling: accept drafted tokens so that the output has exactly the target's distribution, and
whether speculating pays.

Leviathan et al. 2023 (arXiv 2211.17192), Algorithm 1 and eq. 1; Chen et al. 2023 (arXiv 2302.01318), Algorithm 2.

A round drafts K tokens x_1..x_K from the draft's distributions q_1..q_K, the target scores them in one forward
(p_1..p_{K+1}), and draft j is accepted with probability min(1, p_j(x_j) / q_j(x_j)), in order, up to the first
rejection; at the first rejection j the round's last token is drawn from the residual norm(max(0, p_j - q_j)), and
when all K are accepted a bonus token is drawn from p_{K+1}. Every emitted token then has exactly the target's
distribution given the tokens before it, whatever q is. Distributions are [..., V] probabilities (already
temperature-scaled and top-k / top-p filtered, `glmlight.ops.logprobs.processed_logits`); uniforms are in [0, 1).
"""

from __future__ import annotations

import torch
from torch import Tensor


def invert_cdf(probs: Tensor, u: Tensor) -> Tensor:
    """The token of each row [...] of `probs` [..., V] at uniform `u` [...]: the first whose cumulative probability
    exceeds u * (total mass), never one of zero probability (the engine's sampling by inversion)."""
    cdf = probs.cumsum(-1)
    total = cdf[..., -1:]
    tok = torch.searchsorted(cdf, u.to(cdf.dtype).unsqueeze(-1) * total, right=True).squeeze(-1)
    return torch.minimum(tok, (cdf < total).sum(-1))


def acceptance_probability(p_x: Tensor, q_x: Tensor) -> Tensor:
    """min(1, p(x) / q(x)) for drafted tokens x (q(x) > 0 for a token drawn from q; q(x) = 0 counts as 1 where
    p(x) > 0 and 0 where p(x) = 0)."""
    ratio = (p_x / q_x.clamp(min=torch.finfo(q_x.dtype).tiny)).clamp(max=1.0)
    return torch.where(q_x > 0, ratio, (p_x > 0).to(ratio.dtype))


def residual_distribution(p: Tensor, q: Tensor) -> Tensor:
    """norm(max(0, p - q)) over the last dim; p itself where p - q has no positive mass (then p = q, and a
    rejection has probability 0)."""
    r = (p - q).clamp(min=0)
    mass = r.sum(-1, keepdim=True)
    return torch.where(mass > 0, r / mass.clamp(min=torch.finfo(r.dtype).tiny), p)


def accept_drafts(p: Tensor, q: Tensor, drafts: Tensor, u_accept: Tensor, u_final: Tensor) -> tuple[Tensor, Tensor]:
    """One round of speculative sampling per row: (accepted [B], tokens [B, K + 1]).

    p [B, K + 1, V]: the target's distributions at the K drafted positions and the one after; q [B, K, V]: the
    draft's; drafts [B, K]; u_accept [B, K]: draft j is accepted iff u_accept[j] < min(1, p_j(x_j) / q_j(x_j));
    u_final [B, K + 1]: the uniform of the round's last token at each place it can fall. `accepted` counts the
    drafts before the first rejection (m); tokens[:, :m] are those drafts, tokens[:, m] the token drawn at
    `u_final[:, m]` from the residual norm(max(0, p_m - q_m)) (m < K) or from p_K (m = K, the bonus); entries past
    m are the unused drafts (0 at K)."""
    B, K = drafts.shape
    p_x = p[:, :K].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    q_x = q.gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    ok = u_accept.double() < acceptance_probability(p_x.double(), q_x.double())
    accepted = ok.long().cumprod(-1).sum(-1)
    rows = torch.arange(B, device=p.device)
    q_m = torch.cat([q, q.new_zeros(B, 1, q.shape[-1])], dim=1)[rows, accepted]  # no draft at K: residual = p_K
    last = invert_cdf(residual_distribution(p[rows, accepted], q_m), u_final[rows, accepted])
    tokens = torch.cat([drafts, drafts.new_zeros(B, 1)], dim=1)
    tokens[rows, accepted] = last
    return accepted, tokens


def acceptance_estimate(accepted: float, rejected: float) -> float | None:
    """The per-token acceptance rate a of the i.i.d. model (eq. 1) from counted rounds: each round makes m
    acceptance tests that pass and, when it stops before K, one that fails; a = passed / tests (the maximum
    likelihood estimate of a geometric stop). None without a test."""
    tests = accepted + rejected
    return accepted / tests if tests > 0 else None


def expected_tokens_per_round(a: float, k: int) -> float:
    """Expected tokens a round of depth k emits when each draft is accepted with probability a independently:
    (1 - a^(k + 1)) / (1 - a) (Leviathan et al. eq. 1), k + 1 at a = 1."""
    if a >= 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def speculation_speedup(a: float, k: int, draft_s: float, verify_s: float, plain_s: float) -> float:
    """Tokens per second of speculative decoding over plain decoding: a round costs k draft steps (draft_s each)
    and one verification (verify_s) and emits `expected_tokens_per_round(a, k)` tokens; plain decoding emits one
    token per step of plain_s."""
    return expected_tokens_per_round(a, k) * plain_s / max(k * draft_s + verify_s, 1e-12)


def speculation_on(speedup: float, on: bool, margin: float = 0.05) -> bool:
    """Whether to speculate next, from the estimated speedup and whether speculation is on now: it turns off
    below 1 - margin and on above 1 + margin (between, it stays as it is, so measurement noise near 1 does not
    flip it every round)."""
    return speedup >= 1.0 - margin if on else speedup > 1.0 + margin
