#!/usr/bin/env python
"""Throughput of glmlight against baselines measured in the same run (docs/performance.md).

    python scripts/bench.py [--quick] [--only engine|grpo|flops] [--device cpu|cuda] [--json out.json]
                            [--threads N] [--rounds R]

engine  decode tokens/s of LocalEngine (eager, and with compile=True) vs transformers'
        `model.generate` (same tiny GLM-5, batch, prompts, exactly N new tokens on both sides,
        temperature 1). Target >= 3x.
grpo    whole GRPO steps of a glmlight run vs TRL's GRPOTrainer on identical work. Target >= 3x.
        Baseline: trl==1.16.0, which works with transformers 5.24 (pip install -e '.[bench]').
        "sync" is on-policy like TRL; "async" overlaps the next rollout with the update (2 threads);
        both with rollout.compile=true (the compile falls in the untimed first step).
flops   achieved FLOP/s of a GRPO training step of the ~50M `small` preset vs a large fp32
        torch.matmul. Target >= 50% (FLOPs counted as in `train_step_flops`).
server  rollout tokens/s through glmlight's vLLM client vs the raw HTTP API driven concurrently
        with aiohttp (the same requests, seeds included, so both sides generate the same tokens), on
        one real vLLM server glmlight launched (tiny Llama). Target >= 90%. Needs GLMLIGHT_VLLM_PYTHON
        (scripts/vllm_cpu_venv.sh builds vLLM's CPU build); skipped without it.

Figures are medians of several repetitions; ratios are glmlight / baseline. Nothing here is
asserted: on a shared machine timings move by tens of percent from run to run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

os.environ.setdefault("WANDB_MODE", "disabled")

import torch


@dataclass
class Sizes:
    preset: str = "tiny"  # engine and grpo: the tiny GLM-5; flops: the ~50M `small` preset
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


QUICK = Sizes(batch=16, prompt=16, new_tokens=64, reps=2, group=4, prompts=2, completion=32, steps=2,
              flops_batch=2, flops_seq=128, flops_steps=1, matmul_n=2048, server_prompts=16, server_tokens=64,
              server_reps=2)
TARGETS = {"engine": 3.0, "grpo": 3.0, "flops": 0.5, "server": 0.9}


# ----------------------------------------------------------------- helpers
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


def row(figure: str, unit: str, ours: float, base: float, target: float | None, note: str = "") -> dict[str, Any]:
    ratio = ours / base if base else float("nan")
    return {"figure": figure, "unit": unit, "glmlight": ours, "baseline": base, "ratio": ratio,
            "target": target, "met": None if target is None else ratio >= target, "note": note}


def tiny_model(preset: str, device: str):
    from glmlight.models.loading import load_causal_lm
    from glmlight.models.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    return tok, load_causal_lm(None, tok, preset=preset).to(device)


# ----------------------------------------------------------------- engine
def bench_engine(s: Sizes, device: str) -> list[dict[str, Any]]:
    from glmlight.rollout.base import SamplingParams
    from glmlight.rollout.local import LocalEngine

    tok, model = tiny_model(s.preset, device)
    model.eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(6, len(tok), (s.batch, s.prompt), generator=g)
    engines = {"eager": LocalEngine(model, device=device), "compiled": LocalEngine(model, device=device, compile=True)}

    def hf(n: int) -> None:
        with torch.inference_mode():
            out = model.generate(ids.to(device), attention_mask=torch.ones_like(ids).to(device), do_sample=True,
                                 temperature=1.0, top_k=0, top_p=1.0, min_new_tokens=n, max_new_tokens=n,
                                 pad_token_id=tok.pad_token_id)
        assert out.shape[1] == s.prompt + n

    def ours(name: str, n: int) -> None:
        gens = engines[name].generate(ids.tolist(), SamplingParams(temperature=1.0, max_new_tokens=n))
        assert all(len(x.token_ids) == n for x in gens)

    hf(4)  # warm-up; the compiled engine compiles its decode step here
    warm = {name: timed(lambda: ours(name, s.new_tokens), device) for name in engines}
    t_hf, t_ours = [], {name: [] for name in engines}
    for _ in range(s.reps):  # interleaved, so that all sides see the same machine load
        t_hf.append(timed(lambda: hf(s.new_tokens), device))
        for name in engines:
            t_ours[name].append(timed(lambda: ours(name, s.new_tokens), device))
    for e in engines.values():
        e.close()
    n = s.batch * s.new_tokens
    note = f"{s.preset} preset, batch {s.batch}, prompt {s.prompt}, {s.new_tokens} new tokens"
    return [row("engine decode, eager", "tokens/s", n / statistics.median(t_ours["eager"]),
                n / statistics.median(t_hf), TARGETS["engine"], note),
            row("engine decode, compile=True", "tokens/s", n / statistics.median(t_ours["compiled"]),
                n / statistics.median(t_hf), TARGETS["engine"],
                f"{note}; compile=True: the first generate (with the compile) took {warm['compiled']:.1f} s")]


# ----------------------------------------------------------------- grpo
def digit_fraction(text: str) -> float:
    """The reward of both sides: the fraction of digit characters (dense, cheap, equal work)."""
    return sum(c.isdigit() for c in text) / max(len(text), 1)


def digit_fraction_reward(sample) -> float:
    return digit_fraction(sample.metadata["completion_text"])


def _glmlight_steps(s: Sizes, device: str, root: str, extra: list[str]) -> list[float]:
    import lightning.pytorch as pl

    import glmlight
    from glmlight import compose

    stamps: list[float] = []

    class Stamp(pl.Callback):
        def on_train_batch_end(self, *args: Any, **kwargs: Any) -> None:
            sync(device)
            stamps.append(time.perf_counter())

    overrides = [f"model.preset={s.preset}", "model.warm_start.steps=0", "logger=none",
                 f"trainer.default_root_dir={root}", f"trainer.max_steps={s.steps + 1}",
                 "trainer.enable_progress_bar=false", "trainer.checkpoint_every_n_steps=0",
                 f"rollout.rollout_batch_size={s.prompts}", f"rollout.n_samples_per_prompt={s.group}",
                 f"rollout.max_new_tokens={s.completion}", "algo.lr=1e-4", f"algo.micro_batch_size={s.group * s.prompts}",
                 "~callbacks.held_out_eval", "~callbacks.sample_table",
                 "task.reward._target_=bench.digit_fraction_reward", *extra]
    if device.startswith("cuda"):
        overrides += ["accelerator=gpu", "trainer.devices=1", "trainer.precision=32-true", f"rollout.device={device}"]
    run = glmlight.build(compose(overrides))
    run.datamodule.stop_ids = []  # exactly `completion` tokens per completion, as on the TRL side
    run.trainer.callbacks.append(Stamp())
    run.fit()
    run.datamodule.engine.close()
    return [b - a for a, b in zip(stamps, stamps[1:])]


def _trl_steps(s: Sizes, device: str, root: str, threads: int) -> list[float]:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from glmlight.data.sources import ArithmeticTask

    tok, model = tiny_model(s.preset, "cpu")
    source = ArithmeticTask(seed=0)
    n = s.prompts * (s.steps + 1)
    dataset = Dataset.from_dict({"prompt": [source[i].messages for i in range(n)]})
    stamps: list[float] = []

    class Stamp(TrainerCallback):
        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            sync(device)
            stamps.append(time.perf_counter())

    def reward(prompts, completions, **kwargs) -> list[float]:
        return [digit_fraction(c[0]["content"] if isinstance(c, list) else c) for c in completions]

    cfg = GRPOConfig(output_dir=root, per_device_train_batch_size=s.group * s.prompts, num_generations=s.group,
                     max_completion_length=s.completion, generation_kwargs={"min_new_tokens": s.completion},
                     temperature=1.0, top_k=0, top_p=1.0, beta=0.0, num_iterations=1, learning_rate=1e-4,
                     max_steps=s.steps + 1, gradient_accumulation_steps=1, use_cpu=not device.startswith("cuda"),
                     bf16=False, fp16=False, report_to="none", save_strategy="no", logging_steps=10_000,
                     disable_tqdm=True, dataloader_num_workers=0, shuffle_dataset=False, seed=0)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=dataset,
                          processing_class=tok, callbacks=[Stamp()])
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        trainer.train()
    finally:
        torch.set_num_threads(before)
    return [b - a for a, b in zip(stamps, stamps[1:])]


# glmlight's variants: "sync" is on-policy like TRL (generate, then train); "async" overlaps the
# rollout of the next batch (the engine's decode thread) with the update (the trainer's thread), so
# each batch is one policy version old when trained (rollout.mode=async, max_staleness 1).
GLMLIGHT_VARIANTS = {"sync": ["rollout.compile=true"], "async": ["rollout.mode=async", "rollout.compile=true"]}


def bench_grpo(s: Sizes, device: str, rounds: int = 1, variants: tuple[str, ...] = ("sync", "async"),
               trl_threads: tuple[int, ...] | None = None) -> list[dict[str, Any]]:
    """GRPO steps of glmlight's variants against TRL at each of `trl_threads` intra-op thread counts
    (always this process's count; by default also one per core, on CPU). Rows: sync vs TRL at this
    process's thread count (what each side does with one trainer thread), async vs TRL's fastest."""
    threads = torch.get_num_threads()
    cores = machine(device)["cores"] or 1
    if trl_threads is None:
        trl_threads = () if device.startswith("cuda") else (cores,)
    trl_threads = tuple(sorted({threads, *trl_threads}))
    runs: dict[str, Callable[[str], list[float]]] = {
        f"trl@{t}": (lambda root, t=t: _trl_steps(s, device, root, t)) for t in trl_threads}
    runs.update({v: (lambda root, v=v: _glmlight_steps(s, device, root, GLMLIGHT_VARIANTS[v])) for v in variants})
    times: dict[str, list[float]] = {k: [] for k in runs}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):  # the runs alternate, so that they share the machine's moods
            for name, fn in runs.items():
                times[name] += fn(os.path.join(tmp, f"{name}_{r}"))
    step = {k: statistics.median(v) for k, v in times.items()}
    completions, tokens = s.group * s.prompts, s.group * s.prompts * s.completion
    work = f"{s.preset} preset, {s.prompts} prompts x {s.group}, {s.completion} tokens each"
    same = f"trl@{threads}"
    fastest = min((k for k in step if k.startswith("trl@")), key=step.get)
    rows = []
    if "sync" in step:
        note = f"{work}; sync: on-policy, one trainer thread ({threads}); baseline TRL GRPOTrainer, {threads} threads"
        rows.append(row("GRPO step, sync: completions", "completions/s", completions / step["sync"],
                        completions / step[same], TARGETS["grpo"], note))
        rows.append(row("GRPO step, sync: trained tokens", "tokens/s", tokens / step["sync"],
                        tokens / step[same], TARGETS["grpo"], note))
    if "async" in step:
        note = (f"{work}; async: rollout overlapped with the update (decode thread 1 + trainer {threads} threads), "
                f"one step off-policy; baseline TRL at its fastest ({fastest.split('@')[1]} threads)")
        rows.append(row("GRPO step, async: completions", "completions/s", completions / step["async"],
                        completions / step[fastest], TARGETS["grpo"], note))
        rows.append(row("GRPO step, async: trained tokens", "tokens/s", tokens / step["async"],
                        tokens / step[fastest], TARGETS["grpo"], note))
    trl = ", ".join(f"{k.split('@')[1]} threads {completions / v:.1f}" for k, v in step.items() if k.startswith("trl@"))
    for r in rows:
        r["note"] += f" (TRL completions/s: {trl})"
    return rows


# ----------------------------------------------------------------- flops
def matmul_peak(n: int, device: str, reps: int = 3) -> float:
    """FLOP/s of torch.matmul on fp32 [n, n] x [n, n] (median of `reps`)."""
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    a @ b
    return 2 * n**3 / statistics.median(timed(lambda: a @ b, device) for _ in range(reps))


def train_step_flops(model: torch.nn.Module, batch: int, seq: int, start: int = 0) -> tuple[float, dict[str, float]]:
    """FLOPs of one forward+backward over `batch` x `seq` tokens whose logits are needed at positions
    start..seq-1 only, counted from the parameters that do matmul work per token (embedding lookups
    and norm weights excluded): 6 x trained parameters (routed experts scaled by k/E), 2 x the DSA
    indexer's projections (computed without gradients), plus causal attention over the top-k selected
    keys (x3 for the backward) and the indexer's scores over every earlier key (forward only). The LM
    head and the last layer's query side (everything but its key/value projections) count only the
    queries at positions >= start: no logit depends on the others there."""
    cfg = model.config
    L, H = cfg.num_hidden_layers, cfg.num_attention_heads
    last = f"model.layers.{L - 1}."
    key_side = ("kv_a_proj_with_mqa", "kv_b_proj", "indexer.wk", "indexer.k_norm")
    k_over_e = cfg.num_experts_per_tok / cfg.n_routed_experts
    tokens, queries = batch * seq, batch * (seq - start)
    trained = indexer = active = 0.0
    for name, p in model.named_parameters():
        if p.dim() < 2 or name.endswith("embed_tokens.weight"):
            continue
        n = p.numel() * (k_over_e if ".experts." in name else 1.0)
        every = not (name.startswith("lm_head") or (name.startswith(last) and not any(k in name for k in key_side)))
        work = n * (tokens if every else queries)
        if ".indexer." in name:
            indexer += work
        else:
            trained += work
        active += n
    dk, dv = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    keys = [min(cfg.index_topk, t + 1) for t in range(seq)]  # keys attended by the query at position t
    per_pass = 3 * 2 * H * (dk + dv) * batch
    attention = per_pass * (sum(keys) * (L - 1) + sum(keys[start:]))
    seen = seq * (seq + 1) // 2  # keys the indexer scores
    full_indexer_layers = sum(t == "full" for t in cfg.indexer_types)
    index_scores = 2 * (cfg.index_n_heads * cfg.index_head_dim + cfg.index_n_heads) * seen * full_indexer_layers * batch
    parts = {"matmul_params": 6 * trained, "indexer_params": 2 * indexer, "attention": attention,
             "indexer_scores": index_scores}
    total_params = sum(p.numel() for p in model.parameters())
    return float(sum(parts.values())), {**parts, "active_params": active, "total_params": total_params}


def bench_flops(s: Sizes, device: str) -> list[dict[str, Any]]:
    from glmlight.algorithms.grpo import GRPO
    from glmlight.algorithms.grpo import GRPOConfig
    from glmlight.models.glm5 import forward as glm_forward
    from glmlight.sample import Experience, Sample

    tok, policy = tiny_model(s.flops_preset, device)
    g = random.Random(0)
    prompt_len = 32 if s.flops_seq > 64 else s.flops_seq // 2
    samples = []
    for i in range(s.flops_batch):
        resp = [g.randrange(6, len(tok)) for _ in range(s.flops_seq - prompt_len)]
        samples.append(Sample(prompt_ids=[g.randrange(6, len(tok)) for _ in range(prompt_len)], response_ids=resp,
                              loss_mask=[1] * len(resp), rollout_logprobs=[-4.6] * len(resp),
                              versions=[0] * len(resp), reward=float(i % 2), group_id=i // 2))
    batch = Experience.collate(samples, tok.pad_token_id).to(device)
    module = GRPO(GRPOConfig(micro_batch_size=s.flops_batch, lr=1e-5), policy, max_new_tokens=s.flops_seq,
                  use_glm_forward=glm_forward.supports(policy)).to(device)  # as a run's model.forward=auto
    module.prepare_experience(batch)
    module.compute_advantages(batch)
    opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-5)
    scale = {"total_tokens": float(batch.loss_mask.sum()), "num_sequences": float(batch.batch_size)}

    def step() -> None:  # what RLModule.optimizer_step does for one minibatch, without Lightning
        policy.train()
        opt.zero_grad(set_to_none=True)
        loss, _ = module.micro_batch_loss(batch, scale)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        opt.step()

    step()  # warm-up (allocates the optimizer state)
    t = statistics.median(timed(step, device) for _ in range(s.flops_steps))
    flops, parts = train_step_flops(policy, s.flops_batch, s.flops_seq, start=batch.prompt_length - 1)
    n = 2 * s.matmul_n if device.startswith("cuda") else s.matmul_n
    peak = matmul_peak(n, device)
    note = (f"{s.flops_preset}: {parts['total_params'] / 1e6:.1f}M params, {parts['active_params'] / 1e6:.1f}M active; "
            f"{s.flops_batch}x{s.flops_seq} tokens, {flops / 1e9:.0f} GFLOP/step; peak: {n}^2 fp32 matmul")
    return [row("train step FLOP/s vs matmul peak", "GFLOP/s", flops / t / 1e9, peak / 1e9, TARGETS["flops"], note)]


# ----------------------------------------------------------------- main
def print_table(info: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    gpu = f", {info['gpu']}" if "gpu" in info else ""
    print(f"\nmachine: {info['cpu']}, {info['cores']} cores, torch {info['torch']}, "
          f"{info['threads']} intra-op threads, device {info['device']}{gpu}")
    head = f"{'figure':<56} {'unit':>13} {'glmlight':>10} {'baseline':>10} {'ratio':>7} {'target':>7}  met?"
    print(head + "\n" + "-" * len(head))
    for r in rows:
        target = f"{r['target']:.2f}" if r["target"] is not None else "-"
        met = "-" if r["met"] is None else ("yes" if r["met"] else "NO")
        print(f"{r['figure']:<56} {r['unit']:>13} {r['glmlight']:>10.1f} {r['baseline']:>10.1f} "
              f"{r['ratio']:>7.2f} {target:>7}  {met}")
    notes = dict.fromkeys(r["note"] for r in rows if r["note"])
    for n in notes:
        print(f"  * {n}")


# ----------------------------------------------------------------- server
def bench_server(s: Sizes, device: str) -> list[dict[str, Any]]:
    """Rollout tokens/s of glmlight's vLLM client vs raw concurrent HTTP on one real vLLM server."""
    import asyncio

    import aiohttp

    from glmlight.config import validate
    from glmlight.models.tokenizer import build_char_tokenizer, encode_chat
    from glmlight.rollout.base import SamplingParams
    from glmlight.rollout.factory import build_server_engine
    from glmlight.rollout.servers import sampling_fields
    from glmlight.rollout.tiny_checkpoint import build_tiny_checkpoint

    root = tempfile.mkdtemp(prefix="glmlight-bench-server-")
    ckpt = build_tiny_checkpoint(os.path.join(root, "tiny-llama"), "llama", seed=0)
    flags = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "1024", "--seed", "0"]
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_NO_USAGE_STATS": "1"} if device == "cpu" else {}
    cfg = validate({"rollout": {"backend": "vllm", "server": {
        "launch": True, "launch_python": os.environ["GLMLIGHT_VLLM_PYTHON"], "launch_args": flags, "launch_env": env,
        "launch_timeout_s": 900, "api_key_env": None, "max_in_flight": 256}}, "model": {"path": ckpt},
        "trainer": {"default_root_dir": root}})
    tok = build_char_tokenizer()
    prompts = [encode_chat(tok, [{"role": "user", "content": f"{i % 10}+{i % 7}="}], add_generation_prompt=True)
               for i in range(s.server_prompts)]
    params = [SamplingParams(temperature=1.0, max_new_tokens=s.server_tokens, seed=1000 + i) for i in range(len(prompts))]
    engine = build_server_engine(cfg)
    try:
        url, model = engine.urls[0], engine.served_model

        def body(p: list[int], sp: SamplingParams) -> dict[str, Any]:  # what glmlight's client sends
            return {"model": model, "prompt": p, "max_tokens": sp.max_new_tokens, **sampling_fields(sp), "n": 1,
                    "stream": False, "logprobs": 0, "return_token_ids": True, "return_tokens_as_token_ids": True,
                    "seed": sp.seed}

        async def raw_round() -> int:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
                async def one(p, sp):
                    async with session.post(url + "/v1/completions", json=body(p, sp)) as r:
                        return len((await r.json())["choices"][0]["token_ids"])

                return sum(await asyncio.gather(*(one(p, sp) for p, sp in zip(prompts, params))))

        def ours_round() -> int:
            return sum(len(g.token_ids) for g in engine.generate(prompts, params))

        ours_round(), asyncio.run(raw_round())  # warm-up
        raw, ours = [], []
        for _ in range(s.server_reps):
            t = time.perf_counter()
            n_raw = asyncio.run(raw_round())
            raw.append(n_raw / (time.perf_counter() - t))
            t = time.perf_counter()
            n_ours = ours_round()
            ours.append(n_ours / (time.perf_counter() - t))
        if n_raw != n_ours:
            print(f"server: the two sides generated {n_ours} and {n_raw} tokens", file=sys.stderr)
    finally:
        engine.close()
    version = ".".join(map(str, engine.server_versions.get(url, ()))) or "?"
    note = (f"vLLM {version}, tiny Llama, {s.server_prompts} concurrent requests x <= {s.server_tokens} new tokens, "
            "same requests and seeds on both sides; baseline: aiohttp straight to /v1/completions")
    r = row("vLLM rollout through glmlight's client", "tokens/s", statistics.median(ours), statistics.median(raw),
            TARGETS["server"], note)
    print(f"server: glmlight {r['glmlight']:.0f} tokens/s, raw {r['baseline']:.0f} tokens/s, ratio {r['ratio']:.2f}",
          file=sys.stderr)
    return [r]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (about a minute)")
    ap.add_argument("--only", choices=["engine", "grpo", "flops", "server"], help="run one benchmark")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--json", help="also write the figures to this file")
    ap.add_argument("--threads", type=int, help="intra-op CPU threads of the process (default on CPU: 1; "
                    "on a shared machine more threads make both sides' timings depend on the neighbours' load)")
    ap.add_argument("--rounds", type=int, help="grpo: runs of every variant, alternating (default 2; quick 1)")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but torch sees no CUDA device", file=sys.stderr)
        return 2
    if args.threads or args.device == "cpu":
        torch.set_num_threads(args.threads or 1)
    sizes = QUICK if args.quick else Sizes()
    info = machine(args.device)
    rows: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    if args.only in (None, "engine"):
        rows += bench_engine(sizes, args.device)
    if args.only in (None, "grpo"):
        try:
            import trl  # noqa: F401
        except ImportError:
            print("grpo: skipped (TRL is not installed: pip install 'trl==1.16.0')", file=sys.stderr)
        else:
            rows += bench_grpo(sizes, args.device, args.rounds or (1 if args.quick else 2))
    if args.only in (None, "flops"):
        rows += bench_flops(sizes, args.device)
    if args.only in (None, "server"):
        if not os.environ.get("GLMLIGHT_VLLM_PYTHON"):
            print("server: skipped (set GLMLIGHT_VLLM_PYTHON to a Python with vLLM: scripts/vllm_cpu_venv.sh)",
                  file=sys.stderr)
        else:
            rows += bench_server(sizes, args.device)
    print_table(info, rows)
    print(f"({time.perf_counter() - t0:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "sizes": asdict(sizes), "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
