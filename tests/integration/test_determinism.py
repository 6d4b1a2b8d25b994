"""trainer.deterministic=true: the same command on one machine gives the same logged metrics (timings aside)
and the same final weights, bit for bit, whatever else the machine is doing and whatever thread count the
process started with (docs/reliability.md, "Repeatable runs")."""

import json
import math
import os
import subprocess
import sys
import threading

import pytest
import torch

import glmlight
from glmlight import compose
from tests.conftest import overrides_for_tests

# Keys that measure time (or are derived from it), not what was computed.
TIMING = ("seconds", "_s", "per_s", "tokens_per_s", "wait", "time", "mfu", "flops_utilization")


def _is_timing(key: str) -> bool:
    last = key.rsplit("/", 1)[-1]
    return any(last.endswith(t) or last.startswith(t) for t in TIMING)


def _metrics(root) -> list[dict]:
    rows = []
    with open(os.path.join(str(root), "metrics.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            rows.append({k: v for k, v in row.items() if not _is_timing(k)})
    return rows


class _Load:
    """Other work beside the run: a spinning process on every core and a spinning thread in this process."""

    def __enter__(self):
        code = "import time\nt=time.time()\nwhile time.time()-t<300: pass"
        self.procs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(os.cpu_count() or 1)]
        self.stop = threading.Event()

        def spin():
            x = 0
            while not self.stop.is_set():
                x += 1

        self.thread = threading.Thread(target=spin, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for p in self.procs:
            p.kill()
            p.wait()
        self.thread.join()


def _run(root, overrides, threads, load):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        run = glmlight.build(compose(overrides_for_tests(root, *overrides)))
        if load:
            with _Load():
                run.fit(close=False)
        else:
            run.fit(close=False)
        weights = {k: v.detach().clone() for k, v in run.module.policy.state_dict().items()}
        run.close()
    finally:
        torch.set_num_threads(before)
    return _metrics(root), weights


CASES = {
    "sync": [],
    # long enough answers that a weight push lands while the producer generates, two batches ahead
    "async": ["rollout.mode=async", "rollout.queue_size=2", "rollout.max_new_tokens=24"],
    "calculator_agent": ["task=calculator_agent", "rollout.max_new_tokens=6", "task.agent.max_turns=2"],
}


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c == "calculator_agent" else c
                                  for c in sorted(CASES)])  # (the agent case is slow: -m slow)
def test_a_deterministic_run_repeats_bit_for_bit_under_other_load_and_thread_count(tmp_path, case):
    overrides = [*CASES[case], "trainer.deterministic=true", "trainer.max_steps=3", "eval.every_n_steps=2",
                 "eval.k=2", "algo.lr=0.01"]
    quiet, quiet_weights = _run(tmp_path / "quiet", overrides, threads=1, load=False)
    busy, busy_weights = _run(tmp_path / "busy", overrides, threads=2, load=True)
    assert len(quiet) == len(busy) and quiet, (len(quiet), len(busy))
    for a, b in zip(quiet, busy):
        diff = {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b))
                if not (a.get(k) == b.get(k) or (isinstance(a.get(k), float) and math.isnan(a[k])
                                                  and isinstance(b.get(k), float) and math.isnan(b[k])))}
        assert not diff, (a.get("rl_step"), diff)
    assert any(k.startswith("eval/") for row in quiet for k in row)  # an evaluation was compared too
    assert sorted(quiet_weights) == sorted(busy_weights)
    changed = [k for k in quiet_weights if not torch.equal(quiet_weights[k], busy_weights[k])]
    assert not changed, changed
