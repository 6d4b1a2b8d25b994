"""The real thing: Trainer + GRPO + embedded engine + tiny GLM-5, a few steps."""

import csv
import glob
import os

import pytest
import torch

import glmlight
from glmlight.algorithms.grpo import GRPO
from glmlight.errors import ConfigError
from tests.conftest import overrides_for_tests
from tests.support.scripts.fixed_batches import Recorder
from tests.support.tolerances import (adamw_first_step_tolerance, dims, gradient_tolerances, model_logit_tolerance,
                                      within)
from glmlight import compose


def _build(tmp_path, *extra):
    return glmlight.build(compose(overrides_for_tests(tmp_path, *extra)))


def _metrics(tmp_path):
    path = glob.glob(os.path.join(str(tmp_path), "csv", "*", "metrics.csv"))[0]
    with open(path) as f:
        return list(csv.DictReader(f))


def test_grpo_steps_update_policy_and_engine(tmp_path):
    run = _build(tmp_path, "trainer.max_steps=3")
    before = {k: v.clone() for k, v in run.module.policy.state_dict().items()}
    run.fit(close=False)  # the engine is inspected below
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
              "train/entropy", "train/grad_norm", "rollout/tokens_per_s", "policy_version", "eval/heldout/pass@1",
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


class _Steps(Recorder):
    """Recorder's gradients (every optimizer step, after clipping: what AdamW steps on) and parameters
    (every RL step), and each step's batch: what the float32 tolerances need."""

    reads_old_logprobs = False  # reads the batch's shape and tokens only

    def __init__(self, path: str):
        super().__init__(path)
        self.batches: list[torch.Tensor] = []

    def on_experience(self, trainer, module, batch) -> None:
        self.batches.append(batch.input_ids.clone())


def _params_after(tmp_path, *extra):
    run = _build(tmp_path, "trainer.max_steps=2", "~callbacks.held_out_eval", "~callbacks.sample_table",
                 "trainer.deterministic=true", *extra)
    steps = _Steps(str(tmp_path / "record.pt"))
    run.trainer.callbacks.append(steps)
    run.fit(close=False)  # callers inspect the engine
    return run, {k: v.clone() for k, v in run.module.policy.state_dict().items()}, steps


def _first_step_alike(a: _Steps, b: _Steps, run, decayed_in_a_only: tuple[str, ...] = ()) -> None:
    """Two runs that must train alike: the same first batch, its gradients within float32 summation order
    (gradient_tolerances: each tensor against its own scale), and the parameters after the first AdamW step
    within adamw_first_step_tolerance (tests/support/tolerances.py). From there the parameters differ (a
    gradient near zero moves its parameter by up to lr either way), and so do the later gradients: later
    steps are not compared. A wrong normaliser, ratio or skipped row moves a gradient by O(|g|)."""
    assert torch.equal(a.batches[0], b.batches[0])  # the same rollout, at the same initial weights
    size = {**dims(run.module.policy.config), "context": a.batches[0].shape[1],
            "tokens": a.batches[0].numel()}
    grads = a.grads[0]  # the first optimizer step's (ppo_epochs = num_minibatches = 1: the RL step's only)
    bound = gradient_tolerances(grads, **size)
    assert within(grads, b.grads[0], bound) == []
    lr = run.module.cfg.lr  # constant schedule, no warm-up: the first step's rate
    step = {n: adamw_first_step_tolerance(grads[n], bound[n], theta, lr=lr)
            for n, theta in a.params[0].items() if n in grads}  # a frozen parameter: equal
    for n in decayed_in_a_only:  # one weight-decay step apart: theta and theta (1 - lr wd)
        step[n] = step[n] + lr * run.module.cfg.weight_decay * a.params[0][n].abs()
    assert within(a.params[0], b.params[0], step) == []


def test_old_logprobs_from_the_update_forward_give_the_same_training(tmp_path):
    # ppo_epochs = num_minibatches = 1: the update's first (only) forward runs at θ_old, so its detached
    # log-probs are the old log-probs; the two runs must train identically.
    run_u, _, upd = _params_after(tmp_path / "u", "algo.old_logprobs=update", "algo.micro_batch_size=3")
    run_f, _, fwd = _params_after(tmp_path / "f", "algo.old_logprobs=forward", "algo.micro_batch_size=3")
    assert run_u.module.old_logprobs_from_update() and not run_f.module.old_logprobs_from_update()
    _first_step_alike(upd, fwd, run_u)
    rows = _metrics(tmp_path / "u")
    assert {float(r["train/old_logprobs_from_update"]) for r in rows if r.get("train/old_logprobs_from_update")} == {1.0}
    assert all(float(r["train/ratio_mean"]) == pytest.approx(1.0) for r in rows if r.get("train/ratio_mean"))


@pytest.mark.parametrize("reward", ["equal_on_even_prompts_reward", "constant_reward"])
def test_rows_with_zero_advantages_are_skipped_with_the_same_update(tmp_path, monkeypatch, reward):
    # Groups with equal rewards have all-zero advantages: their loss and gradient are exactly zero, so
    # the update skips them. The parameters must come out as when every row trains; with every row
    # skipped AdamW still steps on zero gradients (its weight decay moves the parameters).
    extra = [f"task.reward._target_=tests.conftest.{reward}", "algo.weight_decay=0.1", "algo.micro_batch_size=3"]
    rows_seen = []
    real = GRPO.micro_batch_loss

    def counting(self, mb, scale):
        rows_seen.append(mb.batch_size)
        return real(self, mb, scale)

    monkeypatch.setattr(GRPO, "micro_batch_loss", counting)
    run, skipped, skipped_steps = _params_after(tmp_path / "s", *extra)
    seen_skipping, rows_seen[:] = sum(rows_seen), []
    _, _, full_steps = _params_after(tmp_path / "f", *extra, "algo.skip_zero_advantage_rows=false")
    seen_full = sum(rows_seen)
    # other micro-batches: the same sums up to float32 order. With every row skipped, the step fills in zero
    # gradients for every parameter, also the DSA indexers' that no backward reaches (None in the full run):
    # AdamW decays those in the skipped run only, by lr * weight_decay of themselves
    indexer = [n for n in skipped_steps.params[0] if ".indexer." in n] if reward == "constant_reward" else []
    _first_step_alike(skipped_steps, full_steps, run, tuple(indexer))

    def logged(root, key):
        return [float(r[key]) for r in _metrics(root) if r.get(key)]

    for key in ("train/loss", "train/grad_norm"):  # skipped rows still count in the loss's normaliser
        assert logged(tmp_path / "s", key) == pytest.approx(logged(tmp_path / "f", key), rel=1e-4, abs=1e-9)
    initial = _build(tmp_path / "i").module.policy.state_dict()
    assert any(not torch.equal(initial[k], skipped[k]) for k in initial)
    frac = logged(tmp_path / "s", "train/rows_without_gradient_frac")
    assert len(frac) == 2 and min(frac) > 0  # prompts are shuffled: some groups of even ones in every step
    assert seen_full == 2 * 16 and seen_skipping == sum(round((1 - f) * 16) for f in frac)
    if reward == "constant_reward":
        assert frac == [1.0, 1.0] and seen_skipping == 0


def test_rows_are_not_skipped_when_they_carry_a_kl_or_entropy_term(tmp_path):
    run = _build(tmp_path, "task.reward._target_=tests.conftest.constant_reward")
    batch = run.datamodule.next_experience()
    run.module.compute_advantages(batch)
    assert run.module.rows_without_gradient(batch).all()
    for extra in ("algo.kl_coef=0.1", "algo.entropy_coef=0.01", "algo.skip_zero_advantage_rows=false"):
        other = _build(tmp_path, extra)
        other.module.trainer = other.trainer  # as fit() attaches it
        fresh = batch.select(list(range(batch.batch_size)))
        other.module.prepare_experience(fresh)  # with kl_coef: the reference's log-probs
        assert other.module.rows_without_gradient(fresh) is None, extra


def test_only_data_parallel_ranks_may_skip_rows(tmp_path):
    # FSDP / DeepSpeed gather and reduce inside every forward and backward: a rank that skipped rows
    # the others run would leave them waiting in a collective
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from glmlight.strategies.trainer_setup import hardware_kwargs

    module = _build(tmp_path).module
    assert module.parallel.ranks_may_skip_rows()  # no trainer attached: one process
    ddp = hardware_kwargs(OmegaConf.create({"accelerator": "cpu", "strategy": "ddp", "devices": 2, "num_nodes": 1,
                                            "precision": "32-true", "zero_stage": 2}))["strategy"]
    for strategy, may in ((ddp, True), (SimpleNamespace(), False)):
        module.trainer = SimpleNamespace(world_size=2, strategy=strategy)
        assert module.parallel.ranks_may_skip_rows() is may
    module.trainer = SimpleNamespace(world_size=1, strategy=SimpleNamespace())
    assert module.parallel.ranks_may_skip_rows()


def test_compiled_rollout_trains_as_the_eager_one(tmp_path):
    # rollout.compile=true: the same tokens (fused sampling from the same uniforms), so the same training
    run_c, _, compiled = _params_after(tmp_path / "c", "rollout.compile=true")
    assert run_c.datamodule.engine._runner._decode is not None
    _, _, eager = _params_after(tmp_path / "e")
    _first_step_alike(compiled, eager, run_c)


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
    assert _build(tmp_path).module.scoring.use_glm_forward
    assert not _build(tmp_path, "model.forward=transformers").module.scoring.use_glm_forward
    assert not _build(tmp_path, "model.gradient_checkpointing=true").module.scoring.use_glm_forward
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
        fast = module.scoring.forward_logits(module.policy, batch)
        module.scoring.use_glm_forward = False
        ref = module.scoring.forward_logits(module.policy, batch)
    mask = batch.response_mask.bool()
    rows = [s.prompt_ids + s.response_ids for s in batch.samples]
    tol = model_logit_tolerance(module.policy, rows, context=batch.input_ids.shape[1])  # other kernels: float32
    torch.testing.assert_close(fast[mask], ref[mask], rtol=0, atol=tol)
    run.datamodule.engine.close()
