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

This covers the log-probs (and, through logit_error, the logits) of a forward. Three derived quantities:

Means over tokens (mean_tolerance). The mismatch KL of glmlight/ops/mismatch.py is the k1 estimate
mean(log p_rollout - log p_train) over the sampled tokens, not the expectation under p: with every token's
difference within d it is within d (all of one sign in the worst case), not d^2/2 (the second-order bound
of the exact KL of two normalised distributions, which the finite sample does not inherit). The difference
of two log-perplexities is a difference of two means of such terms, within d as well. Each side's float32
mean of n terms adds lambda * sqrt(n) * u * mean|log p| of rounding, so the bound is d plus twice that.

Gradients (gradient_tolerance). A weight's gradient is a sum over the n token positions of the batch of
terms c_k (one outer product of a backward signal and an activation per position); two computations split
it differently (micro-batches, ranks, a shared prompt's forward: m partial float32 sums, then a float32 sum
of the m partials), and each c_k carries the forward's and the backward's rounding (the backward reduces
over the same lengths transposed: 2N in quadrature). By step 1 the error is lambda * sqrt(2N + n) * u *
sum|c_k| in each computation. sum|c_k| is not recorded; with advantages of either sign the c_k add like a
random walk, |g| ~ sqrt(n) rms(c), sum|c| ~ n mean|c|, so sum|c_k| ~ sqrt(n) |g|, and |g| is bounded by the
largest gradient entry of the step. A summation-order difference stays within this; a defect (a micro-batch
counted twice, a wrong normaliser) moves gradients by a fraction of |g| itself, 1e3 to 1e4 times more.
gradient_tolerances bounds each tensor from its own largest entry instead: a router's or a norm's gradient,
orders of magnitude below an embedding's, is then held to its own scale.

Parameters after one AdamW step (adamw_first_step_tolerance). At step 1, m = (1 - b1) g and v = (1 - b2) g^2,
so the bias-corrected update is lr * g / (|g| + eps) (plus weight decay, the same on both sides): a
gradient difference dg moves it by lr * eps * dg / (|g| + eps)^2 (the derivative of g / (|g| + eps)), at most
2 lr where the sign flips. A gradient much larger than eps gives lr * sign(g) on both sides; one within dg of
zero may move by up to lr. The parameter's own rounding (the subtraction, the decay) adds 2u|theta| per
computation, and the update's own float32 evaluation about ten roundings of its size (at most lr): the two
moments, the bias corrections, the square root, the sum with eps, the quotient, the product with lr; two
implementations (torch's fused AdamW in one process, its per-tensor loop over DTensor shards) order them
otherwise, so 2 * 10 u lr (a parameter near zero, stepped by lr in both, was seen 5 u lr apart). After several steps the parameters differ and so do the next gradients; those comparisons
are best made on the gradients, before the optimiser.

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


def model_logit_tolerance(model: Any, token_ids: list[list[int]], context: int | None = None) -> float:
    """How far two float32 computations of the same logits may be apart (twice logit_error, step 2)."""
    import torch

    with torch.no_grad():
        logit_max = max(float(model(input_ids=torch.tensor([ids])).logits.float().abs().max())
                        for ids in token_ids)
    context = max(len(ids) for ids in token_ids) if context is None else context
    return 2 * logit_error(**dims(model.config), context=context, logit_max=logit_max)


def mean_tolerance(per_token: float, *, tokens: int, magnitude: float, lam: float = 2.0) -> float:
    """A mean over `tokens` of differences each within `per_token` (a mismatch KL, a log-perplexity
    difference): per_token in the worst case, plus each side's float32 rounding of a mean of terms of
    size `magnitude` (|log p|)."""
    return per_token + 2 * lam * math.sqrt(tokens) * U32 * magnitude


def gradient_tolerance(grads: dict, *, hidden: int, intermediate: int, context: int, tokens: int,
                       lam: float = 2.0) -> float:
    """How far two float32 computations of a step's gradients may be apart, element-wise: twice
    lambda * sqrt(2N + n) * u * sqrt(n) * max|g| (`grads`: one computation's gradients by name, `tokens`: the
    batch's token positions n, N: reduction_length)."""
    n_path = 2 * reduction_length(hidden=hidden, intermediate=intermediate, context=context)
    scale = max(float(g.abs().max()) for g in grads.values())
    return 2 * lam * math.sqrt(n_path + tokens) * U32 * math.sqrt(tokens) * scale


def gradient_tolerances(grads: dict, *, hidden: int, intermediate: int, context: int, tokens: int,
                        lam: float = 2.0) -> dict:
    """gradient_tolerance for each tensor of `grads` from its own largest entry, by name (a bound for
    `within`). An entry's rounding is relative to its own terms' sum|c_k|, and a tensor's terms share a
    scale (one layer's activations and backward signals), while the tensors of one model differ by orders
    of magnitude (an embedding's gradient ~1e-3, a router's or a norm's ~1e-6): one bound from the largest
    gradient of the step would let a small tensor's gradient be wrong by all of itself."""
    return {name: gradient_tolerance({name: g}, hidden=hidden, intermediate=intermediate, context=context,
                                     tokens=tokens, lam=lam) for name, g in grads.items()}


def adamw_first_step_tolerance(grad: Any, grad_tol: float, param: Any, *, lr: float, eps: float = 1e-8) -> Any:
    """Element-wise: how far two parameters may be apart after one AdamW step from the same values, their
    gradients within grad_tol of `grad`."""
    import torch

    g = (grad.abs() - grad_tol).clamp(min=0)
    moved = (lr * eps * grad_tol / (g + eps) ** 2).clamp(max=2 * lr)
    return moved + 4 * U32 * param.abs() + 20 * U32 * lr


def within(a: dict, b: dict, bound: dict) -> list[str]:
    """The names whose tensors differ by more than their element-wise bound (empty: all within); a name
    without a bound (no gradient, no step) must be equal."""
    return [k for k in a if not bool(((a[k] - b[k]).abs() <= bound.get(k, 0.0)).all())]
