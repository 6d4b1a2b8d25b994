"""`VLLMServer`: the adapter (glmlight/engines/servers/protocol.py) of one vLLM or vLLM-Ascend server's
OpenAI-compatible API (0.32 and 0.33; run for real on vLLM's CPU build 0.32.0).

Generation: POST /v1/completions with the prompt as token ids, `logprobs: 0` (the sampled token's
log-prob only), `return_token_ids` (choices[0].token_ids; older servers: tokens spelt
"token_id:<id>" via `return_tokens_as_token_ids`) and, on 0.33, `return_weight_versions`
(choices[0].weight_versions: the version label of every token span); with routing replay on,
`routed_experts_prompt_start: 0` (choices[0].routed_experts; `REPLAY_FIELDS`, replay.py;
vLLM returns no DSA selection, so index replay is refused). The log-probs must be those
of the distribution each token was sampled from — temperature, then top-k/top-p, renormalised:
vLLM's `--logprobs-mode processed_logprobs` (vllm/v1/sample/sampler.py and
vllm/v1/sample/ops/topk_topp_sampler.py); a managed launch sets it, and a server that reports
anything else is refused at start (`check_logprob_definition`, checks.py). Finish reasons:
stop, length, abort (a pause aborted the request: the partial answer), repetition (treated as
length), error (the request failed: FAILED). Prefill scoring: `prompt_logprobs: 0` returns, per
prompt position i > 0, a dict keyed by token id (a string) that always holds the prompt's own
token; the completion's entries start at len(prompt).

Control: /pause?mode=abort, /reset_prefix_cache (checked: {"success": true}), /resume, and the worker
extension's methods through /collective_rpc (`rpc`; the weight version every worker reports is the
server's label). /collective_rpc passes string arguments only, so each call carries one JSON string. A
500 from it ("Call to collective_rpc method failed: ...": an unknown method, a failed load) is not
retried. vLLM's API-key middleware guards /v1, /v2, /inference and /cohere paths only; the dev endpoints
are open to whoever reaches the port. While paused, vLLM 0.32 holds new requests and 0.33 answers 503
"Generation is paused": the client waits for the resume in both cases.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

from glmlight.errors import EngineError
from glmlight.engines.base import Generation, SamplingParams
from glmlight.engines.servers.http import AuthError, get_field
from glmlight.engines.servers.protocol import Answer, UpdateFailed, sampling_fields
from glmlight.engines.servers.replay import ReplayCapture, ReplayField
from glmlight.engines.servers.replay_codec import decode_vllm_routed_experts
from glmlight.engines.servers.vllm.wire import EXTENSION, FINISH_REASONS, rpc_failed, token_id, version_tuple

REPLAY_FIELDS = {  # routed experts only: vLLM returns no DSA selection (replay.py, replay_codec.py)
    "routing": ReplayField({"routed_experts_prompt_start": 0}, "routed_experts", "choices.0.routed_experts",
                           decode_vllm_routed_experts, "--enable-return-routed-experts (and Model Runner V2: "
                           "VLLM_USE_V2_MODEL_RUNNER=1)")}


@dataclass
class VLLMFleetInfo:
    """What the vLLM adapters of one fleet share: the name in messages ("vLLM" or "vLLM-Ascend"), the
    served model's name (asked of the first server once), each server's vLLM version (which request
    fields it takes) and the dtype the servers serve in (a delta sync's wire dtype)."""

    name: str = "vLLM"
    served_model: str | None = None
    versions: dict[str, tuple[int, ...]] = field(default_factory=dict)
    served_dtype: str | None = None


class VLLMServer:
    """See the module docstring. `sync_problem`: why this server cannot take weight updates (None: it can;
    `probe_sync`), `workers`: how many workers it has (the ranks of the weight-update group)."""

    health_path = "/health"

    def __init__(self, url: str, http: Any, info: VLLMFleetInfo, replay: ReplayCapture, poll_interval_s: float = 0.05):
        self.url, self.http, self.info, self.replay = url, http, info, replay
        self.poll_interval_s = poll_interval_s
        self.sync_problem: str | None = None
        self.workers = 0

    @property
    def name(self) -> str:
        return self.info.name

    # ------------------------------------------------------------------ start-up
    def read_served_model(self) -> str:
        body = self.http.run(self.http.request("/v1/models", url=self.url, method="GET"))
        return str(get_field(body, "data.0.id", self.url, "/v1/models", self.name))

    def read_version(self) -> None:
        body = self.http.run(self.http.request("/version", url=self.url, method="GET", allow_404=True))
        self.info.versions[self.url] = version_tuple((body or {}).get("version") if isinstance(body, dict) else None)

    async def probe_sync(self) -> None:
        """Find out whether this server can take weight updates (dev mode + our worker extension)."""
        try:
            results = await self.rpc("glmlight_weight_version", None, attempts=1, allow_404=True)
        except AuthError:
            raise
        except EngineError as e:
            self.sync_problem = (f"its workers lack the weight loader ({e}); start vLLM with "
                                 f"--worker-extension-cls {EXTENSION} and glmlight on its PYTHONPATH")
            return
        if results is None:
            self.sync_problem = ("it has no /collective_rpc; start it with VLLM_SERVER_DEV_MODE=1 and "
                                 f"--worker-extension-cls {EXTENSION}, or use the in-process engine")
            return
        problems = sorted({str(r["problem"]) for r in results if r.get("problem")})
        if problems:  # a worker that cannot load updates (vLLM-Ascend weights in FRACTAL_NZ)
            self.sync_problem = "; ".join(problems)
        self.workers = len(results)
        self.info.served_dtype = next((str(r["dtype"]) for r in results if r.get("dtype")), self.info.served_dtype)

    # ------------------------------------------------------------------ generation
    async def generate(self, rid: str, prompt: list[int], p: SamplingParams, route: Any = None) -> Answer:
        payload = {"model": self.info.served_model, "prompt": prompt, "max_tokens": p.max_new_tokens,
                   **sampling_fields(p), "n": 1, "stream": False, "logprobs": 0, "return_token_ids": True,
                   "return_tokens_as_token_ids": True, "request_id": rid, **self.replay.request()}
        if p.seed is not None:
            payload["seed"] = p.seed
        target = {"pool": route} if route is not None else {"url": self.url}
        url, body = await self.http.request("/v1/completions", payload, rid=rid, with_url=True,
                                            payload_for=self._with_versions(payload), **target)
        path = "/v1/completions"
        choice = get_field(body, "choices.0", url, path, self.name, dict)
        reason = choice.get("finish_reason")
        if reason not in FINISH_REASONS:
            raise EngineError(f"{self.name} server at {url} answered {path} with choices.0.finish_reason {reason!r}")
        if reason == "error":
            return Answer(Generation([], [], "error", []), url, [])
        lps = get_field(body, "choices.0.logprobs.token_logprobs", url, path, self.name, list)
        ids = choice.get("token_ids")
        if ids is None:
            tokens = get_field(body, "choices.0.logprobs.tokens", url, path, self.name, list)
            ids = [token_id(t, url) for t in tokens]
        if len(ids) != len(lps) or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in lps):
            raise EngineError(f"{self.name} server at {url} answered {path} with choices.0.token_ids and "
                              "choices.0.logprobs.token_logprobs that do not match")
        labels = [str(span.get("version")) for span in choice.get("weight_versions") or [] if isinstance(span, dict)]
        gen = Generation(token_ids=[int(i) for i in ids], logprobs=[float(x) for x in lps],
                         finish_reason=FINISH_REASONS[reason], versions=[])
        self.replay.attach(gen, choice, url, len(prompt))
        return Answer(gen, url, labels)

    def labels_answers(self) -> bool:
        return self.info.versions.get(self.url, ()) >= (0, 33)  # weight_versions: 0.33 and later

    def _with_versions(self, payload: dict) -> Any:
        """The body for one server: 0.33 reports per-span weight versions when asked (0.32 would
        ignore the field with a warning per request)."""
        versioned = {**payload, "return_weight_versions": True}
        return lambda url, rid: versioned if self.info.versions.get(url, ()) >= (0, 33) else payload

    async def score(self, rid: str, prompt: list[int], completion: list[int], route: Any = None) -> list[float]:
        if not completion:
            return []
        payload = {"model": self.info.served_model, "prompt": prompt + completion, "max_tokens": 1,
                   "temperature": 1.0, "prompt_logprobs": 0, "n": 1, "stream": False, "request_id": rid}
        target = {"pool": route} if route is not None else {"url": self.url}
        url, body = await self.http.request("/v1/completions", payload, rid=rid, with_url=True, **target)
        field_name = "choices.0.prompt_logprobs"
        entries = get_field(body, field_name, url, "/v1/completions", self.name, list)
        if len(entries) != len(prompt) + len(completion):
            raise EngineError(f"{self.name} server at {url} answered /v1/completions with {len(entries)} "
                              f"{field_name} entries, expected {len(prompt) + len(completion)}")
        out = []
        for tok, entry in zip(completion, entries[len(prompt):]):
            item = entry.get(str(tok)) if isinstance(entry, dict) else None
            if not isinstance(item, dict) or not isinstance(item.get("logprob"), (int, float)):
                raise EngineError(f"{self.name} server at {url} answered /v1/completions without {field_name} "
                                  f"for token {tok}")
            out.append(float(item["logprob"]))
        return out

    # ------------------------------------------------------------------ control
    async def pause(self) -> None:
        await self.http.request("/pause?mode=abort", None, url=self.url, expect_json=False, allow_404=True)

    async def flush(self) -> None:
        # /pause cleared the caches already (clear_cache=true); this also covers a server paused elsewhere.
        for _ in range(50):
            body = await self.http.request("/reset_prefix_cache", None, url=self.url, allow_404=True,
                                           expect_json=False)
            if body is None or not body.strip() or json.loads(body).get("success", True) is not False:
                return
            await asyncio.sleep(self.poll_interval_s)  # {"success": false}: blocks still held
        raise UpdateFailed(f"{self.name} server at {self.url} kept answering /reset_prefix_cache with success false")

    async def resume(self) -> None:
        await self.http.request("/resume", None, url=self.url, expect_json=False, allow_404=True)

    async def alive(self) -> None:
        await self.http.request(self.health_path, url=self.url, method="GET", expect_json=False, attempts=1,
                                timeout_s=10)

    async def label(self) -> str | None:
        results = await self.rpc("glmlight_weight_version", None)
        versions = {r.get("weight_version") for r in results}
        return versions.pop() if len(versions) == 1 else f"mixed {sorted(map(str, versions))}"

    async def set_label(self, version: int) -> None:
        """What 0.33 stamps on answers (weight_versions) and /weight_info reports."""
        await self.http.request("/update_weight_version", {"new_version": str(version)}, url=self.url,
                                allow_404=True, expect_json=False)

    async def rpc(self, method: str, spec: dict | None, attempts: int | None = None,
                  allow_404: bool = False) -> list | None:
        """`method(spec)` of the worker extension on every worker of this server: their results."""
        body = await self.http.request("/collective_rpc", {"method": method, "args": [] if spec is None else
                                                           [json.dumps(spec)]}, url=self.url, attempts=attempts,
                                       allow_404=allow_404, permanent=rpc_failed)
        if body is None:
            return None
        results = get_field(body, "results", self.url, "/collective_rpc", self.name, list)
        if not results or not all(isinstance(r, dict) and "weight_version" in r for r in results):
            raise EngineError(f"{self.name} server at {self.url} answered /collective_rpc {method} without "
                              "results[].weight_version")
        return results
