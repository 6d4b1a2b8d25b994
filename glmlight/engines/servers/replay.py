"""Replay records from the servers (`algo.replay`, docs/contracts.md): the `capture_replay(routing=,
index=)` contract of the embedded engine, for the SGLang and vLLM clients (`ReplayCapture`, held by the
fleet, fleet.py, and used by every adapter).

- `layout` (a `RecordLayout`; the fleet's `record_layout`, set by `build_server_engine` from the policy): where the
  model's MoE and DSA layers sit in the servers' per-layer arrays;
- `start` (the fleet's `capture_replay`) adds to what every later request asks for, after a probe generation on every
  server (`checks.check_replay_records`) shows that each answers with records this layout
  decodes: a server started without the flag that returns them stops the run with one line naming it;
- every answer (except aborted ones, as in the embedded engine) is decoded into
  `Generation.routed_experts` / `.indexer_topk`, the layout and dtypes of the embedded engine's
  capture (`Sample`). An answer without a field it was asked for keeps None, is logged and counted
  (`num_missing`; the fleet's `num_missing_records`); the datamodule then drops its sample as
  `rollout/dropped/no_replay_records`.
  A payload that does not decode (another layout, KV-cache slot ids instead of positions) raises
  `ReplayRecordsInvalid`, which stops the run: retrying cannot fix a server's configuration.

The request fields, the answer fields and the server flags of each backend are its `REPLAY_FIELDS`
(kind -> `ReplayField`, in vllm/adapter.py and sglang/adapter.py); the formats are in `replay_codec.py`.
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
    """The replay records one fleet asks its servers for (see the module docstring), held by
    `ServerFleet` and handed to every adapter: `fields` are the backend's (kind -> `ReplayField`);
    `refuse(routing, index)` says why the backend cannot return some (None: it can)."""

    def __init__(self, name: str, fields: dict[str, ReplayField],
                 refuse: Callable[[bool, bool], str | None] | None = None):
        self.name = name
        self.fields = fields
        self.refuse = refuse or (lambda routing, index: None)
        self.layout: RecordLayout | None = None
        self.asked: tuple[bool, bool] = (False, False)  # (routing, index) asked of every request
        self.num_missing = 0
        self._strict = False  # the start-up probe: a missing field raises

    def start(self, routing: bool, index: bool, probe: Callable[[], None]) -> None:
        """Ask every request from now on for the routed experts (`routing`) and/or the DSA selection
        (`index`), prompt and response; adds to what is asked already. `probe()` then checks that every
        server answers with them (`checks.check_replay_records`). EngineError (one line) when the servers
        cannot."""
        want = (routing or self.asked[0], index or self.asked[1])
        if want == self.asked:
            return
        refused = self.refuse(*want)
        if refused:
            raise EngineError(refused)
        layout = self.layout
        if layout is None:
            raise EngineError(f"the {self.name} engine has no record layout (set engine.record_layout = "
                              "RecordLayout.from_model(policy); build_server_engine(cfg, policy) does)")
        if want[0] and not layout.moe_layers:
            raise EngineError("routing records need a model with routed MoE layers")
        if want[1] and not layout.indexer_layers:
            raise EngineError("index records need a model with DSA indexers")
        before = self.asked
        self.asked, self._strict = want, True
        try:
            probe()
        except BaseException:
            self.asked = before
            raise
        finally:
            self._strict = False

    def request(self) -> dict[str, Any]:
        """The request fields that ask for the records being captured."""
        out: dict[str, Any] = {}
        for kind, on in zip(("routing", "index"), self.asked):
            if on and kind in self.fields:
                out.update(self.fields[kind].request)
        return out

    def attach(self, gen: Generation, answer: dict, url: str, num_prompt: int) -> None:
        """Decode the records of `answer` (the dict holding the fields) into `gen` (see the module docstring)."""
        if self.asked == (False, False) or gen.finish_reason in ("abort", "error"):
            return
        num_tokens = num_prompt + len(gen.token_ids)
        for kind, on, attr in (("routing", self.asked[0], "routed_experts"),
                               ("index", self.asked[1], "indexer_topk")):
            if not on:
                continue
            f = self.fields[kind]
            payload = answer.get(f.answer)
            if payload is None:
                if self._strict:
                    raise EngineError(f"{self.name} server at {url} answered without {f.where} although asked: "
                                      f"start it with {f.server_flag}")
                self.num_missing += 1
                log.warning("%s server at %s answered without %s although asked (%d so far): the sample is dropped "
                            "(rollout/dropped/no_replay_records); is it started with %s?", self.name, url,
                            f.where, self.num_missing, f.server_flag)
                continue
            try:
                setattr(gen, attr, f.decode(payload, num_tokens, self.layout))
            except ReplayDecodeError as e:
                raise ReplayRecordsInvalid(f"{self.name} server at {url}: {e}") from None
