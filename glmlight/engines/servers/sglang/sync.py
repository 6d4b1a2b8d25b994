"""`SGLangWeightSync`: the weight-sync transport (protocol.py `WeightSync`) of an SGLang fleet. Within the
fleet's update (/pause_generation before; /flush_cache, /model_info until weight_version is the new
version, and /continue_generation after), by mode:

- disk: a safetensors checkpoint in HF layout, written atomically to weight_sync_dir/v{version}/,
  then /update_weights_from_disk {model_path, weight_version} (SGLang restores its old weights
  itself when that load fails);
- shm: the same request, the checkpoint written into one of two slots in shared memory (shm.py, same
  host): no disk, and pages overwritten in place;
- tensor and distributed: the new weights go in buckets of `bucket_bytes` inside a weight-update session
  (/begin_weight_update … /end_weight_update: 0.5.23 refuses those updates outside one; a server without
  the endpoint, 404, is updated without), the last bucket labelled with the new version.
  tensor: /update_weights_from_tensor, serialized_named_tensors = one entry per TP rank (wire.py
  `serialize_named_tensors`: CPU tensors as named shared-memory segments, CUDA tensors as CUDA IPC
  handles carrying the device UUID). distributed: /init_weights_update_group once (trainer = rank 0,
  each server's TP ranks from rank_offset; group.py), then per bucket /update_weights_from_distributed
  {names, dtypes, shapes, group_name} while this process broadcasts the tensors (nccl on CUDA, hccl on
  Ascend, gloo). A server that restarted lost its group: a re-sync builds it again with every server.

If a server fails an update, every server is put back on the previous weights (the previous checkpoint,
the kept copy of the previous tensors, or the checkpoint it was started from) and `UpdateFailed` is
raised (the fleet retries); if that is impossible, `FleetFailed`.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

from glmlight.dtypes import dtype_name
from glmlight.errors import EngineError
from glmlight.engines import transport as wt
from glmlight.engines.servers.group import UpdateGroup
from glmlight.engines.servers.protocol import FleetFailed, Source, UpdateFailed
from glmlight.engines.servers.sglang.adapter import SGLangServer
from glmlight.engines.servers.sglang.wire import serialize_named_tensors
from glmlight.engines.servers.shm import ShmSlots

log = logging.getLogger(__name__)
# sglang 0.5.23's reply to a disk update whose weights loaded but whose cache flush was refused
FLUSH_REFUSED_AFTER_LOAD = "Weights were updated, but the cache was not flushed"


class SGLangWeightSync:
    """See the module docstring. `mode`: rollout.server.weight_sync."""

    def __init__(self, http: Any, *, mode: str = "disk", weight_sync_dir: str = ".cache/glmlight/weights",
                 model_path: str | None = None, backend: str = "nccl", master_address: str | None = None,
                 bucket_bytes: int = 1 << 30, keep_checkpoints: int = 2, shm_dir: str = "/dev/shm",
                 timeout_s: float = 600.0):
        self.http = http
        self.mode, self.weight_sync_dir, self.model_path = mode, weight_sync_dir, model_path
        self.bucket_bytes, self.keep_checkpoints, self.timeout_s = bucket_bytes, keep_checkpoints, timeout_s
        self.group = UpdateGroup(backend, master_address)
        self.shm = ShmSlots(shm_dir)
        self.last_seconds: dict[str, float] = {}
        self.last_bytes: dict[str, int] = {}

    @property
    def backend(self) -> str:
        return self.group.backend

    def check(self, servers: Sequence[SGLangServer]) -> None:
        """Every SGLang server takes updates."""

    def push(self, servers: Sequence[SGLangServer], named: list | None, path: str | None, version: int,
             current: Source) -> Source:
        self.last_seconds = {}
        source = Source(version, str(version))
        if self.mode in ("disk", "shm"):
            try:
                config_dir = self.model_path if self.model_path and os.path.isdir(self.model_path) else None
                if self.mode == "shm":  # SGLang's loader reads the slot's file: in /dev/shm, a memcpy
                    path = self.shm.write(named if named is not None else wt.map_checkpoint(path),  # type: ignore[arg-type]
                                          config_dir, current.path, self.last_seconds)
                elif named is not None or not os.path.isdir(path or ""):
                    named = named if named is not None else wt.read_checkpoint(path)  # type: ignore[arg-type]
                    path = wt.write_hf_checkpoint(named, self.weight_sync_dir, version, config_dir=config_dir,
                                                  keep=self.keep_checkpoints)
            except OSError as e:
                raise UpdateFailed(f"could not write the checkpoint: {e}") from None
            source.path = os.path.abspath(path)  # type: ignore[arg-type]
            errors = self._post_each(servers, "/update_weights_from_disk",
                                     lambda s: {"model_path": source.path, "weight_version": str(version)})
            errors = self._loaded_anyway(errors, version, servers)
            if errors:  # SGLang put its own weights back where the load failed; the others go back too
                self._revert([s for s in servers if s.url not in errors], current, errors)
            return source
        try:
            named = named if named is not None else wt.read_checkpoint(path)  # type: ignore[arg-type]
            for s in servers:
                s.tp_size()
        except (OSError, EngineError) as e:
            raise UpdateFailed(str(e)) from None
        try:
            self._push_tensors(servers, named, version)
        except (EngineError, RuntimeError) as e:  # RuntimeError: a failed broadcast
            self._revert(servers, current, {s.url: e for s in servers})
        return source

    def _loaded_anyway(self, errors: dict[str, Exception], version: int,
                       servers: Sequence[SGLangServer]) -> dict[str, Exception]:
        """The failures of a disk update where the new weights did not go in. SGLang 0.5.23 answers
        HTTP 400 `success: false` also when the weights loaded and its scheduler's weight version
        (the one stamped on answers) moved, but the cache flush that follows was refused because
        requests were still running (srt/managers/scheduler_components/weight_updater.py
        `flush_cache_after_weight_update`; /model_info keeps the old version, which the HTTP process
        moves only on success). Such a server is neither put back nor loaded twice: its reply says the
        weights are in, /update_weight_version (abort_all_requests false) makes /model_info report the
        same version, and the fleet's flush flushes its cache once the requests are gone. Any other failure
        counts unless /model_info already reports the new version."""
        by_url = {s.url: s for s in servers}
        left = {}
        for url, e in errors.items():
            if FLUSH_REFUSED_AFTER_LOAD in str(e):
                log.warning("SGLang server at %s loaded weight version %d but could not flush its cache yet: %s",
                            url, version, e)
                try:
                    self.http.run(self.http.request("/update_weight_version", {"new_version": str(version),
                                                                               "abort_all_requests": False}, url=url))
                    continue
                except EngineError as e2:
                    e = e2
            try:
                served = self.http.run(by_url[url].label())
            except EngineError:
                served = None
            if served == str(version):
                log.warning("SGLang server at %s reports weight version %d after answering: %s", url, version, e)
            else:
                left[url] = e
        return left

    def _revert(self, servers: Sequence[SGLangServer], prev: Source, errors: dict[str, Exception]) -> None:
        """Put `servers` back on the previous weights, then raise UpdateFailed (FleetFailed if that fails)."""
        first = f"{next(iter(errors))}: {next(iter(errors.values()))}"
        if servers:
            try:
                if prev.named is not None and self.mode not in ("disk", "shm"):
                    self._push_tensors(servers, prev.named, prev.version)
                else:
                    model_path = prev.path or self.model_path
                    if not model_path:
                        raise EngineError("no previous checkpoint to load")
                    bad = self._post_each(servers, "/update_weights_from_disk", lambda s: {
                        "model_path": os.path.abspath(model_path),
                        "weight_version": prev.label or s.initial_label or "default"})
                    if bad:
                        raise next(iter(bad.values()))
            except Exception as e:  # noqa: BLE001
                raise FleetFailed(f"SGLang: a weight update failed ({first}) and {sorted(s.url for s in servers)} "
                                  f"could not be put back on the previous weights ({e}); servers now serve different "
                                  "weights") from None
        raise UpdateFailed(f"update failed on {first}")

    def _push_tensors(self, servers: Sequence[SGLangServer], named: list, version: int) -> None:
        parts = list(wt.buckets(named, self.bucket_bytes)) or [[]]
        self._begin(servers)
        try:
            for i, bucket in enumerate(parts):
                label = {"weight_version": str(version)} if i == len(parts) - 1 else {}
                if self.mode == "tensor":
                    payloads, keep = {}, []
                    for s in servers:
                        data, alive = serialize_named_tensors(bucket)
                        payloads[s.url], keep = [data] * s.tp_size(), keep + [alive]
                    errors = self._post_each(servers, "/update_weights_from_tensor", lambda s: {
                        "serialized_named_tensors": payloads[s.url], "flush_cache": False, **label},
                        attempts=1)  # a shared-memory handle is opened once: never resend the same payload
                    del keep
                elif self.mode == "distributed":
                    errors = self._broadcast_bucket(servers, bucket, label)
                else:
                    raise EngineError(f"unknown rollout.server.weight_sync {self.mode!r}")
                if errors:
                    url, e = next(iter(errors.items()))
                    raise EngineError(f"SGLang server at {url}: {e}")
        finally:
            self._end(servers)

    def _begin(self, servers: Sequence[SGLangServer]) -> None:
        for s in servers:
            if s.session is not False:
                body = self.http.run(self.http.request("/begin_weight_update", {}, url=s.url, allow_404=True))
                s.session = body is not None

    def _end(self, servers: Sequence[SGLangServer]) -> None:
        for s in servers:
            if s.session:
                try:
                    self.http.run(self.http.request("/end_weight_update", {}, url=s.url))
                except EngineError as e:
                    log.warning("SGLang server at %s: /end_weight_update failed: %s", s.url, e)

    def _ensure_group(self, servers: Sequence[SGLangServer]) -> None:
        g = self.group
        if g.group is not None:
            return
        urls = [s.url for s in servers]
        addr, port, world, offsets = g.plan(urls, [s.tp_size() for s in servers])
        bodies = {u: {"master_address": addr, "master_port": port, "rank_offset": off, "world_size": world,
                      "group_name": g.name, "backend": g.backend} for u, off in zip(urls, offsets)}
        fut = self.http.submit(self._post_async(servers, "/init_weights_update_group", bodies))
        try:
            g.join(addr, port, world, self.timeout_s)
        finally:
            errors = fut.result(self.timeout_s)
        if errors:
            raise EngineError(f"SGLang server at {next(iter(errors))}: {next(iter(errors.values()))}")

    def _broadcast_bucket(self, servers: Sequence[SGLangServer], bucket: list, label: dict) -> dict[str, Exception]:
        self._ensure_group(servers)
        meta = {"names": [n for n, _ in bucket], "dtypes": [dtype_name(t.dtype) for _, t in bucket],
                "shapes": [list(t.shape) for _, t in bucket], "group_name": self.group.name,
                "flush_cache": False, **label}
        fut = self.http.submit(self._post_async(servers, "/update_weights_from_distributed",
                                                {s.url: meta for s in servers}))
        try:
            self.group.broadcast(bucket)
        finally:
            errors = fut.result(self.timeout_s)
        return errors

    def resync_targets(self, server: SGLangServer, servers: Sequence[SGLangServer]) -> list[SGLangServer]:
        if self.mode != "distributed":
            return [server]
        if self.group.group is not None:  # the restarted server lost its group: build it again with every server
            self._post_each(servers, "/destroy_weights_update_group", lambda s: {"group_name": self.group.name},
                            attempts=1)
            self.group.renew()
        return list(servers)

    def _post_each(self, servers: Sequence[SGLangServer], path: str, payload_for: Callable[[SGLangServer], Any],
                   attempts: int | None = None) -> dict[str, Exception]:
        async def all_() -> list:
            return await asyncio.gather(*(s.post(path, payload_for(s), attempts) for s in servers),
                                        return_exceptions=True)

        return {s.url: o for s, o in zip(servers, self.http.run(all_())) if isinstance(o, BaseException)}

    @staticmethod
    async def _post_async(servers: Sequence[SGLangServer], path: str, bodies: dict[str, Any]) -> dict[str, Exception]:
        # one attempt: a retry would wait for a broadcast that never comes
        outcomes = await asyncio.gather(*(s.post(path, bodies[s.url], attempts=1) for s in servers),
                                        return_exceptions=True)
        return {s.url: o for s, o in zip(servers, outcomes) if isinstance(o, BaseException)}

    def close(self, servers: Sequence[SGLangServer]) -> None:
        try:
            self.group.destroy()
        finally:
            self.shm.close()
