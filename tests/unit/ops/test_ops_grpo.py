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


def test_k3_survives_a_very_negative_log_ratio_and_k1_k2_are_not_clamped():
    # lr = -100 (e.g. a padding position, or a token the reference finds far likelier): exp(-lr)
    # overflows float32; k3's value and gradient must stay finite.
    lp = torch.tensor([-100.0, -1.0], requires_grad=True)
    ref = torch.tensor([0.0, -1.0])
    kl = kl_penalty(lp, ref, "k3")
    kl.sum().backward()
    assert torch.isfinite(kl).all() and torch.isfinite(lp.grad).all()
    assert kl[0] == 10.0 and kl[1] == 0.0
    # k1 / k2 have no exp: their values are not capped (a cap at 10 would cut the gradient)
    lp2, ref2 = torch.tensor([30.0]), torch.tensor([0.0])
    assert_close(kl_penalty(lp2, ref2, "k1"), torch.tensor([30.0]))
    assert_close(kl_penalty(lp2, ref2, "k2"), torch.tensor([450.0]))
    assert_close(kl_penalty(lp2, ref2, "k2", clamp=10.0), torch.tensor([10.0]))


def test_k2_gradient_is_the_reverse_kl_gradient():
    # Exact expectation over y ~ π_θ of ∇ k2 = Σ_y π(y)·lr(y)·∇log π(y) equals ∇KL(π ‖ π_ref).
    theta = torch.tensor([0.3, -0.2, 0.9], dtype=torch.float64, requires_grad=True)
    ref = torch.log_softmax(torch.tensor([0.0, 0.5, -0.5], dtype=torch.float64), -1)
    logp = torch.log_softmax(theta, -1)
    p = logp.exp().detach()
    surrogate = (p * kl_penalty(logp, ref, "k2")).sum()  # samples' distribution held fixed
    (g_k2,) = torch.autograd.grad(surrogate, theta, retain_graph=True)
    (g_kl,) = torch.autograd.grad((logp.exp() * (logp - ref)).sum(), theta)
    assert_close(g_k2, g_kl)


def test_logprobs_of_confident_tokens_are_exact_to_float32_rounding():
    # Large logits: x[label] - logsumexp(x) subtracts two numbers near 100 (float32 ulp 7.6e-6);
    # the max-subtracted form computes the small result directly.
    g = torch.Generator().manual_seed(0)
    logits = 100.0 + torch.randn(4, 8, 512, generator=g)
    logits[..., 7] += 12.0  # token 7 near-certain
    labels = torch.full((4, 8), 7)
    exact = torch.log_softmax(logits.double(), -1)[..., 7]
    err = (logprobs_from_logits(logits, labels).double() - exact).abs().max().item()
    assert err < 5e-7, err
    err_t = (logprobs_from_logits(logits, labels, temperature=0.7).double()
             - torch.log_softmax(logits.double() / 0.7, -1)[..., 7]).abs().max().item()
    assert err_t < 1e-6, err_t


def test_top_k_top_p_log_probs_are_the_renormalised_kept_set():
    # p = [0.5, 0.3, 0.15, 0.05]: top_p = 0.8 keeps {0.5, 0.3} (mass before 0.15 is 0.8 >= 0.8)
    logits = torch.log(torch.tensor([[[0.5, 0.3, 0.15, 0.05]]]))
    lp = logprobs_from_logits(logits.expand(1, 4, 4), torch.tensor([[0, 1, 2, 3]]), top_p=0.8)
    assert_close(lp[0, :2], torch.log(torch.tensor([0.5 / 0.8, 0.3 / 0.8])))
    assert lp[0, 2] == -math.inf and lp[0, 3] == -math.inf
    # top_k = 3: renormalised over 0.95
    lp = logprobs_from_logits(logits.expand(1, 4, 4), torch.tensor([[0, 1, 2, 3]]), top_k=3)
    assert_close(lp[0, :3], torch.log(torch.tensor([0.5, 0.3, 0.15]) / 0.95))
    assert lp[0, 3] == -math.inf
    # entropy of the kept set
    h = -(0.625 * math.log(0.625) + 0.375 * math.log(0.375))
    assert_close(entropy_from_logits(logits, top_p=0.8), torch.tensor([[h]]))
