"""What a rollout batch is measured by: the reward before length shaping (`outcome`) and the
`rollout/*` metrics logged every step (rewards, lengths, the share of answers cut at the length limit
and of groups whose rewards are all equal, throughput, agent statistics, replay record memory, drop
counts by reason, speculative decoding's acceptance, tokens per forward and on/off share)."""

from __future__ import annotations

from collections import Counter

import torch

from glmlight.sample import Sample, Status


def outcome(sample: Sample) -> float | None:
    """The reward before length shaping (the soft overlong penalty)."""
    if sample.reward is None:
        return None
    return sample.reward - sample.metadata.get("overlong_penalty", 0.0)


def equal_reward_group_frac(batch: list[Sample]) -> float | None:
    """The share of the batch's groups of two or more trajectories whose rewards are all equal: they have
    no learning signal under a group baseline (GRPO's advantages are 0); None when no group has two. An
    agent trajectory's segments count once (they share its reward)."""
    groups: dict[int, dict[int, float]] = {}
    for s in batch:
        groups.setdefault(s.group_id, {})[s.rollout_id] = s.reward
    sized = [set(g.values()) for g in groups.values() if len(g) > 1]
    if not sized:
        return None
    return sum(len(rewards) == 1 for rewards in sized) / len(sized)


def engine_spec_counts(engine: object) -> Counter | None:
    """The speculative decoding counters of an embedded engine that speculates (`spec_*` of `LocalEngine.stats`),
    None for any other engine."""
    if getattr(engine, "speculation", lambda: None)() is None:
        return None
    return Counter({k: v for k, v in engine.stats().items() if k.startswith("spec_")})


def spec_stats(counts: Counter) -> dict[str, float]:
    """rollout/spec_accept_rate (accepted drafts / drafted), rollout/spec_tokens_per_forward (tokens emitted per
    row and target forward over the decode rounds, plain ones counting 1) and rollout/spec_enabled (the share of
    decode rounds with speculation on) of the batch's generation; {} without speculation."""
    if not counts.get("spec_decode_rounds"):
        return {}
    stats = {"rollout/spec_tokens_per_forward": counts["spec_decode_tokens"] / counts["spec_row_forwards"],
             "rollout/spec_enabled": counts["spec_on_rounds"] / counts["spec_decode_rounds"]}
    if counts.get("spec_drafted"):
        stats["rollout/spec_accept_rate"] = counts["spec_accepted"] / counts["spec_drafted"]
    return stats


def rollout_stats(batch: list[Sample], counts: Counter) -> dict[str, float]:
    """The `rollout/*` metrics of one trained batch and the counters of the rounds that produced it."""
    rewards = torch.tensor([s.reward for s in batch], dtype=torch.float32)
    lengths = torch.tensor([s.response_length for s in batch], dtype=torch.float32)
    secs = max(counts["rollout_seconds"], 1e-9)
    stats = {
        "rollout/reward_mean": rewards.mean().item(),
        "rollout/reward_std": rewards.std(unbiased=False).item(),
        "rollout/pass_rate": (rewards >= 1.0).float().mean().item(),
        "rollout/response_length": lengths.mean().item(),
        "rollout/truncated_frac": sum(s.status is Status.TRUNCATED for s in batch) / len(batch),
        "rollout/tokens_per_s": counts["rollout_tokens"] / secs,
        "rollout/seconds": float(counts["rollout_seconds"]),  # generating this batch (async: overlapped)
        "rollout/refill_rounds": float(counts["refill_rounds"]),
        "rollout/produced": float(counts["produced"]),
        "rollout/segments_per_trajectory": len(batch) / max(len({(s.group_id, s.rollout_id) for s in batch}), 1),
        "rollout/trained": float(counts["trained"]),
    }
    flat = equal_reward_group_frac(batch)
    if flat is not None:
        stats["rollout/equal_reward_group_frac"] = flat
    episodes = {(s.group_id, s.rollout_id): s.metadata for s in batch if "num_segments" in s.metadata}  # agents
    if episodes:
        stats["rollout/turns_per_episode"] = sum(m["turns"] for m in episodes.values()) / len(episodes)
        stats["rollout/tool_calls_per_episode"] = sum(m.get("env/tool_calls", 0) for m in episodes.values()) / len(episodes)
        stats["rollout/compactions_per_episode"] = sum(m["num_segments"] - 1 for m in episodes.values()) / len(episodes)
        summaries = [n for m in episodes.values() for n in m.get("summary_lengths", ())]
        if summaries:
            stats["rollout/summary_length"] = sum(summaries) / len(summaries)
    records = [t for s in batch for t in (s.routed_experts, s.indexer_topk) if t is not None]
    if records:  # replay records (routed experts, DSA top-k): their memory per token of prompt + response
        tokens = sum(len(s.prompt_ids) + s.response_length for s in batch)
        stats["rollout/replay_bytes_per_token"] = sum(t.numel() * t.element_size() for t in records) / tokens
    stats.update(spec_stats(counts))
    for k in ("compactions", "env_rewrites", "agent_turns", "env_failed", "env_aborted", "reward_failed",
              "reward_timeout", "reward_seconds", "engine_errors", "invalid_tokens", "gateway_requests",
              "gateway_rewrites", "gateway_regenerated", "gateway_withdrawn_turns", "gateway_forced_calls",
              "gateway_forced_unparsed", "gateway_strict_mismatch", "gateway_disallowed_calls"):
        if k in counts:
            stats[f"rollout/{k}"] = float(counts[k])
    for k, v in counts.items():
        if k.startswith("dropped/"):
            stats[f"rollout/{k}"] = float(v)
    return stats
