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

import torch

from glmlight.bench.common import Sizes, row, smollm2_checkpoint
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
    from glmlight.config.schema import validate

    flags, env = CPU[backend]
    return validate({"rollout": {"backend": backend, "server": {
        "launch": True, "launch_python": os.environ[BACKENDS[backend]], "launch_args": flags, "launch_env": env,
        "launch_timeout_s": 900, "sync_backend": "gloo", "weight_sync_dir": os.path.join(root, "weights")}},
        "model": {"path": ckpt}, "trainer": {"default_root_dir": root}})


def bench_server_sync(s: Sizes, device: str) -> list[dict[str, Any]]:
    from glmlight.engines.factory import build_server_engine
    from glmlight.models.loading import load_causal_lm, load_tokenizer

    ckpt = smollm2_checkpoint()
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
                    engine.sync.mode = mode
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


def bench_weight_delta(s: Sizes, device: str) -> list[dict[str, Any]]:
    """What fraction of the engine's weights a training step changes, on the real model: the SmolLM2 recipe
    (experiment=smollm2_grpo, `s.delta_steps` RL steps), the weights compared at every sync with those
    of the sync before, in bfloat16 (what a bf16 server holds, and what a delta sync would send) and in
    float32. slime and verl send only changed bytes; this says whether that would pay here."""
    import lightning.pytorch as pl

    import glmlight
    from glmlight import compose

    changed: list[dict[str, float]] = []
    states: list[dict[str, torch.Tensor]] = []  # the weights at every sync, the first one included

    class Delta(pl.Callback):  # after WeightSync (appended last): the weights the engine just got
        def __init__(self) -> None:
            self.prev: dict[str, torch.Tensor] | None = None

        def on_train_start(self, trainer: Any, module: Any) -> None:
            self.prev = {k: v.detach().float().clone() for k, v in module.policy.state_dict().items()}
            states.append(self.prev)

        def on_train_batch_end(self, trainer: Any, module: Any, *args: Any, **kwargs: Any) -> None:
            now = {k: v.detach().float().clone() for k, v in module.policy.state_dict().items()}
            if self.prev is not None:
                n = sum(v.numel() for v in now.values())
                bf16 = sum(int((now[k].bfloat16() != self.prev[k].bfloat16()).sum()) for k in now)
                fp32 = sum(int((now[k] != self.prev[k]).sum()) for k in now)
                changed.append({"bf16": bf16 / n, "fp32": fp32 / n})
            self.prev = now
            states.append(now)

    with tempfile.TemporaryDirectory() as root:
        run = glmlight.build(compose(["experiment=smollm2_grpo", f"trainer.max_steps={s.delta_steps}", "logger=none",
                                      "algo.micro_batch_size=8",  # the same update in less memory
                                      "eval.every_n_steps=0", "~callbacks.sample_table", "export.enabled=false",
                                      f"trainer.default_root_dir={root}", "trainer.enable_progress_bar=false"]))
        run.trainer.callbacks.append(Delta())
        run.fit()
    bf16 = statistics.median(c["bf16"] for c in changed)
    fp32 = statistics.median(c["fp32"] for c in changed)
    per_step = {k: ", ".join(f"{c[k]:.3f}" for c in changed) for k in ("bf16", "fp32")}
    note = (f"SmolLM2 recipe (GRPO, lr 2e-5, Adam), {len(changed)} steps compared; per step, fraction of elements "
            f"changed: bf16 {per_step['bf16']}; fp32 {per_step['fp32']}")
    print(f"delta: {note}", file=sys.stderr)
    rows = [row("weights changed per step, bf16 (fraction of elements; baseline: all)", "fraction", bf16, 1.0, None, note),
            row("weights changed per step, fp32 (fraction of elements; baseline: all)", "fraction", fp32, 1.0, None, note)]
    if not os.environ.get(BACKENDS["vllm"]):
        print(f"delta: the sync into a real vLLM server skipped (set {BACKENDS['vllm']})", file=sys.stderr)
        return rows
    return rows + bench_delta_sync(states)


def bench_delta_sync(states: list[dict[str, torch.Tensor]]) -> list[dict[str, Any]]:
    """The recipe's consecutive weights pushed into a real vLLM server serving SmolLM2 in bfloat16
    (weight_sync=tensor): whole float32 tensors as the trainer holds them, against delta sync
    (rollout.server.delta_sync: the changed bf16 elements). Every update after the first is timed."""
    from glmlight.engines.factory import build_server_engine
    from glmlight.engines.weight_delta import DeltaSender

    ckpt = smollm2_checkpoint()
    root = tempfile.mkdtemp(prefix="glmlight-bench-delta-")
    cfg = _config("vllm", ckpt, root)
    cfg.rollout.server.launch_args = [a if a != "float32" else "bfloat16" for a in cfg.rollout.server.launch_args]
    engine = build_server_engine(cfg)
    engine.sync.mode = "tensor"
    seconds: dict[str, list[float]] = {"whole": [], "delta": []}
    sent: dict[str, list[int]] = {"whole": [], "delta": []}
    try:
        for mode in ("whole", "delta"):
            engine.delta = DeltaSender() if mode == "delta" else None
            for i, state in enumerate(states):
                named = list(state.items())
                t = time.perf_counter()
                engine.update_weights(named, version=engine.version + 1)
                if i:  # the first push of each mode sets the base
                    seconds[mode].append(time.perf_counter() - t)
                    sent[mode].append(engine.last_sync_bytes["bytes"] if mode == "delta"
                                      else sum(v.numel() * v.element_size() for _, v in named))
    finally:
        engine.close()
    s_whole, s_delta = statistics.median(seconds["whole"]), statistics.median(seconds["delta"])
    b_whole, b_delta = statistics.median(sent["whole"]), statistics.median(sent["delta"])
    note = (f"SmolLM2 recipe weights after {len(states) - 1} RL steps into vLLM serving bfloat16, tensor mode; per "
            f"update: whole float32 {b_whole / 1e6:.0f} MB in {s_whole:.3f} s, delta "
            f"{', '.join(f'{b / 1e6:.1f}' for b in sent['delta'])} MB in {', '.join(f'{x:.3f}' for x in seconds['delta'])} s")
    print(f"delta: {note}", file=sys.stderr)
    return [row("delta sync into vLLM (bf16): bytes sent per update, whole fp32 / delta", "x", b_whole / b_delta, 1.0,
                None, note),
            row("delta sync into vLLM (bf16): seconds per update, whole fp32 / delta", "x", s_whole / s_delta, 1.0,
                None, note)]
