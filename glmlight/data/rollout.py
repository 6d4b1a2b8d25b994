"""RolloutDataModule: the one DataModule every algorithm shares.

Each training step it draws prompts, asks the engine for `n_samples_per_prompt`
answers per prompt (token ids and log-probs), scores them, applies the sample
filters (failed samples, DAPO dynamic sampling, callback filters such as the
policy-version gate) and yields one `Experience`. Every sample that is produced
is either in the batch or counted under a drop reason.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections import Counter
from typing import Any, Callable, Iterator

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, IterableDataset

from glmlight.config import RolloutConfig
from glmlight.data.groups import pad_or_drop_group
from glmlight.data.sources import Prompt, PromptSource
from glmlight.models.tokenizer import encode_chat, stop_token_ids
from glmlight.ops.advantages import soft_overlong_penalty
from glmlight.rewards.base import RewardFn, score_samples
from glmlight.rollout.base import RolloutEngine, SamplingParams
from glmlight.sample import Experience, Sample, Status

log = logging.getLogger(__name__)

# A filter sees the samples of one round and returns those to keep; it counts what it drops.
SampleFilter = Callable[[list[Sample], Counter], list[Sample]]


class RolloutDataModule(pl.LightningDataModule):
    def __init__(self, engine: RolloutEngine, tokenizer: Any, source: PromptSource, reward_fn: RewardFn,
                 cfg: RolloutConfig, eval_source: PromptSource | None = None, num_eval_prompts: int = 64,
                 rank: int = 0, world_size: int = 1):
        super().__init__()
        self.engine, self.tokenizer, self.source, self.reward_fn, self.cfg = engine, tokenizer, source, reward_fn, cfg
        self.eval_source, self.num_eval_prompts = eval_source, num_eval_prompts
        self.rank, self.world_size = rank, world_size
        self.stop_ids = stop_token_ids(tokenizer)
        self.filters: list[SampleFilter] = []
        self.totals: Counter = Counter()  # lifetime accounting: produced, trained, dropped/<reason>
        self._cursor = 0  # prompts consumed from the source (per rank)
        self._next_rollout_id = 0
        self._next_group_id = 0
        self._encoded: dict[int, list[int]] = {}

    # ----------------------------------------------------------------- Lightning
    def train_dataloader(self) -> DataLoader:
        return DataLoader(_ExperienceStream(self), batch_size=None, collate_fn=lambda x: x, num_workers=0)

    def state_dict(self) -> dict[str, Any]:
        return {"cursor": self._cursor, "next_rollout_id": self._next_rollout_id,
                "next_group_id": self._next_group_id, "totals": dict(self.totals)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._cursor = state["cursor"]
        self._next_rollout_id = state["next_rollout_id"]
        self._next_group_id = state["next_group_id"]
        self.totals = Counter(state["totals"])

    # ----------------------------------------------------------------- prompts
    def _prompt_index(self, k: int) -> int:
        """The k-th prompt of this rank's stream: a seeded permutation per epoch, sharded by rank."""
        k = k * self.world_size + self.rank
        n = len(self.source)
        epoch, pos = divmod(k, n)
        if n > 1_000_000:  # synthetic sources are already random per index
            return pos
        order = list(range(n))
        random.Random(self.cfg.seed * 7919 + epoch).shuffle(order)
        return order[pos]

    def draw_prompts(self, n: int) -> list[Prompt]:
        out = [self.source[self._prompt_index(self._cursor + i)] for i in range(n)]
        self._cursor += n
        return out

    def encode(self, prompt: Prompt) -> list[int]:
        return encode_chat(self.tokenizer, prompt.messages, add_generation_prompt=True)

    # ----------------------------------------------------------------- rollout
    def sampling_params(self, prompt_len: int, greedy: bool = False) -> SamplingParams:
        budget = min(self.cfg.max_new_tokens, self.cfg.max_context - prompt_len)
        return SamplingParams(temperature=0.0 if greedy else self.cfg.temperature, top_p=self.cfg.top_p,
                              top_k=self.cfg.top_k, max_new_tokens=max(budget, 1), stop_token_ids=self.stop_ids)

    def rollout(self, prompts: list[Prompt], n: int, counts: Counter, greedy: bool = False) -> list[Sample]:
        """Generate `n` answers per prompt and score them. Returns samples grouped by prompt."""
        todo: list[tuple[Prompt, list[int]]] = []
        for p in prompts:
            ids = self.encode(p)
            if len(ids) >= self.cfg.max_context:
                counts["dropped/prompt_too_long"] += n
                counts["produced"] += n
                log.warning("prompt of %d tokens exceeds max_context=%d; skipped", len(ids), self.cfg.max_context)
                continue
            todo.append((p, ids))
        flat_ids = [ids for _, ids in todo for _ in range(n)]
        params = [self.sampling_params(len(ids), greedy) for ids in flat_ids]
        t0 = time.perf_counter()
        gens = self.engine.generate(flat_ids, params)
        counts["rollout_seconds"] += time.perf_counter() - t0
        samples = []
        for k, (prompt, ids) in enumerate(todo):
            group_id = self._next_group_id
            self._next_group_id += 1
            for j in range(n):
                g = gens[k * n + j]
                s = Sample(prompt_ids=list(ids), response_ids=list(g.token_ids), loss_mask=[1] * len(g.token_ids),
                           rollout_logprobs=list(g.logprobs), versions=list(g.versions), status=g.status,
                           group_id=group_id, rollout_id=self._next_rollout_id,
                           metadata={"label": prompt.label, "domain": prompt.domain, **prompt.metadata})
                self._next_rollout_id += 1
                s.metadata["completion_text"] = self.tokenizer.decode(g.token_ids, skip_special_tokens=True)
                samples.append(s)
        counts["produced"] += len(samples)
        counts["rollout_tokens"] += sum(s.response_length for s in samples)
        reward_counts = score_samples(self.reward_fn, samples)
        counts["reward_failed"] += reward_counts["failed"]
        self._apply_overlong(samples, counts)
        return samples

    def _apply_overlong(self, samples: list[Sample], counts: Counter) -> None:
        if self.cfg.overlong == "mask":
            for s in samples:
                if s.status is Status.TRUNCATED:
                    s.loss_mask = [0] * s.response_length
                    counts["overlong_masked"] += 1
        elif self.cfg.overlong == "soft_penalty":
            scored = [s for s in samples if s.reward is not None]
            if scored:
                lengths = torch.tensor([s.response_length for s in scored])
                pen = soft_overlong_penalty(lengths, self.cfg.max_new_tokens, self.cfg.overlong_cache)
                for s, p in zip(scored, pen.tolist()):
                    s.reward += p
                    s.metadata["overlong_penalty"] = p

    def _filter_groups(self, samples: list[Sample], counts: Counter) -> list[list[Sample]]:
        groups: dict[int, list[Sample]] = {}
        for s in samples:
            groups.setdefault(s.group_id, []).append(s)
        kept = []
        for group in groups.values():
            group = pad_or_drop_group(group, [s.status is not Status.FAILED for s in group], counts, "failed")
            if group is None:
                continue
            if self.cfg.dynamic_sampling and len(group) > 1 and len({s.reward for s in group}) == 1:
                counts["dropped/zero_variance_group"] += len(group)
                continue
            kept.append(group)
        return kept

    def next_experience(self) -> Experience:
        """One training batch: exactly rollout_batch_size groups (fewer only if refills run out)."""
        counts: Counter = Counter()
        need, n = self.cfg.rollout_batch_size, self.cfg.n_samples_per_prompt
        groups: list[list[Sample]] = []
        rounds = 0
        while len(groups) < need and rounds <= self.cfg.max_refill_rounds:
            missing = need - len(groups)
            prompts = self.draw_prompts(max(missing, math.ceil(missing * self.cfg.over_sample)))
            samples = self.rollout(prompts, n, counts)
            for f in self.filters:
                samples = f(samples, counts)
            groups.extend(self._filter_groups(samples, counts))
            rounds += 1
            if not self.cfg.dynamic_sampling and not self.filters:
                break
        if len(groups) > need:
            counts["dropped/over_sampled"] += sum(len(g) for g in groups[need:])
            groups = groups[:need]
        counts["refill_rounds"] = rounds - 1
        batch = [s for g in groups for s in g]
        if not batch:
            self.totals.update({k: v for k, v in counts.items() if k.startswith(("produced", "dropped/"))})
            raise RuntimeError(f"no trainable samples after {rounds} rollout rounds (counts: {dict(counts)}); "
                               "check the reward function and filters")
        counts["trained"] += len({id(s) for s in batch})
        self.totals.update({k: v for k, v in counts.items() if k.startswith(("produced", "trained", "dropped/"))})
        exp = Experience.collate(batch, pad_token_id=self.tokenizer.pad_token_id)
        exp.stats.update(_rollout_stats(batch, counts))
        return exp

    # ----------------------------------------------------------------- evaluation
    def eval_prompts(self) -> list[Prompt]:
        if self.eval_source is None:
            return []
        return [self.eval_source[i] for i in range(min(self.num_eval_prompts, len(self.eval_source)))]

    def evaluate(self) -> dict[str, float]:
        """Greedy answers on the fixed held-out prompts: mean reward, pass rate, length."""
        prompts = self.eval_prompts()
        if not prompts:
            return {}
        counts: Counter = Counter()
        samples = self.rollout(prompts, 1, counts, greedy=True)
        scored = [s for s in samples if s.reward is not None]
        rewards = [s.reward for s in scored] or [0.0]
        return {"eval/reward": sum(rewards) / len(rewards),
                "eval/pass_rate": sum(r >= 1.0 for r in rewards) / len(rewards),
                "eval/response_length": sum(s.response_length for s in samples) / max(len(samples), 1),
                "eval/reward_failed": float(counts["reward_failed"])}


def _rollout_stats(batch: list[Sample], counts: Counter) -> dict[str, float]:
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
        "rollout/refill_rounds": float(counts["refill_rounds"]),
        "rollout/produced": float(counts["produced"]),
        "rollout/trained": float(counts["trained"]),
    }
    for k, v in counts.items():
        if k.startswith("dropped/"):
            stats[f"rollout/{k}"] = float(v)
    return stats


class _ExperienceStream(IterableDataset):
    """An endless stream of Experience batches, generated when the training step asks."""

    def __init__(self, dm: RolloutDataModule):
        self.dm = dm

    def __iter__(self) -> Iterator[Experience]:
        while True:
            yield self.dm.next_experience()
