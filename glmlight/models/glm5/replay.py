"""Routing replay and DSA index replay in the trainer's forward passes (model and sparse contracts).

A mixture-of-experts router and a DSA indexer make discrete choices: which experts a token goes
to, which keys a query attends. The engine and the trainer compute them from numerically different
(but equal in exact arithmetic) activations, so near-ties can fall the other way; then the trainer's
log-prob belongs to a different network path than the one that produced the action, and no ratio
correction repairs that. With replay, the trainer takes the engine's recorded choices
(`Sample.routed_experts`, `Sample.indexer_topk`) instead of recomputing them:

- replayed: the set of experts of every token at every MoE layer (routing replay, "R3", Rollout
  Routing Replay, arXiv:2510.11370 §3), and the set of selected keys of every query at every
  layer that runs its own DSA indexer (index replay; layers that share the previous layer's
  selection share the replayed one);
- recomputed, with gradients: the router's scores and the weights of the replayed experts (the
  router's own function of its scores: sigmoid, normalised and scaled for GLM-5, GLM-4.5 (Glm4Moe),
  GLM-4.7-Flash (Glm4MoeLite) and DeepSeek-V3,
  softmax restricted to the chosen experts for Qwen-MoE and Mixtral), the experts' outputs, and
  attention over the replayed keys. The DSA indexer has no gradient in either case; under index
  replay glmlight's forward runs it only when a query that selects has no record;
- not replayed: positions without a record (the last token of a sequence, which no trained token
  depends on, and padding) keep the trainer's own choice.

`Replay` carries the records of one padded batch (the `Experience` layout: [B, S, k] per layer,
-1 where a row has no record) into glmlight's GLM-5 forward (`forward.forward_logits(replay=)`)
or, through forward hooks on the routers and indexers, into the model's own forward
(`transformers_replay`). With `capture`, both also report the choices they used (what the
agreement monitors compare with the engine's).
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from glmlight.models.glm5.moe import router_weights

log = logging.getLogger(__name__)

# Routers (transformers 5) that return (router_logits, weights, expert ids), by how they weight.
SIGMOID_ROUTERS = ("GlmMoeDsaTopkRouter", "Glm4MoeTopkRouter", "Glm4MoeLiteTopkRouter", "DeepseekV3TopkRouter")
SOFTMAX_ROUTERS = ("Qwen2MoeTopKRouter", "Qwen3MoeTopKRouter", "MixtralTopKRouter")


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of a causal LM, seen through a peft wrapper (a LoRA policy keeps its base's
    routers and indexers; peft adapts only their linear layers)."""
    if hasattr(model, "peft_config") and callable(getattr(model, "get_base_model", None)):
        model = model.get_base_model()
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    return list(layers) if layers is not None else []


def router_of(layer: torch.nn.Module) -> torch.nn.Module | None:
    """The layer's routed-MoE router (a supported kind), or None."""
    gate = getattr(getattr(layer, "mlp", None), "gate", None)
    return gate if type(gate).__name__ in SIGMOID_ROUTERS + SOFTMAX_ROUTERS else None


def indexer_of(layer: torch.nn.Module) -> torch.nn.Module | None:
    """The layer's own DSA indexer (None for dense attention and for layers that share the previous
    layer's selection)."""
    ix = getattr(getattr(layer, "self_attn", None), "indexer", None)
    return ix if ix is not None and type(ix).__name__.endswith("Indexer") else None


def moe_layers(model: torch.nn.Module) -> list[int]:
    """Decoder layer indices with a routed MoE, in order (the layer axis of routing records)."""
    return [i for i, layer in enumerate(decoder_layers(model)) if router_of(layer) is not None]


def indexer_layers(model: torch.nn.Module) -> list[int]:
    """Decoder layer indices that run their own DSA indexer, in order (the layer axis of index records)."""
    return [i for i, layer in enumerate(decoder_layers(model)) if indexer_of(layer) is not None]


def routing_shape(model: torch.nn.Module) -> tuple[int, int, int] | None:
    """(MoE layers, experts per token, routed experts) of `model`, or None without a supported MoE."""
    layers = moe_layers(model)
    if not layers:
        return None
    gate = router_of(decoder_layers(model)[layers[0]])
    return len(layers), int(gate.top_k), int(getattr(gate, "num_experts", None) or gate.weight.shape[0])


def index_shape(model: torch.nn.Module) -> tuple[int, int] | None:
    """(indexer layers, index_topk) of `model`, or None without a DSA indexer."""
    layers = indexer_layers(model)
    if not layers:
        return None
    return len(layers), int(indexer_of(decoder_layers(model)[layers[0]]).index_topk)


def replayed_router_weights(gate: torch.nn.Module, logits: torch.Tensor, idx: torch.Tensor,
                            like: torch.Tensor) -> torch.Tensor:
    """The weights a transformers router gives the experts `idx` [N, k], from its `logits` [N, E]:
    what its forward computes for its own choice (dtype of `like`, its weights output)."""
    kind = type(gate).__name__
    if kind in SIGMOID_ROUTERS:
        return router_weights(gate, logits.float().sigmoid(), idx).to(like.dtype)
    w = torch.softmax(logits.float(), dim=-1).gather(1, idx)
    if kind == "MixtralTopKRouter" or getattr(gate, "norm_topk_prob", False):
        w = w / w.sum(dim=-1, keepdim=True)
    return w.to(like.dtype)


_warned: set[tuple[str, str]] = set()


def _warn_once(name: str, what: str, msg: str) -> None:
    if (name, what) not in _warned:
        _warned.add((name, what))
        log.warning(msg)


@dataclass
class Replay:
    """The choices to replay in one forward over a padded batch [B, S]: per decoder layer, expert ids
    [B, S, k] and selected key columns [B, S, k_ix] (-1: the row has no record). `capture`: a dict the
    forward fills with the choices it used, {"experts" | "index": {layer: [B, S, k] long}} (index
    rows only for queries at positions >= k_ix)."""

    experts: dict[int, torch.Tensor] = field(default_factory=dict)
    index: dict[int, torch.Tensor] = field(default_factory=dict)
    capture: dict[str, dict[int, torch.Tensor]] | None = None
    shape: tuple[int, int] | None = None  # [B, S] of the forward (a router's flattened output is captured so)

    def record(self, kind: str, layer: int, value: torch.Tensor) -> None:
        if self.capture is not None:
            self.capture.setdefault(kind, {})[layer] = value.detach()

    @classmethod
    def build(cls, model: torch.nn.Module, routed_experts: torch.Tensor | None, indexer_topk: torch.Tensor | None,
              *, routing: bool, index: bool, capture: dict | None = None, shape: tuple[int, int] | None = None,
              name: str = "model") -> "Replay | None":
        """The replay of `model` from an Experience's records ([B, S, L, k], -1 where none); None when
        nothing is replayed or captured. Records of another layout than `model`'s are not replayed into
        it; that is logged once."""
        out = cls(capture=capture, shape=shape)
        if routing and routed_experts is not None:
            shape = routing_shape(model)
            if shape is None or shape[:2] != tuple(routed_experts.shape[2:]):
                _warn_once(name, "routing", f"routing replay: the records ({tuple(routed_experts.shape[2:])} MoE "
                           f"layers x experts per token) do not fit {name} ({shape and shape[:2]}); it routes "
                           "on its own")
            else:
                out.experts = {layer: routed_experts[:, :, j].long() for j, layer in enumerate(moe_layers(model))}
        if index and indexer_topk is not None:
            shape = index_shape(model)
            if shape is None or shape != tuple(indexer_topk.shape[2:]):
                _warn_once(name, "index", f"index replay: the records ({tuple(indexer_topk.shape[2:])} indexer "
                           f"layers x top-k) do not fit {name} ({shape}); it selects on its own")
            else:
                out.index = {layer: indexer_topk[:, :, j].long() for j, layer in enumerate(indexer_layers(model))}
        return out if out.experts or out.index or capture is not None else None


# ----------------------------------------------------------------- the DSA selection as a mask
def selection_from_columns(allowed: torch.Tensor, columns: torch.Tensor,
                           own: torch.Tensor | None = None) -> torch.Tensor:
    """The boolean selection [B, S, S] of replayed key columns [B, S, k] within `allowed`; rows of -1
    take `own` (the indexer's selection), or every allowed key (right for queries with at most k keys)."""
    has = columns[..., :1] >= 0
    chosen = torch.zeros_like(allowed).scatter_(-1, columns.clamp(min=0), True)
    return torch.where(has, allowed & chosen, allowed if own is None else own)


def columns_from_selection(selected: torch.Tensor, rows: torch.Tensor, k: int) -> torch.Tensor:
    """The selected key columns [B, S, k] (ascending) of a selection mask [B, S, S] at query rows
    `rows` [B, S] (bool; each with exactly k keys selected), -1 elsewhere."""
    cols = (~selected).to(torch.uint8).argsort(dim=-1, stable=True)[..., :k]
    return torch.where(rows[..., None], cols, torch.full_like(cols, -1))


# ----------------------------------------------------------------- the model's own forward
@contextmanager
def transformers_replay(model: torch.nn.Module, replay: Replay | None) -> Iterator[None]:
    """Forward hooks on `model`'s routers and DSA indexers that replace their choices with `replay`'s
    (rows with records) and fill `replay.capture`; nothing when `replay` is None. The records are
    in the layout of the forward's input [B, S] (a router sees its B * S tokens flattened)."""
    if replay is None:
        yield
        return
    handles = []
    for i, layer in enumerate(decoder_layers(model)):
        gate, ix = router_of(layer), indexer_of(layer)
        if gate is not None:
            handles.append(gate.register_forward_hook(_router_hook(replay, i)))
        if ix is not None:
            handles.append(ix.register_forward_hook(_indexer_hook(replay, i)))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _router_hook(replay: Replay, layer: int):
    def hook(mod: torch.nn.Module, args: Any, out: tuple[torch.Tensor, torch.Tensor, torch.Tensor]):
        logits, w, idx = out
        forced = replay.experts.get(layer)
        if forced is not None:
            forced = forced.reshape(-1, forced.shape[-1]).to(idx.device)
            if forced.shape != idx.shape:
                raise RuntimeError(f"routing replay: layer {layer} records {tuple(forced.shape)} for a router "
                                   f"output of {tuple(idx.shape)}")
            idx = torch.where(forced[:, :1] >= 0, forced, idx)
            w = replayed_router_weights(mod, logits, idx, w)
        if replay.capture is not None:
            shape = replay.shape
            replay.record("experts", layer, idx.view(*shape, -1) if shape and idx.shape[0] == shape[0] * shape[1]
                          else idx)
        return logits, w, idx
    return hook


def _indexer_hook(replay: Replay, layer: int):
    def hook(mod: torch.nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        forced = replay.index.get(layer)
        if forced is not None:
            forced = forced.to(out.device)
            has = forced[..., :1] >= 0
            if forced.shape == out.shape:
                out = torch.where(has, forced.to(out.dtype), out)
            elif bool(has.any()):  # fewer keys than k in the whole batch: no query can have a record
                raise RuntimeError(f"index replay: layer {layer} records {tuple(forced.shape)} for an indexer "
                                   f"output of {tuple(out.shape)}")
        replay.record("index", layer, out.long())
        return out
    return hook
