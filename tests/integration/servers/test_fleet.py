"""A managed fleet: two real servers of one backend behind the backend's real router (vllm-router 0.1.17 in
front of vLLM 0.32.0 CPU servers, sglang-router 0.3.2 in front of SGLang 0.5.23 CPU servers), launched,
restarted and stopped by glmlight (`rollout.server.num_servers=2 rollout.server.router=...`; each router is
installed in its server's environment by scripts/*_cpu_venv.sh). Slow: each fleet takes minutes to start here.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
import urllib.request

import pytest

from glmlight.engines.base import SamplingParams
from glmlight.engines.factory import build_server_engine
from glmlight.engines.servers.guard import group_processes
from glmlight.models.tiny_checkpoint import build_tiny_checkpoint
from tests.support.real_servers import interpreter, server_config, with_launch_settings

pytestmark = pytest.mark.slow

ROUTER = {"vllm": "vllm-router", "sglang": "sglang-router"}


def _kill_server(proc) -> list[int]:
    """kill -9 a managed process (the server under its guard, not the guard): what a crash or the OOM killer does."""
    pids = [p for p in group_processes(proc.pgid) if p != proc.proc.pid]
    assert pids, "nothing to kill"
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    proc.proc.wait(60)
    return pids


def _vllm_counter(url: str, name: str) -> float:
    """A counter of a vLLM server's own Prometheus metrics (summed over its labels)."""
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    return sum(float(v) for v in re.findall(r"^vllm:" + name + r"\{[^}]*\} ([0-9.e+]+)", text, re.M))


def _vllm_requests(url: str) -> float:
    return _vllm_counter(url, "request_success_total")


def test_a_group_s_copies_go_to_one_worker_updates_reach_every_worker_and_a_killed_worker_rejoins(tmp_path):
    """vLLM fleet of two behind vllm-router (cache-aware): the copies of each prompt are answered by one worker
    (read from the workers' own request counters); a weight update moves both workers to the new version or
    neither; a worker killed with SIGKILL is taken out of the router's rotation, the fleet's answers keep
    coming from the other, and before the next call it is started again, re-synced to the current version
    and given back to the router; closing stops all three processes."""
    python = interpreter("vllm")
    ckpts = [build_tiny_checkpoint(str(tmp_path / f"tiny-{i}"), "llama", seed=i) for i in range(2)]
    from glmlight.engines.transport import read_checkpoint

    cfg = server_config("vllm", python, ckpts[0], str(tmp_path), num_servers=2, router="vllm-router",
                        weight_sync="tensor", launch_restarts=2)
    t0 = time.monotonic()
    engine = build_server_engine(cfg)
    print(f"\nfleet of two vLLM servers and vllm-router ready in {time.monotonic() - t0:.0f} s")
    workers = engine.urls[1:]
    groups = [engine.router_proc.pgid] + [engine.launchers[w].pgid for w in workers]
    try:
        assert sorted(engine.router_admin.workers()) == sorted(workers)
        params = SamplingParams(max_new_tokens=4, temperature=1.0)
        one_worker = 0
        cache = [(_vllm_counter(w, "prefix_cache_hits_total"), _vllm_counter(w, "prefix_cache_queries_total"))
                 for w in workers]
        for g in range(8):
            prompt = [(7 * g + 3 * j) % 90 + 5 for j in range(300)]
            before = [_vllm_requests(w) for w in workers]
            engine.generate([prompt] * 4, [SamplingParams(max_new_tokens=4, temperature=1.0, seed=c) for c in range(4)])
            got = [_vllm_requests(w) - b for w, b in zip(workers, before)]
            one_worker += sorted(got) == [0, 4]
        hits = sum(_vllm_counter(w, "prefix_cache_hits_total") - h for w, (h, _) in zip(workers, cache))
        queries = sum(_vllm_counter(w, "prefix_cache_queries_total") - q for w, (_, q) in zip(workers, cache))
        print(f"groups whose 4 copies one worker answered: {one_worker} of 8; prefix-cache hit rate "
              f"{hits / queries:.2f} ({hits:.0f} of {queries:.0f} prompt tokens, the workers' own counters)")
        assert one_worker >= 7  # cache-aware routing keeps a group on one worker (its prefix cached there)
        # 3 of a group's 4 copies find its whole blocks cached: 0.64 at vLLM's 128-token blocks
        assert hits / queries >= 0.5

        engine.update_weights(read_checkpoint(ckpts[1]), version=1)
        assert engine.version == 1 and all(engine.suspects.versions[w] == 1 for w in workers)
        assert {engine.http.run(engine.servers[w].label()) for w in workers} == {"1"}

        victim = workers[1]
        old = engine.launchers[victim]
        stop = threading.Event()
        answers: list = []

        def generate_meanwhile():
            while not stop.is_set():
                answers.extend(engine.generate([[5 + i, 9, 12] for i in range(8)], params))

        t = threading.Thread(target=generate_meanwhile)
        t.start()
        time.sleep(1.0)
        _kill_server(old)
        time.sleep(3.0)
        stop.set()
        t.join(300)
        assert answers and all(g.versions == [1] * len(g.token_ids) for g in answers)
        engine.generate([[5, 9, 12]], params)  # a call restarts it (if the generating thread's next call has not)
        # it was taken out of the router's rotation, started again, re-synced, and given back
        assert engine.num_router_removals >= 1
        assert engine.num_server_restarts == 1 and engine.launchers[victim] is not old
        assert engine.num_resyncs >= 1 and engine.http.run(engine.servers[victim].label()) == "1"
        assert victim in engine.router_admin.workers() and victim not in engine.suspects
        assert group_processes(old.pgid) == []

        old_router = engine.router_proc
        _kill_server(old_router)
        gens = engine.generate([[5, 9, 12]] * 4, params)  # the router is started again on its port
        assert len(gens) == 4 and engine.router_proc is not old_router and engine.num_server_restarts == 2
        assert sorted(engine.router_admin.workers()) == sorted(workers)
        groups += [engine.router_proc.pgid, engine.launchers[victim].pgid]
    finally:
        engine.close()
    assert all(group_processes(g) == [] for g in groups), "a managed process outlived close()"


@pytest.mark.parametrize("backend", ["vllm", "sglang"])
def test_grpo_through_two_servers_and_the_real_router_with_a_worker_killed_mid_run(backend, tmp_path):
    """GRPO, weight sync every step, into two real servers behind the backend's real router; one worker is
    killed with SIGKILL while a step's rollout is in flight. The run ends at its last step; every sample is
    stamped with the version its step trained, every produced sample is trained or counted as dropped, none
    twice; the killed worker was started again and re-synced; no process is left."""
    import lightning.pytorch as pl

    import glmlight
    from tests.conftest import overrides_for_tests

    python = interpreter(backend)
    ckpt = build_tiny_checkpoint(str(tmp_path / "tiny"), "llama", seed=0)
    cfg = with_launch_settings(glmlight.compose(overrides_for_tests(
        tmp_path, f"rollout={backend}", "model=hf", f"model.path={ckpt}", "model.dtype=float32",
        "trainer.max_steps=4", "rollout.max_new_tokens=8", "rollout.temperature=1.0", "rollout.server.urls=[]",
        "rollout.server.launch=true", "rollout.server.num_servers=2", f"rollout.server.router={ROUTER[backend]}",
        "rollout.server.weight_sync=tensor", "rollout.server.launch_restarts=2", "~callbacks.held_out_eval",
        "~callbacks.sample_table", "algo.lr=0.001")),
        backend, python, ckpt, str(tmp_path))

    class KillMidRollout(pl.Callback):
        def __init__(self):
            self.rows, self.killed, self.timer = [], None, None

        def on_experience(self, trainer, module, batch):
            self.rows.append((module.policy_version, sorted({v for s in batch.samples for v in s.versions})))

        def on_train_batch_end(self, trainer, module, *args):  # after WeightSync's push: the next rollout starts
            eng = run.datamodule.engine
            if module.policy_version == 2 and self.killed is None:
                self.killed = eng.launchers[eng.urls[2]]
                self.timer = threading.Timer(0.3, _kill_server, [self.killed])
                self.timer.start()

    run = glmlight.build(cfg)
    seen = KillMidRollout()
    run.trainer.callbacks.append(seen)
    engine = run.datamodule.engine
    groups = [engine.router_proc.pgid] + [m.pgid for m in engine.launchers.values()]
    try:
        run.fit(close=False)
        seen.timer.join()
        t = run.datamodule.totals
        print(f"\n{backend}: totals {dict(t)}, restarts {engine.num_server_restarts}, re-syncs {engine.num_resyncs}, "
              f"router removals {engine.num_router_removals}, duplicates {engine.num_duplicates}; steps {seen.rows}")
        assert run.module.policy_version == 4 and [r[0] for r in seen.rows] == [0, 1, 2, 3]
        assert all(stamped == [version] for version, stamped in seen.rows)
        assert t["produced"] == t["trained"] + sum(v for k, v in t.items() if k.startswith("dropped/"))
        assert engine.num_duplicates == 0
        # the killed worker was taken out of the router's rotation, started again, and brought to the current
        # version (by a re-sync, or by the next update when that came first) before it rejoined
        assert engine.num_server_restarts == 1 and engine.num_router_removals >= 1
        workers = engine.urls[1:]
        assert {engine.http.run(engine.servers[w].label()) for w in workers} == {"4"}
        assert sorted(engine.router_admin.workers()) == sorted(workers)
        assert group_processes(seen.killed.pgid) == []
        groups += [m.pgid for m in engine.launchers.values()]
    finally:
        run.close()
    assert all(group_processes(g) == [] for g in groups), "a managed process outlived the run"
