"""Reliability: exact resume after kill -9, atomic and verified checkpoints, engine faults,
bad engine output, non-finite losses, secrets kept out of the run directory."""

import csv
import glob
import os
import signal
import subprocess
import sys
from collections import Counter

import pytest
import torch

import glmlight
from glmlight.strategies.checkpoint import checkpoint_problem
from glmlight.config.rollout import RolloutConfig
from glmlight.data.rollout import RolloutDataModule
from glmlight.data.sources import ArithmeticTask
from glmlight.errors import ConfigError
from glmlight.engines.base import Generation
from glmlight.engines.local.engine import LocalEngine
from glmlight.sample import Status
from tests.support.waiting import running, wait_until
from tests.conftest import REPO, overrides_for_tests
from glmlight import compose

KEYS = ["rollout/reward_mean", "rollout/response_length", "train/loss", "train/grad_norm", "train/entropy",
        "policy_version"]


def _overrides(root, *extra):
    return overrides_for_tests(root, "trainer.checkpoint_every_n_steps=1", "~callbacks.held_out_eval",
                               "~callbacks.sample_table", "algo.lr=0.01", "trainer.max_steps=4",
                               "trainer.deterministic=true", *extra)


def _rows(root):
    out = {}
    for path in sorted(glob.glob(os.path.join(str(root), "csv", "*", "metrics.csv"))):
        for r in csv.DictReader(open(path)):
            if r.get("rl_step"):
                out[int(float(r["rl_step"]))] = {k: r[k] for k in KEYS}
    return out


def _kill_after_checkpoints(root, overrides, n):
    """Run scripts/train.py in a subprocess and SIGKILL it once `n` periodic checkpoints exist and
    last.ckpt has caught up with the newest."""
    env = {**os.environ, "PYTHONPATH": REPO}
    proc = subprocess.Popen([sys.executable, "scripts/train.py", *overrides], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    ckpts = os.path.join(str(root), "checkpoints")
    periodic = lambda: glob.glob(os.path.join(ckpts, "*step=*.ckpt"))  # noqa: E731
    last = os.path.join(ckpts, "last.ckpt")

    def ready():
        found = periodic()
        return len(found) >= n and os.path.exists(last) and os.path.getmtime(last) >= max(map(os.path.getmtime, found))

    try:
        wait_until(ready, alive=running(proc), poll_s=0.02, what=f"{n} periodic checkpoints")
    except AssertionError:
        pass  # the run ended first: the assertion below names what it printed
    proc.send_signal(signal.SIGKILL)
    _, err = proc.communicate()
    assert len(periodic()) >= n, err.decode()[-2000:]


def test_kill_dash_nine_then_resume_gives_the_same_metrics(tmp_path):
    straight = tmp_path / "straight"
    glmlight.build(compose(_overrides(straight))).fit()
    expected = _rows(straight)
    assert sorted(expected) == [1, 2, 3, 4]

    killed = tmp_path / "killed"
    _kill_after_checkpoints(killed, _overrides(killed), 2)

    resumed = glmlight.build(compose(_overrides(killed, "trainer.resume=last")))
    resumed.fit()
    got = _rows(killed)
    assert resumed.trainer.global_step == 4 and resumed.module.policy_version == 4
    for step in sorted(got):
        assert got[step] == expected[step], (step, got[step], expected[step])
    assert max(got) == 4


def _is_timing(key):
    return key.endswith(("seconds", "per_s"))


def _logged(csv_path):
    """Every value the run logged (timings aside), by logger step: {step: sorted [(key, value)]}."""
    out = {}
    for r in csv.DictReader(open(csv_path)):
        step = int(r.pop("step"))
        out.setdefault(step, []).extend((k, v) for k, v in r.items() if v not in ("", None) and not _is_timing(k))
    return {step: sorted(kv) for step, kv in out.items()}


def _csv_versions(root):
    paths = glob.glob(os.path.join(str(root), "csv", "version_*", "metrics.csv"))
    return sorted(paths, key=lambda p: int(p.split("version_")[-1].split(os.sep)[0]))


# The default callback set (weight sync, version gate, held-out evaluation, sample table), evaluation
# every 3 RL steps, checkpoints every 2: the run is killed after the RL-step-4 checkpoint, so it resumes
# at a step that is no multiple of the evaluation interval and evaluates again at step 6.
RESUME_CASES = {
    "grpo": [],
    "sao_async": ["algo=sao"],
    "calculator_agent": ["task=calculator_agent", "rollout.max_new_tokens=6", "task.agent.max_turns=2"],
}


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c == "calculator_agent" else c
                                  for c in sorted(RESUME_CASES)])  # (the agent case is slow: -m slow)
def test_resume_with_the_default_callbacks_logs_exactly_the_uninterrupted_metrics(tmp_path, case):
    def overrides(root, *extra):
        return overrides_for_tests(root, *RESUME_CASES[case], "trainer.max_steps=6",
                                   "trainer.checkpoint_every_n_steps=2", "eval.every_n_steps=3", "algo.lr=0.01",
                                   "trainer.deterministic=true", *extra)

    straight = tmp_path / "straight"
    glmlight.build(compose(overrides(straight))).fit()
    [straight_csv] = _csv_versions(straight)
    expected = _logged(straight_csv)

    killed = tmp_path / "killed"
    _kill_after_checkpoints(killed, overrides(killed), 2)
    ckpt = torch.load(os.path.join(str(killed), "checkpoints", "last.ckpt"), weights_only=False, map_location="cpu")
    resumed = glmlight.build(compose(overrides(killed, "trainer.resume=last")))
    steps_per_rl = resumed.module.optimizer_steps_per_rl_step
    resumed_at = ckpt["global_step"] // steps_per_rl
    assert resumed_at % 3 != 0 and resumed_at < 6, resumed_at
    resumed.fit()
    assert resumed.module.rl_step == 6
    got = _logged(_csv_versions(killed)[-1])  # what the resumed run itself logged

    # logger steps count RL steps done before the one in progress: the resumed run logs from resumed_at on
    want = {step: kv for step, kv in expected.items() if step >= resumed_at}
    for step in sorted(want):
        diff = sorted(set(got.get(step, [])) ^ set(want[step]))
        assert got.get(step) == want[step], (step, diff)
    assert sorted(got) == sorted(want), (sorted(got), sorted(want))  # nothing logged twice or left out
    assert any(k.startswith("eval/") for kv in want.values() for k, _ in kv)  # an evaluation ran after the resume


def test_corrupt_checkpoint_is_named_and_the_previous_one_offered(tmp_path):
    run = glmlight.build(compose(_overrides(tmp_path, "trainer.max_steps=2")))
    run.fit()
    ckpts = os.path.join(str(tmp_path), "checkpoints")
    last = os.path.join(ckpts, "last.ckpt")
    assert checkpoint_problem(last) is None
    with open(last, "r+b") as f:  # a partial write: cut the file in half
        f.truncate(os.path.getsize(last) // 2)
    assert checkpoint_problem(last) is not None
    with pytest.raises(ConfigError, match=r"checkpoint .*last.ckpt cannot be resumed from: .*trainer.resume=.*step="):
        glmlight.build(compose(_overrides(tmp_path, "trainer.resume=last"))).fit()
    good = [p for p in glob.glob(os.path.join(ckpts, "*step=*.ckpt")) if checkpoint_problem(p) is None]
    assert good
    resumed = glmlight.build(compose(_overrides(tmp_path, "trainer.max_steps=3", f"trainer.resume='{good[-1]}'")))
    resumed.fit()
    assert resumed.module.policy_version == 3


class FlakyEngine(LocalEngine):
    """Fault injection: the first `fail` generate calls raise; one call may return an id outside the vocabulary."""

    def __init__(self, model, fail=0, garbage=False):
        super().__init__(model)
        self.fail, self.garbage, self.calls = fail, garbage, 0

    def generate(self, prompts, params):
        self.calls += 1
        if self.calls <= self.fail:
            raise ConnectionError("engine went away")
        gens = super().generate(prompts, params)
        if self.garbage:
            gens[0] = Generation([10_000], [-1.0], "stop", [0])
        return gens


def _dm(tokenizer, engine):
    cfg = RolloutConfig(rollout_batch_size=2, n_samples_per_prompt=2, max_new_tokens=3, engine_retries=2,
                        engine_retry_backoff_s=0.0)
    return RolloutDataModule(engine, tokenizer, ArithmeticTask(seed=0), lambda s: float(s.rollout_id % 2), cfg,
                             vocab_size=len(tokenizer))


def test_engine_errors_are_retried_then_counted(tokenizer, tiny_model):
    dm = _dm(tokenizer, FlakyEngine(tiny_model, fail=2))
    exp = dm.next_experience()  # two failures, third attempt succeeds
    assert exp.batch_size == 4 and exp.stats["rollout/engine_errors"] == 2.0
    dm = _dm(tokenizer, FlakyEngine(tiny_model, fail=100))
    counts = Counter()
    samples = dm.rollout(dm.draw_prompts(2), 2, counts)
    assert all(s.status is Status.FAILED for s in samples) and counts["engine_errors"] == 3
    with pytest.raises(RuntimeError, match="no trainable samples"):
        dm.next_experience()
    t = dm.totals
    assert t["produced"] == t["trained"] + sum(v for k, v in t.items() if k.startswith("dropped/"))


def test_token_ids_outside_the_vocabulary_fail_the_sample(tokenizer, tiny_model):
    dm = _dm(tokenizer, FlakyEngine(tiny_model, garbage=True))
    counts = Counter()
    samples = dm.rollout(dm.draw_prompts(2), 2, counts)
    assert counts["invalid_tokens"] == 1 and samples[0].status is Status.FAILED
    assert all(s.status is not Status.FAILED for s in samples[1:])


def nan_reward(sample):
    return float("inf") if sample.rollout_id % 2 else 1.0


def test_non_finite_loss_is_skipped_counted_and_stops_after_n(tmp_path):
    run = glmlight.build(compose(overrides_for_tests(
        tmp_path, "trainer.max_steps=5", "~callbacks.held_out_eval", "~callbacks.sample_table",
        "algo.max_nonfinite_steps=2")))
    real = run.module.micro_batch_loss

    def poisoned(mb, scale):
        loss, stats = real(mb, scale)
        return loss * float("nan"), stats

    run.module.micro_batch_loss = poisoned
    before = {k: v.clone() for k, v in run.module.policy.state_dict().items()}
    from glmlight.algorithms.base import NonFiniteLossError

    with pytest.raises(NonFiniteLossError, match="2 consecutive updates"):
        run.fit()
    assert all(torch.equal(before[k], v) for k, v in run.module.policy.state_dict().items())


def test_secrets_never_reach_the_run_directory(tmp_path, monkeypatch):
    secret = "sk-test-5ecret-do-not-log"
    monkeypatch.setenv("WANDB_API_KEY", secret)
    monkeypatch.setenv("SGLANG_API_KEY", secret + "-server")
    run = glmlight.build(compose(overrides_for_tests(
        tmp_path, "logger=wandb", "logger.mode=offline", "trainer.max_steps=1", "trainer.checkpoint_every_n_steps=1",
        "rollout.server.api_key_env=SGLANG_API_KEY")))
    run.fit()
    import wandb

    wandb.finish()
    files = [p for p in glob.glob(os.path.join(str(tmp_path), "**", "*"), recursive=True) if os.path.isfile(p)]
    assert any(p.endswith(".ckpt") for p in files) and any("wandb" in p for p in files)
    for p in files:
        data = open(p, "rb").read()
        assert secret.encode() not in data, p
    # the config stored with the run names the variable, not its value
    assert any(b"SGLANG_API_KEY" in open(p, "rb").read() for p in files if p.endswith((".yaml", ".json", ".ckpt")))


def test_sigterm_during_a_held_out_evaluation_stops_it_before_the_next_generation(tmp_path, monkeypatch):
    """Lightning acts on SIGTERM between training batches; an evaluation between them (minutes on a real model)
    stops at its next generation instead, and the run ends as on any SIGTERM."""
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from glmlight.data import evaluation

    generate, done = evaluation.SeededEngine.generate, []

    def counted(self, prompts, params):
        out = generate(self, prompts, params)
        done.append(self.name)
        if len(done) == 1:
            os.kill(os.getpid(), signal.SIGTERM)  # as the step-0 evaluation's first generation ends
        return out

    monkeypatch.setattr(evaluation.SeededEngine, "generate", counted)
    run = glmlight.build(compose(overrides_for_tests(tmp_path, "eval.every_n_steps=1")))
    # a handler of our own, so that the signal can never end the test process (Lightning adds its own to it)
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        with pytest.raises(SIGTERMException):
            run.fit()
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert done == ["heldout/sampled"], done  # the greedy generation of the same evaluation never ran
    assert run.module.rl_step == 0


def _periodic(root):
    return sorted(os.path.basename(p) for p in glob.glob(os.path.join(str(root), "checkpoints", "*step=*.ckpt")))


def test_only_the_last_k_checkpoints_are_kept_also_across_a_resume(tmp_path):
    """trainer.keep_last_k_checkpoints (default 3) periodic checkpoints stay beside last.ckpt; null keeps all."""
    glmlight.build(compose(_overrides(tmp_path, "trainer.max_steps=5"))).fit()
    assert _periodic(tmp_path) == ["epoch=0-step=3.ckpt", "epoch=0-step=4.ckpt", "epoch=0-step=5.ckpt"]
    assert os.path.exists(os.path.join(str(tmp_path), "checkpoints", "last.ckpt"))
    resumed = glmlight.build(compose(_overrides(tmp_path, "trainer.max_steps=6", "trainer.resume=last")))
    resumed.fit()
    assert resumed.module.rl_step == 6
    assert _periodic(tmp_path) == ["epoch=0-step=4.ckpt", "epoch=0-step=5.ckpt", "epoch=0-step=6.ckpt"]
    every = tmp_path / "every"
    glmlight.build(compose(_overrides(every, "trainer.max_steps=4", "trainer.keep_last_k_checkpoints=null"))).fit()
    assert len(_periodic(every)) == 4


def test_checkpointing_off_writes_no_checkpoint_and_the_export_still_happens(tmp_path):
    run = glmlight.build(compose(_overrides(tmp_path, "trainer.checkpoint_every_n_steps=0", "trainer.max_steps=2")))
    run.fit()
    assert not glob.glob(os.path.join(str(tmp_path), "checkpoints", "*")), os.listdir(str(tmp_path))
    assert os.path.isfile(os.path.join(str(tmp_path), "hf", "model.safetensors"))
    again = glmlight.build(compose(_overrides(tmp_path, "trainer.checkpoint_every_n_steps=0", "trainer.max_steps=2",
                                              "trainer.resume=last")))
    again.fit()  # nothing to resume from: a new run from step 1
    assert again.module.rl_step == 2


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl_c", "sigterm"])
def test_an_interrupted_run_says_how_to_resume_and_which_steps_are_lost(tmp_path, sig):
    """Ctrl-C or SIGTERM during `python scripts/train.py ...`: the run names its last checkpoint's RL step,
    the steps that are lost, and the command that continues it."""
    import re
    import shlex

    overrides = _overrides(tmp_path, "trainer.max_steps=200", "trainer.checkpoint_every_n_steps=2")
    env = {**os.environ, "PYTHONPATH": REPO}
    proc = subprocess.Popen([sys.executable, "scripts/train.py", *overrides], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    last = os.path.join(str(tmp_path), "checkpoints", "last.ckpt")
    try:
        wait_until(lambda: _periodic(tmp_path) and os.path.exists(last), alive=running(proc), poll_s=0.05,
                   what="a checkpoint")
    finally:
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=300)
    assert proc.returncode == (1 if sig == signal.SIGINT else 128 + signal.SIGTERM), proc.returncode  # never 0
    said = re.search(r"interrupted \((Ctrl-C|SIGTERM)\) during RL step (\d+): the last checkpoint (\S+) holds RL step "
                     r"(\d+); steps (\d+)-(\d+) are lost", err)
    assert said, err[-3000:]
    during, kept, first_lost, last_lost = (int(said.group(i)) for i in (2, 4, 5, 6))
    assert said.group(1) == ("Ctrl-C" if sig == signal.SIGINT else "SIGTERM")
    assert kept % 2 == 0 and kept >= 2 and (first_lost, last_lost) == (kept + 1, during) and during > kept
    # last.ckpt, unless the signal came between a periodic checkpoint and last.ckpt's copy of it
    resume = "last" if said.group(3) == last else said.group(3)
    assert said.group(3) == last or said.group(3).endswith(f"step={kept}.ckpt"), said.group(3)
    command = "python scripts/train.py " + shlex.join(overrides) + f" trainer.resume={resume}"
    assert command in err, err[-3000:]
