"""`algo.replay` for every algorithm: routing replay and DSA index replay (docs/contracts.md).

- at start-up (`check_model`, `start`): the policy must have what is replayed (a supported routed
  MoE for "routing", DSA indexers for "index"), and the engine must be able to record it
  (`engine.capture_replay(routing=, index=)`; the embedded engine and the SGLang / vLLM clients can,
  the servers when started with the flags of docs/servers.md). Otherwise one-line
  ConfigError; nothing silently falls back to recomputing;
- per sample (`RecordsFilter`, applied by the module's `on_rollout_samples` hook): a sample whose
  records do not cover every position a trained token depends on is dropped and counted as
  `rollout/dropped/no_replay_records` (its group padded or dropped as for failures), with a warning;
- per forward (`replay_for`): the `Replay` of the batch's records for the policy's own forwards
  (old log-probs, the update; never the reference or a teacher: `glmlight.algorithms.scoring`),
  handed to glmlight's GLM-5 forward or installed as hooks around the model's own.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import torch

from glmlight.config.schema import CHOICES
from glmlight.groups import pad_or_drop_group
from glmlight.errors import ConfigError
from glmlight.models.glm5.replay import Replay, index_shape, routing_shape
from glmlight.engines.base import CapturesReplay
from glmlight.sample import Experience, Sample

log = logging.getLogger(__name__)

def parts(mode: str) -> tuple[bool, bool]:
    """(routing, index) of an `algo.replay` value (its values: glmlight.config.schema.CHOICES)."""
    if mode not in CHOICES["algo.replay"]:
        raise ConfigError(f"config error: algo.replay={mode!r} is not one of {list(CHOICES['algo.replay'])}")
    return mode in ("routing", "both"), mode in ("index", "both")


def check_model(policy: torch.nn.Module, mode: str) -> None:
    """ConfigError unless `policy` has what `algo.replay=mode` replays."""
    routing, index = parts(mode)
    name = type(policy).__name__
    if routing and routing_shape(policy) is None:
        raise ConfigError(f"config error: algo.replay={mode} replays MoE routing, but {name} has no routed MoE "
                          "layer of a supported kind (GlmMoeDsa, Glm4Moe, Glm4MoeLite, DeepSeek-V3, Qwen2/3-MoE, "
                          "Mixtral routers)")
    if index and index_shape(policy) is None:
        raise ConfigError(f"config error: algo.replay={mode} replays the DSA index, but {name} has no DSA indexer")


def start(module: Any, mode: str) -> None:
    """At setup: ask the engine to record what is replayed, and drop samples without records."""
    routing, index = parts(mode)
    if not (routing or index):
        return
    dm = getattr(module.trainer, "datamodule", None)
    if dm is None:  # no rollout in this fit (e.g. a module trained on prepared batches)
        return
    engine = getattr(dm, "engine", None)
    if not isinstance(engine, CapturesReplay):
        raise ConfigError(f"config error: algo.replay={mode}: the {type(engine).__name__} engine cannot return "
                          "replay records (the embedded engine, rollout=local, and the SGLang and vLLM clients can)")
    try:
        engine.capture_replay(routing=routing, index=index)
    except Exception as e:  # noqa: BLE001 - an engine that cannot: one line at start-up
        raise ConfigError(f"config error: algo.replay={mode}: {type(e).__name__}: {e}") from None
    module.records_filter = RecordsFilter(routing, index)  # the module's on_rollout_samples applies it


def covered(sample: Sample, routing: bool, index: bool) -> bool:
    """Whether the sample's records cover every position its trained tokens depend on (those before
    its last action token)."""
    acted = [t for t, m in enumerate(sample.loss_mask) if m]
    need = len(sample.prompt_ids) + acted[-1] if acted else 0
    n_routing, n_index = sample.record_positions()
    return (not routing or (n_routing is not None and n_routing >= need)) and \
        (not index or (n_index is not None and n_index >= need))


class RecordsFilter:
    """Samples without the replay records they need are dropped, counted as `dropped/no_replay_records`
    (a group with more than half of its samples left is padded)."""

    reason = "no_replay_records"

    def __init__(self, routing: bool, index: bool):
        self.routing, self.index = routing, index
        self.dropped = 0

    def __call__(self, samples: list[Sample], counts: Counter, current: int) -> list[Sample]:
        groups: dict[int, list[Sample]] = {}
        for s in samples:
            groups.setdefault(s.group_id, []).append(s)
        out = []
        for group in groups.values():
            before = counts[f"dropped/{self.reason}"]
            kept = pad_or_drop_group(group, lambda t: all(covered(s, self.routing, self.index) for s in t), counts,
                                     self.reason)
            lost = counts[f"dropped/{self.reason}"] - before
            if lost:
                self.dropped += lost
                log.warning("%d sample(s) without replay records dropped (rollout/dropped/%s; %d so far)", lost,
                            self.reason, self.dropped)
            out.extend(kept or [])
        return out


def replay_for(mode: str, model: torch.nn.Module, exp: Experience, capture: dict | None = None) -> Replay | None:
    """The Replay of `exp`'s records in a forward of `model` (None: nothing to replay or capture).
    With replay on, a batch row without records is an error (the filter keeps them out)."""
    routing, index = parts(mode)
    if not (routing or index) and capture is None:
        return None
    ran = exp.attention_mask.sum(1) - 1  # positions the engine ran per row
    for name, on, rec in (("routed_experts", routing, exp.routed_experts), ("indexer_topk", index, exp.indexer_topk)):
        if not on:
            continue
        has = None if rec is None else (rec[:, :, 0, 0] >= 0).any(1)
        needs = ran > (0 if name == "routed_experts" else rec.shape[-1] if rec is not None else 0)
        if bool(needs.any()) and (has is None or bool((needs & ~has).any())):
            raise RuntimeError(f"algo.replay={mode}: a batch row has no {name} records (such samples are dropped "
                               "before the batch is collated)")
    return Replay.build(model, exp.routed_experts, exp.indexer_topk, routing=routing, index=index, capture=capture,
                        shape=tuple(exp.input_ids.shape), name=type(model).__name__)
