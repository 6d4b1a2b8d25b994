"""flops: achieved FLOP/s of a GRPO training step vs a large fp32 torch.matmul measured in the same run."""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

import torch

from glmlight.bench.common import TARGETS, Sizes, row, sync, timed, tiny_model


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
    from glmlight.algorithms.grpo import GRPO, GRPOConfig
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
    opt = module.make_optimizer(policy, 1e-5)["optimizer"]  # the optimizer a run trains with
    scale = {"total_tokens": float(batch.loss_mask.sum()), "num_sequences": float(batch.batch_size)}

    spent: dict[str, list[float]] = {"fwd+bwd": [], "clip": [], "AdamW": []}

    def step() -> None:  # what RLModule.optimizer_step does for one minibatch, without Lightning
        policy.train()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss, _ = module.micro_batch_loss(batch, scale)
        loss.backward()
        sync(device)
        t1 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        sync(device)
        t2 = time.perf_counter()
        opt.step()
        sync(device)
        for k, dt in zip(spent, (t1 - t0, t2 - t1, time.perf_counter() - t2)):
            spent[k].append(dt)

    step()  # warm-up (allocates the optimizer state)
    for v in spent.values():
        v.clear()
    n = 2 * s.matmul_n if device.startswith("cuda") else s.matmul_n
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    a @ b
    steps, peaks = [], []
    for _ in range(s.flops_steps):  # alternating with the matmul, so that both see the same machine
        steps.append(timed(step, device))
        peaks.append(2 * n**3 / timed(lambda: a @ b, device))
    t, peak = statistics.median(steps), statistics.median(peaks)
    flops, parts = train_step_flops(policy, s.flops_batch, s.flops_seq, start=batch.prompt_length - 1)
    note = (f"{s.flops_preset}: {parts['total_params'] / 1e6:.1f}M params, {parts['active_params'] / 1e6:.1f}M active; "
            f"{s.flops_batch}x{s.flops_seq} tokens, {flops / 1e9:.0f} GFLOP/step; peak: {n}^2 fp32 matmul; step "
            f"{t:.2f} s: " + ", ".join(f"{k} {statistics.median(v):.3f} s" for k, v in spent.items()))
    return [row("train step FLOP/s vs matmul peak", "GFLOP/s", flops / t / 1e9, peak / 1e9, TARGETS["flops"], note)]

