"""`VLLMEngine`: the fleet (glmlight/engines/servers/fleet.py) of vLLM or vLLM-Ascend servers: one
`VLLMServer` adapter per URL (adapter.py), the `VLLMWeightSync` transport (sync.py), and the start-up
checks: the served model's name, each server's vLLM version, whether its workers can take weight updates
(dev mode and the worker extension), and the log-prob definition (`--logprobs-mode processed_logprobs`).
The in-process engine over a `vllm.LLM` is inprocess.py.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from glmlight.engines.weight_delta import DeltaSender
from glmlight.engines.servers.checks import check_logprob_definition
from glmlight.engines.servers.fleet import ServerFleet, fleet_urls
from glmlight.engines.servers.launch import vllm_index_refusal
from glmlight.engines.servers.replay import ReplayCapture
from glmlight.engines.servers.settings import fleet_plan, publish_fleet, server_settings
from glmlight.engines.servers.vllm.adapter import REPLAY_FIELDS, VLLMFleetInfo, VLLMServer
from glmlight.engines.servers.vllm.sync import VLLMWeightSync
from glmlight.engines.servers.vllm.wire import ASCEND_OPTIONS

log = logging.getLogger(__name__)


class VLLMEngine(ServerFleet):
    """See the module docstring; `ascend`: vLLM-Ascend (its name in messages, its weight-sync backend)."""

    name = "vLLM"
    # top-k, renormalise, then top-p (vllm 0.32.0 vllm/v1/sample/ops/topk_topp_sampler.py
    # `apply_top_k_top_p_pytorch`): glmlight's own order (glmlight/ops/logprobs.py)
    filter_order = "sequential"

    def __init__(self, urls: Sequence[str] = (), *, weight_sync: str = "disk",
                 weight_sync_dir: str = ".cache/glmlight/weights", model_path: str | None = None,
                 served_model: str | None = None, sync_backend: str = "nccl", sync_master_address: str | None = None,
                 bucket_bytes: int = 1 << 28, keep_checkpoints: int = 2, ascend: bool = False,
                 check_logprobs: bool = True, delta_sync: bool = False, http: Any = None, launch: Sequence[Any] = (),
                 router_launch: Any = None, shm_dir: str = "/dev/shm", confirm_timeout_s: float | None = None,
                 poll_interval_s: float = 0.05,
                 **kwargs: Any):
        from glmlight.engines.servers.http import HttpClient, HttpSettings

        self.name = "vLLM-Ascend" if ascend else "vLLM"
        self.check_logprobs = check_logprobs
        self.info = VLLMFleetInfo(self.name, served_model)
        if ascend:
            log.info("vLLM-Ascend engine: device %s, weight-sync backend %s", ASCEND_OPTIONS["device"], sync_backend)
        client = HttpClient(self.name, http or HttpSettings())
        replay = ReplayCapture(self.name, REPLAY_FIELDS, lambda routing, index: (
            vllm_index_refusal(self.name) if index else None))
        urls = fleet_urls(urls, launch, router_launch)
        servers = [VLLMServer(u, client, self.info, replay, poll_interval_s) for u in urls]
        sync = VLLMWeightSync(client, self.name, mode=weight_sync, weight_sync_dir=weight_sync_dir,
                              model_path=model_path, backend=sync_backend, master_address=sync_master_address,
                              bucket_bytes=bucket_bytes, keep_checkpoints=keep_checkpoints,
                              delta=DeltaSender() if delta_sync else None, shm_dir=shm_dir,
                              timeout_s=confirm_timeout_s or client.settings.timeout_s)
        super().__init__(servers, http=client, sync=sync, replay=replay, launch=launch, router_launch=router_launch,
                         model_path=model_path,
                         confirm_timeout_s=confirm_timeout_s, poll_interval_s=poll_interval_s,
                         on_ready=VLLMEngine._start_checks, **kwargs)

    @classmethod
    def from_config(cls, cfg: Any, replay: tuple[bool, bool] = (False, False)) -> VLLMEngine:
        """The engine for the run's config; `replay`: (routing, index), what a managed server must return."""
        s, kw = cfg.rollout.server, server_settings(cfg)
        ascend = cfg.rollout.backend == "vllm_ascend"
        kw, launch = fleet_plan(cfg, kw, replay)
        backend = s.sync_backend or (ASCEND_OPTIONS["sync_backend"] if ascend else "nccl")
        engine = cls(launch=launch, ascend=ascend, sync_backend=backend, sync_master_address=s.sync_master_address,
                   check_logprobs=bool(s.check_logprobs), delta_sync=bool(s.delta_sync), **kw)
        publish_fleet(engine)
        return engine

    @property
    def served_model(self) -> str | None:
        return self.info.served_model

    def _start_checks(self) -> None:
        first = self.servers[self.urls[0]]
        if self.info.served_model is None:
            self.info.served_model = first.read_served_model()
        for url in self.urls[:1] if self.router else self.urls:
            self.servers[url].read_version()
        for server in (self._sync_servers() if not self.router or len(self.urls) > 1 else []):
            self.http.run(server.probe_sync())
        if self.check_logprobs:
            check_logprob_definition([self.servers[u] for u in self.pool.urls], self.http, self.name,
                                     "start the server with --logprobs-mode processed_logprobs")
