"""The real thing: Trainer + GRPO + embedded engine + tiny GLM-5, a few steps."""

import csv
import glob
import os

import pytest
import torch

import glmlight
from tests.conftest import overrides_for_tests
from train import compose


def _build(tmp_path, *extra):
    return glmlight.build(compose(overrides_for_tests(tmp_path, *extra)))


def _metrics(tmp_path):
    path = glob.glob(os.path.join(str(tmp_path), "csv", "*", "metrics.csv"))[0]
    with open(path) as f:
        return list(csv.DictReader(f))


def test_grpo_steps_update_policy_and_engine(tmp_path):
    run = _build(tmp_path, "trainer.max_steps=3")
    before = {k: v.clone() for k, v in run.module.policy.state_dict().items()}
    run.fit()
    after = run.module.policy.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert run.trainer.global_step == 3 and run.module.rl_step == 3
    assert run.module.policy_version == 3 and run.datamodule.engine.version == 3
    # the engine serves exactly the trained weights
    engine_state = run.datamodule.engine.model.state_dict()
    assert all(torch.equal(engine_state[k], after[k]) for k in after)
    rows = _metrics(tmp_path)
    keys = set().union(*(r.keys() for r in rows))
    for k in ("rollout/reward_mean", "rollout/pass_rate", "rollout/response_length", "train/clip_frac",
              "train/entropy", "train/grad_norm", "rollout/tokens_per_s", "policy_version", "eval/reward",
              "sync/seconds"):
        assert k in keys, k
    totals = run.datamodule.totals
    assert totals["produced"] == totals["trained"] + sum(v for k, v in totals.items() if k.startswith("dropped/"))
    assert os.path.exists(os.path.join(str(tmp_path), "samples.jsonl"))


@pytest.mark.parametrize("extra", [
    ["algo.ppo_epochs=2", "algo.num_minibatches=2", "algo.micro_batch_size=3"],
    ["algo.kl_coef=0.1", "algo.kl_estimator=k2", "algo.entropy_coef=0.01", "algo.dual_clip_c=3.0"],
    ["algo.normalize_std=false", "algo.loss_agg=constant", "algo.lr_schedule=cosine", "algo.warmup_steps=1"],
    ["algo.loss_agg=seq_mean_token_mean", "algo.policy_loss=dis", "rollout.dtype=bfloat16"],
    ["rollout.dynamic_sampling=true", "rollout.over_sample=1.5", "rollout.overlong=soft_penalty"],
])
def test_grpo_options_run(tmp_path, extra):
    run = _build(tmp_path, "trainer.max_steps=2", "~callbacks.held_out_eval", "~callbacks.sample_table", *extra)
    run.fit()
    steps = run.module.optimizer_steps_per_rl_step
    assert run.trainer.global_step == 2 * steps
    assert run.module.policy_version == 2


def test_checkpoint_and_resume(tmp_path):
    run = _build(tmp_path, "trainer.max_steps=2", "trainer.checkpoint_every_n_steps=1", "~callbacks.held_out_eval")
    run.fit()
    ckpt = os.path.join(str(tmp_path), "checkpoints", "last.ckpt")
    assert os.path.exists(ckpt)
    cursor = run.datamodule.state_dict()["cursor"]
    resumed = _build(tmp_path, "trainer.max_steps=3", "trainer.resume=last", "~callbacks.held_out_eval")
    resumed.fit()
    assert resumed.trainer.global_step == 3
    assert resumed.module.policy_version == 3
    # the prompt stream continued where it stopped (one more step of prompts)
    assert resumed.datamodule.state_dict()["cursor"] == cursor + 4
