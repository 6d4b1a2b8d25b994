"""Weight transport: the pieces both sides of a weight sync share, and the vLLM worker extension.

Trainer side (the SGLang and vLLM clients) and server side (`WeightLoaderExtension`,
running inside vLLM's workers) agree on:

- the checkpoint layout of `weight_sync=disk`: a Hugging Face directory of
  safetensors files named with the model's own state-dict names (what a server's
  `load_weights` maps from), plus config.json when the trainer's checkpoint has one;
- safetensors payloads (base64) for tensors sent inside a JSON body;
- a weight-update process group outside the trainer's default group (rank 0 = trainer,
  servers from `rank_offset`), built the way SGLang builds its own, so both sides meet.

This module imports only torch and safetensors; vLLM is imported lazily inside
the worker (start the server with
`--worker-extension-cls glmlight.rollout.vllm_worker.WeightLoaderExtension`).
"""

from __future__ import annotations

import base64
import datetime
import json
import os
import re
import shutil
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from safetensors.torch import load, load_file, save, save_file

Named = list[tuple[str, torch.Tensor]]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def cpu_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> Named:
    """Detached, contiguous CPU copies; tensors that share storage (tied weights) are
    cloned so that safetensors accepts them."""
    out, seen = [], set()
    for name, t in named:
        t = t.detach().to("cpu").contiguous()
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        if key in seen or t.untyped_storage().nbytes() != t.numel() * t.element_size():
            t = t.clone()
        seen.add(key)
        out.append((name, t))
    return out


def buckets(named: Named, max_bytes: int) -> Iterator[Named]:
    """Consecutive groups of at most `max_bytes` (a larger tensor travels alone)."""
    bucket, size = [], 0
    for name, t in named:
        n = t.numel() * t.element_size()
        if bucket and size + n > max_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += n
    if bucket:
        yield bucket


def write_hf_checkpoint(named: Iterable[tuple[str, torch.Tensor]], root: str, version: int, *,
                        config_dir: str | None = None, max_shard_bytes: int = 5 * 2**30, keep: int = 2) -> str:
    """Write `root/v{version}/` atomically and return its absolute path.

    Files are written into a temporary directory (each file to a temp name, then
    os.replace), which is then renamed to `v{version}`; a reader never sees a partial
    checkpoint. One shard is `model.safetensors`; more are `model-0000i-of-0000N.safetensors`
    with `model.safetensors.index.json`. Older `v*` directories beyond `keep` are removed.
    """
    root = os.path.abspath(root)
    final = os.path.join(root, f"v{version}")
    tmp = os.path.join(root, f".v{version}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    shards = list(buckets(cpu_tensors(named), max_shard_bytes))
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    weight_map, total = {}, 0
    for fname, shard in zip(names, shards):
        part = os.path.join(tmp, fname + ".part")
        save_file(dict(shard), part, metadata={"format": "pt"})
        os.replace(part, os.path.join(tmp, fname))
        for name, t in shard:
            weight_map[name] = fname
            total += t.numel() * t.element_size()
    if len(shards) > 1:
        with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    for extra in ("config.json", "generation_config.json"):
        if config_dir and os.path.isfile(os.path.join(config_dir, extra)):
            shutil.copyfile(os.path.join(config_dir, extra), os.path.join(tmp, extra))
    if os.path.exists(final):
        shutil.rmtree(final)
    os.replace(tmp, final)
    _prune(root, keep)
    return final


def _prune(root: str, keep: int) -> None:
    versions = sorted((int(m.group(1)), d) for d in os.listdir(root) if (m := re.fullmatch(r"v(\d+)", d)))
    for _, d in versions[:-keep] if keep > 0 else []:
        shutil.rmtree(os.path.join(root, d), ignore_errors=True)


def read_checkpoint(path: str) -> Named:
    """Tensors of a safetensors file or of a directory of safetensors files (sorted by name)."""
    if os.path.isdir(path):
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        if not files:
            raise FileNotFoundError(f"no .safetensors files in {path}")
        return [item for f in files for item in load_file(os.path.join(path, f)).items()]
    return list(load_file(path).items())


def encode_safetensors(named: Named) -> str:
    return base64.b64encode(save(dict(cpu_tensors(named)))).decode("ascii")


def decode_safetensors(data: str) -> Named:
    return list(load(base64.b64decode(data)).items())


def init_custom_process_group(backend: str, init_method: str, world_size: int, rank: int, group_name: str,
                              timeout_s: float = 600.0):
    """A process group of its own (not the default group): TCP rendezvous at `init_method`,
    the store prefixed with `group_name`. SGLang's server side builds its weight-update
    group the same way, so trainer and servers meet. Uses torch internals, as SGLang does."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    timeout = datetime.timedelta(seconds=timeout_s)
    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store, group_name=group_name,
                                      timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def sync_device(backend: str) -> torch.device:
    """Where broadcast tensors live: nccl → cuda, hccl → npu, gloo → cpu."""
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    if backend == "hccl":
        return torch.device("npu", torch.npu.current_device())  # type: ignore[attr-defined]
    return torch.device("cpu")


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
