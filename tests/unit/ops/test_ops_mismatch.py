"""Mismatch metrics and agreement checks against hand-computed numbers."""

import math

import torch
from torch.testing import assert_close

from glmlight.ops.mismatch import (
    mismatch_metrics,
    mismatch_sums,
    reduce_mismatch_sums,
    token_agreement,
    topk_agreement,
)

LN2 = math.log(2.0)


def batch():
    """Row 0: r = train − rollout = [ln2, −2ln2] (k = 2, 0.25); row 1: r = [0] (k = 1) + NaN padding."""
    train = torch.tensor([[-1.0, -2.0], [-0.5, float("nan")]])
    rollout = torch.tensor([[-1.0 - LN2, -2.0 + 2 * LN2], [-0.5, float("nan")]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    return train, rollout, mask


def test_mismatch_metrics_by_hand():
    m = mismatch_metrics(*batch(), low=0.5, high=2.0)
    expected = {
        # mean(−r) = (−ln2 + 2ln2 + 0) / 3
        "mismatch_kl": LN2 / 3,
        # e^r − r − 1: (2 − ln2 − 1) + (0.25 + 2ln2 − 1) + 0 = 0.25 + ln2, over 3 tokens
        "mismatch_k3_kl": (0.25 + LN2) / 3,
        # per sequence −mean(train): row0 (1 + 2)/2 = 1.5, row1 0.5 -> mean 1.0
        "train_log_ppl": 1.0,
        # row0 −(−1 − ln2 − 2 + 2ln2)/2 = (3 − ln2)/2, row1 0.5 -> ((3 − ln2)/2 + 0.5)/2
        "rollout_log_ppl": (3 - LN2) / 4 + 0.25,
        # 1.0 − ((3 − ln2)/4 + 0.25) = ln2 / 4
        "log_ppl_diff": LN2 / 4,
        # (2² + 0.25² + 1²)/3 − 1 = 5.0625/3 − 1
        "chi2_token": 5.0625 / 3 - 1,
        # row0 (2·0.25)² = 0.25, row1 1 -> mean 0.625 − 1
        "chi2_seq": -0.375,
        # k in [0.5, 2]: 2 (inclusive) and 1, not 0.25 -> 2/3
        "trusted_token_ratio": 2 / 3,
    }
    assert set(m) == set(expected)
    for key, value in expected.items():
        assert_close(m[key], torch.tensor(value), msg=key)


def test_trusted_ratio_only_with_band():
    assert "trusted_token_ratio" not in mismatch_metrics(*batch())


def test_k3_sign_estimates_kl_rollout_to_train():
    # Tokens sampled from q = π_rollout = [0.5, 0.25, 0.25] in exact proportion (token 0 twice);
    # p = π_train = [0.25, 0.25, 0.5]. KL(q‖p) = 0.5·ln2 + 0.25·0 + 0.25·ln(0.5) = 0.25·ln2.
    # k3 per token with r = ln(p/q): token0 0.5 + ln2 − 1, token1 0, token2 2 − ln2 − 1;
    # (2·(ln2 − 0.5) + 0 + 1 − ln2) / 4 = ln2 / 4 as well, so the sign is the right one.
    q = torch.tensor([0.5, 0.5, 0.25, 0.25])
    p = torch.tensor([0.25, 0.25, 0.25, 0.5])
    m = mismatch_metrics(p.log()[None], q.log()[None], torch.ones(1, 4))
    assert_close(m["mismatch_k3_kl"], torch.tensor(LN2 / 4))
    assert_close(m["mismatch_kl"], torch.tensor(LN2 / 4))


def test_sums_add_across_ranks():
    train, rollout, mask = batch()
    rank0 = mismatch_sums(train[:1], rollout[:1], mask[:1], 0.5, 2.0)
    rank1 = mismatch_sums(train[1:], rollout[1:], mask[1:], 0.5, 2.0)
    summed = {key: rank0[key] + rank1[key] for key in rank0}
    whole = mismatch_metrics(train, rollout, mask, 0.5, 2.0)
    reduced = reduce_mismatch_sums(summed)
    for key in whole:
        assert_close(reduced[key], whole[key], msg=key)
    assert_close(summed["token_count"], torch.tensor(3.0))
    assert_close(summed["seq_count"], torch.tensor(2.0))


def test_chi2_seq_clamped_in_log_space():
    # Σ r = 30 > 20 -> (Π k)² = exp(40), finite
    train = torch.tensor([[15.0, 15.0]])
    m = mismatch_metrics(train, torch.zeros_like(train), torch.ones(1, 2))
    assert_close(m["chi2_seq"], torch.tensor(math.exp(40.0) - 1.0))


def test_empty_mask_gives_nan():
    train, rollout, _ = batch()
    m = mismatch_metrics(train, rollout, torch.zeros(2, 2), 0.5, 2.0)
    assert all(torch.isnan(v) for v in m.values())


def test_token_agreement():
    a = torch.tensor([[1, 2, 3], [4, 5, 6]])
    b = torch.tensor([[1, 0, 3], [4, 5, 9]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    # 4 matches out of 5 mask positions; the mismatch at (1, 2) is padding
    assert_close(token_agreement(a, b, mask), torch.tensor(0.8))


def test_topk_agreement():
    a = torch.tensor([[0, 1, 2, 3], [5, 6, 7, 8]])
    b = torch.tensor([[3, 2, 1, 0], [5, 9, 10, 11]])
    # row 0: same set in another order -> 4/4; row 1: only 5 shared -> 1/4; mean 0.625
    assert_close(topk_agreement(a, b), torch.tensor(0.625))
    # leading dims [2, 1, k] give the same mean
    assert_close(topk_agreement(a[:, None], b[:, None]), torch.tensor(0.625))


def test_topk_agreement_padding():
    a = torch.tensor([[0, 1, -1, -1], [0, 1, 2, -1], [-1, -1, -1, -1]])
    b = torch.tensor([[1, 4, -1, -1], [0, -1, -1, -1], [-1, -1, -1, -1]])
    # row 0: {1} shared of 2 valid -> 1/2; row 1: {0} shared, max(3, 1) valid -> 1/3;
    # row 2: all padding -> left out. Mean (1/2 + 1/3) / 2 = 5/12
    assert_close(topk_agreement(a, b), torch.tensor(5 / 12))
