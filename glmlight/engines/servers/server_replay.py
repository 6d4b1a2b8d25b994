"""Replay records from the servers (`algo.replay`, docs/contracts.md): the `capture_replay(routing=,
index=)` contract of the embedded engine, for the SGLang and vLLM clients.

- `record_layout` (a `RecordLayout`, set by `build_server_engine` from the policy): where the
  model's MoE and DSA layers sit in the servers' per-layer arrays;
- `capture_replay` adds to what every later request asks for, after a probe generation on every
  server (`server_checks.check_replay_records`) shows that each answers with records this layout
  decodes: a server started without the flag that returns them stops the run with one line naming it;
- every answer (except aborted ones, as in the embedded engine) is decoded into
  `Generation.routed_experts` / `.indexer_topk`, the layout and dtypes of the embedded engine's
  capture (`Sample`). An answer without a field it was asked for keeps None, is logged and counted
  (`num_missing_records`); the datamodule then drops its sample as `rollout/dropped/no_replay_records`.
  A payload that does not decode (another layout, KV-cache slot ids instead of positions) raises
  `ReplayRecordsInvalid`, which stops the run: retrying cannot fix a server's configuration.

The request fields, the answer fields and the server flags of each backend are the engine's
`replay_fields` (kind -> `ReplayField`); the formats are in `replay_codec.py`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from glmlight.errors import EngineError
from glmlight.engines.base import Generation
from glmlight.engines.servers.replay_codec import RecordLayout, ReplayDecodeError

log = logging.getLogger(__name__)


class ReplayRecordsInvalid(EngineError):
    """A server's replay payload that does not decode for this model: the run stops."""

    fatal = True


@dataclass(frozen=True)
class ReplayField:
    """One kind of record on one backend: what the request carries, where the answer has it (a key of
    the dict handed to `records_of`), how it decodes, and what the server must be started with."""

    request: dict[str, Any]
    answer: str
    where: str  # the field's full name in the answer, for messages
    decode: Callable[[Any, int, RecordLayout], torch.Tensor]
    server_flag: str


class ReplayCapture:
    """Mixin of the server engines; see the module docstring. Subclasses set `replay_fields` and may
    refuse a kind in `_refuse_replay` (vLLM: index)."""

    name = "server"
    replay_fields: dict[str, ReplayField] = {}
    record_layout: RecordLayout | None = None
    replay_capture: tuple[bool, bool] = (False, False)  # (routing, index) asked of every request
    num_missing_records = 0
    _replay_strict = False  # the start-up probe: a missing field raises

    def capture_replay(self, routing: bool = False, index: bool = False) -> None:
        """Ask every request from now on for the routed experts (`routing`) and/or the DSA selection
        (`index`), prompt and response; adds to what is asked already. EngineError (one line) when the
        servers cannot."""
        want = (routing or self.replay_capture[0], index or self.replay_capture[1])
        if want == self.replay_capture:
            return
        refused = self._refuse_replay(*want)
        if refused:
            raise EngineError(refused)
        layout = self.record_layout
        if layout is None:
            raise EngineError(f"the {self.name} engine has no record layout (set engine.record_layout = "
                              "RecordLayout.from_model(policy); build_server_engine(cfg, policy) does)")
        if want[0] and not layout.moe_layers:
            raise EngineError("routing records need a model with routed MoE layers")
        if want[1] and not layout.indexer_layers:
            raise EngineError("index records need a model with DSA indexers")
        from glmlight.engines.servers.server_checks import check_replay_records

        before = self.replay_capture
        self.replay_capture, self._replay_strict = want, True
        try:
            check_replay_records(self)
        except BaseException:
            self.replay_capture = before
            raise
        finally:
            self._replay_strict = False

    def _refuse_replay(self, routing: bool, index: bool) -> str | None:
        """Why this backend cannot return these records (None: it can)."""
        return None

    def replay_request(self) -> dict[str, Any]:
        """The request fields that ask for the records being captured."""
        out: dict[str, Any] = {}
        for kind, on in zip(("routing", "index"), self.replay_capture):
            if on and kind in self.replay_fields:
                out.update(self.replay_fields[kind].request)
        return out

    def attach_records(self, gen: Generation, answer: dict, url: str, num_prompt: int) -> None:
        """Decode the records of `answer` (the dict holding the fields) into `gen` (see the module docstring)."""
        if self.replay_capture == (False, False) or gen.finish_reason in ("abort", "error"):
            return
        num_tokens = num_prompt + len(gen.token_ids)
        for kind, on, attr in (("routing", self.replay_capture[0], "routed_experts"),
                               ("index", self.replay_capture[1], "indexer_topk")):
            if not on:
                continue
            f = self.replay_fields[kind]
            payload = answer.get(f.answer)
            if payload is None:
                if self._replay_strict:
                    raise EngineError(f"{self.name} server at {url} answered without {f.where} although asked: "
                                      f"start it with {f.server_flag}")
                self.num_missing_records += 1
                log.warning("%s server at %s answered without %s although asked (%d so far): the sample is dropped "
                            "(rollout/dropped/no_replay_records); is it started with %s?", self.name, url,
                            f.where, self.num_missing_records, f.server_flag)
                continue
            try:
                setattr(gen, attr, f.decode(payload, num_tokens, self.record_layout))
            except ReplayDecodeError as e:
                raise ReplayRecordsInvalid(f"{self.name} server at {url}: {e}") from None
