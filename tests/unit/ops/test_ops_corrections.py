"""Mismatch corrections against hand-computed numbers.

Log-probs are built as old = log k, rollout = 0, so k = exp(old − rollout) is
exactly k in float32 for the values used here (0.25, 0.5, 1, 2, 3, ...).
"""

import math

import pytest
import torch
from torch.testing import assert_close

from glmlight.ops.corrections import (
    icepop,
    masked_is,
    rejection_sampling,
    truncated_is,
)

PAD = float("nan")  # padding ratio: must never be read


def logprobs(ks: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(old, rollout) with old − rollout = log k; NaN k marks padding (old=-inf, rollout=NaN)."""
    old = torch.tensor([[math.log(k) if not math.isnan(k) else -math.inf for k in row] for row in ks])
    rollout = torch.tensor([[0.0 if not math.isnan(k) else PAD for k in row] for row in ks])
    return old, rollout


def t(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def test_icepop_band_inclusive_and_padding_ignored():
    old, rollout = logprobs([[0.5, 1.0, 3.0, 2.0], [0.25, 4.0, 1.0, PAD]])
    mask = t([[1, 1, 1, 1], [1, 1, 1, 0]])
    res = icepop(old, rollout, mask, low=0.5, high=2.0)
    # 0.5 and 2.0 sit on the band edges (inclusive) -> kept; 3.0, 0.25, 4.0 popped; padding weight 1 keep 0.
    assert_close(res.weights, t([[0.5, 1.0, 0.0, 2.0], [0.0, 0.0, 1.0, 1.0]]))
    assert_close(res.keep_mask, t([[1, 1, 0, 1], [0, 0, 1, 0]]))
    # 3 of 7 mask tokens popped; kept weights (0.5 + 1 + 2 + 1) / 4 = 1.125
    assert res.stats["removed_frac"] == pytest.approx(3 / 7)
    assert res.stats["popped_frac"] == pytest.approx(3 / 7)
    assert res.stats["weight_mean"] == pytest.approx(1.125)


def test_icepop_band_edges_exact_at_one():
    old, rollout = logprobs([[1.0, 1.0]])
    mask = t([[1, 1]])
    assert_close(icepop(old, rollout, mask, low=1.0, high=1.0).keep_mask, t([[1, 1]]))


def test_truncated_is():
    old, rollout = logprobs([[0.5, 1.0, 3.0], [2.5, 0.25, PAD]])
    mask = t([[1, 1, 1], [1, 1, 0]])
    res = truncated_is(old, rollout, mask)
    # clamp(k, 0, 2): 3.0 -> 2, 2.5 -> 2; nothing removed
    assert_close(res.weights, t([[0.5, 1.0, 2.0], [2.0, 0.25, 1.0]]))
    assert_close(res.keep_mask, mask)
    assert res.stats["removed_frac"] == 0.0
    assert res.stats["clipped_frac"] == pytest.approx(2 / 5)
    # (0.5 + 1 + 2 + 2 + 0.25) / 5 = 1.15
    assert res.stats["weight_mean"] == pytest.approx(1.15)

    low = truncated_is(old, rollout, mask, clip_low=0.5, clip_high=2.0)
    assert_close(low.weights, t([[0.5, 1.0, 2.0], [2.0, 0.5, 1.0]]))
    assert low.stats["clipped_frac"] == pytest.approx(3 / 5)


def test_masked_is_matches_icepop_numbers():
    old, rollout = logprobs([[0.5, 1.0, 3.0, 2.0], [0.25, 4.0, 1.0, PAD]])
    mask = t([[1, 1, 1, 1], [1, 1, 1, 0]])
    mis = masked_is(old, rollout, mask, low=0.5, high=2.0)
    pop = icepop(old, rollout, mask, low=0.5, high=2.0)
    assert_close(mis.weights, pop.weights)
    assert_close(mis.keep_mask, pop.keep_mask)
    assert mis.stats["removed_frac"] == pytest.approx(3 / 7)
    assert mis.stats["ratio_low_frac"] == pytest.approx(1 / 7)  # 0.25
    assert mis.stats["ratio_high_frac"] == pytest.approx(2 / 7)  # 3.0, 4.0


def test_token_modes_truncate_clip():
    old, rollout = logprobs([[0.25, 1.0, 3.0]])
    mask = t([[1, 1, 1]])
    trunc = rejection_sampling(old, rollout, mask, "token", 0.5, 2.0, "truncate")
    clip = rejection_sampling(old, rollout, mask, "token", 0.5, 2.0, "clip")
    # truncate leaves the lower side: min(k, 2); clip: clamp(k, 0.5, 2)
    assert_close(trunc.weights, t([[0.25, 1.0, 2.0]]))
    assert_close(clip.weights, t([[0.5, 1.0, 2.0]]))
    assert_close(trunc.keep_mask, mask)
    assert_close(clip.keep_mask, mask)


# Row 0: k = 2, 0.5, 4 -> product 4, geometric 4^(1/3) ≈ 1.5874.
# Row 1: k = 2, 1, padding with k = 1e9 -> product 2, geometric (over 2 mask tokens) √2.
SEQ_KS = [[2.0, 0.5, 4.0], [2.0, 1.0, 1e9]]
SEQ_MASK = [[1, 1, 1], [1, 1, 0]]


def test_sequence_level_mask_rejects_whole_sequence():
    old, rollout = logprobs(SEQ_KS)
    res = rejection_sampling(old, rollout, t(SEQ_MASK), "sequence", 0.5, 2.0, "mask")
    # row 0 product 4 > 2 -> all three tokens removed; row 1 product 2 kept (inclusive edge;
    # padding weight 1, keep 0)
    assert_close(res.weights, t([[0.0, 0.0, 0.0], [2.0, 2.0, 1.0]]))
    assert_close(res.keep_mask, t([[0, 0, 0], [1, 1, 0]]))
    assert res.stats["removed_frac"] == pytest.approx(3 / 5)
    assert res.stats["weight_mean"] == pytest.approx(2.0)


def test_geometric_level_keeps_what_sequence_rejects():
    old, rollout = logprobs(SEQ_KS)
    res = rejection_sampling(old, rollout, t(SEQ_MASK), "geometric", 0.5, 2.0, "mask")
    c = 4.0 ** (1 / 3)  # exp((ln2 + ln0.5 + ln4) / 3) = 1.5874...
    d = math.sqrt(2.0)  # exp((ln2 + ln1) / 2): padding is not in the count (2^(1/3) if it were)
    assert_close(res.weights, t([[c, c, c], [d, d, 1.0]]))
    assert_close(res.keep_mask, t([[1, 1, 1], [1, 1, 0]]))
    assert res.stats["removed_frac"] == 0.0
    assert res.stats["weight_mean"] == pytest.approx((3 * c + 2 * d) / 5)


def test_sequence_level_truncate():
    old, rollout = logprobs(SEQ_KS)
    res = rejection_sampling(old, rollout, t(SEQ_MASK), "sequence", 0.5, 2.0, "truncate")
    # min(4, 2) = 2 on row 0; min(2, 2) = 2 on row 1; padding 1
    assert_close(res.weights, t([[2.0, 2.0, 2.0], [2.0, 2.0, 1.0]]))
    assert_close(res.keep_mask, t(SEQ_MASK))


def test_sequence_log_ratio_clamped():
    old, rollout = logprobs([[1e6, 1e6]])  # Σ log k = 2·13.8 = 27.6 -> clamped to 20
    res = rejection_sampling(old, rollout, t([[1, 1]]), "sequence", 0.5, 1e12, "clip")
    assert_close(res.weights, torch.full((1, 2), math.exp(20.0)))


def test_veto_removes_sequence_strictly_below_threshold():
    old, rollout = logprobs([[1.0, 5e-5, 2.0], [0.5, 1.0, 1e-9]])
    mask = t([[1, 1, 1], [1, 1, 0]])
    res = rejection_sampling(old, rollout, mask, "token", 0.5, 2.0, "truncate", veto_threshold=1e-4)
    # row 0 has k = 5e-5 < 1e-4 -> vetoed; row 1's tiny k is on padding -> ignored
    assert_close(res.weights, t([[0.0, 0.0, 0.0], [0.5, 1.0, 1.0]]))
    assert_close(res.keep_mask, t([[0, 0, 0], [1, 1, 0]]))
    assert res.stats["removed_frac"] == pytest.approx(3 / 5)
    assert res.stats["veto_seq_frac"] == pytest.approx(0.5)

    # k equal to the threshold is not vetoed (strict <)
    edge = rejection_sampling(old, rollout, mask, "token", 0.25, 2.0, "clip", veto_threshold=0.5)
    assert_close(edge.keep_mask, t([[0, 0, 0], [1, 1, 0]]))  # row 0 vetoed by 5e-5, row 1 (k=0.5) kept


def test_batch_normalize_token_truncate():
    old, rollout = logprobs([[0.5, 1.0, 3.0], [2.5, PAD, PAD]])
    mask = t([[1, 1, 1], [1, 0, 0]])
    res = rejection_sampling(old, rollout, mask, "token", 0.1, 10.0, "truncate", batch_normalize=True)
    # mean over kept = (0.5 + 1 + 3 + 2.5) / 4 = 1.75 -> weights / 1.75 = 2/7, 4/7, 12/7, 10/7
    assert_close(res.weights, t([[2 / 7, 4 / 7, 12 / 7], [10 / 7, 1.0, 1.0]]))
    assert res.stats["batch_norm_factor"] == pytest.approx(1.75)
    assert res.stats["weight_mean"] == pytest.approx(1.0)


def test_batch_normalize_over_kept_tokens_only():
    old, rollout = logprobs([[0.5, 1.0, 3.0, 2.0]])
    mask = t([[1, 1, 1, 1]])
    res = rejection_sampling(old, rollout, mask, "token", 0.5, 2.0, "mask", batch_normalize=True)
    # 3.0 removed; kept mean (0.5 + 1 + 2) / 3 = 7/6 -> 3/7, 6/7, 0, 12/7 (kept sum 3 over 3 tokens)
    assert_close(res.weights, t([[3 / 7, 6 / 7, 0.0, 12 / 7]]))
    kept = mask * res.keep_mask
    assert_close((res.weights * kept).sum() / kept.sum(), torch.tensor(1.0))


def test_padding_does_not_change_stats_or_products():
    old, rollout = logprobs([[2.0, 0.5, PAD, PAD]])
    padded = rejection_sampling(old, rollout, t([[1, 1, 0, 0]]), "sequence", 0.5, 2.0, "mask")
    old2, rollout2 = logprobs([[2.0, 0.5]])
    plain = rejection_sampling(old2, rollout2, t([[1, 1]]), "sequence", 0.5, 2.0, "mask")
    assert_close(padded.weights[:, :2], plain.weights)
    assert padded.stats == plain.stats
    assert torch.isfinite(padded.weights).all()


def test_empty_mask_stats_are_nan():
    old, rollout = logprobs([[2.0, 0.5]])
    res = icepop(old, rollout, t([[0, 0]]), 0.5, 2.0)
    assert math.isnan(res.stats["removed_frac"]) and math.isnan(res.stats["weight_mean"])
    assert_close(res.weights, t([[1.0, 1.0]]))


def test_bad_level_or_mode_raises():
    old, rollout = logprobs([[1.0]])
    with pytest.raises(ValueError, match="level"):
        rejection_sampling(old, rollout, t([[1]]), "tokens", 0.5, 2.0, "mask")
    with pytest.raises(ValueError, match="mode"):
        rejection_sampling(old, rollout, t([[1]]), "token", 0.5, 2.0, "reject")


def test_weights_are_detached():
    old = torch.tensor([[math.log(2.0)]], requires_grad=True)
    res = truncated_is(old, torch.zeros(1, 1), t([[1]]))
    assert not res.weights.requires_grad
