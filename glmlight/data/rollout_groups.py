"""From generations to training groups (for `RolloutDataModule`, glmlight/data/rollout.py): the samples
of single-turn answers and of agent episodes, grouped by prompt (each prompt's share a new group id and
take consecutive rollout ids), and the filter that decides which groups train."""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable

from glmlight.agents.loop import episode_to_samples
from glmlight.groups import pad_or_drop_group, tag_dropped
from glmlight.data.rollout_stats import outcome
from glmlight.prompt import Prompt
from glmlight.engines.base import Generation
from glmlight.sample import Sample, Status


def answer_samples(todo: list[tuple[Prompt, list[int]]], gens: list[Generation | None], n: int, id_source: Any,
                   tokenizer: Any) -> list[Sample]:
    """The samples of `n` answers per prompt of `todo` (`gens`: prompt by prompt; None where the engine
    failed, after retries, or answered garbage: a FAILED sample)."""
    samples = []
    for k, (prompt, ids) in enumerate(todo):
        group_id = id_source.new_group_id()
        first = id_source.take_rollout_ids(n)
        for j in range(n):
            g = gens[k * n + j]
            meta = {**prompt.metadata, "label": prompt.label, "domain": prompt.domain,  # not a row's own "label" field
                    "prompt_messages": prompt.original if prompt.original is not None else prompt.messages}
            if g is None:  # the engine failed (after retries) or answered garbage
                samples.append(Sample(prompt_ids=list(ids), status=Status.FAILED, group_id=group_id,
                                      rollout_id=first + j, metadata={**meta, "engine_error": True}))
                continue
            s = Sample(prompt_ids=list(ids), response_ids=list(g.token_ids), loss_mask=[1] * len(g.token_ids),
                       rollout_logprobs=list(g.logprobs), versions=list(g.versions), status=g.status,
                       group_id=group_id, rollout_id=first + j, metadata=meta,
                       routed_experts=g.routed_experts, indexer_topk=g.indexer_topk)  # replay records, if any
            s.metadata["completion_text"] = tokenizer.decode(g.token_ids, skip_special_tokens=True)
            samples.append(s)
    return samples


def episode_trajectories(episodes: list[Any], n: int, counts: Counter, ids: Any) -> list[list[Sample]]:
    """Each episode's samples, in order: the episodes of one prompt (n of them, consecutive) share a
    new group id and take consecutive rollout ids."""
    out = []
    for k in range(0, len(episodes), n):
        group_id, first = ids.new_group_id(), ids.take_rollout_ids(n)
        for j, ep in enumerate(episodes[k:k + n]):
            out.append(episode_to_samples(ep, group_id, first + j))
            counts["agent_turns"] += ep.turns
    return out


def filter_groups(samples: list[Sample], counts: Counter, dynamic_sampling: bool,
                  requeue: Callable[[int], None]) -> list[list[Sample]]:
    """The groups of `samples` that train, repaired (`pad_or_drop_group`); the others are counted
    under their drop reason. A group with an aborted sample has its prompt `requeue`d (by prompt
    index); with `dynamic_sampling` (DAPO) a group whose outcomes all agree is dropped."""
    groups: dict[int, list[Sample]] = {}
    for s in samples:
        groups.setdefault(s.group_id, []).append(s)
    kept = []
    for group in groups.values():
        if any(s.status is Status.ABORTED for s in group):
            # A weight update aborted this group's generation: its prompt is generated again.
            counts["dropped/aborted"] += len(group)
            tag_dropped(group, "aborted")
            requeue(group[0].metadata["prompt_index"])
            continue
        group = pad_or_drop_group(group, lambda t: t[0].status is not Status.FAILED, counts, "failed",
                                  lambda t: "reward_timeout" if t[0].metadata.get("reward_timeout")
                                  else t[0].metadata.get("failure", "failed"))
        if group is None:
            continue
        # DAPO dynamic sampling keeps a group only if its verifier outcomes differ (0 < #correct < G):
        # judged on the outcome, before length shaping, so lengths alone never make a group "vary".
        if dynamic_sampling and len(group) > 1 and len({outcome(s) for s in group}) == 1:
            counts["dropped/zero_variance_group"] += len(group)
            tag_dropped(group, "zero_variance_group")
            continue
        kept.append(group)
    return kept
