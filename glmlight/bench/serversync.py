"""serversync: weight sync of the real model (SmolLM2-135M-Instruct, float32, as `model=smollm2` trains
it) into a real vLLM server and a real SGLang server that glmlight launches on this machine, in every
mode (disk, shm, tensor, distributed over gloo), against memcpy of the same bytes into memory that
is already mapped, measured in the same run. Each push is a whole update as training does it: pause,
stage, commit (the server's reload), confirm, resume. The server's own stage times come back with
the commit (vLLM: staging, host copy, reload), the trainer side's write with the engine."""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from typing import Any

from glmlight.bench.common import Sizes, row
from glmlight.bench.weightsync import copy_seconds, twins

MODES = ("disk", "shm", "tensor", "distributed")
BACKENDS = {"vllm": "GLMLIGHT_VLLM_PYTHON", "sglang": "GLMLIGHT_SGLANG_PYTHON"}


# The servers' CPU builds as docs/servers.md starts them: float32 (the trainer's dtype), no graph capture;
# vLLM without chunked prefill (its CPU worker dies on a seeded request whose prefill is split), SGLang
# with torch-native attention (its default x86 backend needs AMX).
CPU = {"vllm": (["--dtype", "float32", "--enforce-eager", "--max-model-len", "1024", "--seed", "0",
                 "--no-enable-chunked-prefill"], {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_NO_USAGE_STATS": "1"}),
       "sglang": (["--device", "cpu", "--attention-backend", "torch_native", "--dtype", "float32",
                   "--max-total-tokens", "4096", "--context-length", "1024", "--skip-server-warmup"],
                  {"SGLANG_USE_CPU_ENGINE": "1", "SGLANG_DISABLE_REQUEST_LOGGING": "1"})}


def _config(backend: str, ckpt: str, root: str) -> Any:
    from glmlight.config import validate

    flags, env = CPU[backend]
    return validate({"rollout": {"backend": backend, "server": {
        "launch": True, "launch_python": os.environ[BACKENDS[backend]], "launch_args": flags, "launch_env": env,
        "launch_timeout_s": 900, "sync_backend": "gloo", "weight_sync_dir": os.path.join(root, "weights")}},
        "model": {"path": ckpt}, "trainer": {"default_root_dir": root}})


def bench_server_sync(s: Sizes, device: str) -> list[dict[str, Any]]:
    from glmlight.bench.smollm2 import FILE, PACKAGE
    from glmlight.engines.factory import build_server_engine
    from glmlight.models.gguf import package_checkpoint
    from glmlight.models.loading import load_causal_lm, load_tokenizer

    ckpt = package_checkpoint(PACKAGE, FILE)
    policy = load_causal_lm(ckpt, load_tokenizer(ckpt)).eval()
    named = [(k, v.detach().clone()) for k, v in policy.state_dict().items()]
    gb = sum(v.numel() * v.element_size() for _, v in named) / 1e9
    dst = twins(named)
    rows: list[dict[str, Any]] = []
    for backend, var in BACKENDS.items():
        if not os.environ.get(var):
            print(f"serversync: {backend} skipped (set {var})", file=sys.stderr)
            continue
        root = tempfile.mkdtemp(prefix=f"glmlight-bench-serversync-{backend}-")
        engine = build_server_engine(_config(backend, ckpt, root))
        times: dict[str, list[float]] = {k: [] for k in (*MODES, "memcpy")}
        stages: dict[str, dict[str, list[float]]] = {m: {} for m in MODES}
        try:
            for rep in range(s.sync_reps + 1):  # the first round warms every mode up and is not counted
                for mode in MODES:
                    engine.weight_sync = mode
                    t = time.perf_counter()
                    engine.update_weights(named, version=engine.version + 1)
                    if rep:
                        times[mode].append(time.perf_counter() - t)
                        for k, x in engine.last_sync_seconds.items():
                            stages[mode].setdefault(k, []).append(x)
                if rep:
                    times["memcpy"].append(copy_seconds(named, dst))
        finally:
            engine.close()
        med = {k: statistics.median(v) for k, v in times.items()}
        for mode in MODES:
            parts = ", ".join(f"{k} {statistics.median(v):.3f}" for k, v in sorted(stages[mode].items()))
            note = (f"SmolLM2-135M-Instruct float32 state, {gb * 1e3:.0f} MB; {med[mode]:.3f} s per update "
                    f"(memcpy {med['memcpy']:.3f} s){'; stages (s): ' + parts if parts else ''}")
            rows.append(row(f"weight sync into {backend} ({engine.name}), {mode} mode, vs memcpy", "GB/s",
                            gb / med[mode], gb / med["memcpy"], 0.25 if mode == "shm" else None, note))
    for r in rows:
        print(f"serversync: {r['figure']}: {r['glmlight']:.3f} vs {r['baseline']:.3f} GB/s", file=sys.stderr)
    return rows
