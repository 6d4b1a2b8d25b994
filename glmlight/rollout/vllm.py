"""vLLM and vLLM-Ascend engines: the RolloutEngine protocol over vLLM's OpenAI-compatible server,
or over an in-process `vllm.LLM`.

Server (`VLLMEngine`): POST /v1/completions with the prompt as token ids, `logprobs: 0`
(vLLM then returns the sampled token's log-prob and no alternatives),
`return_token_ids` (choices[0].token_ids; older servers: `return_tokens_as_token_ids`,
tokens spelt "token_id:<id>"). vLLM reports raw log-probs unless the server runs with
`--logprobs-mode processed_logprobs`, which matches the embedded engine's definition.
Prefill scoring: `prompt_logprobs: 0` returns, per prompt position i > 0, a dict keyed by
token id (as a string) that always holds the prompt's own token; the completion's entries
start at len(prompt).

Weight sync uses vLLM's dev-mode endpoints (VLLM_SERVER_DEV_MODE=1) and the worker
extension `glmlight.rollout.vllm_worker.WeightLoaderExtension`
(`--worker-extension-cls`): /pause?mode=abort → POST /collective_rpc (load) →
/reset_prefix_cache → /resume, then /collective_rpc `glmlight_weight_version` until every
worker reports the new version. Both are detected at start; without them update_weights
raises a one-line EngineError saying what to add. /collective_rpc passes string
arguments only, so each call carries one JSON string (see vllm_worker.py). Note: vLLM's
API-key middleware guards /v1 paths only; the dev endpoints are open to whoever reaches
the port.

In-process (`VLLMInProcessEngine`): `vllm.LLM(..., worker_extension_cls=...)` and
`LLM.collective_rpc`; vllm is imported lazily and only there.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from glmlight.dtypes import dtype_name
from glmlight.errors import EngineError
from glmlight.rollout import transport as wt
from glmlight.rollout.base import SERVER_FINISH_REASONS, Generation, NamedTensors, SamplingParams
from glmlight.rollout.http import AuthError, get_field
from glmlight.rollout.launch import LaunchSpec, free_port, launch_target, local_ip_towards, log_path_for
from glmlight.rollout.servers import ServerEngineBase, sampling_fields, server_settings

log = logging.getLogger(__name__)
EXTENSION = "glmlight.rollout.vllm_worker.WeightLoaderExtension"

# rollout=vllm_ascend: the same HTTP protocol; installing vllm-ascend registers the NPU platform
# with vLLM, so no device flag is needed. What changes for us (mirrored in conf/rollout/vllm_ascend.yaml):
ASCEND_OPTIONS: dict[str, Any] = {
    "device": "npu",  # chosen by the vllm-ascend platform plugin; logged, never passed as a flag
    "sync_backend": "hccl",  # the weight-update process group on NPUs
    # set for a managed or in-process engine unless already set; torch_npu cannot be
    # re-initialised in forked children, hence spawn
    "env": {"VLLM_USE_V1": "1", "VLLM_WORKER_MULTIPROC_METHOD": "spawn"},
    # inherited unchanged by a managed server: device visibility and HCCL networking
    "passthrough_env": ("ASCEND_RT_VISIBLE_DEVICES", "HCCL_IF_IP", "HCCL_SOCKET_IFNAME", "HCCL_CONNECT_TIMEOUT"),
    "llm_kwargs": {"distributed_executor_backend": "mp"},
}


class VLLMEngine(ServerEngineBase):
    name = "vLLM"
    health_path = "/health"

    def __init__(self, urls: Sequence[str] = (), *, weight_sync: str = "disk",
                 weight_sync_dir: str = ".cache/glmlight/weights", model_path: str | None = None,
                 served_model: str | None = None, sync_backend: str = "nccl", sync_master_address: str | None = None,
                 bucket_bytes: int = 1 << 28, keep_checkpoints: int = 2, ascend: bool = False, **kwargs: Any):
        self.name = "vLLM-Ascend" if ascend else "vLLM"
        self.weight_sync, self.weight_sync_dir, self.model_path = weight_sync, weight_sync_dir, model_path
        self.served_model = served_model
        self.sync_backend, self.sync_master_address = sync_backend, sync_master_address
        self.bucket_bytes, self.keep_checkpoints = bucket_bytes, keep_checkpoints
        self._sync_problem: dict[str, str] = {}
        self._workers: dict[str, int] = {}
        self._group: Any = None
        self._group_name = f"glmlight-{os.urandom(6).hex()}"
        if ascend:
            log.info("vLLM-Ascend engine: device %s, weight-sync backend %s", ASCEND_OPTIONS["device"], sync_backend)
        super().__init__(urls, **kwargs)

    @classmethod
    def from_config(cls, cfg: Any) -> VLLMEngine:
        s, kw = cfg.rollout.server, server_settings(cfg)
        ascend = cfg.rollout.backend == "vllm_ascend"
        launch = None
        if s.launch:
            host, port = launch_target(s.urls)
            base = list(s.launch_command or [sys.executable, "-m", "vllm.entrypoints.openai.api_server"])
            cmd = base + ["--model", kw["model_path"], "--host", host, "--port", str(port)]
            if "--worker-extension-cls" not in s.launch_args:
                cmd += ["--worker-extension-cls", EXTENSION]
            env = {"VLLM_SERVER_DEV_MODE": "1"}
            key = kw["http"].api_key_env and os.environ.get(kw["http"].api_key_env)
            if key:
                env["VLLM_API_KEY"] = key  # read by vLLM at start; kept off the command line
            if ascend:
                env.update({k: v for k, v in ASCEND_OPTIONS["env"].items() if k not in os.environ})
                env.update({k: os.environ[k] for k in ASCEND_OPTIONS["passthrough_env"] if k in os.environ})
            launch = LaunchSpec("vLLM", cmd + list(s.launch_args), host, port,
                                log_path_for(cfg, cfg.rollout.backend, port), env=env, secrets=(key,) if key else ())
        backend = s.sync_backend or (ASCEND_OPTIONS["sync_backend"] if ascend else "nccl")
        return cls(launch=launch, ascend=ascend, sync_backend=backend,
                   sync_master_address=s.sync_master_address, **kw)

    def _after_ready(self) -> None:
        if self.served_model is None:
            body = self.http.run(self.http.request("/v1/models", url=self.urls[0], method="GET"))
            self.served_model = str(get_field(body, "data.0.id", self.urls[0], "/v1/models", self.name))
        for url in (self.control_urls() if not self.router or len(self.urls) > 1 else []):
            self.http.run(self._probe_sync(url))

    async def _probe_sync(self, url: str) -> None:
        """Find out whether this server can take weight updates (dev mode + our worker extension)."""
        try:
            results = await self._rpc(url, "glmlight_weight_version", None, attempts=1, allow_404=True)
        except AuthError:
            raise
        except EngineError as e:
            self._sync_problem[url] = (f"its workers lack the weight loader ({e}); start vLLM with "
                                       f"--worker-extension-cls {EXTENSION}")
            return
        if results is None:
            self._sync_problem[url] = ("it has no /collective_rpc; start it with VLLM_SERVER_DEV_MODE=1 and "
                                       f"--worker-extension-cls {EXTENSION}, or use the in-process engine")
            return
        self._workers[url] = len(results)

    # ------------------------------------------------------------------ generation
    async def _generate_one(self, rid: str, prompt: list[int], p: SamplingParams, version: int) -> Generation:
        payload = {"model": self.served_model, "prompt": prompt, "max_tokens": p.max_new_tokens, **sampling_fields(p),
                   "n": 1, "stream": False, "logprobs": 0, "return_token_ids": True,
                   "return_tokens_as_token_ids": True, "request_id": rid}
        if p.seed is not None:
            payload["seed"] = p.seed
        url, body = await self.http.request("/v1/completions", payload, pool=self.pool, rid=rid, with_url=True)
        path = "/v1/completions"
        choice = get_field(body, "choices.0", url, path, self.name, dict)
        lps = get_field(body, "choices.0.logprobs.token_logprobs", url, path, self.name, list)
        ids = choice.get("token_ids")
        if ids is None:
            tokens = get_field(body, "choices.0.logprobs.tokens", url, path, self.name, list)
            ids = [_token_id(t, url) for t in tokens]
        if len(ids) != len(lps) or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in lps):
            raise EngineError(f"{self.name} server at {url} answered {path} with choices.0.token_ids and "
                              "choices.0.logprobs.token_logprobs that do not match")
        reason = choice.get("finish_reason")
        if reason not in SERVER_FINISH_REASONS:
            raise EngineError(f"{self.name} server at {url} answered {path} with choices.0.finish_reason {reason!r}")
        return Generation(token_ids=[int(i) for i in ids], logprobs=[float(x) for x in lps],
                          finish_reason=reason, versions=[version] * len(ids))

    async def _score_one(self, rid: str, prompt: list[int], completion: list[int]) -> list[float]:
        if not completion:
            return []
        payload = {"model": self.served_model, "prompt": prompt + completion, "max_tokens": 1, "temperature": 1.0,
                   "prompt_logprobs": 0, "n": 1, "stream": False, "request_id": rid}
        url, body = await self.http.request("/v1/completions", payload, pool=self.pool, rid=rid, with_url=True)
        field = "choices.0.prompt_logprobs"
        entries = get_field(body, field, url, "/v1/completions", self.name, list)
        if len(entries) != len(prompt) + len(completion):
            raise EngineError(f"{self.name} server at {url} answered /v1/completions with {len(entries)} "
                              f"{field} entries, expected {len(prompt) + len(completion)}")
        out = []
        for tok, entry in zip(completion, entries[len(prompt):]):
            item = entry.get(str(tok)) if isinstance(entry, dict) else None
            if not isinstance(item, dict) or not isinstance(item.get("logprob"), (int, float)):
                raise EngineError(f"{self.name} server at {url} answered /v1/completions without {field} for token {tok}")
            out.append(float(item["logprob"]))
        return out

    # ------------------------------------------------------------------ weight sync
    def update_weights(self, named_tensors: NamedTensors | None = None, *, path: str | None = None, version: int) -> None:
        for url in self.control_urls():
            if url in self._sync_problem:
                raise EngineError(f"{self.name} server at {url} cannot take weight updates: {self._sync_problem[url]}")
        super().update_weights(named_tensors, path=path, version=version)

    async def _pause(self, url: str) -> None:
        await self.http.request("/pause?mode=abort", None, url=url, expect_json=False, allow_404=True)

    async def _flush(self, url: str) -> None:
        await self.http.request("/reset_prefix_cache", None, url=url, expect_json=False, allow_404=True)

    async def _resume(self, url: str) -> None:
        await self.http.request("/resume", None, url=url, expect_json=False, allow_404=True)

    async def _served_version(self, url: str) -> str | None:
        results = await self._rpc(url, "glmlight_weight_version", None)
        versions = {r.get("weight_version") for r in results}
        return versions.pop() if len(versions) == 1 else f"mixed {sorted(map(str, versions))}"

    async def _rpc(self, url: str, method: str, spec: dict | None, attempts: int | None = None,
                   allow_404: bool = False) -> list | None:
        body = await self.http.request("/collective_rpc", {"method": method, "args": [] if spec is None else
                                                           [json.dumps(spec)]}, url=url, attempts=attempts,
                                       allow_404=allow_404)
        if body is None:
            return None
        results = get_field(body, "results", url, "/collective_rpc", self.name, list)
        if not results or not all(isinstance(r, dict) and "weight_version" in r for r in results):
            raise EngineError(f"{self.name} server at {url} answered /collective_rpc {method} without "
                              "results[].weight_version")
        return results

    def _rpc_all(self, urls: Sequence[str], method: str, specs: dict[str, dict], attempts: int | None = None):
        async def all_() -> None:
            await asyncio.gather(*(self._rpc(u, method, specs[u], attempts=attempts) for u in urls))

        return all_()

    def _push(self, urls: Sequence[str], named: list | None, path: str | None, version: int) -> None:
        if self.weight_sync == "disk":
            if named is not None or not os.path.isdir(path or ""):
                named = named if named is not None else wt.read_checkpoint(path)  # type: ignore[arg-type]
                config_dir = self.model_path if self.model_path and os.path.isdir(self.model_path) else None
                path = wt.write_hf_checkpoint(named, self.weight_sync_dir, version, config_dir=config_dir,
                                              keep=self.keep_checkpoints)
            spec = {"path": os.path.abspath(path), "version": version}  # type: ignore[arg-type]
            self.http.run(self._rpc_all(urls, "glmlight_load_path", {u: spec for u in urls}))
            return
        named = named if named is not None else wt.read_checkpoint(path)  # type: ignore[arg-type]
        parts = list(wt.buckets(named, self.bucket_bytes)) or [[]]
        for i, bucket in enumerate(parts):
            v = version if i == len(parts) - 1 else None
            if self.weight_sync == "tensor":
                spec = {"data": wt.encode_safetensors(bucket), "version": v}
                self.http.run(self._rpc_all(urls, "glmlight_load_payload", {u: spec for u in urls}))
            elif self.weight_sync == "distributed":
                self._broadcast_bucket(urls, bucket, v)
            else:
                raise EngineError(f"unknown rollout.server.weight_sync {self.weight_sync!r}")

    def _broadcast_bucket(self, urls: Sequence[str], bucket: list, version: int | None) -> None:
        import torch

        if self._group is None:
            world = 1 + sum(self._workers[u] for u in urls)
            offsets = [1 + sum(self._workers[u] for u in urls[:i]) for i in range(len(urls))]
            addr, port = self.sync_master_address or local_ip_towards(urls[0]), free_port("")
            specs = {u: {"master_address": addr, "master_port": port, "rank_offset": off, "world_size": world,
                         "group_name": self._group_name, "backend": self.sync_backend} for u, off in zip(urls, offsets)}
            fut = self.http.submit(self._rpc_all(urls, "glmlight_init_group", specs, attempts=1))
            try:
                self._group = wt.init_custom_process_group(self.sync_backend, f"tcp://{addr}:{port}", world, 0,
                                                           self._group_name, timeout_s=self.confirm_timeout_s)
            finally:
                fut.result(self.confirm_timeout_s)
        spec = {"names": [n for n, _ in bucket], "dtypes": [dtype_name(t.dtype) for _, t in bucket],
                "shapes": [list(t.shape) for _, t in bucket], "group_name": self._group_name,
                "backend": self.sync_backend, "version": version}
        fut = self.http.submit(self._rpc_all(urls, "glmlight_update_distributed", {u: spec for u in urls}, attempts=1))
        try:
            device = wt.sync_device(self.sync_backend)
            for _, t in bucket:
                torch.distributed.broadcast(t.detach().to(device).contiguous(), src=0, group=self._group)
        finally:
            fut.result(self.confirm_timeout_s)

    def _before_close(self) -> None:
        if self._group is not None:
            import torch

            try:
                torch.distributed.destroy_process_group(self._group)
            except Exception:  # noqa: BLE001 - closing must not fail
                pass
            self._group = None


def _token_id(token: Any, url: str) -> int:
    if isinstance(token, str) and token.startswith("token_id:"):
        return int(token.split(":", 1)[1])
    raise EngineError(f"vLLM server at {url} answered /v1/completions with a token {str(token)[:40]!r} "
                      "that is not 'token_id:<id>' and no choices.0.token_ids")


class VLLMInProcessEngine:
    """`vllm.LLM` in this process, weights loaded through the worker extension.

    Not run in this repository's tests (it needs vLLM and a GPU or NPU)."""

    def __init__(self, model_path: str, *, ascend: bool = False, llm_kwargs: dict | None = None,
                 version: int = 0, bucket_bytes: int = 1 << 28):
        if ascend:
            for k, v in ASCEND_OPTIONS["env"].items():
                os.environ.setdefault(k, v)
        import vllm

        self._vllm = vllm
        kwargs = {"model": model_path, "worker_extension_cls": EXTENSION, "enable_prefix_caching": True,
                  **(ASCEND_OPTIONS["llm_kwargs"] if ascend else {}), **(llm_kwargs or {})}
        self.llm = vllm.LLM(**kwargs)
        self._version, self.bucket_bytes = version, bucket_bytes

    @classmethod
    def from_config(cls, cfg: Any) -> VLLMInProcessEngine:
        s = cfg.rollout.server
        return cls(s.model_path or cfg.model.path, ascend=cfg.rollout.backend == "vllm_ascend")

    @property
    def version(self) -> int:
        return self._version

    def generate(self, prompts: list[list[int]], params: SamplingParams | Sequence[SamplingParams]) -> list[Generation]:
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        sps = [self._vllm.SamplingParams(n=1, max_tokens=p.max_new_tokens, logprobs=0, seed=p.seed,
                                         **{k: v for k, v in sampling_fields(p).items()}) for p in params]
        outs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], sps, use_tqdm=False)
        gens = []
        for out in outs:
            c = out.outputs[0]
            ids = list(c.token_ids)
            lps = [float(c.logprobs[i][t].logprob) for i, t in enumerate(ids)]
            gens.append(Generation(ids, lps, c.finish_reason if c.finish_reason in SERVER_FINISH_REASONS else "abort", [self._version] * len(ids)))
        return gens

    def score(self, prompts: list[list[int]], completions: list[list[int]]) -> list[list[float]]:
        sp = self._vllm.SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
        outs = self.llm.generate([{"prompt_token_ids": list(p) + list(c)} for p, c in zip(prompts, completions)],
                                 sp, use_tqdm=False)
        return [[float(o.prompt_logprobs[len(p) + j][t].logprob) for j, t in enumerate(c)]
                for o, p, c in zip(outs, prompts, completions)]

    def update_weights(self, named_tensors: NamedTensors | None = None, *, path: str | None = None, version: int) -> None:
        if (named_tensors is None) == (path is None):
            raise ValueError("update_weights needs exactly one of named_tensors or path")
        named = list(named_tensors) if named_tensors is not None else wt.read_checkpoint(path)  # type: ignore[arg-type]
        parts = list(wt.buckets(named, self.bucket_bytes)) or [[]]
        for i, bucket in enumerate(parts):
            spec = {"data": wt.encode_safetensors(bucket), "version": version if i == len(parts) - 1 else None}
            self.llm.collective_rpc("glmlight_load_payload", args=(json.dumps(spec),))
        self.llm.reset_prefix_cache()
        served = {r["weight_version"] for r in self.llm.collective_rpc("glmlight_weight_version")}
        if served != {str(version)}:
            raise EngineError(f"in-process vLLM workers report weight versions {sorted(map(str, served))}, expected {version}")
        self._version = version

    def close(self) -> None:
        self.llm = None
