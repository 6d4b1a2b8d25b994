#!/usr/bin/env python
"""How much the warm start's result depends on the machine: the same warm start under several CPU
kernel sets (ATEN_CPU_CAPABILITY: default, avx2, avx512) and thread counts, each from scratch (a
private cache), then the held-out evaluation of the warm-started policy (before any RL step).

    python scripts/warm_start_spread.py                                   # the default run's warm start
    python scripts/warm_start_spread.py --kernels default,avx2 --threads 1,2 -- model.warm_start.lr_schedule=constant
    python scripts/warm_start_spread.py -- task=calculator_agent

Prints one JSON line per setting (kernel set, threads, greedy pass rate, pass@1, final loss, seconds)
and the spread of the greedy pass rate. Everything after `--` is a Hydra override of conf/train.yaml.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def child(overrides: list[str], threads: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    import glmlight

    with tempfile.TemporaryDirectory() as cache:
        t0 = time.perf_counter()
        run = glmlight.build(glmlight.compose(["logger=none", "trainer.enable_progress_bar=false",
                                               f"model.warm_start.cache_dir={cache}", *overrides]))
        seconds = time.perf_counter() - t0
        try:
            m = run.datamodule.evaluate()
        finally:
            run.close()
        info = {}
        for name in os.listdir(cache):
            if name.endswith(".json"):
                with open(os.path.join(cache, name)) as f:
                    info = json.load(f)
    return {"kernels": torch.backends.cpu.get_cpu_capability(), "threads": threads,
            "greedy_pass_rate": m.get("eval/heldout/greedy/pass_rate"), "pass@1": m.get("eval/heldout/pass@1"),
            "final_loss": info.get("final_loss"), "warm_start_seconds": round(seconds, 1)}


def main(argv: list[str]) -> int:
    if "--" in argv:
        i = argv.index("--")
        argv, overrides = argv[:i], argv[i + 1:]
    else:
        overrides = []
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", default="default,avx2,avx512", help="ATEN_CPU_CAPABILITY values, comma-separated")
    ap.add_argument("--threads", default="1,2", help="torch thread counts, comma-separated")
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child is not None:
        print(json.dumps(child(overrides, args.child)))
        return 0
    rows = []
    for kernels in args.kernels.split(","):
        for threads in args.threads.split(","):
            env = {**os.environ, "ATEN_CPU_CAPABILITY": kernels}
            out = subprocess.run([sys.executable, __file__, "--child", threads, "--", *overrides], env=env,
                                 capture_output=True, text=True)
            if out.returncode != 0:
                print(f"{kernels}/{threads} threads failed:\n{out.stderr[-2000:]}", file=sys.stderr)
                return 1
            row = json.loads(out.stdout.strip().splitlines()[-1])
            row["requested_kernels"] = kernels
            rows.append(row)
            print(json.dumps(row), flush=True)
    rates = [r["greedy_pass_rate"] for r in rows if r["greedy_pass_rate"] is not None]
    if rates:
        print(json.dumps({"greedy_pass_rate_min": min(rates), "greedy_pass_rate_max": max(rates),
                          "settings": len(rates), "overrides": overrides}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
