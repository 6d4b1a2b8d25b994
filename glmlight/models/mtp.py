"""The multi-token prediction (MTP) layers of a policy: built, loaded from a checkpoint, and named as the
checkpoint and the servers name them.

GLM-4.5 and later, like DeepSeek-V3 (arXiv 2412.19437, sec. 2.2), ship `num_nextn_predict_layers` MTP layers
after the decoder layers; transformers' causal LMs drop them on load (`_keys_to_ignore_on_load_unexpected`).
glmlight keeps them on the policy as `policy.mtp` (a `MultiTokenPredictor`), so that they are trained
(`glmlight.algorithms.base`), checkpointed, synced to the engine and exported with it. Each `MtpLayer` holds

    enorm, hnorm       RMSNorms of the next token's embedding and of the previous depth's hidden state
    eh_proj            [H, 2H], no bias: the projection of their concatenation (`glmlight.ops.mtp.mtp_input`)
    self_attn, mlp, input_layernorm, post_attention_layernorm
                       one decoder block of the model's own layer class (GLM-5: MLA + DSA indexer + MoE)
    shared_head.norm   the final norm of the depth

and shares the embedding and the output head with the main model. The MTP block is built as the layer
`num_hidden_layers + k` of the model (an MoE layer; its own DSA indexer), as both servers build it.

Names. The trainer's `mtp.layers.{k}.X` is the checkpoint's `model.layers.{L + k}.X` (L = num_hidden_layers),
the names SGLang 0.5.23 (`deepseek_nextn.py`, `glm4_moe_nextn.py`: the spec names `enorm`, `hnorm`,
`eh_proj`, `shared_head.norm` go to the NextN model, the rest to its decoder block) and vLLM 0.32
(`deepseek_mtp.py`, `glm4_moe_mtp.py`: the rest under `mtp_block`) load. A checkpoint also carries each MTP
layer's copies of the shared tensors, `model.layers.{L + k}.embed_tokens.weight` and
`.shared_head.head.weight`, as DeepSeek-V3's does (vLLM's DeepSeek MTP loader reads the head from there;
SGLang takes the target model's): exports write them, loading reads the main model's instead.
config.json's `num_nextn_predict_layers` says how many there are.
"""

from __future__ import annotations

import copy
import glob
import json
import logging
import os
import re
from typing import Iterable, Iterator

import torch
from torch import nn

from glmlight.errors import ConfigError

log = logging.getLogger(__name__)

# What an MTP layer has beside its decoder block (the "spec" names of the servers' MTP loaders).
OWN_MODULES = ("enorm", "hnorm", "eh_proj", "shared_head")
# The checkpoint's per-layer copies of the tensors the MTP layers share with the main model.
SHARED_COPIES = {"embed_tokens.weight": "model.embed_tokens.weight", "shared_head.head.weight": "lm_head.weight"}
PREFIX = "mtp.layers."
_TRAINER = re.compile(r"^mtp\.layers\.(\d+)\.(.+)$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class MtpLayer(nn.Module):
    """One MTP depth (see the module docstring): its own norms and projection, and the children of `block`, a
    decoder layer of the model's class built as layer num_hidden_layers + k; `block_forward` runs them as
    that class's forward."""

    gradient_checkpointing = False  # read by transformers' layer-forward wrapper (GradientCheckpointingLayer)

    def __init__(self, block: nn.Module, hidden_size: int, eps: float):
        super().__init__()
        norm = type(block.input_layernorm)
        self.enorm, self.hnorm = norm(hidden_size, eps=eps), norm(hidden_size, eps=eps)
        self.eh_proj = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.shared_head = nn.Module()
        self.shared_head.norm = norm(hidden_size, eps=eps)
        for name, child in block.named_children():
            self.add_module(name, child)
        self._block_class = type(block)

    def block_forward(self, hidden_states: torch.Tensor, **kwargs) -> torch.Tensor:
        """The decoder block's forward (its class's, over this layer's children); the hidden states only."""
        out = self._block_class.forward(self, hidden_states, **kwargs)
        return out[0] if isinstance(out, tuple) else out


class MultiTokenPredictor(nn.Module):
    """The MTP layers of a model, depth 1 first; `first_layer` = the model's num_hidden_layers."""

    def __init__(self, layers: list[MtpLayer], first_layer: int):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.first_layer = first_layer


def mtp_of(model: nn.Module) -> MultiTokenPredictor | None:
    """The MTP layers `attach_mtp` gave `model`, or None."""
    mtp = getattr(model, "mtp", None)
    return mtp if isinstance(mtp, MultiTokenPredictor) else None


def num_mtp_layers(model: nn.Module) -> int:
    mtp = mtp_of(model)
    return len(mtp.layers) if mtp is not None else 0


def block_config(config, n: int):
    """A copy of `config` whose per-layer lists reach layer num_hidden_layers + n - 1: MoE MLPs, own DSA
    indexers (what both servers build for an MTP layer)."""
    cfg = copy.deepcopy(config)
    extra = {"mlp_layer_types": "sparse", "indexer_types": "full", "layer_types": None}
    for key, value in extra.items():
        have = getattr(cfg, key, None)
        if isinstance(have, (list, tuple)) and have:
            setattr(cfg, key, list(have) + [value if value is not None else have[-1]] * n)
    return cfg


def new_mtp_layers(model: nn.Module, indices: Iterable[int], seed: int) -> list[MtpLayer]:
    """Freshly initialised MTP layers of depths `indices` (0-based) for `model`, with the model's own weight
    initialisation, from `seed` (the global RNG is left as it was)."""
    from glmlight.models.glm5.indexer import install_fast_indexer

    cfg, L = model.config, model.config.num_hidden_layers
    indices = list(indices)
    if not indices:
        return []
    block_class = type(model.model.layers[-1])
    bcfg = block_config(cfg, max(indices) + 1)
    eps = getattr(cfg, "rms_norm_eps", 1e-6)
    dtype = model.model.embed_tokens.weight.dtype
    layers = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for k in indices:
            layer = MtpLayer(block_class(bcfg, L + k), cfg.hidden_size, eps)
            for mod in layer.modules():
                model._init_weights(mod)
            install_fast_indexer(layer)
            layers.append(layer.to(dtype))
    return layers


def checkpoint_mtp_count(path: str | None, config) -> int:
    """How many MTP layers the checkpoint at `path` declares (config.json's num_nextn_predict_layers; 0 without
    a checkpoint)."""
    return int(getattr(config, "num_nextn_predict_layers", 0) or 0) if path else 0


def _safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return sorted({os.path.join(path, v) for v in json.load(f)["weight_map"].values()})
    return sorted(glob.glob(os.path.join(path, "*.safetensors")))


def stored_mtp_layers(path: str, first_layer: int, declared: int) -> int:
    """How many of the `declared` MTP layers the weights of `path` hold tensors of (from the first on; names only
    are read). A checkpoint transformers saved holds none: its models drop them."""
    from safetensors import safe_open

    found: set[int] = set()
    for file in _safetensors_files(path):
        with safe_open(file, framework="pt") as f:
            found.update(int(m.group(1)) - first_layer for key in f.keys() if (m := _LAYER.match(key)))
    n = 0
    while n < declared and n in found:
        n += 1
    return n


def read_checkpoint_mtp(path: str, first_layer: int, n: int) -> dict[str, torch.Tensor]:
    """The tensors of MTP layers 0..n-1 in the safetensors files of `path`, under the trainer's names
    (`mtp.layers.{k}.X`), without the per-layer copies of the shared embedding and head; per-expert weights fused
    as the model holds them (`fuse_experts`)."""
    from safetensors import safe_open

    files = _safetensors_files(path)
    out: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                m = _LAYER.match(key)
                if m is None or not first_layer <= int(m.group(1)) < first_layer + n:
                    continue
                rest = key[m.end():]
                if rest in SHARED_COPIES:
                    continue
                out[f"{PREFIX}{int(m.group(1)) - first_layer}.{rest}"] = f.get_tensor(key)
    return fuse_experts(out)


_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def fuse_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert weights as checkpoints store them (`P.experts.{e}.gate_proj / up_proj / down_proj.weight`) as the
    fused tensors transformers' MoE models hold (`P.experts.gate_up_proj` [E, 2I, H], gate rows first;
    `P.experts.down_proj` [E, H, I]); everything else unchanged."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for name, t in tensors.items():
        m = _EXPERT.match(name)
        if m is None:
            out[name] = t
        else:
            experts.setdefault(m.group(1), {}).setdefault(m.group(3), {})[int(m.group(2))] = t
    for prefix, parts in experts.items():
        n = 1 + max(max(p) for p in parts.values())
        try:
            out[f"{prefix}.gate_up_proj"] = torch.stack(
                [torch.cat([parts["gate_proj"][e], parts["up_proj"][e]]) for e in range(n)])
            out[f"{prefix}.down_proj"] = torch.stack([parts["down_proj"][e] for e in range(n)])
        except KeyError:
            raise ConfigError(f"config error: the checkpoint's MTP experts {prefix}.0..{n - 1} lack a gate_proj, up_proj "
                              "or down_proj weight") from None
    return out


def attach_mtp(model: nn.Module, layers: int | None, *, path: str | None = None, seed: int = 0,
               key: str = "model.mtp.layers") -> int:
    """Give `model` its MTP layers (`model.mtp`, and config.num_nextn_predict_layers): `layers` None = the
    checkpoint's own; N = N layers, the checkpoint's first ones loaded and the rest initialised from `seed`;
    0 = none. Returns how many. A checkpoint whose MTP tensors are missing or of another shape stops the run
    with one line."""
    cfg = model.config
    declared = checkpoint_mtp_count(path, cfg)
    have = stored_mtp_layers(path, cfg.num_hidden_layers, declared) if declared else 0
    if have < declared:
        log.info("%s: config.json declares %d MTP layer(s) (num_nextn_predict_layers), its weights hold %d (a "
                 "checkpoint transformers saved holds none: its models drop them)", path, declared, have)
    n = have if layers is None else layers
    if n and not hasattr(getattr(model, "model", None), "layers"):
        raise ConfigError(f"config error: {key}={n}: {type(model).__name__} has no decoder layers to build MTP "
                          "layers from")
    if hasattr(cfg, "num_nextn_predict_layers") or n:
        cfg.num_nextn_predict_layers = n
    if not n:
        if have:
            log.info("%s: the checkpoint's %d MTP layer(s) are not kept (%s=0)", path, have, key)
        return 0
    L = cfg.num_hidden_layers
    loaded = min(have, n)
    mtp_layers = new_mtp_layers(model, range(n), seed)
    mtp = MultiTokenPredictor(mtp_layers, L)
    if loaded:
        state = read_checkpoint_mtp(path, L, loaded)
        want = {k: v for k, v in mtp.state_dict().items() if int(k.split(".")[1]) < loaded}
        missing = sorted(set(want) - {k[len("mtp."):] for k in state})
        if missing:
            raise ConfigError(f"config error: model.path={path!r}: config.json declares {declared} MTP layer(s) "
                              f"(num_nextn_predict_layers) but the weights lack some of their tensors, e.g. "
                              f"{_checkpoint_name(PREFIX + missing[0][len('layers.'):], L)}")
        for name, t in state.items():
            target = want.get(name[len("mtp."):])
            if target is None:
                raise ConfigError(f"config error: model.path={path!r}: {_checkpoint_name(name, L)} has no place in "
                                  f"the MTP layer built from config.json")
            if tuple(t.shape) != tuple(target.shape):
                raise ConfigError(f"config error: model.path={path!r}: {_checkpoint_name(name, L)} is "
                                  f"{list(t.shape)} in the weights but {list(target.shape)} by config.json")
        mtp.load_state_dict({k[len("mtp."):]: v for k, v in state.items()}, strict=False)
    model.mtp = mtp
    log.info("MTP: %d layer(s) after the %d decoder layers (%d from %s, %d freshly initialised)", n, L, loaded,
             path or "the checkpoint", n - loaded)
    return n


def _checkpoint_name(name: str, first_layer: int) -> str:
    m = _TRAINER.match(name)
    return name if m is None else f"model.layers.{first_layer + int(m.group(1))}.{m.group(2)}"


def is_mtp_checkpoint_name(name: str, first_layer: int) -> bool:
    """Whether a checkpoint name belongs to an MTP layer (`model.layers.{N}.*`, N >= first_layer)."""
    m = _LAYER.match(name)
    return m is not None and int(m.group(1)) >= first_layer


def first_layer_of(names: Iterable[str]) -> int:
    """The first MTP layer's checkpoint index: one past the highest decoder layer among `names`."""
    return 1 + max((int(m.group(1)) for n in names if (m := _LAYER.match(n))), default=-1)


def to_checkpoint_names(named: Iterable[tuple[str, torch.Tensor]],
                        first_layer: int | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The trainer's named tensors with the MTP layers' under checkpoint names (`model.layers.{L + k}.X`); the
    rest unchanged. `first_layer` (L): from the names when None (one past the last decoder layer)."""
    named = list(named)
    L = first_layer if first_layer is not None else first_layer_of(n for n, _ in named)
    for name, t in named:
        yield _checkpoint_name(name, L), t


def checkpoint_tensors(named: Iterable[tuple[str, torch.Tensor]], first_layer: int) -> list[tuple[str, torch.Tensor]]:
    """What a checkpoint holds of a policy's named tensors: `to_checkpoint_names`, plus each MTP layer's copies of
    the shared embedding and output head (the main model's `model.embed_tokens.weight` and `lm_head.weight`; the
    embedding where the head is tied)."""
    out = list(to_checkpoint_names(named, first_layer))
    by_name = dict(out)
    depths = sorted({int(_LAYER.match(n).group(1)) for n, _ in out if is_mtp_checkpoint_name(n, first_layer)})
    for layer in depths:
        for leaf, source in SHARED_COPIES.items():
            t = by_name.get(source, by_name.get("model.embed_tokens.weight"))
            if t is not None:
                out.append((f"model.layers.{layer}.{leaf}", t))
    return out
