"""The DSA top-k selection rule (glmlight.ops.dsa): the k largest scores, ties at the cut-off to
the most recent positions, as a mask and as indices."""

import torch

from glmlight.ops.dsa import topk_mask, topk_recent


def test_ties_at_the_cut_off_go_to_the_most_recent_positions():
    # k = 3 of [1, 0, 0, 0, 2]: 2 and 1 are above the cut-off; of the three 0s the last one is kept
    scores = torch.tensor([[1.0, 0.0, 0.0, 0.0, 2.0]])
    assert topk_mask(scores, 3).tolist() == [[True, False, False, True, True]]
    assert sorted(topk_recent(scores, 3)[0].tolist()) == [0, 3, 4]
    # -0.0 ties with 0.0; -inf (masked keys) only when fewer than k are finite
    scores = torch.tensor([[0.0, -0.0, float("-inf"), 5.0]])
    assert topk_mask(scores, 2).tolist() == [[False, True, False, True]]
    assert topk_mask(scores, 4).tolist() == [[True, True, True, True]]


def test_mask_and_indices_make_the_same_choice():
    # many exact ties (rounded ReLUs, zeros) and -inf for masked keys
    g = torch.Generator().manual_seed(0)
    scores = torch.relu(torch.randn(64, 50, generator=g)).round()
    scores[torch.rand(64, 50, generator=g) < 0.3] = float("-inf")
    for k in (1, 8, 20):
        picked = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, topk_recent(scores, k), True)
        assert torch.equal(topk_mask(scores, k), picked)


def test_half_precision_scores_are_read_as_float32():
    # under autocast the indexer's scores can be bf16
    scores = torch.tensor([[0.0, 2.0, 0.0, 1.0, 0.0, 0.0]])
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert sorted(topk_recent(scores.to(dtype), 3)[0].tolist()) == [1, 3, 5]
        assert topk_mask(scores.to(dtype), 3).tolist() == [[False, True, False, True, False, True]]
