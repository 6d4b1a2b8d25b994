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
