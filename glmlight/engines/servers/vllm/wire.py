"""vLLM's wire details the client needs: the worker extension's class path, finish reasons, the
/collective_rpc errors that are permanent, server versions, token ids spelt "token_id:<id>", and
what vLLM-Ascend changes."""

from __future__ import annotations

from typing import Any

from glmlight.errors import EngineError

EXTENSION = "glmlight.engines.servers.worker.vllm_extension.WeightLoaderExtension"
FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort", "repetition": "length", "error": "error"}

# rollout=vllm_ascend: the same HTTP protocol; installing vllm-ascend registers the NPU platform
# with vLLM, so no device flag is needed. What changes for us (mirrored in conf/rollout/vllm_ascend.yaml;
# tests/unit/accelerators/test_npu_wheels.py checks each setting against vllm-ascend 0.23.0.post1 and vLLM 0.23.0):
ASCEND_OPTIONS: dict[str, Any] = {
    "device": "npu",  # vllm-ascend's NPUPlatform.device_type; logged, never passed as a flag
    "sync_backend": "hccl",  # the weight-update process group on NPUs
    # set for a managed or in-process engine unless already set; torch_npu cannot be
    # re-initialised in forked children, hence spawn
    "env": {"VLLM_WORKER_MULTIPROC_METHOD": "spawn"},
    # vllm-ascend's --additional-config for a managed or in-process engine (unless given): weights stay
    # in the ND format. With weight_nz_mode > 0 vllm-ascend casts weights to FRACTAL_NZ after loading,
    # and its own weight-update path (NPUWorker.start_weight_update) refuses to update such a model
    # ("may cause model parameter precision issues in the RL scenarios"); so does the worker extension.
    "additional_config": {"weight_nz_mode": 0},
    # inherited unchanged by a managed server: device visibility and HCCL networking
    "passthrough_env": ("ASCEND_RT_VISIBLE_DEVICES", "HCCL_IF_IP", "HCCL_SOCKET_IFNAME", "HCCL_CONNECT_TIMEOUT"),
    "llm_kwargs": {"distributed_executor_backend": "mp"},
}


def rpc_failed(status: int, text: str) -> bool:
    """A /collective_rpc 500 that retrying cannot fix: the worker raised (vllm/v1/engine/core.py
    "Call to collective_rpc method failed: ...", wrapping NotImplementedError for an unknown method)."""
    return "collective_rpc method failed" in text or "is not implemented" in text


def version_tuple(text: Any) -> tuple[int, ...]:
    out = []
    for part in str(text or "").split("."):
        digits = "".join(ch for ch in part if ch.isdigit())
        if not digits:
            break
        out.append(int(digits))
    return tuple(out)


def token_id(token: Any, url: str) -> int:
    if isinstance(token, str) and token.startswith("token_id:"):
        return int(token.split(":", 1)[1])
    raise EngineError(f"vLLM server at {url} answered /v1/completions with a token {str(token)[:40]!r} "
                      "that is not 'token_id:<id>' and no choices.0.token_ids")
