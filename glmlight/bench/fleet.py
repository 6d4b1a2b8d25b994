"""fleet: one real vLLM server against a managed fleet of two (`rollout.server.num_servers=2`, each on its own
share of the CPU cores), directly (glmlight's least-busy pool) and behind the real vllm-router, all launched by
glmlight on this machine, with SmolLM2-135M-Instruct in float32: rollout throughput (the same prompts and
seeds on every side, after a warm-up round), the time of one weight update of the real model into the fleet
(`shm` and `distributed` over gloo), and the cost of a worker's restart and re-sync (the first call after a
kill -9, against a call of the same size). Everything is a ratio against one server measured in the same run.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from typing import Any

from glmlight.bench.common import Sizes, row, smollm2_checkpoint
from glmlight.bench.serversync import CPU

VAR = "GLMLIGHT_VLLM_PYTHON"


def _config(ckpt: str, root: str, n: int, router: bool, mode: str) -> Any:
    from glmlight.config.schema import validate

    flags, env = CPU["vllm"]
    server = {"launch": True, "launch_python": os.environ[VAR], "launch_args": flags, "launch_env": env,
              "launch_timeout_s": 900, "sync_backend": "gloo", "weight_sync": mode, "num_servers": n,
              "weight_sync_dir": os.path.join(root, "weights"), "launch_restarts": 1}
    if router:
        server["router"] = "vllm-router"
    return validate({"rollout": {"backend": "vllm", "server": server}, "model": {"path": ckpt},
                     "trainer": {"default_root_dir": root}})


def _kill(proc: Any) -> None:
    """kill -9 a managed server (its processes, not its guard), as a crash would."""
    import signal

    from glmlight.engines.servers.guard import group_processes

    for pid in group_processes(proc.pgid):
        if pid != proc.proc.pid:
            os.kill(pid, signal.SIGKILL)
    proc.proc.wait(60)


def bench_fleet(s: Sizes, device: str, prompts: int = 64, new_tokens: int = 64, reps: int = 2) -> list[dict[str, Any]]:
    from glmlight.engines.base import SamplingParams
    from glmlight.engines.factory import build_server_engine
    from glmlight.models.loading import load_causal_lm, load_tokenizer
    from glmlight.models.tokenizer import encode_chat

    if not os.environ.get(VAR):
        print(f"fleet: skipped (set {VAR} to a Python with vLLM: scripts/vllm_cpu_venv.sh)", file=sys.stderr)
        return []
    ckpt = smollm2_checkpoint()
    tok = load_tokenizer(ckpt)
    named = [(k, v.detach().clone()) for k, v in load_causal_lm(ckpt, tok).state_dict().items()]
    gb = sum(v.numel() * v.element_size() for _, v in named) / 1e9
    ids = [encode_chat(tok, [{"role": "user", "content": f"What is {i} plus {i % 7}? Answer in words."}])
           for i in range(prompts)]
    params = [SamplingParams(max_new_tokens=new_tokens, temperature=1.0, seed=i) for i in range(prompts)]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    tput: dict[str, float] = {}
    sync: dict[tuple[str, str], float] = {}
    restart: dict[str, float] = {}
    for name, n, router in (("1 server", 1, False), ("2 servers", 2, False), ("2 servers + vllm-router", 2, True)):
        root = tempfile.mkdtemp(prefix="glmlight-bench-fleet-")
        engine = build_server_engine(_config(ckpt, root, n, router, "shm"))
        try:
            engine.generate(ids, params)  # warm-up
            secs, tokens = [], 0
            for _ in range(reps):
                t = time.perf_counter()
                gens = engine.generate(ids, params)
                secs.append(time.perf_counter() - t)
                tokens = sum(len(g.token_ids) for g in gens)
            tput[name] = tokens / statistics.median(secs)
            if not router:
                for mode in ("shm", "distributed"):
                    engine.sync.mode = mode
                    times = []
                    for rep in range(reps + 1):
                        t = time.perf_counter()
                        engine.update_weights(named, version=engine.version + 1)
                        if rep:
                            times.append(time.perf_counter() - t)
                    sync[(name, mode)] = statistics.median(times)
                engine.sync.mode = "shm"
            if n == 2:
                small = ids[:8]
                t = time.perf_counter()
                engine.generate(small, params[:8])
                plain = time.perf_counter() - t
                _kill(engine.launchers[engine.urls[-1]])
                t = time.perf_counter()
                engine.generate(small, params[:8])  # restarts the worker, re-syncs it, then answers
                restart[name] = time.perf_counter() - t - plain
        finally:
            engine.close()
    base = tput["1 server"]
    note = (f"SmolLM2-135M-Instruct float32, {prompts} prompts x {new_tokens} new tokens, medians of {reps}; "
            f"{cores} cores shared by the servers (one server: all of them; two: half each); tokens/s: "
            + ", ".join(f"{k} {v:.0f}" for k, v in tput.items()))
    rows = [row(f"rollout throughput, {k}, vs 1 server", "tokens/s", v, base, None, note)
            for k, v in tput.items() if k != "1 server"]
    for mode in ("shm", "distributed"):
        one, two = sync[("1 server", mode)], sync[("2 servers", mode)]
        rows.append(row(f"weight sync into 2 servers vs 1, {mode} mode (time ratio, lower is better)", "s", two, one,
                        None, f"{gb * 1e3:.0f} MB per update; 1 server {one:.2f} s, 2 servers {two:.2f} s"))
    for k, v in restart.items():
        rows.append(row(f"a worker's restart and re-sync, {k} (s added to the next call; baseline: one update)", "s",
                        v, sync[("2 servers", "shm")], None, "kill -9 of one worker, then a call of 8 prompts"))
    for r in rows:
        print(f"fleet: {r['figure']}: {r['glmlight']:.3f} vs {r['baseline']:.3f} ({r['ratio']:.2f})", file=sys.stderr)
    return rows
