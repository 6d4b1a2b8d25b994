"""RolloutDataModule: the one DataModule every algorithm shares.

Each training step it draws prompts, asks the engine for `n_samples_per_prompt`
answers per prompt (token ids and log-probs; whole multi-turn episodes for agent
tasks), scores them, applies the sample filters (failed samples, DAPO dynamic
sampling, callback filters such as the policy-version gate) and yields one
`Experience`. Every sample that is produced is either trained on or counted
under a drop reason.

mode="sync" generates each batch when the training step asks for it, with the
newest weights. mode="async" runs a producer thread that keeps the engine busy
while training runs and hands finished groups over through a bounded queue;
staleness is bounded by the queue size and by the policy-version gate.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import queue
import random
import threading
import time
from collections import Counter
from typing import Any, Callable, Iterator

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, IterableDataset

from glmlight.agents.compaction import CompactingAgentLoop
from glmlight.agents.loop import AgentLoop, episode_to_samples
from glmlight.config import RolloutConfig
from glmlight.data.groups import pad_or_drop_group
from glmlight.data.sources import Prompt, PromptSource
from glmlight.models.tokenizer import encode_chat, stop_token_ids
from glmlight.ops.advantages import soft_overlong_penalty
from glmlight.rewards.base import RewardFn, score_samples
from glmlight.rollout.base import RolloutEngine, SamplingParams
from glmlight.rollout.retry import RetryingEngine, generate_with_retries
from glmlight.sample import Experience, Sample, Status

log = logging.getLogger(__name__)

# A filter sees the samples of one round and returns those to keep; it counts what it drops.
SampleFilter = Callable[[list[Sample], Counter], list[Sample]]


class RolloutDataModule(pl.LightningDataModule):
    def __init__(self, engine: RolloutEngine, tokenizer: Any, source: PromptSource, reward_fn: RewardFn,
                 cfg: RolloutConfig, eval_source: PromptSource | None = None, num_eval_prompts: int = 64,
                 rank: int = 0, world_size: int = 1, env_factory: Callable[[], Any] | None = None,
                 max_turns: int = 4, compaction: dict[str, Any] | None = None, vocab_size: int | None = None,
                 turn_max_new_tokens: int | None = None):
        super().__init__()
        self.engine, self.tokenizer, self.source, self.reward_fn, self.cfg = engine, tokenizer, source, reward_fn, cfg
        self.env_factory, self.max_turns = env_factory, max_turns
        self.turn_max_new_tokens = turn_max_new_tokens  # agent turns: tokens per turn (None: cfg.max_new_tokens)
        self.compaction = compaction  # CompactingAgentLoop options, or None
        self.vocab_size = vocab_size  # engine answers with ids outside [0, vocab_size) are FAILED
        self.eval_source, self.num_eval_prompts = eval_source, num_eval_prompts
        self.rank, self.world_size = rank, world_size
        self.stop_ids = stop_token_ids(tokenizer)
        self.filters: list[SampleFilter] = []
        self.totals: Counter = Counter()  # lifetime accounting: produced, trained, dropped/<reason>
        self._cursor = 0  # prompts consumed from the source (per rank)
        self._next_rollout_id = 0
        self._next_group_id = 0
        self._lock = threading.RLock()  # prompt cursor, ids and totals (the async producer shares them)
        self._producer: threading.Thread | None = None
        self._queue: queue.Queue | None = None
        # async: groups the producer may have generated or be generating ahead of training; a batch
        # starts only when the trainer has taken enough of the earlier ones (see _produce)
        self._slots: threading.Semaphore | None = None
        self._stop = threading.Event()
        self._producer_error: BaseException | None = None
        self._producer_counts: Counter = Counter()
        self._inflight_cursor: int | None = None  # async: where the prompts being generated were drawn
        self._pending: list[list[Sample]] = []  # async: queued groups restored from a checkpoint
        self._requeued: list[int] = []  # source indexes of prompts whose generation a weight update aborted

    # ----------------------------------------------------------------- Lightning
    def setup(self, stage: str) -> None:
        """Shard the prompt stream across data-parallel ranks (each rank has its own engine)."""
        if self.trainer is not None:
            self.rank, self.world_size = self.trainer.global_rank, self.trainer.world_size

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_ExperienceStream(self), batch_size=None, collate_fn=lambda x: x, num_workers=0)

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue the prompt stream and the accounting exactly. In async mode
        the queued groups are saved too, and prompts still being generated will be drawn again."""
        with self._lock:
            state = {"cursor": self._cursor if self._inflight_cursor is None else self._inflight_cursor,
                     "next_rollout_id": self._next_rollout_id, "next_group_id": self._next_group_id,
                     "totals": dict(self.totals), "requeued": list(self._requeued)}
            queued = list(self._pending) + (list(self._queue.queue) if self._queue is not None else [])
            if queued:
                state["queued"] = [[smp.to_dict() for smp in g] for g in queued]
        engine_state = getattr(self.engine, "state_dict", None)
        if callable(engine_state):
            state["engine"] = engine_state()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._cursor = state["cursor"]
        self._next_rollout_id = state["next_rollout_id"]
        self._next_group_id = state["next_group_id"]
        self.totals = Counter(state["totals"])
        self._pending = [[Sample.from_dict(d) for d in g] for g in state.get("queued", [])]
        self._requeued = list(state.get("requeued", []))
        if "engine" in state and callable(getattr(self.engine, "load_state_dict", None)):
            self.engine.load_state_dict(state["engine"])

    # ----------------------------------------------------------------- prompts
    def _prompt_index(self, k: int) -> int:
        """The k-th prompt of this rank's stream: a seeded permutation per epoch, sharded by rank."""
        k = k * self.world_size + self.rank
        n = len(self.source)
        epoch, pos = divmod(k, n)
        if n > 1_000_000:  # synthetic sources are already random per index
            return pos
        return _epoch_order(self.cfg.seed, epoch, n)[pos]

    def draw_prompts(self, n: int) -> list[Prompt]:
        """The next n prompts: aborted ones first (generated again), then the stream."""
        with self._lock:
            indexes, self._requeued = self._requeued[:n], self._requeued[n:]
            fresh = n - len(indexes)
            indexes += [self._prompt_index(self._cursor + i) for i in range(fresh)]
            self._cursor += fresh
        out = []
        for i in indexes:
            p = self.source[i]
            out.append(dataclasses.replace(p, metadata={**p.metadata, "prompt_index": i}))
        return out

    def encode(self, prompt: Prompt) -> list[int]:
        return encode_chat(self.tokenizer, prompt.messages, add_generation_prompt=True)

    # ----------------------------------------------------------------- rollout
    def sampling_params(self, prompt_len: int, greedy: bool = False, max_new_tokens: int | None = None) -> SamplingParams:
        budget = min(max_new_tokens or self.cfg.max_new_tokens, self.cfg.max_context - prompt_len)
        return SamplingParams(temperature=0.0 if greedy else self.cfg.temperature, top_p=self.cfg.top_p,
                              top_k=self.cfg.top_k, max_new_tokens=max(budget, 1), stop_token_ids=self.stop_ids)

    def rollout(self, prompts: list[Prompt], n: int, counts: Counter, greedy: bool = False) -> list[Sample]:
        """Generate `n` answers (or agent episodes) per prompt and score them; grouped by prompt."""
        t0 = time.perf_counter()
        samples = self._episodes(prompts, n, counts, greedy) if self.env_factory else \
            self._single_turn(prompts, n, counts, greedy)
        counts["rollout_seconds"] += time.perf_counter() - t0
        counts["produced"] += len(samples)
        counts["rollout_tokens"] += sum(s.num_action_tokens for s in samples)
        if not self.env_factory:
            counts["engine_failed"] += sum(s.status is Status.FAILED for s in samples)
            counts["reward_failed"] += score_samples(self.reward_fn, samples)["failed"]
        else:
            counts["env_failed"] += sum(s.status is Status.FAILED for s in samples)
            counts["env_aborted"] += sum(s.status is Status.ABORTED for s in samples)
        self._apply_overlong(samples, counts)
        return samples

    def _new_group_id(self) -> int:
        with self._lock:
            self._next_group_id += 1
            return self._next_group_id - 1

    def _take_rollout_ids(self, k: int) -> int:
        with self._lock:
            start = self._next_rollout_id
            self._next_rollout_id += k
            return start

    def _single_turn(self, prompts: list[Prompt], n: int, counts: Counter, greedy: bool) -> list[Sample]:
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
        gens = generate_with_retries(self.engine, flat_ids, [self.sampling_params(len(ids), greedy) for ids in flat_ids],
                                     counts, self.cfg.engine_retries, self.cfg.engine_retry_backoff_s, self.vocab_size)
        samples = []
        for k, (prompt, ids) in enumerate(todo):
            group_id = self._new_group_id()
            first = self._take_rollout_ids(n)
            for j in range(n):
                g = gens[k * n + j]
                meta = {"label": prompt.label, "domain": prompt.domain, **prompt.metadata}
                if g is None:  # the engine failed (after retries) or answered garbage
                    samples.append(Sample(prompt_ids=list(ids), status=Status.FAILED, group_id=group_id,
                                          rollout_id=first + j, metadata={**meta, "engine_error": True}))
                    continue
                s = Sample(prompt_ids=list(ids), response_ids=list(g.token_ids), loss_mask=[1] * len(g.token_ids),
                           rollout_logprobs=list(g.logprobs), versions=list(g.versions), status=g.status,
                           group_id=group_id, rollout_id=first + j, metadata=meta)
                s.metadata["completion_text"] = self.tokenizer.decode(g.token_ids, skip_special_tokens=True)
                samples.append(s)
        return samples

    def _episodes(self, prompts: list[Prompt], n: int, counts: Counter, greedy: bool) -> list[Sample]:
        engine = RetryingEngine(self.engine, counts, self.cfg.engine_retries, self.cfg.engine_retry_backoff_s,
                                self.vocab_size)
        args = (engine, self.tokenizer, self.env_factory,
                lambda ctx: self.sampling_params(ctx, greedy, self.turn_max_new_tokens),
                self.max_turns, self.cfg.max_context)
        loop = CompactingAgentLoop(*args, **self.compaction) if self.compaction else AgentLoop(*args)
        episodes = loop.run(prompts, n)
        samples = []
        for k in range(len(prompts)):
            group_id = self._new_group_id()
            first = self._take_rollout_ids(n)
            for j in range(n):
                ep = episodes[k * n + j]
                samples.extend(episode_to_samples(ep, group_id, first + j))
                counts["agent_turns"] += ep.turns
                counts["compactions"] += len(ep.segments)
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
            if any(s.status is Status.ABORTED for s in group):
                # A weight update aborted this group's generation: its prompt is generated again.
                counts["dropped/aborted"] += len(group)
                with self._lock:
                    self._requeued.append(group[0].metadata["prompt_index"])
                continue
            group = pad_or_drop_group(group, lambda t: t[0].status is not Status.FAILED, counts, "failed")
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
        need = self.cfg.rollout_batch_size
        if self.cfg.mode == "async":
            groups = self._collect_async(need, counts)
        else:
            groups = self._collect_sync(need, counts)
        if len(groups) > need:
            counts["dropped/over_sampled"] += sum(len(set(map(id, g))) for g in groups[need:])
            groups = groups[:need]
        batch = [s for g in groups for s in g]
        counts["trained"] += len({id(s) for s in batch})
        self._account(counts)
        if not batch:
            raise RuntimeError(f"no trainable samples in this step (counts: {dict(counts)}); "
                               "check the reward function and filters")
        exp = Experience.collate(batch, pad_token_id=self.tokenizer.pad_token_id)
        exp.stats.update(_rollout_stats(batch, counts))
        return exp

    def _account(self, counts: Counter) -> None:
        with self._lock:
            self.totals.update({k: v for k, v in counts.items() if k.startswith(("produced", "trained", "dropped/"))})

    def _accept(self, samples: list[Sample], counts: Counter) -> list[list[Sample]]:
        for f in self.filters:
            samples = f(samples, counts)
        return self._filter_groups(samples, counts)

    def _collect_sync(self, need: int, counts: Counter) -> list[list[Sample]]:
        groups: list[list[Sample]] = []
        rounds = 0
        while len(groups) < need and rounds <= self.cfg.max_refill_rounds:
            missing = need - len(groups)
            samples = self.rollout(self.draw_prompts(max(missing, math.ceil(missing * self.cfg.over_sample))),
                                   self.cfg.n_samples_per_prompt, counts)
            groups.extend(self._accept(samples, counts))
            rounds += 1
            if not self.cfg.dynamic_sampling and not self.filters:
                break
        counts["refill_rounds"] = rounds - 1
        return groups

    # ----------------------------------------------------------------- async
    def _collect_async(self, need: int, counts: Counter) -> list[list[Sample]]:
        self._ensure_producer()
        groups: list[list[Sample]] = []
        while len(groups) < need:
            if self._pending:
                with self._lock:
                    group = self._pending.pop(0)
                groups.extend(self._accept(group, counts))
                continue
            try:
                group = self._queue.get(timeout=0.5)
                self._slots.release()
            except queue.Empty:
                if self._producer_error is not None:
                    raise RuntimeError("the rollout producer failed") from self._producer_error
                if not self._producer.is_alive():
                    raise RuntimeError("the rollout producer stopped")
                continue
            groups.extend(self._accept(group, counts))
        with self._lock:
            counts.update(self._producer_counts)
            self._producer_counts.clear()
        return groups

    def _ensure_producer(self) -> None:
        if self._producer is not None and self._producer.is_alive():
            return
        self._stop.clear()
        self._producer_error = None
        ahead = self.cfg.queue_size * self.cfg.rollout_batch_size
        self._queue = queue.Queue(maxsize=ahead)
        self._slots = threading.Semaphore(ahead)
        self._producer = threading.Thread(target=self._produce, name="glmlight-rollout-producer", daemon=True)
        self._producer.start()

    def _produce(self) -> None:
        try:
            while not self._stop.is_set():
                # Start a batch only when at most queue_size - 1 others wait untrained: a batch then
                # starts from the weights the trainer had when it took the batch before, and is one
                # version old when trained (queue_size=1). Without this bound the producer ran a batch
                # further ahead whenever training was slower, and the gate dropped it as too stale.
                taken = self._take_slots(self.cfg.rollout_batch_size)
                if taken < self.cfg.rollout_batch_size:
                    break  # stopping
                counts: Counter = Counter()
                with self._lock:
                    self._inflight_cursor = self._cursor
                    prompts = self.draw_prompts(self.cfg.rollout_batch_size)
                samples = self.rollout(prompts, self.cfg.n_samples_per_prompt, counts)
                with self._lock:
                    self._inflight_cursor = None
                    self.totals.update({k: v for k, v in counts.items() if k.startswith(("produced", "dropped/"))})
                    self._producer_counts.update({k: v for k, v in counts.items()
                                                  if not k.startswith(("produced", "dropped/"))})
                by_group: dict[int, list[Sample]] = {}
                for smp in samples:
                    by_group.setdefault(smp.group_id, []).append(smp)
                pending = list(by_group.values())
                for _ in range(max(0, taken - len(pending))):  # fewer groups than slots taken
                    self._slots.release()
                while pending and not self._stop.is_set():
                    try:
                        self._queue.put(pending[0], timeout=0.1)
                        pending.pop(0)
                    except queue.Full:
                        continue
                self._count_shutdown(pending)
        except BaseException as e:  # noqa: BLE001 - handed to the training thread
            self._producer_error = e
            log.error("rollout producer failed: %s: %s", type(e).__name__, e)

    def _take_slots(self, n: int) -> int:
        """Acquire up to n group slots, giving up when the producer is stopped; returns how many."""
        taken = 0
        while taken < n and not self._stop.is_set():
            if self._slots.acquire(timeout=0.1):
                taken += 1
        return taken

    def _count_shutdown(self, groups: list[list[Sample]]) -> None:
        n = sum(len(g) for g in groups)
        if n:
            with self._lock:
                self.totals["dropped/shutdown"] += n

    def stop_producer(self) -> None:
        """Stop the producer; whatever it produced and nobody trained on is counted as dropped/shutdown."""
        if self._producer is None:
            return
        self._stop.set()
        leftovers = []
        while self._producer.is_alive():
            leftovers.extend(self._drain())
            self._producer.join(timeout=0.1)
        leftovers.extend(self._drain())
        self._count_shutdown(leftovers)
        self._producer = None

    def _drain(self) -> list[list[Sample]]:
        out = []
        while self._queue is not None:
            try:
                out.append(self._queue.get_nowait())
            except queue.Empty:
                break
        return out

    def teardown(self, stage: str) -> None:
        self.stop_producer()

    def close(self) -> None:
        """Stop the producer and release the engine."""
        self.stop_producer()
        self.engine.close()

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


@functools.lru_cache(maxsize=4)
def _epoch_order(seed: int, epoch: int, n: int) -> tuple[int, ...]:
    """The prompt order of one epoch (computed once per epoch, not once per prompt)."""
    order = list(range(n))
    random.Random(seed * 7919 + epoch).shuffle(order)
    return tuple(order)


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
        "rollout/segments_per_trajectory": len(batch) / max(len({(s.group_id, s.rollout_id) for s in batch}), 1),
        "rollout/trained": float(counts["trained"]),
    }
    episodes = {(s.group_id, s.rollout_id): s.metadata for s in batch if "num_segments" in s.metadata}  # agents
    if episodes:
        stats["rollout/turns_per_episode"] = sum(m["turns"] for m in episodes.values()) / len(episodes)
        stats["rollout/tool_calls_per_episode"] = sum(m.get("env/tool_calls", 0) for m in episodes.values()) / len(episodes)
        stats["rollout/compactions_per_episode"] = sum(m["num_segments"] - 1 for m in episodes.values()) / len(episodes)
    for k in ("compactions", "agent_turns", "env_failed", "env_aborted", "reward_failed", "engine_errors",
              "invalid_tokens"):
        if k in counts:
            stats[f"rollout/{k}"] = float(counts[k])
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
