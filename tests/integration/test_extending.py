"""The extension points a user reaches without editing glmlight: an algorithm registered from their
own module, a correction, an engine factory, and the Python API from any directory."""

import os
import subprocess
import sys
from dataclasses import dataclass

import torch

import glmlight
from glmlight.callbacks import Correction
from glmlight import compose
from glmlight.algorithms.grpo import GRPO, GRPOConfig
from glmlight.ops.corrections import CorrectionResult
from glmlight.config.registry import ALGORITHMS, register_algorithm
from glmlight.engines.local.engine import LocalEngine
from tests.conftest import REPO, overrides_for_tests


@dataclass
class BaselineReinforceConfig(GRPOConfig):
    name: str = "baseline_reinforce"
    baseline: float = 0.5


@register_algorithm("baseline_reinforce", BaselineReinforceConfig, default_config=True)
class BaselineReinforce(GRPO):
    """REINFORCE with a constant baseline: A = R − b on every action token."""

    def compute_advantages(self, batch):
        batch.advantages = (batch.rewards - self.cfg.baseline).unsqueeze(-1) * batch.loss_mask


class HalveEveryWeight(Correction):
    name = "halve"

    def compute(self, batch):
        mask = batch.loss_mask
        return CorrectionResult(torch.where(mask.bool(), 0.5, 1.0), mask.clone(), {"removed_frac": 0.0})


def make_engine(cfg, policy, tokenizer, tag):
    """An engine factory as a user writes one: any RolloutEngine."""
    engine = LocalEngine(policy, pad_token_id=tokenizer.pad_token_id)
    engine.tag = tag
    return engine


def test_an_algorithm_registered_outside_glmlight_runs_from_its_name(tmp_path):
    assert "baseline_reinforce" in ALGORITHMS
    run = glmlight.build(compose(overrides_for_tests(tmp_path, "algo=baseline_reinforce", "algo.baseline=0.25",
                                                     "trainer.max_steps=1")))
    assert type(run.module) is BaselineReinforce and run.module.cfg.baseline == 0.25
    run.fit()
    assert run.module.rl_step == 1 and run.module.policy_version == 1


def test_a_correction_of_ones_own_composes(tmp_path):
    run = glmlight.build(compose(overrides_for_tests(
        tmp_path, "trainer.max_steps=1", "~callbacks.held_out_eval",
        "+callbacks.halve={_target_:tests.integration.test_extending.HalveEveryWeight}")))
    weights = []
    original = run.module.compute_advantages

    def spy(batch):
        weights.append(batch.token_weights.clone())
        original(batch)

    run.module.compute_advantages = spy
    run.fit()
    assert weights and torch.all((weights[0] == 0.5) | (weights[0] == 1.0))
    assert (weights[0] == 0.5).any()


def test_an_engine_factory_replaces_the_backend(tmp_path):
    run = glmlight.build(compose(overrides_for_tests(
        tmp_path, "trainer.max_steps=1",
        "rollout.engine={_target_:tests.integration.test_extending.make_engine,tag:mine}")))
    assert getattr(run.datamodule.engine, "tag", None) == "mine"


def test_the_python_api_works_from_any_directory(tmp_path):
    code = ("import glmlight; cfg = glmlight.compose(['algo=sao', 'trainer.max_steps=3']); "
            "print(cfg.algo.name, cfg.trainer.max_steps)")
    out = subprocess.run([sys.executable, "-c", code], cwd=str(tmp_path), capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": REPO})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["sao", "3"]
