"""Allowed values and cross-key rules of the config: the one home of the values each key may take
(`CHOICES`) and of the rules that tie keys together, both checked by `glmlight.config.schema.validate`
through `check_rules`. Numeric ranges live in `glmlight.config.ranges`.
"""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from glmlight.dtypes import DTYPES
from glmlight.errors import ConfigError

# The values each key may take, checked by validate: the one list of them. The code that acts on a key checks
# against this list too (rollout factory, algo.replay, reward executor, weight format), or the list is taken from
# the registry that implements the values (dtypes, chat questions, tool-call formats).
CHOICES = {
    "rollout.backend": ("local", "sglang", "vllm", "vllm_ascend"),
    "rollout.mode": ("sync", "async"),
    "rollout.overlong": ("none", "mask", "soft_penalty"),
    "task.source": ("synthetic", "chat", "running_sum", "jsonl", "hf"),
    "task.format": ("auto", "jsonl", "json", "parquet", "datasets"),  # glmlight/data/files.py reads them
    "task.question": ("arithmetic", "sort", "reverse", "count_letter"),  # glmlight/data/chat_tasks.py
    "rollout.on_weight_update": ("continue", "abort"),
    "rollout.server.weight_sync": ("disk", "shm", "tensor", "distributed"),
    "algo.loss_agg": ("token_mean", "seq_mean_token_mean", "constant"),
    "algo.policy_loss": ("ppo", "dis"),
    "algo.kl_estimator": ("k1", "k2", "k3"),
    "algo.old_logprobs": ("auto", "forward", "update"),
    "algo.replay": ("none", "routing", "index", "both"),
    "algo.reward_placement": ("terminal", "turns"),
    "algo.distill_loss": ("sampled", "full"),
    "model.forward": ("auto", "glmlight", "transformers"),
    "model.arch": ("glm5", "glm4moe", "glm4moe_lite"),  # glmlight/models/tiny.py ARCHES
    "algo.lr_schedule": ("constant", "cosine", "linear"),
    "logger.name": ("wandb", "csv", "none"),
    "model.warm_start.lr_schedule": ("constant", "cosine", "wsd"),
    "model.warm_start.data": ("auto", "labels", "expert"),
    "model.dtype": tuple(DTYPES),
    "rollout.dtype": tuple(DTYPES),
    "rollout.weight_format": ("auto", "fp8"),
    "logger.mode": ("offline", "online", "disabled"),
    "task.reward_options.executor": ("thread", "process"),
    "task.reward_options.style": ("auto", "sample", "trl", "verl"),
    "task.agent.gateway.reward": ("task", "agent"),
    "task.agent.gateway.tool_format": ("auto", "line", "hermes", "glm"),  # glmlight/gateway/tool_format.py
}


def check_rules(cfg: DictConfig) -> None:
    """Raise ConfigError, one line naming the key, for a value outside CHOICES or a broken cross-key rule."""
    for key, allowed in CHOICES.items():
        value = OmegaConf.select(cfg, key)
        if value is not None and value not in allowed:
            raise ConfigError(f"config error: {key}={value!r} is not one of {list(allowed)}")
    strategy = OmegaConf.select(cfg, "trainer.strategy")
    if (OmegaConf.select(cfg, "model.lora.rank") or 0) > 0 and strategy in ("fsdp", "deepspeed"):
        raise ConfigError(f"config error: model.lora with trainer.strategy={strategy} is not supported (LoRA trains "
                          "a few adapters: use trainer.strategy=ddp or auto)")
    if (OmegaConf.select(cfg, "model.mtp.layers") or 0) > 0 and (
            (OmegaConf.select(cfg, "model.lora.rank") or 0) > 0 or strategy in ("fsdp", "deepspeed")):
        what = "model.lora" if (OmegaConf.select(cfg, "model.lora.rank") or 0) > 0 else f"trainer.strategy={strategy}"
        raise ConfigError(f"config error: model.mtp.layers with {what} is not supported (the MTP layers train beside "
                          "a whole, unsharded policy: no LoRA, trainer.strategy=auto or ddp)")
    if OmegaConf.select(cfg, "rollout.compile") and OmegaConf.select(cfg, "rollout.backend") != "local":
        raise ConfigError(f"config error: rollout.compile is for the embedded engine (rollout=local); "
                          f"{OmegaConf.select(cfg, 'rollout.backend')} servers capture their own graphs")
    depth = OmegaConf.select(cfg, "rollout.speculative.depth") or 0
    backend = OmegaConf.select(cfg, "rollout.backend")
    if depth > 0 and backend != "local" and (OmegaConf.select(cfg, "rollout.server.in_process")
                                             or not OmegaConf.select(cfg, "rollout.server.launch")):
        raise ConfigError(f"config error: rollout.speculative.depth={depth} with rollout={backend} adds the server's MTP "
                          "speculative flags to a managed server's command (rollout.server.launch=true); start a server "
                          "of your own with them yourself and leave the depth at 0 (docs/servers.md, Speculative decoding)")
    if depth > 0 and backend in ("sglang", "vllm") and OmegaConf.select(cfg, "trainer.accelerator") == "cpu":
        raise ConfigError(f"config error: rollout.speculative.depth={depth} with rollout={backend} on CPU: "
                          + ("SGLang 0.5.23's CPU build cannot start speculative decoding (sgl_kernel has no "
                             "copy_all_layer_kv_cache_cpu) and verifies drafts greedily on CPU"
                             if backend == "sglang" else
                             "vLLM 0.32's CPU build answers sampled speculative requests with token 0 at log-prob 0.0 "
                             "or non-finite log-probs (HTTP 400)")
                          + "; speculate with the embedded engine (rollout=local) or on a GPU (docs/servers.md, "
                            "Speculative decoding)")
    if depth > 0 and OmegaConf.select(cfg, "rollout.compile"):
        raise ConfigError(f"config error: rollout.speculative.depth={depth} decodes eagerly: set rollout.compile=false")
    if OmegaConf.select(cfg, "algo.dual_clip_c") is not None and OmegaConf.select(cfg, "algo.policy_loss") == "dis":
        raise ConfigError("config error: algo.dual_clip_c applies to algo.policy_loss=ppo; DIS bounds the ratio with "
                          "its trust window instead (algo.dis_eps_low / algo.dis_eps_high)")
    if OmegaConf.select(cfg, "algo.old_logprobs") == "update" and (
            OmegaConf.select(cfg, "algo.ppo_epochs") > 1 or OmegaConf.select(cfg, "algo.num_minibatches") > 1):
        raise ConfigError("config error: algo.old_logprobs=update needs ppo_epochs=1 and num_minibatches=1 (every "
                          "token trained once, at θ_old); use forward or auto")
    answer_format = OmegaConf.select(cfg, "task.answer_format")
    if answer_format is not None and "{label}" not in answer_format:
        raise ConfigError(f"config error: task.answer_format={answer_format!r} must contain {{label}} (where the warm "
                          "start puts each prompt's label, e.g. \\boxed{{label}})")
    betas = OmegaConf.select(cfg, "algo.betas")
    if betas is not None and len(betas) != 2:
        raise ConfigError(f"config error: algo.betas must be two numbers [beta1, beta2], got {list(betas)}")
    if OmegaConf.select(cfg, "rollout.server.delta_sync") and (
            OmegaConf.select(cfg, "rollout.backend") not in ("vllm", "vllm_ascend")
            or OmegaConf.select(cfg, "rollout.server.weight_sync") != "tensor"):
        backend, sync = (OmegaConf.select(cfg, k) for k in ("rollout.backend", "rollout.server.weight_sync"))
        raise ConfigError("config error: rollout.server.delta_sync sends changed elements over weight_sync=tensor "
                          f"into vLLM servers (rollout=vllm or vllm_ascend); got rollout.backend={backend}, "
                          f"weight_sync={sync}")
    mix, sizes = (OmegaConf.select(cfg, f"model.warm_start.{k}") or [] for k in ("mix", "mix_batch_size"))
    if sizes and len(sizes) != len(mix):
        raise ConfigError(f"config error: model.warm_start.mix_batch_size has {len(sizes)} entries for "
                          f"{len(mix)} model.warm_start.mix tasks: give one per task, or none")
