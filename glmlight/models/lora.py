"""LoRA policies (`model.lora`, through `peft`): the adapters are trained, the base stays frozen.

- `apply_lora(model, cfg)`: wraps the policy with peft's LoRA (`rank`, `alpha`, `dropout`,
  `target_modules`); `rank = 0` leaves it as it is. Only the adapters require gradients, so the
  optimizer (built over the trainable parameters) holds only them.
- the reference model is the frozen base itself: `base_model_context(policy)` disables the adapters
  (peft's `disable_adapter`), so `algo.kl_coef > 0` needs no second copy of the model.
- `merged_named_tensors(policy)`: the base model's own state-dict names with W + (α/r)·B·A for every
  adapted layer: what a weight sync sends the engine and what an export saves. Nothing is merged in
  place, so the adapters and the base stay exactly as they are.
- `frozen_backbone(policy)`: the base model's backbone (adapters disabled, no gradients), unregistered,
  for a critic that trains only its value head on it (SAO, CompactionRL) without a copy of the base.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator, Sequence

import torch

from glmlight.errors import ConfigError

log = logging.getLogger(__name__)

# Linear layers adapted by default (module-name suffixes, as peft matches them): attention projections
# (MHA/GQA and GLM-5 / DeepSeek MLA) and dense / shared-expert MLPs. Fused MoE experts, routers and the
# DSA indexer (which runs without gradients) are not adapted.
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa",
                   "kv_b_proj", "gate_proj", "up_proj", "down_proj")


def is_lora(model: torch.nn.Module) -> bool:
    """Whether `model` is a peft-wrapped (LoRA) policy."""
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def apply_lora(model: torch.nn.Module, rank: int, alpha: float, dropout: float = 0.0,
               target_modules: Sequence[str] = DEFAULT_TARGETS) -> torch.nn.Module:
    """`model` with LoRA adapters of `rank` (scale alpha / rank) on `target_modules` ("all-linear": every
    linear layer but the LM head); rank 0 returns `model` unchanged."""
    if rank == 0:
        return model
    if rank < 0:
        raise ConfigError(f"config error: model.lora.rank must be >= 0, got {rank}")
    if not 0.0 <= dropout < 1.0:
        raise ConfigError(f"config error: model.lora.dropout must be in [0, 1), got {dropout}")
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise ConfigError("config error: model.lora.rank > 0 needs the peft package: pip install 'glmlight[lora]'") from None
    targets: Any = list(target_modules)
    if targets == ["all-linear"]:
        targets = "all-linear"
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets, bias="none",
                        task_type="CAUSAL_LM")
    try:
        with _targets_as_named():
            wrapped = get_peft_model(model, config)
    except ValueError as e:  # e.g. no module matches target_modules
        raise ConfigError(f"config error: model.lora.target_modules={list(target_modules)}: {_first_line(e)}") from None
    trainable = sum(p.numel() for p in wrapped.parameters() if p.requires_grad)
    total = sum(p.numel() for p in wrapped.parameters())
    log.info("LoRA rank %d on %d layers: %d trainable parameters of %d (%.2f%%)", rank, len(adapted_layers(wrapped)),
             trainable, total, 100.0 * trainable / max(total, 1))
    return wrapped


@contextlib.contextmanager
def _targets_as_named() -> Iterator[None]:
    """peft (>= 0.18 with transformers 5) rewrites the targets of new adapters on MoE models for adapters
    trained on transformers 4: `gate_proj` / `up_proj` / `down_proj` become the fused expert parameters,
    and the dense and shared-expert MLPs of those names lose their adapters. A new adapter means the modules
    it names, so that rewrite is switched off while the adapters are injected."""
    try:
        from peft.utils import transformers_weight_conversion as conversion
    except ImportError:  # an older peft: no rewrite
        yield
        return
    original = conversion.convert_peft_config_for_transformers
    conversion.convert_peft_config_for_transformers = lambda *args, **kwargs: None
    try:
        yield
    finally:
        conversion.convert_peft_config_for_transformers = original


def _first_line(e: BaseException) -> str:
    s = str(e).strip()
    return s.splitlines()[0] if s else type(e).__name__


def adapted_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The LoRA-wrapped layers of the base model, by their names there."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    return {name: m for name, m in base.named_modules() if isinstance(m, LoraLayer)}


def base_model_context(model: torch.nn.Module) -> contextlib.AbstractContextManager:
    """A context in which `model` computes its frozen base (adapters disabled); a no-op for a plain model."""
    return model.disable_adapter() if is_lora(model) else contextlib.nullcontext()


@torch.no_grad()
def merged_named_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The policy's weights under the base model's own state-dict names, LoRA merged (W + scale·B·A for
    the active adapters); for a plain model, its state dict. Detached; unmerged tensors are shared."""
    if not is_lora(model):
        return [(k, v.detach()) for k, v in model.state_dict().items()]
    layers = adapted_layers(model)
    deltas: dict[str, torch.Tensor] = {}
    for name, layer in layers.items():
        active = [a for a in layer.active_adapters if a in layer.lora_A]
        if layer.merged or not active:
            continue
        delta = sum(layer.get_delta_weight(a) for a in active)
        deltas[name] = delta
    out = []
    for key, t in model.get_base_model().state_dict().items():
        module, _, leaf = key.rpartition(".")
        if ".lora_" in key and key.split(".lora_", 1)[0] in layers:  # adapter tensors
            continue
        if module.endswith(".base_layer") and module[: -len(".base_layer")] in layers:
            owner = module[: -len(".base_layer")]
            if leaf == "weight" and owner in deltas:
                t = t + deltas[owner].to(t.dtype)
            key = f"{owner}.{leaf}"
        out.append((key, t.detach()))
    return out


def plain_model(model: torch.nn.Module) -> torch.nn.Module:
    """A model of the base architecture holding `merged_named_tensors(model)` (no adapters, no peft):
    what an export saves. A plain model is returned as it is."""
    if not is_lora(model):
        return model
    from transformers import AutoModelForCausalLM

    base = model.get_base_model()
    merged = dict(merged_named_tensors(model))
    with torch.device("meta"):
        clean = AutoModelForCausalLM.from_config(base.config, trust_remote_code=False)
    clean.load_state_dict(merged, strict=True, assign=True)
    # non-persistent buffers (rotary tables) are not in the state dict: take the base model's
    buffers = dict(base.named_buffers())
    for name, buf in list(clean.named_buffers()):
        if buf.is_meta:
            owner, _, leaf = name.rpartition(".")
            src = buffers.get(name) if name in buffers else buffers.get(_base_layer_name(name))
            if src is None:
                raise RuntimeError(f"cannot rebuild buffer {name!r} of the merged model")
            clean.get_submodule(owner).register_buffer(leaf, src.clone(), persistent=False)
    clean.generation_config = base.generation_config
    return clean.eval()


def _base_layer_name(name: str) -> str:
    owner, _, leaf = name.rpartition(".")
    return f"{owner}.base_layer.{leaf}"


class _FrozenBackbone(torch.nn.Module):
    """The policy's base backbone for a critic: adapters disabled, no gradients, not registered as a
    submodule (its parameters stay the policy's, outside the critic's optimizer and checkpoint)."""

    def __init__(self, policy: torch.nn.Module):
        super().__init__()
        self._policy = [policy]  # a list: not a registered submodule

    def forward(self, **kwargs: Any) -> Any:
        policy = self._policy[0]
        with policy.disable_adapter(), torch.no_grad():
            return policy.get_base_model().base_model(**kwargs)


def frozen_backbone(policy: torch.nn.Module) -> torch.nn.Module:
    """The LoRA policy's frozen base backbone (see `_FrozenBackbone`)."""
    if not is_lora(policy):
        raise ValueError("frozen_backbone needs a LoRA policy")
    return _FrozenBackbone(policy)


def trainable_state_keys(module: torch.nn.Module) -> Iterator[str]:
    """State-dict keys of `module` that a LoRA run checkpoints: every trainable parameter and every buffer
    (frozen base parameters are rebuilt from model.path / the seed and are left out)."""
    frozen = {name for name, p in module.named_parameters() if not p.requires_grad}
    for key in module.state_dict().keys():
        if key not in frozen:
            yield key


def keep_trainable_state(module: torch.nn.Module, checkpoint: dict[str, Any]) -> None:
    """A LoRA run's Lightning checkpoint keeps `trainable_state_keys` only (in place)."""
    keep = set(trainable_state_keys(module))
    checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k in keep}


def check_trainable_state(module: torch.nn.Module, checkpoint: dict[str, Any]) -> None:
    """Loading a LoRA checkpoint is not strict (the base is not in it): check every trainable tensor is."""
    missing = [k for k in trainable_state_keys(module) if k not in checkpoint.get("state_dict", {})]
    if missing:
        raise RuntimeError(f"checkpoint lacks {len(missing)} trainable tensors of this LoRA policy, e.g. "
                           f"{missing[0]!r} (was it written with another model.lora?)")
