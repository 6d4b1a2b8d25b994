"""GAE family against hand-computed numbers and against GAE on compacted sequences, and CompactionRL's
advantages (cross-trajectory GAE over a trajectory's segments, per-turn rewards, normalisation) by hand."""

import math

import pytest
import torch
from torch.testing import assert_close

from glmlight.algorithms.compaction import CompactionConfig, CompactionRL
from glmlight.ops.gae import (
    adaptive_lambda,
    cross_trajectory_gae,
    explained_variance,
    gae,
    masked_scale,
    masked_whiten,
    segment_lambda,
    skip_observation_gae,
)
from glmlight.sample import Experience, Sample


def t(rows):
    return torch.tensor(rows, dtype=torch.float32)


def test_gae_by_hand():
    # Row 0, γ = 1, λ = 0.5, rewards [0, 0, 1], V [0.5, 0.6, 0.7]:
    #   t2: δ = 1 + 0 − 0.7 = 0.3, Â = 0.3
    #   t1: δ = 0 + 0.7 − 0.6 = 0.1, Â = 0.1 + 0.5·0.3 = 0.25
    #   t0: δ = 0 + 0.6 − 0.5 = 0.1, Â = 0.1 + 0.5·0.25 = 0.225
    # Row 1 uses the same γ, λ; rewards [0, 2, pad], V [1.0, 0.5, 9 (pad)]:
    #   t1: δ = 2 + 0 − 0.5 = 1.5 (V after the last valid token is 0), Â = 1.5
    #   t0: δ = 0 + 0.5 − 1.0 = −0.5, Â = −0.5 + 0.5·1.5 = 0.25
    rewards = t([[0.0, 0.0, 1.0], [0.0, 2.0, 5.0]])
    values = t([[0.5, 0.6, 0.7], [1.0, 0.5, 9.0]])
    mask = t([[1, 1, 1], [1, 1, 0]])
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=0.5)
    assert_close(adv, t([[0.225, 0.25, 0.3], [0.25, 1.5, 0.0]]))
    assert_close(ret, t([[0.725, 0.85, 1.0], [1.25, 2.0, 0.0]]))


def test_gae_gamma_and_per_sequence_lambda():
    # Row 1 of the test above with γ = 0.9:
    #   t1: δ = 2 − 0.5 = 1.5; t0: δ = 0 + 0.9·0.5 − 1.0 = −0.55
    #   λ = 0.5: Â0 = −0.55 + 0.9·0.5·1.5 = 0.125;  λ = 0: Â0 = −0.55
    rewards = t([[0.0, 2.0, 5.0], [0.0, 2.0, 5.0]])
    values = t([[1.0, 0.5, 9.0], [1.0, 0.5, 9.0]])
    mask = t([[1, 1, 0], [1, 1, 0]])
    adv, _ = gae(rewards, values, mask, gamma=0.9, lam=torch.tensor([0.5, 0.0]))
    assert_close(adv, t([[0.125, 1.5, 0.0], [-0.55, 1.5, 0.0]]))


def test_gae_lambda_one_is_monte_carlo():
    # γ = λ = 1: returns are the reward-to-go 1, 1, 1 whatever V is
    rewards, values, mask = t([[0.0, 0.0, 1.0]]), t([[0.3, -2.0, 0.7]]), t([[1, 1, 1]])
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    assert_close(ret, t([[1.0, 1.0, 1.0]]))
    assert_close(adv, t([[0.7, 3.0, 0.3]]))


def test_adaptive_and_segment_lambda():
    # 1 − 1/(1.5·l): l=1 -> 1/3, l=2 -> 2/3, l=10 -> 14/15, l=0 clamped to 1 -> 1/3
    assert_close(adaptive_lambda(torch.tensor([1, 2, 10, 0])), t([1 / 3, 2 / 3, 14 / 15, 1 / 3]))
    assert_close(adaptive_lambda(torch.tensor([4]), alpha=2.0), t([7 / 8]))
    assert segment_lambda(4) == pytest.approx(5 / 6)
    assert segment_lambda(0) == pytest.approx(1 / 3)


def test_skip_observation_gae_by_hand():
    # tokens a a o o a pad; γ = 1, λ = 0.5; reward 1 on the last action token
    #   t4: δ = 1 + 0 − 0.8 = 0.2, Â = 0.2
    #   t1 (links over the observation to t4): δ = 0 + 0.8 − 0.4 = 0.4, Â = 0.4 + 0.5·0.2 = 0.5
    #   t0: δ = 0 + 0.4 − 0.2 = 0.2, Â = 0.2 + 0.5·0.5 = 0.45
    rewards = t([[0.0, 0.0, 0.0, 0.0, 1.0, 0.0]])
    values = t([[0.2, 0.4, 9.0, 9.0, 0.8, 0.0]])
    action_mask = t([[1, 1, 0, 0, 1, 0]])
    adv, ret = skip_observation_gae(rewards, values, action_mask, gamma=1.0, lam=0.5)
    assert_close(adv, t([[0.45, 0.5, 0.0, 0.0, 0.2, 0.0]]))
    assert_close(ret, t([[0.65, 0.9, 0.0, 0.0, 1.0, 0.0]]))


def test_skip_observation_gae_equals_gae_with_observations_deleted():
    torch.manual_seed(0)
    action_mask = t(
        [
            [1, 1, 0, 0, 1, 1, 0, 1, 0, 0],  # three actions, trailing padding
            [1, 0, 1, 0, 1, 0, 1, 0, 1, 1],  # one-token observations
            [1, 1, 1, 1, 1, 1, 1, 1, 1, 1],  # no observation at all
            [0, 0, 1, 1, 0, 0, 0, 1, 0, 0],  # starts with an observation
        ]
    )
    values = torch.randn(4, 10)
    rewards = torch.randn(4, 10) * action_mask
    lam = torch.tensor([0.9, 0.5, 0.95, 0.0])
    adv, ret = skip_observation_gae(rewards, values, action_mask, gamma=0.97, lam=lam)

    keep = action_mask.bool()
    width = int(action_mask.sum(-1).max())
    compact = {name: torch.zeros(4, width) for name in ("r", "v", "m")}
    for i in range(4):
        n = int(keep[i].sum())
        compact["r"][i, :n] = rewards[i][keep[i]]
        compact["v"][i, :n] = values[i][keep[i]]
        compact["m"][i, :n] = 1.0
    ref_adv, ref_ret = gae(compact["r"], compact["v"], compact["m"], gamma=0.97, lam=lam)
    for i in range(4):
        n = int(keep[i].sum())
        assert_close(adv[i][keep[i]], ref_adv[i, :n])
        assert_close(ret[i][keep[i]], ref_ret[i, :n])
    assert (adv[~keep] == 0).all() and (ret[~keep] == 0).all()


def test_cross_trajectory_gae_by_hand():
    # trainable tokens: seg0 2, seg1 2, seg2 1 -> N_after = 3, 1, 0
    # γ = 1: seg0 × 0.5³ = 0.125, seg1 × 0.9¹, seg2 × 1
    advs = [t([1.0, 2.0, 7.0]), t([0.5, 0.5]), t([3.0])]
    masks = [t([1, 1, 0]), t([1, 1]), t([1])]
    out = cross_trajectory_gae(advs, masks, gamma=1.0, lambdas=[0.5, 0.9, 0.8])
    assert_close(out[0], t([0.125, 0.25, 0.0]))
    assert_close(out[1], t([0.45, 0.45]))
    assert_close(out[2], t([3.0]))
    # γ = 0.5: seg0 × (0.5·0.5)³ = 1/64, seg1 × 0.5·0.9 = 0.45
    out = cross_trajectory_gae(advs, masks, gamma=0.5, lambdas=[0.5, 0.9, 0.8])
    assert_close(out[0], t([1 / 64, 2 / 64, 0.0]))
    assert_close(out[1], t([0.225, 0.225]))


def test_cross_trajectory_gae_length_mismatch():
    with pytest.raises(ValueError, match="one mask and one lambda"):
        cross_trajectory_gae([t([1.0])], [t([1])], gamma=1.0, lambdas=[0.5, 0.5])


def test_masked_whiten():
    # mask values {1, 2, 3, 6}: mean 3, population var (4 + 1 + 0 + 9)/4 = 3.5
    x = t([[1.0, 2.0, 3.0, 100.0], [6.0, -50.0, 0.0, 0.0]])
    mask = t([[1, 1, 1, 0], [1, 0, 0, 0]])
    s = math.sqrt(3.5 + 1e-8)
    assert_close(masked_whiten(x, mask), t([[-2 / s, -1 / s, 0.0, 0.0], [3 / s, 0.0, 0.0, 0.0]]))
    assert_close(
        masked_whiten(x, mask, shift_mean=False),
        t([[3 - 2 / s, 3 - 1 / s, 3.0, 0.0], [3 + 3 / s, 0.0, 0.0, 0.0]]),
    )
    # std only: x / s, signs and ratios kept
    assert_close(masked_scale(x, mask), t([[1 / s, 2 / s, 3 / s, 0.0], [6 / s, 0.0, 0.0, 0.0]]))


def test_explained_variance():
    # returns {1, 2, 3}: var 2/3; residual {0, 0, 1}: mean 1/3, var ((1/3)²·2 + (2/3)²)/3 = 2/9
    # EV = 1 − (2/9)/(2/3) = 2/3; the padded position (100 vs −7) is ignored
    returns = t([[1.0, 2.0, 3.0, 100.0]])
    values = t([[1.0, 2.0, 2.0, -7.0]])
    mask = t([[1, 1, 1, 0]])
    assert_close(explained_variance(values, returns, mask), torch.tensor(2 / 3))
    assert_close(explained_variance(returns, returns, mask), torch.tensor(1.0))
    assert torch.isnan(explained_variance(values, t([[2.0, 2.0, 2.0, 5.0]]), mask))


# ------------------------------------------------------------------------------------------ CompactionRL's advantages
def _segment(n_actions, rollout_id, segment, reward=1.0, turn_rewards=None):
    return Sample(prompt_ids=[1], response_ids=[2] * n_actions, loss_mask=[1] * n_actions,
                  rollout_logprobs=[-1.0] * n_actions, versions=[0] * n_actions, reward=reward,
                  rollout_id=rollout_id, segment=segment,
                  metadata={} if turn_rewards is None else {"turn_rewards": turn_rewards})


def test_turn_rewards_credit_each_turn_and_carry_the_rest_to_the_summary(tiny_model):
    # One trajectory, R = 1 paid turn by turn: segment 0 (2 tokens: a turn paid 0.25 at 0, then a 1-token
    # summary at 1), segment 1 (3 tokens, one turn paid 0.75 at 2). V = 0, γ = 1, λ0 = 2/3, λ1 = 7/9.
    # reward_placement=turns: r(seg 0) = [0.25, 0.75] (the summary token carries what segment 1 earns),
    # r(seg 1) = [0, 0, 0.75]. Local GAE with V = 0: seg 1 [λ1²·0.75, λ1·0.75, 0.75]; seg 0 [0.25 + λ0·0.75, 0.75],
    # scaled by (γλ0)^3 = 8/27 as before. With "terminal" the 0.25 would reach segment 0's first token
    # only through λ0 (λ0·1 = 2/3, against 0.25 + 0.5 = 0.75 here).
    cfg = CompactionConfig(whiten_advantages=False, critic_freeze_attention=False, reward_placement="turns")
    module = CompactionRL(cfg, tiny_model)
    exp = Experience.collate([_segment(3, 7, 1, turn_rewards=[[2, 0.75]]), _segment(2, 7, 0, turn_rewards=[[0, 0.25]])],
                             pad_token_id=0)
    exp.values = torch.zeros_like(exp.loss_mask)
    module.compute_advantages(exp)
    l0, l1 = 2 / 3, 7 / 9
    assert_close(exp.advantages, torch.tensor([[l1 * l1 * 0.75, l1 * 0.75, 0.75],
                                               [(0.25 + l0 * 0.75) * 8 / 27, 0.75 * 8 / 27, 0.0]]))
    # the critic's targets (λ = 1): the reward still to come at every token
    assert_close(exp.returns, torch.tensor([[0.75, 0.75, 0.75], [1.0, 0.75, 0.0]]))


def test_compaction_cross_trajectory_gae_by_hand(tokenizer, tiny_model):
    # One trajectory: segment 0 with L0 = 2 action tokens, segment 1 with L1 = 3; V = 0, γ = 1, R = 1.
    # λ0 = 1 − 1/(1.5·2) = 2/3, λ1 = 1 − 1/(1.5·3) = 7/9.
    # Segment 1 (last): local GAE = [λ1², λ1, 1]; N_after = 0.
    # Segment 0: local GAE = [λ0, 1], scaled by (γ·λ0)^N_after, N_after = 3 -> (2/3)³ = 8/27.
    cfg = CompactionConfig(whiten_advantages=False, critic_freeze_attention=False)
    module = CompactionRL(cfg, tiny_model)
    exp = Experience.collate([_segment(3, 7, 1), _segment(2, 7, 0)], pad_token_id=0)
    exp.values = torch.zeros_like(exp.loss_mask)
    module.compute_advantages(exp)
    l0, l1 = 2 / 3, 7 / 9
    assert_close(exp.advantages, torch.tensor([[l1 * l1, l1, 1.0], [l0 * 8 / 27, 8 / 27, 0.0]]))


def test_normalisation_keeps_the_cross_trajectory_discount(tiny_model):
    # 4 trajectories x 2 segments x 100 action tokens, 3 succeed (R = 1), V = 0. The first segment of a
    # success is discounted by (γλ)^100 ≈ 0.51; whitening that centres the batch made its early tokens
    # negative (below the batch mean). Normalisation must keep them positive and keep the discount.
    cfg = CompactionConfig(whiten_advantages=True, critic_freeze_attention=False)
    module = CompactionRL(cfg, tiny_model)
    segs = [_segment(100, r, s, reward=1.0 if r < 3 else 0.0) for r in range(4) for s in (0, 1)]
    exp = Experience.collate(segs, pad_token_id=0)
    exp.values = torch.zeros_like(exp.loss_mask)
    module.compute_advantages(exp)
    adv = exp.advantages
    first_success = [i for i, s in enumerate(segs) if s.rollout_id == 0 and s.segment == 0][0]
    last_success = [i for i, s in enumerate(segs) if s.rollout_id == 0 and s.segment == 1][0]
    assert adv[first_success, 0] > 0  # the earliest token of a successful trajectory
    assert (adv[[i for i, s in enumerate(segs) if s.rollout_id < 3]] > 0).all()
    assert (adv[[i for i, s in enumerate(segs) if s.rollout_id == 3]] == 0).all()
    lam = 1 - 1 / (1.5 * 100)
    # the discount between the same position of the two segments is (γλ)^N_after, N_after = 100
    assert_close(adv[first_success, 50] / adv[last_success, 50], torch.tensor(lam ** 100), rtol=1e-4, atol=0)
