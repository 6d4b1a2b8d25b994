"""speculative: decode tokens/s of the embedded engine with speculative rollout (rollout.speculative.depth) against
plain decoding, at the same weights in the same run, on the default run's own policy and rollouts.

The model: the default run's tiny GLM-5 with one MTP layer (`python scripts/train.py model.mtp.layers=1`), built
as that run builds it: the supervised warm start on the arithmetic task, then the MTP layer fitted on the same rows
with the main model frozen (glmlight/models/warm_start.py, model.warm_start.mtp; both cached under
.cache/glmlight of the working directory, as the run caches them). The prompts: the task's held-out sums, which
neither fit saw, sampled as the run samples (rollout.temperature, rollout.max_new_tokens, stopping at <eos>), so
the acceptance is the one a trained draft gets on new prompts. Also reports the speculative decoder's measured
costs: a draft step, a verification forward (with the acceptance), a plain decode step.
"""

from __future__ import annotations

import statistics
from typing import Any

from glmlight.bench.common import Sizes, row, timed


def bench_speculative(s: Sizes, device: str, *, depth: int = 2, prompts: int = 64) -> list[dict[str, Any]]:
    from glmlight.run import build as builder
    from glmlight.config.compose import compose
    from glmlight.engines.base import SamplingParams
    from glmlight.engines.local.engine import LocalEngine
    from glmlight.models.tokenizer import encode_chat

    cfg = compose(["model.mtp.layers=1"])
    tok = builder.model_tokenizer(cfg.model)
    _, held = builder.build_sources(cfg.task, cfg.seed)
    model = builder.build_policy(cfg, tok).eval()
    ids = [encode_chat(tok, held[i % len(held)].messages) for i in range(prompts)]
    r = cfg.rollout

    engines = {"plain": LocalEngine(model, device=device),
               "speculative": LocalEngine(model, device=device, speculative_depth=depth, speculative_auto_off=False),
               "auto": LocalEngine(model, device=device, speculative_depth=depth)}
    produced: dict[str, int] = {name: 0 for name in engines}

    def run(name: str, seed: int) -> None:
        params = SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                                max_new_tokens=r.max_new_tokens, stop_token_ids=[tok.eos_token_id], seed=seed)
        produced[name] += sum(len(g.token_ids) for g in engines[name].generate(ids, params))

    for name in engines:
        run(name, 0)  # warm-up
    before = {name: dict(e.stats()) for name, e in engines.items()}
    produced = {name: 0 for name in engines}
    times: dict[str, list[float]] = {name: [] for name in engines}
    for rep in range(s.reps):  # interleaved: every side sees the same machine load and the same seeds
        for name in engines:
            times[name].append(timed(lambda: run(name, rep + 1), device))
    stats = {name: {k: v - before[name].get(k, 0) for k, v in e.stats().items()} for name, e in engines.items()}
    spec = engines["speculative"].speculation()
    costs = dict(draft_ms=1e3 * spec.draft_s, verify_ms=1e3 * spec.verify_s)
    auto = engines["auto"].speculation()
    for e in engines.values():
        e.close()
    tps = {name: produced[name] / sum(t) for name, t in times.items()}
    median_s = {name: statistics.median(t) for name, t in times.items()}
    sp = stats["speculative"]
    accept = sp["spec_accepted"] / max(sp["spec_drafted"], 1)
    per_forward = sp["spec_decode_tokens"] / max(sp["spec_row_forwards"], 1)
    plain_ms = 1e3 * (auto.plain_s or float("nan"))
    length = produced["plain"] / (prompts * s.reps)
    note = (f"the default run's tiny GLM-5 + 1 MTP layer, both warm-started (model.warm_start, .mtp); {prompts} held-out "
            f"sums per call, temperature {r.temperature}, at most {r.max_new_tokens} new tokens (mean {length:.2f}), "
            f"depth {depth}; acceptance {accept:.3f}, {per_forward:.2f} tokens per target forward; draft step "
            f"{costs['draft_ms']:.1f} ms, verification {costs['verify_ms']:.1f} ms, plain step {plain_ms:.1f} ms; "
            f"median call: plain {median_s['plain']:.3f} s, speculative {median_s['speculative']:.3f} s")
    auto_note = (f"auto-off: speculation on in {stats['auto']['spec_on_rounds']} of "
                 f"{stats['auto']['spec_decode_rounds']} decode rounds")
    return [row("speculative rollout decode (warm-started MTP draft, forced on)", "tokens/s", tps["speculative"],
                tps["plain"], 1.5, note),
            row("speculative rollout decode, auto-off", "tokens/s", tps["auto"], tps["plain"], None, auto_note)]
