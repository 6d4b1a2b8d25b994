"""Rewards that hang or are slow: a per-sample timeout (counted as dropped/reward_timeout, the run goes on,
nothing is left running) and bounded concurrency (a slow reward over a batch costs about one call, not one
call per sample). Real runs: the real Trainer, engine and tiny GLM-5."""

import asyncio
import csv
import glob
import os
import threading
import time

import pytest

import glmlight
from glmlight import compose
from glmlight.errors import ConfigError, GlmlightError
from glmlight.rewards import build_reward
from glmlight.rewards.base import RewardRunner, score_samples
from glmlight.sample import Sample, Status
from tests.support.waiting import wait_until
from tests.conftest import overrides_for_tests

RELEASE = threading.Event()  # lets the thread-hang rewards below return at the end of a test


# ------------------------------------------------------------------------------------- rewards under test
def _record_pid() -> None:
    where = os.environ.get("GLMLIGHT_TEST_PID_DIR")
    if where:
        open(os.path.join(where, str(os.getpid())), "w").close()


def hang_forever_one_in_eight(sample) -> float:
    """Sleeps for ever on every eighth sample (rollout ids 0, 8, 16, ...); otherwise a dense reward."""
    _record_pid()
    if sample.rollout_id % 8 == 0:
        time.sleep(10**9)
    text = sample.metadata["completion_text"]
    return sum(c.isdigit() for c in text) / max(len(text), 1)


def hang_until_released_one_in_eight(sample) -> float:
    if sample.rollout_id % 8 == 0:
        RELEASE.wait()
    return 0.5


async def async_hang_one_in_eight(sample) -> float:
    if sample.rollout_id % 8 == 0:
        await asyncio.sleep(10**9)
    return 0.5


async def async_blocking(sample) -> float:
    time.sleep(3)  # synchronous work inside `async def`: blocks the event loop
    return 0.5


def half_a_second(sample) -> float:
    time.sleep(0.5)
    return 0.5


def dies_on_odd(sample) -> float:
    if sample.rollout_id % 2:
        os._exit(3)
    return 1.0


def env_mark(sample) -> float:
    return float(os.environ.get("GLMLIGHT_TEST_ENV_MARK") == "set after the fork server started")


def _samples(n):
    return [Sample(prompt_ids=[1], rollout_id=i, metadata={"completion_text": "1", "label": "1"}) for i in range(n)]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            state = next(line for line in f if line.startswith("State:"))
    except (OSError, StopIteration):
        return False
    return state.split()[1] not in ("Z", "X")


def _reward_threads():
    return [t for t in threading.enumerate() if t.name.startswith("glmlight-reward")]


def _wait_for(condition, seconds=5.0):
    deadline = time.time() + seconds
    while time.time() < deadline and not condition():
        time.sleep(0.05)


def _metric_rows(root):
    rows = []
    for path in glob.glob(os.path.join(str(root), "csv", "*", "metrics.csv")):
        rows += [r for r in csv.DictReader(open(path)) if r.get("rollout/produced")]
    return rows


# ------------------------------------------------------------------------------------------- real runs
def test_a_reward_that_hangs_for_ever_on_one_sample_in_eight_is_killed_counted_and_the_run_goes_on(
        tmp_path, monkeypatch):
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    monkeypatch.setenv("GLMLIGHT_TEST_PID_DIR", str(pid_dir))
    run = glmlight.build(compose(overrides_for_tests(
        tmp_path, "task.reward._target_=tests.unit.rewards.test_reward_timeouts.hang_forever_one_in_eight",
        "task.reward_options.timeout_s=1", "task.reward_options.executor=process",
        "task.reward_options.max_concurrency=4", "~callbacks.held_out_eval", "~callbacks.sample_table")))
    run.fit()  # returns at all: a hung reward does not hold the run (a hang would hit pytest-timeout)
    assert run.trainer.global_step == 2
    totals = run.datamodule.totals
    # 2 steps x 16 samples: rollout ids 0, 8, 16 and 24 hang; each of their groups is padded back to 4
    assert totals["dropped/reward_timeout"] == 4 and totals["produced"] == 32
    assert totals["produced"] == totals["trained"] + sum(v for k, v in totals.items() if k.startswith("dropped/"))
    rows = _metric_rows(tmp_path)
    assert [float(r["rollout/dropped/reward_timeout"]) for r in rows] == [2.0, 2.0]
    assert [float(r["rollout/reward_timeout"]) for r in rows] == [2.0, 2.0]
    # every worker process that scored (the two killed ones included) is gone after the run
    pids = [int(p) for p in os.listdir(pid_dir)]
    assert len(pids) >= 3 and os.getpid() not in pids
    wait_until(lambda: not any(_alive(p) for p in pids), what="the reward workers to exit")


def test_a_slow_reward_is_scored_concurrently(tmp_path):
    """0.5 s a sample, 8 samples a step, max_concurrency=8: a step's scoring takes about 0.5 s, not 4 s."""
    run = glmlight.build(compose(overrides_for_tests(
        tmp_path, "task.reward._target_=tests.unit.rewards.test_reward_timeouts.half_a_second",
        "rollout.rollout_batch_size=2", "task.reward_options.max_concurrency=8", "trainer.max_steps=2",
        "~callbacks.held_out_eval", "~callbacks.sample_table")))
    run.fit()
    rows = _metric_rows(tmp_path)
    assert len(rows) == 2 and all(float(r["rollout/produced"]) == 8 for r in rows)
    seconds = [float(r["rollout/reward_seconds"]) for r in rows]
    assert all(0.45 < s < 2.5 for s in seconds), seconds


# ------------------------------------------------------------------------------------- the runner itself
def test_a_hung_thread_is_abandoned_counted_and_exits_once_its_call_returns():
    RELEASE.clear()
    before = set(_reward_threads())
    runner = RewardRunner(hang_until_released_one_in_eight, {"timeout_s": 0.5, "max_concurrency": 8})
    samples = _samples(16)
    t0 = time.perf_counter()
    counts = runner.score(samples)
    assert time.perf_counter() - t0 < 5
    assert counts["timeout"] == 2 and counts["scored"] == 14
    assert samples[0].status is Status.FAILED and samples[0].metadata["reward_timeout"] is True
    assert "timed out after 0.5s" in samples[8].metadata["reward_error"]
    assert runner.hung == 2
    runner.close()
    _wait_for(lambda: len(set(_reward_threads()) - before) <= 2)
    assert len(set(_reward_threads()) - before) == 2  # only the two hung calls are still running
    RELEASE.set()
    _wait_for(lambda: not set(_reward_threads()) - before)
    assert not set(_reward_threads()) - before and runner.hung == 0


def test_hung_threads_are_bounded_then_the_run_stops_with_one_line():
    RELEASE.clear()
    try:
        runner = RewardRunner(hang_until_released_one_in_eight, {"timeout_s": 0.3, "max_concurrency": 2})
        assert runner.score(_samples(16))["timeout"] == 2
        with pytest.raises(GlmlightError, match="the reward hangs: 2 calls are still running .*executor=process"):
            runner.score(_samples(8))
    finally:
        RELEASE.set()


def test_an_async_reward_past_its_timeout_is_cancelled():
    before = set(_reward_threads())
    samples = _samples(8)
    t0 = time.perf_counter()
    counts = score_samples(async_hang_one_in_eight, samples, {"timeout_s": 0.5})
    assert time.perf_counter() - t0 < 3
    assert counts["timeout"] == 1 and counts["scored"] == 7 and samples[0].reward is None
    _wait_for(lambda: not set(_reward_threads()) - before)
    assert not set(_reward_threads()) - before  # the event loop's thread is gone too: nothing was left running


def test_an_async_reward_that_blocks_its_event_loop_cannot_hang_the_step():
    samples = _samples(2)
    t0 = time.perf_counter()
    runner = RewardRunner(async_blocking, {"timeout_s": 0.5})
    counts = runner.score(samples)
    assert time.perf_counter() - t0 < 0.5 + 5.0 + 2.0
    assert counts["timeout"] == 2
    assert "event loop was blocked" in samples[0].metadata["reward_error"]


def test_process_workers_fail_a_dying_call_and_replace_the_worker():
    runner = RewardRunner(dies_on_odd, {"executor": "process", "max_concurrency": 2, "timeout_s": 30})
    try:
        samples = _samples(6)
        counts = runner.score(samples)
        assert counts["scored"] == 3 and counts["failed"] == 3
        assert "worker process died (exit code 3)" in samples[1].metadata["reward_error"]
        assert runner.score(_samples(2))["scored"] == 1
    finally:
        runner.close()
    assert not [p for p in runner.pids() if _alive(p)]


def test_process_executor_needs_a_picklable_reward():
    lock = threading.Lock()
    with pytest.raises(ConfigError, match="executor=process: the reward .* cannot be sent to a worker process"):
        RewardRunner(lambda s, lock=lock: 1.0, {"executor": "process"})


def test_reward_options_are_not_reward_arguments():
    with pytest.raises(ConfigError, match=r"unexpected keyword argument 'timeout_s'.*task\.reward_options"):
        build_reward({"_target_": "glmlight.rewards.verifiers.ExactMatch", "timeout_s": 5})
    with pytest.raises(ConfigError, match="unexpected keyword argument 'scale'"):
        build_reward({"_target_": "tests.conftest.digit_fraction_reward", "scale": 2})
    with pytest.raises(ConfigError, match="task.reward_options.max_concurrency must be >= 1, got 0"):
        RewardRunner(half_a_second, {"max_concurrency": 0})


def test_a_generative_judge_is_asked_concurrently_and_its_engine_batches(tokenizer, tiny_model):
    from glmlight.rewards.judge import GenerativeJudge
    from glmlight.engines.local.engine import LocalEngine

    engine = LocalEngine(tiny_model, pad_token_id=tokenizer.pad_token_id)
    judge = GenerativeJudge(engine, template="Rate: {completion}", max_new_tokens=4)
    try:
        samples = _samples(8)
        score_samples(judge, samples, {"max_concurrency": 8})
        assert engine.stats()["max_batch"] > 1  # several judge prompts decoded together
    finally:
        engine.close()


def test_a_worker_process_sees_the_environment_of_when_it_starts(monkeypatch):
    """A reward worker is forked from a fork server that may have started long before (another run in this
    process): it still sees the environment the parent has when the worker starts."""
    first = RewardRunner(half_a_second, {"executor": "process", "timeout_s": 30})
    first.score(_samples(1))  # the fork server starts here (if no earlier test started it)
    first.close()
    monkeypatch.setenv("GLMLIGHT_TEST_ENV_MARK", "set after the fork server started")
    runner = RewardRunner(env_mark, {"executor": "process", "timeout_s": 30})
    samples = _samples(2)
    runner.score(samples)
    runner.close()
    assert [s.reward for s in samples] == [1.0, 1.0]
