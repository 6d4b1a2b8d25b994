"""DIS loss and mask (GLM-5 Eq. 3–5) against hand-computed numbers and gradients."""

import math

import torch
from torch.testing import assert_close

from glmlight.ops.dis import dis_loss_per_token, dis_mask

# r = 0.25, 0.5, 1, 1.5, 2, 3 (rollout log-prob 0, so r = exp(logprob) exactly in float32)
RATIOS = [0.25, 0.5, 1.0, 1.5, 2.0, 3.0]


def test_mask_window_is_strict():
    lp = torch.tensor([[math.log(r) for r in RATIOS]])
    # window (1 − 0.5, 1 + 1.0) = (0.5, 2.0), open: 0.5 and 2.0 are outside
    mask = dis_mask(lp, torch.zeros_like(lp), eps_low=0.5, eps_high=1.0)
    assert_close(mask, torch.tensor([[0.0, 0.0, 1.0, 1.0, 0.0, 0.0]]))


def test_loss_and_gradient_by_hand():
    lp = torch.tensor([[math.log(r) for r in RATIOS]], requires_grad=True)
    adv = torch.tensor([[1.0, 2.0, -1.0, 2.0, 1.0, 1.0]])
    loss, mask = dis_loss_per_token(lp, torch.zeros(1, 6), adv, eps_low=0.5, eps_high=1.0)
    # kept: r=1 -> −1·(−1)·ln1 = 0; r=1.5 -> −1.5·2·ln1.5 = −3·ln1.5; others 0
    assert_close(loss, torch.tensor([[0.0, 0.0, 0.0, -3 * math.log(1.5), 0.0, 0.0]]))
    assert_close(mask, torch.tensor([[0.0, 0.0, 1.0, 1.0, 0.0, 0.0]]))
    loss.sum().backward()
    # d/d lp = −f(r)·Â with f detached: r=1 -> −1·(−1) = 1; r=1.5 -> −1.5·2 = −3; masked 0.
    # (Without detaching f the r=1.5 entry would be −3·(1 + ln1.5).)
    assert_close(lp.grad, torch.tensor([[0.0, 0.0, 1.0, -3.0, 0.0, 0.0]]))


def test_nonzero_rollout_logprobs():
    # window (0.8, 1.2); rollout log-prob −1.
    # current −1 + ln1.25 -> r = 1.25 > 1.2 -> masked, loss and grad 0;
    # current −1 + ln1.1 -> r = 1.1 kept -> loss −1.1·(−2)·(−1 + ln1.1), grad −1.1·(−2) = 2.2
    lp = torch.tensor([[-1.0 + math.log(1.25), -1.0 + math.log(1.1)]], requires_grad=True)
    rollout = torch.full((1, 2), -1.0)
    adv = torch.tensor([[3.0, -2.0]])
    loss, mask = dis_loss_per_token(lp, rollout, adv, eps_low=0.2, eps_high=0.2)
    assert_close(mask, torch.tensor([[0.0, 1.0]]))
    assert_close(loss, torch.tensor([[0.0, 2.2 * (-1.0 + math.log(1.1))]]))
    loss.sum().backward()
    assert_close(lp.grad, torch.tensor([[0.0, 2.2]]))


def test_gradient_only_through_logprobs():
    lp = torch.tensor([[math.log(1.5)]], requires_grad=True)
    rollout = torch.zeros(1, 1, requires_grad=True)
    adv = torch.ones(1, 1, requires_grad=True)
    loss, _ = dis_loss_per_token(lp, rollout, adv, eps_low=0.5, eps_high=1.0)
    loss.sum().backward()
    assert rollout.grad is None and adv.grad is None
    assert_close(lp.grad, torch.tensor([[-1.5]]))


def test_extreme_ratio_is_masked_not_nan():
    lp = torch.tensor([[80.0, -80.0]])
    loss, mask = dis_loss_per_token(lp, torch.zeros(1, 2), torch.ones(1, 2), 0.2, 0.2)
    assert_close(mask, torch.zeros(1, 2))
    assert torch.isfinite(loss).all()
