"""`build_engine(cfg, policy, tokenizer)`: the RolloutEngine a run's config asks for — the embedded
engine (`rollout=local`) or a server client (SGLang, vLLM, vLLM-Ascend). The config is a validated one
(`glmlight.config.schema.validate` checks its values and rules, and resolves rollout.server.model_path); what
is refused here can only be known while building: an engine that cannot be built, a missing library, a client
that cannot send the weights asked for, replay records the engine cannot return, a started server without a
checkpoint (a GGUF source becomes model.path after validate)."""

from __future__ import annotations

from typing import Any

import torch

from glmlight.errors import ConfigError


def build_engine(cfg: Any, policy: torch.nn.Module, tokenizer: Any, *, replay: str = "none"):
    """The engine for `cfg.rollout.backend`; `cfg` is the whole validated config. `replay`: the replay
    records the run will ask the engine for ("none", "routing", "index", "both": the builder passes
    `algo.replay`), which a server engine must be able to return."""
    r = cfg.rollout
    if r.get("engine"):
        return build_custom_engine(cfg, policy, tokenizer)
    if r.backend == "local":
        from glmlight.engines.local.engine import LocalEngine

        return LocalEngine(policy, dtype=r.dtype, device=engine_device(cfg), pad_token_id=tokenizer.pad_token_id,
                           seed=r.seed, on_weight_update=r.on_weight_update, compile=r.compile,
                           weight_format=r.weight_format, num_threads=r.num_threads,
                           speculative_depth=r.speculative.depth, speculative_auto_off=r.speculative.auto_off,
                           speculative_probe_every=r.speculative.probe_every)
    return build_server_engine(cfg, policy, replay=replay)


def build_custom_engine(cfg: Any, policy: torch.nn.Module, tokenizer: Any):
    """`rollout.engine: {_target_: pkg.make_engine, **kwargs}` -> make_engine(cfg=, policy=, tokenizer=, **kwargs)."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from glmlight.engines.base import RolloutEngine

    spec = OmegaConf.to_container(cfg.rollout.engine, resolve=True)
    try:
        engine = instantiate(spec, _partial_=True)(cfg=cfg, policy=policy, tokenizer=tokenizer)
    except Exception as e:  # noqa: BLE001
        while e.__cause__ is not None:
            e = e.__cause__
        raise ConfigError(f"config error: rollout.engine: cannot build {spec['_target_']} ({type(e).__name__}: {e})") from None
    if not isinstance(engine, RolloutEngine):
        raise ConfigError(f"config error: rollout.engine: {spec['_target_']} returned a {type(engine).__name__}, which "
                          "lacks the RolloutEngine methods (version, generate, score, update_weights, close)")
    return engine


def engine_device(cfg: Any) -> torch.device:
    """The embedded engine's device: rollout.device, else the trainer's accelerator (first device)."""
    if cfg.rollout.device:
        return torch.device(cfg.rollout.device)
    if cfg.trainer.accelerator in ("gpu", "cuda"):
        return torch.device("cuda", 0)
    if cfg.trainer.accelerator == "npu":
        from glmlight.accelerators.npu import npu_device, require_npu

        require_npu()
        return npu_device(0)
    return torch.device("cpu")


def build_server_engine(cfg: Any, policy: torch.nn.Module | None = None, *, replay: str = "none"):
    """A server client for `cfg.rollout.backend` (server engines work on token ids only and never
    re-tokenize, so they need no tokenizer). With `policy`, the client knows where the model's MoE
    and DSA layers sit in the servers' replay records (`record_layout`). `replay`: as for `build_engine`;
    a managed server is started with what returns those records."""
    from glmlight.engines.servers.launch import replay_parts, vllm_index_refusal

    r = cfg.rollout
    routing, index = replay_parts(replay)
    in_process = bool(r.server.in_process)
    if (r.server.launch or in_process) and not r.server.model_path:  # resolved by validate, after a GGUF conversion
        raise ConfigError("config error: rollout.server.launch needs rollout.server.model_path or model.path "
                          "(the checkpoint directory the server loads)")
    if r.backend != "sglang" and index:
        raise ConfigError(f"config error: algo.replay={replay} with rollout.backend={r.backend}: "
                          f"{vllm_index_refusal('vLLM')}")
    if in_process and (routing or index):
        raise ConfigError(f"config error: algo.replay={replay}: the in-process vLLM engine "
                          "(rollout.server.in_process) does not return replay records; use a vLLM server")
    try:
        import aiohttp  # noqa: F401
    except ImportError:
        raise ConfigError(f"config error: rollout.backend={r.backend} needs aiohttp; "
                          f"pip install 'glmlight[{r.backend.split('_')[0]}]'") from None
    if r.backend == "sglang":
        from glmlight.engines.servers.sglang.engine import SGLangEngine as cls
    elif in_process:
        from glmlight.engines.servers.vllm.inprocess import VLLMInProcessEngine as cls
    else:
        from glmlight.engines.servers.vllm.engine import VLLMEngine as cls
    _check_weight_format(cfg, cls)
    engine = cls.from_config(cfg) if in_process else cls.from_config(cfg, replay=(routing, index))
    if policy is not None and hasattr(engine, "capture_replay"):
        from glmlight.engines.servers.replay_codec import RecordLayout

        engine.record_layout = RecordLayout.from_model(policy)
    return engine


def _check_weight_format(cfg: Any, cls: type) -> None:
    """rollout.weight_format=fp8 with a server: the client must send the block-FP8 checkpoint layout
    (`glmlight.models.fp8_checkpoint.to_server_weights`), which it declares with `sends_fp8_weights`;
    the server's checkpoint must be block FP8."""
    if cfg.rollout.weight_format == "auto":
        return
    if not getattr(cls, "sends_fp8_weights", False):
        raise ConfigError(f"config error: rollout.weight_format={cfg.rollout.weight_format} is not supported by the "
                          f"{cfg.rollout.backend} client yet (it sends the trainer's weights unquantised); "
                          "use rollout=local, or start the server with a bf16 checkpoint and weight_format=auto")
    from glmlight.models.fp8_checkpoint import server_quantization

    server_quantization(cfg.rollout.server.model_path or "")
