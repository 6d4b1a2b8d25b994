"""sync: seconds per GB of a weight push into the embedded engine (what WeightSync does after every
step) against memcpy and disk-write bandwidth of the same bytes, measured in the same run."""

from __future__ import annotations

import copy
import os
import statistics
import tempfile
import time
from typing import Any

import torch

from glmlight.bench.common import TARGETS, Sizes, row, tiny_model

NamedTensors = list[tuple[str, torch.Tensor]]


def twins(named: NamedTensors) -> list[torch.Tensor]:
    """Destination tensors for copy_seconds, written once (so the timed copies do not page-fault)."""
    dst = [torch.empty_like(v) for _, v in named]
    copy_seconds(named, dst)
    return dst


def copy_seconds(named: NamedTensors, dst: list[torch.Tensor]) -> float:
    """One copy_ of every tensor into its twin in `dst`: memcpy of the same bytes, same layout, into
    memory already mapped (as the engine's own weights are)."""
    t = time.perf_counter()
    for d, (_, v) in zip(dst, named):
        d.copy_(v)
    return time.perf_counter() - t


def write_seconds(named: NamedTensors, path: str) -> float:
    """Writing the same bytes to a file (page cache, no fsync, as safetensors' save_file does)."""
    buffers = [v.contiguous().view(-1).view(torch.uint8).numpy() for _, v in named]
    t = time.perf_counter()
    with open(path, "wb") as f:
        f.writelines(memoryview(b) for b in buffers)
    dt = time.perf_counter() - t
    os.remove(path)
    return dt


def bench_sync(s: Sizes, device: str) -> list[dict[str, Any]]:
    from glmlight.engines.local.engine import LocalEngine

    tok, trained = tiny_model(s.sync_preset, device)
    engine = LocalEngine(copy.deepcopy(trained).eval(), device=device, pad_token_id=tok.pad_token_id)
    named = [(k, v.detach()) for k, v in trained.state_dict().items()]  # what WeightSync.push sends
    nbytes = sum(v.numel() * v.element_size() for _, v in named)
    times: dict[str, list[float]] = {"engine": [], "memcpy": [], "write": []}
    version = 0
    dst = twins(named)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            engine.update_weights(named, version=0)  # warm-up
            for _ in range(s.sync_reps):  # alternating
                version += 1
                t = time.perf_counter()
                engine.update_weights(named, version=version)
                times["engine"].append(time.perf_counter() - t)
                times["memcpy"].append(copy_seconds(named, dst))
                times["write"].append(write_seconds(named, os.path.join(tmp, "w.bin")))
    finally:
        engine.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    gb = nbytes / 1e9
    note = (f"{s.sync_preset} GLM-5 preset, {nbytes / 1e6:.0f} MB fp32 state; s/GB: engine {med['engine'] / gb:.3f}, "
            f"memcpy {med['memcpy'] / gb:.3f}, disk write {med['write'] / gb:.3f} (page cache); "
            f"{s.sync_reps} alternating reps, medians")
    return [row("weight sync into the embedded engine vs memcpy", "GB/s", gb / med["engine"], gb / med["memcpy"],
                TARGETS["sync_memcpy"], note)]
