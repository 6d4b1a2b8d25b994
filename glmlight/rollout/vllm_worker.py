"""The vLLM worker extension: weight loading inside vLLM's workers, reached with /collective_rpc.

Start the server with `--worker-extension-cls glmlight.rollout.vllm_worker.WeightLoaderExtension`.
This module imports torch, safetensors and glmlight's weight transport only (vLLM lazily), so
the server's environment needs no other part of glmlight.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import torch

from glmlight.dtypes import parse_dtype
from glmlight.rollout.transport import Named, decode_safetensors, init_custom_process_group, read_checkpoint, sync_device


class WeightLoaderExtension:
    """Mixed into each vLLM worker by `worker_extension_cls`; reached with collective_rpc.

    Over HTTP (`POST /collective_rpc`, VLLM_SERVER_DEV_MODE=1) arguments travel as
    strings, so every method takes one JSON string. Every method returns
    `{"weight_version": ..., "rank": ...}` so the client can check all workers.
    """

    _glmlight_version: str | None = None
    _glmlight_groups: dict[str, Any]

    def glmlight_load_path(self, spec: str) -> dict:
        """{"path": checkpoint dir or file, "version": v}: load it into the model."""
        s = json.loads(spec)
        return self._load(read_checkpoint(s["path"]), s.get("version"))

    def glmlight_load_payload(self, spec: str) -> dict:
        """{"data": base64 safetensors bytes, "version": v or null}: load these tensors."""
        s = json.loads(spec)
        return self._load(decode_safetensors(s["data"]), s.get("version"))

    def glmlight_init_group(self, spec: str) -> dict:
        """{master_address, master_port, rank_offset, world_size, group_name, backend}: join the
        trainer's weight-update group as rank rank_offset + this worker's rank."""
        s = json.loads(spec)
        groups = self.__dict__.setdefault("_glmlight_groups", {})
        groups[s["group_name"]] = self._make_group(s["backend"], f"tcp://{s['master_address']}:{s['master_port']}",
                                                   int(s["world_size"]), int(s["rank_offset"]) + self._rank(),
                                                   s["group_name"])
        return self._state()

    def glmlight_update_distributed(self, spec: str) -> dict:
        """{names, dtypes, shapes, group_name, backend, version}: receive one broadcast (src 0) per
        name, in order, then load them."""
        s = json.loads(spec)
        group = self.__dict__.get("_glmlight_groups", {}).get(s["group_name"])
        if group is None:
            raise RuntimeError(f"weight-update group {s['group_name']!r} was never initialised")
        device = getattr(self, "device", None) or sync_device(s.get("backend", "nccl"))
        received = []
        for name, dtype, shape in zip(s["names"], s["dtypes"], s["shapes"]):
            t = torch.empty(shape, dtype=parse_dtype(dtype), device=device)
            self._broadcast(t, group)
            received.append((name, t))
        return self._load(received, s.get("version"))

    def glmlight_weight_version(self) -> dict:
        return self._state()

    def load_named_tensors(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: Any = None) -> dict:
        """In-process use (Python objects through collective_rpc)."""
        return self._load(list(named_tensors), version)

    # ------------------------------------------------------------------ internals (test seams)
    def _load(self, weights: Named, version: Any) -> dict:
        self.model_runner.model.load_weights(weights=weights)  # type: ignore[attr-defined]
        if version is not None:
            self._glmlight_version = str(version)
        return self._state()

    def _state(self) -> dict:
        return {"weight_version": self._glmlight_version, "rank": self._rank()}

    def _rank(self) -> int:
        try:
            from vllm.distributed.parallel_state import get_world_group

            return int(get_world_group().rank)
        except Exception:  # noqa: BLE001 - outside vLLM (or before its groups exist)
            return int(getattr(self, "rank", 0))

    def _make_group(self, backend: str, init_method: str, world_size: int, rank: int, group_name: str):
        return init_custom_process_group(backend, init_method, world_size, rank, group_name)

    def _broadcast(self, tensor: torch.Tensor, group: Any) -> None:
        torch.distributed.broadcast(tensor, src=0, group=group)
