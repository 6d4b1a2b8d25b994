"""Start-up checks of a server's answers.

`check_logprob_definition`: glmlight's definition of a rollout log-prob (every engine) is the
log-prob of the token under the distribution it was sampled from: softmax(logits / T) restricted to
the top-k / top-p kept set and renormalised (glmlight/engines/local/sampling.py). Two requests on a fixed
prompt tell a server that reports something else:

1. T = 1, top_k = 1: the kept set is one token, so every sampled token's log-prob must be 0.
   A server reporting unfiltered log-probs (vLLM's default raw_logprobs; SGLang's
   output_token_logprobs) reports the token's full-vocabulary log-prob instead.
2. T = 0.5: the log-prob must be the temperature-scaled one. A server reporting log-probs before
   temperature (vLLM raw_logprobs, SGLang with SGLANG_RETURN_ORIGINAL_LOGPROB=1) reports exactly the
   prefill log-probs at T = 1 (`score`) of the same tokens.

A check whose raw log-probs are all ~0 (a model that is certain of every token) cannot tell and
passes.

`check_replay_records`: with replay records asked for (`ReplayCapture.capture_replay`), one short
greedy generation on every server must come back with every record asked for, decoded for the
model's layout; a server started without the flag that returns them is refused with one line.

`verify_update`: after an update, a probe (the first prompt the engine saw, split in two) is scored
on every server; a server that acknowledged the new version but answers exactly as before, although
the weights moved by more than any server dtype's rounding, did not load them: the run stops.
"""

from __future__ import annotations

from typing import Any

import torch

from glmlight.errors import EngineError
from glmlight.engines.base import SamplingParams

PROMPT = list(range(3, 11))  # any ids inside every vocabulary
TOL = 1e-4


def check_logprob_definition(engine: Any, hint: str, filtered: Any = None) -> None:
    """Raise a one-line EngineError if `engine`'s servers report other log-probs than glmlight's.
    `filtered(error)`: whether a failed top_k=1 request may be passed over (the server then cannot
    do top-k/top-p at all, and the engine refuses such sampling itself)."""
    for url in list(engine.pool.urls):
        _check_one(engine, url, hint, filtered)


def _answer(engine: Any, url: str, params: SamplingParams) -> tuple[list[int], list[float], list[float]]:
    from glmlight.engines.servers.http import new_rid

    a = engine.http.run(_pinned(engine, url, engine._generate_one(new_rid(), PROMPT, params)))
    raw = engine.http.run(engine._score_one(new_rid(), PROMPT, a.gen.token_ids, url=url)) if a.gen.token_ids else []
    return a.gen.token_ids, a.gen.logprobs, raw


async def _pinned(engine: Any, url: str, coro: Any) -> Any:
    """Run a generation on `url` only (the pool is narrowed for the duration)."""
    saved = engine.pool.urls
    engine.pool.urls = [url]
    try:
        return await coro
    finally:
        engine.pool.urls = saved


def _check_one(engine: Any, url: str, hint: str, filtered: Any = None) -> None:
    try:
        ids, lps, raw = _answer(engine, url, SamplingParams(temperature=1.0, top_k=1, max_new_tokens=3, seed=0))
    except EngineError as e:
        if filtered is None or not filtered(e):
            raise
        ids, lps, raw = [], [], []
    informative = any(abs(r) > TOL for r in raw)
    if informative and any(abs(lp) > TOL for lp in lps):
        raise EngineError(f"{engine.name} server at {url} reports log-probs that are not those of the distribution the "
                          f"tokens were sampled from: with top_k=1 a sampled token's log-prob is 0, it reported "
                          f"{lps[0]:.6g} (the unfiltered log-prob is {raw[0]:.6g}); {hint}")
    ids, lps, raw = _answer(engine, url, SamplingParams(temperature=0.5, max_new_tokens=3, seed=0))
    if any(abs(r) > TOL for r in raw) and all(abs(a - b) <= 1e-5 for a, b in zip(lps, raw)):
        raise EngineError(f"{engine.name} server at {url} reports log-probs before temperature: at temperature 0.5 "
                          f"it reported {lps[0]:.6g}, the temperature-1 log-prob of the same token; {hint}")


def check_replay_records(engine: Any) -> None:
    """Raise a one-line EngineError unless every server answers with the records being asked for."""
    from glmlight.engines.servers.http import new_rid

    for url in list(engine.pool.urls):
        a = engine.http.run(_pinned(engine, url, engine._generate_one(
            new_rid(), PROMPT, SamplingParams(temperature=0.0, max_new_tokens=2))))
        routing, index = engine.replay_capture
        if (routing and a.gen.routed_experts is None) or (index and a.gen.indexer_topk is None):
            raise EngineError(f"{engine.name} server at {url} answered the replay probe without records "
                              f"(finish reason {a.gen.finish_reason!r})")


def verify_update(engine: Any, urls: Any, version: int, fingerprint: torch.Tensor | None) -> None:
    """See the module docstring; raises FleetFailed (and marks the engine failed)."""
    from glmlight.engines.servers.http import new_rid
    from glmlight.engines.servers.server_types import FleetFailed

    if engine._probe is None:
        return
    prompt, completion = engine._probe
    changed = moved(fingerprint, engine._fingerprint)
    scores = {u: engine.http.run(engine._score_one(new_rid(), prompt, completion, url=u)) for u in urls}
    for u in urls:
        if changed and scores[u] == engine._probe_scores.get(u):
            engine._failed = (f"{engine.name} server at {u} acknowledged weight version {version} but answers exactly "
                              "as before the update: it did not load the new weights")
            raise FleetFailed(engine._failed)
    engine._probe_scores.update(scores)
    if fingerprint is not None:
        engine._fingerprint = fingerprint


def weights_fingerprint(named: list) -> torch.Tensor:
    """Up to 64 evenly spaced values of every tensor, as float32 (cheap; enough to tell whether
    training moved the weights by more than a server's rounding)."""
    parts = []
    for _, t in named:
        flat = t.detach().reshape(-1)
        parts.append(flat[:: max(1, flat.numel() // 64)][:64].to("cpu", torch.float32))
    return torch.cat(parts) if parts else torch.zeros(0)


def moved(new: torch.Tensor | None, old: torch.Tensor | None) -> bool:
    """Whether the weights moved by more than 1% of their largest value (beyond any server dtype's
    rounding, so the outputs must change)."""
    if new is None or old is None or new.shape != old.shape or new.numel() == 0:
        return False
    return float((new - old).abs().max()) > 1e-2 * float(old.abs().max())
