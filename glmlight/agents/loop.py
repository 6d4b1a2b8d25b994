"""The agent loop: token in, token out, over many turns.

Each turn the engine continues the episode's exact context; its output ids are
appended as they are (loss_mask 1, with their rollout log-probs and versions),
then only the environment's new observation is tokenized with the chat template
and appended (loss_mask 0, log-prob 0, version -1). Nothing already in the
context is ever re-tokenized. Episodes of a batch advance turn by turn together,
so each turn is one batched engine call.

The episode keeps the conversation beside its ids (`Episode.conversation`: the opening messages, each sampled
turn's text as an assistant turn, each observation), and every context the engine continues is the chat
template's rendering of it: after each turn the spliced ids are checked against the template's text of the
conversation (`glmlight.models.tokenizer.extend_to_rendering`, as the agent gateway checks its turns). Where the
rendering continues the segment's text, the splice (or the rendering's rest) extends it; where the template renders
an earlier turn otherwise than the segment holds it (GLM-4.5's template drops the reasoning of turns before the
last user turn, GLM-4.7's renders a turn without kept reasoning as `</think>` alone, a turn ended with a stop token
the template does not put there), the segment is closed and a new one starts whose prompt is the template's
rendering (`Episode.new_segment`: the earlier actions are context there, loss mask 0; they were trained on, as
sampled, in the segment that sampled them). Such turns are counted (`env/rewrites`, `rollout/env_rewrites`);
each segment is a sample of its own (docs/agents.md, segments).

An observation's ids are what the template renders after an assistant turn
(`glmlight.models.tokenizer.spliced_turns`): a default system prompt or BOS the template puts at
the start of a conversation is not repeated. Before them comes what closes the sampled turn (the
template's closing: ChatML's `<|im_end|>` and newline, nothing in GLM-4.5's template). When the model
ended its turn with the first of these tokens (ChatML's `<|im_end|>`; in GLM-4.5's template the next
turn's role marker, `<|observation|>` or `<|user|>`), that token is not rendered again; a turn cut by
max_new_tokens gets all of them (`glmlight.models.tokenizer.splice_after_action`). The observation's
role is `task.agent.observation_role` (`auto` by default: see `glmlight.agents.observation_role`).

Replay records (`Sample.routed_experts` / `.indexer_topk`), when the engine returns them: each turn's
records cover the whole context it ran; a position keeps the record of the turn that ran it first
(what a prefix-caching server reports too), so an action's record is the one it was produced with.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from glmlight.agents.env import Environment, step_result_problem
from glmlight.agents.observation_role import resolve_observation_role
from glmlight.errors import DataError
from glmlight.models.tokenizer import (assistant_closing, encode_chat, extend_to_rendering, rendered_text,
                                       splice_after_action, spliced_turns)
from glmlight.prompt import Prompt
from glmlight.engines.base import Generation, RolloutEngine, SamplingParams
from glmlight.sample import Sample, Status

log = logging.getLogger(__name__)


def encode_observation(tokenizer: Any, text: str, role: str = "observation",
                       closing: list[int] | None = None) -> list[int]:
    """The ids of one observation (or user) turn as the chat template renders it after an assistant turn,
    without the assistant's generation prompt (`closing`: `assistant_closing(tokenizer)`, if known)."""
    closing = assistant_closing(tokenizer) if closing is None else closing
    return spliced_turns(tokenizer, [{"role": role, "content": text}], closing)


def generation_prompt(tokenizer: Any) -> list[int]:
    """The ids that open an assistant turn (what add_generation_prompt appends)."""
    probe = [{"role": "user", "content": "x"}]
    with_prompt = encode_chat(tokenizer, probe, add_generation_prompt=True)
    without = encode_chat(tokenizer, probe, add_generation_prompt=False)
    if with_prompt[: len(without)] != without:
        raise ValueError("the chat template's generation prompt is not a suffix; cannot splice turns")
    return with_prompt[len(without):]


_REASONING = re.compile(r"^\s*<think>.*?</think>\s*", re.S)


def without_reasoning(text: str) -> str:
    """What the environment acts on: the action's text less a leading `<think>...</think>` block and the
    whitespace around it (a GLM-4.5 model opens every answer with one, empty when it does not reason). The
    trained tokens are the action as sampled, reasoning included."""
    return _REASONING.sub("", text, count=1)


@dataclass
class Episode:
    prompt: Prompt
    env: Environment
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    reward: float = 0.0
    turns: int = 0
    done: bool = False
    status: Status = Status.COMPLETED
    error: str | None = None
    info: dict[str, Any] = field(default_factory=dict)
    messages: list[dict[str, str]] = field(default_factory=list)  # the opening messages
    conversation: list[dict[str, str]] = field(default_factory=list)  # what the current segment's ids render
    steps: list[tuple[list[int], list[int]]] = field(default_factory=list)  # (action ids, observation ids)
    awaiting_prompt: bool = False  # the context ends with an observation: open an assistant turn first
    segments: list["Segment"] = field(default_factory=list)  # closed segments (context compaction)
    action_lengths: list[int] = field(default_factory=list)  # tokens of each action turn (max_new_tokens bounds each)
    summary_lengths: list[int] = field(default_factory=list)  # tokens of each summary (context compaction), in order
    routed_experts: Any = None  # replay records of the current segment (module docstring)
    indexer_topk: Any = None
    records_lost: bool = False  # a turn came without the records the others have: the segment has none
    record_turns: int = 0  # turns of the current segment whose records were added
    turn_rewards: list[tuple[int, float]] = field(default_factory=list)  # (response index of the turn's last
    # action token, the environment's reward for that turn) in the current segment; algo.reward_placement=turns

    @property
    def context(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    def add_action(self, g: Generation) -> None:
        self.response_ids += g.token_ids
        self.loss_mask += [1] * len(g.token_ids)
        self.logprobs += g.logprobs
        self.versions += g.versions
        self.add_records(g)

    def add_records(self, g: Generation) -> None:
        """Extend the segment's replay records by the positions `g`'s turn ran first."""
        new, old = (g.routed_experts, g.indexer_topk), (self.routed_experts, self.indexer_topk)
        self.record_turns += 1
        if self.record_turns == 1:
            self.routed_experts, self.indexer_topk = new
        elif self.records_lost or [r is None for r in new] != [r is None for r in old]:
            self.records_lost, self.routed_experts, self.indexer_topk = True, None, None
        else:
            self.routed_experts, self.indexer_topk = (
                o if n is None or len(n) <= len(o) else torch.cat([o, n[len(o):]]) for o, n in zip(old, new))

    def add_observation(self, ids: list[int]) -> None:
        self.response_ids += ids
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)

    def finish(self, status: Status, error: str | None = None) -> None:
        self.done, self.status, self.error = True, status, error

    def new_segment(self, prompt_ids: list[int]) -> bool:
        """Close the current segment (kept when it holds an action) and start one whose prompt is `prompt_ids`
        (a rewritten history, a compacted context); whether the closed one was kept."""
        kept = any(self.loss_mask)
        if kept:
            self.segments.append(Segment(self.prompt_ids, self.response_ids, self.loss_mask, self.logprobs,
                                         self.versions, self.routed_experts, self.indexer_topk, self.turn_rewards))
        self.prompt_ids, self.response_ids, self.loss_mask = list(prompt_ids), [], []
        self.logprobs, self.versions = [], []
        self.routed_experts = self.indexer_topk = None  # the new segment's records start with its prompt
        self.turn_rewards, self.records_lost, self.record_turns = [], False, 0
        return kept


@dataclass
class Segment:
    """A closed part of an episode (compacted, or rewritten by the chat template): its own prompt and response
    (TITO, as produced)."""

    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    versions: list[int]
    routed_experts: Any = None  # replay records (Episode)
    indexer_topk: Any = None
    turn_rewards: list[tuple[int, float]] = field(default_factory=list)  # (Episode.turn_rewards)


class AgentLoop:
    def __init__(self, engine: RolloutEngine, tokenizer: Any, env_factory: Callable[[], Environment],
                 params: Callable[[int], SamplingParams], max_turns: int = 4, max_context: int = 2048,
                 observation_role: str = "auto"):
        """`params(context_len)` gives the sampling params of one turn (its max_new_tokens
        already bounded by the remaining context budget). An `observation_role` the chat template
        renders nothing of is a ConfigError (`glmlight.agents.observation_role`)."""
        self.engine, self.tokenizer, self.env_factory = engine, tokenizer, env_factory
        self.params, self.max_turns, self.max_context = params, max_turns, max_context
        self.observation_role = resolve_observation_role(tokenizer, observation_role)
        self.gen_prompt = generation_prompt(tokenizer)
        self.closing = assistant_closing(tokenizer)
        self.stop_ids = set(self.params(0).stop_token_ids)

    def start(self, prompt: Prompt) -> Episode:
        env = self.env_factory()
        ep = Episode(prompt=prompt, env=env, prompt_ids=[])
        try:
            ep.messages = env.reset(prompt)
            if not isinstance(ep.messages, list):
                raise TypeError(f"reset returned {type(ep.messages).__name__}, expected a list of "
                                "{role, content} messages")
            ep.prompt_ids = encode_chat(self.tokenizer, ep.messages, add_generation_prompt=True)
            ep.conversation = list(ep.messages)
        except Exception as e:  # noqa: BLE001 - an environment crash fails the sample, not the run
            ep.prompt_ids = [self.tokenizer.eos_token_id]
            ep.finish(Status.FAILED, f"reset: {type(e).__name__}: {e}")
        return ep

    def run(self, prompts: list[Prompt], n: int = 1) -> list[Episode]:
        episodes = [self.start(p) for p in prompts for _ in range(n)]
        while True:
            active = [e for e in episodes if not e.done]
            self.before_turn(active)
            for e in active:
                if not e.done and e.awaiting_prompt:
                    e.add_observation(self.gen_prompt)
                    e.awaiting_prompt = False
                if not e.done and self.max_context - len(e.context) < 1:
                    e.finish(Status.TRUNCATED)
            active = [e for e in active if not e.done]
            if not active:
                return episodes
            gens = self.engine.generate([e.context for e in active], [self.params(len(e.context)) for e in active])
            for e, g in zip(active, gens):
                self.advance(e, g)

    def before_turn(self, active: list[Episode]) -> None:
        """Called before each batched turn (context compaction hooks in here)."""

    def advance(self, ep: Episode, g: Generation) -> None:
        """One turn: the action goes in as produced; the environment answers."""
        if g.finish_reason == "error":
            ep.finish(Status.FAILED, "engine failed after retries")
            return
        ep.add_action(g)
        ep.turns += 1
        ep.action_lengths.append(len(g.token_ids))
        if g.finish_reason == "abort":
            ep.finish(Status.ABORTED)
            return
        action = self.tokenizer.decode(g.token_ids, skip_special_tokens=True)
        try:
            result = ep.env.step(without_reasoning(action))
        except Exception as e:  # noqa: BLE001
            ep.finish(Status.FAILED, f"step: {type(e).__name__}: {e}")
            log.warning("environment crashed: %s: %s", type(e).__name__, e)
            return
        problem = step_result_problem(result)
        if problem is not None:  # a malformed answer fails this episode (counted), never the run
            ep.finish(Status.FAILED, f"step: {problem}")
            log.warning("environment %s: %s", type(ep.env).__name__, problem)
            return
        ep.reward += float(result.reward)
        if result.reward and g.token_ids:  # paid for this turn: on its last action token (reward_placement=turns)
            ep.turn_rewards.append((len(ep.response_ids) - 1, float(result.reward)))
        ep.info.update(result.info)
        if result.done:
            ep.finish(Status.COMPLETED)
        elif ep.turns >= self.max_turns:
            ep.finish(Status.TRUNCATED)
        else:
            new = [{"role": "assistant", "content": action},
                   {"role": self.observation_role, "content": result.observation or ""}]
            try:
                obs = splice_after_action(g.token_ids, self.stop_ids, self.closing + encode_observation(
                    self.tokenizer, result.observation or "", self.observation_role, self.closing))
                ids, segment = self.extension(ep, new, obs + self.gen_prompt)
            except DataError as e:  # e.g. characters the tokenizer has no token for
                ep.finish(Status.FAILED, f"step: observation: {e}")
                log.warning("environment %s: observation cannot be encoded: %s", type(ep.env).__name__, e)
                return
            if (len(ids) if segment else len(ep.context) + len(ids)) >= self.max_context:
                ep.finish(Status.TRUNCATED)
                return
            # the next turn's opening goes in when it is taken (context compaction puts its request before it)
            ep.awaiting_prompt = ids[len(ids) - len(self.gen_prompt):] == self.gen_prompt
            body = ids[:len(ids) - len(self.gen_prompt)] if ep.awaiting_prompt else ids
            self.take(ep, new, body, segment)
            ep.steps.append((list(g.token_ids), obs if segment else body))

    def extension(self, ep: Episode, new: list[dict[str, str]], spliced: list[int]) -> tuple[list[int], bool]:
        """(ids, whether they open a new segment): the ids that take the episode's context to the chat template's
        rendering of its conversation followed by `new`, up to the next assistant turn's opening (`spliced`, the
        ids spliced after the context, or the rendering's rest), or, where the template renders the conversation
        otherwise than the context holds it, that whole rendering: a new segment's prompt. DataError when the
        template cannot render or the tokenizer cannot encode the conversation."""
        messages = ep.conversation + new
        ids = extend_to_rendering(self.tokenizer, ep.context, spliced, rendered_text(self.tokenizer, messages))
        if ids is not None:
            return ids, False
        return encode_chat(self.tokenizer, messages, add_generation_prompt=True), True

    def take(self, ep: Episode, new: list[dict[str, str]], ids: list[int], segment: bool) -> None:
        """Extend the episode's conversation by `new` and its context by `ids`, or open a new segment whose
        prompt is `ids` (counted: `env/rewrites`)."""
        ep.conversation = ep.conversation + new
        if not segment:
            ep.add_observation(ids)
            return
        ep.new_segment(ids)
        ep.info["rewrites"] = ep.info.get("rewrites", 0) + 1


def episode_to_samples(ep: Episode, group_id: int, rollout_id: int) -> list[Sample]:
    """One Sample per segment (one for an uncompacted episode); all share the rollout id,
    the terminal reward and the status of the episode."""
    meta = {**ep.prompt.metadata, "label": ep.prompt.label, "domain": ep.prompt.domain, "turns": ep.turns,
            **{f"env/{k}": v for k, v in ep.info.items()}, "num_segments": len(ep.segments) + 1,
            "action_lengths": list(ep.action_lengths), "summary_lengths": list(ep.summary_lengths)}
    if ep.error:
        meta["env_error"] = ep.error
    parts = ep.segments + [Segment(ep.prompt_ids, ep.response_ids, ep.loss_mask, ep.logprobs, ep.versions,
                                   ep.routed_experts, ep.indexer_topk, ep.turn_rewards)]
    reward = None if ep.status is Status.FAILED else ep.reward
    return [Sample(prompt_ids=p.prompt_ids, response_ids=p.response_ids, loss_mask=p.loss_mask,
                   rollout_logprobs=p.logprobs, versions=p.versions, reward=reward, status=ep.status,
                   group_id=group_id, rollout_id=rollout_id, segment=i,
                   metadata={**meta, "turn_rewards": [list(t) for t in p.turn_rewards]},
                   routed_experts=p.routed_experts, indexer_topk=p.indexer_topk)
            for i, p in enumerate(parts)]
