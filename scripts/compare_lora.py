#!/usr/bin/env python
"""Memory and step time of LoRA against full fine-tuning, one GRPO run each, same config otherwise.

    python scripts/compare_lora.py                                   # tiny GLM-5 `small` preset (50M), rank 8
    python scripts/compare_lora.py --rank 16 -- model.preset=tiny     # extra overrides after --
    python scripts/compare_lora.py --rank 16 --steps 5 --lora-override algo.lr=2e-4 -- experiment=smollm2_grpo

Each run is its own process (so its peak resident memory is its own): `trainer.max_steps` RL steps of
the default GRPO run without warm start, evaluation, sample tables or export. Printed per run: trainable
parameters, their gradients and Adam moments (MB), peak resident memory of the process (MB) and the
median wall time of an RL step (rollout + update + sync) and of its update alone (`train/seconds`: old
log-probs, advantages, forward and backward, optimizer step), which does not depend on how long the
answers the run happens to sample are.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def _child(overrides: list[str]) -> None:
    import resource

    import lightning.pytorch as pl

    import glmlight

    class StepTimer(pl.Callback):
        def __init__(self):
            self.times: list[float] = []
            self._t0 = 0.0

        def on_train_batch_start(self, *args):
            self._t0 = time.perf_counter()

        def on_train_batch_end(self, *args):
            self.times.append(time.perf_counter() - self._t0)

    cfg = glmlight.compose(overrides)
    run = glmlight.build(cfg)
    timer = StepTimer()
    run.trainer.callbacks.append(timer)
    run.fit()
    params = [p for p in run.module.policy.parameters() if p.requires_grad]
    opt = run.trainer.optimizers[0]
    state_bytes = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                      if hasattr(t, "numel") and t.dim() > 0)
    print(json.dumps({
        "trainable": sum(p.numel() for p in params),
        "total": sum(p.numel() for p in run.module.policy.parameters()),
        "grads_and_adam_mb": (state_bytes + sum(p.numel() * p.element_size() for p in params)) / 2**20,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "step_s": statistics.median(timer.times[1:] or timer.times),
        "update_s": statistics.median(_metric(run.trainer.default_root_dir, "train/seconds")[1:] or [float("nan")]),
    }))


def _metric(root: str, key: str) -> list[float]:
    """The values of `key` in the run's metrics.jsonl, by RL step."""
    out = {}
    path = os.path.join(root, "metrics.jsonl")
    if os.path.isfile(path):
        with open(path) as f:
            for line in f:
                m = json.loads(line)
                if key in m:
                    out[m["rl_step"]] = m[key]
    return [out[k] for k in sorted(out)]


def main(argv: list[str]) -> int:
    if argv[:1] == ["--child"]:
        _child(argv[1:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--root", default="runs/compare_lora")
    parser.add_argument("--lora-override", action="append", default=[],
                        help="an override for the LoRA run only (e.g. its own algo.lr); repeatable")
    args, extra = parser.parse_known_args(argv)
    extra = [a for a in extra if a != "--"]
    base = ["model.preset=small", "model.warm_start.steps=0", "logger=none", "trainer.enable_progress_bar=false",
            f"trainer.max_steps={args.steps}", "~callbacks.held_out_eval", "~callbacks.sample_table",
            "export.enabled=false", *extra]
    rows = {}
    for name, more in (("full", []), (f"lora r={args.rank}", [f"model.lora.rank={args.rank}", *args.lora_override])):
        cmd = [sys.executable, os.path.abspath(__file__), "--child", *base, *more,
               f"trainer.default_root_dir={os.path.join(args.root, name.split()[0])}"]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        rows[name] = json.loads(out.strip().splitlines()[-1])
    print("| run | trainable params | grads + Adam moments | peak RSS | s / RL step | s / update |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, r in rows.items():
        print(f"| {name} | {r['trainable']:,} of {r['total']:,} | {r['grads_and_adam_mb']:.1f} MB | "
              f"{r['peak_rss_mb']:.0f} MB | {r['step_s']:.2f} | {r['update_s']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
