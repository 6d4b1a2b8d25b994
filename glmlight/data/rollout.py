"""RolloutDataModule: the one DataModule every algorithm shares.

Each training step it draws prompts (`PromptStream`), asks the engine for `n_samples_per_prompt`
answers per prompt (token ids and log-probs; whole multi-turn episodes for agent tasks), scores
them, passes each round's samples through the `on_rollout_samples` hooks (`glmlight.hooks`: the
policy-version gate, replay's records check), applies its own filters (failed samples, DAPO dynamic
sampling) and yields one `Experience`. Every sample that is produced is
either trained on or counted under a drop reason.

mode="sync" generates each batch when the training step asks for it, with the newest weights.
mode="async" hands generation to an `AsyncProducer` thread that keeps the engine busy while
training runs; staleness is bounded by the queue size and by the policy-version gate.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, IterableDataset

from glmlight.agents.compaction import CompactingAgentLoop
from glmlight.agents.loop import AgentLoop
from glmlight.agents.options import AgentOptions
from glmlight.config.schema import EvalConfig
from glmlight.config.rollout import RolloutConfig
from glmlight.data import evaluation
from glmlight.data.rollout_groups import answer_samples, episode_trajectories, filter_groups
from glmlight.data.rollout_stats import engine_spec_counts, rollout_stats
from glmlight.data.shaping import apply_overlong
from glmlight.groups import tag_dropped
from glmlight.data.producer import AsyncProducer
from glmlight.prompt import Prompt, PromptSource
from glmlight.data.stream import PromptStream
from glmlight.hooks import call_rl_hooks, implementers
from glmlight.models.tokenizer import PromptEncodingError, encode_prompt, stop_token_ids
from glmlight.rewards.base import RewardFn, RewardRunner, score_samples
from glmlight.engines.base import HasState, RolloutEngine, SamplingParams
from glmlight.engines.retry import RetryingEngine, generate_with_retries
from glmlight.sample import Experience, Sample, Status
from glmlight.split import overlap

log = logging.getLogger(__name__)

class RolloutDataModule(pl.LightningDataModule):
    """Each part gets its own section: `rollout` (rollout.*: sampling, batch, filters, mode), `agent` (the agent
    options resolved from task.agent; default: single-turn), `eval_cfg` (eval.*) with the held-out `eval_sets` by
    name (the task's own, "heldout", first; a bare source is all its prompts)."""

    deterministic = False  # trainer.deterministic=true (set by Run.fit): weight pushes wait for whole batches

    def __init__(self, engine: RolloutEngine, tokenizer: Any, source: PromptSource, reward_fn: RewardFn,
                 rollout: RolloutConfig, agent: AgentOptions | None = None, eval_cfg: EvalConfig | None = None,
                 eval_sets: dict[str, PromptSource | evaluation.EvalSet] | None = None, vocab_size: int | None = None,
                 policy_version: Callable[[], int] = lambda: 0):
        super().__init__()
        self.engine, self.tokenizer, self.source, self.reward_fn = engine, tokenizer, source, reward_fn
        self.cfg, self.agent, self.eval_cfg = rollout, agent or AgentOptions(), eval_cfg or EvalConfig()
        self.vocab_size = vocab_size  # engine answers with ids outside [0, vocab_size) are FAILED
        self.eval_sets: dict[str, evaluation.EvalSet] = {
            name: s if isinstance(s, evaluation.EvalSet) else evaluation.EvalSet(s) for name, s in (eval_sets or {}).items()}
        # Per set, the fraction of its prompts that can occur in training (glmlight.split.overlap): logged with
        # every evaluation as eval/<set>/overlap, warned about once at start-up when not 0.
        self.eval_overlap = {name: overlap(source, s.prompts()) for name, s in self.eval_sets.items()}
        self.stream = PromptStream(source, rollout.seed)  # sharded across data-parallel ranks in `setup`
        self.stop_ids = stop_token_ids(tokenizer)
        self.policy_version = policy_version  # the version of the weights training is at (the module's)
        self.totals: Counter = Counter()  # lifetime accounting: produced, trained, dropped/<reason>
        self._producer: AsyncProducer | None = None
        self._pending: list[list[Sample]] = []  # async: queued groups restored from a checkpoint
        self._pending_counts: Counter = Counter()  # ... and the per-batch counts of their generation
        # Held while the async producer generates a batch and while evaluation runs on the same engine,
        # so the two never share a decode batch (evaluation must not change training's log-probs).
        self.generation_lock = threading.Lock()
        self.last_dropped: list[Sample] = []  # the latest batch's dropped samples (metadata["drop_reason"])

    # ----------------------------------------------------------------- Lightning
    def setup(self, stage: str) -> None:
        """Say once which held-out sets share prompts with training; shard the prompt stream across data-parallel
        ranks (each rank has its own engine, whose sampling seeds are its own: the same seeds on every rank would
        correlate their samples)."""
        for name, frac in self.eval_overlap.items():
            if frac is None:
                log.warning("eval set %r: its overlap with the training prompts cannot be told (the training source "
                            "has no `contains` and is too large to scan)", name)
            elif frac > 0 and (self.trainer is None or self.trainer.global_rank == 0):
                log.warning("eval set %r is not held out: %.1f%% of its prompts can occur in training "
                            "(eval/%s/overlap); its figures partly measure trained-on prompts", name, 100 * frac, name)
        if self.trainer is not None:
            rank = self.trainer.global_rank
            self.stream.shard(rank, self.trainer.world_size)
            state = self.engine.state_dict() if isinstance(self.engine, HasState) else {}
            if rank and "generator" in state:
                state["generator"] = torch.Generator().manual_seed(self.cfg.seed + 7919 * rank).get_state()
                self.engine.load_state_dict(state)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_ExperienceStream(self), batch_size=None, collate_fn=lambda x: x, num_workers=0)

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue the prompt stream and the accounting exactly. In async mode
        the queued groups are saved too, and prompts still being generated will be drawn again."""
        with self.stream.lock:
            producer = self._producer
            state = self.stream.state_dict(cursor=producer.inflight_cursor if producer is not None else None)
            state["totals"] = dict(self.totals)
            queued = list(self._pending) + (producer.queued() if producer is not None else [])
            if queued:
                state["queued"] = [[smp.to_dict() for smp in g] for g in queued]
                # what generating them counted (tokens, seconds, reward failures): the batch that trains them logs it
                pending = Counter(self._pending_counts)
                pending.update(producer.pending_counts() if producer is not None else {})  # (+ would drop zeros)
                state["queued_counts"] = dict(pending)
        if isinstance(self.engine, HasState):
            state["engine"] = self.engine.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stream.load_state_dict(state)
        self.totals = Counter(state["totals"])
        self._pending = [[Sample.from_dict(d) for d in g] for g in state.get("queued", [])]
        self._pending_counts = Counter(state.get("queued_counts", {}))
        if "engine" in state and isinstance(self.engine, HasState):
            self.engine.load_state_dict(state["engine"])

    # ----------------------------------------------------------------- prompts
    def draw_prompts(self, n: int) -> list[Prompt]:
        """The next n prompts: aborted ones first (generated again), then the stream."""
        return self.stream.draw(n)

    def encode(self, prompt: Prompt) -> list[int]:
        """The prompt's ids; PromptEncodingError for one that cannot be used (counted, skipped)."""
        return encode_prompt(self.tokenizer, prompt.messages)

    # ----------------------------------------------------------------- rollout
    def sampling_params(self, prompt_len: int, greedy: bool = False, max_new_tokens: int | None = None) -> SamplingParams:
        budget = min(max_new_tokens or self.cfg.max_new_tokens, self.cfg.max_context - prompt_len)
        return SamplingParams(temperature=0.0 if greedy else self.cfg.temperature, top_p=self.cfg.top_p,
                              top_k=self.cfg.top_k, max_new_tokens=max(budget, 1), stop_token_ids=self.stop_ids)

    def rollout(self, prompts: list[Prompt], n: int, counts: Counter, greedy: bool = False, *,
                engine: RolloutEngine | None = None, ids: Any = None) -> list[Sample]:
        """Generate `n` answers (or agent episodes) per prompt and score them; grouped by prompt.
        `engine` (default: the data module's) generates; `ids` (default: the prompt stream) hands
        out the group and rollout ids (evaluation passes its own of both)."""
        t0 = time.perf_counter()
        engine = self.engine if engine is None else engine
        ids = self.stream if ids is None else ids
        episodic = [p for p in prompts if self.is_episode(p)]
        single = [p for p in prompts if not self.is_episode(p)]
        samples, reward_seconds = [], 0.0
        spec_before = engine_spec_counts(engine)  # speculative decoding's counters (the embedded engine's)
        if episodic:
            episodes = self._episodes(episodic, n, counts, greedy, engine, ids)
            counts["env_failed"] += sum(s.status is Status.FAILED for s in episodes)
            counts["env_aborted"] += sum(s.status is Status.ABORTED for s in episodes)
            samples += episodes
        if single:
            answers = self._single_turn(single, n, counts, greedy, engine, ids)
            counts["engine_failed"] += sum(s.status is Status.FAILED for s in answers)
            t1 = time.perf_counter()
            scored = score_samples(self.reward_fn, answers)
            reward_seconds = time.perf_counter() - t1
            counts["reward_seconds"] += reward_seconds
            counts["reward_failed"] += scored["failed"]
            counts["reward_timeout"] += scored["timeout"]
            samples += answers
        if spec_before is not None:
            counts.update(engine_spec_counts(engine) - spec_before)
        counts["rollout_seconds"] += time.perf_counter() - t0 - reward_seconds
        counts["produced"] += len(samples)
        counts["rollout_tokens"] += sum(s.num_action_tokens for s in samples)
        apply_overlong(samples, self.cfg.overlong, self.cfg.max_new_tokens, self.cfg.overlong_cache, counts)
        return samples

    def is_episode(self, prompt: Prompt) -> bool:
        """Whether `prompt` runs as an agent episode (an environment or an agent program, and its domain listed or
        none listed)."""
        return self.agent.episodic and (not self.agent.domains or prompt.domain in self.agent.domains)

    def _single_turn(self, prompts: list[Prompt], n: int, counts: Counter, greedy: bool, engine: RolloutEngine,
                     id_source: Any) -> list[Sample]:
        todo: list[tuple[Prompt, list[int]]] = []
        for p in prompts:
            try:
                ids = self.encode(p)
            except PromptEncodingError as e:
                counts[f"dropped/{e.reason}"] += n
                counts["produced"] += n
                log.warning("prompt %s skipped: %s", p.metadata.get("prompt_index"), e)
                continue
            if len(ids) >= self.cfg.max_context:
                counts["dropped/prompt_too_long"] += n
                counts["produced"] += n
                log.warning("prompt of %d tokens exceeds max_context=%d; skipped", len(ids), self.cfg.max_context)
                continue
            todo.append((p, ids))
        flat_ids = [ids for _, ids in todo for _ in range(n)]
        gens = generate_with_retries(engine, flat_ids, [self.sampling_params(len(ids), greedy) for ids in flat_ids],
                                     counts, self.cfg.engine_retries, self.cfg.engine_retry_backoff_s, self.vocab_size)
        return answer_samples(todo, gens, n, id_source, self.tokenizer)

    def _episodes(self, prompts: list[Prompt], n: int, counts: Counter, greedy: bool, engine: RolloutEngine,
                  ids: Any) -> list[Sample]:
        engine = RetryingEngine(engine, counts, self.cfg.engine_retries, self.cfg.engine_retry_backoff_s,
                                self.vocab_size)
        agent = self.agent
        params = lambda ctx: self.sampling_params(ctx, greedy, agent.turn_max_new_tokens)  # noqa: E731
        if agent.gateway is not None:
            return self._gateway_episodes(prompts, n, counts, engine, params, ids)
        args = (engine, self.tokenizer, agent.env_factory, params, agent.max_turns, self.cfg.max_context,
                agent.observation_role)
        loop = CompactingAgentLoop(*args, **agent.compaction) if agent.compaction else AgentLoop(*args)
        episodes = loop.run(prompts, n)
        for ep in episodes:  # segments: compactions and turns the chat template renders otherwise (rewrites)
            counts["compactions"] += ep.info.get("compactions", 0)
            counts["env_rewrites"] += ep.info.get("rewrites", 0)
        return [s for t in episode_trajectories(episodes, n, counts, ids) for s in t]

    def _gateway_episodes(self, prompts: list[Prompt], n: int, counts: Counter, engine: RolloutEngine,
                          params: Callable[[int], SamplingParams], ids: Any) -> list[Sample]:
        """Episodes of the user's agent program through the agent gateway (glmlight/gateway)."""
        from glmlight.gateway.runner import GatewayRollout, score_episodes

        gateway = self.agent.gateway
        rollout = GatewayRollout(engine, self.tokenizer, gateway, params, self.agent.max_turns, self.cfg.max_context,
                                 counts)
        episodes = rollout.run(prompts, n)
        trajectories = episode_trajectories([e.ep for e in episodes], n, counts, ids)
        score_episodes(episodes, trajectories, self.reward_fn, gateway.reward, counts)
        return [s for t in trajectories for s in t]

    def _filter_groups(self, samples: list[Sample], counts: Counter) -> list[list[Sample]]:
        return filter_groups(samples, counts, self.cfg.dynamic_sampling, self.stream.requeue)

    def next_experience(self) -> Experience:
        """One training batch: exactly rollout_batch_size groups (fewer only if refills run out)."""
        counts: Counter = Counter()
        need = self.cfg.rollout_batch_size
        self.last_dropped = []
        if self.cfg.mode == "async":
            groups = self._collect_async(need, counts)
        else:
            groups = self._collect_sync(need, counts)
        if len(groups) > need:
            counts["dropped/over_sampled"] += sum(len(set(map(id, g))) for g in groups[need:])
            self._note_dropped([s for g in groups[need:] for s in tag_dropped(g, "over_sampled")])
            groups = groups[:need]
        batch = [s for g in groups for s in g]
        counts["trained"] += len({id(s) for s in batch})
        self._account(counts)
        if not batch:
            raise RuntimeError(f"no trainable samples in this step (counts: {dict(counts)}); "
                               "check the reward function and filters")
        exp = Experience.collate(batch, pad_token_id=self.tokenizer.pad_token_id)
        exp.stats.update(rollout_stats(batch, counts))
        return exp

    def _account(self, counts: Counter) -> None:
        with self.stream.lock:
            self.totals.update({k: v for k, v in counts.items() if k.startswith(("produced", "trained", "dropped/"))})

    def _accept(self, samples: list[Sample], counts: Counter) -> list[list[Sample]]:
        produced = samples
        samples = call_rl_hooks(self.trainer, "on_rollout_samples", samples, counts, int(self.policy_version()))
        groups = self._filter_groups(samples, counts)
        kept = {id(s) for g in groups for s in g}
        self._note_dropped([s for s in produced if id(s) not in kept])
        return groups

    def _note_dropped(self, samples: list[Sample], keep: int = 256) -> None:
        """Remember (a bounded number of) this batch's dropped samples for the sample table."""
        for s in samples:
            s.metadata.setdefault("drop_reason", "filtered")
        self.last_dropped.extend(samples[: max(keep - len(self.last_dropped), 0)])

    def _collect_sync(self, need: int, counts: Counter) -> list[list[Sample]]:
        groups: list[list[Sample]] = []
        rounds = 0
        while len(groups) < need and rounds <= self.cfg.max_refill_rounds:
            missing = need - len(groups)
            samples = self.rollout(self.draw_prompts(max(missing, math.ceil(missing * self.cfg.over_sample))),
                                   self.cfg.n_samples_per_prompt, counts)
            groups.extend(self._accept(samples, counts))
            rounds += 1
            if not self.cfg.dynamic_sampling and not implementers(self.trainer, "on_rollout_samples"):
                break
        counts["refill_rounds"] = rounds - 1
        return groups

    # ----------------------------------------------------------------- async
    def _collect_async(self, need: int, counts: Counter) -> list[list[Sample]]:
        producer = self._ensure_producer()
        groups: list[list[Sample]] = []
        while len(groups) < need:
            if self._pending:
                with self.stream.lock:
                    group = self._pending.pop(0)
            else:
                group = producer.get(timeout=0.5)
                if group is None:
                    continue
            groups.extend(self._accept(group, counts))
        counts.update(producer.take_counts())
        counts.update(self._pending_counts)
        self._pending_counts = Counter()
        return groups

    def _ensure_producer(self) -> AsyncProducer:
        if self._producer is None or not self._producer.alive:
            self._producer = AsyncProducer(
                self.stream, self._produce,
                self.cfg.rollout_batch_size, self.cfg.queue_size, self.totals)
        return self._producer

    def _produce(self, prompts: list[Prompt], counts: Counter, locked: Callable[[], None] = lambda: None
                 ) -> list[Sample]:
        with self.generation_lock:
            locked()  # the producer's `settle` may return: a weight push now waits for this batch
            return self.rollout(prompts, self.cfg.n_samples_per_prompt, counts)

    @contextmanager
    def weight_update_point(self) -> Iterator[None]:
        """Where a weight push lands (WeightSync). With `deterministic` (trainer.deterministic=true) and an
        async producer: after the producer has started every batch its free slots allow and finished
        generating it, so every batch is generated by one policy version, fixed by how many groups training
        has taken; otherwise at once, between two decode steps of whatever is in flight."""
        producer = self._producer
        if not self.deterministic or producer is None:
            yield
            return
        producer.settle()
        with self.generation_lock:
            yield

    def stop_producer(self) -> None:
        """Stop the producer; whatever it produced and nobody trained on is counted as dropped/shutdown."""
        if self._producer is not None:
            self._producer.stop()
            self._producer = None

    def teardown(self, stage: str) -> None:
        self.stop_producer()
        self._close_reward()

    def close(self) -> None:
        """Stop the producer and release the engine and the reward's workers."""
        self.stop_producer()
        self._close_reward()
        self.engine.close()

    def _close_reward(self) -> None:
        if isinstance(self.reward_fn, RewardRunner):  # its worker threads / processes (started again when needed)
            self.reward_fn.close()

    # ----------------------------------------------------------------- evaluation
    def eval_prompts(self, name: str = evaluation.DEFAULT_SET) -> list[Prompt]:
        """The prompts of one held-out set (none when the set does not exist)."""
        s = self.eval_sets.get(name)
        return s.prompts() if s is not None else []

    @contextmanager
    def engine_aside(self) -> Iterator[RolloutEngine]:
        """The rollout engine for a trainer-side use outside the rollout (a probe, an evaluation): held
        under the generation lock, so it never runs beside an asynchronous rollout's generation. The
        caller passes its own seeds (never the engine's training seed stream)."""
        with self.generation_lock:
            yield self.engine

    def evaluate(self, engine: RolloutEngine | None = None, sets: list[str] | None = None,
                 prefix: str = "eval", select: Callable[[Prompt], bool] | None = None,
                 interrupt: Callable[[], None] | None = None) -> dict[str, float]:
        """Evaluate `engine` (default: the rollout engine) on the named held-out sets (default: all) with
        `eval.k` samples per prompt and a greedy answer (`glmlight.data.evaluation`); the metrics are
        named `<prefix>/<set>/<metric>`; `select` keeps only the prompts it accepts; `interrupt` is called
        before every generation and may raise to stop. Draws from no training seed or id stream."""
        chosen = {n: s for n, s in self.eval_sets.items() if sets is None or n in sets}
        with self.engine_aside() as own:
            out = evaluation.evaluate(self, own if engine is None else engine, chosen, self.eval_cfg, prefix, select,
                                      interrupt)
        for name in chosen:
            if f"{prefix}/{name}/prompts" in out and self.eval_overlap.get(name) is not None:
                out[f"{prefix}/{name}/overlap"] = float(self.eval_overlap[name])
        return out


class _ExperienceStream(IterableDataset):
    """An endless stream of Experience batches, generated when the training step asks."""

    def __init__(self, dm: RolloutDataModule):
        self.dm = dm

    def __iter__(self) -> Iterator[Experience]:
        while True:
            yield self.dm.next_experience()
