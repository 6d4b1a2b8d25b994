"""Engine calls that survive faults: retries with exponential backoff, then a counted failure.

A generation that still fails after the retries is reported as None, and the
caller turns its samples into FAILED ones (counted, never trained on). Retrying
a whole batch never duplicates samples: results are only used from the call that
succeeded. An error whose class sets `fatal = True` (a refused API key, a fleet left
at different weight versions) is not retried: it stops the run.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Any

from glmlight.engines.base import Generation, RolloutEngine, SamplingParams

log = logging.getLogger(__name__)


def generate_with_retries(engine: RolloutEngine, prompts: list[list[int]], params: list[SamplingParams],
                          counts: Counter, retries: int = 3, backoff_s: float = 0.5,
                          vocab_size: int | None = None) -> list[Generation | None]:
    """engine.generate with retries; None for every prompt if all attempts fail.

    With `vocab_size`, a generation holding token ids outside [0, vocab_size) is None too
    (counted as invalid_tokens): an engine answer that cannot be trained on."""
    if not prompts:
        return []
    for attempt in range(retries + 1):
        try:
            gens = engine.generate(prompts, params)
            if len(gens) != len(prompts):
                raise RuntimeError(f"engine returned {len(gens)} generations for {len(prompts)} prompts")
            break
        except Exception as e:  # noqa: BLE001 - engine faults are retried, then counted
            if getattr(e, "fatal", False):
                raise
            counts["engine_errors"] += 1
            if attempt == retries:
                log.error("engine failed %d times (%s: %s); %d samples marked FAILED", retries + 1,
                          type(e).__name__, e, len(prompts))
                return [None] * len(prompts)
            delay = backoff_s * 2**attempt
            log.warning("engine error (%s: %s); retry %d/%d in %.1fs", type(e).__name__, e, attempt + 1, retries,
                        delay)
            time.sleep(delay)
    return [_checked(g, vocab_size, counts) for g in gens]


def _checked(g: Generation, vocab_size: int | None, counts: Counter) -> Generation | None:
    if vocab_size is not None and any(t < 0 or t >= vocab_size for t in g.token_ids):
        bad = next(t for t in g.token_ids if t < 0 or t >= vocab_size)
        counts["invalid_tokens"] += 1
        log.warning("engine returned token id %d outside the vocabulary (size %d); sample FAILED", bad, vocab_size)
        return None
    return g


class RetryingEngine:
    """Wraps an engine so that `generate` retries and never raises: failed entries come back as
    aborted empty generations with `failed=True` in place (used by the agent loop)."""

    def __init__(self, engine: RolloutEngine, counts: Counter, retries: int, backoff_s: float,
                 vocab_size: int | None):
        self.engine, self.counts, self.retries, self.backoff_s = engine, counts, retries, backoff_s
        self.vocab_size = vocab_size

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def generate(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[Generation]:
        out = generate_with_retries(self.engine, prompts, params, self.counts, self.retries, self.backoff_s,
                                    self.vocab_size)
        return [g if g is not None else Generation([], [], "error", []) for g in out]
