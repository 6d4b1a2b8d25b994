"""GRPO-side ops against numbers worked out by hand."""

import math

import pytest
import torch
from torch.testing import assert_close

from glmlight.ops.advantages import group_advantages, soft_overlong_penalty
from glmlight.ops.kl import kl_penalty
from glmlight.ops.logprobs import entropy_from_logits, logprobs_from_logits
from glmlight.ops.policy_loss import ppo_clip_loss
from glmlight.ops.reduce import aggregate_loss, masked_mean


def test_group_advantages_by_hand():
    # group 0: rewards 1, 0, 0, 1 -> mean 0.5, population std 0.5 -> ±1
    # group 7: rewards 3, 1 -> mean 2, std 1 -> ±1 ; Dr.GRPO: ±1 too but group 0 gives ±0.5
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 1.0])
    g = torch.tensor([0, 0, 0, 0, 7, 7])
    assert_close(group_advantages(r, g, eps=0.0), torch.tensor([1.0, -1.0, -1.0, 1.0, 1.0, -1.0]))
    assert_close(group_advantages(r, g, normalize_std=False), torch.tensor([0.5, -0.5, -0.5, 0.5, 1.0, -1.0]))
    # all-equal group: zero advantage, no division blow-up
    assert_close(group_advantages(torch.tensor([2.0, 2.0]), torch.tensor([1, 1])), torch.zeros(2))


@pytest.mark.parametrize("normalize_std", [True, False])
def test_equal_reward_groups_get_exactly_zero(normalize_std):
    # Rewards like 0.8 are not exact in binary: a float32 mean is an ulp off, and an ulp divided by a
    # std of one ulp used to give every member the same non-zero advantage (8 x 0.8 -> -0.056).
    values = [0.8, 0.2, 0.1, 0.3, 0.7, 0.9, 1.1, -0.6, 1 / 3, 2 / 3, 0.05, 1e-7, 123.456, 1.0, 0.0]
    for g in (2, 3, 4, 5, 7, 8, 16, 31, 32, 64, 128):
        for v in values:
            r = torch.full((g,), v, dtype=torch.float32)
            adv = group_advantages(r, torch.zeros(g, dtype=torch.long), normalize_std=normalize_std)
            assert (adv == 0).all(), (g, v, adv[:3])
    # mixed batch: equal groups stay exactly 0 next to groups with signal
    r = torch.tensor([0.8] * 8 + [1.0, 0.1] * 4 + [0.2] * 32)
    ids = torch.tensor([0] * 8 + [1] * 8 + [2] * 32)
    adv = group_advantages(r, ids, normalize_std=normalize_std)
    assert (adv[:8] == 0).all() and (adv[16:] == 0).all() and (adv[8:16] != 0).all()


def test_singleton_groups():
    # zero by default (no baseline); "raw" keeps R (verl: mean 0, std 1 for a group of one)
    r, ids = torch.tensor([0.7, 0.3, 1.0, 0.0]), torch.tensor([0, 1, 2, 2])
    assert_close(group_advantages(r, ids), torch.tensor([0.0, 0.0, 1.0, -1.0]), atol=1e-5, rtol=0)
    assert_close(group_advantages(r, ids, singleton="raw", eps=0.0), torch.tensor([0.7, 0.3, 1.0, -1.0]))
    assert_close(group_advantages(r, ids, normalize_std=False, singleton="raw"), torch.tensor([0.7, 0.3, 0.5, -0.5]))


def test_soft_overlong_penalty_dapo():
    # L_max = 10, L_cache = 4: lengths <= 6 -> 0; 8 -> (6 - 8)/4 = -0.5; 10 -> -1; 11 -> -1
    pen = soft_overlong_penalty(torch.tensor([3, 6, 8, 10, 11]), max_len=10, cache_len=4)
    assert_close(pen, torch.tensor([0.0, 0.0, -0.5, -1.0, -1.0]))


def test_ppo_clip_by_hand():
    # ratios 0.5, 1.0, 1.5 (log space), eps_low 0.2, eps_high 0.28
    old = torch.zeros(1, 3)
    new = torch.log(torch.tensor([[0.5, 1.0, 1.5]]))
    out = ppo_clip_loss(new, old, torch.ones(1, 3), 0.2, 0.28)
    # A = +1: max(-r, -clip(r)) = -min(r, clip) -> -0.5, -1.0, -1.28
    assert_close(out.loss, torch.tensor([[-0.5, -1.0, -1.28]]))
    assert out.clipped.tolist() == [[0.0, 0.0, 1.0]]
    out = ppo_clip_loss(new, old, -torch.ones(1, 3), 0.2, 0.28)
    # A = -1: max(r, clip(r)) -> 0.8, 1.0, 1.5
    assert_close(out.loss, torch.tensor([[0.8, 1.0, 1.5]]))
    assert out.clipped.tolist() == [[1.0, 0.0, 0.0]]


def test_dual_clip_bounds_negative_advantages():
    # r = 4, A = -1: PPO loss max(4, 1.28) = 4; dual clip c = 3 -> min(4, 3) = 3
    new, old = torch.log(torch.tensor([[4.0, 4.0]])), torch.zeros(1, 2)
    out = ppo_clip_loss(new, old, torch.tensor([[-1.0, 1.0]]), 0.2, 0.28, dual_clip_c=3.0)
    assert_close(out.loss, torch.tensor([[3.0, -1.28]]))
    assert out.dual_clipped.tolist() == [[1.0, 0.0]]
    with pytest.raises(ValueError):
        ppo_clip_loss(new, old, torch.ones(1, 2), 0.2, 0.2, dual_clip_c=1.0)


def test_ppo_gradient_zero_when_clipped():
    new = torch.log(torch.tensor([[1.5, 1.1]])).requires_grad_()
    ppo_clip_loss(new, torch.zeros(1, 2), torch.ones(1, 2), 0.2, 0.28).loss.sum().backward()
    # clipped token: no gradient; unclipped: d(-r)/dlogp = -r = -1.1
    assert_close(new.grad, torch.tensor([[0.0, -1.1]]))


def test_kl_estimators_by_hand():
    lp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    lr = math.log(2.0)
    assert_close(kl_penalty(lp, ref, "k1"), torch.tensor([lr]))
    assert_close(kl_penalty(lp, ref, "k2"), torch.tensor([0.5 * lr * lr]))
    assert_close(kl_penalty(lp, ref, "k3"), torch.tensor([0.5 - 1.0 + lr]))  # exp(-ln2) = 0.5
    with pytest.raises(ValueError):
        kl_penalty(lp, ref, "k4")


def test_aggregation_modes_by_hand():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    # token mean: (1+2+3+4)/4 = 2.5 ; seq mean of token means: (2 + 4)/2 = 3 ; constant C=5: 10/(2*5) = 1
    assert_close(aggregate_loss(loss, mask, "token_mean"), torch.tensor(2.5))
    assert_close(aggregate_loss(loss, mask, "seq_mean_token_mean"), torch.tensor(3.0))
    assert_close(aggregate_loss(loss, mask, "constant", constant=5.0), torch.tensor(1.0))
    # micro-batches with the minibatch totals add up to the minibatch loss
    parts = [aggregate_loss(loss[i:i + 1], mask[i:i + 1], "token_mean", total_tokens=4.0) for i in range(2)]
    assert_close(sum(parts), torch.tensor(2.5))
    parts = [aggregate_loss(loss[i:i + 1], mask[i:i + 1], "seq_mean_token_mean", num_sequences=2) for i in range(2)]
    assert_close(sum(parts), torch.tensor(3.0))
    assert_close(masked_mean(loss, mask), torch.tensor(2.5))


def test_logprobs_and_entropy_by_hand():
    logits = torch.log(torch.tensor([[[0.5, 0.25, 0.25]]]))
    assert_close(logprobs_from_logits(logits, torch.tensor([[1]])), torch.tensor([[math.log(0.25)]]))
    # temperature 0.5 squares the probabilities before renormalising: 0.25, 0.0625, 0.0625 / 0.375
    assert_close(logprobs_from_logits(logits, torch.tensor([[0]]), temperature=0.5),
                 torch.tensor([[math.log(0.25 / 0.375)]]))
    h = -(0.5 * math.log(0.5) + 2 * 0.25 * math.log(0.25))
    assert_close(entropy_from_logits(logits), torch.tensor([[h]]))
