"""`VLLMWeightSync`: the weight-sync transport (protocol.py `WeightSync`) of a vLLM fleet, through vLLM's
dev-mode endpoints (VLLM_SERVER_DEV_MODE=1) and the worker extension
`glmlight.engines.servers.worker.vllm_extension.WeightLoaderExtension` (`--worker-extension-cls`; a managed
launch adds both and puts glmlight on the server's PYTHONPATH). Within the fleet's update (pause before,
flush, confirm and resume after):

    stage every bucket on every server (/collective_rpc glmlight_load_payload,
    glmlight_update_distributed or glmlight_load_path) → glmlight_commit on every server (layerwise
    reload; a failure there restores that server's previous weights) → glmlight_release, or, if
    any server failed, glmlight_revert on the others → /update_weight_version (what
    weight_versions and /weight_info report)

Modes: disk (a checkpoint in weight_sync_dir), shm (one of two shared-memory slots, shm.py, mapped by
glmlight_load_path with {"map": true}: each byte is copied once by the trainer and once by the reload, on
the same host), tensor (safetensors buckets in the request), distributed (a process group, group.py). The
commit reports what its stages took (`last_seconds`). weight_sync=tensor with `delta` sends, against the
tensors of the last committed version (in the served dtype), only the elements that changed
(glmlight/engines/weight_delta.py); the worker rebuilds the rest from the copy it kept. A re-sync of a
restarted server and the retry after any failed update send everything.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Sequence
from typing import Any

from glmlight.dtypes import dtype_name
from glmlight.errors import EngineError
from glmlight.engines import transport as wt
from glmlight.engines.weight_delta import DeltaSender
from glmlight.engines.servers.group import UpdateGroup
from glmlight.engines.servers.protocol import FleetFailed, Source, UpdateFailed
from glmlight.engines.servers.shm import ShmSlots
from glmlight.engines.servers.vllm.adapter import VLLMServer


class VLLMWeightSync:
    """See the module docstring. `mode`: rollout.server.weight_sync."""

    def __init__(self, http: Any, name: str, *, mode: str = "disk", weight_sync_dir: str = ".cache/glmlight/weights",
                 model_path: str | None = None, backend: str = "nccl", master_address: str | None = None,
                 bucket_bytes: int = 1 << 28, keep_checkpoints: int = 2, delta: DeltaSender | None = None,
                 shm_dir: str = "/dev/shm", timeout_s: float = 600.0):
        self.http, self.name = http, name
        self.mode, self.weight_sync_dir, self.model_path = mode, weight_sync_dir, model_path
        self.bucket_bytes, self.keep_checkpoints, self.timeout_s = bucket_bytes, keep_checkpoints, timeout_s
        self.delta = delta  # weight_sync=tensor: changed elements only
        self.group = UpdateGroup(backend, master_address)
        self.shm = ShmSlots(shm_dir)
        self.last_seconds: dict[str, float] = {}
        self.last_bytes: dict[str, int] = {}  # delta sync: the last update's bytes sent and whole

    @property
    def backend(self) -> str:
        return self.group.backend

    def check(self, servers: Sequence[VLLMServer]) -> None:
        for s in servers:
            if s.sync_problem is not None:
                raise EngineError(f"{self.name} server at {s.url} cannot take weight updates: {s.sync_problem}")

    def push(self, servers: Sequence[VLLMServer], named: list | None, path: str | None, version: int,
             current: Source) -> Source:
        self.last_seconds = {}
        uid = f"v{version}-{uuid.uuid4().hex[:8]}"
        source = Source(version, str(version))
        delta = self.delta is not None and self.mode == "tensor"
        resync = version == current.version  # a restarted server gets the current weights: whole, not a delta
        try:
            buckets = self._stage(servers, named, path, version, uid, source, resync, current)
        except BaseException as e:
            self.each(servers, "glmlight_abort_update", {}, attempts=1)
            if delta:
                self.delta.forget()
            if isinstance(e, (EngineError, OSError, RuntimeError)):
                raise UpdateFailed(f"staging failed: {e}") from None
            raise
        commit = {"update_id": uid, "version": str(version), "buckets": buckets,
                  **(self.delta.commit_spec(resync) if delta else {})}
        outcomes = self.http.run(self._rpc_all(servers, "glmlight_commit", {s.url: commit for s in servers},
                                               attempts=1))
        errors = {s.url: o for s, o in zip(servers, outcomes) if isinstance(o, BaseException)}
        for o in outcomes:  # what the first server's first worker measured (staging, host copy, reload)
            if not isinstance(o, BaseException) and o and isinstance(o[0].get("seconds"), dict):
                self.last_seconds.update({f"server_{k}": float(x) for k, x in o[0]["seconds"].items()})
                break
        done = [s for s in servers if s.url not in errors]
        if delta and errors:
            self.delta.forget()
        elif delta:
            self.delta.committed(version, resync)
        if errors:
            bad = self.each(done, "glmlight_revert", {"update_id": uid}, attempts=1)
            if bad:
                raise FleetFailed(f"{self.name}: update to version {version} failed on {sorted(errors)} and "
                                  f"{sorted(bad)} could not go back to the previous weights: {next(iter(bad.values()))}")
            raise UpdateFailed(f"commit failed on {sorted(errors)}: {next(iter(errors.values()))}")
        self.each(servers, "glmlight_release", {"update_id": uid}, attempts=1)

        async def labels() -> None:
            await asyncio.gather(*(s.set_label(version) for s in servers))

        self.http.run(labels())
        return source

    def _stage(self, servers: Sequence[VLLMServer], named: list | None, path: str | None, version: int, uid: str,
               source: Any, resync: bool = False, current: Source | None = None) -> int:
        """Send the update to every server's workers (nothing is loaded yet); the number of buckets."""
        config_dir = self.model_path if self.model_path and os.path.isdir(self.model_path) else None
        if self.mode == "shm":
            named = named if named is not None else wt.map_checkpoint(path)  # type: ignore[arg-type]
            source.path = self.shm.write(named, config_dir, current.path if current else None, self.last_seconds)
            self._raise_first(self.each(servers, "glmlight_load_path", {"path": source.path, "update_id": uid,
                                                                         "map": True}))
            return 1
        if self.mode == "disk":
            if named is not None or not os.path.isdir(path or ""):
                named = named if named is not None else wt.read_checkpoint(path)  # type: ignore[arg-type]
                path = wt.write_hf_checkpoint(named, self.weight_sync_dir, version, config_dir=config_dir,
                                              keep=self.keep_checkpoints)
            source.path = os.path.abspath(path)  # type: ignore[arg-type]
            self._raise_first(self.each(servers, "glmlight_load_path", {"path": source.path, "update_id": uid}))
            return 1
        named = named if named is not None else wt.read_checkpoint(path)  # type: ignore[arg-type]
        if self.delta is not None and self.mode == "tensor":
            named = self.delta.wire(named, servers[0].info.served_dtype if servers else None, whole=resync)
            self.last_bytes = dict(self.delta.last)
        parts = list(wt.buckets(named, self.bucket_bytes)) or [[]]
        for i, bucket in enumerate(parts):
            if self.mode == "tensor":
                spec = {"data": wt.encode_safetensors(bucket), "update_id": uid, "bucket": i}
                self._raise_first(self.each(servers, "glmlight_load_payload", spec))
            elif self.mode == "distributed":
                self._broadcast_bucket(servers, bucket, uid, i)
            else:
                raise EngineError(f"unknown rollout.server.weight_sync {self.mode!r}")
        return len(parts)

    def each(self, servers: Sequence[VLLMServer], method: str, spec: dict,
             attempts: int | None = None) -> dict[str, Exception]:
        """`method(spec)` on every server at once; the errors, by URL."""
        outcomes = self.http.run(self._rpc_all(servers, method, {s.url: spec for s in servers}, attempts))
        return {s.url: o for s, o in zip(servers, outcomes) if isinstance(o, BaseException)}

    @staticmethod
    async def _rpc_all(servers: Sequence[VLLMServer], method: str, specs: dict[str, dict],
                       attempts: int | None = None) -> list:
        return await asyncio.gather(*(s.rpc(method, specs[s.url], attempts=attempts) for s in servers),
                                    return_exceptions=True)

    @staticmethod
    def _raise_first(errors: dict[str, Exception]) -> None:
        if errors:
            url, e = next(iter(errors.items()))
            raise e if isinstance(e, EngineError) else EngineError(f"server at {url}: {e}")

    def resync_targets(self, server: VLLMServer, servers: Sequence[VLLMServer]) -> list[VLLMServer]:
        if self.mode != "distributed":
            return [server]
        if self.group.group is not None:  # the restarted server lost its group: build it again with every server
            self.each(servers, "glmlight_destroy_group", {"group_name": self.group.name}, attempts=1)
            self.group.renew()
        return list(servers)

    def _broadcast_bucket(self, servers: Sequence[VLLMServer], bucket: list, uid: str, index: int) -> None:
        g = self.group
        if g.group is None:
            urls = [s.url for s in servers]
            addr, port, world, offsets = g.plan(urls, [s.workers for s in servers])
            specs = {u: {"master_address": addr, "master_port": port, "rank_offset": off, "world_size": world,
                         "group_name": g.name, "backend": g.backend, "timeout_s": self.timeout_s}
                     for u, off in zip(urls, offsets)}
            fut = self.http.submit(self._rpc_all(servers, "glmlight_init_group", specs, attempts=1))
            try:
                g.join(addr, port, world, self.timeout_s)
            finally:
                self._raise_first({s.url: o for s, o in zip(servers, fut.result(self.timeout_s))
                                   if isinstance(o, BaseException)})
        spec = {"names": [n for n, _ in bucket], "dtypes": [dtype_name(t.dtype) for _, t in bucket],
                "shapes": [list(t.shape) for _, t in bucket], "group_name": g.name,
                "backend": g.backend, "update_id": uid, "bucket": index}
        fut = self.http.submit(self._rpc_all(servers, "glmlight_update_distributed", {s.url: spec for s in servers},
                                             attempts=1))
        try:
            g.broadcast(bucket)
        finally:
            self._raise_first({s.url: o for s, o in zip(servers, fut.result(self.timeout_s))
                               if isinstance(o, BaseException)})

    def close(self, servers: Sequence[VLLMServer]) -> None:
        try:
            if self.group.group is not None:  # the servers' side too: groups would pile up in their workers
                try:
                    self.each(servers, "glmlight_destroy_group", {"group_name": self.group.name}, attempts=1)
                except Exception:  # noqa: BLE001 - closing must not fail
                    pass
            self.group.destroy()
        finally:
            self.shm.close()
