"""Expert episodes for the format warm start of agent tasks.

An environment that knows how its task is solved has `expert(messages,
summarize)`: the text of the next action (or, when the context-compaction loop
asks for one, of the summary), read off the conversation so far. `ExpertEngine`
is a RolloutEngine that answers every call with the expert's text, tokenized as
a policy emits it (the text's ids, then the token that ends an action under the
chat template: `action_end`). The episodes come out of the
task's own RolloutDataModule, so the warm start trains on exactly the token
layout RL later produces: chat template, observation splicing, the summary
request and resume prompt of compaction, the per-turn and context budgets.
Only action tokens (loss_mask 1: tool calls, answers, summaries) are trained on;
prompts and observations are context. An expert none of whose episodes of a batch has an action
(all failed: an agent that crashes, a request the gateway refuses, a prompt over the context) stops
the warm start with one line counting the failures by reason.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
from collections import Counter
from typing import Any, Callable

from glmlight.prompt import Prompt
from glmlight.models.warm_start import Example, ExampleFn
from glmlight.engines.base import Generation, SamplingParams, normalize_requests
from glmlight.sample import Status

log = logging.getLogger(__name__)

Expert = Callable[[list[dict[str, str]], bool], str]
_ROLE = re.compile(r"<\|(system|user|assistant|observation)\|>")
_CHATML_TURN = re.compile(r"<\|im_start\|>(\w+)\n(.*?)(?:<\|im_end\|>\n?|$)", re.S)
_THINK = re.compile(r"<think>.*?</think>", re.S)
_TOOL_RESPONSE = re.compile(r"<tool_response>(.*?)</tool_response>", re.S)


def parse_transcript(text: str, eos_token: str = "<eos>") -> list[dict[str, str]]:
    """The messages of a context rendered with a GLM-style template (role marker + content) or with
    ChatML (`<|im_start|>role\ncontent<|im_end|>`, e.g. SmolLM2's), the open assistant turn at the
    end left out."""
    if "<|im_start|>" in text:
        messages = [{"role": r, "content": c} for r, c in _CHATML_TURN.findall(text)]
    else:
        parts = _ROLE.split(text)
        messages = []
        for role, content in zip(parts[1::2], parts[2::2]):
            if role == "assistant" and content.endswith(eos_token):
                content = content[: -len(eos_token)]
            if "[gMASK]" in text:  # GLM-4.5's template: what it wraps a turn's text in
                content = _glm_content(role, content)
            messages.append({"role": role, "content": content})
    if messages and messages[-1]["role"] == "assistant" and not messages[-1]["content"]:
        messages.pop()
    return messages


def _glm_content(role: str, content: str) -> str:
    """A turn's text as GLM-4.5's template renders it, less the template's own wrapping: the newline after the
    role marker, an assistant turn's `<think>...</think>` (reasoning is not the action's text) and a tool
    result's `<tool_response>` tags."""
    if role == "assistant":
        content = _THINK.sub("", content)
    elif role == "observation":
        responses = _TOOL_RESPONSE.findall(content)
        content = "\n".join(r.strip() for r in responses) if responses else content
    return content.strip("\n")


def action_end(tokenizer: Any, observation_role: str | None = None) -> int:
    """The token a policy ends an action with under its chat template: the end-of-turn token of a template that
    closes an assistant turn with one (<eos>, ChatML's <|im_end|>), or for one that closes it with nothing
    (GLM-4.5's: the model samples the next turn's role marker) the marker of the observation turn that follows
    a tool call (`observation_role`, `glmlight.agents.observation_role`). A GLM model ends a final answer with
    `<|user|>` or `<|endoftext|>` instead; an expert's answer ends as its tool calls do (both are stop tokens,
    and an answer's reward reads its text)."""
    from glmlight.models.tokenizer import assistant_closing, spliced_turns

    closing = assistant_closing(tokenizer)
    if closing or not observation_role:
        return tokenizer.eos_token_id
    return spliced_turns(tokenizer, [{"role": observation_role, "content": "x"}], closing)[0]


def assistant_opening(tokenizer: Any) -> str:
    """The text a chat template puts at the start of an assistant turn's content, after the generation prompt
    (GLM-4.5's: `\n<think></think>\n`, an answer without reasoning; glmlight's own and ChatML: nothing): what
    a model of this template writes before its action."""
    probe = "Q7#"
    asked = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=True,
                                          tokenize=False)
    full = tokenizer.apply_chat_template([{"role": "user", "content": "x"}, {"role": "assistant", "content": probe}],
                                         add_generation_prompt=False, tokenize=False)
    if not full.startswith(asked) or probe not in full[len(asked):]:
        return ""
    return full[len(asked):full.index(probe, len(asked))]


class ExpertEngine:
    """A RolloutEngine whose every answer is `expert(messages, summarize)` between what the template opens an
    assistant turn's content with (`assistant_opening`) and the template's end of an action (`action_end`), cut
    at max_new_tokens."""

    def __init__(self, tokenizer: Any, expert: Expert, summary_prompt: str | None = None,
                 observation_role: str | None = None):
        self.tokenizer, self.expert, self.summary_prompt = tokenizer, expert, summary_prompt
        self.end = action_end(tokenizer, observation_role)
        self.opening = assistant_opening(tokenizer)
        self.version = 0

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[Generation]:
        out = []
        for ctx, p in zip(prompts, normalize_requests(prompts, params)):
            messages = parse_transcript(self.tokenizer.decode(ctx, skip_special_tokens=False),
                                        self.tokenizer.eos_token)
            summarize = (self.summary_prompt is not None and bool(messages) and messages[-1]["role"] == "user"
                         and messages[-1]["content"] == self.summary_prompt)
            text = self.expert(messages, summarize)
            ids = self.tokenizer(self.opening + text, add_special_tokens=False)["input_ids"] + [self.end]
            reason = "stop"
            if len(ids) > p.max_new_tokens:
                ids, reason = ids[: p.max_new_tokens], "length"
            out.append(Generation(ids, [0.0] * len(ids), reason, [0] * len(ids)))
        return out

    def score(self, prompts: list[list[int]], completions: list[list[int]]) -> list[list[float]]:
        raise NotImplementedError("the expert engine only generates")

    def update_weights(self, named_tensors=None, *, path=None, version: int) -> None:
        self.version = version

    def close(self) -> None:
        pass


def env_experts(env_factory: Callable[[], Any] | None) -> list[tuple[Expert, float]]:
    """The demonstrations of the task's environment: `experts()` (expert, episodes per prompt) pairs, or
    its `expert` once per prompt; none when it has neither."""
    if env_factory is None:
        return []
    env = env_factory()
    if callable(getattr(env, "experts", None)):
        return list(env.experts())
    expert = getattr(env, "expert", None)
    return [(expert, 1.0)] if callable(expert) else []


def _share(prompt: Prompt, k: int) -> float:
    """A number in [0, 1) fixed by the prompt's messages and k (the same on every machine)."""
    blob = json.dumps([prompt.messages, k], sort_keys=True).encode()
    return int.from_bytes(hashlib.sha1(blob).digest()[:8], "big") / 2**64


def expert_examples(make_datamodule: Callable[[Any], Any], tokenizer: Any, experts: list[tuple[Expert, float]],
                    summary_prompt: str | None = None, observation_role: str | None = None) -> ExampleFn:
    """Training rows from expert episodes: each segment's prompt (mask 0) + response (its loss_mask).

    `experts` pairs an expert with how many of its episodes each prompt gets on average (1.5: one,
    and a second for half of the prompts, chosen by a hash of the prompt). `make_datamodule(engine)`
    builds the task's RolloutDataModule around an engine."""
    dms = [(make_datamodule(ExpertEngine(tokenizer, fn, summary_prompt, observation_role)), rate)
           for fn, rate in experts]
    noted = []

    def make(prompts: list[Prompt]) -> list[Example]:
        rows = []
        for n, (dm, rate) in enumerate(dms):
            chosen = [p for k in range(math.ceil(rate)) for p in prompts if _share(p, k) < rate - k]
            if not chosen:
                continue
            samples = dm.rollout(chosen, 1, Counter())
            if len(noted) <= n:
                noted.append(True)
                _note(samples, n)
            kept = [(list(s.prompt_ids) + list(s.response_ids), [0] * len(s.prompt_ids) + list(s.loss_mask))
                    for s in samples if s.status is not Status.FAILED and s.num_action_tokens]
            if not kept:
                raise RuntimeError(f"warm start: none of expert {n}'s {len(chosen)} episodes has an action to train on "
                                   f"({_failures(samples)})")
            rows += kept
        return rows

    return make


def _failures(samples: list[Any]) -> str:
    """Why episodes gave nothing to train on, counted by reason, with the most common reason's first message."""
    episodes = list({s.rollout_id: s for s in samples}.values())
    reasons = Counter(s.metadata.get("failure") or ("failed" if s.status is Status.FAILED else "no action tokens")
                      for s in episodes)
    top = reasons.most_common(1)[0][0] if reasons else None
    example = next((s.metadata["env_error"] for s in episodes
                    if s.metadata.get("failure") == top and s.metadata.get("env_error")), None)
    text = ", ".join(f"{k}: {v}" for k, v in reasons.most_common())
    return text + (f"; e.g. {str(example)[:300]}" if example else "")


def _note(samples: list[Any], n: int) -> None:
    episodes = list({s.rollout_id: s for s in samples}.values())
    solved = sum(s.reward is not None and s.reward >= 1.0 for s in episodes) / max(len(episodes), 1)
    truncated = sum(s.status is Status.TRUNCATED for s in episodes) / max(len(episodes), 1)
    log.info("expert %d: %d episodes in the first batch, %.0f%% solved, %.0f%% truncated, %.1f segments each, "
             "%d action tokens", n, len(episodes), 100 * solved, 100 * truncated,
             len(samples) / max(len(episodes), 1), sum(s.num_action_tokens for s in samples))
