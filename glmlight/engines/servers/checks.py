"""Checks of a fleet's servers, at start-up and after each update (functions and objects the fleet,
fleet.py, calls and holds; they reach the servers through their adapters, protocol.py).

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

`check_replay_records`: with replay records asked for (`ReplayCapture.start`), one short
greedy generation on every server must come back with every record asked for, decoded for the
model's layout; a server started without the flag that returns them is refused with one line.

`UpdateProbe.verify`: after an update, a probe (the first prompt the engine saw, split in two) is scored
on every server; a server that acknowledged the new version but answers exactly as before, although
the weights moved by more than any server dtype's rounding, did not load them: the run stops.

`ServedShapes.check`: before any server is touched, the new tensors must have the served model's shapes.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from glmlight.errors import EngineError
from glmlight.engines.base import SamplingParams
PROMPT = list(range(3, 11))  # any ids inside every vocabulary
TOL = 1e-4


def check_logprob_definition(servers: Sequence[Any], http: Any, name: str, hint: str,
                             filtered: Callable[[EngineError], bool] | None = None) -> None:
    """Raise a one-line EngineError if the `servers` (adapters) report other log-probs than glmlight's.
    `filtered(error)`: whether a failed top_k=1 request may be passed over (the server then cannot
    do top-k/top-p at all, and the engine refuses such sampling itself)."""
    for server in servers:
        _check_one(server, http, name, hint, filtered)


def _answer(server: Any, http: Any, params: SamplingParams) -> tuple[list[int], list[float], list[float]]:
    from glmlight.engines.servers.http import new_rid

    a = http.run(server.generate(new_rid(), PROMPT, params))
    raw = http.run(server.score(new_rid(), PROMPT, a.gen.token_ids)) if a.gen.token_ids else []
    return a.gen.token_ids, a.gen.logprobs, raw


def _check_one(server: Any, http: Any, name: str, hint: str, filtered: Any = None) -> None:
    url = server.url
    try:
        ids, lps, raw = _answer(server, http, SamplingParams(temperature=1.0, top_k=1, max_new_tokens=3, seed=0))
    except EngineError as e:
        if filtered is None or not filtered(e):
            raise
        ids, lps, raw = [], [], []
    informative = any(abs(r) > TOL for r in raw)
    if informative and any(abs(lp) > TOL for lp in lps):
        raise EngineError(f"{name} server at {url} reports log-probs that are not those of the distribution the "
                          f"tokens were sampled from: with top_k=1 a sampled token's log-prob is 0, it reported "
                          f"{lps[0]:.6g} (the unfiltered log-prob is {raw[0]:.6g}); {hint}")
    ids, lps, raw = _answer(server, http, SamplingParams(temperature=0.5, max_new_tokens=3, seed=0))
    if any(abs(r) > TOL for r in raw) and all(abs(a - b) <= 1e-5 for a, b in zip(lps, raw)):
        raise EngineError(f"{name} server at {url} reports log-probs before temperature: at temperature 0.5 "
                          f"it reported {lps[0]:.6g}, the temperature-1 log-prob of the same token; {hint}")


def check_replay_records(servers: Sequence[Any], http: Any, name: str, asked: tuple[bool, bool]) -> None:
    """Raise a one-line EngineError unless every server answers with the records being asked for."""
    from glmlight.engines.servers.http import new_rid

    for server in servers:
        a = http.run(server.generate(new_rid(), PROMPT, SamplingParams(temperature=0.0, max_new_tokens=2)))
        routing, index = asked
        if (routing and a.gen.routed_experts is None) or (index and a.gen.indexer_topk is None):
            raise EngineError(f"{name} server at {server.url} answered the replay probe without records "
                              f"(finish reason {a.gen.finish_reason!r})")


class UpdateProbe:
    """The probe of `verify` (see the module docstring): the first prompt the fleet saw, split in two, the
    scores each server gave it after the last update, and the fingerprint of the weights they came from."""

    def __init__(self) -> None:
        self.probe: tuple[list[int], list[int]] | None = None
        self.scores: dict[str, list[float]] = {}
        self.fingerprint: torch.Tensor | None = None

    def remember(self, prompt: list[int]) -> None:
        if self.probe is None and len(prompt) >= 4:
            cut = max(1, len(prompt) // 2)
            self.probe = (list(prompt[:cut]), list(prompt[cut:]))

    def verify(self, servers: Sequence[Any], http: Any, name: str, version: int,
               fingerprint: torch.Tensor | None) -> str | None:
        """Why a server did not load `version` (None: every server did, or it cannot be told)."""
        from glmlight.engines.servers.http import new_rid

        if self.probe is None:
            return None
        prompt, completion = self.probe
        changed = moved(fingerprint, self.fingerprint)
        scores = {s.url: http.run(s.score(new_rid(), prompt, completion)) for s in servers}
        for u in scores:
            if changed and scores[u] == self.scores.get(u):
                return (f"{name} server at {u} acknowledged weight version {version} but answers exactly "
                        "as before the update: it did not load the new weights")
        self.scores.update(scores)
        if fingerprint is not None:
            self.fingerprint = fingerprint
        return None


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


class ServedShapes:
    """The shape of every tensor the servers serve: the checkpoint they started from (`model_path`, read
    at the first update) and every update since."""

    def __init__(self, model_path: str | None):
        self.model_path = model_path
        self._shapes: dict[str, tuple[int, ...]] | None = None

    def check(self, named: list, name: str, version: int, current: int) -> None:
        """Refuse, before any server is touched, a tensor whose shape differs from the served model's. A
        server may not refuse it itself: SGLang 0.5.23 on CPU answered a q_proj one row short with success
        and served it (tests/integration/servers/test_real_servers.py)."""
        if self._shapes is None:
            self._shapes = checkpoint_shapes(self.model_path)
        for tensor_name, t in named:
            want = self._shapes.get(tensor_name)
            if want is not None and tuple(t.shape) != want:
                raise EngineError(f"{name}: weight update to version {version} refused: tensor {tensor_name} has the "
                                  f"wrong shape {list(t.shape)}, the served model's is {list(want)}; every server "
                                  f"still serves version {current}")
        self._shapes.update({tensor_name: tuple(t.shape) for tensor_name, t in named})


def checkpoint_shapes(path: str | None) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape from the safetensors headers of a local checkpoint directory ({} when
    there is none here, e.g. a server's own path on another host; a file that cannot be read is left out)."""
    from safetensors import SafetensorError

    from glmlight.engines.servers.worker.checks import checkpoint_shapes as file_shapes

    shapes: dict[str, tuple[int, ...]] = {}
    for f in sorted(glob.glob(os.path.join(path, "*.safetensors"))) if path and os.path.isdir(path) else []:
        try:
            shapes.update(file_shapes(f))
        except (OSError, ValueError, SafetensorError):
            continue
    return shapes
