"""`SGLangServer`: the adapter (glmlight/engines/servers/protocol.py) of one SGLang server's native HTTP API
(written against SGLang 0.5.23's source and run against the real 0.5.23 on CPU; see docs/servers.md for
what each older release supports).

Generation: POST /generate {rid, input_ids, sampling_params, return_logprob: true}; ids from
meta_info.output_token_logprobs ([[logprob, token_id, text], ...]), the finish reason from
meta_info.finish_reason.type, the weights' version labels from meta_info.weight_versions (spans)
or meta_info.weight_version; replay records from meta_info.routed_experts / .indexer_topk
(`REPLAY_FIELDS`, replay.py). Every attempt has its own rid (`<rid>-<attempt>`): SGLang answers 400
"Duplicate request ID" while an earlier attempt is still registered (tokenizer_manager.py
`_init_req_state`).

Log-probs must be those of the distribution the token was sampled from. SGLang's
output_token_logprobs are after temperature but before top-k/top-p (srt/layers/sampler.py), so
when top_k > 0 or top_p < 1 the request also asks `return_sampling_mask: true` and the log-probs
come from meta_info.output_token_sampling_logprobs (log of the sampled token's weight over the
renormalised top-k/top-p support; SGLang's support with both on is the "joint" one,
glmlight/ops/logprobs.py, which the engine's `filter_order` declares). SGLang serves that only for
top_k == 1 or a finite 1 < top_k <= --sampling-mask-max-tokens (default 4096), so top_p < 1 without top_k
is refused at start (`check_sampling`, wire.py).

Prefill scoring (teacher log-probs): /generate with max_new_tokens 0, return_logprob and
logprob_start_len = len(prompt) - 1. input_token_logprobs are aligned with
input_ids[logprob_start_len:] and entry 0 is always None, so entry 0 is the prompt's last token
and entries 1.. are the completion's.

Control: /pause_generation {mode: abort} (in-flight requests return early with finish_reason abort),
/flush_cache, /continue_generation; the label is /model_info's weight_version.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from glmlight.errors import EngineError
from glmlight.engines.base import SamplingParams
from glmlight.engines.servers.http import Rejected, get_field
from glmlight.engines.servers.protocol import Answer, UpdateFailed, sampling_fields
from glmlight.engines.servers.replay import ReplayCapture, ReplayField
from glmlight.engines.servers.replay_codec import decode_sglang_indexer_topk, decode_sglang_routed_experts
from glmlight.engines.servers.sglang.wire import (FilteredLogprobsMissing, attempt_rid, check_sampling, pairs,
                                                  parse_generate_answer, single)

log = logging.getLogger(__name__)

REPLAY_FIELDS = {  # replay records (replay.py; formats in replay_codec.py)
    "routing": ReplayField({"return_routed_experts": True, "routed_experts_start_len": 0}, "routed_experts",
                           "meta_info.routed_experts", decode_sglang_routed_experts, "--enable-return-routed-experts"),
    "index": ReplayField({"return_indexer_topk": True}, "indexer_topk", "meta_info.indexer_topk",
                         decode_sglang_indexer_topk, "--enable-return-indexer-topk (CUDA or NPU) and "
                         "SGLANG_DSA_FUSE_TOPK=0 in its environment")}


@dataclass
class SGLangFleetInfo:
    """What the SGLang adapters of one fleet share: whether the servers report top-k/top-p log-probs
    (return_sampling_mask, SGLang 0.5.18 and later; the start-up check finds out)."""

    filtered_logprobs: bool = True


class SGLangServer:
    """See the module docstring. `initial_label`: the label it reported at start (what its start-up weights
    are loaded back under); `session`: whether it has /begin_weight_update (None: not asked yet)."""

    name = "SGLang"
    health_path = "/health_generate"

    def __init__(self, url: str, http: Any, info: SGLangFleetInfo, replay: ReplayCapture,
                 poll_interval_s: float = 0.05):
        self.url, self.http, self.info, self.replay = url, http, info, replay
        self.poll_interval_s = poll_interval_s
        self.initial_label: str | None = None
        self.session: bool | None = None
        self._tp_size: int | None = None

    # ------------------------------------------------------------------ generation
    async def generate(self, rid: str, prompt: list[int], p: SamplingParams, route: Any = None) -> Answer:
        sp = {**sampling_fields(p), "max_new_tokens": p.max_new_tokens, "no_stop_trim": True}
        if p.seed is not None:
            sp["sampling_seed"] = p.seed
        filtered = p.temperature > 0 and (p.top_k > 0 or p.top_p < 1)
        if filtered and p.top_k <= 0:
            check_sampling(p.top_p, p.top_k)
        if filtered and not self.info.filtered_logprobs:
            raise FilteredLogprobsMissing("this SGLang server cannot report top-k/top-p log-probs "
                                          "(return_sampling_mask needs SGLang 0.5.18 or later): sample with "
                                          "rollout.top_k=0 and rollout.top_p=1, or upgrade the server")

        def body(url: str, attempt_rid: str | None) -> dict:
            b = {"rid": attempt_rid, "input_ids": prompt, "sampling_params": sp, "return_logprob": True,
                 "stream": False, **self.replay.request()}
            return {**b, "return_sampling_mask": True} if filtered else b

        target = {"pool": route} if route is not None else {"url": self.url}
        url, reply = await self.http.request("/generate", None, with_url=True, rid_for=attempt_rid(rid),
                                             payload_for=body, on_retry=self._aborter, **target)
        gen, meta, labels = parse_generate_answer(single(reply), url, rid, filtered, self.name)
        self.replay.attach(gen, meta, url, len(prompt))
        return Answer(gen, url, labels)

    async def score(self, rid: str, prompt: list[int], completion: list[int], route: Any = None) -> list[float]:
        if not completion:
            return []
        payload = {"input_ids": prompt + completion, "return_logprob": True,
                   "logprob_start_len": len(prompt) - 1, "stream": False,
                   "sampling_params": {"max_new_tokens": 0, "temperature": 1.0, "skip_special_tokens": False}}
        target = {"pool": route} if route is not None else {"url": self.url}
        url, body = await self.http.request("/generate", None, with_url=True, rid_for=attempt_rid(rid),
                                            payload_for=lambda u, r: {"rid": r, **payload}, on_retry=self._aborter,
                                            **target)
        field = "meta_info.input_token_logprobs"
        entries = get_field(single(body), field, url, "/generate", self.name, list)
        if len(entries) != len(completion) + 1:
            raise EngineError(f"SGLang server at {url} answered /generate with {len(entries)} {field} entries, "
                              f"expected {len(completion) + 1} (logprob_start_len = len(prompt) - 1)")
        ids, lps = pairs(entries[1:], url, "/generate", field)
        if ids != completion:
            raise EngineError(f"SGLang server at {url} answered /generate with {field} for other tokens than sent")
        return lps

    async def _aborter(self, url: str, reason: str, attempt_rid: str | None) -> None:
        """Before a retry after a timeout, drop that attempt on the server that timed out (best effort)."""
        if reason.startswith("no answer") and attempt_rid:
            try:
                await self.http.request("/abort_request", {"rid": attempt_rid}, url=url, attempts=1, timeout_s=5,
                                        expect_json=False, allow_404=True)
            except EngineError:
                pass

    def labels_answers(self) -> bool:
        return True

    # ------------------------------------------------------------------ control
    async def pause(self) -> None:
        await self.http.request("/pause_generation", {"mode": "abort"}, url=self.url, expect_json=False,
                                allow_404=True)

    async def flush(self) -> None:
        # /flush_cache answers 400 while requests are still running; give them a moment.
        for _ in range(50):
            try:
                await self.http.request("/flush_cache", {}, url=self.url, expect_json=False)
                return
            except Rejected as e:
                if e.status != 400:
                    raise
                await asyncio.sleep(self.poll_interval_s)
        raise UpdateFailed(f"SGLang server at {self.url} kept refusing /flush_cache (requests still running after pause)")

    async def resume(self) -> None:
        await self.http.request("/continue_generation", {}, url=self.url, expect_json=False, allow_404=True)

    async def alive(self) -> None:
        """/health and /health_generate run a one-token generation, which a paused server holds: they
        answer 503 after 20 s (sglang 0.5.23 srt/entrypoints/http_server.py `health_generate`,
        HEALTH_CHECK_TIMEOUT). /model_info is answered by the HTTP process itself, paused or not."""
        await self.http.request("/model_info", url=self.url, method="GET", attempts=1, timeout_s=10, allow_404=True)

    async def label(self) -> str | None:
        for path in ("/model_info", "/get_model_info"):  # 0.5.23 has no /get_weight_version
            body = await self.http.request(path, url=self.url, method="GET", allow_404=True)
            if body is not None:
                return str(get_field(body, "weight_version", self.url, path, self.name))
        raise EngineError(f"SGLang server at {self.url} has neither /model_info nor /get_model_info")

    def server_info(self) -> Any:
        for path in ("/server_info", "/get_server_info"):
            info = self.http.run(self.http.request(path, url=self.url, method="GET", allow_404=True))
            if info is not None:
                return info
        return None

    def tp_size(self) -> int:
        if self._tp_size is None:
            self._tp_size = int((self.server_info() or {}).get("tp_size", 1))
        return self._tp_size

    async def post(self, path: str, body: Any, attempts: int | None = None) -> None:
        """POST a weight-update request; a `success: false` answer is an EngineError."""
        answer = await self.http.request(path, body, url=self.url, attempts=attempts)
        if isinstance(answer, dict) and answer.get("success") is False:
            raise EngineError(f"SGLang server at {self.url} could not {path}: {answer.get('message', '')}")
