"""The vLLM worker extension: weight updates inside vLLM's workers, reached with /collective_rpc.

Start the server with `--worker-extension-cls glmlight.engines.servers.worker.vllm_extension.WeightLoaderExtension`
(a managed launch adds it and puts glmlight on the server's PYTHONPATH). This module imports torch,
safetensors and glmlight's weight transport, update checks and delta form only (vLLM lazily, inside
the methods), so the server's environment needs no other part of glmlight.

An update is staged, then committed, so that a failed update never leaves a half-loaded model
serving:

    stage   glmlight_load_payload / glmlight_update_distributed (one call per bucket) or
            glmlight_load_path (a checkpoint): tensors are kept in the worker; the model is untouched
    commit  glmlight_commit: expand a delta sync's changed elements against the tensors the last
            commit kept (glmlight/engines/weight_delta.py), check the staged tensors against the
            served checkpoint (every tensor, right shapes), keep a host copy of the current weights,
            then load everything through vLLM's layerwise reload (`initialize_layerwise_reload` →
            `model.load_weights` → `finalize_layerwise_reload`, vllm/model_executor/model_loader/reload/layerwise.py in
            vLLM 0.32 and 0.33), which re-runs each layer's `process_weights_after_loading`: the
            CPU backend's repacked linear weights, MLA's absorbed W_UK/W_UV and quantised layers
            get the new values (a plain `load_weights` fails on CPU — the repacked parameters are
            empty — and leaves those derived tensors stale on GPU). If anything raises, the copy
            is put back: the previous version keeps serving.
            A server started with --speculative-config (rollout.speculative.depth) has an MTP draft model
            beside the served one (the model runner's drafter): the same tensors are loaded into it the
            same way, and the copy covers it too.
    release glmlight_release drops the copy once every server committed; glmlight_revert puts it
            back (another server failed: the fleet returns to the previous version together).
    abort   glmlight_abort_update drops a staged update.

On vLLM-Ascend (vllm-ascend 0.23.0.post1, read from its source: vllm_ascend/worker/worker.py) the
extension does what that release's own weight-update path does: the layerwise reload runs with the
worker's NPU as the default device, and a model whose weights vllm-ascend casts to the FRACTAL_NZ
format after loading (`weight_nz_mode` > 0 in its --additional-config, or VLLM_ASCEND_ENABLE_NZ) takes
no update: vllm-ascend refuses that for RL ("may cause model parameter precision issues"), and
`glmlight_weight_version` reports why (`problem`), so the trainer stops at the first update with that
line. The reload re-runs vllm-ascend's `process_weights_after_loading` (AscendUnquantizedLinearMethod,
the fused-MoE methods, MLA's absorbed weights) on the new values.

Over HTTP every argument is a string, so every method takes one JSON string and returns
`{"weight_version", "rank", ...}`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Iterable
from typing import Any

import torch

from glmlight.dtypes import parse_dtype
from glmlight.engines.servers.worker.checks import check_update_names, checkpoint_shapes
from glmlight.engines.transport import (Named, decode_safetensors, init_custom_process_group, map_checkpoint, read_checkpoint,
                                       sync_device)
from glmlight.engines.weight_delta import DeltaBase

log = logging.getLogger(__name__)

class WeightLoaderExtension:
    """Mixed into each vLLM worker by `worker_extension_cls`; see the module docstring. vLLM's worker, the class
    it is mixed into, holds the attributes declared here."""

    model_runner: Any
    vllm_config: Any
    device: Any

    # ------------------------------------------------------------------ RPC methods
    def glmlight_weight_version(self, spec: str | None = None) -> dict:
        problem = self._gl_update_problem()
        return self._gl_state(dtype=self._gl_dtype(), **({"problem": problem} if problem else {}))

    def glmlight_load_payload(self, spec: str) -> dict:
        """{"data": base64 safetensors bytes, "update_id", "bucket": i}: stage these tensors."""
        s = json.loads(spec)
        return self._gl_stage(s, lambda: decode_safetensors(s["data"]))

    def glmlight_load_path(self, spec: str) -> dict:
        """{"path": checkpoint dir or .safetensors file, "update_id", "map": bool}: stage the checkpoint
        (`map`: as views of the files mapped into memory, for files in /dev/shm: the commit copies the
        writer's pages straight into the model)."""
        s = json.loads(spec)
        return self._gl_stage({**s, "bucket": 0},
                              lambda: (map_checkpoint if s.get("map") else read_checkpoint)(s["path"]))

    def glmlight_init_group(self, spec: str) -> dict:
        """{master_address, master_port, rank_offset, world_size, group_name, backend, timeout_s}: join the
        trainer's weight-update group as rank rank_offset + this worker's rank (a broadcast that stops
        midway fails after timeout_s; it blocks the engine meanwhile)."""
        s = json.loads(spec)
        groups = self.__dict__.setdefault("_gl_groups", {})
        rank = int(s["rank_offset"]) + self._gl_rank()
        groups[s["group_name"]] = self._gl_make_group(s["backend"], f"tcp://{s['master_address']}:{s['master_port']}",
                                                      int(s["world_size"]), rank, s["group_name"],
                                                      float(s.get("timeout_s", 600.0)))
        return self._gl_state(group_rank=rank)

    def glmlight_destroy_group(self, spec: str) -> dict:
        group = self.__dict__.get("_gl_groups", {}).pop(json.loads(spec)["group_name"], None)
        if group is not None:
            try:
                torch.distributed.destroy_process_group(group)
            except Exception:  # noqa: BLE001 - a group whose peer is gone
                pass
        return self._gl_state()

    def glmlight_update_distributed(self, spec: str) -> dict:
        """{names, dtypes, shapes, group_name, backend, update_id, bucket}: receive one broadcast
        (src 0) per name, in order, and stage them."""
        s = json.loads(spec)
        group = self.__dict__.get("_gl_groups", {}).get(s["group_name"])

        def receive() -> Named:
            if group is None:
                raise RuntimeError(f"weight-update group {s['group_name']!r} was never initialised")
            backend = s.get("backend", "nccl")  # gloo: received on the host, then loaded onto the device
            device = sync_device("gloo") if backend == "gloo" else (getattr(self, "device", None) or sync_device(backend))
            out = []
            for name, dtype, shape in zip(s["names"], s["dtypes"], s["shapes"]):
                t = torch.empty(shape, dtype=parse_dtype(dtype), device=device)
                self._gl_broadcast(t, group)
                out.append((name, t))
            return out

        return self._gl_stage(s, receive)

    def glmlight_commit(self, spec: str) -> dict:
        """{"update_id", "version", "buckets": n}: apply the staged update (see the module docstring)."""
        s = json.loads(spec)
        stage = self.__dict__.pop("_gl_staged", None)
        if stage is None or stage["update_id"] != s["update_id"]:
            raise RuntimeError(f"no staged update {s['update_id']!r} to commit"
                               + (f" (staged: {stage['update_id']!r})" if stage else ""))
        if stage["buckets"] != int(s.get("buckets", stage["buckets"])):
            raise RuntimeError(f"update {s['update_id']!r}: {stage['buckets']} buckets staged, "
                               f"{s['buckets']} sent")
        named = DeltaBase.expand_update(self.__dict__, stage["tensors"], s)  # a delta sync's changed elements
        problem = self._gl_update_problem()  # the client asked at start (glmlight_weight_version); again here
        if problem:
            raise RuntimeError(problem)
        self._gl_validate(named)
        self.__dict__.pop("_gl_backup", None)  # an older copy never released
        t0 = time.perf_counter()
        backup = {"update_id": s["update_id"], "version": self._gl_version(), "state": self._gl_snapshot(),
                  "delta_base": DeltaBase.current(self.__dict__)}
        t1 = time.perf_counter()
        try:
            loaded = self._gl_reload(named)
            if s.get("_fail_after_load"):  # fault injection (tests): fail once the weights are in
                raise RuntimeError("injected failure after load_weights")
        except BaseException:
            self._gl_restore(backup["state"])
            log.error("glmlight: weight update %s failed; the previous weights were restored", s["update_id"])
            raise
        self.__dict__["_gl_backup"] = backup
        self.__dict__["_gl_version_value"] = str(s["version"])
        DeltaBase.keep(self.__dict__, named, s)
        seconds = {"stage": stage["seconds"], "snapshot": t1 - t0, "reload": time.perf_counter() - t1,
                   **{f"reload_{k}": x for k, x in self.__dict__.pop("_gl_reload_seconds", {}).items()}}
        return self._gl_state(applied=True, tensors=len(named), buckets=stage["buckets"], loaded=loaded,
                              seconds=seconds)

    def glmlight_release(self, spec: str) -> dict:
        """{"update_id"}: forget the previous weights kept by that commit."""
        backup = self.__dict__.get("_gl_backup")
        if backup is not None and backup["update_id"] == json.loads(spec)["update_id"]:
            del self.__dict__["_gl_backup"]
        return self._gl_state()

    def glmlight_revert(self, spec: str) -> dict:
        """{"update_id"}: put back the weights (and version) that commit replaced."""
        backup = self.__dict__.pop("_gl_backup", None)
        uid = json.loads(spec)["update_id"]
        if backup is None or backup["update_id"] != uid:
            raise RuntimeError(f"cannot revert update {uid!r}: its previous weights are no longer kept")
        self._gl_restore(backup["state"])
        self.__dict__["_gl_version_value"] = backup["version"]
        DeltaBase.restore(self.__dict__, backup["delta_base"])
        return self._gl_state(reverted=True)

    def glmlight_abort_update(self, spec: str | None = None) -> dict:
        stage = self.__dict__.pop("_gl_staged", None)
        return self._gl_state(dropped=len(stage["tensors"]) if stage else 0)

    def load_named_tensors(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: Any = None) -> dict:
        """In-process use (`vllm.LLM.collective_rpc` with Python objects): stage and commit at once."""
        uid = f"inproc-{version}"
        self._gl_stage({"update_id": uid, "bucket": 0}, lambda: list(named_tensors))
        out = self.glmlight_commit(json.dumps({"update_id": uid, "version": version}))
        self.glmlight_release(json.dumps({"update_id": uid}))
        return out

    # ------------------------------------------------------------------ staging
    def _gl_stage(self, s: dict, receive: Any) -> dict:
        stage = self.__dict__.get("_gl_staged")
        uid, bucket = s.get("update_id"), int(s.get("bucket", 0))
        if stage is None or stage["update_id"] != uid or bucket == 0:
            stage = self.__dict__["_gl_staged"] = {"update_id": uid, "tensors": [], "buckets": 0, "seconds": 0.0}
        try:
            if bucket != stage["buckets"]:
                raise RuntimeError(f"update {uid!r}: bucket {bucket} arrived, expected {stage['buckets']}")
            t = time.perf_counter()
            named = receive()
            stage["seconds"] += time.perf_counter() - t
        except BaseException:
            self.__dict__.pop("_gl_staged", None)  # a broken update is never committed
            raise
        stage["tensors"].extend(named)
        stage["buckets"] += 1
        return self._gl_state(staged_buckets=stage["buckets"], staged_tensors=len(stage["tensors"]))

    def _gl_validate(self, named: Named) -> None:
        check_update_names(named, self._gl_expected_shapes())

    # ------------------------------------------------------------------ vLLM specifics (test seams)
    def _gl_update_problem(self) -> str | None:
        """Why this worker cannot take weight updates, or None: on vLLM-Ascend, weights in FRACTAL_NZ."""
        if not _on_ascend():
            return None
        from vllm_ascend.ascend_config import get_ascend_config

        mode = get_ascend_config().weight_nz_mode
        if not mode:
            return None
        return (f"vLLM-Ascend casts this model's weights to the FRACTAL_NZ format (weight_nz_mode={mode}), and "
                "weight updates need them in ND (vllm-ascend's own weight-update path refuses NZ for RL); start "
                """the server with --additional-config '{"weight_nz_mode": 0}' (a managed launch adds it)""")

    def _gl_model(self) -> torch.nn.Module:
        return self.model_runner.get_model()  # type: ignore[attr-defined]

    def _gl_expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Names and shapes of the checkpoint the server was started from (safetensors headers)."""
        if "_gl_shapes" not in self.__dict__:
            path = self.vllm_config.model_config.model  # type: ignore[attr-defined]
            self.__dict__["_gl_shapes"] = checkpoint_shapes(path) if os.path.exists(path) else {}
        return self.__dict__["_gl_shapes"]

    def _gl_draft_model(self) -> torch.nn.Module | None:
        """The MTP draft model of a server started with --speculative-config (the model runner's drafter, vLLM
        0.32 v1/spec_decode/eagle.py), or None. Its `load_weights` takes the checkpoint's names and keeps the MTP
        layers' (model.layers.{num_hidden_layers + k}.*, glmlight/models/mtp.py) and the shared embedding and
        head, skipping the rest (glm4_moe_mtp.py, deepseek_mtp.py)."""
        drafter = getattr(self.model_runner, "drafter", None)  # type: ignore[attr-defined]
        model = getattr(drafter, "model", None)
        return model if isinstance(model, torch.nn.Module) and model is not self._gl_model() else None

    def _gl_models(self) -> list[torch.nn.Module]:
        """What an update loads into: the served model, and its MTP draft model when it speculates."""
        draft = self._gl_draft_model()
        return [self._gl_model()] + ([draft] if draft is not None else [])

    def _gl_reload(self, named: Named) -> int:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        # vLLM-Ascend's own update path reloads under its NPU as the default device (tensors a layer's
        # loader or process_weights_after_loading creates land there, not on the CPU)
        device = torch.device(self.device) if _on_ascend() else contextlib.nullcontext()  # type: ignore[attr-defined]
        seconds = {"init": 0.0, "load": 0.0, "finalize": 0.0}
        counted = 0
        with set_current_vllm_config(self.vllm_config), torch.no_grad(), device:  # type: ignore[attr-defined]
            for i, model in enumerate(self._gl_models()):  # the served model, then a speculating server's draft
                kernels = _drop_cpu_moe_kernels(model)
                t0 = time.perf_counter()
                initialize_layerwise_reload(model)
                t1 = time.perf_counter()
                loaded = model.load_weights(weights=iter(named))
                t2 = time.perf_counter()
                finalize_layerwise_reload(model, self.vllm_config.model_config)  # type: ignore[attr-defined]
                for k, x in zip(seconds, (t1 - t0, t2 - t1, time.perf_counter() - t2)):
                    seconds[k] += x
                for qm, old in kernels:  # a MoE layer that was not reloaded keeps its kernel
                    if qm.moe_kernel is None:
                        qm.moe_kernel = old
                if i == 0:
                    counted = len(loaded) if loaded is not None else len(named)
        self.__dict__["_gl_reload_seconds"] = seconds
        reset = getattr(self.model_runner, "reset_lora_state", None)  # type: ignore[attr-defined]
        if callable(reset):
            reset()
        return counted

    def _gl_snapshot(self) -> list:
        """Everything a layerwise reload may replace, per module: its parameter and buffer objects,
        a host copy of their values (kernel tensors are written in place), its attributes (the CPU
        backend keeps the packed weight in a closure attribute) and its quant method's."""
        snap = []
        seen: set[int] = set()
        for m in (m for model in self._gl_models() for m in model.modules()):
            if id(m) in seen:  # a module the draft shares with the served model (its embedding, its head)
                continue
            seen.add(id(m))
            tensors = {**m._parameters, **m._buffers}
            data = {k: t.detach().to("cpu", copy=True) for k, t in tensors.items()
                    if t is not None and not t.is_meta and t.numel() > 0}
            attrs = {k: v for k, v in m.__dict__.items() if k not in ("_parameters", "_buffers", "_modules")}
            qm = getattr(m, "quant_method", None)
            snap.append((m, dict(m._parameters), dict(m._buffers), dict(m._modules), set(m._non_persistent_buffers_set),
                         data, attrs, dict(qm.__dict__) if qm is not None and hasattr(qm, "__dict__") else None))
        return snap

    def _gl_restore(self, snap: list) -> None:
        try:
            from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO, LOADING_LAYERS
        except ImportError:  # pragma: no cover - outside vLLM
            LAYERWISE_INFO, LOADING_LAYERS = {}, set()
        for m, params, buffers, modules, nonpersistent, data, attrs, qattrs in snap:
            info = LAYERWISE_INFO.get(m)
            if info is not None:
                info.reset()
            for k in [k for k in m.__dict__ if k not in attrs and k not in ("_parameters", "_buffers", "_modules")]:
                del m.__dict__[k]
            m.__dict__.update(attrs)
            for live, saved in ((m._parameters, params), (m._buffers, buffers), (m._modules, modules)):
                live.clear()
                live.update(saved)
            m._non_persistent_buffers_set = set(nonpersistent)
            qm = attrs.get("quant_method")
            if qattrs is not None and qm is not None:
                qm.__dict__.clear()
                qm.__dict__.update(qattrs)
            with torch.no_grad():
                for k, t in data.items():
                    live_t = params.get(k, buffers.get(k))
                    if live_t is not None and not live_t.is_meta and live_t.shape == t.shape:
                        live_t.data.copy_(t)
        LOADING_LAYERS.clear()

    def _gl_make_group(self, backend: str, init_method: str, world_size: int, rank: int, group_name: str,
                       timeout_s: float = 600.0):
        return init_custom_process_group(backend, init_method, world_size, rank, group_name, timeout_s=timeout_s)

    def _gl_broadcast(self, tensor: torch.Tensor, group: Any) -> None:
        torch.distributed.broadcast(tensor, src=0, group=group)

    # ------------------------------------------------------------------ state
    def _gl_version(self) -> str | None:
        return self.__dict__.get("_gl_version_value")

    def _gl_state(self, **extra: Any) -> dict:
        return {"weight_version": self._gl_version(), "rank": self._gl_rank(), **extra}

    def _gl_dtype(self) -> str | None:
        """The served weights' dtype ("bfloat16"), which a delta sync compares in."""
        dtype = getattr(getattr(getattr(self, "vllm_config", None), "model_config", None), "dtype", None)
        return str(dtype).removeprefix("torch.") if dtype is not None else None

    def _gl_rank(self) -> int:
        try:
            from vllm.distributed.parallel_state import get_world_group

            return int(get_world_group().rank)
        except Exception:  # noqa: BLE001 - outside vLLM (or before its groups exist)
            return int(getattr(self, "rank", 0))


def _on_ascend() -> bool:
    """Whether this worker runs on vLLM-Ascend (its platform's device type is "npu")."""
    try:
        from vllm.platforms import current_platform
    except ImportError:  # outside vLLM
        return False
    return current_platform.device_type == "npu"


def _drop_cpu_moe_kernels(model: torch.nn.Module) -> list:
    """vLLM 0.32 on CPU: on a reload `UnquantizedFusedMoEMethod._setup_kernel` sees an existing
    `moe_kernel` and skips the experts' CPU prepack, so the new expert weights would be copied
    unpacked into prepacked kernel tensors. Dropping the kernel first makes the reload build and
    prepack it again, as at the first load."""
    try:
        from vllm.platforms import current_platform
    except ImportError:  # pragma: no cover
        return []
    if not current_platform.is_cpu():
        return []
    out = []
    for m in model.modules():
        qm = getattr(m, "quant_method", None)
        if qm is not None and getattr(qm, "moe_kernel", None) is not None and hasattr(qm, "_setup_kernel"):
            out.append((qm, qm.moe_kernel))
            qm.moe_kernel = None
    return out
