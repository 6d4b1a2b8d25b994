"""Evaluation metrics over k sampled answers per prompt: unbiased pass@k and majority vote.

pass@k is the chance that at least one of k answers drawn without replacement from the n
answers generated for a prompt is correct. With c of the n correct, the unbiased estimator
(Chen et al. 2021, "Evaluating Large Language Models Trained on Code", arXiv 2107.03374,
Sec. 2.1 and Fig. 3) is

    pass@k = 1 − C(n − c, k) / C(n, k) = 1 − Π_{i = n − c + 1}^{n} (1 − k / i)

The product form never builds the binomial coefficients, so it stays exact to float rounding
for any n (C(1000, 500) alone overflows a float).

maj@k (majority voting, "self-consistency", Wang et al. 2022, arXiv 2203.11171, Sec. 2): the
answer extracted most often among the k answers is the prompt's answer; it is scored as any of
the answers that carry it.
"""

from __future__ import annotations

from collections import Counter
from typing import Hashable, Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with `c` correct answers among `n` (1 <= k <= n)."""
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n, got c={c}, n={n}")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 1 <= k <= n, got k={k}, n={n}")
    if n - c < k:  # every draw of k answers holds a correct one
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def mean_pass_at_k(correct_counts: Sequence[int], n: int, k: int) -> float:
    """pass@k averaged over prompts, each with `correct_counts[p]` correct answers of `n`."""
    if not correct_counts:
        raise ValueError("mean_pass_at_k needs at least one prompt")
    return sum(pass_at_k(n, c, k) for c in correct_counts) / len(correct_counts)


def majority_vote(answers: Sequence[Hashable | None]) -> int | None:
    """The index of the first answer of the most frequent one (None entries carry no answer and
    do not vote; a tie goes to the answer that appeared first). None when no entry has an answer."""
    votes = Counter(a for a in answers if a is not None)
    if not votes:
        return None
    top = max(votes.values())
    return next(i for i, a in enumerate(answers) if a is not None and votes[a] == top)


def maj_at_k(answers: Sequence[Hashable | None], correct: Sequence[bool]) -> float:
    """1.0 when the majority answer among `answers` is correct (as judged for the answer that
    carries it first), else 0.0; 0.0 when no answer was extracted."""
    if len(answers) != len(correct):
        raise ValueError(f"maj_at_k: {len(answers)} answers but {len(correct)} verdicts")
    i = majority_vote(answers)
    return float(i is not None and bool(correct[i]))


def pass_k_values(k: int) -> list[int]:
    """The k values reported for `k` samples per prompt: 1, the powers of two below k, and k."""
    if k < 1:
        return []
    out, j = [1], 2
    while j < k:
        out.append(j)
        j *= 2
    return out + ([k] if k > 1 else [])
