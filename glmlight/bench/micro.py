"""micro: one GRPO update's forward and backward on a mixed-length batch (one 512-token response among
31 of 16), micro-batches packed by tokens (algo.micro_batch_tokens) vs 8-row micro-batches padded to the
longest row (algo.micro_batch_size). No target."""

from __future__ import annotations

import random
import statistics
from typing import Any

import torch

from glmlight.bench.common import Sizes, row, timed, tiny_model


def bench_micro_batches(s: Sizes, device: str, long: int = 512, short: int = 16, rows: int = 32,
                        row_size: int = 8) -> list[dict[str, Any]]:
    """One GRPO update's forward and backward passes (no optimizer step) over `rows` responses, one of
    `long` tokens and the others of `short`: micro-batches by token count vs by `row_size` rows."""
    from glmlight.algorithms.grpo import GRPO, GRPOConfig
    from glmlight.models.glm5 import forward as glm_forward
    from glmlight.ops.reduce import loss_normalisers
    from glmlight.sample import Experience, Sample

    tok, policy = tiny_model(s.preset, device)
    g = random.Random(0)
    samples = []
    for i in range(rows):
        resp = [g.randrange(6, len(tok)) for _ in range(long if i == 0 else short)]
        samples.append(Sample(prompt_ids=[g.randrange(6, len(tok)) for _ in range(16)], response_ids=resp,
                              loss_mask=[1] * len(resp), rollout_logprobs=[-4.6] * len(resp),
                              versions=[0] * len(resp), reward=float(i % 2), group_id=i // 4))
    batch = Experience.collate(samples, tok.pad_token_id).to(device)
    budget = (long + 16) * 2  # the long row alone, every short row in one micro-batch
    times, counts = {}, {}
    for name, cfg in (("rows", GRPOConfig(micro_batch_size=row_size)), ("tokens", GRPOConfig(micro_batch_tokens=budget))):
        module = GRPO(cfg, policy, max_new_tokens=long, use_glm_forward=glm_forward.supports(policy)).to(device)
        module.prepare_experience(batch)
        module.compute_advantages(batch)
        scale = {**loss_normalisers(batch.loss_mask), "grad_scale": 1.0}
        micro = module.parallel.micro_batches(torch.arange(batch.batch_size), batch)
        counts[name] = len(micro)

        def step() -> None:  # what RLModule.optimizer_step does before the optimizer, without Lightning
            policy.train()
            policy.zero_grad(set_to_none=True)
            for idx in micro:
                loss, _ = module.micro_batch_loss(module.parallel.select(batch, idx), scale)
                loss.backward()

        step()  # warm-up
        times[name] = statistics.median(timed(step, device) for _ in range(max(s.reps, 1)))
    note = (f"{rows} responses: 1 x {long} + {rows - 1} x {short} tokens; {counts['rows']} micro-batches of {row_size} "
            f"rows vs {counts['tokens']} of <= {budget} tokens; forward + backward")
    return [row("micro-batches by tokens vs by rows (mixed lengths)", "updates/s", 1 / times["tokens"],
                1 / times["rows"], None, note)]
