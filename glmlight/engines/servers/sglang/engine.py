"""`SGLangEngine`: the fleet (glmlight/engines/servers/fleet.py) of SGLang servers: one `SGLangServer`
adapter per URL (adapter.py), the `SGLangWeightSync` transport (sync.py), and the start-up checks: each
server's start-up weight label, whether it samples with per-request seeds, and the log-prob definition.

Seeds: sampling_seed is sent, but SGLang uses it only with --enable-deterministic-inference
(`_check_seeding`; `seeded_sampling`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from glmlight.errors import EngineError
from glmlight.engines.servers.checks import check_logprob_definition
from glmlight.engines.servers.fleet import ServerFleet, fleet_urls
from glmlight.engines.servers.replay import ReplayCapture
from glmlight.engines.servers.settings import fleet_plan, publish_fleet, server_settings
from glmlight.engines.servers.sglang.adapter import REPLAY_FIELDS, SGLangFleetInfo, SGLangServer
from glmlight.engines.servers.sglang.sync import SGLangWeightSync
from glmlight.engines.servers.sglang.wire import check_sampling

log = logging.getLogger(__name__)


class SGLangEngine(ServerFleet):
    """See the module docstring."""

    name = "SGLang"
    # top-k and top-p over the same un-renormalised distribution (glmlight/ops/logprobs.py `joint_kept`)
    filter_order = "joint"

    def __init__(self, urls: Sequence[str] = (), *, weight_sync: str = "disk",
                 weight_sync_dir: str = ".cache/glmlight/weights", model_path: str | None = None,
                 sync_backend: str = "nccl", sync_master_address: str | None = None,
                 bucket_bytes: int = 1 << 30, keep_checkpoints: int = 2, check_logprobs: bool = True,
                 http: Any = None, launch: Sequence[Any] = (), router_launch: Any = None, shm_dir: str = "/dev/shm",
                 confirm_timeout_s: float | None = None, poll_interval_s: float = 0.05, **kwargs: Any):
        from glmlight.engines.servers.http import HttpClient, HttpSettings

        self.check_logprobs = check_logprobs
        self.info = SGLangFleetInfo()
        self.seeded_sampling = True  # the servers honour sampling_seed (`_check_seeding`)
        client = HttpClient(self.name, http or HttpSettings())
        replay = ReplayCapture(self.name, REPLAY_FIELDS)
        urls = fleet_urls(urls, launch, router_launch)
        servers = [SGLangServer(u, client, self.info, replay, poll_interval_s) for u in urls]
        sync = SGLangWeightSync(client, mode=weight_sync, weight_sync_dir=weight_sync_dir, model_path=model_path,
                                backend=sync_backend, master_address=sync_master_address, bucket_bytes=bucket_bytes,
                                keep_checkpoints=keep_checkpoints, shm_dir=shm_dir,
                                timeout_s=confirm_timeout_s or client.settings.timeout_s)
        super().__init__(servers, http=client, sync=sync, replay=replay, launch=launch, router_launch=router_launch,
                         model_path=model_path,
                         confirm_timeout_s=confirm_timeout_s, poll_interval_s=poll_interval_s,
                         on_ready=SGLangEngine._start_checks, **kwargs)

    @classmethod
    def from_config(cls, cfg: Any, replay: tuple[bool, bool] = (False, False)) -> SGLangEngine:
        """The engine for the run's config; `replay`: (routing, index), what a managed server must return."""
        check_sampling(cfg.rollout.top_p, cfg.rollout.top_k)
        s, kw = cfg.rollout.server, server_settings(cfg)
        kw, launch = fleet_plan(cfg, kw, replay)
        engine = cls(launch=launch, sync_backend=s.sync_backend or "nccl", sync_master_address=s.sync_master_address,
                   check_logprobs=bool(s.check_logprobs), **kw)
        publish_fleet(engine)
        return engine

    def _start_checks(self) -> None:
        # Health checks pass without a key; an authenticated call finds a refused key now.
        for server in self._sync_servers() if (not self.router or len(self.urls) > 1) else [self.front]:
            server.initial_label = self.http.run(server.label())
        self._check_seeding()
        if self.check_logprobs:
            check_logprob_definition([self.servers[u] for u in self.pool.urls], self.http, self.name,
                                     "do not set SGLANG_RETURN_ORIGINAL_LOGPROB on the server",
                                     filtered=self._sampling_mask_ok)

    def _check_seeding(self) -> None:
        """SGLang samples with a request's sampling_seed only when started with
        --enable-deterministic-inference (sglang 0.5.23 srt/sampling/sampling_batch_info.py: the seeds
        are passed to the sampler only in deterministic mode, which refuses torch-native attention, so
        never on CPU). /server_info carries the flag; a server without it (or that does not say) makes
        the engine report `seeded_sampling = False`, and the run is told once."""
        unseeded = []
        for url in self.pool.urls:
            info = self.servers[url].server_info()
            if not (isinstance(info, dict) and info.get("enable_deterministic_inference") is True):
                unseeded.append(url)
        self.seeded_sampling = not unseeded
        if unseeded:
            log.warning("SGLang server(s) %s run without --enable-deterministic-inference: they ignore per-request "
                        "seeds, so sampling is not reproducible (the same seed gives other tokens, and a resumed run "
                        "samples differently from the interrupted one)", ", ".join(unseeded))

    def _sampling_mask_ok(self, error: EngineError) -> bool:
        """The start-up check's top_k=1 request failed: a server without return_sampling_mask (before
        0.5.18) is still fine for sampling without top-k/top-p."""
        if "output_token_sampling_logprobs" not in str(error):
            return False
        log.warning("%s; top-k/top-p sampling will be refused", error)
        self.info.filtered_logprobs = False
        return True
