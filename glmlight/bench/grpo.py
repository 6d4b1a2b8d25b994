"""grpo: whole GRPO steps of a glmlight run vs TRL's GRPOTrainer on identical work, with a per-step
time breakdown of both sides (docs/performance.md, "Where the time goes")."""

from __future__ import annotations

import multiprocessing
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import torch

from glmlight.bench.common import TARGETS, Sizes, machine, row, smollm2_checkpoint, sync, tiny_model

# TRL at its fastest for the same work. GRPOConfig turns gradient checkpointing on by default (it
# recomputes the forward in the backward: the same gradients, ~1/3 more compute); the bench turns it
# off. Other options that were tried are in docs/performance.md.
TRL_FAST: dict[str, Any] = {"gradient_checkpointing": False}

# glmlight's variants: "sync" is on-policy like TRL (generate, then train); "async" overlaps the
# rollout of the next batch (the engine's decode thread) with the update (the trainer's thread), so
# each batch is one policy version old when trained (rollout.mode=async, max_staleness 1).
# "sync2" is "sync" with two intra-op threads (the whole 2-core machine for the one loop, as TRL's fastest
# configuration uses it): no target, for the like-for-like reading.
GLMLIGHT_VARIANTS = {"sync": ["rollout.compile=true"], "async": ["rollout.mode=async", "rollout.compile=true"]}
GLMLIGHT_VARIANTS["sync2"] = GLMLIGHT_VARIANTS["sync"]
VARIANT_THREADS = {"sync2": 2}  # intra-op threads of a variant's process; the others: the bench's --threads


def variant_overrides(v: str, s: Sizes) -> list[str]:
    """A variant's overrides for the bench's model. SmolLM2 decodes eagerly, as its recipes do: compiling
    its decode step took 436 s on the 2-core machine (docs/models.md), more than a bench run."""
    if s.grpo_model == "smollm2":
        return [o for o in GLMLIGHT_VARIANTS[v] if o != "rollout.compile=true"]
    return GLMLIGHT_VARIANTS[v]

# The parts of a glmlight step, from the metrics the run logs (glmlight/algorithms/base.py,
# glmlight/data/rollout.py, callbacks/weight_sync.py) and the bench's step stamps.
PARTS = ("rollout", "reward", "collate+wait", "old logprobs+adv", "update", "weight sync", "logging+loop")


def digit_fraction(text: str) -> float:
    """The reward of both sides: the fraction of digit characters (dense, cheap, equal work)."""
    return sum(c.isdigit() for c in text) / max(len(text), 1)


def digit_fraction_reward(sample) -> float:
    return digit_fraction(sample.metadata["completion_text"])


def _breakdown(step: float, m: dict[str, float], tokens: int) -> dict[str, float]:
    """One glmlight step split into PARTS (seconds). In async mode "rollout" and "reward" ran on the
    decode thread during the previous update; only "collate+wait" (the trainer waiting) is on the
    step's critical path, and the parts then sum to more than the step."""
    update = tokens / m["train/tokens_per_s"] if m.get("train/tokens_per_s") else 0.0
    wait, rollout, reward = m.get("rollout/wait_seconds", 0.0), m.get("rollout/seconds", 0.0), \
        m.get("rollout/reward_seconds", 0.0)
    train, weights = m.get("train/seconds", 0.0), m.get("sync/seconds", 0.0)
    return {"rollout": rollout, "reward": reward, "collate+wait": max(wait - rollout - reward, 0.0),
            "old logprobs+adv": max(train - update, 0.0), "update": update, "weight sync": weights,
            "logging+loop": max(step - wait - train - weights, 0.0), "step": step}


def peak_rss_mb() -> float:
    """This process's peak resident memory (MB): each timed run has a process of its own (`in_fresh_process`)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def bench_policy(s: Sizes, device: str) -> tuple[Any, Any]:
    """The tokenizer and policy both sides train: the GLM-5 `preset`, or SmolLM2 (`grpo_model`)."""
    if s.grpo_model != "smollm2":
        return tiny_model(s.preset, device)
    from glmlight.models.loading import load_causal_lm, load_tokenizer

    ckpt = smollm2_checkpoint()
    tok = load_tokenizer(ckpt)
    return tok, load_causal_lm(ckpt, tok).to(device)


def glmlight_steps(s: Sizes, device: str, root: str, extra: list[str]) -> tuple[list[float], list[dict[str, float]]]:
    """Step times of a glmlight run (after one warm-up step) and each step's breakdown; the process's
    peak memory rides on the last breakdown ("peak_rss_mb")."""
    import lightning.pytorch as pl

    import glmlight
    from glmlight import compose
    from glmlight.metrics import latest_metrics

    stamps: list[float] = []
    logged: list[dict[str, float]] = []

    class Stamp(pl.Callback):  # appended last: runs after WeightSync has pushed and logged
        def on_train_batch_end(self, trainer, *args: Any, **kwargs: Any) -> None:
            sync(device)
            stamps.append(time.perf_counter())
            logged.append(dict(latest_metrics(trainer)))

    model = ["model=smollm2"] if s.grpo_model == "smollm2" else [f"model.preset={s.preset}"]
    overrides = [*model, "model.warm_start.steps=0", "logger=none",
                 f"trainer.default_root_dir={root}", f"trainer.max_steps={s.steps + 1}",
                 "trainer.enable_progress_bar=false", "trainer.checkpoint_every_n_steps=0",
                 f"rollout.rollout_batch_size={s.prompts}", f"rollout.n_samples_per_prompt={s.group}",
                 f"rollout.max_new_tokens={s.completion}", "algo.lr=1e-4", f"algo.micro_batch_size={s.group * s.prompts}",
                 "~callbacks.held_out_eval", "~callbacks.sample_table",
                 "task.reward._target_=glmlight.bench.grpo.digit_fraction_reward", *extra]
    if device.startswith("cuda"):
        overrides += ["accelerator=gpu", "trainer.devices=1", "trainer.precision=32-true", f"rollout.device={device}"]
    run = glmlight.build(compose(overrides))
    run.datamodule.stop_ids = []  # exactly `completion` tokens per completion, as on the TRL side
    run.trainer.callbacks.append(Stamp())
    run.fit()
    run.datamodule.engine.close()
    steps = [b - a for a, b in zip(stamps, stamps[1:])]
    tokens = s.prompts * s.group * s.completion
    split = [_breakdown(t, m, tokens) for t, m in zip(steps, logged[1:])]
    split[-1]["peak_rss_mb"] = peak_rss_mb()
    return steps, split


def trl_steps(s: Sizes, device: str, root: str, threads: int, options: dict[str, Any] | None = None
              ) -> tuple[list[float], list[dict[str, float]]]:
    """Step times of TRL's GRPOTrainer and each step's breakdown: generation (`_generate_single_turn`),
    the rest of `_generate_and_score_completions` (reward, advantages, any old-log-prob forward) and
    the update with the rest of the step."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from glmlight.data.sources import ArithmeticTask

    tok, model = bench_policy(s, "cpu")
    source = ArithmeticTask(seed=0)
    n = s.prompts * (s.steps + 1)
    dataset = Dataset.from_dict({"prompt": [source[i].messages for i in range(n)]})
    stamps: list[float] = []
    spent: dict[str, float] = {"rollout": 0.0, "score": 0.0}
    parts: list[dict[str, float]] = []

    class Stamp(TrainerCallback):
        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            sync(device)
            stamps.append(time.perf_counter())
            parts.append(dict(spent))
            spent.update(rollout=0.0, score=0.0)

    def reward(prompts, completions, **kwargs) -> list[float]:
        return [digit_fraction(c[0]["content"] if isinstance(c, list) else c) for c in completions]

    kwargs: dict[str, Any] = dict(
        output_dir=root, per_device_train_batch_size=s.group * s.prompts, num_generations=s.group,
        max_completion_length=s.completion, generation_kwargs={"min_new_tokens": s.completion},
        temperature=1.0, top_k=0, top_p=1.0, beta=0.0, num_iterations=1, learning_rate=1e-4,
        max_steps=s.steps + 1, gradient_accumulation_steps=1, use_cpu=not device.startswith("cuda"),
        bf16=False, fp16=False, report_to="none", save_strategy="no", logging_steps=10_000,
        disable_tqdm=True, dataloader_num_workers=0, shuffle_dataset=False, seed=0)
    kwargs.update({**TRL_FAST, **(options or {})})  # TRL_FAST, then a variant's own options
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=GRPOConfig(**kwargs), train_dataset=dataset,
                          processing_class=tok, callbacks=[Stamp()])
    generate, score = trainer._generate_single_turn, trainer._generate_and_score_completions

    def timed_generate(*a: Any, **k: Any):
        t = time.perf_counter()
        try:
            return generate(*a, **k)
        finally:
            spent["rollout"] += time.perf_counter() - t

    def timed_score(*a: Any, **k: Any):
        t, before = time.perf_counter(), spent["rollout"]
        try:
            return score(*a, **k)
        finally:
            spent["score"] += time.perf_counter() - t - (spent["rollout"] - before)

    trainer._generate_single_turn, trainer._generate_and_score_completions = timed_generate, timed_score
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        trainer.train()
    finally:
        torch.set_num_threads(before)
    steps = [b - a for a, b in zip(stamps, stamps[1:])]
    split = [{"rollout": p["rollout"], "reward+adv": p["score"], "update+rest": t - p["rollout"] - p["score"],
              "step": t} for t, p in zip(steps, parts[1:])]
    split[-1]["peak_rss_mb"] = peak_rss_mb()
    return steps, split


def in_fresh_process(threads: int, fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` in a new interpreter with `threads` intra-op threads; every timed run gets its own, so
    that no run inherits what an earlier one left in the process. On the 2-core EPYC, of two bench runs, the
    one whose runs shared a process measured 12-17% longer steps on both sides (TRL 1.67 s against 1.38 s a
    step, glmlight sync 0.78 against 0.69 s, async 0.49 against 0.41 s), the ratios within 0.15 of each other."""
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=ctx, initializer=torch.set_num_threads, initargs=(threads,)) as pool:
        return pool.submit(fn, *args).result()


def run_grpo(s: Sizes, device: str, rounds: int, variants: tuple[str, ...], trl_threads: tuple[int, ...],
             trl_options: dict[str, dict[str, Any]] | None = None
             ) -> tuple[dict[str, list[float]], dict[str, list[dict[str, float]]]]:
    """Every run `rounds` times, alternating, so that they share the machine's moods. Keys: the
    glmlight variants and "trl@<threads>" (plus "<option set>@<threads>" for extra TRL option sets)."""
    threads = torch.get_num_threads()
    runs: dict[str, Callable[[str], tuple[list[float], list[dict[str, float]]]]] = {}
    for name, opts in {"trl": None, **(trl_options or {})}.items():
        for t in trl_threads:
            runs[f"{name}@{t}"] = lambda root, t=t, opts=opts: in_fresh_process(
                threads, trl_steps, s, device, root, t, opts)
    for v in variants:
        runs[v] = lambda root, v=v: in_fresh_process(VARIANT_THREADS.get(v, threads), glmlight_steps, s, device, root,
                                                     variant_overrides(v, s))
    times: dict[str, list[float]] = {k: [] for k in runs}
    parts: dict[str, list[dict[str, float]]] = {k: [] for k in runs}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for name, fn in runs.items():
                steps, split = fn(os.path.join(tmp, f"{name}_{r}"))
                times[name] += steps
                parts[name] += split
    return times, parts


def median_parts(split: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(p[k] for p in split) for k in split[0] if k != "peak_rss_mb"} if split else {}


def peak_memory(split: list[dict[str, float]]) -> float:
    """The largest peak resident memory (MB) of a run's processes."""
    return max((p["peak_rss_mb"] for p in split if "peak_rss_mb" in p), default=0.0)


def bound_rows(parts: dict[str, list[dict[str, float]]], step: dict[str, float]) -> list[dict[str, Any]]:
    """Each glmlight step against what it cannot be faster than, from the medians of its own parts:
    sync, the rollout (generation and reward) plus the update (old log-probs, advantages, optimizer
    steps); async, the longer of the two (they overlap) plus the weight sync, which neither hides; and
    async against the same bound from the parts each alone (the sync run's), which includes what running
    side by side costs them. Ratio = bound / step; the target, a step at most 10% over its bound, is a
    ratio >= 1 / 1.10."""
    rows = []
    for v in ("sync", "async"):
        med = median_parts(parts.get(v, []))
        if not med:
            continue
        rollout, update = med["rollout"] + med["reward"], med["old logprobs+adv"] + med["update"]
        bound = rollout + update if v == "sync" else max(rollout, update) + med["weight sync"]
        over = {k: med[k] for k in ("collate+wait", "logging+loop", "weight sync") if v == "sync" or k != "weight sync"}
        note = (f"{v}: rollout {rollout:.3f} s, update {update:.3f} s, weight sync {med['weight sync']:.3f} s, step "
                f"{step[v]:.3f} s (median of steps; parts' medians); the rest: "
                + ", ".join(f"{k} {x:.3f} s" for k, x in over.items()))
        what = "rollout + update" if v == "sync" else "max(rollout, update) + weight sync"
        rows.append(row(f"GRPO step, {v}: ({what}) / step", "s", bound, step[v], round(1 / 1.10, 3), note))
    alone, both = median_parts(parts.get("sync", [])), median_parts(parts.get("async", []))
    if alone and both:  # the async step against its parts each alone: as the sync run measured them
        rollout, update = alone["rollout"] + alone["reward"], alone["old logprobs+adv"] + alone["update"]
        bound = max(rollout, update) + both["weight sync"]
        note = (f"async: rollout alone {rollout:.3f} s, update alone {update:.3f} s (the sync run's parts), weight "
                f"sync {both['weight sync']:.3f} s, step {step['async']:.3f} s; run side by side the rollout took "
                f"{both['rollout'] + both['reward']:.3f} s and the update {both['old logprobs+adv'] + both['update']:.3f} s")
        rows.append(row("GRPO step, async: (max(rollout alone, update alone) + weight sync) / step", "s", bound,
                        step["async"], round(1 / 1.10, 3), note))
    return rows


def print_breakdown(parts: dict[str, list[dict[str, float]]]) -> None:
    """Median seconds per part of a step, one line per run."""
    print("\nper-step time breakdown (s, medians over the timed steps; async: rollout and reward overlap "
          "the previous update)")
    for name, split in parts.items():
        med = median_parts(split)
        if med:
            print(f"  {name:<10} " + ", ".join(f"{k} {v:.3f}" for k, v in med.items()))


def bench_grpo(s: Sizes, device: str, rounds: int = 1, variants: tuple[str, ...] = ("sync", "async", "sync2"),
               trl_threads: tuple[int, ...] | None = None, breakdown: bool = True,
               trl_variants: dict[str, dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """GRPO steps of glmlight's variants against TRL at its fastest (TRL_FAST, the fastest of
    `trl_threads` intra-op thread counts: by default 1 and 2 on CPU, with this process's count)."""
    threads, cores = torch.get_num_threads(), machine(device)["cores"] or 1
    if trl_threads is None:
        trl_threads = () if device.startswith("cuda") else (1, min(2, cores))
    if device.startswith("cuda") or threads >= 2 or cores < 2:
        variants = tuple(v for v in variants if v != "sync2")  # "sync" already runs on two threads, or cannot
    trl_threads = tuple(sorted(set(trl_threads) or {threads}))
    times, parts = run_grpo(s, device, rounds, variants, trl_threads, trl_variants)
    step = {k: statistics.median(v) for k, v in times.items()}
    completions, tokens = s.group * s.prompts, s.group * s.prompts * s.completion
    model = "SmolLM2-135M-Instruct" if s.grpo_model == "smollm2" else f"{s.preset} preset"
    work = f"{model}, {s.prompts} prompts x {s.group}, {s.completion} tokens each"
    fastest = min((k for k in step if k.startswith("trl@")), key=step.get)  # TRL_FAST at its best thread count
    base = f"baseline TRL GRPOTrainer at its fastest ({fastest.split('@')[1]} threads, no gradient checkpointing)"
    rows = []
    # On the real model the comparison is 1.5x TRL (its step is closer to the matmul bound on both sides).
    sync_target, async_target = ((TARGETS["grpo_smollm2"],) * 2 if s.grpo_model == "smollm2"
                                 else (TARGETS["grpo_sync"], TARGETS["grpo_async"]))
    for v, label, target, what in (
            ("sync", "sync", sync_target, f"on-policy, one trainer thread ({threads})"),
            ("async", "async", async_target, f"rollout overlapped with the update (decode thread 1 + "
             f"trainer {threads}), one step off-policy"),
            ("sync2", "sync, 2 threads", None, "on-policy, one trainer on 2 intra-op threads (engine and update)")):
        if v not in step:
            continue
        note = f"{work}; {label}: {what}; {base}"
        rows.append(row(f"GRPO step, {label}: completions", "completions/s", completions / step[v],
                        completions / step[fastest], target, note))
        rows.append(row(f"GRPO step, {label}: trained tokens", "tokens/s", tokens / step[v],
                        tokens / step[fastest], target, note))
    trl = ", ".join(f"{k.split('@')[1]} threads {completions / v:.1f}" for k, v in step.items() if k.startswith("trl@"))
    other = ", ".join(f"{k} {completions / v:.1f}" for k, v in step.items() if "@" in k and not k.startswith("trl@"))
    if other:  # TRL with other GRPOConfig options (--trl-variant), for comparison only
        trl += f"; other TRL options: {other}"
    for r in rows:
        r["note"] += f" (TRL completions/s: {trl}; {rounds} alternating runs x {s.steps} timed steps, medians)"
    for v in ("sync", "async"):
        if v in parts:
            rows.append(row(f"GRPO run, {v}: peak memory", "MB", peak_memory(parts[v]), peak_memory(parts[fastest]),
                            None, f"{work}; peak resident memory of each side's process (lower is better: a ratio "
                            "below 1 is glmlight holding less)"))
    rows += bound_rows(parts, step)
    if rows:  # the medians of each run's parts, for --json
        rows[0]["breakdown"] = {name: median_parts(split) for name, split in parts.items()}
    if breakdown:
        print_breakdown(parts)
    return rows
