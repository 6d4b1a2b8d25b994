"""speculative: decode tokens/s of the embedded engine with speculative rollout (rollout.speculative.depth) against
plain decoding, at the same weights in the same run.

The model: the GLM-5 `small` preset (8 decoder layers, hidden 512) with one MTP layer. A randomly initialised model
samples nearly uniformly, which no draft can predict and every draft "predicts" (p = q); its output head is
scaled (x `head_scale`) so that its samples have the low entropy of a trained model's, and the MTP layer is then
fitted to the model's own samples (`fit_steps` steps of its cross-entropy, `forward_logits_mtp`, the main model
frozen), so the acceptance rate is what a trained draft gets on its own model. Also reports the speculative
decoder's measured costs: a draft step, a verification forward (with the acceptance), a plain decode step.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from glmlight.bench.common import Sizes, row, timed


def fit_mtp(model: torch.nn.Module, seqs: torch.Tensor, steps: int, lr: float = 2e-3) -> list[float]:
    """Train the MTP layers of `model` on seqs [B, S] (their cross-entropy at temperature 1, the main model frozen);
    the losses."""
    from glmlight.models.glm5.forward import forward_logits_mtp
    from glmlight.ops.mtp import mtp_loss_terms

    params = list(model.mtp.parameters())
    opt = torch.optim.Adam(params, lr=lr)
    B, S = seqs.shape
    mask, pos = torch.ones_like(seqs), torch.arange(S).expand(B, S)
    losses = []
    for _ in range(steps):
        _, mtp = forward_logits_mtp(model, seqs, mask, pos)
        logits = mtp[0][:, 1: S - 1]  # entry i: depth 1 at position i - 1, predicting token i + 1
        keep = torch.ones(B, S - 2)
        ce, _, n = mtp_loss_terms(logits, seqs[:, 2:], keep)
        loss = ce / n
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def bench_speculative(s: Sizes, device: str, *, depth: int = 3, batch: int = 4, new_tokens: int = 128,
                      head_scale: float = 16.0, fit_steps: int = 40) -> list[dict[str, Any]]:
    from glmlight.engines.base import SamplingParams
    from glmlight.engines.local.engine import LocalEngine
    from glmlight.models.loading import load_causal_lm
    from glmlight.models.mtp import attach_mtp
    from glmlight.models.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    model = load_causal_lm(None, tok, preset="small", seed=0)
    attach_mtp(model, 1, seed=1)
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(6, len(tok), (batch, 16), generator=g).tolist()
    params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens)
    # the MTP layer's training data: the model's own samples
    with LocalEngine(model, device=device) as plain:
        train_prompts = torch.randint(6, len(tok), (16, 16), generator=g).tolist()
        gens = plain.generate(train_prompts, SamplingParams(temperature=1.0, max_new_tokens=64, seed=1))
    seqs = torch.tensor([p + x.token_ids for p, x in zip(train_prompts, gens)])
    lp = [v for x in gens for v in x.logprobs]
    entropy = -sum(lp) / len(lp)  # the mean surprisal of the samples: their entropy's estimate
    t0 = time.perf_counter()
    losses = fit_mtp(model, seqs, fit_steps)
    fit_s = time.perf_counter() - t0
    model.eval()
    engines = {"plain": LocalEngine(model, device=device),
               "speculative": LocalEngine(model, device=device, speculative_depth=depth, speculative_auto_off=False),
               "auto": LocalEngine(model, device=device, speculative_depth=depth)}

    def run(name: str) -> None:
        out = engines[name].generate(prompts, params)
        assert all(len(x.token_ids) == new_tokens for x in out)

    for name in engines:
        run(name)  # warm-up
    before = {name: dict(e.stats()) for name, e in engines.items()}
    times: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(s.reps):  # interleaved: every side sees the same machine load
        for name in engines:
            times[name].append(timed(lambda: run(name), device))
    stats = {name: {k: v - before[name].get(k, 0) for k, v in e.stats().items()} for name, e in engines.items()}
    spec = engines["speculative"].speculation()
    costs = dict(draft_ms=1e3 * spec.draft_s, verify_ms=1e3 * spec.verify_s)
    auto = engines["auto"].speculation()
    for e in engines.values():
        e.close()
    n = batch * new_tokens
    tps = {name: n / statistics.median(t) for name, t in times.items()}
    sp = stats["speculative"]
    accept = sp["spec_accepted"] / max(sp["spec_drafted"], 1)
    per_forward = sp["spec_decode_tokens"] / max(sp["spec_row_forwards"], 1)
    plain_ms = 1e3 * (auto.plain_s or float("nan"))
    note = (f"small preset (8 layers) + 1 MTP layer fitted {fit_steps} steps ({fit_s:.0f} s, loss {losses[0]:.2f} -> "
            f"{losses[-1]:.2f}); head x{head_scale}: sample entropy {entropy:.2f} nats; batch {batch}, {new_tokens} new "
            f"tokens, depth {depth}; acceptance {accept:.3f}, {per_forward:.2f} tokens per target forward; draft step "
            f"{costs['draft_ms']:.1f} ms, verification {costs['verify_ms']:.1f} ms, plain step {plain_ms:.1f} ms")
    auto_note = (f"auto-off: speculation on in {stats['auto']['spec_on_rounds']} of "
                 f"{stats['auto']['spec_decode_rounds']} decode rounds")
    return [row("speculative rollout decode (MTP draft, forced on)", "tokens/s", tps["speculative"], tps["plain"],
                1.5, note),
            row("speculative rollout decode, auto-off", "tokens/s", tps["auto"], tps["plain"], None, auto_note)]
