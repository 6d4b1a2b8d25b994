"""Speculative decoding in the embedded engine: a round over the running rows, and the rule that turns it off
when it does not pay.

A round (`Speculation.round`) drafts `depth` tokens per row with the model's MTP layer (`GlmDsaRunner.draft`),
runs the target once over the row's last sampled token and the drafts (`GlmDsaRunner.verify`) and accepts by
speculative sampling (`glmlight.ops.speculative.accept_drafts`, Leviathan et al. 2023 Algorithm 1). p and q are
the target's and the draft's distributions under the request's own temperature, top-k and top-p
(`glmlight.engines.local.sampling.processed_logprobs`, the engine's probability contract); a greedy row's are
one-hot at the argmax, so a draft is accepted iff it is the target's argmax. Every emitted token's log-prob is
the target's, from the verification forward.

Randomness: token t of a request uses column t of its three uniform streams: the engine's sampling uniforms draw
the draft of token t, `spec_uniforms[0]` its acceptance test, `spec_uniforms[1]` the residual or bonus token drawn
at t. A round's emitted tokens depend on the columns up to its last emitted token only (later drafts are
discarded with their uniforms' influence), so the next round starts on columns nothing emitted depends on.

Auto-off (`Speculation.choose`): moving averages of the per-token acceptance rate a, of the wall time of a draft
step, of a verification (with the acceptance's bookkeeping) and of a plain decode step give the speedup
`glmlight.ops.speculative.speculation_speedup` (expected tokens per round (1 - a^(K+1)) / (1 - a) per round cost,
against one token per plain step); below 0.95 speculation turns off, above 1.05 back on. While on, every
`probe_every` rounds one round decodes plainly (to keep the plain step's cost current); while off, every
`probe_every` rounds one round speculates (to keep a and the draft's cost current). Draft costs are taken from
rounds whose catch-up of the MTP layer's cache covered at most depth + 1 positions (a row's first round
catches up on its whole prompt, a prefill's cost).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
import torch.nn.functional as F

from glmlight.engines.local.batch import SLOT, STEP, RunningBatch
from glmlight.engines.local.sampling import processed_logprobs
from glmlight.ops.speculative import (accept_drafts, acceptance_estimate, invert_cdf, speculation_on,
                                      speculation_speedup)

log = logging.getLogger("glmlight.engines.local.engine")

# LocalEngine.stats() counters of speculative decoding: drafts made and accepted; over the decode rounds of the
# running rows (speculative or plain; prefills not counted): rounds, rounds with speculation on, rows times
# rounds (target forwards per row) and tokens emitted
SPEC_COUNTERS = ("spec_drafted", "spec_accepted", "spec_decode_rounds", "spec_on_rounds", "spec_row_forwards",
                 "spec_decode_tokens")


def distributions(logits: torch.Tensor, settings: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(probabilities, log-probs) [n, S, V] of the sampling distributions of logits [n, S, V] under each row's
    settings (`RunningBatch.settings`); a greedy row's probabilities are one-hot at the argmax of its log-probs
    (the token `sample_with_uniforms` takes), its log-probs those `sample_with_uniforms` reports."""
    n, S, V = logits.shape
    rep = {k: settings[k].repeat_interleave(S) for k in ("temperature", "top_k", "top_p")}
    logp = processed_logprobs(logits.reshape(n * S, V), rep["temperature"], rep["top_k"], rep["top_p"],
                              use_top_k=settings["use_top_k"], use_top_p=settings["use_top_p"],
                              order=settings["order"])
    probs = logp.exp()
    if settings["greedy"] != "none":
        onehot = F.one_hot(logp.argmax(-1), V).to(probs.dtype)
        probs = torch.where((rep["temperature"] > 0)[:, None], probs, onehot)
    return probs.view(n, S, V), logp.view(n, S, V)


class Speculation:
    """Speculative rounds of depth `depth` and their on/off rule (module docstring). `auto_off=False` speculates
    every round."""

    def __init__(self, depth: int, auto_off: bool = True, probe_every: int = 32, smoothing: float = 0.2):
        self.depth, self.auto_off, self.probe_every, self.smoothing = depth, auto_off, probe_every, smoothing
        self.on = True
        self.since_probe = 0  # rounds since the last round of the other kind
        self.passed = self.tests = 0.0  # decayed counts of acceptance tests
        self.draft_s: float | None = None  # per draft step
        self.verify_s: float | None = None
        self.plain_s: float | None = None

    # ----------------------------------------------------------------- the rule
    def choose(self) -> bool:
        """Whether the next decode round speculates."""
        if not self.auto_off:
            return True
        if self.on:
            first_plain = self.plain_s is None and self.draft_s is not None
            return not (first_plain or self.since_probe >= self.probe_every)
        return self.since_probe >= self.probe_every

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.smoothing) * old + self.smoothing * new

    def speedup(self) -> float | None:
        """The estimated tokens/s of speculative over plain decoding (None until all is measured)."""
        a = acceptance_estimate(self.passed, self.tests - self.passed)
        if a is None or None in (self.draft_s, self.verify_s, self.plain_s):
            return None
        return speculation_speedup(a, self.depth, self.draft_s, self.verify_s, self.plain_s)

    def _after_round(self, speculated: bool) -> None:
        self.since_probe = 0 if speculated != self.on else self.since_probe + 1
        speedup = self.speedup() if self.auto_off else None
        if speedup is None or speculation_on(speedup, self.on) == self.on:
            return
        self.on = not self.on
        a = acceptance_estimate(self.passed, self.tests - self.passed)
        log.info("speculative decoding %s: %.2fx plain decoding's tokens/s estimated (acceptance %.2f, depth %d; "
                 "draft step %.2f ms, verification %.2f ms, plain step %.2f ms); %s every %d rounds",
                 "on" if self.on else "off", speedup, a, self.depth, 1e3 * self.draft_s, 1e3 * self.verify_s,
                 1e3 * self.plain_s, "a plain round" if self.on else "a speculative round", self.probe_every)
        self.since_probe = 0

    def note_plain(self, seconds: float) -> None:
        """A plain decode step took `seconds`."""
        self.plain_s = self._ema(self.plain_s, seconds)
        self._after_round(False)

    # ----------------------------------------------------------------- a round
    def round(self, runner: Any, batch: RunningBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One speculative round over every row of `batch`: (tokens [n, K + 1], their target log-probs
        [n, K + 1], accepted drafts [n]); row i emits tokens[i, :accepted[i] + 1]. The caller records them and
        moves the runner's rows on by what each recorded (`GlmDsaRunner.advance`)."""
        K, dev = self.depth, batch.device
        settings = batch.settings()
        step, slot = batch.ints[:, STEP], batch.ints[:, SLOT]
        col = (step[:, None] + torch.arange(K + 1, device=dev)).clamp(max=batch.uniforms.shape[1] - 1)
        rows = slot[:, None]
        u_draft, u_accept = batch.uniforms[rows, col[:, :K]], batch.spec_uniforms[0][rows, col[:, :K]]
        u_final = batch.spec_uniforms[1][rows, col]

        def sample(logits: torch.Tensor, j: int) -> tuple[torch.Tensor, torch.Tensor]:
            q = distributions(logits[:, None], settings)[0][:, 0]
            return invert_cdf(q, u_draft[:, j]), q

        t0 = _now(dev)
        drafts, q = runner.draft(batch.last, K, sample)
        t1 = _now(dev)
        logits = runner.verify(torch.cat([batch.last[:, None], drafts], dim=1))
        p, logp = distributions(logits, settings)
        accepted, tokens = accept_drafts(p, q, drafts, u_accept, u_final)
        lps = logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        t2 = _now(dev)
        n_acc = float(accepted.sum())
        rejected = float((accepted < K).sum())
        d = 1 - self.smoothing
        self.passed, self.tests = d * self.passed + n_acc, d * self.tests + n_acc + rejected
        if runner.catchup <= K + 1:
            self.draft_s = self._ema(self.draft_s, (t1 - t0) / K)
        self.verify_s = self._ema(self.verify_s, t2 - t1)
        self._after_round(True)
        return tokens, lps, accepted


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
