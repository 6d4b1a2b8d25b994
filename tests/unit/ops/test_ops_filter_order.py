"""The two ways engines combine top-k and top-p (glmlight/ops/logprobs.py), worked by hand."""

import math

import pytest
import torch

from glmlight.ops.logprobs import joint_kept, logprobs_from_logits, processed_logits

# probabilities 0.4, 0.3, 0.2, 0.1 at temperature 1
LOGITS = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
NEG = float("-inf")


def test_joint_and_sequential_differ_by_hand():
    """top_k = 2, top_p = 0.5.
    sequential: top-2 renormalised is 4/7, 3/7; the mass before token 1 is 4/7 >= 0.5: only token 0 stays.
    joint: top-p on the full distribution: the mass before token 1 is 0.4 <= 0.5 (kept), before token 2
    it is 0.7 (dropped); with top-2: tokens 0 and 1, renormalised 4/7 and 3/7."""
    labels = torch.arange(4).view(1, 4)
    logits = LOGITS.expand(4, 4).unsqueeze(0)  # the same position four times, one label each
    seq = logprobs_from_logits(logits, labels, 1.0, 2, 0.5, "sequential")[0].tolist()
    joint = logprobs_from_logits(logits, labels, 1.0, 2, 0.5, "joint")[0].tolist()
    assert seq[0] == pytest.approx(0.0, abs=1e-6) and seq[1:] == [NEG, NEG, NEG]
    assert joint[0] == pytest.approx(math.log(4 / 7), abs=1e-6) and joint[1] == pytest.approx(math.log(3 / 7), abs=1e-6)
    assert joint[2:] == [NEG, NEG]


def test_joint_kept_boundaries():
    """A token is kept when the mass before it is at most top_p (SGLang's `>` drops it), and its rank
    is below top_k; top_k <= 0 is no top-k."""
    assert joint_kept(LOGITS, torch.tensor(3), torch.tensor(0.7)).tolist() == [[True, True, True, False]]
    assert joint_kept(LOGITS, torch.tensor(0), torch.tensor(0.69)).tolist() == [[True, True, False, False]]
    assert joint_kept(LOGITS, torch.tensor(1), torch.tensor(0.99)).tolist() == [[True, False, False, False]]
    # rows with their own settings; the order of the vocabulary does not matter
    rows = torch.log(torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.4, 0.3, 0.2, 0.1]]))
    kept = joint_kept(rows, torch.tensor([4, 2]), torch.tensor([0.45, 0.9]))
    assert kept.tolist() == [[False, False, True, True], [True, True, False, False]]


def test_orders_agree_with_one_filter_only():
    logits = torch.randn(3, 50)
    for k, p in ((5, 1.0), (0, 0.6)):
        a = processed_logits(logits, 0.7, k, p, order="sequential")
        b = processed_logits(logits, 0.7, k, p, order="joint")
        assert torch.equal(a.isinf(), b.isinf())
    with pytest.raises(ValueError, match="unknown top-k/top-p order"):
        processed_logits(logits, 1.0, 5, 0.5, order="flashinfer")


# probabilities 0.4, 0.2, 0.2, 0.2: three exact ties
TIED = torch.log(torch.tensor([[0.4, 0.2, 0.2, 0.2]]))


def _lp(logits, k, p, order):
    V = logits.shape[-1]
    return logprobs_from_logits(logits.expand(V, V).unsqueeze(0), torch.arange(V).view(1, V), 1.0, k, p, order)[0]


def test_top_k_ties_per_engine_by_hand():
    """top_k = 2 with the 2nd, 3rd and 4th tied.
    sequential (vLLM 0.32.0 masks logits < the k-th): all four kept, log 0.4, log 0.2 x3.
    joint (SGLang 0.5.23 zeroes rank >= top_k): exactly 2, tokens 0 and 1 (ties by token id),
    renormalised 0.4/0.6 = 2/3 and 0.2/0.6 = 1/3."""
    seq = _lp(TIED, 2, 1.0, "sequential").tolist()
    assert seq == pytest.approx([math.log(0.4)] + [math.log(0.2)] * 3, abs=1e-6)
    joint = _lp(TIED, 2, 1.0, "joint").tolist()
    assert joint[:2] == pytest.approx([math.log(2 / 3), math.log(1 / 3)], abs=1e-6) and joint[2:] == [NEG, NEG]
    # with top-p too: top_k = 4, top_p = 0.7; the mass before rank 2 is 0.6 (kept), before rank 3 0.8 (dropped):
    # tokens 0, 1, 2 renormalised over 0.8: 1/2, 1/4, 1/4
    joint = _lp(TIED, 4, 0.7, "joint").tolist()
    assert joint[:3] == pytest.approx([math.log(1 / 2), math.log(1 / 4), math.log(1 / 4)], abs=1e-6)
    assert joint[3] == NEG


def test_ties_are_ranked_by_token_id_in_a_large_vocabulary():
    """4,096 tokens of equal logit (probability 2^-12 each, sums exact in float32).
    joint, top_k = 5: tokens 0-4, log(1/5) each; the rest -inf (the tie-keeping rule kept all: log 2^-12).
    top_p = 0.5 (either order): the mass before rank r is r / 4096, dropped from r = 2048: tokens
    0-2047, log(1/2048) each."""
    V = 4096
    flat = torch.zeros(1, 1, V)
    z = processed_logits(flat, 1.0, 5, 1.0, order="joint")[0, 0]
    assert z.isfinite().nonzero().flatten().tolist() == [0, 1, 2, 3, 4]
    lp = logprobs_from_logits(flat.expand(1, 5, V), torch.arange(5).view(1, 5), 1.0, 5, 1.0, "joint")
    assert lp.flatten().tolist() == pytest.approx([math.log(1 / 5)] * 5, abs=1e-6)
    for order in ("sequential", "joint"):
        kept = processed_logits(flat, 1.0, 0, 0.5, order=order)[0, 0].isfinite()
        assert kept.nonzero().flatten().tolist() == list(range(2048)), order
        lp = logprobs_from_logits(flat, torch.tensor([[7]]), 1.0, 0, 0.5, order)
        assert float(lp) == pytest.approx(math.log(1 / 2048), abs=1e-6)


def test_per_token_settings_equal_each_rows_own():
    """Temperature, top-k and top-p as [B, T] tensors (a turn drawn with the client's sampling): every
    position's log-probs are those of its own scalar settings, in both orders."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 30, generator=g)
    labels = torch.randint(0, 30, (2, 3), generator=g)
    temp = torch.tensor([[1.0, 0.3, 0.0], [2.0, 1.0, 0.7]])
    top_k = torch.tensor([[0, 5, 0], [3, 0, 30]])
    top_p = torch.tensor([[1.0, 0.8, 0.5], [1.0, 0.9, 1.0]])
    for order in ("sequential", "joint"):
        got = logprobs_from_logits(logits, labels, temp, top_k, top_p, order)
        for b in range(2):
            for t in range(3):
                want = logprobs_from_logits(logits[b:b + 1, t:t + 1], labels[b:b + 1, t:t + 1], float(temp[b, t]),
                                            int(top_k[b, t]), float(top_p[b, t]), order)
                assert torch.equal(got[b, t], want[0, 0]), (order, b, t)
