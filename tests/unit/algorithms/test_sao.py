"""SAO: critic, K critic steps, frozen attention, warm-up, value loss, end to end."""

import pytest
import torch
from torch.testing import assert_close

import glmlight
from glmlight.algorithms.sao import RunningMeanStd, SAO
from glmlight.ops.value import segment_terminals, terminal_rewards, turn_rewards, value_loss
from tests.conftest import overrides_for_tests
from glmlight import compose


def test_terminal_rewards_on_last_action_token():
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0, 0.0]])
    out = terminal_rewards(torch.tensor([2.0, 5.0, -1.0]), mask)
    assert_close(out, torch.tensor([[0.0, 0.0, 0.0, 2.0, 0.0], [0.0] * 5, [-1.0, 0.0, 0.0, 0.0, 0.0]]))


def test_turn_rewards_by_hand():
    # row 0: action tokens at 0, 1, 3 (2 is an observation); turns paid 0.25 at 1 and 0.5 at 3, 0.1 left at the end
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0, 0.0], [1.0, 1.0, 1.0, 0.0, 0.0]])
    out = turn_rewards(mask, [[(1, 0.25), (3, 0.5)], []], [0.1, 2.0])
    assert_close(out, torch.tensor([[0.0, 0.25, 0.0, 0.6, 0.0], [0.0, 0.0, 2.0, 0.0, 0.0]]))
    with pytest.raises(ValueError, match="not on an action token"):
        turn_rewards(mask, [[(2, 1.0)], []], [0.0, 0.0])  # an observation token
    # a trajectory of 3 segments whose turns were paid 0.25, 0.5, 0 of R = 1: each segment ends with what
    # the rest of the trajectory earns (0.75, 0.25) and the last with what no turn was paid (0.25)
    assert segment_terminals(1.0, [0.25, 0.5, 0.0]) == [0.75, 0.25, 0.25]
    assert segment_terminals(2.0, []) == []


def test_value_loss_and_clipping_by_hand():
    v, old, ret = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 0.0]]), torch.tensor([[2.0, 1.0]])
    mask = torch.ones(1, 2)
    # ½·mean((1−2)², (0−1)²) = 0.5
    assert_close(value_loss(v, old, ret, mask), torch.tensor(0.5))
    # clip 0.5: V_clipped = 0.5 -> (0.5−2)² = 2.25 > 1 ; second token unchanged: ½·(2.25 + 1)/2
    assert_close(value_loss(v, old, ret, mask, clip=0.5), torch.tensor(0.8125))


def test_running_mean_std():
    rms = RunningMeanStd(eps=0.0)
    rms.count.zero_()
    rms.update(torch.tensor([1.0, 3.0]))
    rms.update(torch.tensor([5.0, 7.0]))
    assert rms.mean.item() == pytest.approx(4.0) and rms.var.item() == pytest.approx(5.0)


def _build(tmp_path, *extra):
    return glmlight.build(compose(overrides_for_tests(
        tmp_path, "algo=sao", "rollout.mode=sync", "~callbacks.held_out_eval", "~callbacks.sample_table", *extra)))


def test_k_critic_steps_frozen_attention_and_warmup(tmp_path):
    run = _build(tmp_path, "trainer.max_steps=3", "algo.critic_updates=3", "algo.critic_warmup_steps=1",
                 "rollout.rollout_batch_size=6")
    module: SAO = run.module
    attn = {n: p.detach().clone() for n, p in module.critic.backbone.named_parameters() if "self_attn" in n}
    mlp = {n: p.detach().clone() for n, p in module.critic.backbone.named_parameters() if "mlp" in n}
    policy_before = {n: p.detach().clone() for n, p in module.policy.named_parameters()}
    assert attn and module.frozen_critic_params == sum(p.numel() for p in attn.values())
    run.fit()
    policy_opt, critic_opt = run.trainer.optimizers
    policy_steps = max(s["step"].item() for s in policy_opt.state.values())
    critic_steps = max(s["step"].item() for s in critic_opt.state.values())
    # 3 RL steps, the first a critic warm-up: 2 policy updates, 3 x 3 critic updates
    assert policy_steps == 2 and critic_steps == 9
    assert run.trainer.global_step == 3 * (1 + 3)
    after = dict(module.critic.backbone.named_parameters())
    assert all(torch.equal(attn[n], after[n]) for n in attn)  # frozen attention really stays
    assert any(not torch.equal(mlp[n], after[n]) for n in mlp)
    assert any(not torch.equal(policy_before[n], p) for n, p in module.policy.named_parameters())


def test_value_loss_falls_with_a_fixed_reward(tmp_path):
    run = _build(tmp_path, "trainer.max_steps=6", "algo.lr=0.0", "algo.critic_lr=0.01",
                 "task.reward._target_=tests.unit.algorithms.test_sao.constant_reward",
                 "algo.critic_freeze_attention=false", "logger=csv")
    losses = []
    real = run.module.critic_loss

    def recording(mb, scale):
        loss, stats = real(mb, scale)
        losses.append(stats["critic/value_loss"].item())
        return loss, stats

    run.module.critic_loss = recording
    run.fit()
    assert losses[-1] < 0.1 * losses[0], losses


def constant_reward(sample) -> float:
    return 1.0


@pytest.mark.parametrize("extra", [
    ["algo.value_normalization=true", "algo.value_clip=0.2", "algo.num_minibatches=2"],
    ["task=calculator_agent", "rollout.max_new_tokens=6", "task.agent.max_turns=2", "rollout.mode=async"],
])
def test_sao_end_to_end(tmp_path, extra):
    run = _build(tmp_path, "trainer.max_steps=2", *extra)
    run.fit()
    assert run.module.policy_version == 2
    t = run.datamodule.totals
    assert t["produced"] == t["trained"] + sum(v for k, v in t.items() if k.startswith("dropped/"))
