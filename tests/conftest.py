import os
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(scope="session")
def tokenizer():
    from glmlight.models.tokenizer import build_char_tokenizer

    return build_char_tokenizer()


@pytest.fixture()
def tiny_model(tokenizer):
    from glmlight.models.loading import load_causal_lm

    return load_causal_lm(None, tokenizer, preset="test", seed=0).eval()


def load_script(name: str):
    """A script of scripts/ as a module (scripts are not a package; nothing touches sys.path)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"script_{name}", os.path.join(REPO, "scripts", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def encode(tokenizer, text: str) -> list[int]:
    from glmlight.models.tokenizer import encode_chat

    return encode_chat(tokenizer, [{"role": "user", "content": text}])


def overrides_for_tests(tmp_path, *extra: str) -> list[str]:
    """A fast configuration of the real default run: the test-size GLM-5, few prompts."""
    return [
        "model.preset=test", "model.warm_start.steps=0", "logger=csv", f"trainer.default_root_dir={tmp_path}",
        "trainer.max_steps=2", "trainer.enable_progress_bar=false", "rollout.rollout_batch_size=4",
        "rollout.n_samples_per_prompt=4", "rollout.max_new_tokens=4", "task.num_eval_prompts=8",
        "trainer.checkpoint_every_n_steps=0", "task.reward._target_=tests.conftest.digit_fraction_reward",
        "logger.report=false", *extra,
    ]


def equal_on_even_prompts_reward(sample) -> float:
    """Equal rewards (zero advantages) for the groups of even prompts, the dense reward for the others."""
    return 0.5 if sample.metadata["prompt_index"] % 2 == 0 else digit_fraction_reward(sample)


def constant_reward(sample) -> float:
    return 0.5


def digit_fraction_reward(sample) -> float:
    """A dense test reward (fraction of digit characters) so that a random tiny model gets
    non-zero advantages; the arithmetic exact-match reward is all zeros before training."""
    text = sample.metadata["completion_text"]
    return sum(c.isdigit() for c in text) / max(len(text), 1)


class DigitRunningSumEnv:
    """RunningSumEnv whose final reward is the fraction of digit characters in the actions (dense, so a
    random tiny model gets non-zero returns and advantages)."""

    def __init__(self, **options) -> None:  # the task's own env options (step_rewards, modulus, ...)
        from glmlight.agents.envs import RunningSumEnv

        self.env, self.digits, self.chars = RunningSumEnv(**options), 0, 0

    def reset(self, prompt):
        self.digits = self.chars = 0
        return self.env.reset(prompt)

    def step(self, action: str):
        self.digits += sum(c.isdigit() for c in action)
        self.chars += max(len(action), 1)
        result = self.env.step(action)
        if result.done:
            result.reward = self.digits / self.chars
        return result


def newest_pushed_version(weights_dir) -> int:
    """The highest `v<N>` a disk-mode weight push has written under `weights_dir` (0: none yet). The push
    keeps only the last two versions, so a fast run has deleted `v1` long before a poller looks for it."""
    from glmlight.engines.transport import checkpoint_versions

    return max(checkpoint_versions(str(weights_dir)), default=0)
