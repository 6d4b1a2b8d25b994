"""Soak test (slow): many asynchronous SAO steps with injected engine and reward faults.

    python -m pytest -m slow tests/system/test_soak.py -s

Prints samples produced / trained / dropped by reason; they must add up exactly.
"""

import random
import threading

import pytest

import glmlight
from glmlight.engines.local.engine import LocalEngine
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
        "~callbacks.sample_table", "task.reward._target_=tests.system.test_soak.chaos_reward")))
    run.datamodule.engine.__class__ = ChaosEngine
    run.fit()
    t = run.datamodule.totals
    dropped = {k: v for k, v in t.items() if k.startswith("dropped/")}
    print(f"\nproduced {t['produced']}  trained {t['trained']}  dropped {sum(dropped.values())}: {dropped}")
    assert t["produced"] == t["trained"] + sum(dropped.values())
    assert t["trained"] > 0 and dropped
    assert run.module.policy_version == 40
    assert not [th for th in threading.enumerate() if th.name == "glmlight-rollout-producer"]


class _TrainedIds(__import__("lightning.pytorch", fromlist=["Callback"]).Callback):
    """Every sample trained on: (rollout id, the versions it was generated with, the policy version)."""

    def __init__(self):
        self.rows = []

    def on_experience(self, trainer, module, batch):
        self.rows += [(s.rollout_id, tuple(s.versions), module.policy_version) for s in batch.samples]


@pytest.mark.slow
def test_server_restart_soak_accounting_adds_up(tmp_path, tokenizer):
    """Asynchronous SAO against two SGLang stand-ins while one of them restarts again and again (its
    initial weights and version, as a new process comes back) and the other loses its weights in
    place: nothing is trained twice, nothing from the wrong weights is trained, and every sample is
    trained on or counted as dropped."""
    from glmlight.models.loading import load_causal_lm
    from tests.support.protocol_servers import SGLangServer

    servers = [SGLangServer(LocalEngine(load_causal_lm(None, tokenizer, preset="test", seed=0))).start()
               for _ in range(2)]
    stop = threading.Event()

    trained = _TrainedIds()

    def reached(step: int) -> bool:  # paced by training steps, not wall time: as many restarts on any machine
        while not stop.wait(0.02):
            if len({r[2] for r in trained.rows}) >= step:
                return True
        return False

    def chaos():
        for k in range(1, 5):  # server 1 restarts at steps 6, 12, 18, 24; server 0 loses its weights at 9, 15, ...
            if not reached(6 * k):
                break
            servers[1].restart(down_s=0.3, fresh=True)
            if not reached(6 * k + 3):
                break
            servers[0].reset_state()

    urls = ",".join(s.url for s in servers)
    run = glmlight.build(compose(overrides_for_tests(
        tmp_path, "algo=sao", "rollout=sglang", "rollout.mode=async", f"rollout.server.urls=[{urls}]",
        "rollout.server.api_key_env=null", f"rollout.server.weight_sync_dir={tmp_path}/weights",
        "rollout.server.request_timeout_s=20", "rollout.server.request_retries=4", "rollout.server.request_retry_backoff_s=0.1",
        "trainer.max_steps=30", "rollout.rollout_batch_size=8", "rollout.engine_retries=2",
        "rollout.engine_retry_backoff_s=0.1", "~callbacks.held_out_eval", "~callbacks.sample_table")))
    run.trainer.callbacks.append(trained)
    thread = threading.Thread(target=chaos, daemon=True)
    try:
        thread.start()
        engine = run.datamodule.engine
        run.fit()
    finally:
        stop.set()
        thread.join(10)
        for s in servers:
            s.close()
    t = run.datamodule.totals
    dropped = {k: v for k, v in t.items() if k.startswith("dropped/")}
    ids = [r[0] for r in trained.rows]
    print(f"\nproduced {t['produced']}  trained {t['trained']}  dropped {sum(dropped.values())}: {dropped}; "
          f"restarts {servers[1].restarts}, re-syncs {engine.num_resyncs}, stale answers {engine.num_stale_answers}, "
          f"duplicates by rollout id {len(ids) - len(set(ids))}")
    assert t["produced"] == t["trained"] + sum(dropped.values())
    assert len(ids) == len(set(ids)) == t["trained"] > 0
    assert servers[1].restarts >= 3  # (a restarted server is caught by a re-sync or by the next step's update)
    assert all(policy - v <= 1 for _, versions, policy in trained.rows for v in versions if v >= 0)
    assert run.module.policy_version == 30
