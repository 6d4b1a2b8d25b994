"""Soak test (slow): many asynchronous SAO steps with injected engine and reward faults.

    python -m pytest -m slow tests/test_soak.py -s

Prints samples produced / trained / dropped by reason; they must add up exactly.
"""

import random
import threading

import pytest

import glmlight
from glmlight.rollout.local import LocalEngine
from tests.conftest import overrides_for_tests
from glmlight import compose

_rng = random.Random(0)


class ChaosEngine(LocalEngine):
    """Fails about one generate call in five (after which the caller retries)."""

    def generate(self, prompts, params):
        if _rng.random() < 0.2:
            raise TimeoutError("injected engine timeout")
        return super().generate(prompts, params)


def chaos_reward(sample) -> float:
    if _rng.random() < 0.1:
        raise RuntimeError("injected reward crash")
    text = sample.metadata["completion_text"]
    return sum(c.isdigit() for c in text) / max(len(text), 1)


@pytest.mark.slow
def test_async_sao_soak_accounting_adds_up(tmp_path):
    run = glmlight.build(compose(overrides_for_tests(
        tmp_path, "algo=sao", "rollout.mode=async", "trainer.max_steps=40", "rollout.rollout_batch_size=8",
        "rollout.engine_retries=1", "rollout.engine_retry_backoff_s=0.0", "~callbacks.held_out_eval",
        "~callbacks.sample_table", "task.reward._target_=tests.test_soak.chaos_reward")))
    run.datamodule.engine.__class__ = ChaosEngine
    run.fit()
    t = run.datamodule.totals
    dropped = {k: v for k, v in t.items() if k.startswith("dropped/")}
    print(f"\nproduced {t['produced']}  trained {t['trained']}  dropped {sum(dropped.values())}: {dropped}")
    assert t["produced"] == t["trained"] + sum(dropped.values())
    assert t["trained"] > 0 and dropped
    assert run.module.policy_version == 40
    assert not [th for th in threading.enumerate() if th.name == "glmlight-rollout-producer"]
