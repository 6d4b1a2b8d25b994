"""Token log-probabilities and entropy of the sampling distribution.

The probability contract: the log-prob of a token is its log-prob under the distribution it is
sampled from, softmax(logits / T) restricted to the top-k / top-p kept set and renormalised.
The embedded engine samples and reports with `processed_logits`, and the trainer recomputes its
log-probs with the same function on its own logits, so with equal logits both sides compute the
same number (and the same kept set). With top_k = 0 and top_p = 1 this is softmax(logits / T).

Which tokens are kept when top-k and top-p are both on depends on the engine (`FILTER_ORDERS`):
- "sequential" (glmlight's embedded engine, vLLM): top-k, renormalise, then top-p over the
  renormalised top-k distribution;
- "joint" (SGLang): top-k and top-p are both applied to the same full, un-renormalised
  distribution and the kept set is their intersection (`joint_kept`).
With only one of the two filters on, both orders keep the same set up to ties (below). Each engine
declares its order (`filter_order`); the trainer scores that engine's rollouts with it.

Exact ties at a cut (frequent with bf16 logits), per engine:
- "sequential" keeps every token tied with the k-th (`scaled < kth` drops), as vLLM 0.32.0 does
  (vllm/v1/sample/ops/topk_topp_sampler.py `apply_top_k_top_p_pytorch` and `apply_top_k_only`:
  `logits < kth` is masked); the kept set may then hold more than k tokens.
- "joint" keeps exactly k tokens by rank, as SGLang 0.5.23 does (srt/layers/sampler.py
  `top_k_top_p_min_p_sampling_from_probs_torch`: rank >= top_k is zeroed after a sort), with top-k
  alone too (`joint_kept`). Tied tokens are ranked by token id (a stable sort); SGLang's sort is
  unstable, so which of the tied tokens it keeps may differ, but the count and therefore every kept
  token's probability agree.
- Top-p: a token is dropped once the mass before it reaches top_p, ties ranked by token id (a stable
  sort, so the engine's step and the trainer's batch, of other shapes, rank them alike). vLLM
  computes the same cut from an ascending sort (`cumsum <= 1 - p` drops) on CPU and with a Triton
  kernel on CUDA, so the float32 rounding of the cumulative mass (and the order of ties) differs and
  tokens near the cut may fall on the other side. Measured on 2,048 bf16-rounded rows, top_p 0.9,
  against vLLM 0.32.0's CPU rule: peaked rows (32,000 N(0, 8^2) logits) differ in 15 rows by at most
  5e-7 in the kept tokens' log-probs; flat rows (32,000 or 49,152 N(0, 3^2) logits, thousands of tokens
  near the cut) by up to 2e-4 at T = 1 and 3e-3 at T = 0.7. glmlight does not copy a
  platform-dependent summation order; for a vLLM run with top_p < 1 on flat distributions this is
  part of the measured train/rollout mismatch (docs/contracts.md).
"""

from __future__ import annotations

import torch
from torch import Tensor

FILTER_ORDERS = ("sequential", "joint")


def processed_logits(logits: Tensor, temperature: float | Tensor = 1.0, top_k: int | Tensor = 0,
                     top_p: float | Tensor = 1.0, *, use_top_k: bool | None = None,
                     use_top_p: bool | None = None, order: str = "sequential") -> Tensor:
    """float32 logits / T with every token outside the top-k / top-p kept set at −inf; [..., V] -> [..., V].

    temperature, top_k, top_p: numbers, or tensors of shape [...] (one per row). T ≤ 0 (greedy)
    counts as T = 1. top_k = 0 and top_p = 1 filter nothing. Top-p (Holtzman et al. 2020, arXiv
    1904.09751, §3.1) keeps the smallest set of most likely tokens whose mass reaches top_p: a
    token is dropped once the mass of the tokens strictly more likely than it already reaches
    top_p (ties ranked by token id, module docstring). `use_top_k` / `use_top_p` say whether any row filters (None:
    look at the arguments, which costs a device synchronisation for tensors). `order`: how top-k and
    top-p combine when both are on (module docstring; "joint": `joint_kept`).
    """
    scaled = logits.float()
    temp = torch.as_tensor(temperature, dtype=torch.float32, device=scaled.device)
    temp = torch.where(temp > 0, temp, torch.ones_like(temp))
    if temp.dim() or float(temp) != 1.0:
        scaled = scaled / temp.unsqueeze(-1) if temp.dim() else scaled / temp
    V = scaled.shape[-1]
    top_k = torch.as_tensor(top_k, device=scaled.device)
    top_p = torch.as_tensor(top_p, dtype=torch.float32, device=scaled.device)
    if use_top_k is None:
        use_top_k = bool((top_k > 0).any())
    if use_top_p is None:
        use_top_p = bool((top_p < 1).any())
    if order not in FILTER_ORDERS:
        raise ValueError(f"unknown top-k/top-p order {order!r}; one of {FILTER_ORDERS}")
    if order == "joint" and use_top_k:  # exactly k by rank, top-p on the same full distribution
        return scaled.masked_fill(~joint_kept(scaled, top_k, top_p), float("-inf"))
    if use_top_k:
        k = torch.where(top_k > 0, top_k.clamp(max=V), torch.full_like(top_k, V)).expand(scaled.shape[:-1])
        kth = scaled.sort(dim=-1, descending=True).values.gather(-1, (k - 1).unsqueeze(-1))
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if use_top_p:
        sorted_logits, order = scaled.sort(dim=-1, descending=True, stable=True)  # ties: lower id first
        probs = sorted_logits.softmax(-1)
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p.expand(scaled.shape[:-1]).unsqueeze(-1)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return scaled


def joint_kept(scaled: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """The kept set of joint top-k/top-p filtering as a bool mask; scaled logits [..., V], top_k and
    top_p numbers or [...] tensors (top_k <= 0: no top-k). Definition of sglang 0.5.23
    srt/layers/sampler.py `top_k_top_p_min_p_sampling_from_probs_torch` (flashinfer's
    filter_apply_order="joint" on CUDA): sort the probabilities p = softmax(scaled) in descending
    order; the token of rank r is kept iff r < top_k and the mass of the tokens ranked before it,
    p_(0) + ... + p_(r-1), is at most top_p. Both tests read the full distribution: top-p is not
    taken after renormalising over the top-k set. Exactly min(top_k, V) tokens pass the rank test:
    tokens of equal probability are ranked by token id (a stable sort; module docstring)."""
    V = scaled.shape[-1]
    top_k = torch.as_tensor(top_k, device=scaled.device)
    top_p = torch.as_tensor(top_p, dtype=torch.float32, device=scaled.device)
    k = torch.where(top_k > 0, top_k.clamp(max=V), torch.full_like(top_k, V)).expand(scaled.shape[:-1])
    probs, order = scaled.float().softmax(-1).sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(V, device=scaled.device)
    p = top_p.expand(scaled.shape[:-1]).unsqueeze(-1)  # top_p >= 1: no top-p (a rounded mass may pass 1)
    keep_sorted = (rank < k.unsqueeze(-1)) & (((probs.cumsum(-1) - probs) <= p) | (p >= 1))
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)


def log_softmax(logits: Tensor) -> Tensor:
    """Max-subtracted log-softmax in float32: (x − max) − log Σ exp(x − max); [..., V] -> [..., V].

    Subtracting the max first keeps the log-prob of a near-certain token exact to float32
    rounding of a number near 0 (x − logsumexp(x) computed from two large numbers is not).
    """
    z = logits.float()
    z = z - z.amax(-1, keepdim=True).detach()
    return z - z.exp().sum(-1, keepdim=True).log()


def logprobs_from_logits(logits: Tensor, labels: Tensor, temperature: float = 1.0, top_k: int = 0,
                         top_p: float = 1.0, order: str = "sequential") -> Tensor:
    """log of the sampling distribution's probability of `labels`: logits [B, T, V], labels [B, T] -> [B, T].

    The sampling distribution is `processed_logits(logits, temperature, top_k, top_p)`; a label
    outside the kept set gets −inf. Computed as (z[label] − log Σ exp z) with z = x − max(x),
    so the full [B, T, V] log-softmax is never materialised.
    """
    z = processed_logits(logits, temperature, top_k, top_p, order=order)
    z = z - z.amax(-1, keepdim=True).detach()
    picked = z.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return picked - z.exp().sum(-1).log()


def entropy_from_logits(logits: Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                        order: str = "sequential") -> Tensor:
    """Entropy of the sampling distribution per position: [..., V] -> [...]."""
    logp = log_softmax(processed_logits(logits, temperature, top_k, top_p, order=order))
    p = logp.exp()
    return -(p * torch.where(p > 0, logp, torch.zeros_like(logp))).sum(-1)
