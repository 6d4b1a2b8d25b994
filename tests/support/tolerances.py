"""How far apart two float32 computations of the same log-probs may be, from the arithmetic.

Two computations of the same model on the same tokens (an inference server and the trainer, a batched
row and the row alone, a compiled and an eager forward, two matmul kernels) perform the same float32
operations, but reduce in different orders: a dot product of length n split into other blocks and SIMD
lanes, a softmax over the context summed in another order. Neither is exact; both are close to the
exact value, so by the triangle inequality |a - b| <= |a - exact| + |b - exact|, and the tolerance is
twice the error of one float32 computation.

One computation's error, in three steps:

1. One reduction. A float32 sum of n terms carries a rounding error of at most gamma_n * sum|terms|
   (gamma_n = n u / (1 - n u), u = 2^-24 the unit roundoff; Higham, "Accuracy and Stability of
   Numerical Algorithms", 2nd ed., sec. 3.1). That worst case needs every rounding to go the same way;
   the rounding errors of a real sum behave as independent, mean-zero variables, and the error is
   lambda * sqrt(n) * u * sum|terms| with overwhelming probability for a small lambda (Higham and Mary,
   "A New Approach to Probabilistic Rounding Error Analysis", SIAM J. Sci. Comput. 41(5), 2019).

2. The path to one logit. In each layer of a pre-norm residual network, x <- x + f(norm(x)), the
   q/k/v and o projections reduce over the hidden size H, the attention scores over the head dimension
   (<= H), the attention output over the context T, the MLP's gate/up over H and its down projection
   over the intermediate size I: f's output carries a relative error of lambda * sqrt(4H + I + T) * u,
   the independent errors of those reductions added in quadrature. The residual stream sums the layers'
   outputs and their errors alike, so its relative error is that of one layer, whatever the number of
   layers (its magnitude and its error both grow as the quadrature sum of the layers'; norm() keeps an
   earlier layer's error relative). The unembedding reduces over H once more. The relative error of a
   logit is lambda * sqrt(N) * u with N = 4H + I + T + H, its absolute error that times the logits'
   magnitude max|z|.

3. The log-probability. log p_t = z_t - logsumexp(z): a logit error dz moves it by at most 2 max|dz|
   (|d logsumexp| <= max|dz|); the sum of exp over the vocabulary V adds lambda * sqrt(V) * u; the final
   subtraction rounds at u * |log p|. A temperature divides the logits first: max|z| / T.

lambda = 2, relative to max|z|. The bound of step 1 is relative to sum|terms|, which for these dot
products exceeds max|z| (about 2.4 times for the tiny Llama of the server tests, H = 128). Measured
against a float64 forward of the same weights (float32_error_of), one float32 forward's worst log-prob
error over a sequence is about 0.5 * sqrt(N) * u * max|z|, both on a 2-layer tiny Llama (H = 128, max|z|
about 9: 9e-6) and on the 30-layer SmolLM2-135M (H = 576, max|z| about 40: 8e-5), so lambda = 2 leaves a
factor 4 on each computation's error for kernels that accumulate in a less favourable order, and the
tolerance (two computations, each at most 2 max|dz| in log-prob) is about 8 times the largest
difference two correct float32 computations of those models were seen to have on one machine.
tests/unit/models/test_float32_tolerances.py checks the estimate against the float64 forward on
whatever CPU runs the suite.

This covers the log-probs (and, through logit_error, the logits) of a forward. A mean of such differences
over many tokens (a mismatch KL, a log-perplexity difference) is bounded by the same tolerance in the worst
case and is far smaller in practice, the per-token errors having either sign; gradients and parameters after
optimiser steps are outside its scope.

A comparison that is exact by construction (the same kernel on the same numbers: a replay, a cache of
the same rows) needs no such tolerance and should compare with ==.
"""

from __future__ import annotations

import math
from typing import Any

U32 = 2.0 ** -24  # float32 unit roundoff (half of torch.finfo(torch.float32).eps = 2^-23)


def reduction_length(*, hidden: int, intermediate: int, context: int) -> int:
    """N of step 2: the reductions of one layer and the unembedding, added in quadrature."""
    return 4 * hidden + intermediate + context + hidden


def logit_error(*, hidden: int, intermediate: int, context: int, logit_max: float,
                lam: float = 2.0) -> float:
    """One float32 computation's error in a logit (step 2)."""
    n = reduction_length(hidden=hidden, intermediate=intermediate, context=context)
    return lam * math.sqrt(n) * U32 * logit_max


def logprob_error(*, hidden: int, intermediate: int, context: int, vocab: int, logit_max: float,
                  logprob_max: float | None = None, lam: float = 2.0) -> float:
    """One float32 computation's error in a log-probability (step 3)."""
    dz = logit_error(hidden=hidden, intermediate=intermediate, context=context,
                     logit_max=logit_max, lam=lam)
    logprob_max = 2 * logit_max + math.log(vocab) if logprob_max is None else logprob_max
    return 2 * dz + lam * math.sqrt(vocab) * U32 + U32 * logprob_max


def logprob_tolerance(*, hidden: int, intermediate: int, context: int, vocab: int,
                      logit_max: float, lam: float = 2.0) -> float:
    """How far two float32 computations of the same log-probs may be apart: twice one's error."""
    return 2 * logprob_error(hidden=hidden, intermediate=intermediate, context=context,
                             vocab=vocab, logit_max=logit_max, lam=lam)


def dims(config: Any) -> dict:
    """hidden and intermediate of a Hugging Face config (dense or MoE: the larger MLP width)."""
    hidden = int(config.hidden_size)
    widths = [getattr(config, k, None) for k in ("intermediate_size", "moe_intermediate_size")]
    return {"hidden": hidden, "intermediate": max([int(w) for w in widths if w] or [4 * hidden])}


def model_logprob_tolerance(model: Any, token_ids: list[list[int]], context: int | None = None,
                            temperature: float = 1.0) -> float:
    """The tolerance for log-probs of `model` on these sequences at `temperature`: the reduction lengths
    from its config and `context` (default: the longest sequence), the logits' magnitude from its own
    float32 forward of them."""
    import torch

    with torch.no_grad():
        logit_max = max(float(model(input_ids=torch.tensor([ids])).logits.float().abs().max())
                        for ids in token_ids)
    context = max(len(ids) for ids in token_ids) if context is None else context
    return logprob_tolerance(**dims(model.config), context=context, vocab=int(model.config.vocab_size),
                             logit_max=logit_max / temperature)


def float32_error_of(model: Any, ids: list[int]) -> float:
    """One float32 computation's actual error: max |log-softmax of the float32 forward - of a float64
    forward of the same weights| over the sequence (float64 is exact at float32's resolution)."""
    import copy

    import torch

    with torch.no_grad():
        x = torch.tensor([ids])
        lp32 = torch.log_softmax(model(input_ids=x).logits.float(), -1).double()
        lp64 = torch.log_softmax(copy.deepcopy(model).double()(input_ids=x).logits, -1)
    return float((lp32 - lp64).abs().max())
