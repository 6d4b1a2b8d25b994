"""The real thing: Trainer + GRPO + embedded engine + tiny GLM-5, a few steps."""

import csv
import glob
import os

import pytest
import torch

import glmlight
from glmlight.errors import ConfigError
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


def _params_after(tmp_path, *extra):
    run = _build(tmp_path, "trainer.max_steps=2", "~callbacks.held_out_eval", "~callbacks.sample_table",
                 "trainer.deterministic=true", *extra)
    run.fit()
    return run, {k: v.clone() for k, v in run.module.policy.state_dict().items()}


def test_old_logprobs_from_the_update_forward_give_the_same_training(tmp_path):
    # ppo_epochs = num_minibatches = 1: the update's first (only) forward runs at θ_old, so its detached
    # log-probs are the old log-probs; the two runs must train identically.
    run_u, upd = _params_after(tmp_path / "u", "algo.old_logprobs=update", "algo.micro_batch_size=3")
    run_f, fwd = _params_after(tmp_path / "f", "algo.old_logprobs=forward", "algo.micro_batch_size=3")
    assert run_u.module.old_logprobs_from_update() and not run_f.module.old_logprobs_from_update()
    for k in fwd:
        torch.testing.assert_close(upd[k], fwd[k], rtol=1e-5, atol=1e-6)
    rows = _metrics(tmp_path / "u")
    assert {float(r["train/old_logprobs_from_update"]) for r in rows if r.get("train/old_logprobs_from_update")} == {1.0}
    assert all(float(r["train/ratio_mean"]) == pytest.approx(1.0) for r in rows if r.get("train/ratio_mean"))


def test_compiled_rollout_trains_as_the_eager_one(tmp_path):
    # rollout.compile=true: the same tokens (fused sampling from the same uniforms), so the same training
    run_c, compiled = _params_after(tmp_path / "c", "rollout.compile=true")
    assert run_c.datamodule.engine._runner._decode is not None
    _, eager = _params_after(tmp_path / "e")
    for k in eager:
        torch.testing.assert_close(compiled[k], eager[k], rtol=1e-4, atol=1e-5)


def test_auto_old_logprobs_fall_back_to_a_forward_when_needed(tmp_path):
    # auto: a forward whenever tokens are trained more than once or a callback reads them first
    def from_update(*extra):
        run = _build(tmp_path, *extra)
        run.module.trainer = run.trainer  # as fit() attaches it
        return run.module.old_logprobs_from_update()

    assert from_update()  # the default callbacks do not read them
    assert not from_update("algo.ppo_epochs=2")
    assert not from_update("callbacks=consistency")  # IcePop and MismatchMonitor do
    assert not from_update("algo.old_logprobs=forward")
    with pytest.raises(ValueError, match="MismatchMonitor, .*IcePop read the old log-probs"):
        from_update("algo.old_logprobs=update", "callbacks=consistency")


def test_old_logprobs_update_with_several_passes_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="old_logprobs=update needs ppo_epochs=1"):
        _build(tmp_path, "algo.old_logprobs=update", "algo.num_minibatches=2")


def test_the_trainer_forward_choice(tmp_path):
    # model.forward=auto: glmlight's GLM-5 forward for a GlmMoeDsa model, the model's own otherwise
    assert _build(tmp_path).module.use_glm_forward
    assert not _build(tmp_path, "model.forward=transformers").module.use_glm_forward
    assert not _build(tmp_path, "model.gradient_checkpointing=true").module.use_glm_forward
    with pytest.raises(ConfigError, match="model.forward=glmlight cannot be used: model.gradient_checkpointing"):
        _build(tmp_path, "model.forward=glmlight", "model.gradient_checkpointing=true")


def test_both_trainer_forwards_give_the_same_response_logits(tmp_path):
    # on a real rollout batch (left-padded prompts, right-padded responses); the test preset's
    # DSA top-k exceeds these lengths, so both select every key and agree to float rounding
    run = _build(tmp_path, "rollout.max_new_tokens=12", "rollout.n_samples_per_prompt=3")
    batch = run.datamodule.next_experience()
    assert batch.attention_mask[:, 0].min() == 0 or batch.attention_mask[:, -1].min() == 0  # there is padding
    module = run.module
    with torch.no_grad():
        fast = module.forward_logits(module.policy, batch)
        module.use_glm_forward = False
        ref = module.forward_logits(module.policy, batch)
    mask = batch.response_mask.bool()
    torch.testing.assert_close(fast[mask], ref[mask], rtol=1e-5, atol=1e-5)
    run.datamodule.engine.close()
